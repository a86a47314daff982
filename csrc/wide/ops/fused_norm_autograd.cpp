// The autograd kernels of wide::fused_norm (Note [wide::fused_norm] in fused_norm.cpp) and
// wide::fused_batch_norm (Note [Batch norm training kernel]): forward is the op below autograd;
// backward is wide::fused_norm_backward / wide::fused_batch_norm_backward, or the formula in ATen
// ops when the backward itself is being differentiated (create_graph=True). Built like the C++ frontend
// files (CMakeLists.txt): the autograd headers pull in every ATen operator.
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/custom_function.h>
#include <ATen/ops/native_batch_norm_backward.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <tuple>

#include "wide/ops/call_op.h"
#include "wide/ops/norm.h"

namespace wide {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::optional<at::Tensor> opt(const at::Tensor& t) { return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt; }

std::tuple<at::Tensor, at::Tensor, at::Tensor> call_backward(const at::Tensor& grad, const at::Tensor& input,
                                                              const std::optional<at::Tensor>& residual, int64_t d,
                                                              const std::optional<at::Tensor>& weight, double eps,
                                                              bool rms, std::array<bool, 3> mask) {
  using Sig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t,
      const std::optional<at::Tensor>&, double, bool, std::array<bool, 3>);
  return detail::call_op<"wide::fused_norm_backward", Sig>(
      grad, input, residual, d, weight, eps, rms, mask);
}

class FusedNormFunction : public torch::autograd::Function<FusedNormFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const std::optional<at::Tensor>& residual,
                            int64_t d, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                            double eps, bool rms) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({input, residual.value_or(at::Tensor()), weight.value_or(at::Tensor())});
    ctx->saved_data["d"] = d;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["rms"] = rms;
    ctx->saved_data["bias_shape"] = bias.has_value() ? bias->sizes().vec() : std::vector<int64_t>{};
    return fused_norm(input, residual, d, weight, bias, eps, rms);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &input = saved[0], &residual = saved[1], &weight = saved[2];
    const int64_t d = ctx->saved_data["d"].toInt();
    const double eps = ctx->saved_data["eps"].toDouble();
    const bool rms = ctx->saved_data["rms"].toBool();
    const std::vector<int64_t> bias_shape = ctx->saved_data["bias_shape"].toIntVector();
    const bool has_bias = !bias_shape.empty();
    variable_list out(7);
    const at::Tensor& grad = grads[0];
    if (!grad.defined()) return out;
    // needs_input_grad counts tensor inputs only: input, then residual, weight, bias where given.
    size_t edge = 0;
    const bool need_x = ctx->needs_input_grad(edge++);
    const bool need_r = residual.defined() && ctx->needs_input_grad(edge++);
    const bool need_w = weight.defined() && ctx->needs_input_grad(edge++);
    const bool need_b = has_bias && ctx->needs_input_grad(edge++);
    const std::array<bool, 3> mask = {need_x || need_r, need_w, need_b};
    // Grad mode is on in a backward only under create_graph=True: then the formula in ATen ops,
    // which autograd can differentiate again.
    auto [dx, dw, db] = at::GradMode::is_enabled()
                            ? detail::fused_norm_backward_math(grad, input, opt(residual), d, opt(weight), eps, rms, mask)
                            : call_backward(grad, input, opt(residual), d, opt(weight), eps, rms, mask);
    if (need_x) out[0] = dx;
    if (need_r) out[1] = dx;
    if (need_w) out[3] = dw;
    if (need_b) out[4] = db.reshape(bias_shape);
    return out;
  }
};

at::Tensor fused_norm_autograd(const at::Tensor& input, const std::optional<at::Tensor>& residual,
                               int64_t normalized_numel, const std::optional<at::Tensor>& weight,
                               const std::optional<at::Tensor>& bias, double eps, bool rms) {
  return FusedNormFunction::apply(input, residual, normalized_numel, weight, bias, eps, rms);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> call_batch_norm_backward(
    const at::Tensor& grad, const at::Tensor& input, const std::optional<at::Tensor>& weight, const at::Tensor& mean,
    const at::Tensor& invstd, double eps, std::array<bool, 3> mask) {
  using Sig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
      const at::Tensor&, double, std::array<bool, 3>);
  return detail::call_op<"wide::fused_batch_norm_backward", Sig>(
      grad, input, weight, mean, invstd, eps, mask);
}

// Outputs (y, mean, invstd, var): only y is differentiable (ATen's native_batch_norm alike).
class FusedBatchNormFunction : public torch::autograd::Function<FusedBatchNormFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input, const std::optional<at::Tensor>& weight,
                               const std::optional<at::Tensor>& bias, double eps) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, mean, invstd, var] = fused_batch_norm(input, weight, bias, eps);
    ctx->save_for_backward({input, weight.value_or(at::Tensor()), mean, invstd});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["has_bias"] = bias.has_value();
    ctx->mark_non_differentiable({mean, invstd, var});
    return {y, mean, invstd, var};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &input = saved[0], &weight = saved[1], &mean = saved[2], &invstd = saved[3];
    const double eps = ctx->saved_data["eps"].toDouble();
    variable_list out(4);
    const at::Tensor& grad = grads[0];
    if (!grad.defined()) return out;
    size_t edge = 0;  // tensor inputs only: input, then weight and bias where given
    const bool need_x = ctx->needs_input_grad(edge++);
    const bool need_w = weight.defined() && ctx->needs_input_grad(edge++);
    const bool need_b = ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(edge++);
    const std::array<bool, 3> mask = {need_x, need_w, need_b};
    // create_graph=True: ATen's backward, which autograd differentiates again (train-mode formula).
    auto [dx, dw, db] = at::GradMode::is_enabled()
                            ? at::native_batch_norm_backward(grad, input, opt(weight), std::nullopt, std::nullopt,
                                                             mean, invstd, true, eps, mask)
                            : call_batch_norm_backward(grad, input, opt(weight), mean, invstd, eps, mask);
    if (need_x) out[0] = dx;
    if (need_w) out[1] = dw;
    if (need_b) out[2] = db;
    return out;
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_batch_norm_autograd(
    const at::Tensor& input, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps) {
  const variable_list out = FusedBatchNormFunction::apply(input, weight, bias, eps);
  return {out[0], out[1], out[2], out[3]};
}

}  // namespace
}  // namespace wide

TORCH_LIBRARY_IMPL(wide, Autograd, m) {
  m.impl("fused_norm", &wide::fused_norm_autograd);
  m.impl("fused_batch_norm", &wide::fused_batch_norm_autograd);
}
