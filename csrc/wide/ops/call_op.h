// How the public C++ functions (wide::linear, wide::adam_step, ...) reach their operator.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cstddef>
#include <utility>

// Note [Calling a wide:: operator]
// --------------------------------
// A public C++ function such as wide::linear does no work itself: it calls the registered
// operator wide::linear through the dispatcher, so that a C++ caller gets what a Python caller
// of torch.ops.wide.linear gets (autograd, autocast, tracing, every backend's kernel). The
// operator's handle is looked up once, at the first call, and kept (one handle per operator
// name and signature). A signature that does not match the registered schema fails at that
// lookup, naming the operator.

namespace wide::detail {

/// An operator's qualified name as a template argument: call_op<"wide::linear", ...>.
template <std::size_t K>
struct OpName {
  // NOLINTNEXTLINE(google-explicit-constructor,cppcoreguidelines-avoid-c-arrays): a literal's type
  constexpr OpName(const char (&name)[K]) { std::copy_n(name, K, chars); }
  char chars[K]{};  // NOLINT(cppcoreguidelines-avoid-c-arrays)
};

/// The typed handle of operator `Name` with C++ signature `Sig`, looked up at the first call.
template <OpName Name, class Sig>
const c10::TypedOperatorHandle<Sig>& op_handle() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow(Name.chars, "").template typed<Sig>();
  return op;
}

/// Calls operator `Name` (C++ signature `Sig`) through the dispatcher with `args`
/// (Note [Calling a wide:: operator]).
template <OpName Name, class Sig, class... Args>
decltype(auto) call_op(Args&&... args) {
  return op_handle<Name, Sig>().call(std::forward<Args>(args)...);
}

}  // namespace wide::detail
