// wide::adam_step (Adam, AdamW, AMSGrad): what is specific to Adam (arguments, per-member
// coefficients, the ATen composite); the shared skeleton is in common.h, the kernel body in
// cpu/kernels_impl.h and the schema in registration.cpp.
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "wide/ops/call_op.h"
#include "wide/optim/common.h"
#include "wide/optim/optim.h"

namespace wide {
namespace {

struct Adam : optim::detail::Optimizer<optim::cpu::AdamCoef, optim::cpu::AdamFlags, 3, 5> {
  static constexpr const char* kOp = "adam_step";
  static constexpr StepCounter kStep = StepCounter::ReadByCoefficients;
  static constexpr States kState{
      {{"exp_avg"}, {"exp_avg_sq"}, {"max_exp_avg_sq", true, &Flags::amsgrad, "amsgrad"}}};
  static constexpr HParamNames kHParams{"lr", "beta1", "beta2", "eps", "weight_decay"};

  static Args bind(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                   const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& max_exp_avg_sq,
                   const at::Tensor& step, const at::Tensor& lr, const at::Tensor& beta1,
                   const at::Tensor& beta2, const at::Tensor& eps, const at::Tensor& weight_decay,
                   bool decoupled_weight_decay, bool amsgrad, bool maximize) {
    return {param, grad, {exp_avg, exp_avg_sq, max_exp_avg_sq.value_or(at::Tensor())}, step,
            {lr, beta1, beta2, eps, weight_decay}, {decoupled_weight_decay, amsgrad, maximize}};
  }

  // torch.optim's `bias_correction1 = 1 - beta1 ** step` etc., with the incremented step.
  static Coef coefficient(const HParams& hp, double step, const Flags&, int64_t) {
    const auto [lr, beta1, beta2, eps, weight_decay] = hp;
    const double bias_correction1 = 1 - std::pow(beta1, step);
    const double bias_correction2 = 1 - std::pow(beta2, step);
    const double step_size = lr / bias_correction1;
    return {-step_size, 1 - beta1, beta2,        1 - beta2, std::pow(bias_correction2, 0.5),
            eps,        weight_decay, 1 - lr * weight_decay};
  }

  static void composite(const Args& a, const std::vector<Coef>& coef) {
    const at::Tensor& param = a.param;
    const at::Tensor &exp_avg = a.state[0], &exp_avg_sq = a.state[1], &max_exp_avg_sq = a.state[2];
    auto per_member = [&](auto f) { return optim::detail::member_tensor(coef, f, param); };
    at::Tensor g = a.flags.maximize ? a.grad.neg() : a.grad;
    if (optim::detail::any_member(coef, &Coef::weight_decay)) {
      if (a.flags.decoupled) {
        param.mul_(per_member([](const Coef& c) { return c.weight_decay != 0 ? c.decay : 1.0; }));
      } else {
        g = g.add(param.mul(per_member(&Coef::weight_decay)));
      }
    }
    exp_avg.lerp_(g, per_member(&Coef::one_minus_beta1));
    exp_avg_sq.mul_(per_member(&Coef::beta2)).add_(g.mul(g).mul_(per_member(&Coef::one_minus_beta2)));
    at::Tensor v_hat = exp_avg_sq;
    if (a.flags.amsgrad) {
      max_exp_avg_sq.copy_(max_exp_avg_sq.maximum(exp_avg_sq));
      v_hat = max_exp_avg_sq;
    }
    const at::Tensor denom =
        v_hat.sqrt().div_(per_member(&Coef::bias_correction2_sqrt)).add_(per_member(&Coef::eps));
    param.add_(exp_avg.mul(per_member(&Coef::neg_step_size)).div_(denom));
  }
};

using Kernels = optim::detail::StepKernels<Adam>;

}  // namespace

void adam_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
               const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& max_exp_avg_sq,
               const at::Tensor& step, const at::Tensor& lr, const at::Tensor& beta1,
               const at::Tensor& beta2, const at::Tensor& eps, const at::Tensor& weight_decay,
               bool decoupled_weight_decay, bool amsgrad, bool maximize) {
  detail::call_op<"wide::adam_step", decltype(adam_step)>(
      param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay,
      decoupled_weight_decay, amsgrad, maximize);
}

void optim::adam_step_composite(const at::Tensor& param, const at::Tensor& grad,
                                const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                                const std::optional<at::Tensor>& max_exp_avg_sq,
                                const at::Tensor& step, const at::Tensor& lr,
                                const at::Tensor& beta1, const at::Tensor& beta2,
                                const at::Tensor& eps, const at::Tensor& weight_decay,
                                bool decoupled_weight_decay, bool amsgrad, bool maximize) {
  Kernels::composite(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, lr, beta1, beta2, eps,
                     weight_decay, decoupled_weight_decay, amsgrad, maximize);
}

}  // namespace wide

WIDE_OPTIM_REGISTER_STEP("adam_step", wide::Kernels)
