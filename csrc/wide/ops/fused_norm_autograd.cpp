// The autograd kernel of wide::fused_norm (Note [wide::fused_norm] in fused_norm.cpp): forward is
// the op below autograd; backward is wide::fused_norm_backward, or its formula in ATen ops when
// the backward itself is being differentiated (create_graph=True). Built like the C++ frontend
// files (CMakeLists.txt): the autograd headers pull in every ATen operator.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <tuple>

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
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("wide::fused_norm_backward", "")
                       .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                           const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t,
                           const std::optional<at::Tensor>&, double, bool, std::array<bool, 3>)>();
  return op.call(grad, input, residual, d, weight, eps, rms, mask);
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

}  // namespace
}  // namespace wide

TORCH_LIBRARY_IMPL(wide, Autograd, m) {
  m.impl("fused_norm", &wide::fused_norm_autograd);
}
