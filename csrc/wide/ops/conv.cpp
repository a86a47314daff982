#include "wide/ops/conv.h"

#include "wide/ops/call_op.h"
#include "wide/ops/layout.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/convolution.h>
#include <torch/library.h>

#include <string>
#include <vector>

// Note [wide::conv strategies]
// ----------------------------
// Member n convolves its input with weight[n]. The result is always channel-packed
// [B, N*C_out, *] (Note [wide layouts]). Four ways to compute it:
//  * shared: the input is N-first with stride 0 on dim 0 (x.expand(N, ...)): every member reads
//    the same activation. With groups == 1 this is ONE ordinary conv with the N*C_out filters
//    stacked ([N*C_out, C_in, *k] is a free view of the weight), whose output is already packed.
//    N copies of the input are never made. (With groups > 1 the members' filters of one group
//    are not adjacent in that stacking, so the input is packed and the grouped path runs.)
//  * grouped: one conv over the packed input with groups = N*groups: group g of member n sees
//    exactly member n's channels of group g. The weight view [N*C_out, C_in/groups, *k] is free.
//  * grouped_cl: the same grouped conv on a channels-last packed input ([B, N*C, H, W] with
//    channels innermost; an N-first input is packed straight into that layout, one copy as for
//    grouped), so the result is channels-last too (oneDNN keeps its input's layout) and the
//    conv, norm and pool ops after it stay channels-last until an op asks for another layout.
//    2-d convs only; other ranks run as grouped.
//  * loop: N separate convs on the channel slices (or on input[n] for an N-first input, which
//    avoids packing it), each made channels-first contiguous, concatenated on the channel dim.
// grouped and loop run channels-first whatever their input's layout (a channels-last input is
// converted), so a strategy names the memory layout its conv runs in. None wins everywhere
// (measured on this machine, ResNet-18 convs, 4 members, batch 8, inference, ms):
//    member conv                 user loop  grouped  grouped_cl  loop
//    3->64 7x7 /2, 64x64           4.4       7.1       1.4        8.0
//    64->64 3x3, 16x16             1.5       1.4       1.25       1.6
//    256->512 3x3 /2, 4x4          1.9       2.2       5.6        2.0
//    512->512 3x3, 2x2             3.2      14.4      31.3        3.2
// Channels-last wins while the planes are large, channels-first once they are small and the
// channels many, and oneDNN's grouped kernel falls far behind N ordinary convs at 512 channels
// per group. So `auto` is only a heuristic default (fx/rules/conv.py); the compile-time tuner
// measures each conv, and the model-level check (model.py) the graph as a whole.
//
// Accuracy: with 3 input channels per group (an RGB stem), oneDNN's channels-first grouped
// weight gradient sums in a way that loses far more precision than the per-member kernel when
// the gradient is a small difference of large terms, as it is behind a training BatchNorm: a
// ResNet-style stem, 16 members, 8x3x32x32, weight gradient 1.1e-2 from float64 (of 1.5) against
// 2.5e-6 for the members and 1.4e-6 for grouped_cl. So 2-d dense convs (groups 1) with fewer
// than kFewChannels input channels never run channels-first grouped by default: `auto` is
// grouped_cl there, and the compiler does not offer grouped for them (fx/rules/conv.py).
// A depthwise conv is the other way round: behind a training BatchNorm on inputs of mean 3,
// 8 members of 16 channels at 32x32, grouped_cl's weight gradient is 1.4e-3 from float64 against
// 5.5e-5 for the members, grouped's 5.7e-5 (and grouped_cl runs a lone depthwise conv 6x slower
// than grouped). So member convs with groups > 1 and few channels per group stay channels-first.
// Built from ATen ops with SymInt sizes: CompositeImplicitAutograd, traces with a dynamic batch.
//
// Padding: `padding` has one value per spatial dim (symmetric, passed to the conv) or two per
// dim in F.pad order (last dim first: left, right, ...), which is how padding='same' with an
// even kernel comes out; then the input is zero-padded first and the conv gets padding 0.
// Non-zero padding modes (reflect, replicate, circular) arrive as an aten.pad before the conv in
// the captured graph; the spatial widen rules handle it (python/wide_compiler/fx/rules/spatial.py)
// and the conv rule (fx/rules/conv.py) passes this op only the conv's own zero padding.

namespace wide {

ConvStrategy parse_conv_strategy(std::string_view name, std::string_view op) {
  if (name == "auto") return ConvStrategy::Auto;
  if (name == "grouped") return ConvStrategy::Grouped;
  if (name == "grouped_cl") return ConvStrategy::GroupedChannelsLast;
  if (name == "loop") return ConvStrategy::Loop;
  TORCH_CHECK(false, "wide::", std::string(op), ": expected strategy 'auto', 'grouped', 'grouped_cl' or 'loop', "
              "got '", std::string(name), "'");
}

namespace {

// Input channels per group below which `auto` runs grouped_cl (Note [wide::conv strategies]).
constexpr int64_t kFewChannels = 8;

// One convolution (transposed or not) of all members; weight is [N, A, B', *k] where
// (A, B') = (C_out, C_in/g) for conv and (C_in, C_out/g) for conv_transpose.
at::Tensor wide_convolution(const char* op, const at::Tensor& input, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, c10::SymIntArrayRef stride,
                            c10::SymIntArrayRef padding_in, c10::SymIntArrayRef dilation,
                            bool transposed, c10::SymIntArrayRef output_padding,
                            const c10::SymInt& groups, bool packed_input, std::string_view strategy) {
  ConvStrategy kind = parse_conv_strategy(strategy, op);
  TORCH_CHECK(weight.dim() >= 4 && weight.dim() <= 6, "wide::", op, ": expected weight [N, ",
              transposed ? "C_in, C_out/groups" : "C_out, C_in/groups", ", *kernel] with 1 to 3 "
              "spatial dims, got ", weight.sym_sizes());
  const int64_t d = weight.dim() - 3;
  TORCH_CHECK(groups >= 1, "wide::", op, ": expected groups >= 1, got ", groups);
  TORCH_CHECK(input.scalar_type() == weight.scalar_type() && input.device() == weight.device(),
              "wide::", op, ": expected input and weight of the same dtype and device, got ",
              input.scalar_type(), " on ", input.device(), " and ", weight.scalar_type(), " on ",
              weight.device());
  const int64_t want_dim = packed_input ? d + 2 : d + 3;
  TORCH_CHECK(input.dim() == want_dim, "wide::", op, ": expected ",
              packed_input ? "a channel-packed input [B, N*C_in, *] with " : "an N-first input [N, B, C_in, *] with ",
              want_dim, " dims for a ", d, "-d weight ", weight.sym_sizes(), ", got ", input.sym_sizes());
  const c10::SymInt n = weight.sym_size(0);
  const c10::SymInt c_in = transposed ? weight.sym_size(1) : weight.sym_size(2) * groups;
  const c10::SymInt c_out = transposed ? weight.sym_size(2) * groups : weight.sym_size(1);
  if (packed_input) {
    TORCH_CHECK(input.sym_size(1) == n * c_in, "wide::", op, ": packed input has ",
                input.sym_size(1), " channels, expected N*C_in = ", n, "*", c_in, " (input ",
                input.sym_sizes(), ", weight ", weight.sym_sizes(), ")");
  } else {
    TORCH_CHECK(input.sym_size(0) == n, "wide::", op, ": input has ", input.sym_size(0),
                " members (dim 0) but weight has ", n);
    TORCH_CHECK(input.sym_size(2) == c_in, "wide::", op, ": input has ", input.sym_size(2),
                " channels (dim 2), expected C_in = ", c_in, " (input ", input.sym_sizes(),
                ", weight ", weight.sym_sizes(), ")");
  }
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 2 && bias->sym_size(0) == n && bias->sym_size(1) == c_out,
                "wide::", op, ": expected bias [N, C_out] = [", n, ", ", c_out, "], got ",
                bias->sym_sizes());
  }
  TORCH_CHECK(static_cast<int64_t>(stride.size()) == d && static_cast<int64_t>(dilation.size()) == d,
              "wide::", op, ": expected ", d, " stride and dilation values, got ", stride.size(),
              " and ", dilation.size());
  TORCH_CHECK(static_cast<int64_t>(padding_in.size()) == d ||
                  (!transposed && static_cast<int64_t>(padding_in.size()) == 2 * d),
              "wide::", op, ": expected ", d, transposed ? "" : " or 2*", transposed ? "" : std::to_string(d),
              " padding values, got ", padding_in.size());

  // Explicit (left, right) padding: zero-pad first (Note [wide::conv strategies]).
  std::vector<c10::SymInt> zeros(d, c10::SymInt(0));
  const bool explicit_pad = static_cast<int64_t>(padding_in.size()) == 2 * d;
  c10::SymIntArrayRef padding = explicit_pad ? c10::SymIntArrayRef(zeros) : padding_in;
  auto pre_pad = [&](const at::Tensor& x) {
    return explicit_pad ? at::constant_pad_nd_symint(x, padding_in, 0) : x;
  };

  // Shared input, one conv with N*C_out filters (groups == 1 only).
  if (!packed_input && input.sym_stride(0) == 0 && groups == 1) {
    std::vector<c10::SymInt> wsizes(weight.sym_sizes().begin() + 1, weight.sym_sizes().end());
    if (transposed) {
      // [N, C_in, C_out, *k] -> [C_in, N*C_out, *k]: filters of member n at output block n.
      wsizes[1] = n * c_out;
      const at::Tensor w = weight.movedim(0, 1).reshape_symint(wsizes);
      const std::optional<at::Tensor> b =
          bias.has_value() ? std::optional<at::Tensor>(bias->reshape_symint({n * c_out})) : std::nullopt;
      return at::convolution_symint(pre_pad(input.select(0, 0)), w, b, stride, padding, dilation,
                                    true, output_padding, 1);
    }
    wsizes[0] = n * c_out;
    const at::Tensor w = weight.reshape_symint(wsizes);
    const std::optional<at::Tensor> b =
        bias.has_value() ? std::optional<at::Tensor>(bias->reshape_symint({n * c_out})) : std::nullopt;
    return at::convolution_symint(pre_pad(input.select(0, 0)), w, b, stride, padding, dilation,
                                  false, output_padding, 1);
  }

  if (kind == ConvStrategy::Auto) {
    // Few input channels per group: channels-first grouped loses accuracy (see the note).
    kind = d == 2 && !transposed && groups == 1 && weight.sym_size(2) < kFewChannels
               ? ConvStrategy::GroupedChannelsLast
               : ConvStrategy::Grouped;
  }
  if (kind == ConvStrategy::Loop) {
    if (!transposed && !explicit_pad && d == 2) {
      // Training: weight gradients written in place (Note [Loop conv gradients]).
      if (auto y = detail::conv_loop_training(input, weight, bias, stride, padding, dilation, groups, packed_input)) {
        return *y;
      }
    }
    // unbind/split, not select/narrow: their backward stacks/concatenates the N gradients once,
    // where N selects would each scatter into a zero tensor of the full size (O(N^2) traffic).
    const std::vector<at::Tensor> xs = packed_input ? input.split_symint(c_in, 1) : input.unbind(0);
    const std::vector<at::Tensor> ws = weight.unbind(0);
    const std::vector<at::Tensor> bs = bias.has_value() ? bias->unbind(0) : std::vector<at::Tensor>{};
    std::vector<at::Tensor> outs;
    outs.reserve(ws.size());
    for (size_t k = 0; k < ws.size(); ++k) {
      outs.push_back(at::convolution_symint(
          pre_pad(xs[k]).contiguous(), ws[k], bs.empty() ? std::nullopt : std::optional<at::Tensor>(bs[k]), stride,
          padding, dilation, transposed, output_padding, groups));
    }
    return at::cat(outs, 1);
  }

  at::Tensor x;
  if (kind == ConvStrategy::GroupedChannelsLast && d == 2) {
    if (packed_input) {
      x = pre_pad(input).contiguous(at::MemoryFormat::ChannelsLast);
    } else {
      // [N, B, C, H, W] -> [B, H, W, N*C] -> the packed [B, N*C, H, W] view with channels innermost.
      const at::Tensor p = pre_pad(input);
      x = p.permute({1, 3, 4, 0, 2})
              .reshape_symint({p.sym_size(1), p.sym_size(3), p.sym_size(4), n * c_in})
              .permute({0, 3, 1, 2});
    }
  } else {
    x = detail::contiguous_keeping_grad_layout(pre_pad(detail::packed_activation(input, packed_input, d + 2, op)));
  }
  std::vector<c10::SymInt> wsizes(weight.sym_sizes().begin() + 1, weight.sym_sizes().end());
  wsizes[0] = n * weight.sym_size(1);
  const at::Tensor w = weight.reshape_symint(wsizes);
  const std::optional<at::Tensor> b =
      bias.has_value() ? std::optional<at::Tensor>(bias->reshape_symint({n * c_out})) : std::nullopt;
  return at::convolution_symint(x, w, b, stride, padding, dilation, transposed, output_padding,
                                n * groups);
}

at::Tensor conv_impl(const at::Tensor& input, const at::Tensor& weight,
                     const std::optional<at::Tensor>& bias, c10::SymIntArrayRef stride,
                     c10::SymIntArrayRef padding, c10::SymIntArrayRef dilation, c10::SymInt groups,
                     bool packed_input, std::string_view strategy) {
  const int64_t d = std::max<int64_t>(weight.dim() - 3, 0);
  std::vector<c10::SymInt> output_padding(d, c10::SymInt(0));
  return wide_convolution("conv", input, weight, bias, stride, padding, dilation, false,
                          output_padding, groups, packed_input, strategy);
}

at::Tensor conv_transpose_impl(const at::Tensor& input, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias, c10::SymIntArrayRef stride,
                               c10::SymIntArrayRef padding, c10::SymIntArrayRef output_padding,
                               c10::SymInt groups, c10::SymIntArrayRef dilation, bool packed_input,
                               std::string_view strategy) {
  const int64_t d = std::max<int64_t>(weight.dim() - 3, 0);
  TORCH_CHECK(static_cast<int64_t>(output_padding.size()) == d, "wide::conv_transpose: expected ",
              d, " output_padding values, got ", output_padding.size());
  return wide_convolution("conv_transpose", input, weight, bias, stride, padding, dilation, true,
                          output_padding, groups, packed_input, strategy);
}

} // namespace

at::Tensor conv(const at::Tensor& input, const at::Tensor& weight,
                const std::optional<at::Tensor>& bias, c10::SymIntArrayRef stride,
                c10::SymIntArrayRef padding, c10::SymIntArrayRef dilation, c10::SymInt groups,
                bool packed_input, std::string_view strategy) {
  return detail::call_op<"wide::conv", decltype(conv)>(
      input, weight, bias, stride, padding, dilation, std::move(groups), packed_input, strategy);
}

at::Tensor conv_transpose(const at::Tensor& input, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias, c10::SymIntArrayRef stride,
                          c10::SymIntArrayRef padding, c10::SymIntArrayRef output_padding,
                          c10::SymInt groups, c10::SymIntArrayRef dilation, bool packed_input,
                          std::string_view strategy) {
  return detail::call_op<"wide::conv_transpose", decltype(conv_transpose)>(
      input, weight, bias, stride, padding, output_padding, std::move(groups), dilation,
      packed_input, strategy);
}

} // namespace wide

TORCH_LIBRARY_IMPL(wide, CompositeImplicitAutograd, m) {
  m.impl("conv", &wide::conv_impl);
  m.impl("conv_transpose", &wide::conv_transpose_impl);
}
