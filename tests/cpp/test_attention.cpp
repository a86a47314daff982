// wide::small_attention (the small-sequence CPU kernel, every instruction set) and wide::attention
// (its dispatching wrapper) against at::scaled_dot_product_attention computed in float64.
#include <ATen/core/grad_mode.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/isnan.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/zeros.h>
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <tuple>

#include "wide/ops/attention.h"
#include "wide/optim/cpu/kernels.h"
#include "isa_dtype_grid.h"
#include "wide_test_utils.h"

namespace {

using AttentionCase = wide_test::IsaDtype;

class WideSmallAttentionTest : public wide_test::IsaTest<AttentionCase> {};

at::Tensor reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                     std::optional<double> scale) {
  return at::scaled_dot_product_attention(q.to(at::kDouble), k.to(at::kDouble), v.to(at::kDouble),
                                          std::nullopt, 0.0, causal, scale, q.size(1) != k.size(1));
}

TEST_P(WideSmallAttentionTest, MatchesSdpa) {
  const at::ScalarType dtype = std::get<1>(GetParam());
  const auto opts = at::TensorOptions().dtype(dtype);
  const double tol = dtype == at::kFloat ? 2e-5 : 1e-12;
  // batch, heads, kv heads, queries, keys, head dim, value dim: below, at and across the vector
  // widths (tails), odd query counts (partial row blocks), more queries than keys and vice versa.
  const int64_t shapes[][7] = {{1, 1, 1, 1, 1, 1, 1},   {2, 3, 3, 7, 13, 5, 9},    {3, 4, 4, 32, 32, 16, 16},
                               {2, 4, 2, 9, 9, 24, 24}, {1, 6, 3, 33, 17, 8, 40},  {2, 2, 1, 5, 70, 64, 3},
                               {1, 2, 2, 130, 130, 32, 32}};
  for (const auto& s : shapes) {
    for (bool causal : {false, true}) {
      for (std::optional<double> scale : {std::optional<double>(), std::optional<double>(0.3)}) {
        SCOPED_TRACE("shape " + std::to_string(s[0]) + "," + std::to_string(s[1]) + "," + std::to_string(s[2]) +
                     "," + std::to_string(s[3]) + "," + std::to_string(s[4]) + "," + std::to_string(s[5]) +
                     "," + std::to_string(s[6]) + " causal=" + std::to_string(causal));
        const at::Tensor q = at::randn({s[0], s[1], s[3], s[5]}, opts).mul(2);
        const at::Tensor k = at::randn({s[0], s[2], s[4], s[5]}, opts);
        const at::Tensor v = at::randn({s[0], s[2], s[4], s[6]}, opts);
        const at::Tensor got = wide::small_attention(q, k, v, causal, scale);
        const at::Tensor want = reference(q, k, v, causal, scale);
        ASSERT_EQ(got.sizes(), want.sizes());
        EXPECT_TRUE(at::allclose(got.to(at::kDouble), want, tol, tol)) << got.to(at::kDouble).sub(want).abs().max();
      }
    }
  }
}

TEST_P(WideSmallAttentionTest, StridedInputsAndOutputLayout) {
  const auto opts = at::TensorOptions().dtype(std::get<1>(GetParam()));
  // q, k, v as a packed projection yields them: [B, T, 3, H, E] permuted, rows strided.
  const at::Tensor qkv = at::randn({2, 11, 3, 4, 8}, opts).permute({2, 0, 3, 1, 4});
  const at::Tensor q = qkv[0], k = qkv[1], v = qkv[2];
  const at::Tensor got = wide::small_attention(q, k, v);
  EXPECT_TRUE(at::equal(got, wide::small_attention(q.contiguous(), k.contiguous(), v.contiguous())));
  // Stored [B, L, H, Ev] like ATen's CPU attention, so the following transpose + flatten is free.
  EXPECT_EQ(got.strides(), c10::IntArrayRef({11 * 4 * 8, 8, 4 * 8, 1}));
  // A last dim that is not unit-stride is taken too (copied first).
  const at::Tensor kt = at::randn({2, 4, 8, 11}, opts).transpose(2, 3);
  EXPECT_TRUE(at::allclose(wide::small_attention(q, kt, v), wide::small_attention(q, kt.contiguous(), v)));
}

INSTANTIATE_TEST_SUITE_P(Isa, WideSmallAttentionTest, wide_test::isa_dtype_grid(), wide_test::isa_dtype_name);

TEST(WideSmallAttention, NanStaysInItsHead) {
  at::Tensor q = at::randn({3, 2, 6, 8}), k = at::randn({3, 2, 6, 8}), v = at::randn({3, 2, 6, 8});
  k[1][0][2][3] = std::numeric_limits<float>::quiet_NaN();
  const at::Tensor out = wide::small_attention(q, k, v);
  EXPECT_TRUE(at::isnan(out[1][0]).all().item<bool>());
  EXPECT_FALSE(at::isnan(out[1][1]).any().item<bool>());
  EXPECT_FALSE(at::isnan(out[0]).any().item<bool>());
  EXPECT_FALSE(at::isnan(out[2]).any().item<bool>());
}

TEST(WideSmallAttention, RefusesBadInputs) {
  const at::Tensor q = at::randn({2, 4, 5, 8});
  wide_test::expect_error([&] { wide::small_attention(q[0], q[0], q[0]); }, "expected 4-d");
  wide_test::expect_error([&] { wide::small_attention(q, q.to(at::kDouble), q); }, "must all be float32 or all float64");
  wide_test::expect_error([&] { wide::small_attention(q, at::randn({2, 4, 5, 7}), q); }, "must agree");
  wide_test::expect_error([&] { wide::small_attention(q, at::randn({2, 3, 5, 8}), at::randn({2, 3, 5, 8})); },
                          "not a multiple of 3 key/value heads");
  wide_test::expect_error([&] { wide::small_attention(q, at::randn({2, 4, 0, 8}), at::randn({2, 4, 0, 8})); },
                          "no keys");
}

TEST(WideAttention, TakesTheKernelOnlyWhereItApplies) {
  const at::Tensor q = at::randn({2, 4, 5, 8}), k = at::randn({2, 4, 5, 8}), v = at::randn({2, 4, 5, 8});
  EXPECT_TRUE(wide::small_attention_applies(q, k, v, std::nullopt, 0.0, false));
  EXPECT_FALSE(wide::small_attention_applies(q, k, v, at::zeros({5, 5}), 0.0, false));   // a mask
  EXPECT_FALSE(wide::small_attention_applies(q, k, v, std::nullopt, 0.1, false));        // dropout
  EXPECT_FALSE(wide::small_attention_applies(q, at::randn({2, 2, 5, 8}), at::randn({2, 2, 5, 8}),
                                             std::nullopt, 0.0, false));                // GQA not asked for
  EXPECT_TRUE(wide::small_attention_applies(q, at::randn({2, 2, 5, 8}), at::randn({2, 2, 5, 8}),
                                            std::nullopt, 0.0, true));
  EXPECT_FALSE(wide::small_attention_applies(q[0], k[0], v[0], std::nullopt, 0.0, false));  // 3-d
  EXPECT_FALSE(wide::small_attention_applies(q, at::randn({2, 4, 4096, 8}), at::randn({2, 4, 4096, 8}),
                                             std::nullopt, 0.0, false));                // many keys
  const at::Tensor qg = q.clone().requires_grad_();
  EXPECT_FALSE(wide::small_attention_applies(qg, k, v, std::nullopt, 0.0, false));      // a gradient
  {
    at::NoGradGuard no_grad;
    EXPECT_TRUE(wide::small_attention_applies(qg, k, v, std::nullopt, 0.0, false));
  }
  // Either way wide::attention computes SDPA's result.
  for (bool causal : {false, true}) {
    EXPECT_TRUE(at::allclose(wide::attention(q, k, v, std::nullopt, 0.0, causal),
                             at::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, causal), 1e-5, 1e-6));
  }
  const at::Tensor mask = at::randn({5, 5});
  EXPECT_TRUE(at::allclose(wide::attention(q, k, v, mask), at::scaled_dot_product_attention(q, k, v, mask),
                           1e-5, 1e-6));
  const at::Tensor out = wide::attention(qg, k, v);
  EXPECT_TRUE(out.requires_grad());  // SDPA's autograd
}

}  // namespace
