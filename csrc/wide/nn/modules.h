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

}  // namespace detail

/// N nn.Linear layers as one batched GEMM: input [N, B, *, in] -> [N, B, *, out].
class LinearImpl : public torch::nn::Cloneable<LinearImpl>, public detail::WideModuleBase {
 public:
  /// N members initialised as N fresh torch::nn::Linear(options) would be.
  LinearImpl(int64_t n, torch::nn::LinearOptions options);
  void reset() override;
  torch::Tensor forward(const torch::Tensor& input);
  /// The members' values, into the wide module (the architectures must match).
  void load_members(const std::vector<torch::nn::Linear>& members);
  /// N ordinary modules holding copies of the members' current values.
  std::vector<torch::nn::Linear> unfuse() const;
  void pretty_print(std::ostream& stream) const override;

  torch::nn::LinearOptions options;
  /// "auto" | "bmm" | "bmm_t" | "loop" (see Note [wide::linear strategies]).
  std::string strategy = "auto";
  torch::Tensor weight, bias;
};
TORCH_MODULE(Linear);

/// N nn.Conv2d layers as one grouped convolution: input [N, B, C_in, H, W] -> [N, B, C_out, H', W'].
class Conv2dImpl : public torch::nn::Cloneable<Conv2dImpl>, public detail::WideModuleBase {
 public:
  Conv2dImpl(int64_t n, torch::nn::Conv2dOptions options);
  void reset() override;
  torch::Tensor forward(const torch::Tensor& input);
  void load_members(const std::vector<torch::nn::Conv2d>& members);
  std::vector<torch::nn::Conv2d> unfuse() const;
  void pretty_print(std::ostream& stream) const override;

  torch::nn::Conv2dOptions options;
  /// "auto" | "grouped" | "loop" (see Note [wide::conv strategies]).
  std::string strategy = "auto";
  torch::Tensor weight, bias;
};
TORCH_MODULE(Conv2d);

/// N nn.BatchNorm2d as one norm over N*C channels: input [N, B, C, H, W] -> same shape. Each
/// member's running statistics are its own; momentum and eps are shared by the members.
class BatchNorm2dImpl : public torch::nn::Cloneable<BatchNorm2dImpl>, public detail::WideModuleBase {
 public:
  BatchNorm2dImpl(int64_t n, torch::nn::BatchNormOptions options);
  void reset() override;
  torch::Tensor forward(const torch::Tensor& input);
  void load_members(const std::vector<torch::nn::BatchNorm2d>& members);
  std::vector<torch::nn::BatchNorm2d> unfuse() const;
  void pretty_print(std::ostream& stream) const override;

  torch::nn::BatchNormOptions options;
  torch::Tensor weight, bias, running_mean, running_var, num_batches_tracked;
};
TORCH_MODULE(BatchNorm2d);

/// N nn.LayerNorm: input [N, *, normalized_shape] -> same shape.
class LayerNormImpl : public torch::nn::Cloneable<LayerNormImpl>, public detail::WideModuleBase {
 public:
  LayerNormImpl(int64_t n, torch::nn::LayerNormOptions options);
  void reset() override;
  torch::Tensor forward(const torch::Tensor& input);
  void load_members(const std::vector<torch::nn::LayerNorm>& members);
  std::vector<torch::nn::LayerNorm> unfuse() const;
  void pretty_print(std::ostream& stream) const override;

  torch::nn::LayerNormOptions options;
  torch::Tensor weight, bias;
};
TORCH_MODULE(LayerNorm);

/// N nn.Embedding tables: indices [N, *] (each member its own) -> [N, *, embedding_dim].
class EmbeddingImpl : public torch::nn::Cloneable<EmbeddingImpl>, public detail::WideModuleBase {
 public:
  EmbeddingImpl(int64_t n, torch::nn::EmbeddingOptions options);
  void reset() override;
  torch::Tensor forward(const torch::Tensor& indices);
  void load_members(const std::vector<torch::nn::Embedding>& members);
  std::vector<torch::nn::Embedding> unfuse() const;
  void pretty_print(std::ostream& stream) const override;

  torch::nn::EmbeddingOptions options;
  torch::Tensor weight;
};
TORCH_MODULE(Embedding);

/// N nn.LSTM run by one time loop: input [N, T, B, I] ([N, B, T, I] if batch_first), optional
/// (h0, c0) [N, layers*directions, B, H]; returns (output, (h_n, c_n)), all N-first.
class LSTMImpl : public torch::nn::Cloneable<LSTMImpl>, public detail::WideModuleBase {
 public:
  LSTMImpl(int64_t n, torch::nn::LSTMOptions options);
  void reset() override;
  std::tuple<torch::Tensor, std::tuple<torch::Tensor, torch::Tensor>> forward(
      const torch::Tensor& input, std::optional<std::tuple<torch::Tensor, torch::Tensor>> hx = {});
  void load_members(const std::vector<torch::nn::LSTM>& members);
  std::vector<torch::nn::LSTM> unfuse() const;
  void pretty_print(std::ostream& stream) const override;

  torch::nn::LSTMOptions options;
  /// "auto" = "fused" (one time loop for all members) | "loop" (ATen's LSTM per member).
  std::string strategy = "auto";

 protected:
  FORWARD_HAS_DEFAULT_ARGS({1, torch::nn::AnyValue(std::optional<std::tuple<torch::Tensor, torch::Tensor>>())})
};
TORCH_MODULE(LSTM);

/// N nn.GRU run by one time loop: input as LSTM, optional h0; returns (output, h_n), N-first.
class GRUImpl : public torch::nn::Cloneable<GRUImpl>, public detail::WideModuleBase {
 public:
  GRUImpl(int64_t n, torch::nn::GRUOptions options);
  void reset() override;
  std::tuple<torch::Tensor, torch::Tensor> forward(const torch::Tensor& input,
                                                   torch::Tensor hx = {});
  void load_members(const std::vector<torch::nn::GRU>& members);
  std::vector<torch::nn::GRU> unfuse() const;
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
