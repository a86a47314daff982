// Autocast kernels of the wide ops: under torch.autocast a wide op casts its arguments as ATen's
// autocast casts those of the op it replaces, so member i of a wide model run under autocast gets
// what model i gets alone under the same autocast, dtype included.
//
// Note [wide autocast]
// ~~~~~~~~~~~~~~~~~~~~
// Autocast is a dispatch key above autograd: its kernel casts the arguments (differentiable
// casts, recorded by autograd), then calls the op again with the key excluded, so the op's own
// kernels run on the cast tensors. Without a kernel here a wide op falls through to its composite
// body with autocast still on, where the ATen ops inside it cast their own arguments: a wide
// linear's bmm returned bfloat16, and the next wide linear met a bfloat16 input and float32
// weights. Each kernel below follows the ATen op the wide op replaces, per device (autocast lists
// of aten/src/ATen/autocast_mode.cpp, and what the CPU composites of the unlisted ops return):
//
//   wide op                           replaces                  CPU                  CUDA
//   linear, conv, conv_transpose,     linear, conv*d,           lower precision      lower precision
//   prelu, attention, small_attention conv_transpose*d, prelu,
//                                     scaled_dot_product_attention
//   batch_norm, instance_norm         batch_norm, instance_norm activation dtype    activation dtype
//   group_norm, layer_norm, rms_norm, group_norm, layer_norm,   activation dtype    float32 (rms_norm:
//   add_layer_norm, fused_norm,       rms_norm (of x + r)                            where ATen lists it)
//   group_norm_nfirst, fused_group_norm
//   rnn                               lstm                      lower precision      lower precision
//                                     gru, rnn_tanh/relu, lstm  per member           (float16 with
//                                     with projections                               cuDNN on)
//   rnn_cell                          every cell                per member           lower precision
//
// "lower precision": every floating argument is cast to the autocast dtype (float64 ones are
// left alone), as ATen's lower_precision_fp policy. "float32": every floating argument is cast
// to float32 (ATen's fp32 policy). "activation dtype": ATen does not cast these; its CPU norms
// take a lower-precision activation with float32 parameters and return the activation's dtype
// (computing in float32 inside). The wide norms need one dtype, so when the dtypes differ the
// activation (and residual) are cast to float32, the norm runs in float32 and the result is cast
// back to the activation's dtype (for add_layer_norm / fused_norm the dtype of input + residual,
// which type promotion gives in the member: a bfloat16 sublayer output plus a float32 residual
// is float32 there). Running statistics are never cast: they are updated in place.
// "per member": each member runs ATen's own op on its slice, under the autocast (Note [Recurrent
// ops under CPU autocast]). (ATen's CPU LSTM without projections runs through mkldnn_rnn_layer,
// on the lower-precision list: all lower, as the wide op.)
// Ops with no entry here (embedding, embedding_bag: ATen does not cast them; layout, allocator
// and optimizer ops) fall through to their kernels, as autocast does for every op by default.
#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/gru.h>
#include <ATen/ops/gru_cell.h>
#include <ATen/ops/lstm.h>
#include <ATen/ops/lstm_cell.h>
#include <ATen/ops/rnn_relu.h>
#include <ATen/ops/rnn_relu_cell.h>
#include <ATen/ops/rnn_tanh.h>
#include <ATen/ops/rnn_tanh_cell.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <initializer_list>
#include <optional>
#include <string_view>
#include <tuple>
#include <vector>

#include "wide/ops/attention.h"
#include "wide/ops/conv.h"
#include "wide/ops/linear.h"
#include "wide/ops/norm.h"
#include "wide/ops/prelu.h"
#include "wide/ops/rnn.h"

namespace wide::autocast {
namespace {

using c10::DeviceType;
using OptTensor = std::optional<at::Tensor>;

// Autocast off for device D while alive: the op called inside runs its own kernels.
template <DeviceType D>
struct NoAutocast {
  c10::impl::ExcludeDispatchKeyGuard guard{at::autocast::get_autocast_dispatch_key_from_device_type(D)};
};

template <DeviceType D>
at::ScalarType lower() {
  return at::autocast::get_lower_precision_fp_from_device_type(D);
}

// at::autocast::cached_cast for D: floating, non-float64 tensors of device D to `to`; float32
// leaf weights cast to lower precision are cached for the autocast region, as ATen's are. An
// input shared by the members (stride 0 on the member dim, Note [wide::linear strategies]) is
// cast once and expanded again: the shared-input paths stay, and N copies are never made.
template <DeviceType D>
at::Tensor cast(at::ScalarType to, const at::Tensor& t) {
  if (t.defined() && t.dim() > 0 && t.sym_stride(0) == 0 && t.scalar_type() != to &&
      at::autocast::is_eligible(t, D)) {
    return at::autocast::cached_cast(to, t.select(0, 0), D).unsqueeze(0).expand_symint(t.sym_sizes());
  }
  return at::autocast::cached_cast(to, t, D);
}

template <DeviceType D>
OptTensor cast(at::ScalarType to, const OptTensor& t) {
  return t.has_value() ? OptTensor(cast<D>(to, *t)) : std::nullopt;
}

template <DeviceType D>
std::vector<at::Tensor> cast(at::ScalarType to, at::TensorList ts) {
  std::vector<at::Tensor> out;
  out.reserve(ts.size());
  for (const at::Tensor& t : ts) out.push_back(cast<D>(to, t));
  return out;
}

bool is_float(const at::Tensor& t, DeviceType device) {
  return t.defined() && at::autocast::is_eligible(t, device);  // floating, not float64, on device
}

// The activation dtype of a norm under the "activation dtype" policy, or nullopt when every
// floating argument already has one dtype (the norm runs as it is). `activation` is the input
// (promoted with the residual where there is one).
template <DeviceType D>
std::optional<at::ScalarType> mixed_activation(const at::Tensor& input, const at::Tensor* residual,
                                               std::initializer_list<const OptTensor*> params) {
  if (!is_float(input, D)) return std::nullopt;
  at::ScalarType act = input.scalar_type();
  bool mixed = false;
  if (residual != nullptr && is_float(*residual, D) && residual->scalar_type() != act) {
    act = at::promote_types(act, residual->scalar_type());
    mixed = true;
  }
  for (const OptTensor* p : params) {
    if (p->has_value() && is_float(**p, D) && (*p)->scalar_type() != input.scalar_type()) mixed = true;
  }
  return mixed ? std::optional<at::ScalarType>(act) : std::nullopt;
}

// The result of `run(cast)` under the "activation dtype" policy (Note [wide autocast]): `run`
// gets the cast function to apply to the activation and the affine parameters.
template <DeviceType D, typename Run>
at::Tensor activation_dtype_norm(const std::optional<at::ScalarType>& act, Run&& run) {
  NoAutocast<D> guard;
  if (!act.has_value()) {
    return run([](const auto& t) { return t; });
  }
  const at::Tensor y = run([](const auto& t) { return cast<D>(at::kFloat, t); });
  return y.scalar_type() == *act ? y : y.to(*act);
}

// --- lower precision: linear, conv, conv_transpose, prelu, attention ---

template <DeviceType D>
at::Tensor linear(const at::Tensor& input, const at::Tensor& weight, const OptTensor& bias,
                  std::string_view strategy) {
  NoAutocast<D> guard;
  const auto to = lower<D>();
  return wide::linear(cast<D>(to, input), cast<D>(to, weight), cast<D>(to, bias), strategy);
}

template <DeviceType D>
at::Tensor conv(const at::Tensor& input, const at::Tensor& weight, const OptTensor& bias,
                c10::SymIntArrayRef stride, c10::SymIntArrayRef padding, c10::SymIntArrayRef dilation,
                c10::SymInt groups, bool packed_input, std::string_view strategy) {
  NoAutocast<D> guard;
  const auto to = lower<D>();
  return wide::conv(cast<D>(to, input), cast<D>(to, weight), cast<D>(to, bias), stride, padding, dilation,
                    std::move(groups), packed_input, strategy);
}

template <DeviceType D>
at::Tensor conv_transpose(const at::Tensor& input, const at::Tensor& weight, const OptTensor& bias,
                          c10::SymIntArrayRef stride, c10::SymIntArrayRef padding,
                          c10::SymIntArrayRef output_padding, c10::SymInt groups,
                          c10::SymIntArrayRef dilation, bool packed_input, std::string_view strategy) {
  NoAutocast<D> guard;
  const auto to = lower<D>();
  return wide::conv_transpose(cast<D>(to, input), cast<D>(to, weight), cast<D>(to, bias), stride, padding,
                              output_padding, std::move(groups), dilation, packed_input, strategy);
}

template <DeviceType D>
at::Tensor prelu(const at::Tensor& input, const at::Tensor& weight, bool packed_input) {
  NoAutocast<D> guard;
  const auto to = lower<D>();
  return wide::prelu(cast<D>(to, input), cast<D>(to, weight), packed_input);
}

template <DeviceType D>
at::Tensor attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                     const OptTensor& attn_mask, double dropout_p, bool is_causal, std::optional<double> scale,
                     bool enable_gqa) {
  NoAutocast<D> guard;
  const auto to = lower<D>();
  return wide::attention(cast<D>(to, query), cast<D>(to, key), cast<D>(to, value), cast<D>(to, attn_mask),
                         dropout_p, is_causal, scale, enable_gqa);
}

// small_attention computes SDPA for float32/float64 only: in lower precision it is SDPA itself.
template <DeviceType D>
at::Tensor small_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                           bool is_causal, std::optional<double> scale) {
  NoAutocast<D> guard;
  const auto to = lower<D>();
  const at::Tensor q = cast<D>(to, query), k = cast<D>(to, key), v = cast<D>(to, value);
  const auto dtype = q.scalar_type();
  if ((dtype == at::kFloat || dtype == at::kDouble) && k.scalar_type() == dtype && v.scalar_type() == dtype) {
    return wide::small_attention(q, k, v, is_causal, scale);
  }
  const int64_t kv_heads = k.dim() == 4 ? k.size(1) : 0;
  const bool gqa = k.dim() == 4 && q.dim() == 4 && kv_heads != q.size(1);
  return at::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, is_causal, scale, gqa);
}

// --- norms: activation dtype (CPU; CUDA batch/instance norm) or float32 (CUDA) ---

template <DeviceType D>
at::Tensor batch_norm(const at::Tensor& input, const OptTensor& weight, const OptTensor& bias,
                      const OptTensor& running_mean, const OptTensor& running_var, bool training,
                      double momentum, double eps, bool packed_input) {
  return activation_dtype_norm<D>(mixed_activation<D>(input, nullptr, {&weight, &bias}), [&](auto cast_to) {
    return wide::batch_norm(cast_to(input), cast_to(weight), cast_to(bias), running_mean, running_var, training,
                            momentum, eps, packed_input);
  });
}

template <DeviceType D>
at::Tensor instance_norm(const at::Tensor& input, const OptTensor& weight, const OptTensor& bias,
                         const OptTensor& running_mean, const OptTensor& running_var, bool use_input_stats,
                         double momentum, double eps, bool packed_input) {
  return activation_dtype_norm<D>(mixed_activation<D>(input, nullptr, {&weight, &bias}), [&](auto cast_to) {
    return wide::instance_norm(cast_to(input), cast_to(weight), cast_to(bias), running_mean, running_var,
                               use_input_stats, momentum, eps, packed_input);
  });
}

// ATen's CUDA policy for group/layer/rms norm: everything in float32, a float32 result.
template <DeviceType D>
constexpr bool kFloat32Norms = D == DeviceType::CUDA;

template <DeviceType D>
at::Tensor group_norm(const at::Tensor& input, int64_t n, int64_t num_groups, const OptTensor& weight,
                      const OptTensor& bias, double eps, bool packed_input) {
  if constexpr (kFloat32Norms<D>) {
    NoAutocast<D> guard;
    return wide::group_norm(cast<D>(at::kFloat, input), n, num_groups, cast<D>(at::kFloat, weight),
                            cast<D>(at::kFloat, bias), eps, packed_input);
  }
  return activation_dtype_norm<D>(mixed_activation<D>(input, nullptr, {&weight, &bias}), [&](auto cast_to) {
    return wide::group_norm(cast_to(input), n, num_groups, cast_to(weight), cast_to(bias), eps, packed_input);
  });
}

// group_norm_nfirst / fused_group_norm: group_norm's policy, on N-first input and output.
template <DeviceType D, at::Tensor (*Op)(const at::Tensor&, int64_t, const OptTensor&, const OptTensor&, double)>
at::Tensor nfirst_group_norm(const at::Tensor& input, int64_t num_groups, const OptTensor& weight,
                             const OptTensor& bias, double eps) {
  if constexpr (kFloat32Norms<D>) {
    NoAutocast<D> guard;
    return Op(cast<D>(at::kFloat, input), num_groups, cast<D>(at::kFloat, weight), cast<D>(at::kFloat, bias), eps);
  }
  return activation_dtype_norm<D>(mixed_activation<D>(input, nullptr, {&weight, &bias}), [&](auto cast_to) {
    return Op(cast_to(input), num_groups, cast_to(weight), cast_to(bias), eps);
  });
}

template <DeviceType D>
at::Tensor layer_norm(const at::Tensor& input, c10::SymIntArrayRef normalized_shape, const OptTensor& weight,
                      const OptTensor& bias, double eps, std::string_view strategy) {
  if constexpr (kFloat32Norms<D>) {
    NoAutocast<D> guard;
    return wide::layer_norm(cast<D>(at::kFloat, input), normalized_shape, cast<D>(at::kFloat, weight),
                            cast<D>(at::kFloat, bias), eps, strategy);
  }
  return activation_dtype_norm<D>(mixed_activation<D>(input, nullptr, {&weight, &bias}), [&](auto cast_to) {
    return wide::layer_norm(cast_to(input), normalized_shape, cast_to(weight), cast_to(bias), eps, strategy);
  });
}

// Whether ATen casts aten::rms_norm under CUDA autocast (the float32 list): torch 2.11 does not,
// so a member's F.rms_norm returns its activation's dtype there, as on the CPU.
bool aten_lists_rms_norm_on_cuda() {
  static const bool listed = [] {
    const auto op = c10::Dispatcher::singleton().findOp({"aten::rms_norm", ""});
    return op.has_value() && op->hasKernelForDispatchKey(c10::DispatchKey::AutocastCUDA);
  }();
  return listed;
}

template <DeviceType D>
at::Tensor rms_norm(const at::Tensor& input, c10::SymIntArrayRef normalized_shape, const OptTensor& weight,
                    std::optional<double> eps) {
  if (kFloat32Norms<D> && aten_lists_rms_norm_on_cuda()) {
    NoAutocast<D> guard;
    return wide::rms_norm(cast<D>(at::kFloat, input), normalized_shape, cast<D>(at::kFloat, weight), eps);
  }
  return activation_dtype_norm<D>(mixed_activation<D>(input, nullptr, {&weight}), [&](auto cast_to) {
    return wide::rms_norm(cast_to(input), normalized_shape, cast_to(weight), eps);
  });
}

template <DeviceType D>
at::Tensor add_layer_norm(const at::Tensor& input, const at::Tensor& residual,
                          c10::SymIntArrayRef normalized_shape, const OptTensor& weight, const OptTensor& bias,
                          double eps) {
  if constexpr (kFloat32Norms<D>) {
    NoAutocast<D> guard;
    return wide::add_layer_norm(cast<D>(at::kFloat, input), cast<D>(at::kFloat, residual), normalized_shape,
                                cast<D>(at::kFloat, weight), cast<D>(at::kFloat, bias), eps);
  }
  return activation_dtype_norm<D>(mixed_activation<D>(input, &residual, {&weight, &bias}), [&](auto cast_to) {
    return wide::add_layer_norm(cast_to(input), cast_to(residual), normalized_shape, cast_to(weight),
                                cast_to(bias), eps);
  });
}

template <DeviceType D>
at::Tensor fused_norm(const at::Tensor& input, const OptTensor& residual, int64_t normalized_numel,
                      const OptTensor& weight, const OptTensor& bias, double eps, bool rms) {
  if (kFloat32Norms<D> && (!rms || aten_lists_rms_norm_on_cuda())) {
    NoAutocast<D> guard;
    return wide::fused_norm(cast<D>(at::kFloat, input), cast<D>(at::kFloat, residual), normalized_numel,
                            cast<D>(at::kFloat, weight), cast<D>(at::kFloat, bias), eps, rms);
  }
  const at::Tensor* r = residual.has_value() ? &*residual : nullptr;
  return activation_dtype_norm<D>(mixed_activation<D>(input, r, {&weight, &bias}), [&](auto cast_to) {
    return wide::fused_norm(cast_to(input), cast_to(residual), normalized_numel, cast_to(weight), cast_to(bias),
                            eps, rms);
  });
}

// --- recurrent ops ---

// Note [Recurrent ops under CPU autocast]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// ATen's CPU GRU, Elman RNN, LSTM with projections and every cell under autocast run their gate
// GEMMs through at::linear, which autocast casts: the gates come out in lower precision, are
// combined in lower precision in place, and meet a float32 state only in the last update
// (GRU: h' = (h - n) * z + n). The wide kernels compute the gates with one batched GEMM and their
// own fusion of the bias and the update, so run in float32 they returned values off the member's
// by the gates' lower-precision rounding (GRU, 2 members: 5e-3; LSTM with projections: 3.7e-3),
// and run in lower precision a step's rounding in 40-50% of the elements (Elman RNNs, cells'
// gradients; independent probes 10 and 11 of issue 44). So on the CPU each member runs ATen's own
// op (at::gru, at::rnn_tanh/relu, at::lstm with projections, at::*_cell) on its slice with the
// autocast left on: the member's own computation, cast for cast; autograd records it as for the
// member. A member's
// float32 parameters are leaves whose lower-precision casts autocast caches, so the gradient of a
// weight used at every time step is summed in lower precision before its one cast back: each
// member's slice of a stacked weight (a view, which autocast does not cache) is cast once here
// for the same sums (without it the GRU's weight gradients differed by 1e-2), and so is an input
// the member's autocast would cache. (Slower than the
// fused time loop: exact first. ATen's LSTM without projections runs all in lower precision
// through oneDNN, as the wide kernel does: that one stays fused.)
template <DeviceType D>
std::tuple<at::Tensor, std::vector<at::Tensor>> rnn_per_member(std::string_view mode, const at::Tensor& input,
                                                               at::TensorList hx,
                                                               at::TensorList params, int64_t num_layers,
                                                               bool bidirectional, bool batch_first, double dropout,
                                                               bool train, bool has_biases, int64_t proj_size) {
  const int64_t members = input.size(0);
  // An input autocast would cache in the member (a float32 leaf that requires grad, read by both
  // directions) is cast once per member too
  const bool cached_input = at::autocast::is_autocast_cache_enabled() && input.is_leaf() && input.requires_grad() &&
                            !input.is_view() && input.scalar_type() == at::kFloat;
  // nn.LSTM's / nn.GRU's zeros when no state is given: [layers * directions, batch, size], the input's dtype
  const c10::SymInt layers = num_layers * (bidirectional ? 2 : 1);
  const bool lstm = mode == "LSTM";
  const c10::SymInt hidden = params[0].sym_size(1) / (lstm ? 4 : mode == "GRU" ? 3 : 1);  // w_ih_l0 [N, G*H, I]
  const c10::SymInt h_size = proj_size > 0 ? c10::SymInt(proj_size) : hidden;
  std::vector<at::Tensor> outputs;
  std::vector<std::vector<at::Tensor>> states(lstm ? 2 : 1);
  for (int64_t i = 0; i < members; ++i) {
    const at::Tensor x = cached_input ? cast<D>(lower<D>(), input.select(0, i)) : input.select(0, i);
    std::vector<at::Tensor> ps;
    ps.reserve(params.size());
    const size_t per_dir = 2 + (has_biases ? 2 : 0) + (proj_size > 0 ? 1 : 0);
    for (size_t k = 0; k < params.size(); ++k) {
      // w_hr is read as matmul(h, w_hr.t()), a view, which autocast does not cache: cast at each step
      const bool projection = proj_size > 0 && k % per_dir == per_dir - 1;
      ps.push_back(projection ? params[k].select(0, i) : cast<D>(lower<D>(), params[k].select(0, i)));
    }
    const c10::SymInt batch = input.sym_size(batch_first ? 1 : 2);
    const auto state = [&](size_t k, const c10::SymInt& size) {
      return hx.empty() ? at::zeros_symint({layers, batch, size}, input.options()) : hx[k].select(0, i);
    };
    if (lstm) {
      auto [o, h_n, c_n] = at::lstm(x, {state(0, h_size), state(1, hidden)}, ps, has_biases, num_layers, dropout,
                                    train, bidirectional, batch_first);
      outputs.push_back(o);
      states[0].push_back(h_n);
      states[1].push_back(c_n);
    } else {
      using Single = std::tuple<at::Tensor, at::Tensor> (*)(const at::Tensor&, const at::Tensor&, at::TensorList,
                                                            bool, int64_t, double, bool, bool, bool);
      const Single single = mode == "GRU"        ? static_cast<Single>(&at::gru)
                            : mode == "RNN_TANH" ? static_cast<Single>(&at::rnn_tanh)
                                                 : static_cast<Single>(&at::rnn_relu);
      auto [o, h_n] = single(x, state(0, hidden), ps, has_biases, num_layers, dropout, train, bidirectional,
                             batch_first);
      outputs.push_back(o);
      states[0].push_back(h_n);
    }
  }
  std::vector<at::Tensor> final_states;
  for (const auto& s : states) final_states.push_back(at::stack(s));
  return {at::stack(outputs), std::move(final_states)};
}

std::vector<at::Tensor> cell_per_member(const at::Tensor& input, at::TensorList hx, const at::Tensor& w_ih,
                                        const at::Tensor& w_hh, const OptTensor& b_ih, const OptTensor& b_hh,
                                        std::string_view mode) {
  const bool lstm = mode == "LSTM";
  const int64_t members = input.size(0);
  const bool batched = input.dim() == 3;  // [N, B, I], else [N, I]: the cell's own unsqueeze and squeeze
  std::vector<at::Tensor> hs, cs;
  for (int64_t i = 0; i < members; ++i) {
    const at::Tensor x = batched ? input.select(0, i) : input.select(0, i).unsqueeze(0);
    const auto state = [&](size_t k) {  // nn.*Cell's zeros when no state is given: [batch, hidden], input's dtype
      if (hx.empty()) return at::zeros_symint({x.sym_size(0), w_hh.sym_size(-1)}, x.options());
      return batched ? hx[k].select(0, i) : hx[k].select(0, i).unsqueeze(0);
    };
    const OptTensor bi = b_ih.has_value() ? OptTensor(b_ih->select(0, i)) : std::nullopt;
    const OptTensor bh = b_hh.has_value() ? OptTensor(b_hh->select(0, i)) : std::nullopt;
    if (lstm) {
      auto [h, c] = at::lstm_cell(x, {state(0), state(1)}, w_ih.select(0, i), w_hh.select(0, i), bi, bh);
      hs.push_back(batched ? h : h.squeeze(0));
      cs.push_back(batched ? c : c.squeeze(0));
    } else {
      const at::Tensor w_i = w_ih.select(0, i), w_h = w_hh.select(0, i);
      const at::Tensor h = mode == "GRU"        ? at::gru_cell(x, state(0), w_i, w_h, bi, bh)
                           : mode == "RNN_TANH" ? at::rnn_tanh_cell(x, state(0), w_i, w_h, bi, bh)
                                                : at::rnn_relu_cell(x, state(0), w_i, w_h, bi, bh);
      hs.push_back(batched ? h : h.squeeze(0));
    }
  }
  std::vector<at::Tensor> result{at::stack(hs)};
  if (lstm) result.push_back(at::stack(cs));
  return result;
}

// Note [cuDNN's RNN under CUDA autocast]: on CUDA, ATen's recurrent layers run cuDNN's RNN where
// cuDNN is on, and its autocast kernel (_cudnn_rnn, aten/src/ATen/native/cudnn/AutocastRNN.cpp)
// casts to float16 whatever the autocast dtype: under bfloat16 autocast a member's LSTM returns
// float16 (seen on an H200, torch 2.11). Without cuDNN the layers run their cells in the autocast
// dtype. The wide op casts as the member's layer does.
bool cudnn_runs_rnns() {
  return at::globalContext().userEnabledCuDNN() && at::globalContext().hasCuDNN();
}

template <DeviceType D>
std::tuple<at::Tensor, std::vector<at::Tensor>> rnn(const at::Tensor& input, at::TensorList hx,
                                                    at::TensorList params, std::string_view mode,
                                                    int64_t num_layers, bool bidirectional, bool batch_first,
                                                    double dropout, bool train, bool has_biases,
                                                    int64_t proj_size, std::string_view strategy) {
  if (D == DeviceType::CPU && !(mode == "LSTM" && proj_size == 0)) {
    // Note [Recurrent ops under CPU autocast]: the autocast stays on
    return rnn_per_member<D>(mode, input, hx, params, num_layers, bidirectional, batch_first, dropout, train,
                             has_biases, proj_size);
  }
  NoAutocast<D> guard;
  const auto to = D == DeviceType::CUDA && cudnn_runs_rnns() ? at::kHalf : lower<D>();
  return wide::rnn(cast<D>(to, input), cast<D>(to, hx), cast<D>(to, params), mode, num_layers, bidirectional,
                   batch_first, dropout, train, has_biases, proj_size, strategy);
}

template <DeviceType D>
std::vector<at::Tensor> rnn_cell(const at::Tensor& input, at::TensorList hx, const at::Tensor& w_ih,
                                 const at::Tensor& w_hh, const OptTensor& b_ih, const OptTensor& b_hh,
                                 std::string_view mode) {
  if (D == DeviceType::CPU) {  // Note [Recurrent ops under CPU autocast]: the autocast stays on
    return cell_per_member(input, hx, w_ih, w_hh, b_ih, b_hh, mode);
  }
  NoAutocast<D> guard;
  const auto to = lower<D>();
  return wide::rnn_cell(cast<D>(to, input), cast<D>(to, hx), cast<D>(to, w_ih), cast<D>(to, w_hh),
                        cast<D>(to, b_ih), cast<D>(to, b_hh), mode);
}

template <DeviceType D>
void register_kernels(torch::Library& m) {
  m.impl("linear", &linear<D>);
  m.impl("conv", &conv<D>);
  m.impl("conv_transpose", &conv_transpose<D>);
  m.impl("prelu", &prelu<D>);
  m.impl("attention", &attention<D>);
  m.impl("small_attention", &small_attention<D>);  // off the CPU the kernel is SDPA: as attention
  m.impl("batch_norm", &batch_norm<D>);
  m.impl("instance_norm", &instance_norm<D>);
  m.impl("group_norm", &group_norm<D>);
  m.impl("group_norm_nfirst", &nfirst_group_norm<D, &wide::group_norm_nfirst>);
  m.impl("fused_group_norm", &nfirst_group_norm<D, &wide::fused_group_norm>);
  m.impl("layer_norm", &layer_norm<D>);
  m.impl("rms_norm", &rms_norm<D>);
  m.impl("add_layer_norm", &add_layer_norm<D>);
  m.impl("fused_norm", &fused_norm<D>);
  m.impl("rnn", &rnn<D>);
  m.impl("rnn_cell", &rnn_cell<D>);
}

}  // namespace
}  // namespace wide::autocast

TORCH_LIBRARY_IMPL(wide, AutocastCPU, m) {
  wide::autocast::register_kernels<c10::DeviceType::CPU>(m);
}

TORCH_LIBRARY_IMPL(wide, AutocastCUDA, m) {
  wide::autocast::register_kernels<c10::DeviceType::CUDA>(m);
}
