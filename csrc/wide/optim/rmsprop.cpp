// wide::rmsprop_step: what is specific to RMSprop (arguments, per-member coefficients, the ATen
// composite); the shared skeleton is in common.h, the kernel body in cpu/kernels_impl.h and the
// schema in registration.cpp.
#include <torch/library.h>

#include <vector>

#include "wide/ops/call_op.h"
#include "wide/optim/common.h"
#include "wide/optim/optim.h"

namespace wide {
namespace {

struct Rmsprop : optim::detail::Optimizer<optim::cpu::RmspropCoef, optim::cpu::RmspropFlags, 3, 5> {
  static constexpr const char* kOp = "rmsprop_step";
  static constexpr StepCounter kStep = StepCounter::Counted;
  static constexpr States kState{
      {{"square_avg"}, {"grad_avg", true, &Flags::centered, "centered"}, {"momentum_buffer", true}}};
  static constexpr HParamNames kHParams{"lr", "alpha", "eps", "weight_decay", "momentum"};

  static Args bind(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& square_avg,
                   const std::optional<at::Tensor>& grad_avg,
                   const std::optional<at::Tensor>& momentum_buffer, const at::Tensor& step,
                   const at::Tensor& lr, const at::Tensor& alpha, const at::Tensor& eps,
                   const at::Tensor& weight_decay, const at::Tensor& momentum, bool centered,
                   bool maximize) {
    return {param, grad,
            {square_avg, grad_avg.value_or(at::Tensor()), momentum_buffer.value_or(at::Tensor())},
            step, {lr, alpha, eps, weight_decay, momentum},
            {centered, maximize, momentum_buffer.has_value()}};
  }

  static Coef coefficient(const HParams& hp, double, const Flags&, int64_t) {
    const auto [lr, alpha, eps, weight_decay, momentum] = hp;
    return {-lr, alpha, 1 - alpha, eps, weight_decay, momentum};
  }

  static void composite(const Args& a, const std::vector<Coef>& coef) {
    const at::Tensor& param = a.param;
    const at::Tensor &square_avg = a.state[0], &grad_avg = a.state[1], &buf = a.state[2];
    auto per_member = [&](auto f) { return optim::detail::member_tensor(coef, f, param); };
    const auto has_momentum = [](const Coef& c) { return c.momentum > 0 ? 1.0 : 0.0; };
    at::Tensor g = a.flags.maximize ? a.grad.neg() : a.grad;
    if (optim::detail::any_member(coef, &Coef::weight_decay)) {
      g = g.add(param.mul(per_member(&Coef::weight_decay)));
    }
    square_avg.mul_(per_member(&Coef::alpha)).add_(g.mul(g).mul_(per_member(&Coef::one_minus_alpha)));
    at::Tensor avg;
    if (a.flags.centered) {
      grad_avg.lerp_(g, per_member(&Coef::one_minus_alpha));
      avg = square_avg.sub(grad_avg.mul(grad_avg)).sqrt_();
    } else {
      avg = square_avg.sqrt();
    }
    avg.add_(per_member(&Coef::eps));
    at::Tensor upd = g.div(avg);
    if (optim::detail::any_member(coef, has_momentum) && buf.defined()) {
      const at::Tensor mask = per_member(has_momentum).ne(0);
      const at::Tensor new_buf = buf.mul(per_member(&Coef::momentum)).add_(upd);
      buf.copy_(new_buf.where(mask, buf));
      upd = new_buf.where(mask, upd);
    }
    param.add_(upd.mul_(per_member(&Coef::neg_lr)));
  }
};

using Kernels = optim::detail::StepKernels<Rmsprop>;

}  // namespace

void rmsprop_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& square_avg,
                  const std::optional<at::Tensor>& grad_avg,
                  const std::optional<at::Tensor>& momentum_buffer, const at::Tensor& step,
                  const at::Tensor& lr, const at::Tensor& alpha, const at::Tensor& eps,
                  const at::Tensor& weight_decay, const at::Tensor& momentum, bool centered,
                  bool maximize) {
  detail::call_op<"wide::rmsprop_step", decltype(rmsprop_step)>(
      param, grad, square_avg, grad_avg, momentum_buffer, step, lr, alpha, eps, weight_decay,
      momentum, centered, maximize);
}

void optim::rmsprop_step_composite(const at::Tensor& param, const at::Tensor& grad,
                                   const at::Tensor& square_avg,
                                   const std::optional<at::Tensor>& grad_avg,
                                   const std::optional<at::Tensor>& momentum_buffer,
                                   const at::Tensor& step, const at::Tensor& lr,
                                   const at::Tensor& alpha, const at::Tensor& eps,
                                   const at::Tensor& weight_decay, const at::Tensor& momentum,
                                   bool centered, bool maximize) {
  Kernels::composite(param, grad, square_avg, grad_avg, momentum_buffer, step, lr, alpha, eps,
                     weight_decay, momentum, centered, maximize);
}

}  // namespace wide

WIDE_OPTIM_REGISTER_STEP("rmsprop_step", wide::Kernels)
