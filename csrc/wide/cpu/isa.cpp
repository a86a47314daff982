#include "wide/cpu/isa.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <cstdlib>
#include <string>

namespace wide::cpu {
namespace {

Isa best_supported() {
#if defined(__x86_64__) && !defined(WIDE_NO_AVX_KERNELS)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    return Isa::Avx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::Avx2;
#endif
  return Isa::Default;
}

Isa parse(std::string_view name) {
  const Isa best = best_supported();
  Isa want;
  if (name == "auto") return best;
  if (name == "default") {
    want = Isa::Default;
  } else if (name == "avx2") {
    want = Isa::Avx2;
  } else if (name == "avx512") {
    want = Isa::Avx512;
  } else {
    TORCH_CHECK(false, "wide::cpu: expected a CPU capability 'auto', 'default', 'avx2' or "
                "'avx512', got '", std::string(name), "'");
  }
  TORCH_CHECK(static_cast<int>(want) <= static_cast<int>(best), "wide::cpu: CPU capability '",
              std::string(name), "' is not supported by this CPU (best: '",
              best == Isa::Avx512 ? "avx512" : best == Isa::Avx2 ? "avx2" : "default", "')");
  return want;
}

std::atomic<int>& current() {
  static std::atomic<int> isa{[] {
    const char* env = std::getenv("WIDE_CPU_CAPABILITY");
    return static_cast<int>(env != nullptr && *env != '\0' ? parse(env) : best_supported());
  }()};
  return isa;
}

}  // namespace

Isa cpu_capability() { return static_cast<Isa>(current().load(std::memory_order_relaxed)); }

void set_cpu_capability(std::string_view name) {
  current().store(static_cast<int>(parse(name)), std::memory_order_relaxed);
}

std::string cpu_capability_name() {
  switch (cpu_capability()) {
    case Isa::Avx512: return "avx512";
    case Isa::Avx2: return "avx2";
    default: return "default";
  }
}

std::string cpu_capability_op(std::string_view capability) {
  if (!capability.empty()) set_cpu_capability(capability);
  return cpu_capability_name();
}

}  // namespace wide::cpu
