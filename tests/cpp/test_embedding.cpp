// wide::embedding / embedding_renorm_ / embedding_bag (public C++ API, through the dispatcher),
// against references written with plain ATen calls per member: at::embedding(weight[n], indices[n], ...),
// at::embedding_renorm_ on weight[n], at::embedding_bag(weight[n], indices[n], offsets[n], ...).
// Embeddings are N-first in and out. Gradients are compared too: the op's padding_idx handling
// (Note [wide embeddings]) changes only what flows back, not the forward value.
#include <ATen/ops/allclose.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/embedding.h>
#include <ATen/ops/embedding_bag.h>
#include <ATen/ops/embedding_renorm.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/randn_like.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "wide/ops/embedding.h"
#include "wide_test_utils.h"

namespace {

using namespace wide_test;

constexpr int64_t kN = 3, kV = 6, kD = 4, kPad = 2;

// Random indices [N, *member_shape] (or one [*member_shape] expanded with stride 0 when shared)
// whose first column is kPad and whose second repeats the third, so padding rows and repeated
// rows (scale_grad_by_freq) always occur.
at::Tensor make_indices(bool shared, Ints member_shape, at::ScalarType dtype = at::kLong) {
  Ints shape = member_shape;
  shape.insert(shape.begin(), shared ? 1 : kN);
  at::Tensor idx = at::randint(kV, shape, at::TensorOptions().dtype(dtype));
  idx.select(-1, 0).fill_(kPad);
  idx.select(-1, 1).copy_(idx.select(-1, 2));
  if (!shared) return idx;
  shape[0] = kN;
  return idx.expand(shape);
}

at::Tensor leaf_weight() { return at::randn({kN, kV, kD}, f64()).requires_grad_(true); }

// An int64 tensor holding `values`.
at::Tensor longs(const Ints& values) { return at::tensor(at::IntArrayRef(values)); }

// A fresh leaf with w's values, for the reference's own gradient.
at::Tensor leaf_copy(const at::Tensor& w) { return w.detach().clone().requires_grad_(true); }

// --- embedding -------------------------------------------------------------------------------------

// shared indices, padding_idx, index dtype
using EmbeddingCase = std::tuple<bool, int64_t, at::ScalarType>;

class WideEmbeddingTest : public ::testing::TestWithParam<EmbeddingCase> {};

TEST_P(WideEmbeddingTest, MatchesPerMemberReferenceWithGradients) {
  const auto& [shared, padding_idx, dtype] = GetParam();
  const at::Tensor idx = make_indices(shared, {2, 5}, dtype);
  for (bool scale_grad : {false, true}) {
    SCOPED_TRACE("scale_grad_by_freq=" + std::to_string(scale_grad));
    const at::Tensor w = leaf_weight();
    const at::Tensor got = wide::embedding(w, idx, padding_idx, scale_grad);
    const at::Tensor w_ref = leaf_copy(w);
    std::vector<at::Tensor> outs;
    for (int64_t n = 0; n < kN; ++n) {
      outs.push_back(at::embedding(w_ref.select(0, n), idx[n], padding_idx, scale_grad, false));
    }
    const at::Tensor want = at::stack(outs);
    WIDE_EXPECT_CLOSE(got, want);

    const at::Tensor g = at::randn_like(want);
    got.backward(g);
    want.backward(g);
    WIDE_EXPECT_CLOSE(w.grad(), w_ref.grad());
    if (padding_idx >= 0) {
      EXPECT_EQ(w.grad().select(1, padding_idx).abs().sum().item<double>(), 0.0) << "padding rows got a gradient";
    }
  }
}

std::string embedding_case_name(const ::testing::TestParamInfo<EmbeddingCase>& info) {
  const auto& [shared, pad, dtype] = info.param;
  return std::string(shared ? "shared" : "nfirst") + (pad >= 0 ? "_pad" : "_nopad") +
         (dtype == at::kLong ? "_long" : "_int");
}

INSTANTIATE_TEST_SUITE_P(Grid, WideEmbeddingTest,
                         ::testing::Combine(::testing::Bool(), ::testing::Values<int64_t>(-1, kPad),
                                            ::testing::Values(at::kLong, at::kInt)),
                         embedding_case_name);

// --- embedding_renorm_ -----------------------------------------------------------------------------

TEST(WideEmbedding, RenormMatchesPerMemberReference) {
  for (bool contiguous : {true, false}) {
    for (bool shared : {false, true}) {
      SCOPED_TRACE("contiguous=" + std::to_string(contiguous) + " shared=" + std::to_string(shared));
      // Rows of norm ~6 against max_norm 1.5; 4 indices into 6 rows leave some rows untouched.
      at::Tensor w = contiguous ? at::randn({kN, kV, kD}, f64()).mul(3)
                                : at::randn({kN, kD, kV}, f64()).mul(3).transpose(1, 2);
      ASSERT_EQ(w.is_contiguous(), contiguous);
      const at::Tensor idx = shared ? longs({0, 3, 3, 5}).expand({kN, 4})
                                    : longs({0, 3, 3, 5, 1, 1, 2, 4, 5, 5, 5, 0}).view({kN, 4});
      const at::Tensor before = w.clone();
      at::Tensor want = w.clone();
      for (int64_t n = 0; n < kN; ++n) {
        at::Tensor table = want.select(0, n);
        at::embedding_renorm_(table, idx[n], 1.5, 2.0);
      }
      at::Tensor& out = wide::embedding_renorm_(w, idx, 1.5, 2.0);
      EXPECT_TRUE(out.is_same(w)) << "embedding_renorm_ must return its (in-place) argument";
      WIDE_EXPECT_CLOSE(w, want);
      EXPECT_FALSE(at::equal(w, before)) << "nothing was renormalised: the test cannot fail";
    }
  }
}

// --- embedding_bag ---------------------------------------------------------------------------------

enum class Offsets { None, Shared, PerMember };

// mode (0 sum, 1 mean, 2 max), offsets form
using BagCase = std::tuple<int64_t, Offsets>;

class WideEmbeddingBagTest : public ::testing::TestWithParam<BagCase> {};

TEST_P(WideEmbeddingBagTest, MatchesPerMemberReferenceWithGradients) {
  const auto& [mode, offsets_kind] = GetParam();
  const int64_t bags = 3, len = 4, total = 7;
  for (bool shared : {false, true}) {
    for (int64_t padding_idx : {int64_t{-1}, kPad}) {
      for (bool last_offset : {false, true}) {
        for (bool weighted : {false, true}) {
          if (last_offset && offsets_kind == Offsets::None) continue;
          if (weighted && mode != 0) continue;  // per_sample_weights: sum mode only
          SCOPED_TRACE("shared=" + std::to_string(shared) + " padding_idx=" + std::to_string(padding_idx) +
                       " include_last_offset=" + std::to_string(last_offset) + " weighted=" + std::to_string(weighted));
          // None: fixed bags [N, B, L]; else indices [N, T] with offsets [B(+1)] or [N, B(+1)]
          // (with an empty bag in the middle, and member 2's last bag empty).
          const at::Tensor idx = make_indices(shared, offsets_kind == Offsets::None ? Ints{bags, len} : Ints{total});
          OptT offsets;
          if (offsets_kind == Offsets::Shared) {
            offsets = last_offset ? longs({0, 2, 2, total}) : longs({0, 2, 2});
          } else if (offsets_kind == Offsets::PerMember) {
            offsets = last_offset ? longs({0, 2, 2, total, 0, 1, 5, total, 0, 3, total, total}).view({kN, 4})
                                  : longs({0, 2, 2, 0, 1, 5, 0, 3, total}).view({kN, 3});
          }
          const OptT psw = weighted ? OptT(at::randn(idx.sizes(), f64())) : std::nullopt;
          const std::optional<int64_t> pad = padding_idx >= 0 ? std::optional<int64_t>(padding_idx) : std::nullopt;

          const at::Tensor w = leaf_weight();
          const at::Tensor got =
              wide::embedding_bag(w, idx, offsets, false, mode, false, psw, last_offset, padding_idx);
          const at::Tensor w_ref = leaf_copy(w);
          std::vector<at::Tensor> outs;
          for (int64_t n = 0; n < kN; ++n) {
            at::Tensor member_idx = idx[n], member_off;
            OptT member_psw = member(psw, n);
            if (offsets_kind == Offsets::None) {  // as F.embedding_bag does for 2-d input
              member_idx = member_idx.reshape({-1});
              member_off = at::arange(0, bags * len, len, at::kLong);
              if (member_psw) member_psw = member_psw->reshape({-1});
            } else {
              member_off = offsets->dim() == 1 ? *offsets : (*offsets)[n];
            }
            outs.push_back(std::get<0>(at::embedding_bag(w_ref.select(0, n), member_idx, member_off, false, mode,
                                                         false, member_psw, last_offset, pad)));
          }
          const at::Tensor want = at::stack(outs);
          ASSERT_EQ(want.sizes(), (Ints{kN, bags, kD}));
          WIDE_EXPECT_CLOSE(got, want);

          const at::Tensor g = at::randn_like(want);
          got.backward(g);
          want.backward(g);
          WIDE_EXPECT_CLOSE(w.grad(), w_ref.grad());
        }
      }
    }
  }
}

std::string bag_case_name(const ::testing::TestParamInfo<BagCase>& info) {
  const auto& [mode, kind] = info.param;
  const char* modes[] = {"sum", "mean", "max"};
  const char* kinds[] = {"fixed_length", "shared_offsets", "per_member_offsets"};
  return std::string(modes[mode]) + "_" + kinds[static_cast<int>(kind)];
}

INSTANTIATE_TEST_SUITE_P(Grid, WideEmbeddingBagTest,
                         ::testing::Combine(::testing::Values<int64_t>(0, 1, 2),
                                            ::testing::Values(Offsets::None, Offsets::Shared, Offsets::PerMember)),
                         bag_case_name);

TEST(WideEmbedding, IntIndicesEmptyAndCppApi) {
  const at::Tensor w = at::randn({kN, kV, kD}, f64());
  // int32 indices with int64 offsets, as ATen accepts.
  const at::Tensor idx = make_indices(false, {5}, at::kInt);
  const at::Tensor off = longs({0, 3});
  std::vector<at::Tensor> outs;
  for (int64_t n = 0; n < kN; ++n) outs.push_back(std::get<0>(at::embedding_bag(w[n], idx[n], off, false, 1)));
  WIDE_EXPECT_CLOSE(wide::embedding_bag(w, idx, off, false, 1), at::stack(outs));
  // Empty lookups.
  EXPECT_EQ(wide::embedding(w, at::zeros({kN, 0}, at::kLong)).sizes(), (Ints{kN, 0, kD}));
  EXPECT_EQ(wide::embedding_bag(w, at::zeros({kN, 0, 2}, at::kLong)).sizes(), (Ints{kN, 0, kD}));
  // The public C++ API (a typed dispatcher call) agrees with the boxed call Python makes.
  const at::Tensor i2 = make_indices(false, {4});
  EXPECT_TRUE(at::equal(wide::embedding(w, i2, kPad, false, false),
                        call_boxed("wide::embedding", w, i2, kPad, false, false).toTensor()));
  EXPECT_TRUE(at::equal(wide::embedding_bag(w, i2, off, false, 0, false, std::nullopt, false, -1),
                        call_boxed("wide::embedding_bag", w, i2, off, false, 0, false, std::nullopt, false, -1)
                            .toTensor()));
}

TEST(WideEmbedding, Errors) {
  const at::Tensor w = at::randn({kN, kV, kD});
  const at::Tensor idx = at::zeros({kN, 4}, at::kLong);
  const OptT none;
  // embedding
  expect_error([&] { wide::embedding(at::randn({kV, kD}), idx); },
               "wide::embedding: expected weight [N, num_embeddings, dim], got [6, 4]");
  expect_error([&] { wide::embedding(w, at::zeros({2, 4}, at::kLong)); },
               "wide::embedding: expected N-first indices [N, *] with N=3, got [2, 4]");
  expect_error([&] { wide::embedding(w, at::zeros({kN, 4})); }, "wide::embedding: expected integer indices, got Float");
  expect_error([&] { wide::embedding(w, idx, -1, false, true); }, "wide::embedding: sparse=True gradients are not supported");
  expect_error([&] { wide::embedding(w, idx, kV); },
               "wide::embedding: expected padding_idx in [0, num_embeddings) or -1 (none), got 6");
  expect_error([&] { wide::embedding(w, idx, -2); }, "expected padding_idx in [0, num_embeddings) or -1 (none), got -2");
  // embedding_renorm_
  at::Tensor w2 = w.clone();
  expect_error([&] { wide::embedding_renorm_(w2, at::zeros({kN + 1, 2}, at::kLong), 1.0, 2.0); },
               "wide::embedding_renorm_: expected N-first indices [N, *] with N=3");
  // embedding_bag
  const at::Tensor bag_idx = at::zeros({kN, 2, 2}, at::kLong);
  expect_error([&] { wide::embedding_bag(w, bag_idx, none, false, 0, true); },
               "wide::embedding_bag: sparse=True gradients are not supported");
  expect_error([&] { wide::embedding_bag(w, bag_idx, none, false, 3); },
               "wide::embedding_bag: expected mode 0 (sum), 1 (mean) or 2 (max), got 3");
  expect_error([&] { wide::embedding_bag(w, bag_idx, none, false, 0, false, none, false, kV); },
               "wide::embedding_bag: expected padding_idx in [0, num_embeddings) or -1, got 6");
  expect_error([&] { wide::embedding_bag(w, bag_idx, none, false, 0, false, at::randn({kN, 4})); },
               "expected per_sample_weights shaped like indices [3, 2, 2], got [3, 4]");
  expect_error([&] { wide::embedding_bag(w, idx, none); },
               "wide::embedding_bag: without offsets expected indices [N, B, L], got [3, 4]");
  expect_error([&] { wide::embedding_bag(w, bag_idx, none, false, 0, false, none, true); },
               "wide::embedding_bag: include_last_offset needs offsets");
  expect_error([&] { wide::embedding_bag(w, bag_idx, longs({0, 1})); },
               "wide::embedding_bag: with offsets expected indices [N, T], got [3, 2, 2]");
  expect_error([&] { wide::embedding_bag(w, idx, at::zeros({2, 2}, at::kLong)); },
               "wide::embedding_bag: expected offsets [B] (shared) or [N, B], got [2, 2]");
}

// An index outside [0, num_embeddings) of a member must raise as at::embedding does, never read
// another member's row of the flat [N*V, D] table (index V of member 0 would be member 1's row 0).
TEST(WideEmbedding, OutOfRangeIndicesRaise) {
  const at::Tensor w = at::randn({kN, kV, kD});
  expect_error([&] { wide::embedding(w, longs({kV, 0, 0}).view({kN, 1})); }, "out of range");
  expect_error([&] { wide::embedding(w, longs({0, -1, 0}).view({kN, 1})); }, "out of range");
  // the message names the member and the user's own index, not the flat table's
  expect_error([&] { wide::embedding(w, longs({0, kV + 2, 0}).view({kN, 1})); },
               "index " + std::to_string(kV + 2) + " of member 1 is not in the valid range");
  expect_error([&] { wide::embedding_bag(w, longs({kV, 0, 0}).view({kN, 1, 1})); },
               "not in the valid range");
}

// Offsets ATen would reject for one member are rejected, never merged across members: a member's
// offsets must start at 0, and with include_last_offset=True end at T (ATen's own float32 and
// float64 paths disagree on a smaller last offset).
TEST(WideEmbedding, BadOffsetsRaise) {
  const at::Tensor w = at::randn({kN, kV, kD});
  const at::Tensor idx = longs({0, 1, 2, 3}).expand({kN, 4});
  expect_error([&] { wide::embedding_bag(w, idx, longs({0, 2, 1, 3, 0, 2}).view({kN, 2})); },
               "expected every member's offsets to start at 0");
  expect_error([&] { wide::embedding_bag(w, idx, longs({0, 1, 3}), false, 0, false, std::nullopt, true); },
               "last offset to equal the number of indices 4");
  expect_error([&] { wide::embedding_bag(w, idx.view({kN, 2, 2}), std::nullopt, true, 2); },
               "max mode does not support scale_grad_by_freq");
  // one member's offsets past T (or decreasing) must not shift another member's bags
  expect_error([&] { wide::embedding_bag(w, idx, longs({0, 2, 0, 9, 0, 1}).view({kN, 2})); },
               "offsets of member 1 must be non-decreasing and at most the number of indices 4");
  expect_error([&] { wide::embedding_bag(w, idx, longs({0, 3, 1, 0, 1, 2, 0, 1, 2}).view({kN, 3})); },
               "offsets of member 0 must be non-decreasing");
}

// float32 sum/mean run ATen's fbgemm path, not the generic one the float64 grid exercises.
TEST(WideEmbedding, BagFloat32FastPath) {
  const at::Tensor w = at::randn({kN, kV, kD});
  const at::Tensor idx = make_indices(false, {7});
  const at::Tensor off = longs({0, 2, 2, 7, 0, 1, 5, 7, 0, 3, 7, 7}).view({kN, 4});
  for (int64_t mode : {0, 1, 2}) {
    for (int64_t padding_idx : {int64_t{-1}, kPad}) {
      const std::optional<int64_t> pad = padding_idx >= 0 ? std::optional<int64_t>(padding_idx) : std::nullopt;
      std::vector<at::Tensor> outs;
      for (int64_t n = 0; n < kN; ++n) {
        outs.push_back(std::get<0>(at::embedding_bag(w[n], idx[n], off[n], false, mode, false, std::nullopt, true, pad)));
      }
      EXPECT_TRUE(at::allclose(wide::embedding_bag(w, idx, off, false, mode, false, std::nullopt, true, padding_idx),
                               at::stack(outs), 1e-5, 1e-5))
          << "mode " << mode << " padding_idx " << padding_idx;
    }
  }
}

}  // namespace
