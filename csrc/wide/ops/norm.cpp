#include "wide/ops/norm.h"

#include "wide/ops/call_op.h"
#include "wide/ops/layout.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/batch_norm.h>
#include <ATen/ops/group_norm.h>
#include <ATen/ops/instance_norm.h>
#include <ATen/ops/layer_norm.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/addcmul.h>
#include <ATen/ops/rms_norm.h>
#include <torch/library.h>

#include <string>
#include <vector>

// Note [wide norms]
// -----------------
// BatchNorm, InstanceNorm and GroupNorm act per channel (or per group of adjacent channels), so
// on the channel-packed layout [B, N*C, *] (Note [wide layouts]) N members are ONE ATen call with
// the [N, C] parameters and running statistics viewed as [N*C]: channel i*C+c is member i's
// channel c, and GroupNorm uses N*num_groups groups (member i's groups are the i-th block).
// Batch statistics are taken over (B, *) per channel, i.e. per member, exactly as each member
// alone. Running statistics are updated IN PLACE through the [N*C] view (the schemas mark them
// mutable), so the caller's [N, C] buffers are the members' buffers; a non-contiguous buffer is
// updated through a contiguous copy written back. momentum is one float for all members: it is
// a module hyperparameter, equal across members by the architecture check.
//
// InstanceNorm with instance statistics and no running statistics (nn.InstanceNorm*d's default)
// runs on CPU as ATen's GroupNorm with one group per channel: the same statistics (mean and
// biased variance over the spatial dims of each sample and channel) and affine. ATen's CPU
// instance_norm is a batch_norm over a [1, B*C, *] view, 6x slower than its group_norm on a
// [8, 512, 32, 32] activation in inference (2.7 against 0.44 ms) and 1.4x slower forward and
// backward (6.3 against 4.5 ms); the values agree to float rounding (2e-6 there).
//
// LayerNorm and RMSNorm normalise each member's trailing dims, which the N-first layout already
// exposes, so they run N-first: one ATen norm without affine, then the member's weight/bias
// broadcast as [N, 1, ..., *normalized_shape]: one more pass over the activation than a fused
// kernel, so when no gradient is wanted they take wide::fused_norm (Note [wide::fused_norm]).

namespace wide {
namespace {

// An affine parameter [N, C] as a contiguous [N*C] (a copy only if it is strided: ATen's CPU
// batch_norm backward gets the input gradient wrong for a non-contiguous weight), or none.
std::optional<at::Tensor> flat(const std::optional<at::Tensor>& t) {
  if (!t.has_value()) return std::nullopt;
  return t->reshape_symint({t->sym_numel()}).contiguous();
}

void check_param(const char* op, const char* what, const std::optional<at::Tensor>& t,
                 const at::Tensor& input) {
  if (!t.has_value()) return;
  TORCH_CHECK(t->dim() == 2, "wide::", op, ": expected ", what, " of shape [N, C], got ",
              t->sym_sizes());
  TORCH_CHECK(t->device() == input.device(), "wide::", op, ": expected ", what, " on ",
              input.device(), ", got ", t->device());
}

// The member count and channels the [N, C] tensors agree on (-1 when there are none), checked
// against the input.
void check_channels(const char* op, const at::Tensor& x_packed,
                    std::initializer_list<const std::optional<at::Tensor>*> params,
                    const at::Tensor& input, bool packed_input) {
  for (const auto* p : params) {
    if (!p->has_value()) continue;
    const at::Tensor& t = **p;
    TORCH_CHECK(x_packed.sym_size(1) == t.sym_numel(), "wide::", op, ": input has ",
                x_packed.sym_size(1), " packed channels (N*C) but a [N, C] parameter/buffer is ",
                t.sym_sizes(), " (input ", input.sym_sizes(), packed_input ? ", packed)" : ", N-first)");
    if (!packed_input) {
      TORCH_CHECK(input.sym_size(0) == t.sym_size(0), "wide::", op, ": input has ",
                  input.sym_size(0), " members (dim 0) but a parameter/buffer has ", t.sym_size(0));
    }
  }
}

// Runs fn(mean, var) with [N*C] running stats that write through to the caller's [N, C] buffers
// (Note [wide norms]): views of them, or, when not contiguous or when `updated` (batch statistics
// used), copies written back with copy_ after. The copy_ bumps the buffers' version counters as
// torch's BatchNorm bumps them (ATen's kernel writes the running stats without a bump), and the eval
// fold cache (python/wide_compiler/fx/fold.py, Note [The fold cache]) tells changed statistics by
// their versions; the copies, not views of the buffers, are what autograd saves for the backward,
// so the bump does not fail its check that saved tensors are unchanged.
template <typename Fn>
at::Tensor with_running_stats(const std::optional<at::Tensor>& rm, const std::optional<at::Tensor>& rv,
                              bool updated, Fn&& fn) {
  auto view_of = [updated](const std::optional<at::Tensor>& t) -> std::optional<at::Tensor> {
    if (!t.has_value()) return std::nullopt;
    return t->is_contiguous() && !updated ? t->view_symint({t->sym_numel()})
                                          : t->reshape_symint({t->sym_numel()}).clone();
  };
  std::optional<at::Tensor> m = view_of(rm), v = view_of(rv);
  at::Tensor out = fn(m, v);
  const at::NoGradGuard no_grad;
  if (rm.has_value() && (updated || !rm->is_contiguous())) rm->copy_(m->view_symint(rm->sym_sizes()));
  if (rv.has_value() && (updated || !rv->is_contiguous())) rv->copy_(v->view_symint(rv->sym_sizes()));
  return out;
}

// ATen 2.13's CPU group_norm backward crashes (a segmentation fault) for a channels-last input
// when the weight or bias gradient is wanted and the input's is not (known only in the backward:
// torch.autograd.grad of the parameters alone, or an input that needs none), so a
// non-contiguous input is made contiguous whenever a parameter gradient may be asked for.
at::Tensor group_norm_input(const at::Tensor& x, const std::optional<at::Tensor>& w,
                            const std::optional<at::Tensor>& b) {
  const bool params = (w.has_value() && w->requires_grad()) || (b.has_value() && b->requires_grad());
  if (at::GradMode::is_enabled() && params && x.device().is_cpu() && !x.is_contiguous()) {
    return x.contiguous();
  }
  return x;
}

// The body of batch_norm and instance_norm: checks, the packed input and [N*C] views of the
// running stats around `norm(x, weight, bias, running_mean, running_var)`, the ATen norm.
// `use_batch_stats` is training / use_input_stats; without it running stats are required
// (`without_batch_stats` says when, for the message).
template <typename Norm>
at::Tensor stat_norm(const char* op, int64_t min_spatial, const char* without_batch_stats,
                     const at::Tensor& input, const std::optional<at::Tensor>& weight,
                     const std::optional<at::Tensor>& bias,
                     const std::optional<at::Tensor>& running_mean,
                     const std::optional<at::Tensor>& running_var, bool use_batch_stats,
                     bool packed_input, Norm&& norm) {
  const int64_t lead = packed_input ? 2 : 3;
  TORCH_CHECK(input.dim() >= lead + min_spatial && input.dim() <= lead + 3, "wide::", op,
              ": expected ", packed_input ? "a packed input [B, N*C, *]" : "an N-first input [N, B, C, *]",
              " with ", min_spatial, " to 3 spatial dims, got ", input.sym_sizes());
  for (auto [what, t] : {std::pair{"weight", &weight}, {"bias", &bias}, {"running_mean", &running_mean},
                         {"running_var", &running_var}}) {
    check_param(op, what, *t, input);
  }
  TORCH_CHECK(running_mean.has_value() == running_var.has_value(), "wide::", op, ": expected "
              "both running_mean and running_var or neither");
  TORCH_CHECK(use_batch_stats || running_mean.has_value(), "wide::", op, ": expected running "
              "stats ", without_batch_stats, ", got none");
  const at::Tensor x = packed_input ? input : detail::to_packed(input);
  check_channels(op, x, {&weight, &bias, &running_mean, &running_var}, input, packed_input);
  return with_running_stats(running_mean, running_var, use_batch_stats, [&](auto& m, auto& v) {
    return norm(x, flat(weight), flat(bias), m, v);
  });
}

// PyTorch's run-time check of a norm in training (F.batch_norm / instance_norm / group_norm):
// with one value to normalise, the output is 0 and the running variance NaN, so it raises.
void check_values(const char* op, const c10::SymInt& values, const at::Tensor& input, const char* what) {
  TORCH_CHECK(values != 1, "wide::", op, ": expected more than 1 ", what, " (as PyTorch checks), got ",
              "input size ", input.sym_sizes(), "; a member would be normalised to 0 and its running "
              "statistics set to NaN");
}

at::Tensor batch_norm_impl(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                           const std::optional<at::Tensor>& bias,
                           const std::optional<at::Tensor>& running_mean,
                           const std::optional<at::Tensor>& running_var, bool training,
                           double momentum, double eps, bool packed_input) {
  return stat_norm("batch_norm", 0, "in eval mode (training=False)", input, weight, bias,
                   running_mean, running_var, training, packed_input,
                   [&](const at::Tensor& x, const auto& w, const auto& b, auto& m, auto& v) {
                     if (training) {
                       check_values("batch_norm", x.sym_numel() / x.sym_size(1), input,
                                    "value per channel when training");
                     }
                     if (training && detail::takes_fused_batch_norm(x, w, b)) {  // Note [Batch norm training kernel]
                       auto [y, mean, invstd, var] = fused_batch_norm(x, w, b, eps);
                       if (m.has_value()) {  // as ATen: (1 - momentum) * running + momentum * batch
                         const at::NoGradGuard no_grad;
                         m->mul_(1 - momentum).add_(mean, momentum);
                         v->mul_(1 - momentum).add_(var, momentum);
                       }
                       return y;
                     }
                     // CUDA's backward (cuDNN's and ATen's) fails on a bias without a weight ('tensor
                     // does not have a device', torch 2.11 on an H200): a weight of ones is the same norm
                     if (!w.has_value() && b.has_value() && !x.device().is_cpu()) {
                       return at::batch_norm(x, at::ones_like(*b), b, m, v, training, momentum, eps, false);
                     }
                     return at::batch_norm(x, w, b, m, v, training, momentum, eps, false);
                   });
}

at::Tensor instance_norm_impl(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                              const std::optional<at::Tensor>& bias,
                              const std::optional<at::Tensor>& running_mean,
                              const std::optional<at::Tensor>& running_var, bool use_input_stats,
                              double momentum, double eps, bool packed_input) {
  return stat_norm("instance_norm", 1, "when use_input_stats=False", input, weight, bias,
                   running_mean, running_var, use_input_stats, packed_input,
                   [&](const at::Tensor& x, const auto& w, const auto& b, auto& m, auto& v) {
                     if (use_input_stats) {
                       check_values("instance_norm", x.sym_numel() / (x.sym_size(0) * x.sym_size(1)), input,
                                    "spatial element when training");
                     }
                     const auto channels = x.sym_size(1).maybe_as_int();
                     // (not for a bias without a weight: ATen 2.13's CPU group_norm backward fails on it)
                     if (use_input_stats && !m.has_value() && x.device().is_cpu() && channels.has_value() &&
                         (w.has_value() || !b.has_value())) {
                       return at::group_norm(group_norm_input(x, w, b), *channels, w, b, eps, false);  // Note [wide norms]
                     }
                     return at::instance_norm(x, w, b, m, v, use_input_stats, momentum, eps, false);
                   });
}

at::Tensor group_norm_impl(const at::Tensor& input, int64_t n, int64_t num_groups,
                           const std::optional<at::Tensor>& weight,
                           const std::optional<at::Tensor>& bias, double eps, bool packed_input) {
  TORCH_CHECK(n >= 1 && num_groups >= 1, "wide::group_norm: expected n >= 1 and num_groups >= 1, "
              "got n=", n, ", num_groups=", num_groups);
  TORCH_CHECK(input.dim() >= (packed_input ? 2 : 3), "wide::group_norm: expected ",
              packed_input ? "a packed input [B, N*C, *]" : "an N-first input [N, B, C, *]", ", got ",
              input.sym_sizes());
  check_param("group_norm", "weight", weight, input);
  check_param("group_norm", "bias", bias, input);
  if (!packed_input) {
    TORCH_CHECK(input.sym_size(0) == n, "wide::group_norm: input has ", input.sym_size(0),
                " members (dim 0), expected n=", n);
  }
  const at::Tensor x = packed_input ? input : detail::to_packed(input);
  TORCH_CHECK(x.sym_size(1) % (n * num_groups) == 0, "wide::group_norm: expected the ",
              x.sym_size(1) / n, " channels per member to be divisible by num_groups=", num_groups);
  check_channels("group_norm", x, {&weight, &bias}, input, packed_input);
  check_values("group_norm", x.sym_numel() / (n * num_groups), input, "value per channel");
  const auto w = flat(weight), b = flat(bias);
  return at::group_norm(group_norm_input(x, w, b), n * num_groups, w, b, eps, false);
}

// GroupNorm between N-first ops: no layout change when no gradient is wanted (Note [N-first
// group norm kernel]); the packed op with autograd otherwise.
at::Tensor group_norm_nfirst_impl(const at::Tensor& input, int64_t num_groups,
                                  const std::optional<at::Tensor>& weight,
                                  const std::optional<at::Tensor>& bias, double eps) {
  TORCH_CHECK(input.dim() >= 3 && num_groups >= 1, "wide::group_norm_nfirst: expected an N-first "
              "input [N, B, C, *] and num_groups >= 1, got ", input.sym_sizes(), " and ", num_groups);
  // (size(0) would read every size as an int, fixing a symbolic batch under export)
  const int64_t n = input.sym_size(0).guard_int(__FILE__, __LINE__);
  check_values("group_norm", input.sym_numel() / (n * num_groups), input, "value per channel");
  if (auto y = detail::maybe_fused_group_norm(input, num_groups, weight, bias, eps)) return *y;
  return to_nfirst(group_norm(input, n, num_groups, weight, bias, eps, false), n);
}

// [N, *ns] -> [N, 1, ..., 1, *ns] broadcasting against an N-first [N, *lead, *ns] input.
at::Tensor broadcastable(const at::Tensor& p, const at::Tensor& input, int64_t k) {
  std::vector<c10::SymInt> sizes;
  sizes.push_back(p.sym_size(0));
  for (int64_t d = 1; d < input.dim() - k; ++d) sizes.push_back(1);
  for (int64_t d = 1; d < p.dim(); ++d) sizes.push_back(p.sym_size(d));
  return p.view_symint(sizes);
}

void check_affine(const char* op, const char* what, const std::optional<at::Tensor>& p,
                  const at::Tensor& input, c10::SymIntArrayRef ns) {
  if (!p.has_value()) return;
  bool ok = p->dim() == static_cast<int64_t>(ns.size()) + 1 && p->sym_size(0) == input.sym_size(0);
  for (size_t d = 0; ok && d < ns.size(); ++d) ok = p->sym_size(d + 1) == ns[d];
  TORCH_CHECK(ok, "wide::", op, ": expected ", what, " of shape [N, *normalized_shape] = [",
              input.sym_size(0), ", ", ns, "], got ", p->sym_sizes());
}

void check_trailing(const char* op, const at::Tensor& input, c10::SymIntArrayRef ns) {
  const int64_t k = static_cast<int64_t>(ns.size());
  bool ok = k >= 1 && input.dim() >= k + 1;
  for (int64_t d = 0; ok && d < k; ++d) ok = input.sym_size(input.dim() - k + d) == ns[d];
  TORCH_CHECK(ok, "wide::", op, ": expected an N-first input [N, *, ", ns, "], got ",
              input.sym_sizes());
}

at::Tensor layer_norm_impl(const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                           const std::optional<at::Tensor>& weight,
                           const std::optional<at::Tensor>& bias, double eps,
                           std::string_view strategy) {
  TORCH_CHECK(strategy == "auto" || strategy == "fused" || strategy == "loop", "wide::layer_norm: "
              "expected strategy 'auto', 'fused' or 'loop', got '", std::string(strategy), "'");
  check_trailing("layer_norm", input, normalized_shape);
  check_affine("layer_norm", "weight", weight, input, normalized_shape);
  check_affine("layer_norm", "bias", bias, input, normalized_shape);
  if (strategy == "loop") {
    // N ATen layer norms: each applies its member's affine inside the norm kernel, and each
    // member's slice stays in cache (measured 2-5x faster than "fused" on large activations).
    const std::vector<at::Tensor> xs = input.unbind(0);
    const std::vector<at::Tensor> ws = weight.has_value() ? weight->unbind(0) : std::vector<at::Tensor>{};
    const std::vector<at::Tensor> bs = bias.has_value() ? bias->unbind(0) : std::vector<at::Tensor>{};
    std::vector<at::Tensor> outs;
    outs.reserve(xs.size());
    for (size_t k = 0; k < xs.size(); ++k) {
      outs.push_back(at::layer_norm_symint(
          xs[k], normalized_shape, ws.empty() ? std::nullopt : std::optional<at::Tensor>(ws[k]),
          bs.empty() ? std::nullopt : std::optional<at::Tensor>(bs[k]), eps, false));
    }
    return at::stack(outs);
  }
  if (auto y = detail::maybe_fused_norm(input, normalized_shape, weight, bias, eps, /*rms=*/false)) {
    return *y;  // no gradient wanted: one pass (Note [wide::fused_norm])
  }
  const int64_t k = static_cast<int64_t>(normalized_shape.size());
  at::Tensor y = at::layer_norm_symint(input, normalized_shape, std::nullopt, std::nullopt, eps, false);
  if (weight.has_value() && bias.has_value()) {  // one pass for the affine
    return at::addcmul(broadcastable(*bias, input, k), y, broadcastable(*weight, input, k));
  }
  if (weight.has_value()) y = y.mul(broadcastable(*weight, input, k));
  if (bias.has_value()) y = y.add(broadcastable(*bias, input, k));
  return y;
}

at::Tensor rms_norm_impl(const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                         const std::optional<at::Tensor>& weight, std::optional<double> eps) {
  check_trailing("rms_norm", input, normalized_shape);
  check_affine("rms_norm", "weight", weight, input, normalized_shape);
  if (auto y = detail::maybe_fused_norm(input, normalized_shape, weight, std::nullopt, eps, /*rms=*/true)) {
    return *y;  // no gradient wanted: one pass (Note [wide::fused_norm])
  }
  const int64_t k = static_cast<int64_t>(normalized_shape.size());
  at::Tensor y = at::rms_norm_symint(input, normalized_shape, std::nullopt, eps);
  if (weight.has_value()) y = y.mul(broadcastable(*weight, input, k));
  return y;
}

} // namespace

at::Tensor batch_norm(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                      const std::optional<at::Tensor>& bias,
                      const std::optional<at::Tensor>& running_mean,
                      const std::optional<at::Tensor>& running_var, bool training,
                      double momentum, double eps, bool packed_input) {
  return detail::call_op<"wide::batch_norm", decltype(batch_norm)>(
      input, weight, bias, running_mean, running_var, training, momentum, eps, packed_input);
}

at::Tensor instance_norm(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                         const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& running_mean,
                         const std::optional<at::Tensor>& running_var, bool use_input_stats,
                         double momentum, double eps, bool packed_input) {
  return detail::call_op<"wide::instance_norm", decltype(instance_norm)>(
      input, weight, bias, running_mean, running_var, use_input_stats, momentum, eps, packed_input);
}

at::Tensor group_norm(const at::Tensor& input, int64_t n, int64_t num_groups,
                      const std::optional<at::Tensor>& weight,
                      const std::optional<at::Tensor>& bias, double eps, bool packed_input) {
  return detail::call_op<"wide::group_norm", decltype(group_norm)>(
      input, n, num_groups, weight, bias, eps, packed_input);
}

at::Tensor group_norm_nfirst(const at::Tensor& input, int64_t num_groups,
                             const std::optional<at::Tensor>& weight,
                             const std::optional<at::Tensor>& bias, double eps) {
  return detail::call_op<"wide::group_norm_nfirst", decltype(group_norm_nfirst)>(
      input, num_groups, weight, bias, eps);
}

at::Tensor layer_norm(const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                      const std::optional<at::Tensor>& weight,
                      const std::optional<at::Tensor>& bias, double eps, std::string_view strategy) {
  return detail::call_op<"wide::layer_norm", decltype(layer_norm)>(
      input, normalized_shape, weight, bias, eps, strategy);
}

at::Tensor rms_norm(const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                    const std::optional<at::Tensor>& weight, std::optional<double> eps) {
  return detail::call_op<"wide::rms_norm", decltype(rms_norm)>(
      input, normalized_shape, weight, eps);
}

} // namespace wide

TORCH_LIBRARY_IMPL(wide, CompositeImplicitAutograd, m) {
  m.impl("batch_norm", &wide::batch_norm_impl);
  m.impl("instance_norm", &wide::instance_norm_impl);
  m.impl("group_norm", &wide::group_norm_impl);
  m.impl("group_norm_nfirst", &wide::group_norm_nfirst_impl);
  m.impl("layer_norm", &wide::layer_norm_impl);
  m.impl("rms_norm", &wide::rms_norm_impl);
}
