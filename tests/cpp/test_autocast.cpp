// The autocast kernels of the wide ops (ops/autocast.cpp) from C++: with CPU autocast on (as
// at::autocast::set_autocast_enabled(at::kCPU, true) turns it on: the AutocastCPU key no longer
// excluded on this thread; the CPU autocast dtype defaults to bfloat16), each op returns the dtype
// the ATen op it replaces returns, and the same values as ATen per member up to bfloat16 rounding.
#include <ATen/ops/allclose.h>
#include <ATen/ops/layer_norm.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <gtest/gtest.h>

#include <vector>

#include "wide/ops/linear.h"
#include "wide/ops/norm.h"
#include "wide/ops/rnn.h"

namespace {

// CPU autocast on for the scope (the thread's previous state restored after).
class CpuAutocast {
 public:
  CpuAutocast() : was_excluded_(c10::impl::tls_is_dispatch_key_excluded(c10::DispatchKey::AutocastCPU)) {
    c10::impl::tls_set_dispatch_key_excluded(c10::DispatchKey::AutocastCPU, false);
  }
  ~CpuAutocast() { c10::impl::tls_set_dispatch_key_excluded(c10::DispatchKey::AutocastCPU, was_excluded_); }

 private:
  bool was_excluded_;
};

constexpr int64_t kN = 3;

TEST(WideAutocast, LinearRunsInBfloat16LikeAtenLinear) {
  const at::Tensor x = at::randn({kN, 4, 6}), w = at::randn({kN, 5, 6}), b = at::randn({kN, 5});
  at::Tensor y;
  std::vector<at::Tensor> refs;
  {
    CpuAutocast on;
    y = wide::linear(x, w, b);
    for (int64_t n = 0; n < kN; ++n) refs.push_back(at::linear(x[n], w[n], b[n]));
  }
  EXPECT_EQ(y.scalar_type(), at::kBFloat16);
  EXPECT_EQ(refs[0].scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::allclose(y.to(at::kFloat), at::stack(refs).to(at::kFloat), 2e-2, 2e-2));
  EXPECT_EQ(wide::linear(x, w, b).scalar_type(), at::kFloat);  // autocast off again
}

TEST(WideAutocast, LayerNormKeepsABfloat16ActivationLikeAtenOnCpu) {
  const at::Tensor x = at::randn({kN, 2, 6}).to(at::kBFloat16), w = at::randn({kN, 6}), b = at::randn({kN, 6});
  at::Tensor y;
  std::vector<at::Tensor> refs;
  {
    CpuAutocast on;
    y = wide::layer_norm(x, c10::SymIntArrayRef({c10::SymInt(6)}), w, b, 1e-5);
    for (int64_t n = 0; n < kN; ++n) refs.push_back(at::layer_norm(x[n], {6}, w[n], b[n], 1e-5));
  }
  EXPECT_EQ(y.scalar_type(), at::kBFloat16);
  EXPECT_EQ(refs[0].scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::allclose(y.to(at::kFloat), at::stack(refs).to(at::kFloat), 2e-2, 2e-2));
}

TEST(WideAutocast, GruKeepsAFloat32StateAndLstmRunsInBfloat16) {
  const int64_t in = 4, hidden = 5;
  const at::Tensor x = at::randn({kN, 3, 2, in});
  auto params = [&](int64_t gates) {
    return std::vector<at::Tensor>{at::randn({kN, gates * hidden, in}), at::randn({kN, gates * hidden, hidden}),
                                   at::randn({kN, gates * hidden}), at::randn({kN, gates * hidden})};
  };
  CpuAutocast on;
  const auto gru = wide::rnn(x, {}, params(3), "GRU", 1, false, false, 0.0, false, true);
  EXPECT_EQ(std::get<0>(gru).scalar_type(), at::kFloat);  // zeros of the float32 input's dtype
  const auto gru_bf16 = wide::rnn(x.to(at::kBFloat16), {}, params(3), "GRU", 1, false, false, 0.0, false, true);
  EXPECT_EQ(std::get<0>(gru_bf16).scalar_type(), at::kBFloat16);
  const auto lstm = wide::rnn(x, {}, params(4), "LSTM", 1, false, false, 0.0, false, true);
  EXPECT_EQ(std::get<0>(lstm).scalar_type(), at::kBFloat16);
  EXPECT_EQ(std::get<1>(lstm)[1].scalar_type(), at::kBFloat16);
}

}  // namespace
