// wide embeddings: N independent nn.Embedding / nn.EmbeddingBag tables looked up at once.
// Public C++ API: each function calls its op through the dispatcher, as torch.ops.wide.embedding
// does; the implementation is internal to embedding.cpp (schemas in registration.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>

#include <optional>

namespace wide {

/// weight [N, V, D]; indices N-first [N, *] (stride 0 on dim 0 for shared indices); out
/// [N, *, D]. padding_idx (per member, in [0, V), or -1) rows get no gradient.
at::Tensor embedding(const at::Tensor& weight, const at::Tensor& indices,
                     c10::SymInt padding_idx = -1, bool scale_grad_by_freq = false,
                     bool sparse = false);

/// In place: rescales each member's rows referenced by its indices to norm <= max_norm.
at::Tensor& embedding_renorm_(at::Tensor& weight, const at::Tensor& indices, double max_norm,
                              double norm_type);

/// weight [N, V, D]; indices [N, T] with offsets [N, B] (or [B] shared) or [N, B, L] without;
/// per_sample_weights shaped like indices; out [N, B, D]. mode: 0 sum, 1 mean, 2 max.
at::Tensor embedding_bag(const at::Tensor& weight, const at::Tensor& indices,
                         const std::optional<at::Tensor>& offsets = std::nullopt,
                         bool scale_grad_by_freq = false, int64_t mode = 0, bool sparse = false,
                         const std::optional<at::Tensor>& per_sample_weights = std::nullopt,
                         bool include_last_offset = false, int64_t padding_idx = -1);

} // namespace wide
