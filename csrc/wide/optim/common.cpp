#include "wide/optim/common.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <string>
#include <utility>

namespace wide::optim {
namespace detail {

void check_param(const at::Tensor& param, const char* op) {
  TORCH_CHECK(param.defined(), "wide::", op, ": expected a parameter tensor, got an undefined one");
  TORCH_CHECK(param.dim() >= 1, "wide::", op, ": expected a parameter of shape [N, ...] (dim 0 is "
              "the member dim), got a 0-dim tensor");
  TORCH_CHECK(at::isFloatingType(param.scalar_type()), "wide::", op,
              ": expected a floating-point parameter, got ", param.scalar_type());
}

void check_like(const at::Tensor& param, const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.defined(), "wide::", op, ": expected ", name, " to be defined");
  TORCH_CHECK(t.sym_sizes() == param.sym_sizes(), "wide::", op, ": expected ", name,
              " of the parameter's shape ", param.sym_sizes(), ", got ", t.sym_sizes());
  TORCH_CHECK(t.scalar_type() == param.scalar_type(), "wide::", op, ": expected ", name,
              " of the parameter's dtype ", param.scalar_type(), ", got ", t.scalar_type());
  TORCH_CHECK(t.device() == param.device(), "wide::", op, ": expected ", name,
              " on the parameter's device ", param.device(), ", got ", t.device());
}

void check_hparam(const at::Tensor& t, const c10::SymInt& n, const char* op, const char* name) {
  TORCH_CHECK(t.defined(), "wide::", op, ": expected ", name, " to be a tensor");
  TORCH_CHECK(t.dim() <= 1 && (t.sym_numel() == n || t.sym_numel() == 1), "wide::", op,
              ": expected ", name, " with one value per member (shape [", n,
              "]) or one shared value, got shape ", t.sym_sizes());
  TORCH_CHECK(!at::isComplexType(t.scalar_type()) && t.scalar_type() != at::kBool, "wide::", op,
              ": expected ", name, " to be a real tensor, got ", t.scalar_type());
}

// Note [Optimizer step arguments never alias]
// --------------------------------------------
// A fused step reads every argument and writes some of them, element by element and in an order
// of its own (the composite: whole-tensor ATen ops one after another; the CPU kernel: one pass
// over contiguous copies, copied back one after another). When a written tensor shares memory
// with another argument (exp_avg and exp_avg_sq the same tensor, a gradient that is a view of its
// parameter, lr a view of step), the result depends on that order: no order gives what
// torch.optim computes for separate tensors, and nothing would say so. So every pair (written,
// any other argument) is checked before anything is changed, as ATen's in-place ops check
// theirs (assert_no_overlap), and refused with both names. Tensors in one storage whose element
// ranges interleave without touching (the two halves of a [N, 2, ...] buffer selected on dim 1)
// are told apart exactly from their sizes and strides, so only real overlap is refused. With
// symbolic sizes (a dynamic-shape trace) only the same tensor twice is caught here; the real
// kernels check again with concrete sizes.
namespace {

enum class Overlap { No, Yes, Unknown };

bool symbolic(const at::Tensor& t) { return t.unsafeGetTensorImpl()->has_symbolic_sizes_strides(); }

// [first, last] element offsets of t (numel > 0) in its storage, in elements of t's dtype.
std::pair<int64_t, int64_t> element_range(const at::Tensor& t) {
  int64_t last = t.storage_offset();
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  return {t.storage_offset(), last};
}

// Whether a and b (defined, concrete sizes) share at least one byte of memory.
Overlap overlap(const at::Tensor& a, const at::Tensor& b) {
  if (a.is_same(b)) return a.numel() == 0 ? Overlap::No : Overlap::Yes;
  if (a.numel() == 0 || b.numel() == 0 || !a.has_storage() || !b.has_storage()) return Overlap::No;
  if (!a.storage().is_alias_of(b.storage())) return Overlap::No;
  const auto [a0, a1] = element_range(a);
  const auto [b0, b1] = element_range(b);
  const int64_t sa = static_cast<int64_t>(a.element_size()), sb = static_cast<int64_t>(b.element_size());
  if ((a1 + 1) * sa <= b0 * sb || (b1 + 1) * sb <= a0 * sa) return Overlap::No;  // disjoint ranges
  // Dense tensors cover every element of their range: intersecting ranges overlap.
  if (a.is_non_overlapping_and_dense() && b.is_non_overlapping_and_dense()) return Overlap::Yes;
  // Strided views with intersecting ranges: mark a's elements, look for one of b's (metadata
  // only, on the host; bounded so that the check itself stays cheap).
  constexpr int64_t kMaxExactElements = int64_t{1} << 26;
  const int64_t lo = std::min(a0, b0), hi = std::max(a1, b1);
  if (sa != sb || hi - lo + 1 > kMaxExactElements) return Overlap::Unknown;
  const at::Tensor mask = at::zeros({hi - lo + 1}, at::TensorOptions().dtype(at::kBool));
  mask.as_strided(a.sizes(), a.strides(), a0 - lo).fill_(true);
  return mask.as_strided(b.sizes(), b.strides(), b0 - lo).any().item<bool>() ? Overlap::Yes : Overlap::No;
}

void refuse_overlap(const char* op, const NamedTensor& w, const NamedTensor& other, Overlap o) {
  TORCH_CHECK(o == Overlap::No, "wide::", op, ": ", w.name, " ",
              o == Overlap::Yes ? "shares memory with " : "may share memory with ", other.name,
              w.tensor.is_same(other.tensor) ? " (the same tensor)" : "",
              "; the step writes ", w.name, " and would read or write elements it has already "
              "changed, giving a wrong update: pass separate tensors (e.g. ", other.name,
              ".clone())");
}

}  // namespace

void check_no_overlap(const char* op, const std::vector<NamedTensor>& written,
                      const std::vector<NamedTensor>& read) {
  for (size_t i = 0; i < written.size(); ++i) {
    const NamedTensor& w = written[i];
    const bool concrete = !symbolic(w.tensor);
    TORCH_CHECK(!concrete || at::has_internal_overlap(w.tensor) != at::MemOverlap::Yes, "wide::", op,
                ": ", w.name, " has elements that share memory (an expanded or stride-0 tensor, "
                "strides ", w.tensor.strides(), "); the step writes it in place: pass a tensor "
                "that owns its elements (e.g. ", w.name, ".clone())");
    const auto against = [&](const NamedTensor& other) {
      if (!other.tensor.defined()) return;
      if (!concrete || symbolic(other.tensor)) {
        refuse_overlap(op, w, other, w.tensor.is_same(other.tensor) ? Overlap::Yes : Overlap::No);
        return;
      }
      refuse_overlap(op, w, other, overlap(w.tensor, other.tensor));
    };
    for (size_t j = i + 1; j < written.size(); ++j) against(written[j]);
    for (const NamedTensor& r : read) against(r);
  }
}

std::vector<double> member_values(const at::Tensor& t, int64_t n) {
  const at::Tensor d = t.to(at::kCPU, at::kDouble).contiguous();
  const double* p = d.const_data_ptr<double>();
  if (d.numel() == 1) return std::vector<double>(n, p[0]);
  return std::vector<double>(p, p + n);
}

void increment_step(const at::Tensor& step) { step.add_(1); }

bool kernel_dtype(const at::Tensor& param) {
  return param.scalar_type() == at::kFloat || param.scalar_type() == at::kDouble;
}

at::Tensor contiguous(const at::Tensor& t) { return t.is_contiguous() ? t : t.contiguous(); }

void copy_back(const at::Tensor& original, const at::Tensor& work) {
  if (!original.is_same(work)) original.copy_(work);
}

at::Tensor member_tensor(const std::vector<double>& values, const at::Tensor& param) {
  const int64_t n = static_cast<int64_t>(values.size());
  at::Tensor t = at::empty({n}, at::TensorOptions().dtype(at::kDouble));
  std::copy(values.begin(), values.end(), t.mutable_data_ptr<double>());
  std::vector<int64_t> shape(param.dim(), 1);
  shape[0] = n;
  return t.to(param.device(), param.scalar_type()).view(shape);
}

}  // namespace detail

}  // namespace wide::optim
