// wide::adagrad_step: what is specific to Adagrad (arguments, per-member coefficients, the ATen
// composite); the shared skeleton is in common.h, the kernel body in cpu/kernels_impl.h and the
// schema in registration.cpp.
#include <torch/library.h>

#include <vector>

#include "wide/ops/call_op.h"
#include "wide/optim/common.h"
#include "wide/optim/optim.h"

namespace wide {
namespace {

struct Adagrad : optim::detail::Optimizer<optim::cpu::AdagradCoef, optim::cpu::AdagradFlags, 1, 4> {
  static constexpr const char* kOp = "adagrad_step";
  static constexpr StepCounter kStep = StepCounter::ReadByCoefficients;
  static constexpr States kState{{{"state_sum"}}};
  static constexpr HParamNames kHParams{"lr", "lr_decay", "weight_decay", "eps"};

  static Args bind(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& state_sum,
                   const at::Tensor& step, const at::Tensor& lr, const at::Tensor& lr_decay,
                   const at::Tensor& weight_decay, const at::Tensor& eps, bool maximize) {
    return {param, grad, {state_sum}, step, {lr, lr_decay, weight_decay, eps}, {maximize}};
  }

  // torch.optim's `clr = lr / (1 + (step - 1) * lr_decay)`, with the incremented step.
  static Coef coefficient(const HParams& hp, double step, const Flags&, int64_t) {
    const auto [lr, lr_decay, weight_decay, eps] = hp;
    return {-(lr / (1 + (step - 1) * lr_decay)), weight_decay, eps};
  }

  static void composite(const Args& a, const std::vector<Coef>& coef) {
    const at::Tensor& param = a.param;
    const at::Tensor& state_sum = a.state[0];
    auto per_member = [&](auto f) { return optim::detail::member_tensor(coef, f, param); };
    at::Tensor g = a.flags.maximize ? a.grad.neg() : a.grad;
    if (optim::detail::any_member(coef, &Coef::weight_decay)) {
      g = g.add(param.mul(per_member(&Coef::weight_decay)));
    }
    state_sum.add_(g.mul(g));
    const at::Tensor std = state_sum.sqrt().add_(per_member(&Coef::eps));
    param.add_(g.div(std).mul_(per_member(&Coef::neg_clr)));
  }
};

using Kernels = optim::detail::StepKernels<Adagrad>;

}  // namespace

void adagrad_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& state_sum,
                  const at::Tensor& step, const at::Tensor& lr, const at::Tensor& lr_decay,
                  const at::Tensor& weight_decay, const at::Tensor& eps, bool maximize) {
  detail::call_op<"wide::adagrad_step", decltype(adagrad_step)>(
      param, grad, state_sum, step, lr, lr_decay, weight_decay, eps, maximize);
}

void optim::adagrad_step_composite(const at::Tensor& param, const at::Tensor& grad,
                                   const at::Tensor& state_sum, const at::Tensor& step,
                                   const at::Tensor& lr, const at::Tensor& lr_decay,
                                   const at::Tensor& weight_decay, const at::Tensor& eps,
                                   bool maximize) {
  Kernels::composite(param, grad, state_sum, step, lr, lr_decay, weight_decay, eps, maximize);
}

}  // namespace wide

WIDE_OPTIM_REGISTER_STEP("adagrad_step", wide::Kernels)
