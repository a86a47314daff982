// wide::rnn / wide::rnn_cell: N independent LSTM / GRU / Elman RNNs (and their cells) as one
// operator, the time loop running over all N members at once.
// Public C++ API: each function calls its op through the dispatcher, as torch.ops.wide.rnn does;
// the implementation is internal to rnn.cpp (schemas in registration.cpp). See Note [wide::rnn].
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string_view>
#include <tuple>
#include <vector>

namespace wide {

/// N nn.LSTM / nn.GRU / nn.RNN (mode "LSTM" | "GRU" | "RNN_TANH" | "RNN_RELU"): input [N, T, B, I]
/// ([N, B, T, I] if batch_first), hx [h0] or [h0, c0] ([N, L*D, B, H_out], [N, L*D, B, H]; empty =
/// zeros), params the members' stacked _flat_weights; returns (output, [h_n] or [h_n, c_n]).
/// strategy: "fused" (= "auto": one time loop for all members) or "loop" (ATen's op per member).
std::tuple<at::Tensor, std::vector<at::Tensor>> rnn(const at::Tensor& input, at::TensorList hx,
                                                    at::TensorList params, std::string_view mode,
                                                    int64_t num_layers, bool bidirectional,
                                                    bool batch_first, double dropout, bool train,
                                                    bool has_biases, int64_t proj_size = 0,
                                                    std::string_view strategy = "auto");

/// One step of N LSTM / GRU / RNN cells: input [N, B, I] or [N, I], hx [h] or [h, c] (empty =
/// zeros), w_ih [N, G*H, I], w_hh [N, G*H, H], biases [N, G*H]; returns [h'] or [h', c'].
std::vector<at::Tensor> rnn_cell(const at::Tensor& input, at::TensorList hx, const at::Tensor& w_ih,
                                 const at::Tensor& w_hh, const std::optional<at::Tensor>& b_ih,
                                 const std::optional<at::Tensor>& b_hh, std::string_view mode);

} // namespace wide
