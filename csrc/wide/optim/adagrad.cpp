// wide::adagrad_step: checks, per-member coefficients, the CPU kernel entry, the ATen composite
// and the meta kernel. Schema in registration.cpp, kernel body in cpu/kernels_impl.h.
#include <ATen/Dispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <vector>

#include "wide/optim/common.h"
#include "wide/optim/optim.h"

namespace wide {
namespace {

constexpr const char* kOp = "adagrad_step";

void check_adagrad(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& state_sum,
                   const at::Tensor& step, const at::Tensor& lr, const at::Tensor& lr_decay,
                   const at::Tensor& weight_decay, const at::Tensor& eps) {
  using namespace optim::detail;
  check_param(param, kOp);
  check_like(param, grad, kOp, "grad");
  check_like(param, state_sum, kOp, "state_sum");
  const c10::SymInt n = param.sym_size(0);
  check_hparam(step, n, kOp, "step");
  TORCH_CHECK(at::isFloatingType(step.scalar_type()), "wide::adagrad_step: expected a "
              "floating-point step tensor, got ", step.scalar_type());
  check_hparam(lr, n, kOp, "lr");
  check_hparam(lr_decay, n, kOp, "lr_decay");
  check_hparam(weight_decay, n, kOp, "weight_decay");
  check_hparam(eps, n, kOp, "eps");
}

// Call after the step increment: torch.optim's `clr = lr / (1 + (step - 1) * lr_decay)`.
std::vector<optim::cpu::AdagradCoef> adagrad_coefficients(int64_t n, const at::Tensor& step,
                                                          const at::Tensor& lr,
                                                          const at::Tensor& lr_decay,
                                                          const at::Tensor& weight_decay,
                                                          const at::Tensor& eps) {
  using optim::detail::member_values;
  const auto s = member_values(step, n), lr_v = member_values(lr, n),
             decay = member_values(lr_decay, n), wd = member_values(weight_decay, n),
             eps_v = member_values(eps, n);
  std::vector<optim::cpu::AdagradCoef> coef(n);
  for (int64_t k = 0; k < n; ++k) {
    coef[k] = {-(lr_v[k] / (1 + (s[k] - 1) * decay[k])), wd[k], eps_v[k]};
  }
  return coef;
}

void adagrad_step_cpu(const at::Tensor& param, const at::Tensor& grad,
                      const at::Tensor& state_sum, const at::Tensor& step, const at::Tensor& lr,
                      const at::Tensor& lr_decay, const at::Tensor& weight_decay,
                      const at::Tensor& eps, bool maximize) {
  if (!optim::detail::kernel_dtype(param)) {
    optim::adagrad_step_composite(param, grad, state_sum, step, lr, lr_decay, weight_decay, eps,
                                  maximize);
    return;
  }
  check_adagrad(param, grad, state_sum, step, lr, lr_decay, weight_decay, eps);
  const int64_t n = param.size(0);
  optim::detail::increment_step(step);
  const auto coef = adagrad_coefficients(n, step, lr, lr_decay, weight_decay, eps);
  if (param.numel() == 0) return;
  using optim::detail::contiguous;
  const at::Tensor p = contiguous(param), g = contiguous(grad), s = contiguous(state_sum);
  const optim::cpu::AdagradFlags flags{maximize};
  AT_DISPATCH_FLOATING_TYPES(param.scalar_type(), "wide::adagrad_step", [&] {
    WIDE_OPTIM_ISA_CALL(adagrad, p.mutable_data_ptr<scalar_t>(), g.const_data_ptr<scalar_t>(),
                        s.mutable_data_ptr<scalar_t>(), n, param.numel() / n, coef.data(), flags);
  });
  optim::detail::copy_back(param, p);
  optim::detail::copy_back(state_sum, s);
}

void adagrad_step_meta(const at::Tensor& param, const at::Tensor& grad,
                       const at::Tensor& state_sum, const at::Tensor& step, const at::Tensor& lr,
                       const at::Tensor& lr_decay, const at::Tensor& weight_decay,
                       const at::Tensor& eps, bool) {
  check_adagrad(param, grad, state_sum, step, lr, lr_decay, weight_decay, eps);
}

}  // namespace

void optim::adagrad_step_composite(const at::Tensor& param, const at::Tensor& grad,
                                   const at::Tensor& state_sum, const at::Tensor& step,
                                   const at::Tensor& lr, const at::Tensor& lr_decay,
                                   const at::Tensor& weight_decay, const at::Tensor& eps,
                                   bool maximize) {
  check_adagrad(param, grad, state_sum, step, lr, lr_decay, weight_decay, eps);
  const int64_t n = param.size(0);
  detail::increment_step(step);
  const auto coef = adagrad_coefficients(n, step, lr, lr_decay, weight_decay, eps);
  std::vector<double> neg_clr(n), wd(n), eps_v(n);
  bool any_wd = false;
  for (int64_t k = 0; k < n; ++k) {
    neg_clr[k] = coef[k].neg_clr, wd[k] = coef[k].weight_decay, eps_v[k] = coef[k].eps;
    any_wd |= wd[k] != 0;
  }
  using detail::member_tensor;
  at::Tensor g = maximize ? grad.neg() : grad;
  if (any_wd) g = g.add(param.mul(member_tensor(wd, param)));
  state_sum.add_(g.mul(g));
  const at::Tensor std = state_sum.sqrt().add_(member_tensor(eps_v, param));
  param.add_(g.div(std).mul_(member_tensor(neg_clr, param)));
}

void adagrad_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& state_sum,
                  const at::Tensor& step, const at::Tensor& lr, const at::Tensor& lr_decay,
                  const at::Tensor& weight_decay, const at::Tensor& eps, bool maximize) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("wide::adagrad_step", "")
                       .typed<decltype(adagrad_step_meta)>();
  op.call(param, grad, state_sum, step, lr, lr_decay, weight_decay, eps, maximize);
}

}  // namespace wide

TORCH_LIBRARY_IMPL(wide, CPU, m) { m.impl("adagrad_step", &wide::adagrad_step_cpu); }
TORCH_LIBRARY_IMPL(wide, Meta, m) { m.impl("adagrad_step", &wide::adagrad_step_meta); }
TORCH_LIBRARY_IMPL(wide, CompositeExplicitAutograd, m) {
  m.impl("adagrad_step", &wide::optim::adagrad_step_composite);
}
