// wide::batch_norm / instance_norm / group_norm / layer_norm / rms_norm / prelu (public C++ API,
// through the dispatcher), against references written with plain ATen calls per member: at::batch_norm(x[n],
// weight[n], bias[n], running_mean[n], running_var[n], ...) and so on. Packed-family ops (all but
// layer_norm and rms_norm) return the members' results concatenated on the channel dim; their
// running statistics must end up exactly as each member's own buffers would.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/batch_norm.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/group_norm.h>
#include <ATen/ops/instance_norm.h>
#include <ATen/ops/layer_norm.h>
#include <ATen/ops/native_batch_norm.h>
#include <ATen/ops/native_batch_norm_backward.h>
#include <ATen/ops/var.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/prelu.h>
#include <ATen/ops/rand.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/rms_norm.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <gtest/gtest.h>

#include <array>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "wide/ops/norm.h"
#include "wide/ops/prelu.h"
#include "wide/optim/cpu/kernels.h"
#include "isa_dtype_grid.h"
#include "wide_test_utils.h"

namespace {

using namespace wide_test;

constexpr double kMomentum = 0.3, kEps = 1e-4;

OptT maybe_randn(bool present, const Ints& shape) {
  return present ? OptT(at::randn(shape, f64())) : std::nullopt;
}

// Running statistics [N, C], contiguous or a transposed [C, N] buffer (non-contiguous: the op must
// still update the caller's tensor in place).
std::pair<OptT, OptT> running_stats(bool present, bool contiguous, int64_t n, int64_t c) {
  if (!present) return {std::nullopt, std::nullopt};
  if (contiguous) return {at::randn({n, c}, f64()), at::rand({n, c}, f64()).add(0.5)};
  return {at::randn({c, n}, f64()).t(), at::rand({c, n}, f64()).add(0.5).t()};
}

OptT clone(const OptT& t) { return t.has_value() ? OptT(t->clone()) : std::nullopt; }

struct StatResult {
  at::Tensor out;
  OptT running_mean, running_var;
};

// Member n runs `norm` on x[n] with its own copies of the running stats; those copies, stacked,
// are what the wide op must leave in the [N, C] buffers.
template <class NormFn>
StatResult reference_stat_norm(const at::Tensor& x, const OptT& w, const OptT& b, const OptT& rm,
                               const OptT& rv, NormFn&& norm) {
  std::vector<at::Tensor> outs, means, vars;
  for (int64_t n = 0; n < x.size(0); ++n) {
    const OptT m = rm ? OptT(rm->select(0, n).clone()) : std::nullopt;
    const OptT v = rv ? OptT(rv->select(0, n).clone()) : std::nullopt;
    outs.push_back(norm(x[n], member(w, n), member(b, n), m, v));
    if (m) means.push_back(*m);
    if (v) vars.push_back(*v);
  }
  StatResult r{pack(outs), std::nullopt, std::nullopt};
  if (rm) r.running_mean = at::stack(means);
  if (rv) r.running_var = at::stack(vars);
  return r;
}

// --- batch_norm / instance_norm -------------------------------------------------------------------

// The norms with running statistics (the same signature, wide and per member).
enum class StatNorm { Batch, Instance };

// Which statistics the norm uses: batch (or instance) statistics and updates running stats /
// batch statistics without running stats / running stats (eval; use_input_stats=False).
enum class StatMode { UpdateRunning, NoRunning, UseRunning };

const char* stat_mode_name(StatMode m) {
  switch (m) {
    case StatMode::UpdateRunning: return "update_running";
    case StatMode::NoRunning: return "no_running";
    case StatMode::UseRunning: return "use_running";
  }
  return "?";
}

// norm, input layout, statistics
using StatCase = std::tuple<StatNorm, Layout, StatMode>;

std::string stat_case_name(const ::testing::TestParamInfo<StatCase>& info) {
  const auto& [norm, layout, mode] = info.param;
  return std::string(norm == StatNorm::Batch ? "batch_" : "instance_") + layout_name(layout) + "_" +
         stat_mode_name(mode);
}

class WideStatNormTest : public ::testing::TestWithParam<StatCase> {};

// The wide op against the member reference for every member shape, with and without affine
// parameters, with contiguous and transposed running-stat buffers.
TEST_P(WideStatNormTest, MatchesPerMemberReference) {
  const auto& [norm, layout, mode] = GetParam();
  const bool batch = norm == StatNorm::Batch;
  const auto wide_op = batch ? &wide::batch_norm : &wide::instance_norm;
  const auto member_op = batch ? &at::batch_norm : &at::instance_norm;
  const bool batch_stats = mode != StatMode::UseRunning;  // training / use_input_stats
  const bool has_stats = mode != StatMode::NoRunning;
  // BatchNorm1d on [B, C] and [B, C, L], BatchNorm2d, BatchNorm3d; InstanceNorm1d, 2d, 3d.
  const std::vector<Ints> member_shapes =
      batch ? std::vector<Ints>{{4, 5}, {4, 3, 6}, {2, 3, 4, 3}, {2, 2, 3, 2, 3}}
            : std::vector<Ints>{{3, 4, 6}, {2, 3, 4, 3}, {2, 2, 3, 2, 3}};
  const int64_t n = 3;
  for (const Ints& shape : member_shapes) {
    const int64_t c = shape[1];
    const at::Tensor x = member_inputs(layout, n, shape);
    for (bool affine : {false, true}) {
      for (bool contiguous_stats : {true, false}) {
        if (!has_stats && !contiguous_stats) continue;
        SCOPED_TRACE("member shape " + c10::str(at::IntArrayRef(shape)) + " affine=" + std::to_string(affine) +
                     " contiguous_stats=" + std::to_string(contiguous_stats));
        const OptT w = maybe_randn(affine, {n, c}), b = maybe_randn(affine, {n, c});
        const auto [rm, rv] = running_stats(has_stats, contiguous_stats, n, c);
        const OptT rm0 = clone(rm), rv0 = clone(rv);
        const StatResult want = reference_stat_norm(
            x, w, b, rm0, rv0,
            [&](const at::Tensor& xx, const OptT& ww, const OptT& bb, const OptT& m, const OptT& v) {
              return member_op(xx, ww, bb, m, v, batch_stats, kMomentum, kEps, false);
            });
        const at::Tensor got =
            wide_op(op_input(layout, x), w, b, rm, rv, batch_stats, kMomentum, kEps, layout == Layout::Packed);
        WIDE_EXPECT_CLOSE(got, want.out);
        if (has_stats) {
          WIDE_EXPECT_CLOSE(*rm, *want.running_mean);
          WIDE_EXPECT_CLOSE(*rv, *want.running_var);
          // The update really happened (or really did not).
          EXPECT_EQ(at::equal(*rm, *rm0), mode == StatMode::UseRunning);
          EXPECT_EQ(at::equal(*rv, *rv0), mode == StatMode::UseRunning);
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Grid, WideStatNormTest,
    ::testing::Combine(::testing::Values(StatNorm::Batch, StatNorm::Instance),
                       ::testing::Values(Layout::NFirst, Layout::Packed, Layout::Shared),
                       ::testing::Values(StatMode::UpdateRunning, StatMode::NoRunning, StatMode::UseRunning)),
    stat_case_name);

// --- group_norm ------------------------------------------------------------------------------------

class WideGroupNormTest : public ::testing::TestWithParam<Layout> {};

TEST_P(WideGroupNormTest, MatchesPerMemberReference) {
  const Layout layout = GetParam();
  const int64_t n = 3, c = 4;
  for (const Ints& shape : std::vector<Ints>{{3, c}, {2, c, 5}, {2, c, 3, 2}}) {
    const at::Tensor x = member_inputs(layout, n, shape);
    for (int64_t groups : {1, 2, 4}) {
      for (bool affine : {false, true}) {
        SCOPED_TRACE("member shape " + c10::str(at::IntArrayRef(shape)) + " groups=" + std::to_string(groups) +
                     " affine=" + std::to_string(affine));
        const OptT w = maybe_randn(affine, {n, c}), b = maybe_randn(affine, {n, c});
        std::vector<at::Tensor> outs;
        for (int64_t k = 0; k < n; ++k) outs.push_back(at::group_norm(x[k], groups, member(w, k), member(b, k), kEps, false));
        WIDE_EXPECT_CLOSE(wide::group_norm(op_input(layout, x), n, groups, w, b, kEps, layout == Layout::Packed),
                          pack(outs));
        if (layout != Layout::Packed) {  // N-first in and out: the one-pass kernel
          WIDE_EXPECT_CLOSE(wide::group_norm_nfirst(x, groups, w, b, kEps), at::stack(outs));
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Grid, WideGroupNormTest,
                         ::testing::Values(Layout::NFirst, Layout::Packed, Layout::Shared),
                         [](const ::testing::TestParamInfo<Layout>& info) {
                           return std::string(layout_name(info.param));
                         });

// --- layer_norm / rms_norm (N-first in, N-first out) ---------------------------------------------

// rms (else layer), number of normalized dims, shared input
using LayerCase = std::tuple<bool, int, bool>;

class WideLayerNormTest : public ::testing::TestWithParam<LayerCase> {};

TEST_P(WideLayerNormTest, MatchesPerMemberReference) {
  const auto& [rms, k, shared] = GetParam();
  const int64_t n = 3;
  std::vector<Ints> member_shapes = {{4, 5}, {2, 3, 4, 5}};
  if (k == 1) member_shapes.push_back({5});
  for (const Ints& shape : member_shapes) {
    const Ints ns(shape.end() - k, shape.end());
    Ints pshape = ns;
    pshape.insert(pshape.begin(), n);
    const at::Tensor x = member_inputs(shared ? Layout::Shared : Layout::NFirst, n, shape);
    for (bool has_weight : {false, true}) {
      for (int variant : {0, 1}) {  // layer_norm: without / with bias; rms_norm: default eps / 1e-3
        SCOPED_TRACE("member shape " + c10::str(at::IntArrayRef(shape)) + " weight=" + std::to_string(has_weight) +
                     " variant=" + std::to_string(variant));
        const OptT w = maybe_randn(has_weight, pshape);
        std::vector<at::Tensor> outs;
        at::Tensor got;
        if (rms) {
          const std::optional<double> eps = variant ? std::optional<double>(1e-3) : std::nullopt;
          for (int64_t m = 0; m < n; ++m) outs.push_back(at::rms_norm(x[m], ns, member(w, m), eps));
          got = wide::rms_norm(x, syms(ns), w, eps);
        } else {
          const OptT b = maybe_randn(variant == 1, pshape);
          for (int64_t m = 0; m < n; ++m) outs.push_back(at::layer_norm(x[m], ns, member(w, m), member(b, m), kEps, false));
          got = wide::layer_norm(x, syms(ns), w, b, kEps);
          WIDE_EXPECT_CLOSE(wide::layer_norm(x, syms(ns), w, b, kEps, "loop"), at::stack(outs));
        }
        WIDE_EXPECT_CLOSE(got, at::stack(outs));
      }
    }
  }
}

std::string layer_case_name(const ::testing::TestParamInfo<LayerCase>& info) {
  const auto& [rms, k, shared] = info.param;
  return std::string(rms ? "rms" : "layer") + "_k" + std::to_string(k) + (shared ? "_shared" : "_nfirst");
}

INSTANTIATE_TEST_SUITE_P(Grid, WideLayerNormTest,
                         ::testing::Combine(::testing::Bool(), ::testing::Values(1, 2), ::testing::Bool()),
                         layer_case_name);

// --- fused_norm: the one-pass no-gradient kernel, every instruction set ------------------------------

using FusedCase = wide_test::IsaDtype;

class WideFusedNormTest : public wide_test::IsaTest<FusedCase> {};

TEST_P(WideFusedNormTest, MatchesPerMemberReference) {
  const at::ScalarType dtype = std::get<1>(GetParam());
  const auto opts = at::TensorOptions().dtype(dtype);
  const double tol = dtype == at::kFloat ? 1e-5 : 1e-10;
  const int64_t n = 3;
  for (int64_t d : {1, 7, 16, 67}) {  // below, at and across vector widths (tails)
    for (bool residual : {false, true}) {
      for (bool rms : {false, true}) {
        for (bool affine : {false, true}) {
          SCOPED_TRACE("d=" + std::to_string(d) + " residual=" + std::to_string(residual) +
                       " rms=" + std::to_string(rms) + " affine=" + std::to_string(affine));
          // Members on very different scales: statistics must be per row, affine per member.
          const at::Tensor x = at::randn({n, 2, 5, d}, opts).mul(10).add(3);
          const OptT r = residual ? OptT(at::randn({n, 2, 5, d}, opts)) : std::nullopt;
          const OptT w = affine ? OptT(at::randn({n, d}, opts)) : std::nullopt;
          const OptT b = affine && !rms ? OptT(at::randn({n, d}, opts)) : std::nullopt;
          std::vector<at::Tensor> outs;
          for (int64_t m = 0; m < n; ++m) {
            const at::Tensor s = residual ? x[m].add((*r)[m]) : x[m];
            outs.push_back(rms ? at::rms_norm(s, {d}, member(w, m), 1e-5)
                               : at::layer_norm(s, {d}, member(w, m), member(b, m), 1e-5, false));
          }
          const at::Tensor got = wide::fused_norm(x, r, d, w, b, 1e-5, rms);
          EXPECT_TRUE(at::allclose(got, at::stack(outs), tol, tol)) << got.sub(at::stack(outs)).abs().max();
        }
      }
    }
  }
  // Strided input, residual and weight take the same result as contiguous ones.
  const at::Tensor x = at::randn({5, 4, 3}, opts).transpose(0, 2);  // [3, 4, 5]
  const at::Tensor r = at::randn({3, 5, 4}, opts).transpose(1, 2);
  const at::Tensor w = at::randn({5, 3}, opts).t();
  EXPECT_TRUE(at::allclose(wide::fused_norm(x, r, 5, w, std::nullopt, 1e-5),
                           wide::fused_norm(x.contiguous(), r.contiguous(), 5, w.contiguous(), std::nullopt, 1e-5),
                           tol, tol));
  // fused_group_norm: rows of C/G channels of `inner` values each, inner below, at and across
  // vector widths; members on different scales; affine per member and channel.
  for (const Ints& spatial : std::vector<Ints>{{}, {7}, {4, 4}, {3, 23}}) {
    for (int64_t groups : {1, 2, 6}) {
      // (one value per row: the kernel gives exactly the bias, ATen's one-pass variance noise)
      if (spatial.empty() && groups == 6) continue;
      for (bool affine : {false, true}) {
        SCOPED_TRACE("spatial " + c10::str(at::IntArrayRef(spatial)) + " groups=" + std::to_string(groups) +
                     " affine=" + std::to_string(affine));
        Ints shape{n, 2, 6};
        shape.insert(shape.end(), spatial.begin(), spatial.end());
        Ints scale(shape.size(), 1);
        scale[0] = n;
        const at::Tensor gx = at::randn(shape, opts).mul(at::arange(1, n + 1, opts).mul(5).view(scale)).add(3);
        const OptT gw = affine ? OptT(at::randn({n, 6}, opts)) : std::nullopt;
        const OptT gb = affine ? OptT(at::randn({n, 6}, opts)) : std::nullopt;
        std::vector<at::Tensor> outs;
        for (int64_t m = 0; m < n; ++m) outs.push_back(at::group_norm(gx[m], groups, member(gw, m), member(gb, m), 1e-5));
        const at::Tensor got = wide::fused_group_norm(gx, groups, gw, gb, 1e-5);
        EXPECT_TRUE(at::allclose(got, at::stack(outs), tol, tol)) << got.sub(at::stack(outs)).abs().max();
      }
    }
  }
  // add_layer_norm: the fused path (no gradient wanted) equals layer_norm of the sum.
  const at::Tensor y = at::randn({3, 4, 5}, opts), z = at::randn({3, 4, 5}, opts);
  EXPECT_TRUE(at::allclose(wide::add_layer_norm(y, z, syms({5}), w, std::nullopt, 1e-5),
                           wide::layer_norm(y.add(z), syms({5}), w, std::nullopt, 1e-5, "loop"), tol, tol));
  // ... and broadcasting sums (not fused) too.
  const at::Tensor bias = at::randn({3, 1, 5}, opts);
  EXPECT_TRUE(at::allclose(wide::add_layer_norm(y, bias, syms({5}), w, std::nullopt, 1e-5),
                           wide::layer_norm(y.add(bias), syms({5}), w, std::nullopt, 1e-5, "loop"), tol, tol));
}

using NormGrads = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

NormGrads fused_norm_backward(const at::Tensor& g, const at::Tensor& x, const OptT& r, int64_t d, const OptT& w,
                              double eps, bool rms, std::array<bool, 3> mask) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("wide::fused_norm_backward", "")
                       .typed<NormGrads(const at::Tensor&, const at::Tensor&, const OptT&, int64_t, const OptT&,
                                        double, bool, std::array<bool, 3>)>();
  return op.call(g, x, r, d, w, eps, rms, mask);
}

// The backward kernel against the same formula in ATen ops (detail::fused_norm_backward_math,
// itself checked against autograd of the members' norms in tests/python/test_norm.py).
TEST_P(WideFusedNormTest, BackwardMatchesFormula) {
  const at::ScalarType dtype = std::get<1>(GetParam());
  const auto opts = at::TensorOptions().dtype(dtype);
  const double tol = dtype == at::kFloat ? 1e-4 : 1e-10;
  const int64_t n = 3;
  for (int64_t d : {2, 7, 16, 67}) {
    for (int64_t rows : {1, 5}) {  // one row per member: a single chunk each
      for (bool residual : {false, true}) {
        for (bool rms : {false, true}) {
          for (bool affine : {false, true}) {
            SCOPED_TRACE("d=" + std::to_string(d) + " rows=" + std::to_string(rows) + " residual=" +
                         std::to_string(residual) + " rms=" + std::to_string(rms) + " affine=" + std::to_string(affine));
            const at::Tensor x = at::randn({n, rows, d}, opts).mul(5).add(2);
            const at::Tensor g = at::randn({n, rows, d}, opts);
            const OptT r = residual ? OptT(at::randn({n, rows, d}, opts)) : std::nullopt;
            const OptT w = affine ? OptT(at::randn({n, d}, opts)) : std::nullopt;
            for (std::array<bool, 3> mask : {std::array<bool, 3>{true, true, true}, std::array<bool, 3>{true, false, false},
                                             std::array<bool, 3>{false, true, true}}) {
              const auto [dx, dw, db] = fused_norm_backward(g, x, r, d, w, 1e-5, rms, mask);
              const auto [ex, ew, eb] = wide::detail::fused_norm_backward_math(g, x, r, d, w, 1e-5, rms, mask);
              ASSERT_EQ(dx.defined(), mask[0]);
              ASSERT_EQ(db.defined(), mask[2]);
              ASSERT_EQ(dw.defined(), mask[1] && affine);
              if (dx.defined()) EXPECT_TRUE(at::allclose(dx, ex, tol, tol)) << dx.sub(ex).abs().max();
              if (dw.defined()) EXPECT_TRUE(at::allclose(dw, ew, tol, tol)) << dw.sub(ew).abs().max();
              if (db.defined()) EXPECT_TRUE(at::allclose(db.view({n, d}), eb.view({n, d}), tol, tol));
            }
          }
        }
      }
    }
  }
}

// fused_batch_norm (Note [Batch norm training kernel]) and its backward against ATen's training
// batch norm: rows of `inner` values at, past and across vector widths, channels on different
// scales, with and without affine, every gradient mask.
TEST_P(WideFusedNormTest, BatchNormTrainingMatchesAten) {
  const at::ScalarType dtype = std::get<1>(GetParam());
  const auto opts = at::TensorOptions().dtype(dtype);
  const double tol = dtype == at::kFloat ? 1e-4 : 1e-10;
  for (const Ints& spatial : std::vector<Ints>{{16}, {17}, {5, 7}, {3, 4, 6}, {67}}) {
    for (int64_t batch : {1, 3}) {
      for (bool affine : {false, true}) {
        SCOPED_TRACE("spatial " + c10::str(at::IntArrayRef(spatial)) + " batch=" + std::to_string(batch) +
                     " affine=" + std::to_string(affine));
        const int64_t c = 5;
        Ints shape{batch, c};
        shape.insert(shape.end(), spatial.begin(), spatial.end());
        Ints scale(shape.size(), 1);
        scale[1] = c;
        const at::Tensor x = at::randn(shape, opts).mul(at::arange(1, c + 1, opts).mul(4).view(scale)).add(3);
        const OptT w = affine ? OptT(at::rand({c}, opts).add(0.5)) : std::nullopt;
        const OptT b = affine ? OptT(at::randn({c}, opts)) : std::nullopt;
        ASSERT_TRUE(wide::detail::takes_fused_batch_norm(x, w, b));
        const auto [y, mean, invstd, var] = wide::fused_batch_norm(x, w, b, 1e-5);
        const auto [ey, emean, einvstd] = at::native_batch_norm(x, w, b, std::nullopt, std::nullopt, true, 0.0, 1e-5);
        Ints dims{0};
        for (int64_t d = 2; d < x.dim(); ++d) dims.push_back(d);
        const at::Tensor evar = x.var(dims, /*unbiased=*/true);
        EXPECT_TRUE(at::allclose(y, ey, tol, tol)) << y.sub(ey).abs().max();
        EXPECT_TRUE(at::allclose(mean, emean, tol, tol));
        EXPECT_TRUE(at::allclose(invstd, einvstd, tol, tol));
        EXPECT_TRUE(at::allclose(var, evar, tol, tol)) << var << evar;
        const at::Tensor g = at::randn(shape, opts);
        static auto backward = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("wide::fused_batch_norm_backward", "")
                                   .typed<NormGrads(const at::Tensor&, const at::Tensor&, const OptT&, const at::Tensor&,
                                                    const at::Tensor&, double, std::array<bool, 3>)>();
        for (std::array<bool, 3> mask : {std::array<bool, 3>{true, true, true}, std::array<bool, 3>{true, false, false},
                                         std::array<bool, 3>{false, true, true}}) {
          const auto [dx, dw, db] = backward.call(g, x, w, mean, invstd, 1e-5, mask);
          const auto [ex, ew, eb] = at::native_batch_norm_backward(g, x, w, std::nullopt, std::nullopt, mean, invstd,
                                                                   true, 1e-5, mask);
          ASSERT_EQ(dx.defined(), mask[0]);
          ASSERT_EQ(dw.defined(), mask[1]);
          ASSERT_EQ(db.defined(), mask[2]);
          if (dx.defined()) EXPECT_TRUE(at::allclose(dx, ex, tol, tol)) << dx.sub(ex).abs().max();
          if (dw.defined()) EXPECT_TRUE(at::allclose(dw, ew, tol, tol)) << dw.sub(ew).abs().max();
          if (db.defined()) EXPECT_TRUE(at::allclose(db, eb, tol, tol)) << db.sub(eb).abs().max();
        }
      }
    }
  }
  // Rows shorter than 16 values and channels-last inputs take ATen's kernel.
  EXPECT_FALSE(wide::detail::takes_fused_batch_norm(at::randn({4, 3, 15}, opts), std::nullopt, std::nullopt));
  EXPECT_FALSE(wide::detail::takes_fused_batch_norm(
      at::randn({2, 3, 4, 4}, opts).contiguous(at::MemoryFormat::ChannelsLast), std::nullopt, std::nullopt));
}

INSTANTIATE_TEST_SUITE_P(Isa, WideFusedNormTest, wide_test::isa_dtype_grid(), wide_test::isa_dtype_name);

TEST(WideFusedNorm, RefusesBadShapes) {
  const at::Tensor x = at::randn({2, 3, 4});
  wide_test::expect_error([&] { wide::fused_norm(x, at::randn({2, 3, 5}), 4, std::nullopt, std::nullopt, 1e-5); },
                          "residual");
  wide_test::expect_error([&] { wide::fused_norm(x, std::nullopt, 4, at::randn({3, 4}), std::nullopt, 1e-5); },
                          "[N, *normalized_shape] with N=2");
  wide_test::expect_error([&] { wide::fused_norm(x, std::nullopt, 5, std::nullopt, std::nullopt, 1e-5); },
                          "multiple of normalized_numel=5");
}

// --- prelu -----------------------------------------------------------------------------------------

// input layout, one slope per channel (else one per member)
using PreluCase = std::tuple<Layout, bool>;

class WidePreluTest : public ::testing::TestWithParam<PreluCase> {};

TEST_P(WidePreluTest, MatchesPerMemberReference) {
  const auto& [layout, per_channel] = GetParam();
  const int64_t n = 3, c = 4;
  for (const Ints& shape : std::vector<Ints>{{5, c}, {2, c, 5}, {2, c, 3, 2}}) {
    SCOPED_TRACE("member shape " + c10::str(at::IntArrayRef(shape)));
    const at::Tensor x = member_inputs(layout, n, shape);
    const at::Tensor w = at::randn({n, per_channel ? c : 1}, f64());
    std::vector<at::Tensor> outs;
    for (int64_t k = 0; k < n; ++k) outs.push_back(at::prelu(x[k], w[k]));
    WIDE_EXPECT_CLOSE(wide::prelu(op_input(layout, x), w, layout == Layout::Packed), pack(outs));
  }
}

std::string prelu_case_name(const ::testing::TestParamInfo<PreluCase>& info) {
  return std::string(layout_name(std::get<0>(info.param))) +
         (std::get<1>(info.param) ? "_per_channel" : "_per_member");
}

INSTANTIATE_TEST_SUITE_P(Grid, WidePreluTest,
                         ::testing::Combine(::testing::Values(Layout::NFirst, Layout::Packed, Layout::Shared),
                                            ::testing::Bool()),
                         prelu_case_name);

// --- non-contiguous inputs, empty batches, errors ------------------------------------------------

TEST(WideNorm, NonContiguousInputs) {
  const int64_t n = 3, c = 4;
  // [N, B=2, C, H=3, W=5] from a permuted buffer.
  const at::Tensor x = at::randn({n, c, 5, 2, 3}, f64()).permute({0, 3, 1, 4, 2});
  ASSERT_FALSE(x.is_contiguous());
  const at::Tensor w = at::randn({n, c}, f64()), b = at::randn({n, c}, f64());
  auto [rm, rv] = running_stats(true, true, n, c);
  const StatResult want = reference_stat_norm(x, w, b, clone(rm), clone(rv),
      [](const at::Tensor& xx, const OptT& ww, const OptT& bb, const OptT& m, const OptT& v) {
        return at::batch_norm(xx, ww, bb, m, v, true, kMomentum, kEps, false);
      });
  WIDE_EXPECT_CLOSE(wide::batch_norm(x, w, b, rm, rv, true, kMomentum, kEps, false), want.out);
  WIDE_EXPECT_CLOSE(*rm, *want.running_mean);
  WIDE_EXPECT_CLOSE(*rv, *want.running_var);

  std::vector<at::Tensor> gn, pr;
  for (int64_t k = 0; k < n; ++k) {
    gn.push_back(at::group_norm(x[k], 2, w[k], b[k], kEps, false));
    pr.push_back(at::prelu(x[k], w[k]));
  }
  WIDE_EXPECT_CLOSE(wide::group_norm(x, n, 2, w, b, kEps, false), pack(gn));
  WIDE_EXPECT_CLOSE(wide::prelu(x, w, false), pack(pr));
  // Non-contiguous packed input: every other channel of a wider tensor.
  const at::Tensor p = at::randn({2, 2 * n * c, 3}, f64()).slice(1, 0, 2 * n * c, 2);
  ASSERT_FALSE(p.is_contiguous());
  const at::Tensor p_nfirst = p.view({2, n, c, 3}).movedim(1, 0);
  std::vector<at::Tensor> pr2;
  for (int64_t k = 0; k < n; ++k) pr2.push_back(at::prelu(p_nfirst[k], w[k]));
  WIDE_EXPECT_CLOSE(wide::prelu(p, w, true), pack(pr2));

  // layer_norm / rms_norm on a transposed N-first input, with non-contiguous weights.
  const at::Tensor y = at::randn({n, 5, 2, 4}, f64()).transpose(1, 3);  // [N, 4, 2, 5]
  const at::Tensor lw = at::randn({5, n}, f64()).t(), lb = at::randn({5, n}, f64()).t();
  std::vector<at::Tensor> ln, rmsn;
  for (int64_t k = 0; k < n; ++k) {
    ln.push_back(at::layer_norm(y[k], {5}, lw[k], lb[k], kEps, false));
    rmsn.push_back(at::rms_norm(y[k], {5}, lw[k], std::nullopt));
  }
  WIDE_EXPECT_CLOSE(wide::layer_norm(y, syms({5}), lw, lb, kEps), at::stack(ln));
  WIDE_EXPECT_CLOSE(wide::layer_norm(y, syms({5}), lw, lb, kEps, "loop"), at::stack(ln));
  WIDE_EXPECT_CLOSE(wide::rms_norm(y, syms({5}), lw, std::nullopt), at::stack(rmsn));
}

TEST(WideNorm, EmptyBatch) {
  const int64_t n = 3, c = 4;
  const at::Tensor x = at::randn({n, 0, c, 5});
  const at::Tensor w = at::randn({n, c});
  const Ints packed_shape = {0, n * c, 5};
  EXPECT_EQ(wide::batch_norm(x, w, w, at::zeros({n, c}), at::ones({n, c}), false, kMomentum, kEps, false).sizes(),
            packed_shape);
  // (instance_norm is left out: at::instance_norm itself fails on an empty batch, in select().)
  EXPECT_EQ(wide::group_norm(x, n, 2, w, w, kEps, false).sizes(), packed_shape);
  EXPECT_EQ(wide::prelu(x, w, false).sizes(), packed_shape);
  const at::Tensor empty = at::randn({n, 0, 5});
  EXPECT_EQ(wide::layer_norm(empty, syms({5}), std::nullopt, std::nullopt, kEps).sizes(), (Ints{n, 0, 5}));
  EXPECT_EQ(wide::layer_norm(empty, syms({5}), std::nullopt, std::nullopt, kEps, "loop").sizes(), (Ints{n, 0, 5}));
}

TEST(WideNorm, Errors) {
  const at::Tensor x = at::randn({3, 2, 4, 5});
  const at::Tensor p = at::randn({3, 4});
  const OptT none;
  // batch_norm
  expect_error([&] { wide::batch_norm(at::randn({3, 4}), p, p, none, none, true, kMomentum, kEps, false); },
               "wide::batch_norm: expected an N-first input [N, B, C, *] with 0 to 3 spatial dims, got [3, 4]");
  expect_error([&] { wide::batch_norm(at::randn({2, 12, 1, 1, 1, 1}), none, none, none, none, true, kMomentum, kEps,
                                      true); },
               "wide::batch_norm: expected a packed input [B, N*C, *] with 0 to 3 spatial dims");
  expect_error([&] { wide::batch_norm(x, at::randn({12}), none, none, none, true, kMomentum, kEps, false); },
               "wide::batch_norm: expected weight of shape [N, C], got [12]");
  expect_error([&] { wide::batch_norm(x, none, none, p, none, true, kMomentum, kEps, false); },
               "expected both running_mean and running_var or neither");
  expect_error([&] { wide::batch_norm(x, none, none, none, none, false, kMomentum, kEps, false); },
               "expected running stats in eval mode (training=False), got none");
  expect_error([&] { wide::batch_norm(x, at::randn({3, 5}), none, none, none, true, kMomentum, kEps, false); },
               "wide::batch_norm: input has 12 packed channels (N*C) but a [N, C] parameter/buffer is [3, 5]");
  expect_error([&] { wide::batch_norm(x, at::randn({2, 6}), none, none, none, true, kMomentum, kEps, false); },
               "wide::batch_norm: input has 3 members (dim 0) but a parameter/buffer has 2");
  expect_error([&] { wide::batch_norm(at::randn({2, 10, 5}), p, none, none, none, true, kMomentum, kEps, true); },
               "input has 10 packed channels (N*C) but a [N, C] parameter/buffer is [3, 4] (input [2, 10, 5], packed)");
  // instance_norm
  expect_error([&] { wide::instance_norm(at::randn({3, 2, 4}), none, none, none, none, true, kMomentum, kEps, false); },
               "wide::instance_norm: expected an N-first input [N, B, C, *] with 1 to 3 spatial dims, got [3, 2, 4]");
  expect_error([&] { wide::instance_norm(x, none, none, none, none, false, kMomentum, kEps, false); },
               "expected running stats when use_input_stats=False, got none");
  expect_error([&] { wide::instance_norm(x, at::randn({3, 3}), none, none, none, true, kMomentum, kEps, false); },
               "wide::instance_norm: input has 12 packed channels (N*C)");
  // group_norm
  expect_error([&] { wide::group_norm(x, 3, 0, none, none, kEps, false); },
               "wide::group_norm: expected n >= 1 and num_groups >= 1, got n=3, num_groups=0");
  expect_error([&] { wide::group_norm(x, 2, 1, none, none, kEps, false); },
               "wide::group_norm: input has 3 members (dim 0), expected n=2");
  expect_error([&] { wide::group_norm(x, 3, 3, none, none, kEps, false); },
               "expected the 4 channels per member to be divisible by num_groups=3");
  expect_error([&] { wide::group_norm(x, 3, 2, at::randn({3, 4, 1}), none, kEps, false); },
               "wide::group_norm: expected weight of shape [N, C], got [3, 4, 1]");
  expect_error([&] { wide::group_norm(at::randn({4}), 3, 1, none, none, kEps, true); },
               "wide::group_norm: expected a packed input [B, N*C, *], got [4]");
  // layer_norm / rms_norm
  expect_error([&] { wide::layer_norm(x, syms({4}), none, none, kEps); },
               "wide::layer_norm: expected an N-first input [N, *, [4]], got [3, 2, 4, 5]");
  expect_error([&] { wide::layer_norm(x, syms({}), none, none, kEps); }, "wide::layer_norm: expected an N-first input");
  expect_error([&] { wide::layer_norm(x, syms({5}), none, none, kEps, "bmm"); },
               "wide::layer_norm: expected strategy 'auto', 'fused' or 'loop', got 'bmm'");
  expect_error([&] { wide::layer_norm(x, syms({5}), at::randn({2, 5}), none, kEps); },
               "wide::layer_norm: expected weight of shape [N, *normalized_shape] = [3, [5]], got [2, 5]");
  expect_error([&] { wide::layer_norm(x, syms({4, 5}), none, at::randn({3, 5}), kEps); },
               "wide::layer_norm: expected bias of shape [N, *normalized_shape]");
  expect_error([&] { wide::rms_norm(x, syms({3}), none, std::nullopt); }, "wide::rms_norm: expected an N-first input");
  expect_error([&] { wide::rms_norm(x, syms({5}), at::randn({3, 4}), std::nullopt); },
               "wide::rms_norm: expected weight of shape [N, *normalized_shape]");
  // prelu
  expect_error([&] { wide::prelu(x, at::randn({3}), false); }, "wide::prelu: expected weight [N, 1] or [N, C], got [3]");
  expect_error([&] { wide::prelu(at::randn({3, 4}), p, false); }, "wide::prelu: expected an N-first input [N, B, C, *]");
  expect_error([&] { wide::prelu(x, at::randn({2, 4}), false); }, "wide::prelu: input has 3 members (dim 0) but weight has 2");
  expect_error([&] { wide::prelu(at::randn({2, 10}), p, true); }, "packed input has 10 channels, not a multiple of N=3");
  expect_error([&] { wide::prelu(x, at::randn({3, 2}), false); }, "expected weight [N, 1] or [N, C] = [3, 4], got [3, 2]");
}

}  // namespace

// PyTorch's run-time checks of a norm in training: one value to normalise raises (a member alone
// raises it too) instead of returning 0 and setting the running variance to NaN.
TEST(WideNormChecks, OneValuePerChannelInTrainingRaises) {
  const at::Tensor x = at::randn({2, 1, 3});  // N=2 members, batch of 1, 3 channels
  const at::Tensor mean = at::zeros({2, 3}), var = at::ones({2, 3});
  wide_test::expect_error([&] { wide::batch_norm(x, std::nullopt, std::nullopt, mean, var, true, 0.1, 1e-5); },
                          "expected more than 1 value per channel when training");
  EXPECT_TRUE(at::equal(var, at::ones({2, 3})));  // nothing changed
  // eval: fine (the result is packed [B, N*C])
  EXPECT_EQ(wide::batch_norm(x, std::nullopt, std::nullopt, mean, var, false, 0.1, 1e-5).sizes(), (std::vector<int64_t>{1, 6}));
  wide_test::expect_error(
      [&] { wide::instance_norm(at::randn({2, 4, 3, 1}), std::nullopt, std::nullopt, std::nullopt, std::nullopt,
                                true, 0.1, 1e-5); },
      "expected more than 1 spatial element when training");
  wide_test::expect_error([&] { wide::group_norm(at::randn({2, 1, 3}), 2, 3); },
                          "expected more than 1 value per channel");
}
