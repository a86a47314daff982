// wide attention: scaled dot-product attention with the N members folded into the batch, and the
// small-sequence CPU kernel behind it. Public C++ API: each function calls its op through the
// dispatcher, as torch.ops.wide.attention does (schemas in registration.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace wide {

/// at::scaled_dot_product_attention with its arguments and result (q [B, H, L, E], k/v
/// [B, H_kv, S, E/Ev]); with no gradient needed, no mask and no dropout on CPU it runs the
/// small-sequence kernel (small_attention) where that is faster. The eval graph's attention.
at::Tensor attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                     const std::optional<at::Tensor>& attn_mask = std::nullopt, double dropout_p = 0.0,
                     bool is_causal = false, std::optional<double> scale = std::nullopt,
                     bool enable_gqa = false);

/// softmax(q k^T * scale (+ causal mask)) v for 4-d float/double CPU tensors, one head at a time
/// (H a multiple of H_kv: grouped-query heads). No autograd. Output [B, H, L, Ev], stored
/// [B, L, H, Ev] as ATen's CPU attention stores it.
at::Tensor small_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                           bool is_causal = false, std::optional<double> scale = std::nullopt);

/// Whether wide::attention takes small_attention for these arguments (the rule of
/// Note [wide::attention]).
bool small_attention_applies(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                             const std::optional<at::Tensor>& attn_mask, double dropout_p,
                             bool enable_gqa);

}  // namespace wide
