// Hand-written CPU kernel of wide::small_attention (softmax(q k^T * scale) v for short sequences,
// no mask but an optional causal one, no dropout), compiled once per instruction set
// (small_attention_kernels_{default,avx2,avx512}.cpp) and chosen at run time like the optimizer
// kernels.
// See Note [Small-sequence attention kernel] in small_attention_kernels_impl.h.
#pragma once

#include <cstdint>

namespace wide::ops::cpu {

/// Sizes and element strides of one attention call: q [batch, heads, lq, e], k [batch, kv_heads,
/// lk, e], v [batch, kv_heads, lk, ev], out [batch, heads, lq, ev]; every last dim has stride 1.
/// Head h reads key/value head h / (heads / kv_heads) (grouped-query attention when they differ).
struct AttentionProblem {
  int64_t batch, heads, kv_heads, lq, lk, e, ev;
  int64_t q_strides[3], k_strides[3], v_strides[3], out_strides[3];  // batch, head, row
  double scale;
  bool causal;  // key j is seen by query i only when j <= i (SDPA's is_causal)
};

#define WIDE_ATTENTION_DECLARE_KERNELS(ISA, T)                                                \
  namespace ISA {                                                                             \
  void small_attention(const T* q, const T* k, const T* v, T* out, const AttentionProblem& p); \
  }

WIDE_ATTENTION_DECLARE_KERNELS(DEFAULT, float)
WIDE_ATTENTION_DECLARE_KERNELS(DEFAULT, double)
#if defined(__x86_64__) && !defined(WIDE_NO_AVX_KERNELS)
WIDE_ATTENTION_DECLARE_KERNELS(AVX2, float)
WIDE_ATTENTION_DECLARE_KERNELS(AVX2, double)
WIDE_ATTENTION_DECLARE_KERNELS(AVX512, float)
WIDE_ATTENTION_DECLARE_KERNELS(AVX512, double)
#endif
#undef WIDE_ATTENTION_DECLARE_KERNELS

}  // namespace wide::ops::cpu
