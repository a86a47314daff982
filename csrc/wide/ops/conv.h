// wide::conv and wide::conv_transpose: N independent Conv{1,2,3}d / ConvTranspose{1,2,3}d layers.
// Public C++ API: each function calls its op through the dispatcher, as torch.ops.wide.conv does;
// the implementation is internal to conv.cpp (schemas in registration.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>

#include <optional>
#include <string_view>

namespace wide {

/// Algorithm for per-member inputs (a shared input always runs as one conv when groups == 1);
/// Auto = Grouped. See Note [wide::conv strategies].
enum class ConvStrategy { Auto, Grouped, GroupedChannelsLast, Loop };

/// Parses "auto" | "grouped" | "grouped_cl" | "loop"; throws a c10::Error naming the bad value otherwise.
ConvStrategy parse_conv_strategy(std::string_view name, std::string_view op);

/// N convolutions; weight [N, C_out, C_in/groups, *k], bias [N, C_out]; input N-first
/// [N, B, C_in, *] (or packed [B, N*C_in, *] when packed_input); output packed [B, N*C_out, *].
/// `padding` holds one value per spatial dim, or two (left, right) per dim in F.pad order.
at::Tensor conv(const at::Tensor& input, const at::Tensor& weight,
                const std::optional<at::Tensor>& bias, c10::SymIntArrayRef stride,
                c10::SymIntArrayRef padding, c10::SymIntArrayRef dilation, c10::SymInt groups,
                bool packed_input = false, std::string_view strategy = "auto");

/// N transposed convolutions; weight [N, C_in, C_out/groups, *k], bias [N, C_out]; layouts as conv.
at::Tensor conv_transpose(const at::Tensor& input, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias, c10::SymIntArrayRef stride,
                          c10::SymIntArrayRef padding, c10::SymIntArrayRef output_padding,
                          c10::SymInt groups, c10::SymIntArrayRef dilation,
                          bool packed_input = false, std::string_view strategy = "auto");

namespace detail {
/// The 'loop' strategy of a 2-d conv (groups 1, symmetric padding) when a weight gradient is
/// wanted: weight gradients written straight into one [N, ...] tensor (Note [Loop conv gradients]
/// in conv_autograd.cpp); nullopt where that path does not apply (the composite loop runs then).
std::optional<at::Tensor> conv_loop_training(const at::Tensor& input, const at::Tensor& weight,
                                             const std::optional<at::Tensor>& bias, c10::SymIntArrayRef stride,
                                             c10::SymIntArrayRef padding, c10::SymIntArrayRef dilation,
                                             const c10::SymInt& groups, bool packed_input);
} // namespace detail

} // namespace wide
