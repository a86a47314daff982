// Hand-written CPU kernels of the fused per-member optimizer steps (wide::*_step), compiled once
// per instruction set (kernels_default.cpp, kernels_avx2.cpp, kernels_avx512.cpp) and chosen at
// run time (wide/cpu/isa.h). See Note [Fused per-member optimizer kernels] in kernels_impl.h.
#pragma once

#include <cstdint>

#include "wide/cpu/isa.h"  // the run-time instruction-set choice (WIDE_ISA_CALL)

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

// One set of kernels per instruction set: `step`, overloaded on the optimizer's coefficients.
// Every tensor is contiguous [n, m]: n members of m elements each; `state` holds the optimizer's
// state tensors in schema order (nullptr where absent or unused); coef has n entries (one per
// member).
#define WIDE_OPTIM_DECLARE_STEP(T, Opt)                                                            \
  void step(T* param, const T* grad, T* const* state, int64_t n, int64_t m, const Opt##Coef* coef, \
            Opt##Flags flags);
#define WIDE_OPTIM_DECLARE_KERNELS(ISA, T) \
  namespace ISA {                          \
  WIDE_OPTIM_DECLARE_STEP(T, Sgd)          \
  WIDE_OPTIM_DECLARE_STEP(T, Adam)         \
  WIDE_OPTIM_DECLARE_STEP(T, Rmsprop)      \
  WIDE_OPTIM_DECLARE_STEP(T, Adagrad)      \
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
#undef WIDE_OPTIM_DECLARE_STEP

// The instruction-set choice lives in wide/cpu/isa.h (shared with ops/cpu/); its names stay
// reachable here, where they were first declared.
using ::wide::cpu::cpu_capability;
using ::wide::cpu::cpu_capability_name;
using ::wide::cpu::Isa;
using ::wide::cpu::set_cpu_capability;

}  // namespace wide::optim::cpu
