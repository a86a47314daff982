// wide::linear (public C++ API, through the dispatcher as torch.ops.wide.linear is), against a
// reference written with plain ATen calls: member n is at::linear(input[n], weight[n], bias[n]).
#include <ATen/ops/allclose.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/sub.h>
#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

#include "wide/ops/linear.h"
#include "wide_test_utils.h"

namespace {

at::Tensor reference(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  std::vector<at::Tensor> outs;
  for (int64_t n = 0; n < w.size(0); ++n) {
    outs.push_back(at::linear(x[n], w[n], b ? std::optional<at::Tensor>((*b)[n]) : std::nullopt));
  }
  return at::stack(outs);
}

// strategy, has bias, member input rank (1 = [I], 2 = [B, I], 3 = [B, S, I]), shared input
using Case = std::tuple<std::string, bool, int, bool>;

class WideLinearTest : public ::testing::TestWithParam<Case> {};

TEST_P(WideLinearTest, MatchesPerMemberReference) {
  const auto& [strategy, has_bias, rank, shared] = GetParam();
  const int64_t n = 5, in = 7, out = 3;
  std::vector<int64_t> member_shape = {4, 2, in};
  member_shape.erase(member_shape.begin(), member_shape.end() - rank);
  std::vector<int64_t> wide_shape = member_shape;
  wide_shape.insert(wide_shape.begin(), n);

  const auto opts = at::TensorOptions().dtype(at::kDouble);
  const at::Tensor x = shared ? at::randn(member_shape, opts).expand(wide_shape) : at::randn(wide_shape, opts);
  const at::Tensor w = at::randn({n, out, in}, opts);
  const std::optional<at::Tensor> b = has_bias ? std::optional<at::Tensor>(at::randn({n, out}, opts)) : std::nullopt;

  const at::Tensor got = wide::linear(x, w, b, strategy);
  const at::Tensor want = reference(x, w, b);
  ASSERT_EQ(got.sizes(), want.sizes());
  EXPECT_TRUE(at::allclose(got, want, 1e-12, 1e-12)) << "max diff " << at::sub(got, want).abs().max().item<double>();
}

INSTANTIATE_TEST_SUITE_P(
    Grid, WideLinearTest,
    ::testing::Combine(::testing::Values("auto", "bmm", "bmm_t", "loop"), ::testing::Bool(),
                       ::testing::Values(1, 2, 3), ::testing::Bool()));

TEST(WideLinear, NonContiguousInput) {
  // [N=6, B=4, S=5, I=3] built from a transposed buffer: non-contiguous in every member.
  const at::Tensor xt = at::randn({6, 3, 4, 5}).permute({0, 2, 3, 1});
  const at::Tensor w = at::randn({6, 2, 3});
  ASSERT_FALSE(xt.is_contiguous());
  for (const char* s : {"auto", "bmm", "bmm_t", "loop"}) {
    EXPECT_TRUE(at::allclose(wide::linear(xt, w, std::nullopt, s), reference(xt, w, std::nullopt), 1e-5, 1e-5)) << s;
  }
}

// n members of a Linear(in, out) on a batch of b: every strategy gives the shape [n, b, out].
void expect_output_shape(int64_t n, int64_t b, int64_t in, int64_t out) {
  const at::Tensor x = at::randn({n, b, in});
  const at::Tensor w = at::randn({n, out, in});
  const at::Tensor bias = at::randn({n, out});
  for (const char* s : {"auto", "bmm", "bmm_t", "loop"}) {
    EXPECT_EQ(wide::linear(x, w, bias, s).sizes(), (std::vector<int64_t>{n, b, out})) << s;
  }
}

TEST(WideLinear, EmptyBatch) { expect_output_shape(3, 0, 4, 2); }

TEST(WideLinear, NoMembers) { expect_output_shape(0, 5, 4, 2); }

void expect_error(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
                  const std::string& strategy, const std::string& fragment) {
  wide_test::expect_error([&] { wide::linear(x, w, b, strategy); }, fragment);
}

TEST(WideLinear, Errors) {
  const at::Tensor x = at::randn({3, 2, 4});
  const at::Tensor w = at::randn({3, 5, 4});
  expect_error(x, w, std::nullopt, "fast", "expected strategy 'auto', 'bmm', 'bmm_t' or 'loop', got 'fast'");
  expect_error(x, at::randn({5, 4}), std::nullopt, "auto", "expected weight of shape [N, out, in]");
  expect_error(at::randn({2, 2, 4}), w, std::nullopt, "auto", "input has 2 members (dim 0) but weight has 3");
  expect_error(at::randn({3, 2, 6}), w, std::nullopt, "auto", "do not match weight in_features 4");
  expect_error(x, w, at::randn({3, 4}), "auto", "expected bias of shape [N, out] = [3, 5]");
  expect_error(x.to(at::kDouble), w, std::nullopt, "auto", "of the same dtype");
  expect_error(at::randn({4}), w, std::nullopt, "auto", "at least 2 dims");
}

// The public C++ API (a typed dispatcher call) agrees with the boxed call Python makes.
TEST(WideLinear, CppApiMatchesDispatcher) {
  const at::Tensor x = at::randn({4, 3, 5});
  const at::Tensor w = at::randn({4, 2, 5});
  const at::Tensor b = at::randn({4, 2});
  EXPECT_TRUE(at::allclose(wide::linear(x, w, b, "bmm"),
                           wide_test::call_boxed("wide::linear", x, w, b, "bmm").toTensor()));
  EXPECT_EQ(wide::parse_linear_strategy("loop"), wide::LinearStrategy::Loop);
}

}  // namespace
