// Body of the fused per-member norm kernel. Included ONLY by norm_kernels_{default,avx2,avx512}.cpp,
// each compiled with CPU_CAPABILITY=<ISA> and that ISA's -m flags (see CMakeLists.txt), so that
// at::vec::Vectorized is the real SIMD type and the definitions land in wide::ops::cpu::<ISA>.
#pragma once

#ifndef CPU_CAPABILITY
#error "norm_kernels_impl.h must be compiled with CPU_CAPABILITY defined (see CMakeLists.txt)"
#endif

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "wide/ops/cpu/norm_kernels.h"

// Note [Fused per-member norm kernel]
// -----------------------------------
// The composite wide LayerNorm normalises all N*rows rows with ATen's kernel and then applies
// the per-member affine with one addcmul: two passes over the wide activation, and ATen's CPU
// layer norm without gamma/beta is itself about 2x slower than with them (measured, 1 thread:
// 300 vs 153 us for 16 x 256 x 64). A residual block adds a third pass (the add). This kernel
// does, per row and in one sweep of memory: s = x (+ residual), stored into y; mean and variance
// of the row (two passes over the row while it is in L1, in the accumulation type); then
// y = (s - mean) * rstd * weight[member] + bias[member] in place. RMSNorm skips the mean and the
// bias. It has no backward: it is the inference path of wide::layer_norm / wide::rms_norm /
// wide::add_layer_norm when no input needs a gradient (see Note [wide::fused_norm] in norm.cpp).
// Threading: at::parallel_for over rows, with a grain of about 32K elements.

#if defined(CPU_CAPABILITY_AVX512) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define WIDE_NORM_POP_DIAGNOSTIC
#endif

namespace wide::ops::cpu::CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;

template <typename T>
T horizontal_sum(const Vectorized<T>& v) {
  T lanes[Vectorized<T>::size()];
  v.store(lanes);
  T s = 0;
  for (int i = 0; i < Vectorized<T>::size(); ++i) s += lanes[i];
  return s;
}

template <typename T>
void fused_norm_impl(const T* x, const T* residual, T* y, const T* weight, const T* bias,
                     int64_t rows, int64_t rows_per_member, int64_t d, double eps, bool rms) {
  using V = Vectorized<T>;
  constexpr int64_t W = V::size();
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(d, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t member = r / rows_per_member;
      const T* xr = x + r * d;
      T* yr = y + r * d;
      const T* src = xr;
      if (residual != nullptr) {  // s = x + residual, rounded to T as the composite's add is
        const T* rr = residual + r * d;
        int64_t j = 0;
        for (; j + W <= d; j += W) (V::loadu(xr + j) + V::loadu(rr + j)).store(yr + j);
        if (j < d) (V::loadu(xr + j, d - j) + V::loadu(rr + j, d - j)).store(yr + j, d - j);
        src = yr;
      }
      T mean = 0;
      if (!rms) {
        V acc(T(0));
        int64_t j = 0;
        for (; j + W <= d; j += W) acc = acc + V::loadu(src + j);
        T s = horizontal_sum(acc);
        for (; j < d; ++j) s += src[j];
        mean = s / static_cast<T>(d);
      }
      V vmean(mean);
      V acc(T(0));
      int64_t j = 0;
      for (; j + W <= d; j += W) {
        V c = V::loadu(src + j) - vmean;
        acc = at::vec::fmadd(c, c, acc);
      }
      T sq = horizontal_sum(acc);
      for (; j < d; ++j) sq += (src[j] - mean) * (src[j] - mean);
      const T rstd = static_cast<T>(1) / std::sqrt(sq / static_cast<T>(d) + static_cast<T>(eps));
      const V vrstd(rstd);
      const T* w = weight != nullptr ? weight + member * d : nullptr;
      const T* b = bias != nullptr ? bias + member * d : nullptr;
      auto apply = [&](int64_t at, int64_t count) {
        V v = (V::loadu(src + at, count) - vmean) * vrstd;
        if (w != nullptr) v = v * V::loadu(w + at, count);
        if (b != nullptr) v = v + V::loadu(b + at, count);
        v.store(yr + at, count);
      };
      j = 0;
      for (; j + W <= d; j += W) apply(j, W);
      if (j < d) apply(j, d - j);
    }
  });
}

}  // namespace

void fused_norm(const float* x, const float* residual, float* y, const float* weight,
                const float* bias, int64_t rows, int64_t rows_per_member, int64_t d, double eps,
                bool rms) {
  fused_norm_impl(x, residual, y, weight, bias, rows, rows_per_member, d, eps, rms);
}

void fused_norm(const double* x, const double* residual, double* y, const double* weight,
                const double* bias, int64_t rows, int64_t rows_per_member, int64_t d, double eps,
                bool rms) {
  fused_norm_impl(x, residual, y, weight, bias, rows, rows_per_member, d, eps, rms);
}

}  // namespace wide::ops::cpu::CPU_CAPABILITY

#ifdef WIDE_NORM_POP_DIAGNOSTIC
#pragma GCC diagnostic pop
#undef WIDE_NORM_POP_DIAGNOSTIC
#endif
