// wide::adam_step (Adam, AdamW, AMSGrad): checks, per-member coefficients, the CPU kernel entry,
// the ATen composite and the meta kernel. Schema in registration.cpp, body in cpu/kernels_impl.h.
#include <ATen/Dispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "wide/optim/common.h"
#include "wide/optim/optim.h"

namespace wide {
namespace {

constexpr const char* kOp = "adam_step";

void check_adam(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& max_exp_avg_sq,
                const at::Tensor& step, const at::Tensor& lr, const at::Tensor& beta1,
                const at::Tensor& beta2, const at::Tensor& eps, const at::Tensor& weight_decay,
                bool amsgrad) {
  using namespace optim::detail;
  check_param(param, kOp);
  check_like(param, grad, kOp, "grad");
  check_like(param, exp_avg, kOp, "exp_avg");
  check_like(param, exp_avg_sq, kOp, "exp_avg_sq");
  TORCH_CHECK(!amsgrad || max_exp_avg_sq.has_value(),
              "wide::adam_step: amsgrad=True requires max_exp_avg_sq");
  if (max_exp_avg_sq.has_value()) check_like(param, *max_exp_avg_sq, kOp, "max_exp_avg_sq");
  const c10::SymInt n = param.sym_size(0);
  check_hparam(step, n, kOp, "step");
  TORCH_CHECK(at::isFloatingType(step.scalar_type()), "wide::adam_step: expected a floating-point "
              "step tensor, got ", step.scalar_type());
  check_hparam(lr, n, kOp, "lr");
  check_hparam(beta1, n, kOp, "beta1");
  check_hparam(beta2, n, kOp, "beta2");
  check_hparam(eps, n, kOp, "eps");
  check_hparam(weight_decay, n, kOp, "weight_decay");
}

// Call after the step increment: torch.optim's `bias_correction1 = 1 - beta1 ** step` etc.
std::vector<optim::cpu::AdamCoef> adam_coefficients(int64_t n, const at::Tensor& step,
                                                    const at::Tensor& lr, const at::Tensor& beta1,
                                                    const at::Tensor& beta2, const at::Tensor& eps,
                                                    const at::Tensor& weight_decay) {
  using optim::detail::member_values;
  const auto s = member_values(step, n), lr_v = member_values(lr, n),
             b1 = member_values(beta1, n), b2 = member_values(beta2, n),
             eps_v = member_values(eps, n), wd = member_values(weight_decay, n);
  std::vector<optim::cpu::AdamCoef> coef(n);
  for (int64_t k = 0; k < n; ++k) {
    const double bias_correction1 = 1 - std::pow(b1[k], s[k]);
    const double bias_correction2 = 1 - std::pow(b2[k], s[k]);
    const double step_size = lr_v[k] / bias_correction1;
    coef[k] = {-step_size,  1 - b1[k], b2[k], 1 - b2[k], std::pow(bias_correction2, 0.5),
               eps_v[k],    wd[k],     1 - lr_v[k] * wd[k]};
  }
  return coef;
}

void adam_step_cpu(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                   const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& max_exp_avg_sq,
                   const at::Tensor& step, const at::Tensor& lr, const at::Tensor& beta1,
                   const at::Tensor& beta2, const at::Tensor& eps, const at::Tensor& weight_decay,
                   bool decoupled, bool amsgrad, bool maximize) {
  if (!optim::detail::kernel_dtype(param)) {
    optim::adam_step_composite(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, lr, beta1,
                               beta2, eps, weight_decay, decoupled, amsgrad, maximize);
    return;
  }
  check_adam(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, lr, beta1, beta2, eps,
             weight_decay, amsgrad);
  const int64_t n = param.size(0);
  optim::detail::increment_step(step);
  const auto coef = adam_coefficients(n, step, lr, beta1, beta2, eps, weight_decay);
  if (param.numel() == 0) return;
  using optim::detail::contiguous;
  const at::Tensor p = contiguous(param), g = contiguous(grad), m = contiguous(exp_avg),
                   v = contiguous(exp_avg_sq);
  const at::Tensor vmax = amsgrad ? contiguous(*max_exp_avg_sq) : at::Tensor();
  const optim::cpu::AdamFlags flags{decoupled, amsgrad, maximize};
  AT_DISPATCH_FLOATING_TYPES(param.scalar_type(), "wide::adam_step", [&] {
    WIDE_OPTIM_ISA_CALL(adam, p.mutable_data_ptr<scalar_t>(), g.const_data_ptr<scalar_t>(),
                        m.mutable_data_ptr<scalar_t>(), v.mutable_data_ptr<scalar_t>(),
                        amsgrad ? vmax.mutable_data_ptr<scalar_t>() : nullptr, n,
                        param.numel() / n, coef.data(), flags);
  });
  optim::detail::copy_back(param, p);
  optim::detail::copy_back(exp_avg, m);
  optim::detail::copy_back(exp_avg_sq, v);
  if (amsgrad) optim::detail::copy_back(*max_exp_avg_sq, vmax);
}

void adam_step_meta(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                    const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& max_exp_avg_sq,
                    const at::Tensor& step, const at::Tensor& lr, const at::Tensor& beta1,
                    const at::Tensor& beta2, const at::Tensor& eps, const at::Tensor& weight_decay,
                    bool, bool amsgrad, bool) {
  check_adam(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, lr, beta1, beta2, eps,
             weight_decay, amsgrad);
}

}  // namespace

void optim::adam_step_composite(const at::Tensor& param, const at::Tensor& grad,
                                const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                                const std::optional<at::Tensor>& max_exp_avg_sq,
                                const at::Tensor& step, const at::Tensor& lr,
                                const at::Tensor& beta1, const at::Tensor& beta2,
                                const at::Tensor& eps, const at::Tensor& weight_decay,
                                bool decoupled, bool amsgrad, bool maximize) {
  check_adam(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, lr, beta1, beta2, eps,
             weight_decay, amsgrad);
  const int64_t n = param.size(0);
  detail::increment_step(step);
  const auto coef = adam_coefficients(n, step, lr, beta1, beta2, eps, weight_decay);
  std::vector<double> neg_step(n), omb1(n), b2(n), omb2(n), bc2(n), eps_v(n), wd(n), decay(n);
  bool any_wd = false;
  for (int64_t k = 0; k < n; ++k) {
    const auto& c = coef[k];
    neg_step[k] = c.neg_step_size, omb1[k] = c.one_minus_beta1, b2[k] = c.beta2;
    omb2[k] = c.one_minus_beta2, bc2[k] = c.bias_correction2_sqrt, eps_v[k] = c.eps;
    wd[k] = c.weight_decay, decay[k] = c.weight_decay != 0 ? c.decay : 1.0;
    any_wd |= wd[k] != 0;
  }
  using detail::member_tensor;
  at::Tensor g = maximize ? grad.neg() : grad;
  if (any_wd) {
    if (decoupled) {
      param.mul_(member_tensor(decay, param));
    } else {
      g = g.add(param.mul(member_tensor(wd, param)));
    }
  }
  exp_avg.lerp_(g, member_tensor(omb1, param));
  exp_avg_sq.mul_(member_tensor(b2, param)).add_(g.mul(g).mul_(member_tensor(omb2, param)));
  at::Tensor v_hat = exp_avg_sq;
  if (amsgrad) {
    max_exp_avg_sq->copy_(max_exp_avg_sq->maximum(exp_avg_sq));
    v_hat = *max_exp_avg_sq;
  }
  const at::Tensor denom =
      v_hat.sqrt().div_(member_tensor(bc2, param)).add_(member_tensor(eps_v, param));
  param.add_(exp_avg.mul(member_tensor(neg_step, param)).div_(denom));
}

void adam_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
               const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& max_exp_avg_sq,
               const at::Tensor& step, const at::Tensor& lr, const at::Tensor& beta1,
               const at::Tensor& beta2, const at::Tensor& eps, const at::Tensor& weight_decay,
               bool decoupled_weight_decay, bool amsgrad, bool maximize) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("wide::adam_step", "")
                       .typed<decltype(adam_step_meta)>();
  op.call(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, lr, beta1, beta2, eps,
          weight_decay, decoupled_weight_decay, amsgrad, maximize);
}

}  // namespace wide

TORCH_LIBRARY_IMPL(wide, CPU, m) { m.impl("adam_step", &wide::adam_step_cpu); }
TORCH_LIBRARY_IMPL(wide, Meta, m) { m.impl("adam_step", &wide::adam_step_meta); }
TORCH_LIBRARY_IMPL(wide, CompositeExplicitAutograd, m) {
  m.impl("adam_step", &wide::optim::adam_step_composite);
}
