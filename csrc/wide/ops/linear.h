// wide::linear: N independent nn.Linear layers evaluated as one operator.
// Public C++ API: each function calls its op through the dispatcher, as torch.ops.wide.linear does;
// the implementation is internal to linear.cpp (schemas in registration.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string_view>

namespace wide {

/// Algorithm for per-member inputs and most shared ones (a shared input of a small layer that
/// needs a gradient runs as one GEMM); Auto = Bmm.
/// See Note [wide::linear strategies].
enum class LinearStrategy { Auto, Bmm, BmmT, Loop };

/// Parses "auto" | "bmm" | "bmm_t" | "loop"; throws a c10::Error naming the bad value otherwise.
LinearStrategy parse_linear_strategy(std::string_view name);

/// out[n] = input[n] @ weight[n].T + bias[n]; input [N, B, *, I] (or [N, I]), weight [N, O, I],
/// bias [N, O] or none; out [N, B, *, O]. A stride-0 (expanded) dim 0 takes the shared-input path
/// for small layers when a gradient is wanted (Note [wide::linear strategies]).
at::Tensor linear(const at::Tensor& input, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias = std::nullopt,
                  std::string_view strategy = "auto");

namespace detail {
/// x @ weight^T (+ addend) as one batched GEMM; x [N, M, I], weight [N, O, I], addend [N, 1, O]
/// (a bias) or [N, M, O] (an accumulator, as baddbmm's) -> [N, M, O]. When a contiguous weight
/// needs a gradient, its gradient comes out in the weight's own layout (Note [Linear weight
/// gradient layout] in linear_autograd.cpp); while tracing or under torch.func transforms the
/// plain baddbmm/bmm runs.
at::Tensor batched_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& addend);
} // namespace detail

} // namespace wide
