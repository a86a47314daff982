// Every schema of the torch.ops.wide namespace, in one place: this file is the operator API.
// Implementations are registered next to their code (ops/<op>.cpp) with TORCH_LIBRARY_IMPL.
#include <torch/library.h>

#include "wide/info.h"
#include "wide/memory/caching_allocator.h"
#include "wide/cpu/isa.h"

TORCH_LIBRARY(wide, m) {
  // N independent linear layers: input [N, B, *, in], weight [N, out, in], bias [N, out].
  // `strategy` picks the algorithm for per-member inputs: "auto" | "bmm" | "bmm_t" | "loop"; a stride-0
  // (expanded, shared) input always takes the one-GEMM shared path.
  m.def("linear(Tensor input, Tensor weight, Tensor? bias=None, *, str strategy=\"auto\") -> Tensor");

  // Build facts of the loaded library: version, compiler, OpenMP, threads; for `wide_compiler info`.
  m.def("_build_info() -> str", &wide::build_info);
  // The wide caching allocator (Note [The wide caching allocator] in memory/caching_allocator.cpp):
  // enter/leave a caching scope on this thread (1 while inside one); statistics (cached, live,
  // limit bytes, hits, misses); set the limit on cached bytes (-1: unchanged), release free blocks.
  m.def("_caching_scope(bool enter) -> int", &wide::memory::caching_scope);
  m.def("_cache_stats() -> (int, int, int, int, int, int)", &wide::memory::cache_stats);
  m.def("_cache_control(int limit_bytes=-1, bool empty=False, bool working_set_limit=False) -> ()",
        &wide::memory::cache_control);

  // --- vision and tabular ops ---
  // Layouts (Note [wide layouts] in ops/layout.cpp): N-first [N, B, C, *] and channel-packed
  // [B, N*C, *]. Packed-family ops (conv, conv_transpose, batch/instance/group norm, prelu) take
  // their input N-first (packed_input=False; a stride-0 shared input takes the fast path where
  // one exists) or packed (packed_input=True) and always return a PACKED result.
  m.def("to_packed(Tensor(a) input) -> Tensor(a)");
  m.def("to_nfirst(Tensor(a) input, SymInt n) -> Tensor(a)");
  // A channels-last packed activation made channels-first for the channels-first ops after it;
  // its gradient goes back channels-last (Note [Layout-keeping conversion] in ops/conv_autograd.cpp).
  m.def("to_channels_first(Tensor input) -> Tensor");
  // N Conv{1,2,3}d: weight [N, C_out, C_in/groups, *k], bias [N, C_out]. padding: one value per
  // spatial dim, or (left, right) per dim in F.pad order. strategy: "auto" | "grouped" |
  // "grouped_cl" (channels-last, 2-d) | "loop" (Note [wide::conv strategies] in ops/conv.cpp).
  m.def("conv(Tensor input, Tensor weight, Tensor? bias, SymInt[] stride, SymInt[] padding, "
        "SymInt[] dilation, SymInt groups, *, bool packed_input=False, str strategy=\"auto\") -> Tensor");
  // N ConvTranspose{1,2,3}d: weight [N, C_in, C_out/groups, *k], bias [N, C_out].
  m.def("conv_transpose(Tensor input, Tensor weight, Tensor? bias, SymInt[] stride, SymInt[] padding, "
        "SymInt[] output_padding, SymInt groups, SymInt[] dilation, *, bool packed_input=False, "
        "str strategy=\"auto\") -> Tensor");
  // N BatchNorm / InstanceNorm: parameters and running stats [N, C]; running stats updated in place.
  m.def("batch_norm(Tensor input, Tensor? weight, Tensor? bias, Tensor(a!)? running_mean, "
        "Tensor(b!)? running_var, bool training, float momentum, float eps, *, bool packed_input=False) -> Tensor");
  m.def("instance_norm(Tensor input, Tensor? weight, Tensor? bias, Tensor(a!)? running_mean, "
        "Tensor(b!)? running_var, bool use_input_stats, float momentum, float eps, *, "
        "bool packed_input=False) -> Tensor");
  // N GroupNorm(num_groups per member): weight/bias [N, C].
  m.def("group_norm(Tensor input, int n, int num_groups, Tensor? weight=None, Tensor? bias=None, "
        "float eps=1e-05, *, bool packed_input=False) -> Tensor");
  // N GroupNorm on N-first input and output [N, B, C, *] (the one-pass kernel fused_group_norm
  // when no gradient is wanted; group_norm on the packed layout otherwise).
  m.def("group_norm_nfirst(Tensor input, int num_groups, Tensor? weight=None, Tensor? bias=None, "
        "float eps=1e-05) -> Tensor");
  m.def("fused_group_norm(Tensor input, int num_groups, Tensor? weight, Tensor? bias, float eps) -> Tensor");
  // N LayerNorm / RMSNorm on N-first input [N, *, *normalized_shape]; weight/bias [N, *normalized_shape].
  // layer_norm strategy: "auto" | "fused" (one norm over all members, affine in one addcmul) |
  // "loop" (N ATen layer norms with the affine fused, each member's data staying in cache).
  m.def("layer_norm(Tensor input, SymInt[] normalized_shape, Tensor? weight=None, Tensor? bias=None, "
        "float eps=1e-05, *, str strategy=\"auto\") -> Tensor");
  m.def("rms_norm(Tensor input, SymInt[] normalized_shape, Tensor? weight=None, float? eps=None) -> Tensor");
  // layer_norm(input + residual) (the eval fold pass emits it for a sum only the norm reads).
  m.def("add_layer_norm(Tensor input, Tensor residual, SymInt[] normalized_shape, Tensor? weight=None, "
        "Tensor? bias=None, float eps=1e-05) -> Tensor");
  // The one-pass kernel of the three above (per-member affine, optional residual sum); its
  // gradients: fused_norm_backward (two sweeps per row; statistics recomputed from the inputs).
  m.def("fused_norm(Tensor input, Tensor? residual, int normalized_numel, Tensor? weight, Tensor? bias, "
        "float eps, bool rms=False) -> Tensor");
  m.def("fused_norm_backward(Tensor grad_out, Tensor input, Tensor? residual, int normalized_numel, "
        "Tensor? weight, float eps, bool rms, bool[3] output_mask) -> (Tensor, Tensor, Tensor)");
  // BatchNorm in training on a packed input [B, N*C, *] (the CPU kernel behind batch_norm; Note
  // [Batch norm training kernel]): (out, mean, invstd, unbiased var), the last three [N*C]; its
  // gradients from the forward's mean and invstd: fused_batch_norm_backward.
  m.def("fused_batch_norm(Tensor input, Tensor? weight, Tensor? bias, float eps) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("fused_batch_norm_backward(Tensor grad_out, Tensor input, Tensor? weight, Tensor save_mean, "
        "Tensor save_invstd, float eps, bool[3] output_mask) -> (Tensor, Tensor, Tensor)");
  // Scaled dot-product attention (aten's schema) of the eval graph: the small-sequence kernel below
  // when no gradient is wanted and it wins, at::scaled_dot_product_attention otherwise
  // (Note [wide::attention] in ops/attention.cpp).
  m.def("attention(Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None, float dropout_p=0.0, "
        "bool is_causal=False, *, float? scale=None, bool enable_gqa=False) -> Tensor");
  // softmax(q k^T * scale) v, one head at a time, 4-d float/double CPU tensors; no autograd.
  m.def("small_attention(Tensor query, Tensor key, Tensor value, bool is_causal=False, *, "
        "float? scale=None) -> Tensor");
  // N PReLU: weight [N, 1] or [N, C].
  m.def("prelu(Tensor input, Tensor weight, *, bool packed_input=False) -> Tensor");
  // N Embedding / EmbeddingBag tables [N, V, D], one lookup into the [N*V, D] table; N-first.
  m.def("embedding(Tensor weight, Tensor indices, SymInt padding_idx=-1, bool scale_grad_by_freq=False, "
        "bool sparse=False) -> Tensor");
  m.def("embedding_renorm_(Tensor(a!) weight, Tensor indices, float max_norm, float norm_type) -> Tensor(a!)");
  m.def("embedding_bag(Tensor weight, Tensor indices, Tensor? offsets=None, bool scale_grad_by_freq=False, "
        "int mode=0, bool sparse=False, Tensor? per_sample_weights=None, bool include_last_offset=False, "
        "int padding_idx=-1) -> Tensor");

  // --- recurrent ops (Note [wide::rnn] in ops/rnn.cpp) ---
  // N LSTM / GRU / RNN (mode "LSTM" | "GRU" | "RNN_TANH" | "RNN_RELU") as one op, one time loop for
  // all members. input [N, T, B, I] ([N, B, T, I] if batch_first); hx [h0] or [h0, c0] (LSTM) with
  // h0 [N, L*D, B, H_out], c0 [N, L*D, B, H], or empty for zeros; params: torch's _flat_weights
  // stacked over members (per layer and direction: w_ih, w_hh[, b_ih, b_hh][, w_hr]). Returns
  // (output [N, T, B, D*H_out], [h_n] or [h_n, c_n]), batch_first as the input. strategy: "auto" |
  // "fused" (one time loop for all members) | "loop" (ATen's recurrent op per member, stacked).
  m.def("rnn(Tensor input, Tensor[] hx, Tensor[] params, str mode, int num_layers, bool bidirectional, "
        "bool batch_first, float dropout, bool train, bool has_biases, int proj_size=0, *, "
        "str strategy=\"auto\") -> (Tensor, Tensor[])");
  // One step of N LSTMCell / GRUCell / RNNCell: input [N, B, I] or [N, I]; hx [h] or [h, c] (empty
  // for zeros); w_ih [N, G*H, I], w_hh [N, G*H, H], biases [N, G*H]. Returns [h'] or [h', c'].
  m.def("rnn_cell(Tensor input, Tensor[] hx, Tensor w_ih, Tensor w_hh, Tensor? b_ih=None, "
        "Tensor? b_hh=None, *, str mode) -> Tensor[]");

  // --- optimizers (csrc/wide/optim) ---
  // Fused per-member optimizer steps on stacked [N, ...] parameters (optim/optim.h): one call
  // updates a parameter and its state for all N members, each as torch.optim's single-tensor path
  // would update it alone. Every hyperparameter is a real tensor with one value per member ([N])
  // or one shared value; `step` [N] (float) is incremented by the call. Flags are shared.
  m.def("sgd_step(Tensor(a!) param, Tensor grad, Tensor(b!)? momentum_buffer, Tensor lr, "
        "Tensor weight_decay, Tensor momentum, Tensor dampening, *, bool nesterov=False, "
        "bool maximize=False, bool init_buffer=False) -> ()");
  m.def("adam_step(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
        "Tensor(d!)? max_exp_avg_sq, Tensor(e!) step, Tensor lr, Tensor beta1, Tensor beta2, "
        "Tensor eps, Tensor weight_decay, *, bool decoupled_weight_decay=False, bool amsgrad=False, "
        "bool maximize=False) -> ()");
  m.def("rmsprop_step(Tensor(a!) param, Tensor grad, Tensor(b!) square_avg, Tensor(c!)? grad_avg, "
        "Tensor(d!)? momentum_buffer, Tensor(e!) step, Tensor lr, Tensor alpha, Tensor eps, "
        "Tensor weight_decay, Tensor momentum, *, bool centered=False, bool maximize=False) -> ()");
  m.def("adagrad_step(Tensor(a!) param, Tensor grad, Tensor(b!) state_sum, Tensor(c!) step, "
        "Tensor lr, Tensor lr_decay, Tensor weight_decay, Tensor eps, *, bool maximize=False) -> ()");
  // Instruction set of the hand-written CPU kernels (optimizer steps, fused norms, small
  // attention; wide/cpu/isa.h): sets it when `capability` is non-empty ("auto", "default", "avx2",
  // "avx512"); returns the one in use. For tests and benchmarks.
  m.def("_cpu_capability(str capability=\"\") -> str", [](c10::string_view capability) {
    return wide::cpu::cpu_capability_op(std::string_view(capability.data(), capability.size()));
  });
  // The same, under its first name (when only the optimizers had such kernels).
  m.def("_optim_cpu_capability(str capability=\"\") -> str", [](c10::string_view capability) {
    return wide::cpu::cpu_capability_op(std::string_view(capability.data(), capability.size()));
  });
}
