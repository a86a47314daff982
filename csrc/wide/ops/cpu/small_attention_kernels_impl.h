// Body of the small-sequence attention kernel (wide::small_attention). Included ONLY by
// small_attention_kernels_{default,avx2,avx512}.cpp, each compiled with CPU_CAPABILITY=<ISA> and
// that ISA's -m flags (see CMakeLists.txt), so that at::vec::Vectorized is the real SIMD type and
// the definitions land in wide::ops::cpu::<ISA>.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "wide/ops/cpu/small_attention_kernels.h"
#include "wide/ops/cpu/isa_kernel.h"

// Note [Small-sequence attention kernel]
// --------------------------------------
// With N members folded into the batch, a wide encoder's attention is thousands of tiny
// problems: N*B*H heads of, e.g., 32 queries x 32 keys x 16 dims. ATen's CPU flash-attention
// kernel is built for long sequences (blocked online softmax, per-block bookkeeping) and reaches
// about 60 GFLOP/s there (measured: 16 members x 8 x 4 heads, T=32, E=16: 540 us, 2 threads),
// a quarter of what the same machine's GEMMs do. This kernel does one head at a time, whole:
//   1. pack K^T [e][lk] and V [lk][ev] into thread-local buffers padded to whole vectors (zeros),
//      once per key/value head (grouped-query heads reuse them);
//   2. for a block of 4 query rows: the scores of all keys, vectorised over keys, 4 rows x 2
//      vectors of independent FMA chains (broadcast q[i, d] against row d of K^T);
//   3. an exact softmax per row (max, exp, sum; masked keys, causal or padding, are -inf);
//   4. out rows = P V, vectorised over the value dim, 4 rows x 2 vectors of chains;
//   5. scale by 1/sum and store.
// Scores are scaled after the dot product, as SDPA's kernels do; everything accumulates in T.
// It has no backward and no mask other than causal: it is the no-gradient path of wide::attention
// (Note [wide::attention] in ops/attention.cpp), which only takes it where it wins. Threading:
// at::parallel_for over (batch, head) with a grain of about 64K multiply-adds.

WIDE_ISA_KERNEL_BEGIN

namespace wide::ops::cpu::CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;
using ::wide::cpu_vec::CPU_CAPABILITY::lanes_max;
using ::wide::cpu_vec::CPU_CAPABILITY::lanes_sum;

// Query rows per register block: 8 x 2 score accumulators fit AVX-512's 32 registers, 4 x 2 the
// 16 of AVX2.
#ifdef CPU_CAPABILITY_AVX512
constexpr int64_t kRows = 8;
#else
constexpr int64_t kRows = 4;
#endif

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// The register block of both products below: acc[r][c] = sum over t in [0, depth) of
// a(r, t) * b[t * ldb + (c0 + c) * W ...], kRows rows x C vectors of independent FMA chains (one
// broadcast of a(r, t) against C vectors of row t of b).
template <typename T, int C, typename A>
inline void accumulate_block(Vectorized<T> (&acc)[kRows][C], A&& a, const T* b, int64_t ldb, int64_t depth,
                             int64_t c0) {
  using V = Vectorized<T>;
  constexpr int64_t W = V::size();
  for (int64_t r = 0; r < kRows; ++r) {
    for (int c = 0; c < C; ++c) acc[r][c] = V(T(0));
  }
  for (int64_t t = 0; t < depth; ++t) {
    V bv[C];
    for (int c = 0; c < C; ++c) bv[c] = V::loadu(b + t * ldb + (c0 + c) * W);
    for (int64_t r = 0; r < kRows; ++r) {
      const V av(a(r, t));
      for (int c = 0; c < C; ++c) acc[r][c] = at::vec::fmadd(av, bv[c], acc[r][c]);
    }
  }
}

// Scores of kRows query rows against key vectors [c0, c0 + C) of K^T: s[r][c0*W ...] = q_r . k * scale.
template <typename T, int C>
inline void score_block(const T* const* qrows, const T* kt, int64_t lkp, int64_t e, int64_t c0, T* s,
                        T scale) {
  using V = Vectorized<T>;
  constexpr int64_t W = V::size();
  V acc[kRows][C];
  accumulate_block<T, C>(acc, [qrows](int64_t r, int64_t d) { return qrows[r][d]; }, kt, lkp, e, c0);
  const V vs(scale);
  for (int64_t r = 0; r < kRows; ++r) {
    for (int c = 0; c < C; ++c) (acc[r][c] * vs).store(s + r * lkp + (c0 + c) * W);
  }
}

// o[r][c0*W ...] = sum_j p[r][j] v[j][c0*W ...] for value vectors [c0, c0 + C), keys [0, jend).
template <typename T, int C>
inline void value_block(const T* p, int64_t lkp, const T* vp, int64_t evp, int64_t jend, int64_t c0, T* o) {
  using V = Vectorized<T>;
  constexpr int64_t W = V::size();
  V acc[kRows][C];
  accumulate_block<T, C>(acc, [p, lkp](int64_t r, int64_t j) { return p[r * lkp + j]; }, vp, evp, jend, c0);
  for (int64_t r = 0; r < kRows; ++r) {
    for (int c = 0; c < C; ++c) acc[r][c].store(o + r * evp + (c0 + c) * W);
  }
}

// Calls block<2> on pairs of vectors in [0, count) and block<1> on the odd one left.
template <typename F2, typename F1>
inline void in_pairs(int64_t count, F2&& pair, F1&& single) {
  int64_t c = 0;
  for (; c + 2 <= count; c += 2) pair(c);
  if (c < count) single(c);
}

template <typename T>
void small_attention_impl(const T* q, const T* k, const T* v, T* out, const AttentionProblem& p) {
  using V = Vectorized<T>;
  constexpr int64_t W = V::size();
  const int64_t lkp = round_up(p.lk, W), evp = round_up(p.ev, W);
  const int64_t group = p.heads / p.kv_heads;
  const T scale = static_cast<T>(p.scale);
  const int64_t work = std::max<int64_t>(1, p.lq * p.lk * (p.e + p.ev));
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / work);
  at::parallel_for(0, p.batch * p.heads, grain, [&](int64_t begin, int64_t end) {
    // Zero padding: K^T columns [lk, lkp) and V columns [ev, evp) are never written below.
    std::vector<T> kt(p.e * lkp, T(0)), vp(p.lk * evp, T(0)), s(kRows * lkp), o(kRows * evp);
    int64_t packed = -1;  // the (batch, kv head) whose K^T and V are in kt / vp
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / p.heads, h = idx % p.heads, g = h / group;
      if (b * p.kv_heads + g != packed) {
        packed = b * p.kv_heads + g;
        const T* K = k + b * p.k_strides[0] + g * p.k_strides[1];
        const T* Vh = v + b * p.v_strides[0] + g * p.v_strides[1];
        at::vec::transpose_mxn<T>(K, p.k_strides[2], kt.data(), lkp, static_cast<int>(p.lk),
                                  static_cast<int>(p.e));
        for (int64_t j = 0; j < p.lk; ++j) {
          std::copy(Vh + j * p.v_strides[2], Vh + j * p.v_strides[2] + p.ev, vp.data() + j * evp);
        }
      }
      const T* Q = q + b * p.q_strides[0] + h * p.q_strides[1];
      T* O = out + b * p.out_strides[0] + h * p.out_strides[1];
      for (int64_t i0 = 0; i0 < p.lq; i0 += kRows) {
        const int64_t rows = std::min(kRows, p.lq - i0);
        const T* qrows[kRows];  // rows past the end repeat the last one; they are never stored
        for (int64_t r = 0; r < kRows; ++r) qrows[r] = Q + std::min(i0 + r, p.lq - 1) * p.q_strides[2];
        const int64_t jend = p.causal ? std::min(p.lk, i0 + rows) : p.lk;  // keys any row here sees
        const int64_t jvec = round_up(jend, W) / W;
        in_pairs(jvec, [&](int64_t c) { score_block<T, 2>(qrows, kt.data(), lkp, p.e, c, s.data(), scale); },
                 [&](int64_t c) { score_block<T, 1>(qrows, kt.data(), lkp, p.e, c, s.data(), scale); });
        // Softmax of every row of the block, the rows interleaved (independent dependency chains).
        for (int64_t r = 0; r < rows; ++r) {  // masked keys: causal, and the padding of the last vector
          const int64_t seen = p.causal ? std::min(p.lk, i0 + r + 1) : p.lk;
          std::fill(s.data() + r * lkp + seen, s.data() + r * lkp + jvec * W, -std::numeric_limits<T>::infinity());
        }
        V vmax[kRows], vsum[kRows];
        for (int64_t r = 0; r < kRows; ++r) vmax[r] = V(-std::numeric_limits<T>::infinity());
        for (int64_t c = 0; c < jvec; ++c) {
          for (int64_t r = 0; r < kRows; ++r) vmax[r] = at::vec::maximum(vmax[r], V::loadu(s.data() + r * lkp + c * W));
        }
        for (int64_t r = 0; r < kRows; ++r) {
          vmax[r] = V(lanes_max(vmax[r]));
          vsum[r] = V(T(0));
        }
        for (int64_t c = 0; c < jvec; ++c) {
          for (int64_t r = 0; r < kRows; ++r) {
            T* sv = s.data() + r * lkp + c * W;
            const V ex = (V::loadu(sv) - vmax[r]).exp_u20();
            ex.store(sv);
            vsum[r] = vsum[r] + ex;
          }
        }
        T inv[kRows];
        for (int64_t r = 0; r < kRows; ++r) inv[r] = T(1) / lanes_sum(vsum[r]);
        in_pairs(evp / W, [&](int64_t c) { value_block<T, 2>(s.data(), lkp, vp.data(), evp, jend, c, o.data()); },
                 [&](int64_t c) { value_block<T, 1>(s.data(), lkp, vp.data(), evp, jend, c, o.data()); });
        for (int64_t r = 0; r < rows; ++r) {
          T* orow = O + (i0 + r) * p.out_strides[2];
          const V vinv(inv[r]);
          for (int64_t c = 0; c * W < p.ev; ++c) {
            (V::loadu(o.data() + r * evp + c * W) * vinv).store(orow + c * W, std::min(W, p.ev - c * W));
          }
        }
      }
    }
  });
}

}  // namespace

void small_attention(const float* q, const float* k, const float* v, float* out, const AttentionProblem& p) {
  small_attention_impl(q, k, v, out, p);
}

void small_attention(const double* q, const double* k, const double* v, double* out,
                     const AttentionProblem& p) {
  small_attention_impl(q, k, v, out, p);
}

}  // namespace wide::ops::cpu::CPU_CAPABILITY

WIDE_ISA_KERNEL_END
