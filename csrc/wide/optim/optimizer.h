// wide::optim::Adam / SGD: per-member optimizers for C++ training of wide modules (wide::nn).
// Every parameter is stacked [N, ...] (member k = slice [k]) and every hyperparameter has one
// value per member; step() runs one fused wide::adam_step / wide::sgd_step per parameter, exactly
// as torch::optim would update each member alone with that member's hyperparameters.
//
//   auto wide = wide::nn::from_modules(members);
//   wide::optim::Adam opt(wide->parameters(), wide::optim::AdamOptions().lr({1e-3, 3e-3, 1e-2}));
//   loss.backward(); opt.step(); opt.zero_grad();
//   opt.set("lr", /*member=*/2, 5e-3);           // PBT explore
//   wide->...; opt.copy_member(/*src=*/0, /*dst=*/2);  // PBT exploit (with the module's copy)
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace wide::optim {

/// One hyperparameter: a single value shared by all members ({v}) or one value per member.
using PerMember = std::vector<double>;

/// Adam / AdamW (decoupled_weight_decay) hyperparameters, per member; defaults as torch::optim.
struct AdamOptions {
  PerMember lr_{1e-3}, beta1_{0.9}, beta2_{0.999}, eps_{1e-8}, weight_decay_{0.0};
  bool amsgrad_ = false, maximize_ = false, decoupled_weight_decay_ = false;

  AdamOptions& lr(PerMember v) { lr_ = std::move(v); return *this; }
  AdamOptions& betas(PerMember b1, PerMember b2) { beta1_ = std::move(b1); beta2_ = std::move(b2); return *this; }
  AdamOptions& eps(PerMember v) { eps_ = std::move(v); return *this; }
  AdamOptions& weight_decay(PerMember v) { weight_decay_ = std::move(v); return *this; }
  AdamOptions& amsgrad(bool v) { amsgrad_ = v; return *this; }
  AdamOptions& maximize(bool v) { maximize_ = v; return *this; }
  /// AdamW: param *= 1 - lr * weight_decay instead of adding weight_decay * param to the gradient.
  AdamOptions& decoupled_weight_decay(bool v) { decoupled_weight_decay_ = v; return *this; }
};

/// SGD hyperparameters, per member; defaults as torch::optim (lr has no default there: 1e-2 here).
struct SGDOptions {
  PerMember lr_{1e-2}, momentum_{0.0}, dampening_{0.0}, weight_decay_{0.0};
  bool nesterov_ = false, maximize_ = false;

  SGDOptions& lr(PerMember v) { lr_ = std::move(v); return *this; }
  SGDOptions& momentum(PerMember v) { momentum_ = std::move(v); return *this; }
  SGDOptions& dampening(PerMember v) { dampening_ = std::move(v); return *this; }
  SGDOptions& weight_decay(PerMember v) { weight_decay_ = std::move(v); return *this; }
  SGDOptions& nesterov(bool v) { nesterov_ = v; return *this; }
  SGDOptions& maximize(bool v) { maximize_ = v; return *this; }
};

/// What the per-member optimizers share: the stacked parameters, the [N] float64 hyperparameter
/// tensors and the per-parameter state, with member-level access for population-based training.
class WideOptimizer {
 public:
  virtual ~WideOptimizer() = default;
  /// One update of every member (parameters without a gradient are skipped, as torch::optim does).
  virtual void step() = 0;
  /// Clears the gradients (set to undefined, or zeroed when set_to_none is false).
  void zero_grad(bool set_to_none = true);
  /// Number of members.
  int64_t n() const { return n_; }
  const std::vector<at::Tensor>& params() const { return params_; }
  /// Member `member`'s value of hyperparameter `name` ("lr", "beta1", "momentum", ...).
  double get(std::string_view name, int64_t member) const;
  /// Sets member `member`'s value of hyperparameter `name` (checked like the constructor).
  void set(std::string_view name, int64_t member, double value);
  /// The [N] float64 tensor of one hyperparameter (read-only view of every member's value).
  const at::Tensor& hyperparameter(std::string_view name) const;
  /// Per-parameter state tensors ("exp_avg", "step", "momentum_buffer", ...) of parameter p.
  const std::map<std::string, at::Tensor>& state(size_t p) const { return state_.at(p); }
  /// Member dst takes member src's optimizer state and hyperparameters (PBT "exploit").
  void copy_member(int64_t src, int64_t dst);

 protected:
  WideOptimizer(std::vector<at::Tensor> params, const char* name);
  void add_hyperparameter(const std::string& name, const PerMember& values, bool (*valid)(double),
                          const char* rule);
  int64_t member_index(int64_t member, const char* what) const;

  const char* name_;
  int64_t n_ = 0;
  std::vector<at::Tensor> params_;
  std::map<std::string, at::Tensor, std::less<>> hparams_;
  std::map<std::string, std::pair<bool (*)(double), const char*>, std::less<>> rules_;
  std::vector<std::map<std::string, at::Tensor>> state_;
};

namespace detail {

/// A WideOptimizer configured by an options struct (AdamOptions, SGDOptions), which it keeps.
template <typename Options>
class WithOptions : public WideOptimizer {
 public:
  const Options& options() const { return options_; }

 protected:
  WithOptions(std::vector<at::Tensor> params, const char* name, Options options)
      : WideOptimizer(std::move(params), name), options_(std::move(options)) {}

  Options options_;
};

}  // namespace detail

/// Per-member Adam / AdamW (see AdamOptions).
class Adam : public detail::WithOptions<AdamOptions> {
 public:
  Adam(std::vector<at::Tensor> params, AdamOptions options = {});
  void step() override;
};

/// Per-member SGD with momentum, dampening, Nesterov and weight decay (see SGDOptions).
class SGD : public detail::WithOptions<SGDOptions> {
 public:
  SGD(std::vector<at::Tensor> params, SGDOptions options = {});
  void step() override;
};

}  // namespace wide::optim
