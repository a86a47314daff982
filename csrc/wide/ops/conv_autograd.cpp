// The 'loop' strategy of wide::conv when a weight gradient is wanted (Note [Loop conv gradients]),
// and the layout-keeping conversion of a channels-last input (Note [Layout-keeping conversion]).
// Built like the C++ frontend files (CMakeLists.txt): the autograd headers pull in every ATen
// operator.
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <ATen/ops/cat.h>
#include <ATen/ops/convolution.h>
#include <ATen/ops/convolution_backward.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/im2col.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/sum.h>

#include <optional>
#include <vector>

#include "wide/ops/conv.h"
#include "wide/ops/layout.h"
#include "wide/ops/transforms.h"

// Note [Loop conv gradients]
// --------------------------
// The composite 'loop' strategy unbinds the stacked weight [N, C_out, C_in, kh, kw] and runs N
// ordinary convs; autograd then computes N member weight gradients and UnbindBackward stacks them
// into the [N, ...] gradient: one more read and write of every weight. For the convs the loop is
// chosen for (large weights, small planes: ResNet-18's last stages) that copy is most of the
// backward's memory traffic: 160 MB per step for ResNet-18 at N=4, ~20 ms on this machine, where
// the members' own loop hands each gradient to its parameter without a copy.
// So in training the loop runs as this autograd function. Its backward writes each member's
// weight gradient straight into its slice of one [N, ...] tensor: where the im2col matrix of a
// member's input is no larger than its weight (B*H_out*W_out <= C_out), as one GEMM (at::mm_out)
// of the output gradient [C_out, B*L] with the columns [B*L, C_in*kh*kw]; otherwise by ATen's
// convolution_backward and a copy into the slice. Bias gradients are summed into their slices;
// input gradients come from ATen's convolution_backward per member. Under create_graph=True the
// backward recomputes the composite loop and differentiates it, so higher-order gradients stay
// exact. 2-d, groups == 1, symmetric padding, CPU, no Python keys or modes (fake tensors while
// tracing take the composite path, which is what a traced graph records).

namespace wide::detail {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Each member's conv input, contiguous: input[n] of an N-first input, or its channel slice.
std::vector<at::Tensor> member_inputs(const at::Tensor& input, bool packed_input, int64_t members) {
  std::vector<at::Tensor> xs = packed_input ? input.chunk(members, 1) : input.unbind(0);
  for (at::Tensor& x : xs) x = x.contiguous();
  return xs;
}

// Member k's conv of xs[k], concatenated on the channel dim (differentiable).
at::Tensor member_convs(const std::vector<at::Tensor>& xs, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias, at::IntArrayRef stride, at::IntArrayRef padding,
                        at::IntArrayRef dilation) {
  const int64_t members = weight.size(0);
  const std::vector<at::Tensor> ws = weight.unbind(0);
  const std::vector<at::Tensor> bs = bias.has_value() ? bias->unbind(0) : std::vector<at::Tensor>{};
  std::vector<at::Tensor> outs;
  for (int64_t k = 0; k < members; ++k) {
    outs.push_back(at::convolution(xs[k], ws[k], bs.empty() ? std::nullopt : std::optional<at::Tensor>(bs[k]), stride,
                                   padding, dilation, false, {0, 0}, 1));
  }
  return at::cat(outs, 1);
}

// The composite loop (conv.cpp's 'loop' branch for this case), differentiable.
at::Tensor loop_forward(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                        at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, bool packed_input) {
  return member_convs(member_inputs(input, packed_input, weight.size(0)), weight, bias, stride, padding, dilation);
}

class LoopConv2d : public torch::autograd::Function<LoopConv2d> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, std::vector<int64_t> stride,
                            std::vector<int64_t> padding, std::vector<int64_t> dilation, bool packed_input) {
    // The members' contiguous inputs are saved for the backward (views of an N-first input;
    // copies of a packed one, which the backward would otherwise make again).
    const std::vector<at::Tensor> xs = member_inputs(input, packed_input, weight.size(0));
    variable_list saved{input, weight, bias.value_or(at::Tensor())};
    saved.insert(saved.end(), xs.begin(), xs.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["stride"] = stride;
    ctx->saved_data["padding"] = padding;
    ctx->saved_data["dilation"] = dilation;
    ctx->saved_data["packed"] = packed_input;
    return member_convs(xs, weight, bias, stride, padding, dilation);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &input = saved[0], &weight = saved[1], &bias = saved[2];
    const std::vector<int64_t> stride = ctx->saved_data["stride"].toIntVector();
    const std::vector<int64_t> padding = ctx->saved_data["padding"].toIntVector();
    const std::vector<int64_t> dilation = ctx->saved_data["dilation"].toIntVector();
    const bool packed_input = ctx->saved_data["packed"].toBool();
    variable_list out(7);
    const at::Tensor& grad = grads[0];
    if (!grad.defined()) return out;
    const bool need_x = ctx->needs_input_grad(0), need_w = ctx->needs_input_grad(1);
    const bool need_b = bias.defined() && ctx->needs_input_grad(2);

    if (at::GradMode::is_enabled()) {
      // create_graph=True: differentiate the composite loop, recomputed on the saved tensors.
      const std::optional<at::Tensor> b = bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt;
      const at::Tensor y = loop_forward(input, weight, b, stride, padding, dilation, packed_input);
      // only what autograd can differentiate: an input batch (or a frozen weight) has no gradient
      variable_list wrt;
      std::vector<size_t> slots;
      for (const auto& [slot, t] : {std::pair<size_t, const at::Tensor*>{0, &input}, {1, &weight}, {2, &bias}}) {
        if (t->defined() && t->requires_grad() && ctx->needs_input_grad(slot)) {
          wrt.push_back(*t);
          slots.push_back(slot);
        }
      }
      if (wrt.empty()) return out;
      const variable_list got = torch::autograd::grad({y}, wrt, {grad}, /*retain_graph=*/true,
                                                      /*create_graph=*/true, /*allow_unused=*/true);
      for (size_t k = 0; k < slots.size(); ++k) out[slots[k]] = got[k];
      return out;
    }

    const int64_t members = weight.size(0), c_out = weight.size(1);
    const std::vector<at::Tensor> xs(saved.begin() + 3, saved.end());
    const std::vector<at::Tensor> gs = grad.chunk(members, 1);
    at::Tensor gw = need_w ? at::empty_like(weight, at::MemoryFormat::Contiguous) : at::Tensor();
    at::Tensor gb = need_b ? at::empty_like(bias, at::MemoryFormat::Contiguous) : at::Tensor();
    std::vector<at::Tensor> gx;
    for (int64_t k = 0; k < members; ++k) {
      const at::Tensor g = gs[k].contiguous();  // [B, C_out, H_out, W_out]
      const int64_t batch = g.size(0), l = g.size(2) * g.size(3);
      const bool gemm = need_w && batch * l <= c_out;
      const auto [dx, dw, db] = at::convolution_backward(g, xs[k], weight[k], std::nullopt, stride, padding, dilation,
                                                         false, {0, 0}, 1, {need_x, need_w && !gemm, false});
      if (need_x) gx.push_back(dx);
      if (gemm) {
        // [C_out, B*L] x [B*L, C_in*kh*kw], written into member k's slice.
        const at::Tensor cols = at::im2col(xs[k], {weight.size(3), weight.size(4)}, dilation, padding, stride);
        const at::Tensor lhs = g.view({batch, c_out, l}).transpose(0, 1).reshape({c_out, batch * l});
        const at::Tensor rhs = cols.transpose(0, 1).reshape({cols.size(1), batch * l});
        at::Tensor slice = gw.select(0, k).view({c_out, -1});
        at::mm_out(slice, lhs, rhs.t());
      } else if (need_w) {
        gw.select(0, k).copy_(dw);
      }
      if (need_b) {
        at::Tensor slice = gb.select(0, k);
        at::sum_out(slice, g, {0, 2, 3});
      }
    }
    if (need_x) out[0] = packed_input ? at::cat(gx, 1) : at::stack(gx);
    if (need_w) out[1] = gw;
    if (need_b) out[2] = gb;
    return out;
  }
};

// Note [Layout-keeping conversion]
// ---------------------------------
// A channels-first op reading a channels-last activation converts it with .contiguous(), whose
// backward hands the gradient on as it comes: channels-first, into ops that saved channels-last
// tensors. ResNet-18's train graph has one such place: its stem runs channels-last up to the max
// pool (Note [Stem layout]) and the channels-first convs of layer 1 read the pooled features.
// ATen's max_pool2d backward with a channels-last input and a channels-first gradient took 58 ms
// on [8, 1024, 32, 32] against 11 ms with a channels-last gradient (it converts both ways
// itself), and a residual add of one tensor of each layout runs 10-15x slower than of one.
// wide::to_channels_first is .contiguous() with a backward that returns the gradient in its
// input's layout: one copy of the (4x smaller) pooled gradient. The layout plan puts it after
// such a max pool, once for all its readers (fx/layout.py); the grouped conv converts a
// channels-last input with it too. Values are .contiguous()'s either way; with Python keys or
// modes (tracing, fake tensors) it is .contiguous() itself, which is what a traced graph records.
class ContiguousKeepingGradLayout : public torch::autograd::Function<ContiguousKeepingGradLayout> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x) {
    ctx->saved_data["format"] = static_cast<int64_t>(x.suggest_memory_format());
    return x.contiguous();
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto format = static_cast<at::MemoryFormat>(ctx->saved_data["format"].toInt());
    return {grads[0].defined() ? grads[0].contiguous(format) : grads[0]};
  }
};

bool concrete(c10::SymIntArrayRef values) {
  for (const c10::SymInt& v : values) {
    if (!v.maybe_as_int().has_value()) return false;
  }
  return true;
}

std::vector<int64_t> ints(c10::SymIntArrayRef values) {
  std::vector<int64_t> out;
  for (const c10::SymInt& v : values) out.push_back(v.expect_int());
  return out;
}

} // namespace

at::Tensor contiguous_keeping_grad_layout(const at::Tensor& x) {
  const bool applies = at::GradMode::is_enabled() && x.requires_grad() && !x.is_contiguous() &&
                       x.suggest_memory_format() != at::MemoryFormat::Contiguous &&
                       untraced({&x}) && plain_autograd({&x});  // Note [Kernels under transforms]
  return applies ? ContiguousKeepingGradLayout::apply(x) : x.contiguous();
}

std::optional<at::Tensor> conv_loop_training(const at::Tensor& input, const at::Tensor& weight,
                                             const std::optional<at::Tensor>& bias, c10::SymIntArrayRef stride,
                                             c10::SymIntArrayRef padding, c10::SymIntArrayRef dilation,
                                             const c10::SymInt& groups, bool packed_input) {
  const bool applies = at::GradMode::is_enabled() && weight.requires_grad() && weight.dim() == 5 &&
                       weight.device().is_cpu() && input.device().is_cpu() && groups == 1 &&
                       padding.size() == 2 && untraced({&input, &weight, bias.has_value() ? &*bias : nullptr}) &&
                       plain_autograd({&input, &weight, bias.has_value() ? &*bias : nullptr}) &&
                       concrete(input.sym_sizes()) && concrete(weight.sym_sizes()) && concrete(stride) &&
                       concrete(padding) && concrete(dilation);
  if (!applies) return std::nullopt;
  return LoopConv2d::apply(input, weight, bias, ints(stride), ints(padding), ints(dilation), packed_input);
}

} // namespace wide::detail
