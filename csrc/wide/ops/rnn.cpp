#include "wide/ops/rnn.h"
#include "wide/ops/call_op.h"
#include "wide/ops/linear.h"
#include "wide/ops/transforms.h"

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <ATen/ops/addcmul.h>
#include <ATen/ops/baddbmm.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/dropout.h>
#include <ATen/ops/gru.h>
#include <ATen/ops/lstm.h>
#include <ATen/ops/rnn_relu.h>
#include <ATen/ops/rnn_tanh.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <c10/core/ScalarType.h>
#include <torch/library.h>

#include <algorithm>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

// Note [wide::rnn]
// ----------------
// N independent recurrent networks (nn.LSTM / nn.GRU / nn.RNN with equal hyperparameters) run as
// one operator: the time loop is shared, every step advances all N members at once.
//
// Layout. Everything is N-first. The input is [N, T, B, I] ([N, B, T, I] with batch_first), the
// states [N, L*D, B, H_out] (h) and [N, L*D, B, H] (c, LSTM), and `params` is torch's
// `_flat_weights` list with every entry stacked over members: per layer, per direction (forward
// then reverse) w_ih [N, G*H, I_l], w_hh [N, G*H, H_out], then b_ih, b_hh [N, G*H] (has_biases),
// then w_hr [N, proj_size, H] (LSTM with projections). G = 4 (LSTM: i, f, g, o), 3 (GRU: r, z, n)
// or 1 (RNN). Results are laid out exactly as torch's, with N in front.
//
// Algorithm, per layer and direction:
//  1. the input projection of ALL time steps is one batched GEMM over the member dim:
//     [N, T*B, I_l] x [N, I_l, G*H] (baddbmm) with b_ih folded in, and for LSTM/RNN also b_hh
//     (the sum b_ih + b_hh is added once). GRU keeps b_hh with the hidden projection, because its
//     candidate gate needs r * (W_hn h + b_hn). Layer 0 is projected in the caller's memory order
//     (a batch_first input is not transposed to time-major first; the result is viewed instead);
//  2. per step t, one batched GEMM for the hidden projection: baddbmm(xw_t, h, W_hh^T) puts the
//     step's input projection in the GEMM's accumulator (GRU: baddbmm(b_hh, h, W_hh^T)), then the
//     gate math as ATen pointwise ops on [N, B, G*H] (chunk, sigmoid/tanh, addcmul), in torch's
//     formulas (LSTM c' = f*c + i*g, h' = o*tanh(c'), projected h' = h' @ W_hr^T; GRU
//     n = tanh(x_n + r*(W_hn h + b_hn)), h' = (h - n)*z + n; RNN h' = act(x + W_hh h));
//  3. the reverse direction runs t = T-1 .. 0 and its outputs are stored at their own t, so both
//     directions come out in time order; the per-step outputs are stacked once (no in-place writes
//     into tensors that require grad), the directions concatenated on the feature dim.
// Between layers (not after the last) the output goes through at::dropout in train mode, on the
// N-first tensor: every member and element draws its own mask.
//
// The op is CompositeImplicitAutograd: backward through time is autograd's, exact per member
// (members never mix: every GEMM is batched over N, every pointwise op is elementwise). The
// per-step slices of the input projection come from ONE unbind (likewise the initial states):
// its backward stacks the T gradients once, where T selects would each scatter into a zero
// tensor of the full [N, T, B, G*H] size (O(T^2) memory traffic).
// T is a concrete loop bound (torch.compile specialises on it, as for torch's own RNNs); N, B and
// the feature sizes are SymInts.

namespace wide {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

enum class Mode { LSTM, GRU, RNNTanh, RNNRelu };

Mode parse_mode(std::string_view name, const char* op) {
  if (name == "LSTM") return Mode::LSTM;
  if (name == "GRU") return Mode::GRU;
  if (name == "RNN_TANH") return Mode::RNNTanh;
  if (name == "RNN_RELU") return Mode::RNNRelu;
  TORCH_CHECK(false, op, ": expected mode 'LSTM', 'GRU', 'RNN_TANH' or 'RNN_RELU', got '",
              std::string(name), "'");
}

int64_t gate_count(Mode mode) {
  switch (mode) {
    case Mode::LSTM: return 4;
    case Mode::GRU: return 3;
    default: return 1;
  }
}

const char* mode_name(Mode mode) {
  switch (mode) {
    case Mode::LSTM: return "LSTM";
    case Mode::GRU: return "GRU";
    case Mode::RNNTanh: return "RNN_TANH";
    case Mode::RNNRelu: return "RNN_RELU";
  }
  return "?";
}

// t has exactly the sizes `want` and the dtype and device of `like`; `what` names it in errors.
void check_shape(const char* op, const at::Tensor& t, const std::vector<c10::SymInt>& want,
                 const std::string& what, const char* pattern, const at::Tensor& like) {
  bool ok = t.dim() == static_cast<int64_t>(want.size());
  for (size_t d = 0; ok && d < want.size(); ++d) ok = t.sym_size(static_cast<int64_t>(d)) == want[d];
  TORCH_CHECK(ok, op, ": expected ", what, " of shape ", pattern, " = ", c10::SymIntArrayRef(want),
              ", got ", t.sym_sizes());
  TORCH_CHECK(t.scalar_type() == like.scalar_type() && t.device() == like.device(), op,
              ": expected ", what, " with the input's dtype and device (", like.scalar_type(), " on ",
              like.device(), "), got ", t.scalar_type(), " on ", t.device());
}

// x @ w^T + addend (a bias [N, 1, O], an accumulator [N, M, O] or undefined): one batched GEMM
// whose weight gradient, summed over the time steps, comes in w's own layout (Note [Linear
// weight gradient layout]).
at::Tensor gemm_nt(const at::Tensor& x, const at::Tensor& w, const at::Tensor& addend) {
  return detail::batched_linear(x, w, addend.defined() ? std::optional<at::Tensor>(addend) : std::nullopt);
}

// One step of N cells. xw [N, B, G*H]: this step's input projection, b_ih included (and b_hh for
// LSTM/RNN); h [N, B, H_out]; c [N, B, H] (LSTM, else undefined); w_hh [N, G*H, H_out];
// b_hh_gru [N, 1, G*H] (GRU with biases, else undefined); w_hr [N, proj, H] or undefined.
struct State {
  at::Tensor h, c;
};

State cell_step(Mode mode, const at::Tensor& xw, const at::Tensor& h, const at::Tensor& c,
                const at::Tensor& w_hh, const at::Tensor& b_hh_gru, const at::Tensor& w_hr) {
  switch (mode) {
    case Mode::LSTM: {
      const std::vector<at::Tensor> gates = gemm_nt(h, w_hh, xw).chunk(4, 2);
      const at::Tensor i = gates[0].sigmoid();
      const at::Tensor f = gates[1].sigmoid();
      const at::Tensor g = gates[2].tanh();
      const at::Tensor o = gates[3].sigmoid();
      const at::Tensor c_next = at::addcmul(f.mul(c), i, g);
      at::Tensor h_next = o.mul(c_next.tanh());
      if (w_hr.defined()) h_next = gemm_nt(h_next, w_hr, at::Tensor());
      return {h_next, c_next};
    }
    case Mode::GRU: {
      const at::Tensor hg = gemm_nt(h, w_hh, b_hh_gru);
      const std::vector<at::Tensor> xs = xw.chunk(3, 2);
      const std::vector<at::Tensor> hs = hg.chunk(3, 2);
      const at::Tensor r = hs[0].add(xs[0]).sigmoid();
      const at::Tensor z = hs[1].add(xs[1]).sigmoid();
      const at::Tensor n = at::addcmul(xs[2], r, hs[2]).tanh();
      return {at::addcmul(n, h.sub(n), z), at::Tensor()};
    }
    case Mode::RNNTanh: return {gemm_nt(h, w_hh, xw).tanh(), at::Tensor()};
    case Mode::RNNRelu: return {gemm_nt(h, w_hh, xw).relu(), at::Tensor()};
  }
  TORCH_CHECK(false, "wide::rnn: unreachable mode");
}

// x [N, A, C, I] -> x @ w_ih^T + bias: [N, A, C, G*H], one batched GEMM over all A*C rows.
at::Tensor project_input(const at::Tensor& x, const at::Tensor& w_ih, const at::Tensor& bias) {
  const c10::SymInt n = x.sym_size(0), a = x.sym_size(1), c = x.sym_size(2);
  const at::Tensor x2 = x.reshape_symint({n, a * c, x.sym_size(3)});
  const at::Tensor y = gemm_nt(x2, w_ih, bias.defined() ? bias.unsqueeze(1) : at::Tensor());
  return y.view_symint({n, a, c, w_ih.sym_size(1)});
}

at::Tensor opt_sum(const std::optional<at::Tensor>& a, const std::optional<at::Tensor>& b) {
  if (a.has_value() && b.has_value()) return a->add(*b);
  if (a.has_value()) return *a;
  if (b.has_value()) return *b;
  return at::Tensor();
}

// One member's results ({output, h_n} or {output, h_n, c_n}) from its tensors {input, initial
// states..., parameters...}.
using MemberFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

// Member m's tensors: slice m of every stacked [N, ...] tensor (unbind, not select: its backward
// stacks the N gradients once).
std::vector<std::vector<at::Tensor>> per_member(at::TensorList stacked) {
  std::vector<std::vector<at::Tensor>> out(stacked[0].size(0));
  for (const at::Tensor& t : stacked) {
    std::vector<at::Tensor> slices = t.unbind(0);
    for (size_t m = 0; m < out.size(); ++m) out[m].push_back(std::move(slices[m]));
  }
  return out;
}

// fn(m) for every member m: in parallel, one chunk of members per intra-op thread, each under
// the caller's thread-local state (Note [Members in parallel]), or one after another.
std::vector<std::vector<at::Tensor>> run_members(int64_t members,
                                                 const std::function<std::vector<at::Tensor>(int64_t)>& fn,
                                                 bool parallel) {
  std::vector<std::vector<at::Tensor>> results(members);
  if (!parallel) {
    for (int64_t m = 0; m < members; ++m) results[m] = fn(m);
    return results;
  }
  const at::ThreadLocalState caller;
  at::parallel_for(0, members, 1, [&](int64_t begin, int64_t end) {
    at::ThreadLocalStateGuard guard(caller);
    for (int64_t m = begin; m < end; ++m) results[m] = fn(m);
  });
  return results;
}

// Result j of every member, stacked [N, ...].
std::vector<at::Tensor> stack_results(const std::vector<std::vector<at::Tensor>>& results) {
  std::vector<at::Tensor> stacked;
  for (size_t j = 0; j < results[0].size(); ++j) {
    std::vector<at::Tensor> parts;
    for (const auto& r : results) parts.push_back(r[j]);
    stacked.push_back(at::stack(parts));
  }
  return stacked;
}

// Note [Members in parallel], training: the autograd engine would run the N members' backward
// nodes one after another, so the members' graphs are recorded inside this function (on leaves
// that are slices of the stacked inputs) and its backward runs torch::autograd::grad of each
// member's graph on the member's thread. Not twice differentiable (neither is oneDNN's RNN).
class MembersInParallel : public torch::autograd::Function<MembersInParallel> {
 public:
  // flat: {input, h0 [, c0], parameters...}, each [N, ...].
  static variable_list forward(AutogradContext* ctx, at::TensorList flat, MemberFn fn) {
    std::vector<at::Tensor> detached;
    for (const at::Tensor& t : flat) detached.push_back(t.detach());
    std::vector<std::vector<at::Tensor>> leaves = per_member(detached);
    for (auto& member : leaves) {
      for (size_t i = 0; i < flat.size(); ++i) member[i].requires_grad_(flat[i].requires_grad());
    }
    const int64_t members = static_cast<int64_t>(leaves.size());
    const auto results = run_members(members, [&](int64_t m) {
      at::AutoGradMode grad(true);
      return fn(leaves[m]);
    }, /*parallel=*/true);
    // Saved as saved variables, not saved_data: the engine releases them (and with them the
    // members' graphs) after a backward that does not retain the graph, as for any node.
    variable_list saved;
    for (const auto& member : leaves) saved.insert(saved.end(), member.begin(), member.end());
    for (const auto& member : results) saved.insert(saved.end(), member.begin(), member.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["k"] = static_cast<int64_t>(flat.size());
    ctx->saved_data["r"] = static_cast<int64_t>(results[0].size());
    return stack_results(results);  // grad mode is off in forward: plain stacked tensors
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(), "wide::rnn: the 'loop' strategy with members in parallel is not "
                "twice differentiable; compile with WideConfig(strategy='fused') for higher-order gradients");
    const variable_list saved = ctx->get_saved_variables();
    const int64_t k = ctx->saved_data["k"].toInt(), r = ctx->saved_data["r"].toInt();
    const int64_t members = static_cast<int64_t>(saved.size()) / (k + r);
    const variable_list leaves(saved.begin(), saved.begin() + members * k);
    const variable_list results(saved.begin() + members * k, saved.end());
    const auto member_grads = run_members(members, [&](int64_t m) {
      variable_list outs, gouts, wrt;
      std::vector<int64_t> where;
      for (int64_t j = 0; j < r; ++j) {
        const at::Tensor& out = results[m * r + j];
        if (grads[j].defined() && out.requires_grad()) outs.push_back(out), gouts.push_back(grads[j][m]);
      }
      for (int64_t i = 0; i < k; ++i) {
        if (leaves[m * k + i].requires_grad()) wrt.push_back(leaves[m * k + i]), where.push_back(i);
      }
      std::vector<at::Tensor> g(k);
      if (outs.empty() || wrt.empty()) return g;
      // Retained: the outer backward may be retained; the saved variables bound its life.
      const variable_list got = torch::autograd::grad(outs, wrt, gouts, /*retain_graph=*/true,
                                                      /*create_graph=*/false, /*allow_unused=*/true);
      for (size_t w = 0; w < where.size(); ++w) g[where[w]] = got[w];
      return g;
    }, /*parallel=*/true);
    variable_list out(k + 1);
    for (int64_t i = 0; i < k; ++i) {
      if (!leaves[i].requires_grad()) continue;
      std::vector<at::Tensor> parts;
      for (int64_t m = 0; m < members; ++m) {
        const at::Tensor& g = member_grads[m][i];
        parts.push_back(g.defined() ? g : at::zeros_like(leaves[m * k + i]));
      }
      out[i] = at::stack(parts);
    }
    return out;
  }
};

// Strategy "loop": ATen's own recurrent op per member (oneDNN's fused LSTM kernel on CPU, cuDNN
// on CUDA), stacked. unbind, not select: its backward stacks the N gradients once.
//
// Note [Members in parallel]
// --------------------------
// A member's recurrent op runs T small steps ([B, H] x [H, 4H] GEMMs for an LSTM) that two
// threads barely speed up, so on CPU the members are split into one contiguous chunk per
// intra-op thread (at::parallel_for), each member's op running single-threaded inside its
// chunk (ATen and oneDNN do not nest parallelism). A member's computation is the same kernel
// on the same data whatever the chunking, so results do not depend on the thread count
// (tests/python/test_rnn.py checks 1 and 2 threads bit for bit). The caller's thread-local
// state (grad mode, inference mode, autocast, dispatch keys) is carried into the workers. When
// a gradient is wanted, MembersInParallel records each member's graph and runs the members'
// backward passes in parallel too. Not taken when the op draws random numbers (dropout in
// training: the members' draws would depend on the order the threads reach the generator), for
// Python tensor subclasses and dispatch modes (fake tensors while tracing), on other devices, or
// for a single member.
std::tuple<at::Tensor, std::vector<at::Tensor>> rnn_loop(
    Mode mode, const at::Tensor& input, at::TensorList hx, at::TensorList params, int64_t num_layers,
    bool bidirectional, bool batch_first, double dropout, bool train, bool has_biases,
    const c10::SymInt& h_out, const c10::SymInt& hidden, const c10::SymInt& batch) {
  const int64_t members = input.size(0), dirs = bidirectional ? 2 : 1;
  const int64_t k = mode == Mode::LSTM ? 2 : 1;
  // One member: its initial states (zeros when none are given) and its parameters.
  const size_t n_states = hx.size();
  const MemberFn run_member = [=](const std::vector<at::Tensor>& t) -> std::vector<at::Tensor> {
    const at::Tensor& x = t[0];
    std::vector<at::Tensor> states(t.begin() + 1, t.begin() + 1 + n_states);
    const std::vector<at::Tensor> ps(t.begin() + 1 + n_states, t.end());
    if (states.empty()) {
      for (int64_t j = 0; j < k; ++j) {
        states.push_back(
            at::zeros_symint({c10::SymInt(num_layers * dirs), batch, j == 0 ? h_out : hidden}, x.options()));
      }
    }
    if (mode == Mode::LSTM) {
      auto [o, h, c] = at::lstm(x, states, ps, has_biases, num_layers, dropout, train, bidirectional, batch_first);
      return {o, h, c};
    }
    using Single = std::tuple<at::Tensor, at::Tensor> (*)(const at::Tensor&, const at::Tensor&, at::TensorList,
                                                          bool, int64_t, double, bool, bool, bool);
    const Single single = mode == Mode::GRU       ? static_cast<Single>(&at::gru)
                          : mode == Mode::RNNTanh ? static_cast<Single>(&at::rnn_tanh)
                                                  : static_cast<Single>(&at::rnn_relu);
    auto [o, h] = single(x, states[0], ps, has_biases, num_layers, dropout, train, bidirectional, batch_first);
    return {o, h};
  };
  std::vector<at::Tensor> flat{input};
  for (const at::Tensor& h : hx) flat.push_back(h);
  for (const at::Tensor& p : params) flat.push_back(p);

  const bool random = train && dropout > 0 && num_layers > 1;
  // Python tensor subclasses and modes (fake tensors under torch.compile/export) call back into
  // Python, which worker threads may not do while the caller waits, and torch.func transforms
  // refuse MembersInParallel: sequential then.
  const bool eager = std::all_of(flat.begin(), flat.end(), [](const at::Tensor& t) {
    return detail::untraced({&t}) && detail::plain_autograd({&t});  // Note [Kernels under transforms]
  });
  const bool parallel = input.device().is_cpu() && members > 1 && !random && eager &&
                        at::get_num_threads() > 1 && !at::in_parallel_region();
  const bool wants_grad =
      at::GradMode::is_enabled() && std::any_of(flat.begin(), flat.end(), [](const at::Tensor& t) { return t.requires_grad(); });
  std::vector<at::Tensor> stacked;
  if (parallel && wants_grad) {
    stacked = MembersInParallel::apply(at::TensorList(flat), run_member);
  } else {
    const std::vector<std::vector<at::Tensor>> tensors = per_member(flat);
    stacked = stack_results(run_members(members, [&](int64_t m) { return run_member(tensors[m]); }, parallel));
  }
  std::vector<at::Tensor> final_states(stacked.begin() + 1, stacked.end());
  return {stacked[0], std::move(final_states)};
}

std::tuple<at::Tensor, std::vector<at::Tensor>> rnn_impl(
    const at::Tensor& input, at::TensorList hx, at::TensorList params, std::string_view mode_str,
    int64_t num_layers, bool bidirectional, bool batch_first, double dropout, bool train,
    bool has_biases, int64_t proj_size, std::string_view strategy) {
  constexpr const char* op = "wide::rnn";
  const Mode mode = parse_mode(mode_str, op);
  TORCH_CHECK(strategy == "auto" || strategy == "fused" || strategy == "loop", op,
              ": expected strategy \"auto\", \"fused\" or \"loop\", got \"", strategy, "\"");
  TORCH_CHECK(proj_size >= 0, op, ": expected proj_size >= 0, got ", proj_size);
  TORCH_CHECK(proj_size == 0 || mode == Mode::LSTM, op, ": expected proj_size = 0 for mode ",
              mode_name(mode), " (projections are LSTM only), got ", proj_size);
  TORCH_CHECK(num_layers >= 1, op, ": expected num_layers >= 1, got ", num_layers);
  TORCH_CHECK(dropout >= 0 && dropout <= 1, op, ": expected dropout in [0, 1], got ", dropout);
  TORCH_CHECK(input.dim() == 4, op, ": expected input of shape ",
              batch_first ? "[N, B, T, I]" : "[N, T, B, I]", " (4 dims), got ", input.sym_sizes());
  TORCH_CHECK(c10::isFloatingType(input.scalar_type()), op, ": expected a floating-point input, got ",
              input.scalar_type());

  const int64_t dirs = bidirectional ? 2 : 1;
  const int64_t per_dir = 2 + (has_biases ? 2 : 0) + (proj_size > 0 ? 1 : 0);
  TORCH_CHECK(static_cast<int64_t>(params.size()) == num_layers * dirs * per_dir, op, ": expected ",
              num_layers * dirs * per_dir, " params (", num_layers, " layers x ", dirs,
              " directions x ", per_dir, ": w_ih, w_hh", has_biases ? ", b_ih, b_hh" : "",
              proj_size > 0 ? ", w_hr" : "", "), got ", params.size());
  const int64_t seq_dim = batch_first ? 2 : 1, batch_dim = batch_first ? 1 : 2;
  const int64_t steps = input.size(seq_dim);
  TORCH_CHECK(steps > 0, op, ": expected sequence length > 0, got input ", input.sym_sizes());
  const c10::SymInt n = input.sym_size(0), batch = input.sym_size(batch_dim);
  const int64_t gates = gate_count(mode);
  TORCH_CHECK(params[0].dim() == 3 && params[0].sym_size(1) % gates == 0, op,
              ": expected layer 0 w_ih of shape [N, G*H, I] with G = ", gates, " for ",
              mode_name(mode), ", got ", params[0].sym_sizes());
  const c10::SymInt hidden = params[0].sym_size(1) / gates;
  TORCH_CHECK(proj_size == 0 || hidden > proj_size, op, ": expected proj_size < hidden_size (as nn.LSTM "
              "requires), got proj_size=", proj_size, " and hidden_size=", hidden);
  const c10::SymInt h_out = proj_size > 0 ? c10::SymInt(proj_size) : hidden;
  const c10::SymInt gh = hidden * gates;

  // Parameters, named as torch names them ("layer 1 reverse w_hh").
  for (int64_t l = 0; l < num_layers; ++l) {
    const c10::SymInt in_l = l == 0 ? input.sym_size(3) : h_out * dirs;
    for (int64_t d = 0; d < dirs; ++d) {
      const std::string name = "layer " + std::to_string(l) + (d == 1 ? " reverse " : " ");
      const at::Tensor* p = params.data() + (l * dirs + d) * per_dir;
      check_shape(op, p[0], {n, gh, in_l}, name + "w_ih", "[N, G*H, I_l]", input);
      check_shape(op, p[1], {n, gh, h_out}, name + "w_hh", "[N, G*H, H_out]", input);
      if (has_biases) {
        check_shape(op, p[2], {n, gh}, name + "b_ih", "[N, G*H]", input);
        check_shape(op, p[3], {n, gh}, name + "b_hh", "[N, G*H]", input);
      }
      if (proj_size > 0) check_shape(op, p[per_dir - 1], {n, proj_size, hidden}, name + "w_hr", "[N, proj_size, H]", input);
    }
  }
  const int64_t states = mode == Mode::LSTM ? 2 : 1;
  TORCH_CHECK(hx.empty() || static_cast<int64_t>(hx.size()) == states, op, ": expected hx ",
              mode == Mode::LSTM ? "[h0, c0]" : "[h0]", " or an empty list (zeros) for mode ",
              mode_name(mode), ", got ", hx.size(), " tensors");

  if (strategy == "loop" && n != 0) {
    return rnn_loop(mode, input, hx, params, num_layers, bidirectional, batch_first, dropout, train,
                    has_biases, h_out, hidden, batch);
  }

  // Initial states per layer and direction, [N, B, H_out] / [N, B, H].
  std::vector<at::Tensor> h0s, c0s;
  if (hx.empty()) {
    const at::Tensor h0 = at::zeros_symint({n, batch, h_out}, input.options());
    h0s.assign(num_layers * dirs, h0);
    if (mode == Mode::LSTM) {
      c0s.assign(num_layers * dirs, proj_size > 0 ? at::zeros_symint({n, batch, hidden}, input.options()) : h0);
    }
  } else {
    check_shape(op, hx[0], {n, c10::SymInt(num_layers * dirs), batch, h_out}, "h0", "[N, L*D, B, H_out]", input);
    h0s = hx[0].unbind(1);
    if (mode == Mode::LSTM) {
      check_shape(op, hx[1], {n, c10::SymInt(num_layers * dirs), batch, hidden}, "c0", "[N, L*D, B, H]", input);
      c0s = hx[1].unbind(1);
    }
  }

  std::vector<at::Tensor> h_n, c_n;
  at::Tensor layer_in = input;  // layer 0 in the caller's layout, later layers time-major
  bool in_batch_first = batch_first;
  for (int64_t l = 0; l < num_layers; ++l) {
    std::vector<at::Tensor> dir_outs;
    for (int64_t d = 0; d < dirs; ++d) {
      const int64_t k = l * dirs + d;
      const at::Tensor* p = params.data() + k * per_dir;
      const at::Tensor& w_ih = p[0];
      const at::Tensor& w_hh = p[1];
      const at::Tensor w_hr = proj_size > 0 ? p[per_dir - 1] : at::Tensor();
      at::Tensor x_bias, b_hh_gru;
      if (has_biases) {
        x_bias = mode == Mode::GRU ? p[2] : p[2].add(p[3]);
        if (mode == Mode::GRU) b_hh_gru = p[3].unsqueeze(1);
      }
      at::Tensor xw = project_input(layer_in, w_ih, x_bias);  // [N, A, C, G*H]
      if (in_batch_first) xw = xw.transpose(1, 2);             // [N, T, B, G*H]
      const std::vector<at::Tensor> xw_steps = xw.unbind(1);

      at::Tensor h = h0s[k];
      at::Tensor c = mode == Mode::LSTM ? c0s[k] : at::Tensor();
      std::vector<at::Tensor> outs(steps);
      for (int64_t s = 0; s < steps; ++s) {
        const int64_t t = d == 0 ? s : steps - 1 - s;
        State next = cell_step(mode, xw_steps[t], h, c, w_hh, b_hh_gru, w_hr);
        h = std::move(next.h);
        c = std::move(next.c);
        outs[t] = h;
      }
      h_n.push_back(h);
      if (mode == Mode::LSTM) c_n.push_back(c);
      dir_outs.push_back(at::stack(outs, 1));  // [N, T, B, H_out]
    }
    at::Tensor layer_out = dirs == 2 ? at::cat(dir_outs, 3) : dir_outs[0];
    if (train && dropout > 0 && l + 1 < num_layers) layer_out = at::dropout(layer_out, dropout, true);
    layer_in = std::move(layer_out);
    in_batch_first = false;
  }
  at::Tensor output = batch_first ? layer_in.transpose(1, 2) : layer_in;
  std::vector<at::Tensor> final_states{at::stack(h_n, 1)};
  if (mode == Mode::LSTM) final_states.push_back(at::stack(c_n, 1));
  return {std::move(output), std::move(final_states)};
}

std::vector<at::Tensor> rnn_cell_impl(const at::Tensor& input, at::TensorList hx, const at::Tensor& w_ih,
                                      const at::Tensor& w_hh, const std::optional<at::Tensor>& b_ih,
                                      const std::optional<at::Tensor>& b_hh, std::string_view mode_str) {
  constexpr const char* op = "wide::rnn_cell";
  const Mode mode = parse_mode(mode_str, op);
  TORCH_CHECK(input.dim() == 2 || input.dim() == 3, op, ": expected input of shape [N, B, I] or [N, I], got ",
              input.sym_sizes());
  TORCH_CHECK(c10::isFloatingType(input.scalar_type()), op, ": expected a floating-point input, got ",
              input.scalar_type());
  const bool batched = input.dim() == 3;
  const int64_t gates = gate_count(mode);
  TORCH_CHECK(w_ih.dim() == 3 && w_ih.sym_size(1) % gates == 0, op,
              ": expected w_ih of shape [N, G*H, I] with G = ", gates, " for ", mode_name(mode), ", got ",
              w_ih.sym_sizes());
  const c10::SymInt n = input.sym_size(0), gh = w_ih.sym_size(1), hidden = gh / gates;
  check_shape(op, w_ih, {n, gh, input.sym_size(-1)}, "w_ih", "[N, G*H, I]", input);
  check_shape(op, w_hh, {n, gh, hidden}, "w_hh", "[N, G*H, H]", input);
  if (b_ih.has_value()) check_shape(op, *b_ih, {n, gh}, "b_ih", "[N, G*H]", input);
  if (b_hh.has_value()) check_shape(op, *b_hh, {n, gh}, "b_hh", "[N, G*H]", input);
  const size_t states = mode == Mode::LSTM ? 2 : 1;
  TORCH_CHECK(hx.empty() || hx.size() == states, op, ": expected hx ", mode == Mode::LSTM ? "[h, c]" : "[h]",
              " or an empty list (zeros) for mode ", mode_name(mode), ", got ", hx.size(), " tensors");

  const at::Tensor x = batched ? input : input.unsqueeze(1);  // [N, B, I]
  const c10::SymInt batch = x.sym_size(1);
  std::vector<c10::SymInt> state_shape{n, batch, hidden};
  const char* pattern = "[N, B, H]";
  if (!batched) {
    state_shape.erase(state_shape.begin() + 1);
    pattern = "[N, H]";
  }
  at::Tensor h, c;
  if (hx.empty()) {
    h = at::zeros_symint({n, batch, hidden}, input.options());
    if (mode == Mode::LSTM) c = h;
  } else {
    check_shape(op, hx[0], state_shape, "h", pattern, input);
    h = batched ? hx[0] : hx[0].unsqueeze(1);
    if (mode == Mode::LSTM) {
      check_shape(op, hx[1], state_shape, "c", pattern, input);
      c = batched ? hx[1] : hx[1].unsqueeze(1);
    }
  }

  const at::Tensor x_bias = mode == Mode::GRU ? (b_ih.has_value() ? *b_ih : at::Tensor()) : opt_sum(b_ih, b_hh);
  const at::Tensor b_hh_gru = mode == Mode::GRU && b_hh.has_value() ? b_hh->unsqueeze(1) : at::Tensor();
  const at::Tensor xw = gemm_nt(x, w_ih, x_bias.defined() ? x_bias.unsqueeze(1) : at::Tensor());
  State next = cell_step(mode, xw, h, c, w_hh, b_hh_gru, at::Tensor());
  std::vector<at::Tensor> result{batched ? next.h : next.h.squeeze(1)};
  if (mode == Mode::LSTM) result.push_back(batched ? next.c : next.c.squeeze(1));
  return result;
}

} // namespace

std::tuple<at::Tensor, std::vector<at::Tensor>> rnn(const at::Tensor& input, at::TensorList hx,
                                                    at::TensorList params, std::string_view mode,
                                                    int64_t num_layers, bool bidirectional,
                                                    bool batch_first, double dropout, bool train,
                                                    bool has_biases, int64_t proj_size,
                                                    std::string_view strategy) {
  return detail::call_op<"wide::rnn", decltype(rnn)>(
      input, hx, params, mode, num_layers, bidirectional, batch_first, dropout, train, has_biases,
      proj_size, strategy);
}

std::vector<at::Tensor> rnn_cell(const at::Tensor& input, at::TensorList hx, const at::Tensor& w_ih,
                                 const at::Tensor& w_hh, const std::optional<at::Tensor>& b_ih,
                                 const std::optional<at::Tensor>& b_hh, std::string_view mode) {
  return detail::call_op<"wide::rnn_cell", decltype(rnn_cell)>(
      input, hx, w_ih, w_hh, b_ih, b_hh, mode);
}

} // namespace wide

TORCH_LIBRARY_IMPL(wide, CompositeImplicitAutograd, m) {
  m.impl("rnn", &wide::rnn_impl);
  m.impl("rnn_cell", &wide::rnn_cell_impl);
}
