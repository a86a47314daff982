#include "wide/ops/prelu.h"

#include "wide/ops/call_op.h"
#include "wide/ops/layout.h"

#include <ATen/ops/prelu.h>
#include <torch/library.h>

// PReLU scales negative inputs by a per-channel (or one per-member) slope: on the packed layout
// (Note [wide layouts]) it is ONE at::prelu with the [N, C] slopes as [N*C]; a member with a
// single slope has it broadcast over its C channels first ([N, 1] -> [N, C], a tiny copy whose
// gradient sums back to the one slope). Upstream's bug was sharing member 0's slope: never here.

namespace wide {
namespace {

at::Tensor prelu_impl(const at::Tensor& input, const at::Tensor& weight, bool packed_input) {
  TORCH_CHECK(weight.dim() == 2, "wide::prelu: expected weight [N, 1] or [N, C], got ",
              weight.sym_sizes());
  TORCH_CHECK(input.dim() >= (packed_input ? 2 : 3), "wide::prelu: expected ",
              packed_input ? "a packed input [B, N*C, *]" : "an N-first input [N, B, C, *]",
              ", got ", input.sym_sizes());
  const c10::SymInt n = weight.sym_size(0);
  if (!packed_input) {
    TORCH_CHECK(input.sym_size(0) == n, "wide::prelu: input has ", input.sym_size(0),
                " members (dim 0) but weight has ", n);
  }
  const at::Tensor x = packed_input ? input : detail::to_packed(input);
  TORCH_CHECK(x.sym_size(1) % n == 0, "wide::prelu: packed input has ", x.sym_size(1),
              " channels, not a multiple of N=", n);
  const c10::SymInt c = x.sym_size(1) / n;
  TORCH_CHECK(weight.sym_size(1) == 1 || weight.sym_size(1) == c, "wide::prelu: expected weight "
              "[N, 1] or [N, C] = [", n, ", ", c, "], got ", weight.sym_sizes());
  const at::Tensor w = weight.expand_symint({n, c}).reshape_symint({n * c});
  return at::prelu(x, w);
}

} // namespace

at::Tensor prelu(const at::Tensor& input, const at::Tensor& weight, bool packed_input) {
  return detail::call_op<"wide::prelu", decltype(prelu)>(input, weight, packed_input);
}

} // namespace wide

TORCH_LIBRARY_IMPL(wide, CompositeImplicitAutograd, m) {
  m.impl("prelu", &wide::prelu_impl);
}
