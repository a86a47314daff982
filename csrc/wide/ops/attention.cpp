// wide::attention and wide::small_attention (schemas in registration.cpp, the kernel in
// cpu/small_attention_kernels_impl.h).
//
// Note [wide::attention]
// ~~~~~~~~~~~~~~~~~~~~~~
// The widen pass folds the members into SDPA's batch (rules/matmul.py), so a wide encoder's
// attention is ATen's SDPA over N*B*H tiny heads. In the eval graph a pass (fx/eval_rewrites.py)
// turns SDPA calls without mask or dropout into wide::attention, which has SDPA's schema and
// decides per call: small_attention (Note [Small-sequence attention kernel]) when nothing needs a
// gradient, the tensors are 4-d float/double on the CPU with concrete sizes, and the keys are few
// enough for the one-head-at-a-time kernel to win (kMaxKeys; measured against ATen's flash kernel
// with `python -m wide_compiler benchmark attention`); at::scaled_dot_product_attention otherwise.
// It is CompositeImplicitAutograd, so whenever a gradient is wanted autograd sees SDPA's own
// backward, and under torch.compile / export the decision is taken at trace time like any
// decomposition. small_attention itself has CPU and Meta kernels, ATen's SDPA on other devices, and
// no autograd formula.
#include "wide/ops/attention.h"
#include "wide/ops/call_op.h"
#include "wide/ops/transforms.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cmath>

#include "wide/ops/cpu/small_attention_kernels.h"
#include "wide/cpu/isa.h"  // the run-time instruction-set choice

namespace wide {
namespace {

// The most keys small_attention takes: past this the K^T / V / score buffers of one head leave
// the L1/L2 caches and ATen's blocked flash kernel is the better one.
constexpr int64_t kMaxKeys = 512;

template <typename Int>
void check_small(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, c10::ArrayRef<Int> qs,
                 c10::ArrayRef<Int> ks, c10::ArrayRef<Int> vs) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "wide::small_attention: expected 4-d query, key and value [B, H, L, E], got ", q.dim(),
              "-d, ", k.dim(), "-d and ", v.dim(), "-d");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble),
              "wide::small_attention: query, key and value must all be float32 or all float64, got ",
              q.scalar_type(), ", ", k.scalar_type(), " and ", v.scalar_type());
  TORCH_CHECK(ks[0] == qs[0] && vs[0] == qs[0] && vs[1] == ks[1] && vs[2] == ks[2] && ks[3] == qs[3],
              "wide::small_attention: query ", qs, ", key ", ks, " and value ", vs,
              " must agree on batch, key/value heads, key length and head dim");
  TORCH_CHECK(ks[1] >= 1 && qs[1] % ks[1] == 0, "wide::small_attention: ", qs[1],
              " query heads are not a multiple of ", ks[1], " key/value heads");
  TORCH_CHECK(ks[2] >= 1, "wide::small_attention: no keys (key length 0)");
  TORCH_CHECK(qs[3] >= 1, "wide::small_attention: head dim 0");
}

// [B, H, L, Ev] stored [B, L, H, Ev], as ATen's CPU flash attention returns it.
at::Tensor empty_output(const at::Tensor& q, const at::Tensor& v) {
  return at::empty_symint({q.sym_size(0), q.sym_size(2), q.sym_size(1), v.sym_size(3)}, q.options())
      .transpose(1, 2);
}

at::Tensor small_attention_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool,
                                std::optional<double>) {
  check_small(q, k, v, q.sym_sizes(), k.sym_sizes(), v.sym_sizes());
  return empty_output(q, v);
}

at::Tensor small_attention_cpu(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                               bool is_causal, std::optional<double> scale) {
  check_small(query, key, value, query.sizes(), key.sizes(), value.sizes());
  auto unit_last = [](const at::Tensor& t) { return t.stride(3) == 1 ? t : t.contiguous(); };
  const at::Tensor q = unit_last(query), k = unit_last(key), v = unit_last(value);
  at::Tensor out = empty_output(q, v);
  if (out.numel() == 0) return out;
  ops::cpu::AttentionProblem p{};
  p.batch = q.size(0);
  p.heads = q.size(1);
  p.kv_heads = k.size(1);
  p.lq = q.size(2);
  p.lk = k.size(2);
  p.e = q.size(3);
  p.ev = v.size(3);
  for (int i = 0; i < 3; ++i) {
    p.q_strides[i] = q.stride(i);
    p.k_strides[i] = k.stride(i);
    p.v_strides[i] = v.stride(i);
    p.out_strides[i] = out.stride(i);
  }
  p.scale = scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(p.e));
  p.causal = is_causal;
  auto run = [&](auto* type_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    WIDE_ISA_CALL(::wide::ops::cpu, small_attention, q.const_data_ptr<T>(), k.const_data_ptr<T>(),
                  v.const_data_ptr<T>(), out.mutable_data_ptr<T>(), p);
  };
  if (q.scalar_type() == at::kFloat) {
    run(static_cast<float*>(nullptr));
  } else {
    run(static_cast<double*>(nullptr));
  }
  return out;
}

// Devices without a kernel of their own (CUDA): ATen's SDPA computes the same attention, returned in
// small_attention's output layout (the Meta kernel's strides hold on every device).
at::Tensor small_attention_any(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                               bool is_causal, std::optional<double> scale) {
  check_small(query, key, value, query.sizes(), key.sizes(), value.sizes());
  const bool gqa = query.size(1) != key.size(1);
  return empty_output(query, value)
      .copy_(at::scaled_dot_product_attention(query, key, value, {}, 0.0, is_causal, scale, gqa));
}

at::Tensor attention_impl(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                          const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                          std::optional<double> scale, bool enable_gqa) {
  if (small_attention_applies(query, key, value, attn_mask, dropout_p, enable_gqa)) {
    return small_attention(query, key, value, is_causal, scale);
  }
  return at::scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                          enable_gqa);
}

}  // namespace

bool small_attention_applies(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                             const std::optional<at::Tensor>& attn_mask, double dropout_p,
                             bool enable_gqa) {
  if (attn_mask.has_value() || dropout_p != 0.0) return false;
  if (at::GradMode::is_enabled() && (query.requires_grad() || key.requires_grad() || value.requires_grad())) {
    return false;
  }
  if (!detail::plain_autograd({&query, &key, &value})) return false;  // Note [Kernels under transforms]
  const auto dtype = query.scalar_type();
  if (query.dim() != 4 || key.dim() != 4 || value.dim() != 4 || (dtype != at::kFloat && dtype != at::kDouble) ||
      key.scalar_type() != dtype || value.scalar_type() != dtype || !query.device().is_cpu() ||
      !key.device().is_cpu() || !value.device().is_cpu() || query.is_nested()) {
    return false;
  }
  int64_t s[3][4];
  const at::Tensor* ts[3] = {&query, &key, &value};
  for (int t = 0; t < 3; ++t) {
    for (int d = 0; d < 4; ++d) {
      auto v = ts[t]->sym_size(d).maybe_as_int();
      if (!v.has_value()) return false;  // symbolic sizes: SDPA
      s[t][d] = *v;
    }
  }
  const auto &q = s[0], &k = s[1], &v = s[2];
  const bool heads_ok = k[1] == q[1] || (enable_gqa && k[1] >= 1 && q[1] % k[1] == 0);
  return heads_ok && k[0] == q[0] && v[0] == q[0] && v[1] == k[1] && v[2] == k[2] && k[3] == q[3] &&
         k[2] >= 1 && k[2] <= kMaxKeys && q[2] >= 1 && q[3] >= 1;
}

at::Tensor attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                     const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                     std::optional<double> scale, bool enable_gqa) {
  return detail::call_op<"wide::attention", decltype(attention)>(
      query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa);
}

at::Tensor small_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                           bool is_causal, std::optional<double> scale) {
  return detail::call_op<"wide::small_attention", decltype(small_attention)>(
      query, key, value, is_causal, scale);
}

}  // namespace wide

TORCH_LIBRARY_IMPL(wide, CompositeImplicitAutograd, m) {
  m.impl("attention", &wide::attention_impl);
}

TORCH_LIBRARY_IMPL(wide, CPU, m) {
  m.impl("small_attention", &wide::small_attention_cpu);
}

TORCH_LIBRARY_IMPL(wide, CompositeExplicitAutograd, m) {
  m.impl("small_attention", &wide::small_attention_any);
}

TORCH_LIBRARY_IMPL(wide, Meta, m) {
  m.impl("small_attention", &wide::small_attention_meta);
}
