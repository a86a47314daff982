// The fused optimizer steps (wide::*_step) through the dispatcher, for every instruction set the
// CPU has, against the ATen composite (wide::optim::*_step_composite) and, for SGD, against a
// per-member reference written with plain ATen calls.
#include <ATen/ops/allclose.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <ATen/ops/linspace.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>
#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

#include "wide/optim/cpu/kernels.h"
#include "wide/optim/optim.h"
#include "wide_test_utils.h"

namespace {

at::Tensor hp(double lo, double hi, int64_t n) {
  return at::linspace(lo, hi, n, at::TensorOptions().dtype(at::kDouble));
}

std::vector<at::Tensor> clones(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  for (const auto& t : ts) out.push_back(t.defined() ? t.clone() : t);
  return out;
}

bool close(const at::Tensor& a, const at::Tensor& b) {
  const bool fp32 = a.scalar_type() == at::kFloat;
  return at::allclose(a, b, fp32 ? 1e-5 : 1e-12, fp32 ? 1e-6 : 1e-12);
}

// ISA, dtype, member shape (numel covers full vectors + tails), contiguous
using Case = std::tuple<std::string, at::ScalarType, int64_t, bool>;

class WideOptimTest : public wide_test::IsaTest<Case> {
 protected:
  at::Tensor make(int64_t n, bool positive = false) const {
    const auto& [isa, dtype, m, contiguous] = GetParam();
    at::Tensor t = contiguous ? at::randn({n, m}, at::TensorOptions().dtype(dtype))
                              : at::randn({m, n}, at::TensorOptions().dtype(dtype)).t();
    return positive ? t.abs() : t;
  }
};

TEST_P(WideOptimTest, SgdMatchesPerMemberReferenceAndComposite) {
  const int64_t n = 5;
  const at::Tensor lr = hp(0.01, 0.1, n), wd = hp(0, 0.01, n), mom = hp(0.0, 0.9, n),
                   damp = at::zeros({1}, at::kDouble);
  std::vector<at::Tensor> a = {make(n), make(n), make(n)};
  std::vector<at::Tensor> b = clones(a), ref = clones(a);
  for (int step = 0; step < 3; ++step) {
    wide::sgd_step(a[0], a[1], a[2], lr, wd, mom, damp, false, false, step == 0);
    wide::optim::sgd_step_composite(b[0], b[1], b[2], lr, wd, mom, damp, false, false, step == 0);
    for (int64_t k = 0; k < n; ++k) {  // torch.optim.SGD single-tensor path, member k
      at::Tensor p = ref[0][k], g = ref[1][k].add(p, wd[k].item<double>()), buf = ref[2][k];
      const double mk = mom[k].item<double>();
      if (mk != 0) {
        if (step == 0) buf.copy_(g); else buf.mul_(mk).add_(g);
        g = buf;
      }
      p.add_(g, -lr[k].item<double>());
    }
  }
  EXPECT_TRUE(close(a[0], ref[0])) << "kernel vs reference";
  EXPECT_TRUE(close(a[0], b[0])) << "kernel vs composite";
}

TEST_P(WideOptimTest, AdamAmsgradMatchesComposite) {
  const int64_t n = 4;
  for (bool decoupled : {false, true}) {
    std::vector<at::Tensor> a = {make(n), make(n), make(n), make(n, true), make(n, true),
                                 at::zeros({n})};
    std::vector<at::Tensor> b = clones(a);
    for (int step = 0; step < 3; ++step) {
      wide::adam_step(a[0], a[1], a[2], a[3], a[4], a[5], hp(1e-3, 1e-1, n), hp(0.8, 0.9, n),
                      hp(0.99, 0.999, n), hp(1e-8, 1e-6, n), hp(0, 0.1, n), decoupled, true, false);
      wide::optim::adam_step_composite(b[0], b[1], b[2], b[3], b[4], b[5], hp(1e-3, 1e-1, n),
                                       hp(0.8, 0.9, n), hp(0.99, 0.999, n), hp(1e-8, 1e-6, n),
                                       hp(0, 0.1, n), decoupled, true, false);
    }
    for (size_t k = 0; k < a.size(); ++k) EXPECT_TRUE(close(a[k], b[k])) << "tensor " << k;
    EXPECT_EQ(a[5][0].item<float>(), 3.0f);
  }
}

TEST_P(WideOptimTest, RmspropCenteredMomentumMatchesComposite) {
  const int64_t n = 3;
  std::vector<at::Tensor> a = {make(n), make(n), make(n, true), at::zeros({n, std::get<2>(GetParam())}, make(1).options()), make(n),
                               at::zeros({n})};
  std::vector<at::Tensor> b = clones(a);
  for (int step = 0; step < 3; ++step) {
    wide::rmsprop_step(a[0], a[1], a[2], a[3], a[4], a[5], hp(1e-3, 1e-2, n), hp(0.9, 0.99, n),
                       hp(1e-8, 1e-8, n), hp(0, 0.1, n), hp(0, 0.9, n), true, true);
    wide::optim::rmsprop_step_composite(b[0], b[1], b[2], b[3], b[4], b[5], hp(1e-3, 1e-2, n),
                                        hp(0.9, 0.99, n), hp(1e-8, 1e-8, n), hp(0, 0.1, n),
                                        hp(0, 0.9, n), true, true);
  }
  for (size_t k = 0; k < a.size(); ++k) EXPECT_TRUE(close(a[k], b[k])) << "tensor " << k;
}

TEST_P(WideOptimTest, AdagradMatchesComposite) {
  const int64_t n = 6;
  std::vector<at::Tensor> a = {make(n), make(n), make(n, true), at::zeros({n})};
  std::vector<at::Tensor> b = clones(a);
  for (int step = 0; step < 3; ++step) {
    wide::adagrad_step(a[0], a[1], a[2], a[3], hp(0.01, 0.1, n), hp(0, 0.1, n), hp(0, 0.1, n),
                       hp(1e-10, 1e-10, n), false);
    wide::optim::adagrad_step_composite(b[0], b[1], b[2], b[3], hp(0.01, 0.1, n), hp(0, 0.1, n),
                                        hp(0, 0.1, n), hp(1e-10, 1e-10, n), false);
  }
  for (size_t k = 0; k < a.size(); ++k) EXPECT_TRUE(close(a[k], b[k])) << "tensor " << k;
}

INSTANTIATE_TEST_SUITE_P(
    Grid, WideOptimTest,
    ::testing::Combine(::testing::Values("default", "avx2", "avx512"),
                       ::testing::Values(at::kFloat, at::kDouble),
                       ::testing::Values(1, 37, 4099), ::testing::Bool()));

TEST(WideOptim, RejectsWrongLengthHyperparametersBeforeChangingAnything) {
  const at::Tensor p = at::randn({4, 3}), g = at::randn({4, 3}), before = p.clone();
  const at::Tensor m = at::zeros({4, 3}), v = at::zeros({4, 3}), step = at::zeros({4});
  const at::Tensor ok = at::full({4}, 0.1, at::kDouble), bad = at::full({3}, 0.1, at::kDouble);
  EXPECT_THROW(wide::adam_step(p, g, m, v, std::nullopt, step, bad, ok, ok, ok, ok), c10::Error);
  EXPECT_THROW(wide::sgd_step(p, g, std::nullopt, ok, ok, bad, ok), c10::Error);
  EXPECT_THROW(wide::adam_step(p, g, m, at::zeros({4, 2}), std::nullopt, step, ok, ok, ok, ok, ok),
               c10::Error);
  EXPECT_TRUE(at::equal(p, before));
  EXPECT_EQ(step.sum().item<float>(), 0.0f);
}

TEST(WideOptim, RefusesWrittenTensorsThatShareMemoryBeforeChangingAnything) {
  const at::Tensor p = at::randn({4, 3}), g = at::randn({4, 3}), before = p.clone();
  const at::Tensor m = at::zeros({4, 3}), step = at::zeros({4});
  const at::Tensor ok = at::full({4}, 0.1, at::kDouble);
  wide_test::expect_error([&] { wide::adam_step(p, g, m, m, std::nullopt, step, ok, ok, ok, ok, ok); },
                          "wide::adam_step: exp_avg shares memory with exp_avg_sq (the same tensor)");
  const at::Tensor buf = at::zeros({4, 4});  // columns 0-2 and 1-3: two views sharing two columns
  wide_test::expect_error(
      [&] { wide::adam_step(p, g, buf.narrow(1, 0, 3), buf.narrow(1, 1, 3), std::nullopt, step, ok, ok, ok, ok, ok); },
      "wide::adam_step: exp_avg shares memory with exp_avg_sq;");
  wide_test::expect_error([&] { wide::sgd_step(p, p, std::nullopt, ok, ok, ok, ok); },
                          "wide::sgd_step: param shares memory with grad");
  EXPECT_TRUE(at::equal(p, before));
  EXPECT_EQ(step.sum().item<float>(), 0.0f);
  // Views of one buffer that never share an element are separate tensors.
  const at::Tensor halves = at::zeros({4, 2, 3});
  wide::adam_step(p, g, halves.select(1, 0), halves.select(1, 1), std::nullopt, step, ok, ok, ok, ok, ok);
  EXPECT_EQ(step.sum().item<float>(), 4.0f);
}

TEST(WideOptim, EmptyParameterStillCountsTheStep) {
  const at::Tensor p = at::randn({3, 0}), step = at::zeros({3});
  const at::Tensor one = at::full({1}, 0.1, at::kDouble);
  wide::adam_step(p, p.clone(), p.clone(), p.clone(), std::nullopt, step, one, one, one, one, one);
  EXPECT_EQ(step[2].item<float>(), 1.0f);
}

}  // namespace
