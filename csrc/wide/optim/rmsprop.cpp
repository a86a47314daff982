// wide::rmsprop_step: checks, per-member coefficients, the CPU kernel entry, the ATen composite
// and the meta kernel. Schema in registration.cpp, kernel body in cpu/kernels_impl.h.
#include <ATen/Dispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <vector>

#include "wide/optim/common.h"
#include "wide/optim/optim.h"

namespace wide {
namespace {

constexpr const char* kOp = "rmsprop_step";

void check_rmsprop(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& square_avg,
                   const std::optional<at::Tensor>& grad_avg,
                   const std::optional<at::Tensor>& buf, const at::Tensor& step,
                   const at::Tensor& lr, const at::Tensor& alpha, const at::Tensor& eps,
                   const at::Tensor& weight_decay, const at::Tensor& momentum, bool centered) {
  using namespace optim::detail;
  check_param(param, kOp);
  check_like(param, grad, kOp, "grad");
  check_like(param, square_avg, kOp, "square_avg");
  TORCH_CHECK(!centered || grad_avg.has_value(),
              "wide::rmsprop_step: centered=True requires grad_avg");
  if (grad_avg.has_value()) check_like(param, *grad_avg, kOp, "grad_avg");
  if (buf.has_value()) check_like(param, *buf, kOp, "momentum_buffer");
  const c10::SymInt n = param.sym_size(0);
  check_hparam(step, n, kOp, "step");
  TORCH_CHECK(at::isFloatingType(step.scalar_type()), "wide::rmsprop_step: expected a "
              "floating-point step tensor, got ", step.scalar_type());
  check_hparam(lr, n, kOp, "lr");
  check_hparam(alpha, n, kOp, "alpha");
  check_hparam(eps, n, kOp, "eps");
  check_hparam(weight_decay, n, kOp, "weight_decay");
  check_hparam(momentum, n, kOp, "momentum");
}

std::vector<optim::cpu::RmspropCoef> rmsprop_coefficients(int64_t n, const at::Tensor& lr,
                                                          const at::Tensor& alpha,
                                                          const at::Tensor& eps,
                                                          const at::Tensor& weight_decay,
                                                          const at::Tensor& momentum) {
  using optim::detail::member_values;
  const auto lr_v = member_values(lr, n), a = member_values(alpha, n),
             eps_v = member_values(eps, n), wd = member_values(weight_decay, n),
             mom = member_values(momentum, n);
  std::vector<optim::cpu::RmspropCoef> coef(n);
  for (int64_t k = 0; k < n; ++k) coef[k] = {-lr_v[k], a[k], 1 - a[k], eps_v[k], wd[k], mom[k]};
  return coef;
}

void rmsprop_step_cpu(const at::Tensor& param, const at::Tensor& grad,
                      const at::Tensor& square_avg, const std::optional<at::Tensor>& grad_avg,
                      const std::optional<at::Tensor>& buf, const at::Tensor& step,
                      const at::Tensor& lr, const at::Tensor& alpha, const at::Tensor& eps,
                      const at::Tensor& weight_decay, const at::Tensor& momentum, bool centered,
                      bool maximize) {
  if (!optim::detail::kernel_dtype(param)) {
    optim::rmsprop_step_composite(param, grad, square_avg, grad_avg, buf, step, lr, alpha, eps,
                                  weight_decay, momentum, centered, maximize);
    return;
  }
  check_rmsprop(param, grad, square_avg, grad_avg, buf, step, lr, alpha, eps, weight_decay,
                momentum, centered);
  const int64_t n = param.size(0);
  optim::detail::increment_step(step);
  const auto coef = rmsprop_coefficients(n, lr, alpha, eps, weight_decay, momentum);
  if (param.numel() == 0) return;
  using optim::detail::contiguous;
  const at::Tensor p = contiguous(param), g = contiguous(grad), sq = contiguous(square_avg);
  const at::Tensor ga = centered ? contiguous(*grad_avg) : at::Tensor();
  const at::Tensor b = buf.has_value() ? contiguous(*buf) : at::Tensor();
  const optim::cpu::RmspropFlags flags{centered, maximize, buf.has_value()};
  AT_DISPATCH_FLOATING_TYPES(param.scalar_type(), "wide::rmsprop_step", [&] {
    WIDE_OPTIM_ISA_CALL(rmsprop, p.mutable_data_ptr<scalar_t>(), g.const_data_ptr<scalar_t>(),
                        sq.mutable_data_ptr<scalar_t>(),
                        centered ? ga.mutable_data_ptr<scalar_t>() : nullptr,
                        b.defined() ? b.mutable_data_ptr<scalar_t>() : nullptr, n,
                        param.numel() / n, coef.data(), flags);
  });
  optim::detail::copy_back(param, p);
  optim::detail::copy_back(square_avg, sq);
  if (centered) optim::detail::copy_back(*grad_avg, ga);
  if (buf.has_value()) optim::detail::copy_back(*buf, b);
}

void rmsprop_step_meta(const at::Tensor& param, const at::Tensor& grad,
                       const at::Tensor& square_avg, const std::optional<at::Tensor>& grad_avg,
                       const std::optional<at::Tensor>& buf, const at::Tensor& step,
                       const at::Tensor& lr, const at::Tensor& alpha, const at::Tensor& eps,
                       const at::Tensor& weight_decay, const at::Tensor& momentum, bool centered,
                       bool) {
  check_rmsprop(param, grad, square_avg, grad_avg, buf, step, lr, alpha, eps, weight_decay,
                momentum, centered);
}

}  // namespace

void optim::rmsprop_step_composite(const at::Tensor& param, const at::Tensor& grad,
                                   const at::Tensor& square_avg,
                                   const std::optional<at::Tensor>& grad_avg,
                                   const std::optional<at::Tensor>& buf, const at::Tensor& step,
                                   const at::Tensor& lr, const at::Tensor& alpha,
                                   const at::Tensor& eps, const at::Tensor& weight_decay,
                                   const at::Tensor& momentum, bool centered, bool maximize) {
  check_rmsprop(param, grad, square_avg, grad_avg, buf, step, lr, alpha, eps, weight_decay,
                momentum, centered);
  const int64_t n = param.size(0);
  detail::increment_step(step);
  const auto coef = rmsprop_coefficients(n, lr, alpha, eps, weight_decay, momentum);
  std::vector<double> neg_lr(n), a(n), oma(n), eps_v(n), wd(n), mom(n), has_mom(n);
  bool any_wd = false, any_mom = false;
  for (int64_t k = 0; k < n; ++k) {
    const auto& c = coef[k];
    neg_lr[k] = c.neg_lr, a[k] = c.alpha, oma[k] = c.one_minus_alpha, eps_v[k] = c.eps;
    wd[k] = c.weight_decay, mom[k] = c.momentum, has_mom[k] = c.momentum > 0 ? 1 : 0;
    any_wd |= wd[k] != 0;
    any_mom |= has_mom[k] != 0;
  }
  using detail::member_tensor;
  at::Tensor g = maximize ? grad.neg() : grad;
  if (any_wd) g = g.add(param.mul(member_tensor(wd, param)));
  square_avg.mul_(member_tensor(a, param)).add_(g.mul(g).mul_(member_tensor(oma, param)));
  at::Tensor avg;
  if (centered) {
    grad_avg->lerp_(g, member_tensor(oma, param));
    avg = square_avg.sub(grad_avg->mul(*grad_avg)).sqrt_();
  } else {
    avg = square_avg.sqrt();
  }
  avg.add_(member_tensor(eps_v, param));
  at::Tensor upd = g.div(avg);
  if (any_mom && buf.has_value()) {
    const at::Tensor mask = member_tensor(has_mom, param).ne(0);
    const at::Tensor new_buf = buf->mul(member_tensor(mom, param)).add_(upd);
    buf->copy_(new_buf.where(mask, *buf));
    upd = new_buf.where(mask, upd);
  }
  param.add_(upd.mul_(member_tensor(neg_lr, param)));
}

void rmsprop_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& square_avg,
                  const std::optional<at::Tensor>& grad_avg,
                  const std::optional<at::Tensor>& momentum_buffer, const at::Tensor& step,
                  const at::Tensor& lr, const at::Tensor& alpha, const at::Tensor& eps,
                  const at::Tensor& weight_decay, const at::Tensor& momentum, bool centered,
                  bool maximize) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("wide::rmsprop_step", "")
                       .typed<decltype(rmsprop_step_meta)>();
  op.call(param, grad, square_avg, grad_avg, momentum_buffer, step, lr, alpha, eps, weight_decay,
          momentum, centered, maximize);
}

}  // namespace wide

TORCH_LIBRARY_IMPL(wide, CPU, m) { m.impl("rmsprop_step", &wide::rmsprop_step_cpu); }
TORCH_LIBRARY_IMPL(wide, Meta, m) { m.impl("rmsprop_step", &wide::rmsprop_step_meta); }
TORCH_LIBRARY_IMPL(wide, CompositeExplicitAutograd, m) {
  m.impl("rmsprop_step", &wide::optim::rmsprop_step_composite);
}
