// wide::prelu: N independent nn.PReLU layers (1 or C parameters per member).
#pragma once

#include <ATen/core/Tensor.h>

namespace wide {

/// weight [N, 1] or [N, C]; input N-first [N, B, C, *] or packed [B, N*C, *]; output packed.
at::Tensor prelu(const at::Tensor& input, const at::Tensor& weight, bool packed_input = false);

} // namespace wide
