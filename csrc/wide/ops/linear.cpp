#include "wide/ops/linear.h"

#include "wide/ops/call_op.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/baddbmm.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/stack.h>
#include <torch/library.h>

#include <vector>

// Note [wide::linear strategies]
// ------------------------------
// Member n computes input[n] @ weight[n].T + bias[n]. Three ways to run that:
//  * shared: dim 0 of the input has stride 0, i.e. the caller passed x.expand(N, ...): every
//    member reads the same activation. When a gradient is wanted and the member weight is small
//    (under 32K elements), concatenate the weights on the output dim ([N*O, I], a free view) and
//    run ONE GEMM [M, I] x [I, N*O] with the bias fused (addmm); the result [M, N*O] is returned
//    as the N-first view [N, M, O] (a permute, no copy), and the input's gradient is one GEMM
//    too, where the batched paths sum N of them. Otherwise the batched paths below run on the
//    expanded input as it is (stride 0: no copy of it is made) and `strategy` applies. Measured
//    (B=32, N=4-64, 2 threads): forward+backward, the one GEMM was 1.1-1.9x faster than baddbmm
//    on the expanded input for 64->128, mixed for 128->256 (0.8-1.06x), 0.90-0.98x for 256->512
//    and 512->1024; forward alone, it was 1.3-2.4x slower than baddbmm for 64->128 and 512->1024
//    (a GEMM of 32 rows against N*O columns, plus the copy that makes its result N-first).
//  * bmm: one batched GEMM over the member dim with the bias fused (baddbmm); when the weight
//    needs a gradient, with a backward that hands it back in the weight's layout (Note [Linear
//    weight gradient layout], linear_autograd.cpp);
//  * bmm_t: the same GEMM as out^T = W @ x^T, see Note [wide::linear bmm orientation].
//  * loop: N separate at::linear calls, stacked. Wins only when each member's GEMM is large
//    enough that batching gains nothing; the compile-time tuner measures rather than guesses.
// `strategy` picks among bmm, bmm_t and loop for per-member inputs; `auto` is bmm (the heuristic
// used when nothing was measured). All paths are built from ATen ops (the bmm backward's autograd
// function from differentiable ones, and only outside tracing), so the op is
// CompositeImplicitAutograd: autograd, fake tensors, torch.compile and export come free, and all
// size arithmetic uses SymInts so it traces with a dynamic batch dimension.

namespace wide {

LinearStrategy parse_linear_strategy(std::string_view name) {
  if (name == "auto") return LinearStrategy::Auto;
  if (name == "bmm") return LinearStrategy::Bmm;
  if (name == "bmm_t") return LinearStrategy::BmmT;
  if (name == "loop") return LinearStrategy::Loop;
  TORCH_CHECK(false, "wide::linear: expected strategy 'auto', 'bmm', 'bmm_t' or 'loop', got '",
              std::string(name), "'");
}

namespace {

// Note [A member's bias slice on the GPU]
// ---------------------------------------
// The loop strategy hands member k's bias as a slice of the stacked [N, out] bias, which starts
// k * out elements into its storage. CUDA's addmm fuses a 1-d bias into cuBLASLt's epilogue, which
// is told the alignment of the matrices but not of the bias pointer, and a fault there would end
// the process's CUDA context. A member's own bias is an allocation of its own; so, off the CPU, a
// slice off a 16-byte boundary (out = 27 float32 values, say) is passed as a copy (a symbolic
// offset, while tracing, is assumed unaligned). A precaution: the misaligned-address fault of the
// GPU runs was the attention's (Note [Strided attention inputs on a GPU] in blocks.py).
at::Tensor aligned_bias(const at::Tensor& bias) {
  if (bias.is_cpu()) return bias;
  const auto offset = bias.sym_storage_offset().maybe_as_int();
  return offset.has_value() && (*offset * static_cast<int64_t>(bias.element_size())) % 16 == 0 ? bias
                                                                                              : bias.clone();
}

void check_linear_args(const at::Tensor& input, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.dim() == 3, "wide::linear: expected weight of shape [N, out, in], got ",
              weight.sym_sizes());
  TORCH_CHECK(input.dim() >= 2, "wide::linear: expected input of shape [N, ..., in] with at least "
              "2 dims, got ", input.sym_sizes());
  TORCH_CHECK(input.sym_size(0) == weight.sym_size(0), "wide::linear: input has ",
              input.sym_size(0), " members (dim 0) but weight has ", weight.sym_size(0),
              " (input ", input.sym_sizes(), ", weight ", weight.sym_sizes(), ")");
  TORCH_CHECK(input.sym_size(-1) == weight.sym_size(2), "wide::linear: input features (last dim) ",
              input.sym_size(-1), " do not match weight in_features ", weight.sym_size(2),
              " (input ", input.sym_sizes(), ", weight ", weight.sym_sizes(), ")");
  TORCH_CHECK(input.scalar_type() == weight.scalar_type(), "wide::linear: expected input and "
              "weight of the same dtype, got ", input.scalar_type(), " and ", weight.scalar_type());
  TORCH_CHECK(input.device() == weight.device(), "wide::linear: expected input and weight on the "
              "same device, got ", input.device(), " and ", weight.device());
  if (bias.has_value()) {
    const auto& b = *bias;
    TORCH_CHECK(b.dim() == 2 && b.sym_size(0) == weight.sym_size(0) &&
                    b.sym_size(1) == weight.sym_size(1),
                "wide::linear: expected bias of shape [N, out] = [", weight.sym_size(0), ", ",
                weight.sym_size(1), "], got ", b.sym_sizes());
    TORCH_CHECK(b.scalar_type() == weight.scalar_type() && b.device() == weight.device(),
                "wide::linear: expected bias with the weight's dtype and device, got ",
                b.scalar_type(), " on ", b.device());
  }
}

at::Tensor linear_impl(const at::Tensor& input, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias, std::string_view strategy) {
  const LinearStrategy kind = parse_linear_strategy(strategy);
  check_linear_args(input, weight, bias);
  const c10::SymInt n = weight.sym_size(0);
  const c10::SymInt out_features = weight.sym_size(1);
  const c10::SymInt in_features = weight.sym_size(2);

  // Output shape: the input's with the last dim replaced; m = rows each member multiplies.
  std::vector<c10::SymInt> out_sizes(input.sym_sizes().begin(), input.sym_sizes().end());
  out_sizes.back() = out_features;
  c10::SymInt m = 1;
  for (size_t d = 1; d + 1 < out_sizes.size(); ++d) m *= out_sizes[d];

  constexpr int64_t kSharedGemmMaxWeight = 1 << 15;  // member weight elements (see the note)
  const auto wants_grad = [&] {
    return at::GradMode::is_enabled() &&
           (input.requires_grad() || weight.requires_grad() || (bias.has_value() && bias->requires_grad()));
  };
  if (input.sym_stride(0) == 0 && out_features * in_features < kSharedGemmMaxWeight && wants_grad()) {
    // Shared input in training, small layers: one GEMM against the concatenated weights.
    const at::Tensor x = input.select(0, 0).reshape_symint({m, in_features});
    const at::Tensor w = weight.reshape_symint({n * out_features, in_features});
    const at::Tensor y = bias.has_value()
                             ? at::addmm(bias->reshape_symint({n * out_features}), x, w.t())
                             : at::mm(x, w.t());
    return y.view_symint({m, n, out_features}).permute({1, 0, 2}).view_symint(out_sizes);
  }

  if (kind == LinearStrategy::Loop && weight.sym_size(0) != 0) {  // N = 0: the batched path's empty result
    // unbind, not select: its backward stacks the N gradients once, where N selects would each
    // scatter into a zero tensor of the full [N, ...] size (O(N^2) memory traffic).
    const std::vector<at::Tensor> xs = input.unbind(0);
    const std::vector<at::Tensor> ws = weight.unbind(0);
    const std::vector<at::Tensor> bs = bias.has_value() ? bias->unbind(0) : std::vector<at::Tensor>{};
    std::vector<at::Tensor> outs;
    outs.reserve(ws.size());
    for (size_t k = 0; k < ws.size(); ++k) {
      outs.push_back(at::linear(xs[k], ws[k], bs.empty() ? std::nullopt
                                                         : std::optional<at::Tensor>(aligned_bias(bs[k]))));
    }
    return at::stack(outs);
  }

  if (kind == LinearStrategy::BmmT) {
    // Note [wide::linear bmm orientation]: out^T = W @ x^T ([N, O, I] x [N, I, M]), made
    // contiguous [N, M, O]. Its weight gradient comes out as a contiguous [N, O, I] where the
    // composite x @ W^T yields it transposed (accumulating a transposed gradient into .grad is a
    // strided copy of every weight): forward+backward of 512->1024 at N=64, B=32 took 151 ms
    // against 215 ms for that composite. The bmm strategy now has its own backward with the same
    // layout (Note [Linear weight gradient layout]) except while tracing, where the composite
    // runs. The output copy costs the forward of small layers (64->128: 0.49 against 0.35 ms), so
    // the tuner, which times forward+backward for train graphs and the forward for eval graphs, picks.
    const at::Tensor xt = input.reshape_symint({n, m, in_features}).transpose(1, 2);
    const at::Tensor yt = bias.has_value() ? at::baddbmm(bias->unsqueeze(2), weight, xt) : at::bmm(weight, xt);
    return yt.transpose(1, 2).contiguous().view_symint(out_sizes);
  }
  const at::Tensor x = input.reshape_symint({n, m, in_features});
  const std::optional<at::Tensor> addend = bias.has_value() ? std::optional<at::Tensor>(bias->unsqueeze(1)) : std::nullopt;
  return detail::batched_linear(x, weight, addend).view_symint(out_sizes);  // Note [Linear weight gradient layout]
}

} // namespace

at::Tensor linear(const at::Tensor& input, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias, std::string_view strategy) {
  return detail::call_op<"wide::linear", decltype(linear)>(input, weight, bias, strategy);
}

} // namespace wide

TORCH_LIBRARY_IMPL(wide, CompositeImplicitAutograd, m) {
  m.impl("linear", &wide::linear_impl);
}
