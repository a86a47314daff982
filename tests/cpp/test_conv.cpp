// wide::conv and wide::conv_transpose (public C++ API, through the dispatcher as
// torch.ops.wide.conv is), against a reference written with plain ATen calls: member n is at::conv{1,2,3}d (or
// at::conv_transpose{1,2,3}d) of its own input with weight[n], bias[n] and the member's `groups`;
// the members' results concatenated on the channel dim are the packed result the op returns.
#include <ATen/ops/allclose.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/conv1d.h>
#include <ATen/ops/conv2d.h>
#include <ATen/ops/conv3d.h>
#include <ATen/ops/conv_transpose1d.h>
#include <ATen/ops/conv_transpose2d.h>
#include <ATen/ops/conv_transpose3d.h>
#include <ATen/ops/randn.h>
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "wide/ops/conv.h"
#include "wide/ops/layout.h"
#include "wide_test_utils.h"

namespace {

using namespace wide_test;

// One member's convolution with plain ATen.
at::Tensor member_conv(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
                       const Ints& stride, const Ints& padding, const Ints& dilation, int64_t groups) {
  switch (w.dim() - 2) {
    case 1: return at::conv1d(x, w, b, stride, padding, dilation, groups);
    case 2: return at::conv2d(x, w, b, stride, padding, dilation, groups);
    default: return at::conv3d(x, w, b, stride, padding, dilation, groups);
  }
}

at::Tensor member_conv_transpose(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
                                 const Ints& stride, const Ints& padding, const Ints& output_padding,
                                 int64_t groups, const Ints& dilation) {
  switch (w.dim() - 2) {
    case 1: return at::conv_transpose1d(x, w, b, stride, padding, output_padding, groups, dilation);
    case 2: return at::conv_transpose2d(x, w, b, stride, padding, output_padding, groups, dilation);
    default: return at::conv_transpose3d(x, w, b, stride, padding, output_padding, groups, dilation);
  }
}

// x: the members' inputs N-first [N, B, C_in, *] (whatever layout the op receives).
at::Tensor reference_conv(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
                          const Ints& stride, const Ints& padding, const Ints& dilation, int64_t groups) {
  std::vector<at::Tensor> outs;
  for (int64_t n = 0; n < w.size(0); ++n) {
    outs.push_back(member_conv(x[n], w[n], member(b, n), stride, padding, dilation, groups));
  }
  return pack(outs);
}

at::Tensor reference_conv_transpose(const at::Tensor& x, const at::Tensor& w,
                                    const std::optional<at::Tensor>& b, const Ints& stride,
                                    const Ints& padding, const Ints& output_padding, int64_t groups,
                                    const Ints& dilation) {
  std::vector<at::Tensor> outs;
  for (int64_t n = 0; n < w.size(0); ++n) {
    outs.push_back(member_conv_transpose(x[n], w[n], member(b, n), stride, padding, output_padding,
                                         groups, dilation));
  }
  return pack(outs);
}

Ints first(const Ints& v, int64_t d) { return Ints(v.begin(), v.begin() + d); }

// transposed, spatial dims, input layout, strategy; groups (1, 2) and bias (with, without) vary
// inside each case.
using Case = std::tuple<bool, int, Layout, std::string>;

class WideConvTest : public ::testing::TestWithParam<Case> {};

TEST_P(WideConvTest, MatchesPerMemberReference) {
  const auto& [transposed, d, layout, strategy] = GetParam();
  const int64_t n = 3, batch = 2, c_in = 4, c_out = 6;
  const Ints stride = first({2, 1, 1}, d), padding = first({1, 0, 1}, d);
  const Ints dilation = first({1, 2, 1}, d), output_padding = first({1, 0, 0}, d);
  Ints in_shape = {batch, c_in};
  for (int64_t s : first({7, 6, 5}, d)) in_shape.push_back(s);
  const at::Tensor x = member_inputs(layout, n, in_shape);
  const at::Tensor input = op_input(layout, x);
  const bool packed = layout == Layout::Packed;

  for (int64_t groups : {1, 2}) {
    for (bool has_bias : {false, true}) {
      SCOPED_TRACE("groups=" + std::to_string(groups) + " bias=" + std::to_string(has_bias));
      Ints w_shape = transposed ? Ints{n, c_in, c_out / groups} : Ints{n, c_out, c_in / groups};
      for (int64_t k : first({3, 3, 2}, d)) w_shape.push_back(k);
      const at::Tensor w = at::randn(w_shape, f64());
      const std::optional<at::Tensor> b =
          has_bias ? std::optional<at::Tensor>(at::randn({n, c_out}, f64())) : std::nullopt;
      if (transposed) {
        WIDE_EXPECT_CLOSE(wide::conv_transpose(input, w, b, syms(stride), syms(padding), syms(output_padding),
                                               groups, syms(dilation), packed, strategy),
                          reference_conv_transpose(x, w, b, stride, padding, output_padding, groups, dilation));
      } else {
        WIDE_EXPECT_CLOSE(
            wide::conv(input, w, b, syms(stride), syms(padding), syms(dilation), groups, packed, strategy),
            reference_conv(x, w, b, stride, padding, dilation, groups));
      }
    }
  }
}

std::string conv_case_name(const ::testing::TestParamInfo<Case>& info) {
  const auto& [transposed, d, layout, strategy] = info.param;
  return std::string(transposed ? "transpose" : "conv") + std::to_string(d) + "d_" +
         layout_name(layout) + "_" + strategy;
}

INSTANTIATE_TEST_SUITE_P(
    Grid, WideConvTest,
    ::testing::Combine(::testing::Bool(), ::testing::Values(1, 2, 3),
                       ::testing::Values(Layout::NFirst, Layout::Packed, Layout::Shared),
                       ::testing::Values("grouped", "grouped_cl", "loop")),
    conv_case_name);

// Explicit (left, right) padding in F.pad order (last dim first), as padding='same' with an even
// kernel produces: the member reference zero-pads with at::constant_pad_nd, then convolves.
TEST(WideConv, ExplicitPadding) {
  const int64_t n = 3;
  const Ints pad = {1, 0, 0, 1};  // W: (1, 0), H: (0, 1)
  const Ints stride = {1, 1}, dilation = {1, 1};
  const at::Tensor w = at::randn({n, 6, 2, 2, 2}, f64());
  const at::Tensor b = at::randn({n, 6}, f64());
  for (Layout layout : {Layout::NFirst, Layout::Packed, Layout::Shared}) {
    const at::Tensor x = member_inputs(layout, n, {2, 4, 5, 6});
    std::vector<at::Tensor> outs;
    for (int64_t k = 0; k < n; ++k) {
      outs.push_back(at::conv2d(at::constant_pad_nd(x[k], pad, 0), w[k], b[k], stride, Ints{0, 0}, dilation, 2));
    }
    const at::Tensor want = pack(outs);
    ASSERT_EQ(want.sizes(), (Ints{2, n * 6, 5, 6}));  // "same" output size for a 2x2 kernel
    for (const char* s : {"auto", "grouped", "loop"}) {
      SCOPED_TRACE(std::string(layout_name(layout)) + " " + s);
      WIDE_EXPECT_CLOSE(wide::conv(op_input(layout, x), w, b, syms(stride), syms(pad), syms(dilation), 2,
                                   layout == Layout::Packed, s),
                        want);
    }
  }
}

TEST(WideConv, AutoStrategy) {
  const int64_t n = 4;
  const Ints one = {1, 1};
  const at::Tensor w = at::randn({n, 3, 2, 3, 3}, f64());
  const at::Tensor wt = at::randn({n, 2, 3, 3, 3}, f64());
  const at::Tensor b = at::randn({n, 3}, f64());
  for (Layout layout : {Layout::NFirst, Layout::Packed, Layout::Shared}) {
    SCOPED_TRACE(layout_name(layout));
    const at::Tensor x = member_inputs(layout, n, {2, 2, 5, 4});
    const at::Tensor input = op_input(layout, x);
    const bool packed = layout == Layout::Packed;
    WIDE_EXPECT_CLOSE(wide::conv(input, w, b, syms(one), syms(one), syms(one), 1, packed, "auto"),
                      reference_conv(x, w, b, one, one, one, 1));
    WIDE_EXPECT_CLOSE(
        wide::conv_transpose(input, wt, b, syms(one), syms(one), syms({0, 0}), 1, syms(one), packed, "auto"),
        reference_conv_transpose(x, wt, b, one, one, {0, 0}, 1, one));
  }
}

TEST(WideConv, NonContiguousInput) {
  // [N=3, B=2, C=4, H=5, W=6] from a permuted buffer: non-contiguous in every member.
  const at::Tensor x = at::randn({3, 4, 6, 2, 5}, f64()).permute({0, 3, 1, 4, 2});
  ASSERT_FALSE(x.is_contiguous());
  const at::Tensor w = at::randn({3, 6, 2, 3, 3}, f64());
  const at::Tensor wt = at::randn({3, 4, 3, 3, 3}, f64());
  const Ints one = {1, 1}, two = {2, 2};
  for (const char* s : {"grouped", "loop"}) {
    SCOPED_TRACE(s);
    WIDE_EXPECT_CLOSE(wide::conv(x, w, std::nullopt, syms(two), syms(one), syms(one), 2, false, s),
                      reference_conv(x, w, std::nullopt, two, one, one, 2));
    WIDE_EXPECT_CLOSE(
        wide::conv_transpose(x, wt, std::nullopt, syms(two), syms(one), syms(one), 2, syms(one), false, s),
        reference_conv_transpose(x, wt, std::nullopt, two, one, one, 2, one));
    // A non-contiguous packed input: every other channel of a wider tensor.
    const at::Tensor wide_buf = at::randn({2, 24, 5, 6}, f64());
    const at::Tensor p = wide_buf.slice(1, 0, 24, 2);
    ASSERT_FALSE(p.is_contiguous());
    const at::Tensor nf = p.view({2, 3, 4, 5, 6}).movedim(1, 0);  // members' values, strided
    WIDE_EXPECT_CLOSE(wide::conv(p, w, std::nullopt, syms(one), syms(one), syms(one), 2, true, s),
                      reference_conv(nf, w, std::nullopt, one, one, one, 2));
  }
}

TEST(WideConv, EmptyBatch) {
  const at::Tensor x = at::randn({3, 0, 4, 5, 5}, f64());
  const at::Tensor w = at::randn({3, 2, 4, 3, 3}, f64());
  const at::Tensor wt = at::randn({3, 4, 2, 3, 3}, f64());
  const Ints one = {1, 1};
  for (const char* s : {"grouped", "loop"}) {
    EXPECT_EQ(wide::conv(x, w, std::nullopt, syms(one), syms(one), syms(one), 1, false, s).sizes(),
              (Ints{0, 6, 5, 5})) << s;
    EXPECT_EQ(wide::conv_transpose(x, wt, std::nullopt, syms(one), syms(one), syms({0, 0}), 1, syms(one), false, s)
                  .sizes(),
              (Ints{0, 6, 5, 5})) << s;
  }
}

TEST(WideConv, Errors) {
  const at::Tensor x = at::randn({3, 2, 4, 5});
  const at::Tensor w = at::randn({3, 6, 4, 3});
  const Ints one = {1};
  auto conv = [&](const at::Tensor& xx, const at::Tensor& ww, const std::optional<at::Tensor>& b,
                  const Ints& stride, const Ints& padding, int64_t groups, bool packed, const char* s) {
    return [=] { wide::conv(xx, ww, b, syms(stride), syms(padding), syms(one), groups, packed, s); };
  };
  expect_error(conv(x, w, std::nullopt, one, one, 1, false, "fast"),
               "wide::conv: expected strategy 'auto', 'grouped', 'grouped_cl' or 'loop', got 'fast'");
  expect_error(conv(x, at::randn({6, 4, 3}), std::nullopt, one, one, 1, false, "auto"),
               "wide::conv: expected weight [N, C_out, C_in/groups, *kernel] with 1 to 3 spatial dims");
  expect_error(conv(x, w, std::nullopt, one, one, 0, false, "auto"), "expected groups >= 1, got 0");
  expect_error(conv(x.to(at::kDouble), w, std::nullopt, one, one, 1, false, "auto"),
               "expected input and weight of the same dtype and device");
  expect_error(conv(at::randn({3, 2, 4, 5, 5}), w, std::nullopt, one, one, 1, false, "auto"),
               "expected an N-first input [N, B, C_in, *] with 4 dims for a 1-d weight");
  expect_error(conv(x, w, std::nullopt, one, one, 1, true, "auto"),
               "expected a channel-packed input [B, N*C_in, *] with 3 dims");
  expect_error(conv(at::randn({2, 2, 4, 5}), w, std::nullopt, one, one, 1, false, "auto"),
               "wide::conv: input has 2 members (dim 0) but weight has 3");
  expect_error(conv(at::randn({3, 2, 5, 5}), w, std::nullopt, one, one, 1, false, "auto"),
               "input has 5 channels (dim 2), expected C_in = 4");
  expect_error(conv(x, w, std::nullopt, one, one, 2, false, "auto"),  // C_in/groups = 4 -> C_in 8
               "expected C_in = 8");
  expect_error(conv(at::randn({2, 10, 5}), w, std::nullopt, one, one, 1, true, "auto"),
               "packed input has 10 channels, expected N*C_in = 3*4");
  expect_error(conv(x, w, at::randn({3, 4}), one, one, 1, false, "auto"),
               "expected bias [N, C_out] = [3, 6], got [3, 4]");
  expect_error(conv(x, w, std::nullopt, {1, 1}, one, 1, false, "auto"),
               "expected 1 stride and dilation values, got 2 and 1");
  expect_error(conv(x, w, std::nullopt, one, {1, 1, 1}, 1, false, "auto"),
               "expected 1 or 2*1 padding values, got 3");
  const at::Tensor wt = at::randn({3, 4, 6, 3});
  auto conv_t = [&](const Ints& padding, const Ints& output_padding, const char* s) {
    return [=] { wide::conv_transpose(x, wt, std::nullopt, syms(one), syms(padding), syms(output_padding), 1,
                                      syms(one), false, s); };
  };
  expect_error(conv_t({0, 0}, {0}, "auto"), "wide::conv_transpose: expected 1 padding values, got 2");
  expect_error(conv_t(one, {0, 0}, "auto"), "wide::conv_transpose: expected 1 output_padding values, got 2");
  expect_error(conv_t(one, {0}, "loops"),
               "wide::conv_transpose: expected strategy 'auto', 'grouped', 'grouped_cl' or 'loop', got 'loops'");
}

// Note [wide::conv strategies]: grouped_cl runs channels-last and returns a channels-last
// packed result; grouped and loop return channels-first whatever their input's layout.
TEST(WideConv, StrategiesNameTheirMemoryLayout) {
  const at::Tensor x = at::randn({3, 2, 4, 6, 6});
  const at::Tensor w = at::randn({3, 5, 4, 3, 3});
  const Ints one = {1, 1};
  auto run = [&](const at::Tensor& input, bool packed, const char* s) {
    return wide::conv(input, w, std::nullopt, syms(one), syms(one), syms(one), 1, packed, s);
  };
  const at::Tensor want = run(x, false, "loop");
  const at::Tensor packed_cl = wide::to_packed(x).contiguous(at::MemoryFormat::ChannelsLast);
  for (const at::Tensor& out : {run(x, false, "grouped_cl"), run(packed_cl, true, "grouped_cl")}) {
    EXPECT_TRUE(out.is_contiguous(at::MemoryFormat::ChannelsLast));
    EXPECT_TRUE(at::allclose(out, want, 1e-5, 1e-5));
  }
  for (const char* s : {"grouped", "loop"}) {
    const at::Tensor out = run(packed_cl, true, s);
    EXPECT_TRUE(out.is_contiguous()) << s;
    EXPECT_TRUE(at::allclose(out, want, 1e-5, 1e-5)) << s;
  }
}

// The public C++ API (a typed dispatcher call) agrees with the boxed call Python makes.
TEST(WideConv, CppApiMatchesDispatcher) {
  const at::Tensor x = at::randn({3, 2, 4, 5, 5});
  const at::Tensor w = at::randn({3, 6, 2, 3, 3});
  const Ints one = {1, 1};
  const at::Tensor boxed = call_boxed("wide::conv", x, w, std::nullopt, one, one, one, 2, false, "loop").toTensor();
  EXPECT_TRUE(at::allclose(wide::conv(x, w, std::nullopt, syms(one), syms(one), syms(one), 2, false, "loop"), boxed));
  EXPECT_EQ(wide::parse_conv_strategy("grouped", "conv"), wide::ConvStrategy::Grouped);
  EXPECT_EQ(wide::parse_conv_strategy("grouped_cl", "conv"), wide::ConvStrategy::GroupedChannelsLast);
  EXPECT_EQ(wide::parse_conv_strategy("auto", "conv"), wide::ConvStrategy::Auto);
}

}  // namespace
