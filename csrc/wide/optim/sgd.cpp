// wide::sgd_step: what is specific to SGD (arguments, per-member coefficients, the ATen
// composite); the shared skeleton is in common.h, the kernel body in cpu/kernels_impl.h and the
// schema in registration.cpp.
#include <torch/library.h>

#include <vector>

#include "wide/ops/call_op.h"
#include "wide/optim/common.h"
#include "wide/optim/optim.h"

namespace wide {
namespace {

struct Sgd : optim::detail::Optimizer<optim::cpu::SgdCoef, optim::cpu::SgdFlags, 1, 4> {
  static constexpr const char* kOp = "sgd_step";
  static constexpr StepCounter kStep = StepCounter::None;
  static constexpr States kState{{{"momentum_buffer", true}}};
  static constexpr HParamNames kHParams{"lr", "weight_decay", "momentum", "dampening"};

  static Args bind(const at::Tensor& param, const at::Tensor& grad,
                   const std::optional<at::Tensor>& momentum_buffer, const at::Tensor& lr,
                   const at::Tensor& weight_decay, const at::Tensor& momentum,
                   const at::Tensor& dampening, bool nesterov, bool maximize, bool init_buffer) {
    return {param, grad, {momentum_buffer.value_or(at::Tensor())}, at::Tensor(),
            {lr, weight_decay, momentum, dampening}, {nesterov, maximize, init_buffer}};
  }

  static Coef coefficient(const HParams& hp, double, const Flags& flags, int64_t k) {
    const auto [lr, weight_decay, momentum, dampening] = hp;
    TORCH_CHECK(!flags.nesterov || (momentum > 0 && dampening == 0), "wide::sgd_step: nesterov "
                "momentum requires momentum > 0 and dampening == 0, got momentum ", momentum,
                " and dampening ", dampening, " for member ", k);
    return {-lr, weight_decay, momentum, 1 - dampening};
  }

  static void composite(const Args& a, const std::vector<Coef>& coef) {
    const at::Tensor& param = a.param;
    const at::Tensor& buf = a.state[0];
    auto per_member = [&](auto f) { return optim::detail::member_tensor(coef, f, param); };
    const auto has_momentum = [](const Coef& c) { return c.momentum != 0 ? 1.0 : 0.0; };
    at::Tensor d = a.flags.maximize ? a.grad.neg() : a.grad;
    if (optim::detail::any_member(coef, &Coef::weight_decay)) {
      d = d.add(param.mul(per_member(&Coef::weight_decay)));
    }
    if (optim::detail::any_member(coef, has_momentum) && buf.defined()) {
      const at::Tensor mom = per_member(&Coef::momentum);
      const at::Tensor mask = per_member(has_momentum).ne(0);
      const at::Tensor new_buf = a.flags.init_buffer
                                     ? d.clone()
                                     : buf.mul(mom).add(d.mul(per_member(&Coef::one_minus_dampening)));
      buf.copy_(new_buf.where(mask, buf));
      const at::Tensor upd = a.flags.nesterov ? d.add(new_buf.mul(mom)) : new_buf;
      d = upd.where(mask, d);
    }
    param.add_(d.mul(per_member(&Coef::neg_lr)));
  }
};

using Kernels = optim::detail::StepKernels<Sgd>;

}  // namespace

void sgd_step(const at::Tensor& param, const at::Tensor& grad,
              const std::optional<at::Tensor>& momentum_buffer, const at::Tensor& lr,
              const at::Tensor& weight_decay, const at::Tensor& momentum,
              const at::Tensor& dampening, bool nesterov, bool maximize, bool init_buffer) {
  detail::call_op<"wide::sgd_step", decltype(sgd_step)>(
      param, grad, momentum_buffer, lr, weight_decay, momentum, dampening, nesterov, maximize,
      init_buffer);
}

void optim::sgd_step_composite(const at::Tensor& param, const at::Tensor& grad,
                               const std::optional<at::Tensor>& momentum_buffer,
                               const at::Tensor& lr, const at::Tensor& weight_decay,
                               const at::Tensor& momentum, const at::Tensor& dampening,
                               bool nesterov, bool maximize, bool init_buffer) {
  Kernels::composite(param, grad, momentum_buffer, lr, weight_decay, momentum, dampening, nesterov,
                     maximize, init_buffer);
}

}  // namespace wide

WIDE_OPTIM_REGISTER_STEP("sgd_step", wide::Kernels)
