// wide::prelu: N independent nn.PReLU layers (1 or C parameters per member).
// Public C++ API: each function calls its op through the dispatcher, as torch.ops.wide.prelu does;
// the implementation is internal to prelu.cpp (schemas in registration.cpp).
#pragma once

#include <ATen/core/Tensor.h>

namespace wide {

/// weight [N, 1] or [N, C]; input N-first [N, B, C, *] or packed [B, N*C, *]; output packed.
at::Tensor prelu(const at::Tensor& input, const at::Tensor& weight, bool packed_input = false);

} // namespace wide
