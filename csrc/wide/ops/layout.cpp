#include "wide/ops/layout.h"

#include "wide/ops/call_op.h"

#include <ATen/ops/movedim.h>
#include <torch/library.h>

#include <string>
#include <vector>

// Note [wide layouts]
// -------------------
// Convolutions, batch/group/instance norm, PReLU and pooling act on every channel of a
// [B, C, *] tensor independently (or on channel groups), so N members' activations fit ONE ATen
// call when their channels are laid side by side: the channel-packed layout [B, N*C, *], member i
// owning channels [i*C, (i+1)*C). The rest of the wide graph is N-first [N, B, *].
//
// Every packed-family wide op (wide::conv, wide::conv_transpose, wide::batch_norm, ...) returns
// its result PACKED and takes its input either N-first (`packed_input=False`: it packs it, with
// one copy, or takes the shared-input fast path) or packed (`packed_input=True`). The widen rules
// emit `wide::to_nfirst(op(x), N)` after each such op, so every value the other rules see is
// N-first. to_nfirst is a view ([B, N*C, *] -> view [B, N, C, *] -> movedim), so it costs
// nothing; and because to_packed() of such a view is again a view, an N-first round trip between
// two packed ops is free at run time even before the layout plan removes it from the graph
// (python/wide_compiler/fx/layout.py). Pointwise ops keep their input's strides, so a ReLU or a
// residual add between packed ops also stays in packed memory.
//
// A real conversion (a copy) happens where a packed value meets an op that needs contiguous
// N-first memory (a Linear's batched GEMM, an output the user reads), or where an N-first value
// enters a packed op. The layout plan counts those boundaries for WideModel.summary().

namespace wide {
namespace detail {

at::Tensor to_packed(const at::Tensor& input) {
  TORCH_CHECK(input.dim() >= 3, "wide::to_packed: expected an N-first tensor [N, B, C, *] with at "
              "least 3 dims, got ", input.sym_sizes());
  std::vector<c10::SymInt> sizes;
  sizes.reserve(input.dim() - 1);
  sizes.push_back(input.sym_size(1));
  sizes.push_back(input.sym_size(0) * input.sym_size(2));
  for (int64_t d = 3; d < input.dim(); ++d) sizes.push_back(input.sym_size(d));
  return input.movedim(0, 1).reshape_symint(sizes);
}

at::Tensor packed_activation(const at::Tensor& input, bool packed_input, int64_t member_rank,
                             std::string_view op) {
  const int64_t want = packed_input ? member_rank : member_rank + 1;
  TORCH_CHECK(input.dim() == want, "wide::", std::string(op), ": expected ",
              packed_input ? "a channel-packed input [B, N*C, *] with " : "an N-first input [N, B, C, *] with ",
              want, " dims, got ", input.sym_sizes());
  return packed_input ? input : to_packed(input);
}

} // namespace detail

namespace {

at::Tensor to_nfirst_impl(const at::Tensor& input, c10::SymInt n) {
  TORCH_CHECK(input.dim() >= 2, "wide::to_nfirst: expected a channel-packed tensor [B, N*C, *] "
              "with at least 2 dims, got ", input.sym_sizes());
  TORCH_CHECK(n >= 1, "wide::to_nfirst: expected n >= 1 members, got ", n);
  TORCH_CHECK(input.sym_size(1) % n == 0, "wide::to_nfirst: expected the channel dim (dim 1) to "
              "be a multiple of n=", n, ", got shape ", input.sym_sizes());
  std::vector<c10::SymInt> sizes;
  sizes.reserve(input.dim() + 1);
  sizes.push_back(input.sym_size(0));
  sizes.push_back(n);
  sizes.push_back(input.sym_size(1) / n);
  for (int64_t d = 2; d < input.dim(); ++d) sizes.push_back(input.sym_size(d));
  return input.view_symint(sizes).movedim(1, 0);
}

} // namespace

at::Tensor to_packed(const at::Tensor& input) {
  return detail::call_op<"wide::to_packed", decltype(to_packed)>(input);
}

at::Tensor to_nfirst(const at::Tensor& input, c10::SymInt n) {
  return detail::call_op<"wide::to_nfirst", decltype(to_nfirst)>(input, std::move(n));
}

at::Tensor to_channels_first(const at::Tensor& input) {
  return detail::call_op<"wide::to_channels_first", decltype(to_channels_first)>(input);
}

} // namespace wide

TORCH_LIBRARY_IMPL(wide, CompositeImplicitAutograd, m) {
  m.impl("to_channels_first", &wide::detail::contiguous_keeping_grad_layout);
  m.impl("to_packed", &wide::detail::to_packed);
  m.impl("to_nfirst", &wide::to_nfirst_impl);
}
