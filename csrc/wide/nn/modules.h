// wide::nn: the wide operators as LibTorch C++ modules (torch::nn::Module). Each holds N
// members' parameters stacked on a leading dim ([N, ...], under the member module's names), runs
// them as one operator, and converts back to N ordinary modules. Every forward takes and returns
// N-first tensors: member i's input is input[i], member i's output is output[i].
//
//   std::vector<torch::nn::Linear> members = ...;            // N modules, one architecture
//   auto wide = wide::nn::Linear::from_modules(members);     // or wide::nn::Linear(N, options)
//   torch::Tensor y = wide(x);                                // x [N, B, in] -> y [N, B, out]
//   auto back = wide->unfuse();                               // N torch::nn::Linear, copies
//
// Training uses autograd as any LibTorch module does (the wide ops are composite), with a
// per-member optimizer from wide/optim/optimizer.h. See Note [wide::nn modules].
#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/any_value.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/modules/rnn.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

namespace wide::nn {

namespace detail {

/// Base of the wide modules: `n` members whose parameters and buffers are registered stacked.
class WideModuleBase {
 public:
  explicit WideModuleBase(int64_t n);
  /// Number of members.
  int64_t n() const { return n_; }
  /// Copies member i's slice of every stacked tensor of `self` into `member`.
  static void copy_out(const torch::nn::Module& self, torch::nn::Module& member, int64_t i);
  /// Gives every stacked tensor of `self` the dtype and device of the same tensor of `member`.
  static void match_tensor_types(torch::nn::Module& self, const torch::nn::Module& member);

 protected:
  /// Registers every parameter and buffer of the fresh `members` on `self`, stacked [N, ...].
  void stack_from(torch::nn::Module& self, const std::vector<std::shared_ptr<torch::nn::Module>>& members);
  /// Copies the members' values into the stacked tensors of `self` (shapes and names checked first).
  void load_from(torch::nn::Module& self, const std::vector<std::shared_ptr<torch::nn::Module>>& members,
                 const char* what) const;

  int64_t n_;
};

/// What every wide module shares, given its class and its member module's holder type: cloning,
/// loading members, and N ordinary modules back. `Impl` has `options` and `kName`.
template <typename Impl, typename Member>
class WideModule : public torch::nn::Cloneable<Impl>, public WideModuleBase {
 public:
  using WideModuleBase::WideModuleBase;

  /// The members' values, into the wide module (the architectures must match).
  void load_members(const std::vector<Member>& members) {
    std::vector<std::shared_ptr<torch::nn::Module>> modules;
    for (const Member& m : members) modules.push_back(m.is_empty() ? nullptr : m.ptr());
    load_from(*this, modules, Impl::kName);
  }

  /// N ordinary modules holding copies of the members' current values, in this module's mode.
  std::vector<Member> unfuse() const {
    std::vector<Member> out;
    for (int64_t i = 0; i < n_; ++i) {
      Member m(static_cast<const Impl&>(*this).options);
      copy_out(*this, *m, i);
      m->train(this->is_training());
      out.push_back(std::move(m));
    }
    return out;
  }
};

}  // namespace detail

/// N nn.Linear layers as one batched GEMM: input [N, B, *, in] -> [N, B, *, out].
class LinearImpl : public detail::WideModule<LinearImpl, torch::nn::Linear> {
 public:
  static constexpr const char* kName = "wide::nn::Linear";
  /// N members initialised as N fresh torch::nn::Linear(options) would be.
  LinearImpl(int64_t n, torch::nn::LinearOptions options);
  void reset() override;
  torch::Tensor forward(const torch::Tensor& input);
  void pretty_print(std::ostream& stream) const override;

  torch::nn::LinearOptions options;
  /// "auto" | "bmm" | "bmm_t" | "loop" (see Note [wide::linear strategies]).
  std::string strategy = "auto";
  torch::Tensor weight, bias;
};
TORCH_MODULE(Linear);

/// N nn.Conv2d layers as one grouped convolution: input [N, B, C_in, H, W] -> [N, B, C_out, H', W'].
class Conv2dImpl : public detail::WideModule<Conv2dImpl, torch::nn::Conv2d> {
 public:
  static constexpr const char* kName = "wide::nn::Conv2d";
  Conv2dImpl(int64_t n, torch::nn::Conv2dOptions options);
  void reset() override;
  torch::Tensor forward(const torch::Tensor& input);
  void pretty_print(std::ostream& stream) const override;

  torch::nn::Conv2dOptions options;
  /// "auto" | "grouped" | "loop" (see Note [wide::conv strategies]).
  std::string strategy = "auto";
  torch::Tensor weight, bias;
};
TORCH_MODULE(Conv2d);

/// N nn.BatchNorm2d as one norm over N*C channels: input [N, B, C, H, W] -> same shape. Each
/// member's running statistics are its own; momentum and eps are shared by the members.
class BatchNorm2dImpl : public detail::WideModule<BatchNorm2dImpl, torch::nn::BatchNorm2d> {
 public:
  static constexpr const char* kName = "wide::nn::BatchNorm2d";
  BatchNorm2dImpl(int64_t n, torch::nn::BatchNormOptions options);
  void reset() override;
  torch::Tensor forward(const torch::Tensor& input);
  void pretty_print(std::ostream& stream) const override;

  torch::nn::BatchNormOptions options;
  torch::Tensor weight, bias, running_mean, running_var, num_batches_tracked;
};
TORCH_MODULE(BatchNorm2d);

/// N nn.LayerNorm: input [N, *, normalized_shape] -> same shape.
class LayerNormImpl : public detail::WideModule<LayerNormImpl, torch::nn::LayerNorm> {
 public:
  static constexpr const char* kName = "wide::nn::LayerNorm";
  LayerNormImpl(int64_t n, torch::nn::LayerNormOptions options);
  void reset() override;
  torch::Tensor forward(const torch::Tensor& input);
  void pretty_print(std::ostream& stream) const override;

  torch::nn::LayerNormOptions options;
  torch::Tensor weight, bias;
};
TORCH_MODULE(LayerNorm);

/// N nn.Embedding tables: indices [N, *] (each member its own) -> [N, *, embedding_dim].
class EmbeddingImpl : public detail::WideModule<EmbeddingImpl, torch::nn::Embedding> {
 public:
  static constexpr const char* kName = "wide::nn::Embedding";
  EmbeddingImpl(int64_t n, torch::nn::EmbeddingOptions options);
  void reset() override;
  torch::Tensor forward(const torch::Tensor& indices);
  void pretty_print(std::ostream& stream) const override;

  torch::nn::EmbeddingOptions options;
  torch::Tensor weight;
};
TORCH_MODULE(Embedding);

/// N nn.LSTM run by one time loop: input [N, T, B, I] ([N, B, T, I] if batch_first), optional
/// (h0, c0) [N, layers*directions, B, H]; returns (output, (h_n, c_n)), all N-first.
class LSTMImpl : public detail::WideModule<LSTMImpl, torch::nn::LSTM> {
 public:
  static constexpr const char* kName = "wide::nn::LSTM";
  LSTMImpl(int64_t n, torch::nn::LSTMOptions options);
  void reset() override;
  std::tuple<torch::Tensor, std::tuple<torch::Tensor, torch::Tensor>> forward(
      const torch::Tensor& input, std::optional<std::tuple<torch::Tensor, torch::Tensor>> hx = {});
  void pretty_print(std::ostream& stream) const override;

  torch::nn::LSTMOptions options;
  /// "auto" = "fused" (one time loop for all members) | "loop" (ATen's LSTM per member).
  std::string strategy = "auto";

 protected:
  FORWARD_HAS_DEFAULT_ARGS({1, torch::nn::AnyValue(std::optional<std::tuple<torch::Tensor, torch::Tensor>>())})
};
TORCH_MODULE(LSTM);

/// N nn.GRU run by one time loop: input as LSTM, optional h0; returns (output, h_n), N-first.
class GRUImpl : public detail::WideModule<GRUImpl, torch::nn::GRU> {
 public:
  static constexpr const char* kName = "wide::nn::GRU";
  GRUImpl(int64_t n, torch::nn::GRUOptions options);
  void reset() override;
  std::tuple<torch::Tensor, torch::Tensor> forward(const torch::Tensor& input,
                                                   torch::Tensor hx = {});
  void pretty_print(std::ostream& stream) const override;

  torch::nn::GRUOptions options;
  std::string strategy = "auto";

 protected:
  FORWARD_HAS_DEFAULT_ARGS({1, torch::nn::AnyValue(torch::Tensor())})
};
TORCH_MODULE(GRU);

/// The wide module of `members` (N >= 1 modules of one architecture), holding copies of their
/// values; throws a c10::Error naming the first member that differs (options, shapes, dtype).
Linear from_modules(const std::vector<torch::nn::Linear>& members);
Conv2d from_modules(const std::vector<torch::nn::Conv2d>& members);
BatchNorm2d from_modules(const std::vector<torch::nn::BatchNorm2d>& members);
LayerNorm from_modules(const std::vector<torch::nn::LayerNorm>& members);
Embedding from_modules(const std::vector<torch::nn::Embedding>& members);
LSTM from_modules(const std::vector<torch::nn::LSTM>& members);
GRU from_modules(const std::vector<torch::nn::GRU>& members);

}  // namespace wide::nn
