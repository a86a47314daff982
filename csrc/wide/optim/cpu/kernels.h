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

// Calls NS::<ISA>::fn(args...) for the instruction set chosen at run time (NS: a namespace with
// DEFAULT, AVX2 and AVX512 kernel copies, as wide::optim::cpu and wide::ops::cpu have).
#if defined(__x86_64__) && !defined(WIDE_NO_AVX_KERNELS)
#define WIDE_ISA_CALL(NS, fn, ...)                            \
  do {                                                        \
    switch (::wide::optim::cpu::cpu_capability()) {           \
      case ::wide::optim::cpu::Isa::Avx512:                   \
        NS::AVX512::fn(__VA_ARGS__);                          \
        break;                                                \
      case ::wide::optim::cpu::Isa::Avx2:                     \
        NS::AVX2::fn(__VA_ARGS__);                            \
        break;                                                \
      default:                                                \
        NS::DEFAULT::fn(__VA_ARGS__);                         \
    }                                                         \
  } while (0)
#else
#define WIDE_ISA_CALL(NS, fn, ...) NS::DEFAULT::fn(__VA_ARGS__)
#endif

namespace wide::optim {
/// torch.ops.wide._optim_cpu_capability(capability=""): sets the kernels' instruction set when
/// `capability` is non-empty ("auto" | "default" | "avx2" | "avx512"); returns the one in use.
std::string optim_cpu_capability(std::string_view capability);
}  // namespace wide::optim
