// The shared skeleton of the fused per-member optimizer steps (internal): argument checks,
// per-member hyperparameters and coefficients, the CPU kernel entry with its composite fallback,
// the composite and the meta kernel, all as one template over an optimizer description. Each
// optimizer file (sgd.cpp, adam.cpp, ...) keeps only what is specific to it; see
// Note [Fused per-member optimizer steps].
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>
#include <torch/library.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "wide/optim/cpu/kernels.h"

// Calls cpu::<ISA>::fn(args...) for the instruction set chosen at run time.
#define WIDE_OPTIM_ISA_CALL(fn, ...) WIDE_ISA_CALL(::wide::optim::cpu, fn, __VA_ARGS__)

// Registers the kernels of StepKernels<Opt> (`kernels`) for the schema wide::<op> ("adam_step"):
// its CPU, Meta and CompositeExplicitAutograd kernels. Once per optimizer file, at global scope.
#define WIDE_OPTIM_REGISTER_STEP(op, kernels)                                                   \
  TORCH_LIBRARY_IMPL(wide, CPU, m) { m.impl(op, &kernels::cpu); }                                \
  TORCH_LIBRARY_IMPL(wide, Meta, m) { m.impl(op, &kernels::meta); }                              \
  TORCH_LIBRARY_IMPL(wide, CompositeExplicitAutograd, m) { m.impl(op, &kernels::composite); }

// Note [Fused per-member optimizer steps]
// ---------------------------------------
// An optimizer is described by a struct Opt (in its own file) deriving from Optimizer<Coef,
// Flags, #state tensors, #hyperparameters> (Coef and Flags in cpu/kernels.h), with:
//  * kOp ("adam_step", for messages) and kStep: whether it has a step counter;
//  * kState: its state tensors in schema order (StateArg), kHParams: its per-member
//    hyperparameter names in schema order;
//  * bind(schema arguments...) -> Args: the schema's signature, mapped onto roles;
//  * coefficient(hyperparameters of member k, its step, flags, k) -> Coef (host, double);
//  * composite(args, coefficients): the step built from ATen ops (any device and dtype).
// StepKernels<Opt> then makes the CPU kernel (hand-written for float and double through
// cpu::<ISA>::step, the composite otherwise), the composite and the meta kernel, each with the
// schema's signature, registered by WIDE_OPTIM_REGISTER_STEP.

namespace wide::optim::detail {

/// param must be a floating tensor [N, ...] with N >= 1 (dim 0 is the member dim).
void check_param(const at::Tensor& param, const char* op);

/// t (the gradient or a state tensor) must have param's shape, dtype and device.
void check_like(const at::Tensor& param, const at::Tensor& t, const char* op, const char* name);

/// A per-member hyperparameter: a real tensor of N elements (one per member) or of 1 (shared).
void check_hparam(const at::Tensor& t, const c10::SymInt& n, const char* op, const char* name);

/// One argument of a step, by its schema name, for the memory checks.
struct NamedTensor {
  const char* name;
  at::Tensor tensor;
};

/// Refuses a step whose written tensors (param, the state tensors it uses, step) share memory
/// with each other or with a tensor it reads (grad, hyperparameters), or that overlap themselves
/// (an expanded tensor): the step would read values it has already overwritten, or write one
/// element twice, and give a silently wrong update. Read tensors may share memory among
/// themselves (an expanded gradient). Note [Optimizer step arguments never alias].
void check_no_overlap(const char* op, const std::vector<NamedTensor>& written,
                      const std::vector<NamedTensor>& read);

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

/// member_tensor of f(coef[k]) (a Coef field or a function of the coefficients) per member.
template <class Coef, class F>
at::Tensor member_tensor(const std::vector<Coef>& coef, F&& f, const at::Tensor& param) {
  std::vector<double> values(coef.size());
  for (size_t k = 0; k < coef.size(); ++k) values[k] = std::invoke(f, coef[k]);
  return member_tensor(values, param);
}

/// Whether f(coef[k]) is non-zero for some member.
template <class Coef, class F>
bool any_member(const std::vector<Coef>& coef, F&& f) {
  for (const Coef& c : coef) {
    if (std::invoke(f, c) != 0) return true;
  }
  return false;
}

/// One state tensor of a step: its schema name, whether the schema makes it optional, and the
/// flag (and the flag's name, for the message) without which the step ignores it and with which
/// it is required; none when the step uses it whenever it is given.
template <class Flags>
struct StateArg {
  const char* name;
  bool optional = false;
  bool Flags::*flag = nullptr;
  const char* flag_name = nullptr;
};

/// Whether a step has a per-member step counter (incremented by the call) and whether its
/// coefficients read it (after the increment).
enum class StepCounter { None, Counted, ReadByCoefficients };

/// The arguments of one step by role: state tensors and hyperparameters in schema order (an
/// absent optional state tensor is undefined), the step counter (undefined without one), flags.
template <class Flags, size_t NumState, size_t NumHParams>
struct StepArgs {
  at::Tensor param, grad;
  std::array<at::Tensor, NumState> state;
  at::Tensor step;
  std::array<at::Tensor, NumHParams> hparams;
  Flags flags;
};

/// The base of an optimizer description: its coefficient and flag types (cpu/kernels.h) and the
/// shapes of its arguments, with NumState state tensors and NumHParams hyperparameters.
template <class CoefT, class FlagsT, size_t NumState, size_t NumHParams>
struct Optimizer {
  using Coef = CoefT;
  using Flags = FlagsT;
  using Args = StepArgs<Flags, NumState, NumHParams>;
  using States = std::array<StateArg<Flags>, NumState>;
  using HParamNames = std::array<const char*, NumHParams>;
  using HParams = std::array<double, NumHParams>;  // one member's values
  using StepCounter = detail::StepCounter;
};

/// Whether the step reads and writes state tensor i (when given).
template <class Opt>
bool uses_state(const typename Opt::Args& a, size_t i) {
  const auto flag = Opt::kState[i].flag;
  return flag == nullptr || a.flags.*flag;
}

/// Every argument check of the step, before anything is changed.
template <class Opt>
void check(const typename Opt::Args& a) {
  constexpr const char* op = Opt::kOp;
  check_param(a.param, op);
  check_like(a.param, a.grad, op, "grad");
  for (size_t i = 0; i < a.state.size(); ++i) {
    const auto& s = Opt::kState[i];
    TORCH_CHECK(s.flag == nullptr || !uses_state<Opt>(a, i) || a.state[i].defined(), "wide::", op,
                ": ", s.flag_name, "=True requires ", s.name);
    if (!s.optional || a.state[i].defined()) check_like(a.param, a.state[i], op, s.name);
  }
  const c10::SymInt n = a.param.sym_size(0);
  if constexpr (Opt::kStep != StepCounter::None) {
    check_hparam(a.step, n, op, "step");
    TORCH_CHECK(at::isFloatingType(a.step.scalar_type()), "wide::", op, ": expected a "
                "floating-point step tensor, got ", a.step.scalar_type());
  }
  for (size_t i = 0; i < a.hparams.size(); ++i) check_hparam(a.hparams[i], n, op, Opt::kHParams[i]);
  std::vector<NamedTensor> written{{"param", a.param}}, read{{"grad", a.grad}};
  for (size_t i = 0; i < a.state.size(); ++i) {
    if (a.state[i].defined() && uses_state<Opt>(a, i)) written.push_back({Opt::kState[i].name, a.state[i]});
  }
  if constexpr (Opt::kStep != StepCounter::None) written.push_back({"step", a.step});
  for (size_t i = 0; i < a.hparams.size(); ++i) read.push_back({Opt::kHParams[i], a.hparams[i]});
  check_no_overlap(op, written, read);
}

/// The per-member coefficients (after the step increment), computed on the host in double.
template <class Opt>
std::vector<typename Opt::Coef> coefficients(const typename Opt::Args& a, int64_t n) {
  constexpr size_t h = Opt::kHParams.size();
  std::array<std::vector<double>, h> values;
  for (size_t i = 0; i < h; ++i) values[i] = member_values(a.hparams[i], n);
  std::vector<double> steps;
  if constexpr (Opt::kStep == StepCounter::ReadByCoefficients) steps = member_values(a.step, n);
  std::vector<typename Opt::Coef> coef(n);
  for (int64_t k = 0; k < n; ++k) {
    std::array<double, h> member;
    for (size_t i = 0; i < h; ++i) member[i] = values[i][k];
    coef[k] = Opt::coefficient(member, steps.empty() ? 0.0 : steps[k], a.flags, k);
  }
  return coef;
}

/// The step built from ATen ops (CompositeExplicitAutograd: every device and dtype).
template <class Opt>
void run_composite(const typename Opt::Args& a) {
  check<Opt>(a);
  const int64_t n = a.param.size(0);
  if constexpr (Opt::kStep != StepCounter::None) increment_step(a.step);
  Opt::composite(a, coefficients<Opt>(a, n));
}

/// The CPU kernel: the hand-written one for float and double, the composite otherwise.
template <class Opt>
void run_cpu(const typename Opt::Args& a) {
  if (!kernel_dtype(a.param)) {
    run_composite<Opt>(a);
    return;
  }
  check<Opt>(a);
  const int64_t n = a.param.size(0);
  if constexpr (Opt::kStep != StepCounter::None) increment_step(a.step);
  const auto coef = coefficients<Opt>(a, n);
  if (a.param.numel() == 0) return;
  const at::Tensor p = contiguous(a.param), g = contiguous(a.grad);
  constexpr size_t s = Opt::kState.size();
  std::array<at::Tensor, s> state;
  for (size_t i = 0; i < s; ++i) {
    if (a.state[i].defined() && uses_state<Opt>(a, i)) state[i] = contiguous(a.state[i]);
  }
  AT_DISPATCH_FLOATING_TYPES(a.param.scalar_type(), Opt::kOp, [&] {
    std::array<scalar_t*, s> state_ptr{};
    for (size_t i = 0; i < s; ++i) {
      const at::Tensor& t = state[i];
      state_ptr[i] = t.defined() ? t.mutable_data_ptr<scalar_t>() : nullptr;
    }
    WIDE_OPTIM_ISA_CALL(step, p.mutable_data_ptr<scalar_t>(), g.const_data_ptr<scalar_t>(),
                        state_ptr.data(), n, a.param.numel() / n, coef.data(), a.flags);
  });
  copy_back(a.param, p);
  for (size_t i = 0; i < s; ++i) {
    if (state[i].defined()) copy_back(a.state[i], state[i]);
  }
}

/// The kernels of Opt with the schema's signature (that of Opt::bind), to register.
template <class Opt, class Bind = decltype(&Opt::bind)>
struct StepKernels;

template <class Opt, class R, class... A>
struct StepKernels<Opt, R (*)(A...)> {
  static void cpu(A... args) { run_cpu<Opt>(Opt::bind(args...)); }
  static void composite(A... args) { run_composite<Opt>(Opt::bind(args...)); }
  static void meta(A... args) { check<Opt>(Opt::bind(args...)); }
};

}  // namespace wide::optim::detail
