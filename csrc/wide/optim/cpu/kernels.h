// Hand-written CPU kernels of the fused per-member optimizer steps (wide::*_step), compiled once
// per instruction set (kernels_default.cpp, kernels_avx2.cpp, kernels_avx512.cpp) and chosen at
// run time. See Note [Fused per-member optimizer kernels] in kernels_impl.h.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace wide::optim::cpu {

// Per-member coefficients, computed on the host in double exactly as torch.optim's single-tensor
// path computes its Python floats; each kernel casts them to the parameter's dtype per member.
struct SgdCoef {
  double neg_lr, weight_decay, momentum, one_minus_dampening;
};
struct SgdFlags {
  bool nesterov, maximize, init_buffer;
};

struct AdamCoef {
  double neg_step_size, one_minus_beta1, beta2, one_minus_beta2, bias_correction2_sqrt, eps,
      weight_decay, decay;
};
struct AdamFlags {
  bool decoupled, amsgrad, maximize;
};

struct RmspropCoef {
  double neg_lr, alpha, one_minus_alpha, eps, weight_decay, momentum;
};
struct RmspropFlags {
  bool centered, maximize, has_momentum_buffer;
};

struct AdagradCoef {
  double neg_clr, weight_decay, eps;
};
struct AdagradFlags {
  bool maximize;
};

// One set of kernels per instruction set. Every tensor is contiguous [n, m]: n members of m
// elements each; coef has n entries (one per member).
#define WIDE_OPTIM_DECLARE_KERNELS(ISA, T)                                                      \
  namespace ISA {                                                                               \
  void sgd(T* param, const T* grad, T* buf, int64_t n, int64_t m, const SgdCoef* coef,          \
           SgdFlags flags);                                                                     \
  void adam(T* param, const T* grad, T* exp_avg, T* exp_avg_sq, T* max_exp_avg_sq, int64_t n,   \
            int64_t m, const AdamCoef* coef, AdamFlags flags);                                  \
  void rmsprop(T* param, const T* grad, T* square_avg, T* grad_avg, T* buf, int64_t n,          \
               int64_t m, const RmspropCoef* coef, RmspropFlags flags);                         \
  void adagrad(T* param, const T* grad, T* sum, int64_t n, int64_t m, const AdagradCoef* coef,  \
               AdagradFlags flags);                                                             \
  }

WIDE_OPTIM_DECLARE_KERNELS(DEFAULT, float)
WIDE_OPTIM_DECLARE_KERNELS(DEFAULT, double)
#if defined(__x86_64__) && !defined(WIDE_NO_AVX_KERNELS)
WIDE_OPTIM_DECLARE_KERNELS(AVX2, float)
WIDE_OPTIM_DECLARE_KERNELS(AVX2, double)
WIDE_OPTIM_DECLARE_KERNELS(AVX512, float)
WIDE_OPTIM_DECLARE_KERNELS(AVX512, double)
#endif
#undef WIDE_OPTIM_DECLARE_KERNELS

/// Instruction set the kernels run with.
enum class Isa { Default, Avx2, Avx512 };

/// The instruction set in use: the best the CPU supports, or $WIDE_CPU_CAPABILITY
/// ("default" | "avx2" | "avx512"), or the last set_cpu_capability().
Isa cpu_capability();

/// Forces an instruction set ("default" | "avx2" | "avx512" | "auto"), for tests and benchmarks;
/// throws if the CPU lacks it.
void set_cpu_capability(std::string_view name);

/// "default" | "avx2" | "avx512".
std::string cpu_capability_name();

}  // namespace wide::optim::cpu

namespace wide::optim {
/// torch.ops.wide._optim_cpu_capability(capability=""): sets the kernels' instruction set when
/// `capability` is non-empty ("auto" | "default" | "avx2" | "avx512"); returns the one in use.
std::string optim_cpu_capability(std::string_view capability);
}  // namespace wide::optim
