// The grid of the hand-written CPU kernels' parameterised tests: every instruction set the
// kernels are built for ("default" | "avx2" | "avx512", run through wide_test::IsaTest) times
// float32 and float64, with test names such as "avx2_float".
#pragma once

#include <c10/core/ScalarType.h>
#include <gtest/gtest.h>

#include <string>
#include <tuple>

namespace wide_test {

// instruction set, dtype
using IsaDtype = std::tuple<std::string, at::ScalarType>;

inline auto isa_dtype_grid() {
  return ::testing::Combine(::testing::Values("default", "avx2", "avx512"), ::testing::Values(at::kFloat, at::kDouble));
}

inline std::string isa_dtype_name(const ::testing::TestParamInfo<IsaDtype>& info) {
  return std::get<0>(info.param) + (std::get<1>(info.param) == at::kFloat ? "_float" : "_double");
}

} // namespace wide_test
