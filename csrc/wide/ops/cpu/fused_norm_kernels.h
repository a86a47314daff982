// Hand-written CPU kernels of wide::fused_norm (LayerNorm / RMSNorm of N members with per-member
// affine, optionally of input + residual), the N-first GroupNorm and the packed BatchNorm in
// training, compiled once per instruction set (fused_norm_kernels_{default,avx2,avx512}.cpp) and
// chosen at run time like the optimizer kernels.
// See the Notes in fused_norm_kernels_impl.h.
#pragma once

#include <cstdint>

namespace wide::ops::cpu {

/// rows of d elements, member k owning rows [k*rows_per_member, (k+1)*rows_per_member); weight
/// and bias [n, d] (either may be null), residual like x (or null); y may not alias x.
/// fused_norm_backward: dx like x, dw/db [n, d]; any of the three may be null (not wanted).
/// group_norm: x and y N-first contiguous [n, batch, groups * channels_per_group, inner], weight
/// and bias [n, groups * channels_per_group] (either may be null); y may not alias x.
/// batch_norm_train: x, y [batch, channels, inner] contiguous; weight, bias [channels] (or null);
/// mean, invstd, var (unbiased) [channels] out. batch_norm_backward: dy, x, dx like x; mean and
/// invstd the forward's; dw, db [channels]; weight, dx, dw, db may be null.
#define WIDE_NORM_DECLARE_KERNELS(ISA, T)                                                       \
  namespace ISA {                                                                               \
  void fused_norm(const T* x, const T* residual, T* y, const T* weight, const T* bias,         \
                  int64_t rows, int64_t rows_per_member, int64_t d, double eps, bool rms);      \
  void fused_norm_backward(const T* dy, const T* x, const T* residual, const T* weight, T* dx,  \
                           T* dw, T* db, int64_t rows, int64_t rows_per_member, int64_t d,      \
                           double eps, bool rms);                                              \
  void group_norm(const T* x, T* y, const T* weight, const T* bias, int64_t n, int64_t batch,     \
                  int64_t groups, int64_t channels_per_group, int64_t inner, double eps);       \
  void batch_norm_train(const T* x, T* y, const T* weight, const T* bias, T* mean, T* invstd,     \
                        T* var, int64_t batch, int64_t channels, int64_t inner, double eps);     \
  void batch_norm_backward(const T* dy, const T* x, const T* weight, const T* mean,              \
                           const T* invstd, T* dx, T* dw, T* db, int64_t batch, int64_t channels, \
                           int64_t inner);                                                       \
  }

WIDE_NORM_DECLARE_KERNELS(DEFAULT, float)
WIDE_NORM_DECLARE_KERNELS(DEFAULT, double)
#if defined(__x86_64__) && !defined(WIDE_NO_AVX_KERNELS)
WIDE_NORM_DECLARE_KERNELS(AVX2, float)
WIDE_NORM_DECLARE_KERNELS(AVX2, double)
WIDE_NORM_DECLARE_KERNELS(AVX512, float)
WIDE_NORM_DECLARE_KERNELS(AVX512, double)
#endif
#undef WIDE_NORM_DECLARE_KERNELS

}  // namespace wide::ops::cpu
