// Shared argument checks and helpers of the fused per-member optimizer steps (internal).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "wide/optim/cpu/kernels.h"

namespace wide::optim::detail {

/// param must be a floating tensor [N, ...] with N >= 1 (dim 0 is the member dim).
void check_param(const at::Tensor& param, const char* op);

/// t (the gradient or a state tensor) must have param's shape, dtype and device.
void check_like(const at::Tensor& param, const at::Tensor& t, const char* op, const char* name);

/// A per-member hyperparameter: a real tensor of N elements (one per member) or of 1 (shared).
void check_hparam(const at::Tensor& t, const c10::SymInt& n, const char* op, const char* name);

/// The N per-member values of a checked hyperparameter, in double (a shared value repeated).
std::vector<double> member_values(const at::Tensor& t, int64_t n);

/// step += 1 (the per-member step counters, as torch.optim's `state["step"] += 1`).
void increment_step(const at::Tensor& step);

/// True when the hand-written CPU kernels handle this dtype (float, double).
bool kernel_dtype(const at::Tensor& param);

/// t itself when contiguous, else a contiguous copy (copied back by copy_back).
at::Tensor contiguous(const at::Tensor& t);
void copy_back(const at::Tensor& original, const at::Tensor& work);

/// Per-member values as a tensor [N, 1, ..., 1] in param's dtype and device, to broadcast
/// against [N, ...] in the composite (any-device) implementations.
at::Tensor member_tensor(const std::vector<double>& values, const at::Tensor& param);

}  // namespace wide::optim::detail

// Calls cpu::<ISA>::fn(args...) for the instruction set chosen at run time.
#if defined(__x86_64__) && !defined(WIDE_NO_AVX_KERNELS)
#define WIDE_OPTIM_ISA_CALL(fn, ...)                                      \
  do {                                                                    \
    switch (::wide::optim::cpu::cpu_capability()) {                       \
      case ::wide::optim::cpu::Isa::Avx512:                               \
        ::wide::optim::cpu::AVX512::fn(__VA_ARGS__);                      \
        break;                                                            \
      case ::wide::optim::cpu::Isa::Avx2:                                 \
        ::wide::optim::cpu::AVX2::fn(__VA_ARGS__);                        \
        break;                                                            \
      default:                                                            \
        ::wide::optim::cpu::DEFAULT::fn(__VA_ARGS__);                     \
    }                                                                     \
  } while (0)
#else
#define WIDE_OPTIM_ISA_CALL(fn, ...) ::wide::optim::cpu::DEFAULT::fn(__VA_ARGS__)
#endif
