#include "wide/optim/common.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>

namespace wide::optim {
namespace detail {

void check_param(const at::Tensor& param, const char* op) {
  TORCH_CHECK(param.defined(), "wide::", op, ": expected a parameter tensor, got an undefined one");
  TORCH_CHECK(param.dim() >= 1, "wide::", op, ": expected a parameter of shape [N, ...] (dim 0 is "
              "the member dim), got a 0-dim tensor");
  TORCH_CHECK(at::isFloatingType(param.scalar_type()), "wide::", op,
              ": expected a floating-point parameter, got ", param.scalar_type());
}

void check_like(const at::Tensor& param, const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.defined(), "wide::", op, ": expected ", name, " to be defined");
  TORCH_CHECK(t.sym_sizes() == param.sym_sizes(), "wide::", op, ": expected ", name,
              " of the parameter's shape ", param.sym_sizes(), ", got ", t.sym_sizes());
  TORCH_CHECK(t.scalar_type() == param.scalar_type(), "wide::", op, ": expected ", name,
              " of the parameter's dtype ", param.scalar_type(), ", got ", t.scalar_type());
  TORCH_CHECK(t.device() == param.device(), "wide::", op, ": expected ", name,
              " on the parameter's device ", param.device(), ", got ", t.device());
}

void check_hparam(const at::Tensor& t, const c10::SymInt& n, const char* op, const char* name) {
  TORCH_CHECK(t.defined(), "wide::", op, ": expected ", name, " to be a tensor");
  TORCH_CHECK(t.dim() <= 1 && (t.sym_numel() == n || t.sym_numel() == 1), "wide::", op,
              ": expected ", name, " with one value per member (shape [", n,
              "]) or one shared value, got shape ", t.sym_sizes());
  TORCH_CHECK(!at::isComplexType(t.scalar_type()) && t.scalar_type() != at::kBool, "wide::", op,
              ": expected ", name, " to be a real tensor, got ", t.scalar_type());
}

std::vector<double> member_values(const at::Tensor& t, int64_t n) {
  const at::Tensor d = t.to(at::kCPU, at::kDouble).contiguous();
  const double* p = d.const_data_ptr<double>();
  if (d.numel() == 1) return std::vector<double>(n, p[0]);
  return std::vector<double>(p, p + n);
}

void increment_step(const at::Tensor& step) { step.add_(1); }

bool kernel_dtype(const at::Tensor& param) {
  return param.scalar_type() == at::kFloat || param.scalar_type() == at::kDouble;
}

at::Tensor contiguous(const at::Tensor& t) { return t.is_contiguous() ? t : t.contiguous(); }

void copy_back(const at::Tensor& original, const at::Tensor& work) {
  if (!original.is_same(work)) original.copy_(work);
}

at::Tensor member_tensor(const std::vector<double>& values, const at::Tensor& param) {
  const int64_t n = static_cast<int64_t>(values.size());
  at::Tensor t = at::empty({n}, at::TensorOptions().dtype(at::kDouble));
  std::copy(values.begin(), values.end(), t.mutable_data_ptr<double>());
  std::vector<int64_t> shape(param.dim(), 1);
  shape[0] = n;
  return t.to(param.device(), param.scalar_type()).view(shape);
}

}  // namespace detail

namespace cpu {
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
    TORCH_CHECK(false, "wide::optim: expected a CPU capability 'auto', 'default', 'avx2' or "
                "'avx512', got '", std::string(name), "'");
  }
  TORCH_CHECK(static_cast<int>(want) <= static_cast<int>(best), "wide::optim: CPU capability '",
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

}  // namespace cpu
}  // namespace wide::optim

namespace wide::optim {
std::string optim_cpu_capability(std::string_view capability) {
  if (!capability.empty()) cpu::set_cpu_capability(capability);
  return cpu::cpu_capability_name();
}
}  // namespace wide::optim
