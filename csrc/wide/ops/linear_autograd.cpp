// The 'bmm' strategy of wide::linear (and the recurrent layers' GEMMs against a weight) when a
// weight gradient is wanted (Note [Linear weight gradient layout]). Built like the C++ frontend
// files (CMakeLists.txt): the autograd headers pull in every ATen operator.
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <ATen/ops/baddbmm.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/sum.h>

#include <optional>

#include "wide/ops/linear.h"
#include "wide/ops/transforms.h"

// Note [Linear weight gradient layout]
// ------------------------------------
// The batched GEMM x @ W^T (baddbmm of x [N, M, I] with the transposed view of the weight
// [N, O, I]) has ATen's bmm derivative: the gradient of its second operand is x^T @ grad, a
// contiguous [N, I, O], which reaches the weight as its transpose. That is no layout a parameter
// keeps: AccumulateGrad (loss.backward() into .grad) copies it into the weight's layout, or adds
// it into an existing .grad, with a transposing strided copy of every weight. nn.Linear does not
// pay this (ATen's mm derivative returns the gradient in its operand's layout), and
// torch.autograd.grad, which tuning and benchmarks used to time, never accumulates, so nobody saw
// it: a 512->1024 layer at N=256, B=32, trained with .backward() took 245 ms per step against
// 115 ms with torch.autograd.grad, and the members' own loop 140 ms.
// So in training the bmm strategy runs as this autograd function: the same forward (baddbmm), and
// a backward of the same GEMMs written the other way round: the weight gradient as grad^T @ x, a
// contiguous [N, O, I] that AccumulateGrad takes as it is; the input gradient grad @ W and the
// bias gradient grad summed over rows as before. The backward is made of differentiable ATen ops,
// so under create_graph=True autograd records them and higher-order gradients stay exact. The
// recurrent layers' fused time loop runs every GEMM against a weight through it too (gemm_nt in
// rnn.cpp, with the step's input projection or b_hh as the addend), so the T steps' weight
// gradients are summed in the weight's own layout (a GRU's weights had come back transposed). Any
// device; not while tracing or under torch.func transforms or forward-mode AD (Note [Kernels
// under transforms]): the composite runs there, which is what a traced graph records.

namespace wide::detail {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class BmmLinear : public torch::autograd::Function<BmmLinear> {
 public:
  // x [N, M, I], weight [N, O, I], addend [N, 1, O] (a bias) or [N, M, O] or none -> [N, M, O].
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& addend) {
    ctx->save_for_backward({x, weight});
    ctx->saved_data["addend_rows"] = addend.has_value() ? addend->size(1) : int64_t{-1};
    const at::Tensor wt = weight.transpose(1, 2);
    return addend.has_value() ? at::baddbmm(*addend, x, wt) : at::bmm(x, wt);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1];
    const at::Tensor& grad = grads[0];
    const int64_t addend_rows = ctx->saved_data["addend_rows"].toInt();
    variable_list out(3);
    if (!grad.defined()) return out;
    if (ctx->needs_input_grad(0)) out[0] = at::bmm(grad, weight);
    if (ctx->needs_input_grad(1)) out[1] = at::bmm(grad.transpose(1, 2), x);
    if (addend_rows >= 0 && ctx->needs_input_grad(2)) {
      out[2] = addend_rows == grad.size(1) ? grad : grad.sum(1, /*keepdim=*/true);
    }
    return out;
  }
};

}  // namespace

at::Tensor batched_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& addend) {
  const at::Tensor* a = addend.has_value() ? &*addend : nullptr;
  if (at::GradMode::is_enabled() && weight.requires_grad() && weight.is_contiguous() && untraced({&x, &weight, a}) &&
      plain_autograd({&x, &weight, a})) {
    return BmmLinear::apply(x, weight, addend);
  }
  const at::Tensor wt = weight.transpose(1, 2);
  return addend.has_value() ? at::baddbmm(*addend, x, wt) : at::bmm(x, wt);
}

}  // namespace wide::detail
