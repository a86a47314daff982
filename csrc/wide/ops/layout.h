// wide layouts: N-first [N, B, C, *] and channel-packed [B, N*C, *] (DESIGN §3).
// Public C++ API: each function calls its op through the dispatcher, as torch.ops.wide.to_packed
// does; the implementation is internal to layout.cpp (schemas in registration.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>

#include <string_view>

namespace wide {

/// N-first [N, B, C, *] -> channel-packed [B, N*C, *]; free (a view) when the memory is already
/// packed (e.g. the input is to_nfirst() of a packed tensor), one copy otherwise.
at::Tensor to_packed(const at::Tensor& input);

/// Channel-packed [B, N*C, *] -> N-first [N, B, C, *]; always a view (no copy).
/// See Note [wide layouts].
at::Tensor to_nfirst(const at::Tensor& input, c10::SymInt n);

/// input.contiguous(), whose gradient keeps input's memory layout: a channels-last input gets
/// a channels-last gradient (Note [Layout-keeping conversion] in ops/conv_autograd.cpp).
at::Tensor to_channels_first(const at::Tensor& input);

namespace detail {

// Internal helpers of the packed-family op implementations (called directly, not through the
// dispatcher, from inside their composite kernels).

/// The implementation of wide::to_packed.
at::Tensor to_packed(const at::Tensor& input);

/// The packed form of an op's activation: `input` itself when `packed_input`, else to_packed();
/// checks that each member's value has `member_rank` dims ([B, C, *]).
at::Tensor packed_activation(const at::Tensor& input, bool packed_input, int64_t member_rank,
                             std::string_view op);

/// The implementation of wide::to_channels_first (in conv_autograd.cpp, with the autograd headers).
at::Tensor contiguous_keeping_grad_layout(const at::Tensor& input);

} // namespace detail
} // namespace wide
