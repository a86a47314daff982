// wide normalisations: N independent BatchNorm / InstanceNorm / GroupNorm / LayerNorm / RMSNorm.
// Public C++ API: each function calls its op through the dispatcher, as torch.ops.wide.batch_norm
// does; the implementation is internal to norm.cpp (schemas in registration.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>

#include <array>
#include <optional>
#include <tuple>
#include <string_view>

namespace wide {

/// N BatchNorm{1,2,3}d: weight/bias/running stats [N, C]; input N-first [N, B, C, *] or packed
/// [B, N*C, *]; output packed. Running stats are updated in place when training (per member).
at::Tensor batch_norm(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                      const std::optional<at::Tensor>& bias,
                      const std::optional<at::Tensor>& running_mean,
                      const std::optional<at::Tensor>& running_var, bool training,
                      double momentum, double eps, bool packed_input = false);

/// N InstanceNorm{1,2,3}d: parameters and running stats [N, C]; layouts as batch_norm.
at::Tensor instance_norm(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                         const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& running_mean,
                         const std::optional<at::Tensor>& running_var, bool use_input_stats,
                         double momentum, double eps, bool packed_input = false);

/// N GroupNorm(num_groups, C): weight/bias [N, C]; `n` members; layouts as batch_norm.
at::Tensor group_norm(const at::Tensor& input, int64_t n, int64_t num_groups,
                      const std::optional<at::Tensor>& weight = std::nullopt,
                      const std::optional<at::Tensor>& bias = std::nullopt, double eps = 1e-5,
                      bool packed_input = false);

/// N GroupNorm(num_groups, C) with input and output N-first [N, B, C, *]: the one-pass kernel
/// (wide::fused_group_norm) when no gradient is wanted, else group_norm (packed) differentiably.
at::Tensor group_norm_nfirst(const at::Tensor& input, int64_t num_groups,
                             const std::optional<at::Tensor>& weight = std::nullopt,
                             const std::optional<at::Tensor>& bias = std::nullopt, double eps = 1e-5);

/// The N-first GroupNorm kernel behind group_norm_nfirst (CPU float/double; ATen ops elsewhere);
/// no autograd. Output contiguous N-first.
at::Tensor fused_group_norm(const at::Tensor& input, int64_t num_groups,
                            const std::optional<at::Tensor>& weight,
                            const std::optional<at::Tensor>& bias, double eps);

/// N LayerNorm(normalized_shape): weight/bias [N, *normalized_shape]; input and output N-first.
at::Tensor layer_norm(const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                      const std::optional<at::Tensor>& weight = std::nullopt,
                      const std::optional<at::Tensor>& bias = std::nullopt, double eps = 1e-5,
                      std::string_view strategy = "auto");

/// N RMSNorm(normalized_shape): weight [N, *normalized_shape]; input and output N-first.
at::Tensor rms_norm(const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                    const std::optional<at::Tensor>& weight = std::nullopt,
                    std::optional<double> eps = std::nullopt);

/// N LayerNorm(input + residual) (a post-norm residual block), N-first; the add broadcasts as
/// aten's. One pass over memory when the two have one shape and no gradient is needed.
at::Tensor add_layer_norm(const at::Tensor& input, const at::Tensor& residual,
                          c10::SymIntArrayRef normalized_shape,
                          const std::optional<at::Tensor>& weight = std::nullopt,
                          const std::optional<at::Tensor>& bias = std::nullopt, double eps = 1e-5);

/// The inference kernel behind layer_norm / rms_norm / add_layer_norm: LayerNorm (RMSNorm when
/// `rms`) of input (+ residual) over the trailing `normalized_numel` elements, each member with
/// its own weight/bias [N, *normalized_shape]. Differentiable (wide::fused_norm_backward).
at::Tensor fused_norm(const at::Tensor& input, const std::optional<at::Tensor>& residual,
                      int64_t normalized_numel, const std::optional<at::Tensor>& weight,
                      const std::optional<at::Tensor>& bias, double eps, bool rms = false);

/// BatchNorm in training of a packed input [B, C, *] (C = N*C packed channels) with weight/bias
/// [C]: (out, mean, invstd, unbiased variance), the CPU kernel for contiguous float/double input
/// (ATen's native_batch_norm elsewhere). Differentiable (wide::fused_batch_norm_backward).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_batch_norm(
    const at::Tensor& input, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    double eps);

namespace detail {

/// wide::fused_norm of `input` when the normalized shape is concrete and either nothing needs a
/// gradient or the tensors are float/double on the CPU (its differentiable kernel); else nothing.
/// The fast path of the layer_norm / rms_norm composites.
std::optional<at::Tensor> maybe_fused_norm(const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                                           const std::optional<at::Tensor>& weight,
                                           const std::optional<at::Tensor>& bias,
                                           std::optional<double> eps, bool rms);

/// wide::fused_group_norm of `input` when no gradient is wanted; else nothing.
std::optional<at::Tensor> maybe_fused_group_norm(const at::Tensor& input, int64_t num_groups,
                                                 const std::optional<at::Tensor>& weight,
                                                 const std::optional<at::Tensor>& bias, double eps);

/// Whether wide::fused_batch_norm runs its CPU kernel for these tensors: CPU float/double, one
/// dtype, a contiguous input of at least 3 dims and 16 values per (sample, channel), no Python
/// dispatch (tracing keeps ATen's norm).
bool takes_fused_batch_norm(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                            const std::optional<at::Tensor>& bias);

/// The gradients of wide::fused_norm in ATen ops (any device; differentiable, for double
/// backward): (d input, d weight, d bias), each only where output_mask says.
std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_norm_backward_math(
    const at::Tensor& grad_out, const at::Tensor& input, const std::optional<at::Tensor>& residual,
    int64_t normalized_numel, const std::optional<at::Tensor>& weight, double eps, bool rms,
    std::array<bool, 3> output_mask);

} // namespace detail
} // namespace wide
