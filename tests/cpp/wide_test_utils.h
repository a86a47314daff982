// Helpers shared by the GoogleTest files of the wide ops: how a test feeds N members' activations
// to an op (N-first, channel-packed, or one shared input expanded with stride 0), the reference's
// packed result, tolerance and error-message checks, and the boxed call Python makes. The tests
// call the public C++ API (wide::<op>), which reaches each op through the dispatcher.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/sub.h>
#include <c10/core/SymIntArrayRef.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <optional>
#include <tuple>
#include <string>
#include <utility>

#include "wide/optim/cpu/kernels.h"
#include <vector>

namespace wide_test {

using Ints = std::vector<int64_t>;
using OptT = std::optional<at::Tensor>;

// All references run in float64 with the same ATen kernels on per-member slices; the wide op runs
// them on packed/grouped/offset data, so only the reduction order differs. 1e-10 is far above
// fp64 reordering error on these tiny shapes and far below any real mistake (O(1e-1)).
constexpr double kTol = 1e-10;

inline at::TensorOptions f64() { return at::TensorOptions().dtype(at::kDouble); }

// How the N members' activations reach a packed-family op.
enum class Layout { NFirst, Packed, Shared };

inline const char* layout_name(Layout l) {
  switch (l) {
    case Layout::NFirst: return "nfirst";
    case Layout::Packed: return "packed";
    case Layout::Shared: return "shared";
  }
  return "?";
}

// The members' inputs as an N-first tensor [N, *member]: independent per member, or one
// [*member] tensor expanded with stride 0 on dim 0 for Layout::Shared.
inline at::Tensor member_inputs(Layout layout, int64_t n, std::vector<int64_t> member_shape) {
  if (layout == Layout::Shared) {
    const at::Tensor one = at::randn(member_shape, f64());
    member_shape.insert(member_shape.begin(), n);
    return one.expand(member_shape);
  }
  member_shape.insert(member_shape.begin(), n);
  return at::randn(member_shape, f64());
}

// Member values [N, B, C, *] side by side on the channel dim: [B, N*C, *] (built with plain ATen,
// independently of wide::to_packed). Also the packed form of a list of member results.
inline at::Tensor pack(const std::vector<at::Tensor>& members) { return at::cat(members, 1); }
inline at::Tensor pack(const at::Tensor& nfirst) { return pack(nfirst.unbind(0)); }

// What the op receives for `layout`, given the members' N-first values.
inline at::Tensor op_input(Layout layout, const at::Tensor& nfirst) {
  return layout == Layout::Packed ? pack(nfirst) : nfirst;
}

inline std::optional<at::Tensor> member(const std::optional<at::Tensor>& t, int64_t n) {
  return t.has_value() ? std::optional<at::Tensor>(t->select(0, n)) : std::nullopt;
}

// std::vector<int64_t> as the SymInt[] a schema takes (the vector must outlive the call).
inline c10::SymIntArrayRef syms(const std::vector<int64_t>& v) { return c10::fromIntArrayRefSlow(v); }

inline double max_diff(const at::Tensor& a, const at::Tensor& b) {
  return a.numel() == 0 ? 0.0 : at::sub(a, b).abs().max().item<double>();
}

#define WIDE_EXPECT_CLOSE(got, want)                                                               \
  do {                                                                                             \
    const at::Tensor g_ = (got), w_ = (want);                                                      \
    ASSERT_EQ(g_.sizes(), w_.sizes());                                                             \
    EXPECT_TRUE(at::allclose(g_, w_, ::wide_test::kTol, ::wide_test::kTol))                        \
        << "max diff " << ::wide_test::max_diff(g_, w_);                                           \
  } while (0)

// Runs fn() and expects a c10::Error whose message contains `fragment`.
template <class Fn>
void expect_error(Fn&& fn, const std::string& fragment) {
  try {
    fn();
    ADD_FAILURE() << "expected an error containing: " << fragment;
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos)
        << "expected: " << fragment << "\ngot: " << e.what();
  }
}

// Calls the schema `name` ("wide::<op>") as torch.ops.wide.<op> does from Python: boxed, every
// argument an IValue in schema order. Returns the first result.
template <class... Args>
c10::IValue call_boxed(const char* name, Args&&... args) {
  const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
  torch::jit::Stack stack{c10::IValue(std::forward<Args>(args))...};
  op.callBoxed(&stack);
  return stack.at(0);
}

// A parameterised test whose first parameter (std::get<0>) names the instruction set the hand-
// written CPU kernels run with ("default" | "avx2" | "avx512"): set for the test, skipped when the
// CPU lacks it, back to "auto" after.
template <class Param>
class IsaTest : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override {
    const auto& isa = std::get<0>(this->GetParam());
    try {
      wide::optim::cpu::set_cpu_capability(isa);
    } catch (const c10::Error&) {
      GTEST_SKIP() << "CPU lacks " << isa;
    }
  }
  void TearDown() override { wide::optim::cpu::set_cpu_capability("auto"); }
};

} // namespace wide_test
