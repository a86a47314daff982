// wide::fused_norm and wide::add_layer_norm: the one-pass inference path of the wide LayerNorm /
// RMSNorm (schemas in registration.cpp, the kernel in cpu/fused_norm_kernels_impl.h);
// wide::fused_group_norm, the N-first GroupNorm of wide::group_norm_nfirst (Note [N-first group
// norm kernel]); and wide::fused_batch_norm(_backward), wide::batch_norm's training path on the
// CPU (Note [Batch norm training kernel]).
//
// Note [wide::fused_norm]
// ~~~~~~~~~~~~~~~~~~~~~~~
// wide::layer_norm's composite (Note [wide norms]) costs two passes over the activation, three
// with the residual add before it. When no input needs a gradient (inference, or eval under
// no_grad) wide::layer_norm, wide::rms_norm and wide::add_layer_norm call wide::fused_norm
// instead: a CPU kernel doing add, statistics and per-member affine in one sweep (float and
// double), and the same composite elsewhere (other devices and dtypes, fake tensors). The decision
// is made per call, so one graph serves both.
//
// With a gradient wanted, CPU float/double inputs take wide::fused_norm as well: it has an
// autograd function (fused_norm_autograd.cpp) whose backward is wide::fused_norm_backward, a CPU
// kernel of two sweeps per row (Note [Fused per-member norm backward]) with the same formula in
// ATen ops for other devices and for double backward (create_graph=True), where it is
// differentiable. Other devices keep the composite with autograd's backward.
#include <ATen/core/grad_mode.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/group_norm.h>
#include <ATen/ops/layer_norm.h>
#include <ATen/ops/native_batch_norm.h>
#include <ATen/ops/native_batch_norm_backward.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/rms_norm.h>
#include <ATen/ops/rsqrt.h>
#include <ATen/ops/var.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <array>
#include <limits>
#include <tuple>
#include <vector>

#include "wide/ops/call_op.h"
#include "wide/ops/cpu/fused_norm_kernels.h"
#include "wide/ops/norm.h"
#include "wide/ops/transforms.h"
#include "wide/cpu/isa.h"  // the run-time instruction-set choice, shared with the optimizers

namespace wide {
namespace {

bool needs_grad(std::initializer_list<const at::Tensor*> ts) {
  if (!at::GradMode::is_enabled()) return false;
  for (const at::Tensor* t : ts) {
    if (t != nullptr && t->defined() && t->requires_grad()) return true;
  }
  return false;
}

const at::Tensor* opt_ptr(const std::optional<at::Tensor>& t) { return t.has_value() ? &*t : nullptr; }

// Whether the CPU kernels take these tensors: all CPU, all float or all double (the first is the
// input; null and undefined entries are absent optionals).
bool kernel_takes(std::initializer_list<const at::Tensor*> ts) {
  const auto dtype = (*ts.begin())->scalar_type();
  if (dtype != at::kFloat && dtype != at::kDouble) return false;
  for (const at::Tensor* t : ts) {
    if (t != nullptr && t->defined() && (!t->device().is_cpu() || t->scalar_type() != dtype)) return false;
  }
  return true;
}

// Whether wide::fused_norm serves these tensors: always when no gradient is wanted; with one, when
// its differentiable CPU kernel takes them; else the callers take the composite, whose backward
// is autograd's.
bool takes_fused(std::initializer_list<const at::Tensor*> ts) {
  return detail::plain_autograd(ts) && (!needs_grad(ts) || kernel_takes(ts));  // Note [Kernels under transforms]
}

void check_fused(const at::Tensor& input, const std::optional<at::Tensor>& residual,
                 int64_t d, const std::optional<at::Tensor>& weight,
                 const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.dim() >= 2 && d >= 1 && (input.size(0) == 0 || (input.numel() / input.size(0)) % d == 0),
              "wide::fused_norm: expected an N-first input [N, *] whose member size is a multiple of "
              "normalized_numel=", d, ", got ", input.sizes());
  TORCH_CHECK(!residual.has_value() || residual->sizes() == input.sizes(),
              "wide::fused_norm: residual ", residual.has_value() ? residual->sizes() : c10::IntArrayRef{},
              " must have the input's shape ", input.sizes());
  for (const auto* p : {opt_ptr(weight), opt_ptr(bias)}) {
    TORCH_CHECK(p == nullptr || (p->numel() == input.size(0) * d && p->size(0) == input.size(0)),
                "wide::fused_norm: weight/bias must be [N, *normalized_shape] with N=", input.size(0),
                " and ", d, " elements per member, got ", p->sizes());
  }
}

// The same math from ATen ops: every device and dtype, and fake tensors (symbolic sizes).
at::Tensor fused_norm_composite(const at::Tensor& input, const std::optional<at::Tensor>& residual,
                                int64_t d, const std::optional<at::Tensor>& weight,
                                const std::optional<at::Tensor>& bias, double eps, bool rms) {
  TORCH_CHECK(input.dim() >= 2 && d >= 1, "wide::fused_norm: expected an N-first input [N, *] and "
              "normalized_numel >= 1, got ", input.sym_sizes(), " and ", d);
  TORCH_CHECK(!residual.has_value() || residual->sym_sizes() == input.sym_sizes(),
              "wide::fused_norm: the residual must have the input's shape ", input.sym_sizes());
  const at::Tensor s = residual.has_value() ? at::add(input, *residual) : input;
  const c10::SymInt n = input.sym_size(0);
  const at::Tensor rows = s.reshape_symint({n, -1, d});
  at::Tensor y = rms ? at::rms_norm(rows, {d}, std::nullopt, eps)
                     : at::layer_norm(rows, {d}, std::nullopt, std::nullopt, eps, false);
  if (weight.has_value()) y = y.mul(weight->reshape_symint({n, 1, d}));
  if (bias.has_value()) y = y.add(bias->reshape_symint({n, 1, d}));
  return y.view_symint(input.sym_sizes());
}

at::Tensor fused_norm_cpu(const at::Tensor& input, const std::optional<at::Tensor>& residual,
                          int64_t d, const std::optional<at::Tensor>& weight,
                          const std::optional<at::Tensor>& bias, double eps, bool rms) {
  const auto dtype = input.scalar_type();
  if (!kernel_takes({&input, opt_ptr(residual), opt_ptr(weight), opt_ptr(bias)})) {
    return fused_norm_composite(input, residual, d, weight, bias, eps, rms);
  }
  check_fused(input, residual, d, weight, bias);
  const at::Tensor x = input.contiguous();
  const at::Tensor r = residual.has_value() ? residual->contiguous() : at::Tensor();
  const at::Tensor w = weight.has_value() ? weight->contiguous() : at::Tensor();
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t n = x.size(0), rows = x.numel() / d;
  if (rows == 0) return y;
  const int64_t rows_per_member = rows / n;
  auto run = [&](auto* type_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    auto ptr = [](const at::Tensor& t) { return t.defined() ? t.const_data_ptr<T>() : nullptr; };
    const T* xp = x.const_data_ptr<T>();
    T* yp = y.mutable_data_ptr<T>();
    WIDE_ISA_CALL(::wide::ops::cpu, fused_norm, xp, ptr(r), yp, ptr(w), ptr(b), rows, rows_per_member,
                  d, eps, rms);
  };
  if (dtype == at::kFloat) {
    run(static_cast<float*>(nullptr));
  } else {
    run(static_cast<double*>(nullptr));
  }
  return y;
}

void check_group_norm(const at::Tensor& input, int64_t num_groups, const std::optional<at::Tensor>& weight,
                      const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.dim() >= 3 && num_groups >= 1 && input.sym_size(2) % num_groups == 0,
              "wide::fused_group_norm: expected an N-first input [N, B, C, *] with C divisible by "
              "num_groups=", num_groups, ", got ", input.sym_sizes());
  for (const auto* p : {opt_ptr(weight), opt_ptr(bias)}) {
    TORCH_CHECK(p == nullptr || (p->dim() == 2 && p->sym_size(0) == input.sym_size(0) &&
                                 p->sym_size(1) == input.sym_size(2)),
                "wide::fused_group_norm: weight/bias must be [N, C] = [", input.sym_size(0), ", ",
                input.sym_size(2), "], got ", p->sym_sizes());
  }
}

// [N, C] -> [N, 1, C, 1, ..., 1] broadcasting against the N-first input.
at::Tensor per_channel(const at::Tensor& p, const at::Tensor& input) {
  std::vector<c10::SymInt> sizes{p.sym_size(0), 1, p.sym_size(1)};
  sizes.resize(input.dim(), 1);
  return p.view_symint(sizes);
}

// The same math from ATen ops: every device and dtype, and fake tensors (symbolic sizes).
at::Tensor fused_group_norm_composite(const at::Tensor& input, int64_t num_groups,
                                      const std::optional<at::Tensor>& weight,
                                      const std::optional<at::Tensor>& bias, double eps) {
  check_group_norm(input, num_groups, weight, bias);
  at::Tensor y = at::group_norm(input.flatten(0, 1), num_groups, std::nullopt, std::nullopt, eps, false)
                     .view_symint(input.sym_sizes());
  if (weight.has_value()) y = y.mul(per_channel(*weight, input));
  if (bias.has_value()) y = y.add(per_channel(*bias, input));
  return y;
}

at::Tensor fused_group_norm_cpu(const at::Tensor& input, int64_t num_groups,
                                const std::optional<at::Tensor>& weight,
                                const std::optional<at::Tensor>& bias, double eps) {
  if (!kernel_takes({&input, opt_ptr(weight), opt_ptr(bias)})) {
    return fused_group_norm_composite(input, num_groups, weight, bias, eps);
  }
  check_group_norm(input, num_groups, weight, bias);
  const at::Tensor x = input.contiguous();
  const at::Tensor w = weight.has_value() ? weight->contiguous() : at::Tensor();
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (x.numel() == 0) return y;
  const int64_t n = x.size(0), batch = x.size(1), channels = x.size(2);
  const int64_t inner = x.numel() / (n * batch * channels);
  auto run = [&](auto* type_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    auto ptr = [](const at::Tensor& t) { return t.defined() ? t.const_data_ptr<T>() : nullptr; };
    WIDE_ISA_CALL(::wide::ops::cpu, group_norm, x.const_data_ptr<T>(), y.mutable_data_ptr<T>(), ptr(w),
                  ptr(b), n, batch, num_groups, channels / num_groups, inner, eps);
  };
  if (input.scalar_type() == at::kFloat) {
    run(static_cast<float*>(nullptr));
  } else {
    run(static_cast<double*>(nullptr));
  }
  return y;
}

using NormGrads = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

NormGrads fused_norm_backward_cpu(const at::Tensor& grad_out, const at::Tensor& input,
                                  const std::optional<at::Tensor>& residual, int64_t d,
                                  const std::optional<at::Tensor>& weight, double eps, bool rms,
                                  std::array<bool, 3> output_mask) {
  const auto dtype = input.scalar_type();
  if (!kernel_takes({&input, &grad_out, opt_ptr(residual), opt_ptr(weight)})) {
    return detail::fused_norm_backward_math(grad_out, input, residual, d, weight, eps, rms, output_mask);
  }
  check_fused(input, residual, d, weight, std::nullopt);
  TORCH_CHECK(grad_out.sizes() == input.sizes(), "wide::fused_norm_backward: grad_out ", grad_out.sizes(),
              " must have the input's shape ", input.sizes());
  const at::Tensor x = input.contiguous(), g = grad_out.contiguous();
  const at::Tensor r = residual.has_value() ? residual->contiguous() : at::Tensor();
  const at::Tensor w = weight.has_value() ? weight->contiguous() : at::Tensor();
  const int64_t n = x.size(0);
  at::Tensor dx = output_mask[0] ? at::empty_like(x, at::MemoryFormat::Contiguous) : at::Tensor();
  at::Tensor dw = output_mask[1] && weight.has_value() ? at::empty({n, d}, x.options()) : at::Tensor();
  at::Tensor db = output_mask[2] ? at::empty({n, d}, x.options()) : at::Tensor();
  const int64_t rows = x.numel() / d;
  if (rows == 0 || n == 0) {
    if (dw.defined()) dw.zero_();
    if (db.defined()) db.zero_();
  } else {
    auto run = [&](auto* type_tag) {
      using T = std::remove_pointer_t<decltype(type_tag)>;
      auto in = [](const at::Tensor& t) { return t.defined() ? t.const_data_ptr<T>() : nullptr; };
      auto out = [](at::Tensor& t) { return t.defined() ? t.mutable_data_ptr<T>() : nullptr; };
      WIDE_ISA_CALL(::wide::ops::cpu, fused_norm_backward, g.const_data_ptr<T>(), x.const_data_ptr<T>(), in(r),
                    in(w), out(dx), out(dw), out(db), rows, rows / n, d, eps, rms);
    };
    if (dtype == at::kFloat) {
      run(static_cast<float*>(nullptr));
    } else {
      run(static_cast<double*>(nullptr));
    }
  }
  if (dw.defined()) dw = dw.view(weight->sizes());
  if (db.defined() && weight.has_value()) db = db.view(weight->sizes());
  return {dx, dw, db};
}

NormGrads fused_norm_backward_meta(const at::Tensor& grad_out, const at::Tensor& input,
                                   const std::optional<at::Tensor>& residual, int64_t d,
                                   const std::optional<at::Tensor>& weight, double eps, bool rms,
                                   std::array<bool, 3> output_mask) {
  const c10::SymInt n = input.sym_size(0);
  at::Tensor dx = output_mask[0] ? at::empty_symint(input.sym_sizes(), input.options()) : at::Tensor();
  at::Tensor dw = output_mask[1] && weight.has_value() ? at::empty_symint(weight->sym_sizes(), input.options())
                                                       : at::Tensor();
  at::Tensor db = output_mask[2] ? (weight.has_value() ? at::empty_symint(weight->sym_sizes(), input.options())
                                                       : at::empty_symint({n, d}, input.options()))
                                 : at::Tensor();
  return {dx, dw, db};
}

using BatchNormOut = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

void check_batch_norm(const char* op, const at::Tensor& input, std::initializer_list<const at::Tensor*> per_channel) {
  TORCH_CHECK(input.dim() >= 2, "wide::", op, ": expected a packed input [B, C, *], got ", input.sym_sizes());
  for (const at::Tensor* p : per_channel) {
    TORCH_CHECK(p == nullptr || !p->defined() || (p->dim() == 1 && p->sym_size(0) == input.sym_size(1)),
                "wide::", op, ": expected per-channel tensors of shape [", input.sym_size(1), "], got ",
                p->sym_sizes());
  }
}

// The same results from ATen ops: every device, dtype and layout, and fake tensors.
BatchNormOut fused_batch_norm_composite(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                                        const std::optional<at::Tensor>& bias, double eps) {
  check_batch_norm("fused_batch_norm", input, {opt_ptr(weight), opt_ptr(bias)});
  auto [y, mean, invstd] = at::native_batch_norm(input, weight, bias, std::nullopt, std::nullopt, true, 0.0, eps);
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < input.dim(); ++d) dims.push_back(d);
  return {y, mean, invstd, at::var(input, dims, /*correction=*/1, /*keepdim=*/false)};
}

BatchNormOut fused_batch_norm_cpu(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                                  const std::optional<at::Tensor>& bias, double eps) {
  if (!detail::takes_fused_batch_norm(input, weight, bias)) return fused_batch_norm_composite(input, weight, bias, eps);
  check_batch_norm("fused_batch_norm", input, {opt_ptr(weight), opt_ptr(bias)});
  const at::Tensor w = weight.has_value() ? weight->contiguous() : at::Tensor();
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  const int64_t batch = input.size(0), channels = input.size(1);
  const int64_t inner = input.numel() / (batch * channels);  // takes_fused_batch_norm: numel > 0
  at::Tensor y = at::empty_like(input, at::MemoryFormat::Contiguous);
  at::Tensor mean = at::empty({channels}, input.options()), invstd = at::empty({channels}, input.options());
  at::Tensor var = at::empty({channels}, input.options());
  auto run = [&](auto* type_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    auto ptr = [](const at::Tensor& t) { return t.defined() ? t.const_data_ptr<T>() : nullptr; };
    WIDE_ISA_CALL(::wide::ops::cpu, batch_norm_train, input.const_data_ptr<T>(), y.mutable_data_ptr<T>(), ptr(w),
                  ptr(b), mean.mutable_data_ptr<T>(), invstd.mutable_data_ptr<T>(), var.mutable_data_ptr<T>(), batch,
                  channels, inner, eps);
  };
  if (input.scalar_type() == at::kFloat) {
    run(static_cast<float*>(nullptr));
  } else {
    run(static_cast<double*>(nullptr));
  }
  return {y, mean, invstd, var};
}

NormGrads fused_batch_norm_backward_composite(const at::Tensor& grad_out, const at::Tensor& input,
                                              const std::optional<at::Tensor>& weight, const at::Tensor& save_mean,
                                              const at::Tensor& save_invstd, double eps,
                                              std::array<bool, 3> output_mask) {
  check_batch_norm("fused_batch_norm_backward", input, {opt_ptr(weight), &save_mean, &save_invstd});
  // CUDA's kernel raises 'tensor does not have a device' without a weight (seen on an H200,
  // torch 2.11): a weight of ones is the same batch norm, exactly (the weight gradient, sum of
  // grad_out * x_hat, does not read the weight; the CPU kernel returns it without one too)
  const bool ones = !weight.has_value() && !input.device().is_cpu();
  const std::optional<at::Tensor> w = ones ? std::optional<at::Tensor>(at::ones({input.size(1)}, input.options())) : weight;
  auto [dx, dw, db] = at::native_batch_norm_backward(grad_out, input, w, std::nullopt, std::nullopt, save_mean,
                                                     save_invstd, true, eps, output_mask);
  // only what the mask asks for, whatever the backend returns (ATen's meta kernel, which fake
  // tensors run, allocates all three; its CPU kernel leaves the unwanted ones undefined)
  return {output_mask[0] ? dx : at::Tensor(), output_mask[1] ? dw : at::Tensor(), output_mask[2] ? db : at::Tensor()};
}

NormGrads fused_batch_norm_backward_cpu(const at::Tensor& grad_out, const at::Tensor& input,
                                        const std::optional<at::Tensor>& weight, const at::Tensor& save_mean,
                                        const at::Tensor& save_invstd, double eps, std::array<bool, 3> output_mask) {
  if (!detail::takes_fused_batch_norm(input, weight, std::nullopt) ||
      !kernel_takes({&input, &grad_out, &save_mean, &save_invstd})) {
    return fused_batch_norm_backward_composite(grad_out, input, weight, save_mean, save_invstd, eps, output_mask);
  }
  check_batch_norm("fused_batch_norm_backward", input, {opt_ptr(weight), &save_mean, &save_invstd});
  TORCH_CHECK(grad_out.sizes() == input.sizes(), "wide::fused_batch_norm_backward: grad_out ", grad_out.sizes(),
              " must have the input's shape ", input.sizes());
  const at::Tensor g = grad_out.contiguous(), mean = save_mean.contiguous(), invstd = save_invstd.contiguous();
  const at::Tensor w = weight.has_value() ? weight->contiguous() : at::Tensor();
  const int64_t batch = input.size(0), channels = input.size(1);
  const int64_t inner = input.numel() / (batch * channels);  // takes_fused_batch_norm: numel > 0
  at::Tensor dx = output_mask[0] ? at::empty_like(input, at::MemoryFormat::Contiguous) : at::Tensor();
  at::Tensor dw = output_mask[1] ? at::empty({channels}, input.options()) : at::Tensor();
  at::Tensor db = output_mask[2] ? at::empty({channels}, input.options()) : at::Tensor();
  auto run = [&](auto* type_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    auto out = [](at::Tensor& t) { return t.defined() ? t.mutable_data_ptr<T>() : nullptr; };
    WIDE_ISA_CALL(::wide::ops::cpu, batch_norm_backward, g.const_data_ptr<T>(), input.const_data_ptr<T>(),
                  w.defined() ? w.const_data_ptr<T>() : nullptr, mean.const_data_ptr<T>(), invstd.const_data_ptr<T>(),
                  out(dx), out(dw), out(db), batch, channels, inner);
  };
  if (input.scalar_type() == at::kFloat) {
    run(static_cast<float*>(nullptr));
  } else {
    run(static_cast<double*>(nullptr));
  }
  return {dx, dw, db};
}

// The trailing normalized_shape as one element count, when every size is concrete.
std::optional<int64_t> concrete_numel(c10::SymIntArrayRef shape) {
  int64_t numel = 1;
  for (const c10::SymInt& s : shape) {
    auto v = s.maybe_as_int();
    if (!v.has_value()) return std::nullopt;
    numel *= *v;
  }
  return numel;
}

at::Tensor add_layer_norm_impl(const at::Tensor& input, const at::Tensor& residual,
                               c10::SymIntArrayRef normalized_shape,
                               const std::optional<at::Tensor>& weight,
                               const std::optional<at::Tensor>& bias, double eps) {
  const auto d = concrete_numel(normalized_shape);
  if (d.has_value() && input.sym_sizes() == residual.sym_sizes() &&
      takes_fused({&input, &residual, opt_ptr(weight), opt_ptr(bias)})) {
    return fused_norm(input, residual, *d, weight, bias, eps, /*rms=*/false);
  }
  return layer_norm(at::add(input, residual), normalized_shape, weight, bias, eps, "fused");
}

}  // namespace

namespace detail {

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_norm_backward_math(
    const at::Tensor& grad_out, const at::Tensor& input, const std::optional<at::Tensor>& residual,
    int64_t d, const std::optional<at::Tensor>& weight, double eps, bool rms, std::array<bool, 3> output_mask) {
  const c10::SymInt n = input.sym_size(0);
  const at::Tensor s = (residual.has_value() ? at::add(input, *residual) : input).reshape_symint({n, -1, d});
  const at::Tensor dy = grad_out.reshape_symint({n, -1, d});
  at::Tensor xhat;
  at::Tensor rstd;
  if (rms) {
    rstd = at::rsqrt(s.mul(s).mean(-1, true).add(eps));
    xhat = s.mul(rstd);
  } else {
    const at::Tensor centered = s.sub(s.mean(-1, true));
    rstd = at::rsqrt(centered.mul(centered).mean(-1, true).add(eps));
    xhat = centered.mul(rstd);
  }
  at::Tensor dx, dw, db;
  if (output_mask[0]) {
    const at::Tensor gw = weight.has_value() ? dy.mul(weight->reshape_symint({n, 1, d})) : dy;
    at::Tensor inner = gw.sub(xhat.mul(gw.mul(xhat).mean(-1, true)));
    if (!rms) inner = inner.sub(gw.mean(-1, true));
    dx = inner.mul(rstd).view_symint(input.sym_sizes());
  }
  if (output_mask[1] && weight.has_value()) dw = dy.mul(xhat).sum(1).view_symint(weight->sym_sizes());
  if (output_mask[2]) {
    db = dy.sum(1);
    if (weight.has_value()) db = db.view_symint(weight->sym_sizes());
  }
  return {dx, dw, db};
}

bool takes_fused_batch_norm(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                            const std::optional<at::Tensor>& bias) {
  // Rows shorter than a vector: ATen's kernel is faster (0.05 against 1.2 ms on [256, 1024, 1]).
  return untraced({&input}) && input.dim() >= 3 && input.is_contiguous() && input.numel() > 0 &&
         input.numel() / (input.size(0) * input.size(1)) >= 16 &&
         kernel_takes({&input, opt_ptr(weight), opt_ptr(bias)}) && plain_autograd({&input, opt_ptr(weight), opt_ptr(bias)});
}

std::optional<at::Tensor> maybe_fused_norm(const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                                           const std::optional<at::Tensor>& weight,
                                           const std::optional<at::Tensor>& bias,
                                           std::optional<double> eps, bool rms) {
  const auto d = concrete_numel(normalized_shape);
  if (!d.has_value() || !takes_fused({&input, opt_ptr(weight), opt_ptr(bias)})) return std::nullopt;
  double e = eps.value_or(0.0);
  if (!eps.has_value()) {  // RMSNorm's default, as torch: the input dtype's machine epsilon
    e = input.scalar_type() == at::kDouble ? std::numeric_limits<double>::epsilon()
                                           : std::numeric_limits<float>::epsilon();
  }
  return fused_norm(input, std::nullopt, *d, weight, bias, e, rms);
}

std::optional<at::Tensor> maybe_fused_group_norm(const at::Tensor& input, int64_t num_groups,
                                                 const std::optional<at::Tensor>& weight,
                                                 const std::optional<at::Tensor>& bias, double eps) {
  if (needs_grad({&input, opt_ptr(weight), opt_ptr(bias)}) || !plain_autograd({&input, opt_ptr(weight), opt_ptr(bias)})) {
    return std::nullopt;
  }
  return fused_group_norm(input, num_groups, weight, bias, eps);
}

}  // namespace detail

at::Tensor fused_norm(const at::Tensor& input, const std::optional<at::Tensor>& residual,
                      int64_t normalized_numel, const std::optional<at::Tensor>& weight,
                      const std::optional<at::Tensor>& bias, double eps, bool rms) {
  return detail::call_op<"wide::fused_norm", decltype(fused_norm)>(
      input, residual, normalized_numel, weight, bias, eps, rms);
}

at::Tensor fused_group_norm(const at::Tensor& input, int64_t num_groups,
                            const std::optional<at::Tensor>& weight,
                            const std::optional<at::Tensor>& bias, double eps) {
  return detail::call_op<"wide::fused_group_norm", decltype(fused_group_norm)>(
      input, num_groups, weight, bias, eps);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_batch_norm(
    const at::Tensor& input, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    double eps) {
  return detail::call_op<"wide::fused_batch_norm", decltype(fused_batch_norm)>(
      input, weight, bias, eps);
}

at::Tensor add_layer_norm(const at::Tensor& input, const at::Tensor& residual,
                          c10::SymIntArrayRef normalized_shape,
                          const std::optional<at::Tensor>& weight,
                          const std::optional<at::Tensor>& bias, double eps) {
  return detail::call_op<"wide::add_layer_norm", decltype(add_layer_norm)>(
      input, residual, normalized_shape, weight, bias, eps);
}

}  // namespace wide

TORCH_LIBRARY_IMPL(wide, CompositeImplicitAutograd, m) {
  m.impl("add_layer_norm", &wide::add_layer_norm_impl);
}

TORCH_LIBRARY_IMPL(wide, CompositeExplicitAutograd, m) {
  m.impl("fused_norm", &wide::fused_norm_composite);
  m.impl("fused_group_norm", &wide::fused_group_norm_composite);
  m.impl("fused_norm_backward", &wide::detail::fused_norm_backward_math);
  m.impl("fused_batch_norm", &wide::fused_batch_norm_composite);
  m.impl("fused_batch_norm_backward", &wide::fused_batch_norm_backward_composite);
}

TORCH_LIBRARY_IMPL(wide, CPU, m) {
  m.impl("fused_norm", &wide::fused_norm_cpu);
  m.impl("fused_group_norm", &wide::fused_group_norm_cpu);
  m.impl("fused_norm_backward", &wide::fused_norm_backward_cpu);
  m.impl("fused_batch_norm", &wide::fused_batch_norm_cpu);
  m.impl("fused_batch_norm_backward", &wide::fused_batch_norm_backward_cpu);
}

TORCH_LIBRARY_IMPL(wide, Meta, m) {
  m.impl("fused_norm_backward", &wide::fused_norm_backward_meta);
}
