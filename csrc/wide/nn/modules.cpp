// wide::nn modules: LibTorch C++ modules over the wide operators (see modules.h).
//
// Note [wide::nn modules]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A wide module registers, under each member module's own parameter and buffer names, one tensor
// [N, ...] holding all members (member i = slice [i]), exactly as the Python WideModel does, so
// named_parameters(), state_dict serialization, .to() and clone() work as on any LibTorch module
// and a per-member optimizer steps each stacked tensor once. reset() builds N fresh members with
// LibTorch's own initialisation and stacks them (a wide module starts where N separately built
// modules would); from_modules() copies given members in. Everything a member could differ in
// besides its values (options, shapes, dtype, device) is checked before anything is written, and
// the error names the member and what differs. Forward calls the public wide:: functions (through
// the dispatcher), converting the packed outputs of the conv/norm family back to N-first.
#include "wide/nn/modules.h"

#include <ATen/ops/stack.h>
#include <c10/util/Exception.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <sstream>
#include <string>
#include <utility>
#include <variant>

#include "wide/ops/conv.h"
#include "wide/ops/embedding.h"
#include "wide/ops/layout.h"
#include "wide/ops/linear.h"
#include "wide/ops/norm.h"
#include "wide/ops/rnn.h"

namespace wide::nn {
namespace detail {
namespace {

using Named = std::vector<std::pair<std::string, torch::Tensor>>;

// Parameters then buffers of a module (not recursing: every wide module is a leaf), in order.
Named tensors_of(const torch::nn::Module& m) {
  Named out;
  for (const auto& p : m.named_parameters(/*recurse=*/false)) out.emplace_back(p.key(), p.value());
  for (const auto& b : m.named_buffers(/*recurse=*/false)) out.emplace_back(b.key(), b.value());
  return out;
}

std::string names_of(const Named& named) {
  std::ostringstream s;
  for (const auto& [name, t] : named) s << (&name == &named.front().first ? "" : ", ") << name;
  return s.str();
}

}  // namespace

WideModuleBase::WideModuleBase(int64_t n) : n_(n) {
  TORCH_CHECK(n >= 1, "wide::nn: a wide module needs at least one member, got n=", n);
}

void WideModuleBase::stack_from(torch::nn::Module& self,
                                const std::vector<std::shared_ptr<torch::nn::Module>>& members) {
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(members.size()) == n_);
  std::vector<Named> all;
  for (const auto& m : members) all.push_back(tensors_of(*m));
  const auto params = members.front()->named_parameters(/*recurse=*/false);
  for (size_t k = 0; k < all.front().size(); ++k) {
    const auto& [name, t] = all.front()[k];
    std::vector<torch::Tensor> slices;
    for (const Named& named : all) slices.push_back(named.at(k).second);
    torch::NoGradGuard no_grad;
    torch::Tensor stacked = at::stack(slices);
    if (params.contains(name)) {
      self.register_parameter(name, stacked, t.requires_grad());
    } else {
      self.register_buffer(name, stacked);
    }
  }
}

void WideModuleBase::load_from(torch::nn::Module& self,
                               const std::vector<std::shared_ptr<torch::nn::Module>>& members,
                               const char* what) const {
  TORCH_CHECK(static_cast<int64_t>(members.size()) == n_, what, ": expected ", n_,
              " member modules, got ", members.size());
  const Named mine = tensors_of(self);
  for (size_t i = 0; i < members.size(); ++i) {
    TORCH_CHECK(members[i], what, ": member ", i, " is an empty module holder");
    const Named theirs = tensors_of(*members[i]);
    TORCH_CHECK(theirs.size() == mine.size(), what, ": member ", i, " has tensors (",
                names_of(theirs), "); expected (", names_of(mine), ")");
    for (size_t k = 0; k < mine.size(); ++k) {
      const auto& [name, stacked] = mine[k];
      const auto& [their_name, t] = theirs[k];
      TORCH_CHECK(their_name == name, what, ": member ", i, " has ", their_name, " where ", name,
                  " was expected");
      TORCH_CHECK(t.defined() && t.sizes() == stacked.sizes().slice(1), what, ": member ", i, " ",
                  name, " has shape ", t.defined() ? t.sizes() : c10::IntArrayRef{},
                  "; expected ", stacked.sizes().slice(1));
      TORCH_CHECK(t.scalar_type() == stacked.scalar_type() && t.device() == stacked.device(), what,
                  ": member ", i, " ", name, " is ", t.scalar_type(), " on ", t.device(),
                  "; the wide module holds ", stacked.scalar_type(), " on ", stacked.device(),
                  " (convert the members or the wide module with .to() first)");
    }
  }
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < members.size(); ++i) {
    const Named theirs = tensors_of(*members[i]);
    for (size_t k = 0; k < mine.size(); ++k) mine[k].second[i].copy_(theirs[k].second);
  }
}

void WideModuleBase::copy_out(const torch::nn::Module& self, torch::nn::Module& member, int64_t i) {
  const Named mine = tensors_of(self), theirs = tensors_of(member);
  TORCH_INTERNAL_ASSERT(mine.size() == theirs.size());
  torch::NoGradGuard no_grad;
  for (size_t k = 0; k < mine.size(); ++k) {
    theirs[k].second.set_data(mine[k].second[i].clone());
  }
}

void WideModuleBase::match_tensor_types(torch::nn::Module& self, const torch::nn::Module& member) {
  const Named mine = tensors_of(self), theirs = tensors_of(member);
  TORCH_INTERNAL_ASSERT(mine.size() == theirs.size());
  torch::NoGradGuard no_grad;
  for (size_t k = 0; k < mine.size(); ++k) {
    const torch::Tensor& t = theirs[k].second;
    if (t.defined()) mine[k].second.set_data(mine[k].second.to(t.device(), t.scalar_type()));
  }
}

}  // namespace detail

namespace {

// N fresh members built with the member module's own constructor (its initialisation).
template <typename Holder, typename Options>
std::vector<std::shared_ptr<torch::nn::Module>> fresh(int64_t n, const Options& options) {
  std::vector<std::shared_ptr<torch::nn::Module>> out;
  for (int64_t i = 0; i < n; ++i) out.push_back(Holder(options).ptr());
  return out;
}

// Every member of a from_modules() call must have the options of member 0; `same` compares them.
template <typename Holder, typename Same>
void check_same_options(const std::vector<Holder>& members, const char* what, Same same) {
  TORCH_CHECK(!members.empty(), what, ": from_modules needs at least one member module");
  for (size_t i = 0; i < members.size(); ++i) {
    TORCH_CHECK(!members[i].is_empty(), what, ": member ", i, " is an empty module holder");
    std::string why = same(members.front()->options, members[i]->options);
    TORCH_CHECK(why.empty(), what, ": member ", i, " differs from member 0 in ", why,
                "; every member must have the same architecture");
  }
}

template <typename T>
std::string differs(const char* name, const T& a, const T& b) {
  return a == b ? std::string() : std::string(name);
}

std::string first_of(std::initializer_list<std::string> whys) {
  for (const auto& w : whys) if (!w.empty()) return w;
  return {};
}

// The options a member was built with, as its wide module's constructor takes them.
template <typename Holder>
auto options_of(const Holder& m) { return m->options; }

torch::nn::Conv2dOptions options_of(const torch::nn::Conv2d& m) {
  const auto& o = m->options;  // ConvNdOptions<2>: the same fields
  return torch::nn::Conv2dOptions(o.in_channels(), o.out_channels(), o.kernel_size())
      .stride(o.stride()).padding(o.padding()).dilation(o.dilation()).groups(o.groups())
      .bias(o.bias()).padding_mode(o.padding_mode());
}

template <typename Wide, typename Holder>
Wide build(const std::vector<Holder>& members, bool training) {
  Wide wide(static_cast<int64_t>(members.size()), options_of(members.front()));
  detail::WideModuleBase::match_tensor_types(*wide, *members.front());
  wide->load_members(members);
  wide->train(training);
  return wide;
}

}  // namespace

// -- Linear ----------------------------------------------------------------------------------------

LinearImpl::LinearImpl(int64_t n, torch::nn::LinearOptions options_)
    : WideModule(n), options(std::move(options_)) {
  reset();  // NOLINT(clang-analyzer-optin.cplusplus.VirtualCall)
}

void LinearImpl::reset() {
  stack_from(*this, fresh<torch::nn::Linear>(n_, options));
  weight = named_parameters(false)["weight"];
  bias = options.bias() ? named_parameters(false)["bias"] : torch::Tensor();
}

torch::Tensor LinearImpl::forward(const torch::Tensor& input) {
  return wide::linear(input, weight, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt,
                      strategy);
}

void LinearImpl::pretty_print(std::ostream& stream) const {
  stream << "wide::nn::Linear(n=" << n_ << ", in_features=" << options.in_features()
         << ", out_features=" << options.out_features() << ", bias=" << std::boolalpha
         << options.bias() << ")";
}

Linear from_modules(const std::vector<torch::nn::Linear>& members) {
  check_same_options(members, LinearImpl::kName, [](const auto& a, const auto& b) {
    return first_of({differs("in_features", a.in_features(), b.in_features()),
                     differs("out_features", a.out_features(), b.out_features()),
                     differs("bias", a.bias(), b.bias())});
  });
  return build<Linear>(members, members.front()->is_training());
}

// -- Conv2d ----------------------------------------------------------------------------------------

namespace {

// The padding argument of wide::conv: one value per spatial dim, or (left, right) per dim in
// F.pad order (last dim first) for "same" padding whose total is odd.
template <typename Options>
std::vector<int64_t> conv_padding(const Options& o) {
  if (std::holds_alternative<torch::ExpandingArray<2>>(o.padding())) {
    const auto& p = std::get<torch::ExpandingArray<2>>(o.padding());
    return {(*p)[0], (*p)[1]};
  }
  if (std::holds_alternative<torch::enumtype::kValid>(o.padding())) return {0, 0};
  std::vector<int64_t> lr;  // kSame
  for (int d = 1; d >= 0; --d) {
    const int64_t total = (*o.dilation())[d] * ((*o.kernel_size())[d] - 1);
    lr.push_back(total / 2);
    lr.push_back(total - total / 2);
  }
  return lr;
}

template <typename Options>
std::string padding_repr(const Options& o) {
  std::ostringstream s;
  if (std::holds_alternative<torch::enumtype::kValid>(o.padding())) return "valid";
  if (std::holds_alternative<torch::enumtype::kSame>(o.padding())) return "same";
  s << std::get<torch::ExpandingArray<2>>(o.padding());
  return s.str();
}

}  // namespace

Conv2dImpl::Conv2dImpl(int64_t n, torch::nn::Conv2dOptions options_)
    : WideModule(n), options(std::move(options_)) {
  TORCH_CHECK(std::holds_alternative<torch::enumtype::kZeros>(options.padding_mode()),
              "wide::nn::Conv2d: only padding_mode zeros is supported, got ",
              torch::enumtype::get_enum_name(options.padding_mode()));
  reset();  // NOLINT(clang-analyzer-optin.cplusplus.VirtualCall)
}

void Conv2dImpl::reset() {
  stack_from(*this, fresh<torch::nn::Conv2d>(n_, options));
  weight = named_parameters(false)["weight"];
  bias = options.bias() ? named_parameters(false)["bias"] : torch::Tensor();
}

torch::Tensor Conv2dImpl::forward(const torch::Tensor& input) {
  TORCH_CHECK(input.dim() == 5 && input.size(0) == n_, "wide::nn::Conv2d: expected an N-first input [",
              n_, ", B, ", options.in_channels(), ", H, W], got ", input.sizes());
  const std::vector<int64_t> padding = conv_padding(options);
  const auto& k = options;
  at::Tensor packed = wide::conv(
      input, weight, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt,
      c10::fromIntArrayRefSlow(*k.stride()), c10::fromIntArrayRefSlow(padding),
      c10::fromIntArrayRefSlow(*k.dilation()), k.groups(), /*packed_input=*/false, strategy);
  return wide::to_nfirst(packed, n_);
}

void Conv2dImpl::pretty_print(std::ostream& stream) const {
  stream << "wide::nn::Conv2d(n=" << n_ << ", " << options.in_channels() << ", "
         << options.out_channels() << ", kernel_size=" << options.kernel_size()
         << ", stride=" << options.stride() << ", padding=" << padding_repr(options)
         << ", groups=" << options.groups() << ")";
}

Conv2d from_modules(const std::vector<torch::nn::Conv2d>& members) {
  check_same_options(members, Conv2dImpl::kName, [](const auto& a, const auto& b) {
    return first_of({differs("in_channels", a.in_channels(), b.in_channels()),
                     differs("out_channels", a.out_channels(), b.out_channels()),
                     differs("kernel_size", *a.kernel_size(), *b.kernel_size()),
                     differs("stride", *a.stride(), *b.stride()),
                     differs("padding", padding_repr(a), padding_repr(b)),
                     differs("dilation", *a.dilation(), *b.dilation()),
                     differs("groups", a.groups(), b.groups()),
                     differs("bias", a.bias(), b.bias()),
                     differs("padding_mode", a.padding_mode().index(), b.padding_mode().index())});
  });
  return build<Conv2d>(members, members.front()->is_training());
}

// -- BatchNorm2d -----------------------------------------------------------------------------------

BatchNorm2dImpl::BatchNorm2dImpl(int64_t n, torch::nn::BatchNormOptions options_)
    : WideModule(n), options(std::move(options_)) {
  TORCH_CHECK(options.momentum().has_value(), "wide::nn::BatchNorm2d: momentum=None (a cumulative "
              "moving average) is not supported; give a momentum");
  reset();  // NOLINT(clang-analyzer-optin.cplusplus.VirtualCall)
}

void BatchNorm2dImpl::reset() {
  stack_from(*this, fresh<torch::nn::BatchNorm2d>(n_, options));
  auto p = named_parameters(false);
  auto b = named_buffers(false);
  weight = options.affine() ? p["weight"] : torch::Tensor();
  bias = options.affine() ? p["bias"] : torch::Tensor();
  running_mean = options.track_running_stats() ? b["running_mean"] : torch::Tensor();
  running_var = options.track_running_stats() ? b["running_var"] : torch::Tensor();
  num_batches_tracked = options.track_running_stats() ? b["num_batches_tracked"] : torch::Tensor();
}

torch::Tensor BatchNorm2dImpl::forward(const torch::Tensor& input) {
  TORCH_CHECK(input.dim() == 5 && input.size(0) == n_, "wide::nn::BatchNorm2d: expected an N-first "
              "input [", n_, ", B, ", options.num_features(), ", H, W], got ", input.sizes());
  auto opt = [](const torch::Tensor& t) { return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt; };
  const bool use_batch_stats = is_training() || !options.track_running_stats();
  if (is_training() && options.track_running_stats()) {
    torch::NoGradGuard no_grad;
    num_batches_tracked.add_(1);
  }
  at::Tensor packed = wide::batch_norm(input, opt(weight), opt(bias), opt(running_mean),
                                       opt(running_var), use_batch_stats, *options.momentum(),
                                       options.eps());
  return wide::to_nfirst(packed, n_);
}

void BatchNorm2dImpl::pretty_print(std::ostream& stream) const {
  stream << "wide::nn::BatchNorm2d(n=" << n_ << ", " << options.num_features()
         << ", eps=" << options.eps() << ", momentum=" << *options.momentum()
         << ", affine=" << std::boolalpha << options.affine()
         << ", track_running_stats=" << options.track_running_stats() << ")";
}

BatchNorm2d from_modules(const std::vector<torch::nn::BatchNorm2d>& members) {
  check_same_options(members, BatchNorm2dImpl::kName, [](const auto& a, const auto& b) {
    return first_of({differs("num_features", a.num_features(), b.num_features()),
                     differs("eps", a.eps(), b.eps()),
                     differs("momentum", a.momentum(), b.momentum()),
                     differs("affine", a.affine(), b.affine()),
                     differs("track_running_stats", a.track_running_stats(), b.track_running_stats())});
  });
  return build<BatchNorm2d>(members, members.front()->is_training());
}

// -- LayerNorm -------------------------------------------------------------------------------------

LayerNormImpl::LayerNormImpl(int64_t n, torch::nn::LayerNormOptions options_)
    : WideModule(n), options(std::move(options_)) {
  reset();  // NOLINT(clang-analyzer-optin.cplusplus.VirtualCall)
}

void LayerNormImpl::reset() {
  stack_from(*this, fresh<torch::nn::LayerNorm>(n_, options));
  auto p = named_parameters(false);
  weight = options.elementwise_affine() ? p["weight"] : torch::Tensor();
  bias = options.elementwise_affine() ? p["bias"] : torch::Tensor();
}

torch::Tensor LayerNormImpl::forward(const torch::Tensor& input) {
  auto opt = [](const torch::Tensor& t) { return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt; };
  return wide::layer_norm(input, c10::fromIntArrayRefSlow(options.normalized_shape()), opt(weight),
                          opt(bias), options.eps());
}

void LayerNormImpl::pretty_print(std::ostream& stream) const {
  stream << "wide::nn::LayerNorm(n=" << n_ << ", " << c10::IntArrayRef(options.normalized_shape())
         << ", eps=" << options.eps() << ", elementwise_affine=" << std::boolalpha
         << options.elementwise_affine() << ")";
}

LayerNorm from_modules(const std::vector<torch::nn::LayerNorm>& members) {
  check_same_options(members, LayerNormImpl::kName, [](const auto& a, const auto& b) {
    return first_of({differs("normalized_shape", a.normalized_shape(), b.normalized_shape()),
                     differs("eps", a.eps(), b.eps()),
                     differs("elementwise_affine", a.elementwise_affine(), b.elementwise_affine())});
  });
  return build<LayerNorm>(members, members.front()->is_training());
}

// -- Embedding -------------------------------------------------------------------------------------

EmbeddingImpl::EmbeddingImpl(int64_t n, torch::nn::EmbeddingOptions options_)
    : WideModule(n), options(std::move(options_)) {
  reset();  // NOLINT(clang-analyzer-optin.cplusplus.VirtualCall)
}

void EmbeddingImpl::reset() {
  stack_from(*this, fresh<torch::nn::Embedding>(n_, options));
  weight = named_parameters(false)["weight"];
}

torch::Tensor EmbeddingImpl::forward(const torch::Tensor& indices) {
  if (options.max_norm().has_value()) {
    torch::NoGradGuard no_grad;
    wide::embedding_renorm_(weight, indices, *options.max_norm(), options.norm_type());
  }
  int64_t padding_idx = options.padding_idx().value_or(-1);
  if (padding_idx < 0 && options.padding_idx().has_value()) padding_idx += options.num_embeddings();
  return wide::embedding(weight, indices, padding_idx, options.scale_grad_by_freq(), options.sparse());
}

void EmbeddingImpl::pretty_print(std::ostream& stream) const {
  stream << "wide::nn::Embedding(n=" << n_ << ", num_embeddings=" << options.num_embeddings()
         << ", embedding_dim=" << options.embedding_dim() << ")";
}

Embedding from_modules(const std::vector<torch::nn::Embedding>& members) {
  check_same_options(members, EmbeddingImpl::kName, [](const auto& a, const auto& b) {
    return first_of({differs("num_embeddings", a.num_embeddings(), b.num_embeddings()),
                     differs("embedding_dim", a.embedding_dim(), b.embedding_dim()),
                     differs("padding_idx", a.padding_idx(), b.padding_idx()),
                     differs("max_norm", a.max_norm(), b.max_norm()),
                     differs("norm_type", a.norm_type(), b.norm_type()),
                     differs("scale_grad_by_freq", a.scale_grad_by_freq(), b.scale_grad_by_freq()),
                     differs("sparse", a.sparse(), b.sparse())});
  });
  return build<Embedding>(members, members.front()->is_training());
}

// -- LSTM / GRU ------------------------------------------------------------------------------------

namespace {

template <typename Options>
std::string rnn_differs(const Options& a, const Options& b) {
  return first_of({differs("input_size", a.input_size(), b.input_size()),
                   differs("hidden_size", a.hidden_size(), b.hidden_size()),
                   differs("num_layers", a.num_layers(), b.num_layers()),
                   differs("bias", a.bias(), b.bias()),
                   differs("batch_first", a.batch_first(), b.batch_first()),
                   differs("dropout", a.dropout(), b.dropout()),
                   differs("bidirectional", a.bidirectional(), b.bidirectional())});
}

std::vector<at::Tensor> flat_params(const torch::nn::Module& m) {
  std::vector<at::Tensor> out;
  for (const auto& p : m.named_parameters(/*recurse=*/false)) out.push_back(p.value());
  return out;
}

}  // namespace

LSTMImpl::LSTMImpl(int64_t n, torch::nn::LSTMOptions options_)
    : WideModule(n), options(std::move(options_)) {
  reset();  // NOLINT(clang-analyzer-optin.cplusplus.VirtualCall)
}

void LSTMImpl::reset() { stack_from(*this, fresh<torch::nn::LSTM>(n_, options)); }

std::tuple<torch::Tensor, std::tuple<torch::Tensor, torch::Tensor>> LSTMImpl::forward(
    const torch::Tensor& input, std::optional<std::tuple<torch::Tensor, torch::Tensor>> hx) {
  std::vector<at::Tensor> state;
  if (hx) state = {std::get<0>(*hx), std::get<1>(*hx)};
  auto [out, h] = wide::rnn(input, state, flat_params(*this), "LSTM", options.num_layers(),
                            options.bidirectional(), options.batch_first(), options.dropout(),
                            is_training(), options.bias(), options.proj_size(), strategy);
  return {out, {h.at(0), h.at(1)}};
}

void LSTMImpl::pretty_print(std::ostream& stream) const {
  stream << "wide::nn::LSTM(n=" << n_ << ", input_size=" << options.input_size()
         << ", hidden_size=" << options.hidden_size() << ", num_layers=" << options.num_layers()
         << ", bidirectional=" << std::boolalpha << options.bidirectional() << ")";
}

LSTM from_modules(const std::vector<torch::nn::LSTM>& members) {
  check_same_options(members, LSTMImpl::kName, [](const auto& a, const auto& b) {
    return first_of({rnn_differs(a, b), differs("proj_size", a.proj_size(), b.proj_size())});
  });
  return build<LSTM>(members, members.front()->is_training());
}

GRUImpl::GRUImpl(int64_t n, torch::nn::GRUOptions options_)
    : WideModule(n), options(std::move(options_)) {
  reset();  // NOLINT(clang-analyzer-optin.cplusplus.VirtualCall)
}

void GRUImpl::reset() { stack_from(*this, fresh<torch::nn::GRU>(n_, options)); }

std::tuple<torch::Tensor, torch::Tensor> GRUImpl::forward(const torch::Tensor& input, torch::Tensor hx) {
  std::vector<at::Tensor> state;
  if (hx.defined()) state = {hx};
  auto [out, h] = wide::rnn(input, state, flat_params(*this), "GRU", options.num_layers(),
                            options.bidirectional(), options.batch_first(), options.dropout(),
                            is_training(), options.bias(), /*proj_size=*/0, strategy);
  return {out, h.at(0)};
}

void GRUImpl::pretty_print(std::ostream& stream) const {
  stream << "wide::nn::GRU(n=" << n_ << ", input_size=" << options.input_size()
         << ", hidden_size=" << options.hidden_size() << ", num_layers=" << options.num_layers()
         << ", bidirectional=" << std::boolalpha << options.bidirectional() << ")";
}

GRU from_modules(const std::vector<torch::nn::GRU>& members) {
  check_same_options(members, GRUImpl::kName, rnn_differs<torch::nn::GRUOptions>);
  return build<GRU>(members, members.front()->is_training());
}

}  // namespace wide::nn
