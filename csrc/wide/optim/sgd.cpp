// wide::sgd_step: checks, per-member coefficients, the CPU kernel entry, the ATen composite and
// the meta kernel. The schema is in registration.cpp; the kernel body in cpu/kernels_impl.h.
#include <ATen/Dispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <vector>

#include "wide/optim/common.h"
#include "wide/optim/optim.h"

namespace wide {
namespace {

constexpr const char* kOp = "sgd_step";

void check_sgd(const at::Tensor& param, const at::Tensor& grad,
               const std::optional<at::Tensor>& buf, const at::Tensor& lr,
               const at::Tensor& weight_decay, const at::Tensor& momentum,
               const at::Tensor& dampening) {
  optim::detail::check_param(param, kOp);
  optim::detail::check_like(param, grad, kOp, "grad");
  if (buf.has_value()) optim::detail::check_like(param, *buf, kOp, "momentum_buffer");
  const c10::SymInt n = param.sym_size(0);
  optim::detail::check_hparam(lr, n, kOp, "lr");
  optim::detail::check_hparam(weight_decay, n, kOp, "weight_decay");
  optim::detail::check_hparam(momentum, n, kOp, "momentum");
  optim::detail::check_hparam(dampening, n, kOp, "dampening");
}

std::vector<optim::cpu::SgdCoef> sgd_coefficients(int64_t n, const at::Tensor& lr,
                                                  const at::Tensor& weight_decay,
                                                  const at::Tensor& momentum,
                                                  const at::Tensor& dampening, bool nesterov) {
  const auto lr_v = optim::detail::member_values(lr, n);
  const auto wd_v = optim::detail::member_values(weight_decay, n);
  const auto mom_v = optim::detail::member_values(momentum, n);
  const auto damp_v = optim::detail::member_values(dampening, n);
  std::vector<optim::cpu::SgdCoef> coef(n);
  for (int64_t k = 0; k < n; ++k) {
    TORCH_CHECK(!nesterov || (mom_v[k] > 0 && damp_v[k] == 0), "wide::sgd_step: nesterov "
                "momentum requires momentum > 0 and dampening == 0, got momentum ", mom_v[k],
                " and dampening ", damp_v[k], " for member ", k);
    coef[k] = {-lr_v[k], wd_v[k], mom_v[k], 1 - damp_v[k]};
  }
  return coef;
}

void sgd_step_cpu(const at::Tensor& param, const at::Tensor& grad,
                  const std::optional<at::Tensor>& buf, const at::Tensor& lr,
                  const at::Tensor& weight_decay, const at::Tensor& momentum,
                  const at::Tensor& dampening, bool nesterov, bool maximize, bool init_buffer) {
  if (!optim::detail::kernel_dtype(param)) {
    optim::sgd_step_composite(param, grad, buf, lr, weight_decay, momentum, dampening, nesterov,
                              maximize, init_buffer);
    return;
  }
  check_sgd(param, grad, buf, lr, weight_decay, momentum, dampening);
  const int64_t n = param.size(0);
  const auto coef = sgd_coefficients(n, lr, weight_decay, momentum, dampening, nesterov);
  if (param.numel() == 0) return;
  const at::Tensor p = optim::detail::contiguous(param);
  const at::Tensor g = optim::detail::contiguous(grad);
  const at::Tensor b = buf.has_value() ? optim::detail::contiguous(*buf) : at::Tensor();
  const optim::cpu::SgdFlags flags{nesterov, maximize, init_buffer};
  AT_DISPATCH_FLOATING_TYPES(param.scalar_type(), "wide::sgd_step", [&] {
    WIDE_OPTIM_ISA_CALL(sgd, p.mutable_data_ptr<scalar_t>(), g.const_data_ptr<scalar_t>(),
                        b.defined() ? b.mutable_data_ptr<scalar_t>() : nullptr, n,
                        param.numel() / n, coef.data(), flags);
  });
  optim::detail::copy_back(param, p);
  if (buf.has_value()) optim::detail::copy_back(*buf, b);
}

void sgd_step_meta(const at::Tensor& param, const at::Tensor& grad,
                   const std::optional<at::Tensor>& buf, const at::Tensor& lr,
                   const at::Tensor& weight_decay, const at::Tensor& momentum,
                   const at::Tensor& dampening, bool, bool, bool) {
  check_sgd(param, grad, buf, lr, weight_decay, momentum, dampening);
}

}  // namespace

void optim::sgd_step_composite(const at::Tensor& param, const at::Tensor& grad,
                               const std::optional<at::Tensor>& buf, const at::Tensor& lr,
                               const at::Tensor& weight_decay, const at::Tensor& momentum,
                               const at::Tensor& dampening, bool nesterov, bool maximize,
                               bool init_buffer) {
  check_sgd(param, grad, buf, lr, weight_decay, momentum, dampening);
  const int64_t n = param.size(0);
  const auto coef = sgd_coefficients(n, lr, weight_decay, momentum, dampening, nesterov);
  std::vector<double> neg_lr(n), wd(n), mom(n), omd(n), has_mom(n);
  bool any_wd = false, any_mom = false;
  for (int64_t k = 0; k < n; ++k) {
    neg_lr[k] = coef[k].neg_lr;
    wd[k] = coef[k].weight_decay;
    mom[k] = coef[k].momentum;
    omd[k] = coef[k].one_minus_dampening;
    has_mom[k] = coef[k].momentum != 0 ? 1 : 0;
    any_wd |= wd[k] != 0;
    any_mom |= has_mom[k] != 0;
  }
  using detail::member_tensor;
  at::Tensor d = maximize ? grad.neg() : grad;
  if (any_wd) d = d.add(param.mul(member_tensor(wd, param)));
  if (any_mom && buf.has_value()) {
    const at::Tensor mom_t = member_tensor(mom, param);
    const at::Tensor mask = member_tensor(has_mom, param).ne(0);
    const at::Tensor new_buf =
        init_buffer ? d.clone() : buf->mul(mom_t).add(d.mul(member_tensor(omd, param)));
    buf->copy_(new_buf.where(mask, *buf));
    const at::Tensor upd = nesterov ? d.add(new_buf.mul(mom_t)) : new_buf;
    d = upd.where(mask, d);
  }
  param.add_(d.mul(member_tensor(neg_lr, param)));
}

void sgd_step(const at::Tensor& param, const at::Tensor& grad,
              const std::optional<at::Tensor>& momentum_buffer, const at::Tensor& lr,
              const at::Tensor& weight_decay, const at::Tensor& momentum,
              const at::Tensor& dampening, bool nesterov, bool maximize, bool init_buffer) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("wide::sgd_step", "")
                       .typed<decltype(sgd_step_meta)>();
  op.call(param, grad, momentum_buffer, lr, weight_decay, momentum, dampening, nesterov, maximize,
          init_buffer);
}

}  // namespace wide

TORCH_LIBRARY_IMPL(wide, CPU, m) { m.impl("sgd_step", &wide::sgd_step_cpu); }
TORCH_LIBRARY_IMPL(wide, Meta, m) { m.impl("sgd_step", &wide::sgd_step_meta); }
TORCH_LIBRARY_IMPL(wide, CompositeExplicitAutograd, m) {
  m.impl("sgd_step", &wide::optim::sgd_step_composite);
}
