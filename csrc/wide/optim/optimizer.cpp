// wide::optim::Adam / SGD: the C++ per-member optimizers (see optimizer.h). The update itself is
// the fused op (wide::adam_step / wide::sgd_step through the dispatcher); this file holds the
// bookkeeping torch::optim would: hyperparameters as [N] float64 tensors, lazily created state,
// member-level get/set/copy.
#include "wide/optim/optimizer.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/core/DefaultDtype.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <utility>

#include "wide/optim/optim.h"

namespace wide::optim {
namespace {

bool positive_or_zero(double v) { return v >= 0; }
bool in_unit(double v) { return v >= 0 && v < 1; }
bool any_value(double v) { return !std::isnan(v); }

at::Tensor zeros_state(const at::Tensor& p) {
  return at::zeros_like(p, at::MemoryFormat::Contiguous);
}

}  // namespace

WideOptimizer::WideOptimizer(std::vector<at::Tensor> params, const char* name)
    : name_(name), params_(std::move(params)) {
  TORCH_CHECK(!params_.empty(), name_, ": got an empty parameter list");
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i];
    TORCH_CHECK(p.defined() && p.dim() >= 1, name_, ": parameter ", i, " must be a stacked [N, ...] "
                "tensor (member k = slice [k]), got ", p.defined() ? p.sizes() : c10::IntArrayRef{});
    if (i == 0) n_ = p.size(0);
    TORCH_CHECK(p.size(0) == n_, name_, ": parameter ", i, " holds ", p.size(0),
                " members; parameter 0 holds ", n_, " (every parameter must be [N, ...])");
  }
  state_.resize(params_.size());
}

void WideOptimizer::add_hyperparameter(const std::string& name, const PerMember& values,
                                       bool (*valid)(double), const char* rule) {
  const auto count = static_cast<int64_t>(values.size());
  TORCH_CHECK(count == 1 || count == n_, name_, ": ", name, " needs one value or one per member (",
              n_, "), got ", count);
  at::Tensor t = at::empty({n_}, at::TensorOptions().dtype(at::kDouble));
  for (int64_t k = 0; k < n_; ++k) {
    const double v = values[count == 1 ? 0 : k];
    TORCH_CHECK(valid(v), name_, ": member ", k, " has ", name, " = ", v, "; expected ", rule);
    t.mutable_data_ptr<double>()[k] = v;
  }
  hparams_[name] = t;
  rules_[name] = {valid, rule};
}

int64_t WideOptimizer::member_index(int64_t member, const char* what) const {
  TORCH_CHECK(member >= -n_ && member < n_, name_, ": ", what, " index ", member,
              " out of range for ", n_, " members");
  return member < 0 ? member + n_ : member;
}

const at::Tensor& WideOptimizer::hyperparameter(std::string_view name) const {
  auto it = hparams_.find(name);
  if (it == hparams_.end()) {
    std::string known;
    for (const auto& [k, v] : hparams_) known += (known.empty() ? "" : ", ") + k;
    TORCH_CHECK(false, name_, ": no hyperparameter '", name, "' (it has ", known, ")");
  }
  return it->second;
}

double WideOptimizer::get(std::string_view name, int64_t member) const {
  return hyperparameter(name).const_data_ptr<double>()[member_index(member, "member")];
}

void WideOptimizer::set(std::string_view name, int64_t member, double value) {
  const at::Tensor& t = hyperparameter(name);
  const auto& [valid, rule] = rules_.find(name)->second;
  const int64_t k = member_index(member, "member");
  TORCH_CHECK(valid(value), name_, ": member ", k, " has ", name, " = ", value, "; expected ", rule);
  t.mutable_data_ptr<double>()[k] = value;
}

void WideOptimizer::zero_grad(bool set_to_none) {
  for (const at::Tensor& p : params_) {
    at::Tensor& g = p.mutable_grad();  // the grad slot itself (a const method in ATen)
    if (!g.defined()) continue;
    if (set_to_none) {
      g.reset();
    } else {
      g = g.detach();
      g.zero_();
    }
  }
}

void WideOptimizer::copy_member(int64_t src, int64_t dst) {
  src = member_index(src, "src");
  dst = member_index(dst, "dst");
  for (auto& [name, t] : hparams_) {
    double* v = t.mutable_data_ptr<double>();
    v[dst] = v[src];
  }
  for (auto& state : state_) {
    for (auto& [name, t] : state) t.select(0, dst).copy_(t.select(0, src));
  }
}

// -- Adam ------------------------------------------------------------------------------------------

Adam::Adam(std::vector<at::Tensor> params, AdamOptions options)
    : WithOptions(std::move(params), "wide::optim::Adam", std::move(options)) {
  add_hyperparameter("lr", options_.lr_, positive_or_zero, ">= 0");
  add_hyperparameter("beta1", options_.beta1_, in_unit, "0 <= beta1 < 1");
  add_hyperparameter("beta2", options_.beta2_, in_unit, "0 <= beta2 < 1");
  add_hyperparameter("eps", options_.eps_, positive_or_zero, ">= 0");
  add_hyperparameter("weight_decay", options_.weight_decay_, positive_or_zero, ">= 0");
}

void Adam::step() {
  // torch.optim keeps `step` in float32 (float64 when that is the default dtype).
  const auto step_dtype = c10::get_default_dtype_as_scalartype() == at::kDouble ? at::kDouble : at::kFloat;
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i];
    if (!p.grad().defined()) continue;
    auto& s = state_[i];
    if (s.empty()) {
      s["step"] = at::zeros({n_}, at::TensorOptions().dtype(step_dtype));
      s["exp_avg"] = zeros_state(p);
      s["exp_avg_sq"] = zeros_state(p);
      if (options_.amsgrad_) s["max_exp_avg_sq"] = zeros_state(p);
    }
    std::optional<at::Tensor> max_sq;
    if (options_.amsgrad_) max_sq = s["max_exp_avg_sq"];
    wide::adam_step(p, p.grad(), s["exp_avg"], s["exp_avg_sq"], max_sq, s["step"],
                    hparams_.at("lr"), hparams_.at("beta1"), hparams_.at("beta2"),
                    hparams_.at("eps"), hparams_.at("weight_decay"),
                    options_.decoupled_weight_decay_, options_.amsgrad_, options_.maximize_);
  }
}

// -- SGD -------------------------------------------------------------------------------------------

SGD::SGD(std::vector<at::Tensor> params, SGDOptions options)
    : WithOptions(std::move(params), "wide::optim::SGD", std::move(options)) {
  add_hyperparameter("lr", options_.lr_, positive_or_zero, ">= 0");
  add_hyperparameter("momentum", options_.momentum_, positive_or_zero, ">= 0");
  add_hyperparameter("dampening", options_.dampening_, any_value, "a number");
  add_hyperparameter("weight_decay", options_.weight_decay_, positive_or_zero, ">= 0");
  if (options_.nesterov_) {
    const double* m = hparams_.at("momentum").const_data_ptr<double>();
    const double* d = hparams_.at("dampening").const_data_ptr<double>();
    for (int64_t k = 0; k < n_; ++k) {
      TORCH_CHECK(m[k] > 0 && d[k] == 0, name_, ": nesterov momentum requires momentum > 0 and "
                  "dampening == 0 for every member; member ", k, " has momentum ", m[k],
                  " and dampening ", d[k]);
    }
  }
}

void SGD::step() {
  const double* m = hparams_.at("momentum").const_data_ptr<double>();
  bool any_momentum = false;
  for (int64_t k = 0; k < n_; ++k) any_momentum = any_momentum || m[k] != 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i];
    if (!p.grad().defined()) continue;
    std::optional<at::Tensor> buf;
    bool init = false;
    if (any_momentum) {  // like torch.optim: no state without momentum
      auto& s = state_[i];
      init = !s.count("momentum_buffer");
      if (init) s["momentum_buffer"] = zeros_state(p);
      buf = s["momentum_buffer"];
    }
    wide::sgd_step(p, p.grad(), buf, hparams_.at("lr"), hparams_.at("weight_decay"),
                   hparams_.at("momentum"), hparams_.at("dampening"), options_.nesterov_,
                   options_.maximize_, init);
  }
}

}  // namespace wide::optim
