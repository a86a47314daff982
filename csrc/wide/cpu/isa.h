// The run-time choice of instruction set (ISA) for the hand-written CPU kernels: the fused
// optimizer steps (optim/cpu/), the fused norms and small attention (ops/cpu/). Each of those is
// compiled once per ISA (*_default.cpp, *_avx2.cpp, *_avx512.cpp, CMakeLists.txt) into namespaces
// DEFAULT, AVX2 and AVX512; WIDE_ISA_CALL picks the copy for the ISA chosen here. One choice for
// all of them, so a test or benchmark that forces an ISA forces it everywhere.
#pragma once

#include <string>
#include <string_view>

namespace wide::cpu {

/// Instruction set the hand-written CPU kernels run with.
enum class Isa { Default, Avx2, Avx512 };

/// The instruction set in use: the best the CPU supports, or $WIDE_CPU_CAPABILITY
/// ("default" | "avx2" | "avx512"), or the last set_cpu_capability().
Isa cpu_capability();

/// Forces an instruction set ("default" | "avx2" | "avx512" | "auto": the best the CPU supports),
/// for tests and benchmarks; throws if the CPU lacks it.
void set_cpu_capability(std::string_view name);

/// "default" | "avx2" | "avx512".
std::string cpu_capability_name();

/// torch.ops.wide._cpu_capability(capability=""): sets the instruction set when `capability` is
/// non-empty ("auto" | "default" | "avx2" | "avx512"); returns the one in use.
std::string cpu_capability_op(std::string_view capability);

}  // namespace wide::cpu

// Calls NS::<ISA>::fn(args...) for the instruction set chosen at run time (NS: a namespace with
// DEFAULT, AVX2 and AVX512 kernel copies, as wide::optim::cpu and wide::ops::cpu have).
#if defined(__x86_64__) && !defined(WIDE_NO_AVX_KERNELS)
#define WIDE_ISA_CALL(NS, fn, ...)                \
  do {                                            \
    switch (::wide::cpu::cpu_capability()) {      \
      case ::wide::cpu::Isa::Avx512:              \
        NS::AVX512::fn(__VA_ARGS__);              \
        break;                                    \
      case ::wide::cpu::Isa::Avx2:                \
        NS::AVX2::fn(__VA_ARGS__);                \
        break;                                    \
      default:                                    \
        NS::DEFAULT::fn(__VA_ARGS__);             \
    }                                             \
  } while (0)
#else
#define WIDE_ISA_CALL(NS, fn, ...) NS::DEFAULT::fn(__VA_ARGS__)
#endif
