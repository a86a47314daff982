// Shared by the per-instruction-set kernel bodies (ops/cpu/*_kernels_impl.h,
// optim/cpu/kernels_impl.h), each compiled once per ISA with CPU_CAPABILITY set (CMakeLists.txt).
#pragma once

#ifndef CPU_CAPABILITY
#error "isa_kernel.h must be compiled with CPU_CAPABILITY defined (see CMakeLists.txt)"
#endif

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

// GCC 12 flags the _mm512_undefined_*() inside its own AVX-512 intrinsics (sqrt, max, the lane
// shuffles of vec_reduce_all) as (maybe-)uninitialized once they are inlined into a kernel: a
// false positive (GCC bug 105593). A kernel body goes between WIDE_ISA_KERNEL_BEGIN and
// WIDE_ISA_KERNEL_END.
#if defined(CPU_CAPABILITY_AVX512) && defined(__GNUC__) && !defined(__clang__)
#define WIDE_ISA_KERNEL_BEGIN \
  _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wmaybe-uninitialized\"") \
      _Pragma("GCC diagnostic ignored \"-Wuninitialized\"")
#define WIDE_ISA_KERNEL_END _Pragma("GCC diagnostic pop")
#else
#define WIDE_ISA_KERNEL_BEGIN
#define WIDE_ISA_KERNEL_END
#endif

namespace wide::cpu_vec::CPU_CAPABILITY {

/// The sum of a vector's lanes.
template <typename T>
inline T lanes_sum(const at::vec::Vectorized<T>& v) {
  return at::vec::vec_reduce_all<T>([](at::vec::Vectorized<T>& a, at::vec::Vectorized<T>& b) { return a + b; }, v);
}

/// The largest of a vector's lanes; NaN if any lane is NaN (at::vec::maximum propagates it).
template <typename T>
inline T lanes_max(const at::vec::Vectorized<T>& v) {
  return at::vec::vec_reduce_all<T>(
      [](at::vec::Vectorized<T>& a, at::vec::Vectorized<T>& b) { return at::vec::maximum(a, b); }, v);
}

}  // namespace wide::cpu_vec::CPU_CAPABILITY
