#include "wide/ops/embedding.h"

#include "wide/ops/call_op.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/embedding.h>
#include <ATen/ops/embedding_bag.h>
#include <ATen/ops/embedding_renorm.h>
#include <ATen/ops/full.h>
#include <ATen/TensorSubclassLikeUtils.h>
#include <ATen/ops/where.h>
#include <torch/library.h>

#include <vector>

// Note [wide embeddings]
// ----------------------
// The N tables [N, V, D] are one table [N*V, D] (a free view); member n's index i is row n*V + i.
// One lookup with offset indices serves all members: no N x N cross products and no loop. Shared
// indices (stride 0 on dim 0) get their offsets by broadcasting, which materialises only the
// [N, *] integer indices, never the embeddings.
//  * padding_idx: at::embedding takes ONE padding row, but each member has its own (n*V + p).
//    The lookup runs without one and the positions that hit the padding row take the detached
//    value: same output, and no gradient reaches the padding rows, exactly as nn.Embedding.
//  * scale_grad_by_freq counts occurrences per flat row, i.e. per member and row: as each
//    member alone.
//  * max_norm arrives as a separate in-place aten.embedding_renorm_ on the (detached) weight:
//    embedding_renorm_ below renormalises the rows each member references.
//  * EmbeddingBag: bags of all members are concatenated: indices [N*T] offset by member, bag
//    offsets shifted by n*T. padding_idx entries are excluded from their bag whatever their
//    row, so a member's padding index is mapped to member 0's padding row p and p is passed as
//    the one padding_idx. Bag offsets are assumed to start at 0 per member, as PyTorch requires.
// sparse=True gradients are not supported (a sparse gradient of the [N*V, D] view).

namespace wide {

namespace {

void check_table(const char* op, const at::Tensor& weight, const at::Tensor& indices) {
  TORCH_CHECK(weight.dim() == 3, "wide::", op, ": expected weight [N, num_embeddings, dim], got ",
              weight.sym_sizes());
  TORCH_CHECK(indices.dim() >= 1 && indices.sym_size(0) == weight.sym_size(0), "wide::", op,
              ": expected N-first indices [N, *] with N=", weight.sym_size(0), ", got ",
              indices.sym_sizes());
  TORCH_CHECK(indices.scalar_type() == at::kLong || indices.scalar_type() == at::kInt,
              "wide::", op, ": expected integer indices, got ", indices.scalar_type());
}

// Whether real values can be read (a fake, meta or traced tensor has none).
bool has_values(const at::Tensor& t) { return !at::isTensorSubclassLike(t) && !t.is_meta() && t.numel() > 0; }

// An index outside [0, V) must not read (or renormalise) another member's row, nor, negative,
// a row counted from the end of its own table: on real tensors it raises an IndexError naming the
// member and the user's own index (a fake, meta or traced tensor has no values to check).
void check_indices(const char* op, const at::Tensor& indices, const c10::SymInt& v) {
  if (!has_values(indices)) return;
  const at::Tensor valid = indices.ge(c10::Scalar(0)).logical_and(indices.lt(c10::Scalar(v)));
  if (valid.all().item<bool>()) return;
  const int64_t first = valid.logical_not().reshape({-1}).nonzero().select(0, 0).item<int64_t>();
  const int64_t per_member = indices.numel() / indices.size(0);
  TORCH_CHECK_INDEX(false, "wide::", op, ": index ", indices.reshape({-1})[first].item<int64_t>(),
                    " of member ", first / per_member, " is not in the valid range [0, ", v,
                    ") of its table (index out of range in self)");
}

// indices [N, *] -> indices + n * V (broadcast; materialises only the integer indices), always
// int64: with int32 indices, rows n*V + i of a table of N*V >= 2^31 rows do not fit in int32
// and would wrap to another member's row (or a negative one). Invalid indices raise on real
// tensors (check_indices); on traced ones they are mapped to row N*V, past the table, so the
// lookup raises ATen's own "index out of range" error.
at::Tensor offset_indices(const char* op, const at::Tensor& indices, const c10::SymInt& n, const c10::SymInt& v) {
  check_indices(op, indices, v);
  const at::Tensor idx = indices.to(at::kLong);
  std::vector<c10::SymInt> shape(indices.dim(), c10::SymInt(1));
  shape[0] = n;
  const at::Tensor base = at::arange(c10::Scalar(n), idx.options()).mul(c10::Scalar(v)).view_symint(shape);
  const at::Tensor valid = idx.ge(c10::Scalar(0)).logical_and(idx.lt(c10::Scalar(v)));
  return at::where(valid, idx.add(base), c10::Scalar(n * v));
}

at::Tensor embedding_impl(const at::Tensor& weight, const at::Tensor& indices,
                          c10::SymInt padding_idx, bool scale_grad_by_freq, bool sparse) {
  check_table("embedding", weight, indices);
  TORCH_CHECK(!sparse, "wide::embedding: sparse=True gradients are not supported; use sparse=False");
  const c10::SymInt n = weight.sym_size(0), v = weight.sym_size(1), dim = weight.sym_size(2);
  TORCH_CHECK(padding_idx >= -1 && padding_idx < v, "wide::embedding: expected padding_idx in "
              "[0, num_embeddings) or -1 (none), got ", padding_idx);
  const at::Tensor table = weight.reshape_symint({n * v, dim});
  at::Tensor out = at::embedding_symint(table, offset_indices("embedding", indices, n, v), -1, scale_grad_by_freq, false);
  if (padding_idx >= 0) {
    const at::Tensor hit = indices.eq(padding_idx.guard_int(__FILE__, __LINE__)).unsqueeze(-1);
    out = at::where(hit, out.detach(), out);
  }
  return out;
}

at::Tensor& embedding_renorm_impl(at::Tensor& weight, const at::Tensor& indices,
                                  double max_norm, double norm_type) {
  check_table("embedding_renorm_", weight, indices);
  const c10::SymInt n = weight.sym_size(0), v = weight.sym_size(1), dim = weight.sym_size(2);
  // Written in place: a table whose rows share memory (an expanded [N, V, D], stride 0 on the
  // member dim) would renormalise one row once per member that references it.
  TORCH_CHECK(weight.unsafeGetTensorImpl()->has_symbolic_sizes_strides() ||
                  at::has_internal_overlap(weight) != at::MemOverlap::Yes,
              "wide::embedding_renorm_: the weight's elements share memory (an expanded or "
              "stride-0 tensor, strides ", weight.strides(), "), so members' rows cannot be "
              "renormalised in place independently: pass a table that owns its rows (e.g. "
              "weight.contiguous())");
  if (weight.is_contiguous() && (weight.is_cpu() || weight.sym_stride(-2) == dim)) {
    at::Tensor table = weight.view_symint({n * v, dim});
    at::embedding_renorm_(table, offset_indices("embedding_renorm_", indices, n, v), max_norm, norm_type);
  } else {
    // A strided table (a transposed or sliced [N, V, D]) is not one [N*V, D] view: one renorm
    // per member on its own [V, D] table, with the same index checks as the one-call path.
    check_indices("embedding_renorm_", indices, v);
    const int64_t members = n.guard_int(__FILE__, __LINE__);
    // ATen's CUDA renorm reads a row as stride(0) elements (its CPU kernel follows the strides):
    // a strided table renormalised the wrong elements, and other members' (up to 1.09 off in the
    // op fuzzer on an H200, torch 2.11; a [1, D] table is "contiguous" whatever its stride(0)).
    // Off the CPU such a table is renormalised as a contiguous copy, written back.
    for (int64_t k = 0; k < members; ++k) {
      at::Tensor table = weight.select(0, k);
      if (table.is_cpu() || table.sym_stride(0) == table.sym_size(1)) {
        at::embedding_renorm_(table, indices.select(0, k), max_norm, norm_type);
      } else {
        at::Tensor rows = table.clone(at::MemoryFormat::Contiguous);
        at::embedding_renorm_(rows, indices.select(0, k), max_norm, norm_type);
        table.copy_(rows);
      }
    }
  }
  return weight;
}

at::Tensor embedding_bag_impl(const at::Tensor& weight, const at::Tensor& indices,
                              const std::optional<at::Tensor>& offsets, bool scale_grad_by_freq,
                              int64_t mode, bool sparse,
                              const std::optional<at::Tensor>& per_sample_weights,
                              bool include_last_offset, int64_t padding_idx) {
  check_table("embedding_bag", weight, indices);
  TORCH_CHECK(!sparse, "wide::embedding_bag: sparse=True gradients are not supported");
  TORCH_CHECK(mode >= 0 && mode <= 2, "wide::embedding_bag: expected mode 0 (sum), 1 (mean) or 2 "
              "(max), got ", mode);
  TORCH_CHECK(!(scale_grad_by_freq && mode == 2), "wide::embedding_bag: max mode does not support "
              "scale_grad_by_freq (as PyTorch)");
  const c10::SymInt n = weight.sym_size(0), v = weight.sym_size(1), dim = weight.sym_size(2);
  TORCH_CHECK(padding_idx >= -1 && v > padding_idx, "wide::embedding_bag: expected padding_idx "
              "in [0, num_embeddings) or -1, got ", padding_idx);
  if (per_sample_weights.has_value()) {
    TORCH_CHECK(per_sample_weights->sym_sizes() == indices.sym_sizes(), "wide::embedding_bag: "
                "expected per_sample_weights shaped like indices ", indices.sym_sizes(), ", got ",
                per_sample_weights->sym_sizes());
  }
  if (scale_grad_by_freq && n != 1) {
    // PyTorch 2.13's CPU backward with scale_grad_by_freq divides a row's gradient by the count
    // of another row of the same call (pytorch#190063): with all members in one call that row can
    // belong to another member. One call per member keeps each member's counts its own.
    std::vector<at::Tensor> outs;
    const int64_t members = n.guard_int(__FILE__, __LINE__);
    for (int64_t m = 0; m < members; ++m) {
      const auto slice = [m](const at::Tensor& t) { return t.narrow(0, m, 1); };
      std::optional<at::Tensor> off, psw;
      if (offsets.has_value()) off = offsets->dim() == 2 ? slice(*offsets) : *offsets;
      if (per_sample_weights.has_value()) psw = slice(*per_sample_weights);
      outs.push_back(embedding_bag_impl(slice(weight), slice(indices), off, true, mode, false, psw,
                                        include_last_offset, padding_idx));
    }
    return at::cat(outs);
  }
  at::Tensor idx = offset_indices("embedding_bag", indices, n, v);
  if (padding_idx >= 0) idx = at::where(indices.eq(padding_idx), idx.new_full({}, padding_idx), idx);
  const at::Tensor table = weight.reshape_symint({n * v, dim});
  std::optional<at::Tensor> psw;
  if (per_sample_weights.has_value()) psw = per_sample_weights->reshape_symint({-1});
  const std::optional<int64_t> pad = padding_idx >= 0 ? std::optional<int64_t>(padding_idx) : std::nullopt;

  c10::SymInt bags;
  at::Tensor flat_offsets;
  if (!offsets.has_value()) {
    // Fixed-length bags: indices [N, B, L] -> N*B bags of L.
    TORCH_CHECK(indices.dim() == 3, "wide::embedding_bag: without offsets expected indices "
                "[N, B, L], got ", indices.sym_sizes());
    TORCH_CHECK(!include_last_offset, "wide::embedding_bag: include_last_offset needs offsets");
    const c10::SymInt l = indices.sym_size(2);
    bags = n * indices.sym_size(1);
    flat_offsets = at::arange(c10::Scalar(0), c10::Scalar(bags * l + 1), c10::Scalar(l), idx.options());
  } else {
    TORCH_CHECK(indices.dim() == 2, "wide::embedding_bag: with offsets expected indices [N, T], got ",
                indices.sym_sizes());
    TORCH_CHECK(offsets->scalar_type() == at::kLong || offsets->scalar_type() == at::kInt,
                "wide::embedding_bag: expected integer offsets, got ", offsets->scalar_type());
    // int64, as the offset indices: the shifted offsets run up to N*T.
    const at::Tensor off = offsets->to(at::kLong);
    TORCH_CHECK(off.dim() == 1 || (off.dim() == 2 && off.sym_size(0) == n), "wide::embedding_bag: "
                "expected offsets [B] (shared) or [N, B], got ", off.sym_sizes());
    const c10::SymInt t = indices.sym_size(1);
    const at::Tensor per_member = (off.dim() == 1 ? off.unsqueeze(0) : off);
    // Each member's bags must start at 0, as ATen requires of one member; otherwise the previous
    // member's last bag would absorb the leading indices. Checked on real tensors only (a fake
    // or traced tensor has no values to read).
    // With include_last_offset the last offset must be T (as PyTorch documents; ATen's own paths
    // disagree on a smaller one), since bags run to the end of each member's indices here.
    if (has_values(off)) {
      TORCH_CHECK(per_member.select(1, 0).eq(0).all().item<bool>(), "wide::embedding_bag: expected "
                  "every member's offsets to start at 0, got first offsets ", per_member.select(1, 0));
      // As ATen checks one member's offsets: non-decreasing and at most T, per member, so that a
      // member's bad offsets can never move indices into another member's bags.
      const at::Tensor bad = per_member.gt(t.guard_int(__FILE__, __LINE__)).any(1).logical_or(
          per_member.narrow(1, 1, per_member.size(1) - 1).lt(per_member.narrow(1, 0, per_member.size(1) - 1)).any(1));
      if (bad.any().item<bool>()) {
        const int64_t m = bad.nonzero().select(0, 0).item<int64_t>();
        TORCH_CHECK(false, "wide::embedding_bag: offsets of member ", off.dim() == 1 ? 0 : m,
                    off.dim() == 1 ? " (shared)" : "", " must be non-decreasing and at most the number of "
                    "indices ", t, ", got ", per_member.select(0, m));
      }
      TORCH_CHECK(!include_last_offset || per_member.select(1, -1).eq(t.guard_int(__FILE__, __LINE__)).all().item<bool>(),
                  "wide::embedding_bag: with include_last_offset=True expected every member's last "
                  "offset to equal the number of indices ", t, ", got ", per_member.select(1, -1));
    }
    // Starts of every bag of member m shifted by m*T; the concatenation ends with N*T.
    const at::Tensor starts = include_last_offset ? per_member.narrow_symint(1, 0, per_member.sym_size(1) - 1)
                                                  : per_member;
    const at::Tensor shift = at::arange(c10::Scalar(n), off.options()).mul(c10::Scalar(t)).unsqueeze(1);
    const at::Tensor shifted = starts.add(shift).reshape_symint({-1});
    bags = shifted.sym_size(0);
    flat_offsets = at::cat({shifted, at::full_symint({c10::SymInt(1)}, c10::Scalar(n * t), off.options())});
  }
  auto result = at::embedding_bag(table, idx.reshape_symint({-1}), flat_offsets, scale_grad_by_freq,
                                  mode, false, psw, /*include_last_offset=*/true, pad);
  return std::get<0>(result).view_symint({n, bags / n, dim});
}

} // namespace

at::Tensor embedding(const at::Tensor& weight, const at::Tensor& indices, c10::SymInt padding_idx,
                     bool scale_grad_by_freq, bool sparse) {
  return detail::call_op<"wide::embedding", decltype(embedding)>(
      weight, indices, std::move(padding_idx), scale_grad_by_freq, sparse);
}

at::Tensor& embedding_renorm_(at::Tensor& weight, const at::Tensor& indices, double max_norm,
                              double norm_type) {
  return detail::call_op<"wide::embedding_renorm_", decltype(embedding_renorm_)>(
      weight, indices, max_norm, norm_type);
}

at::Tensor embedding_bag(const at::Tensor& weight, const at::Tensor& indices,
                         const std::optional<at::Tensor>& offsets, bool scale_grad_by_freq,
                         int64_t mode, bool sparse,
                         const std::optional<at::Tensor>& per_sample_weights,
                         bool include_last_offset, int64_t padding_idx) {
  return detail::call_op<"wide::embedding_bag", decltype(embedding_bag)>(
      weight, indices, offsets, scale_grad_by_freq, mode, sparse, per_sample_weights,
      include_last_offset, padding_idx);
}

} // namespace wide

TORCH_LIBRARY_IMPL(wide, CompositeImplicitAutograd, m) {
  m.impl("embedding", &wide::embedding_impl);
  m.impl("embedding_renorm_", &wide::embedding_renorm_impl);
  m.impl("embedding_bag", &wide::embedding_bag_impl);
}
