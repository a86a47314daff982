// wide::to_packed / wide::to_nfirst (public C++ API, through the dispatcher), against the packed
// layout built with plain ATen (member values concatenated on the channel dim), plus the view
// guarantees that Note [wide layouts] (csrc/wide/ops/layout.cpp) relies on.
#include <ATen/ops/equal.h>
#include <ATen/ops/randn.h>
#include <gtest/gtest.h>

#include <vector>

#include "wide/ops/layout.h"
#include "wide_test_utils.h"

namespace {

using wide_test::expect_error;

// Number of spatial dims of each member's [B, C, *] value.
class WideLayoutTest : public ::testing::TestWithParam<int> {};

TEST_P(WideLayoutTest, RoundTripMatchesConcatenation) {
  const int spatial = GetParam();
  const int64_t n = 3;
  std::vector<int64_t> shape = {n, 2, 4, 5, 3};
  shape.resize(3 + spatial);
  const at::Tensor x = at::randn(shape);

  const at::Tensor packed = wide::to_packed(x);
  EXPECT_TRUE(at::equal(packed, wide_test::pack(x)));
  // Member i owns channels [i*C, (i+1)*C).
  EXPECT_TRUE(at::equal(packed.narrow(1, 4, 4), x[1]));

  const at::Tensor back = wide::to_nfirst(packed, n);
  EXPECT_TRUE(at::equal(back, x));
  EXPECT_TRUE(back.is_alias_of(packed)) << "to_nfirst must be a view";
  // to_packed of a to_nfirst view is again a view of the same packed memory: the N-first round
  // trip between two packed ops is free.
  const at::Tensor again = wide::to_packed(back);
  EXPECT_TRUE(again.is_alias_of(packed));
  EXPECT_EQ(again.data_ptr(), packed.data_ptr());
  EXPECT_EQ(again.strides(), packed.strides());
}

INSTANTIATE_TEST_SUITE_P(Grid, WideLayoutTest, ::testing::Values(0, 1, 2));

TEST(WideLayout, SharedAndNonContiguousInputs) {
  // A stride-0 shared input packs to N copies of the member value.
  const at::Tensor one = at::randn({2, 3, 4});
  const at::Tensor shared = one.expand({4, 2, 3, 4});
  EXPECT_TRUE(at::equal(wide::to_packed(shared), wide_test::pack(shared)));
  EXPECT_TRUE(at::equal(wide::to_packed(shared).narrow(1, 9, 3), one));
  // A permuted N-first input.
  const at::Tensor xt = at::randn({4, 3, 2, 5}).permute({0, 2, 1, 3});
  ASSERT_FALSE(xt.is_contiguous());
  EXPECT_TRUE(at::equal(wide::to_packed(xt), wide_test::pack(xt)));
  // to_nfirst of a non-contiguous packed tensor (a channel slice) is still a correct view.
  const at::Tensor p = at::randn({2, 12, 5}).narrow(1, 3, 6);
  const at::Tensor nf = wide::to_nfirst(p, 2);
  EXPECT_TRUE(nf.is_alias_of(p));
  EXPECT_TRUE(at::equal(wide_test::pack(nf), p));
}

TEST(WideLayout, PackedActivationCppApi) {
  const at::Tensor x = at::randn({3, 2, 4, 5});
  EXPECT_TRUE(at::equal(wide::detail::packed_activation(x, false, 3, "myop"), wide_test::pack(x)));
  const at::Tensor p = at::randn({2, 12, 5});
  EXPECT_TRUE(wide::detail::packed_activation(p, true, 3, "myop").is_same(p));
  expect_error([&] { wide::detail::packed_activation(p, false, 3, "myop"); },
               "wide::myop: expected an N-first input [N, B, C, *] with 4 dims, got [2, 12, 5]");
  expect_error([&] { wide::detail::packed_activation(x, true, 3, "myop"); },
               "wide::myop: expected a channel-packed input [B, N*C, *] with 3 dims");
}

// Note [Layout-keeping conversion]: .contiguous()'s values; a channels-last input's gradient comes
// back channels-last, a channels-first input's channels-first.
TEST(WideLayout, ToChannelsFirstKeepsTheGradientLayout) {
  for (const auto format : {at::MemoryFormat::ChannelsLast, at::MemoryFormat::Contiguous}) {
    at::Tensor x = at::randn({2, 6, 3, 4}).contiguous(format);
    x.set_requires_grad(true);
    const at::Tensor y = wide::to_channels_first(x);
    EXPECT_TRUE(y.is_contiguous());
    EXPECT_TRUE(at::equal(y, x));
    const at::Tensor g = at::randn({2, 6, 3, 4});
    y.backward(g);
    EXPECT_TRUE(at::equal(x.grad(), g));
    EXPECT_TRUE(x.grad().is_contiguous(format)) << format;
  }
}

TEST(WideLayout, Errors) {
  expect_error([] { wide::to_packed(at::randn({3, 4})); }, "wide::to_packed: expected an N-first tensor [N, B, C, *]");
  expect_error([] { wide::to_nfirst(at::randn({4}), 2); }, "wide::to_nfirst: expected a channel-packed tensor");
  expect_error([] { wide::to_nfirst(at::randn({2, 6}), 0); }, "expected n >= 1 members, got 0");
  expect_error([] { wide::to_nfirst(at::randn({2, 7}), 3); },
               "expected the channel dim (dim 1) to be a multiple of n=3, got shape [2, 7]");
}

}  // namespace
