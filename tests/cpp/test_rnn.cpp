// wide::rnn / wide::rnn_cell (public C++ API, through the dispatcher), against references written
// with plain ATen calls per member: at::lstm / at::gru / at::rnn_tanh / at::rnn_relu on member n's
// slices of the input, states and every stacked parameter (and at::lstm_cell / at::gru_cell /
// at::rnn_{tanh,relu}_cell for the cell). Outputs, final states and the gradients of the input, the
// initial states and every parameter are compared; the reference runs on its own leaf copies.
#include <ATen/ops/allclose.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/gru.h>
#include <ATen/ops/gru_cell.h>
#include <ATen/ops/lstm.h>
#include <ATen/ops/lstm_cell.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/randn_like.h>
#include <ATen/ops/rnn_relu.h>
#include <ATen/ops/rnn_relu_cell.h>
#include <ATen/ops/rnn_tanh.h>
#include <ATen/ops/rnn_tanh_cell.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "wide/ops/rnn.h"
#include "wide_test_utils.h"

namespace {

using namespace wide_test;

constexpr int64_t kN = 3, kT = 4, kB = 2, kI = 5, kH = 4;

int64_t gate_count(const std::string& mode) { return mode == "LSTM" ? 4 : mode == "GRU" ? 3 : 1; }

at::Tensor leaf(const Ints& shape) { return at::randn(shape, f64()).mul(0.5).requires_grad_(true); }
at::Tensor leaf_copy(const at::Tensor& t) { return t.detach().clone().requires_grad_(true); }
std::vector<at::Tensor> leaf_copies(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  for (const auto& t : ts) out.push_back(leaf_copy(t));
  return out;
}
std::vector<at::Tensor> members(const std::vector<at::Tensor>& ts, int64_t n) {
  std::vector<at::Tensor> out;
  for (const auto& t : ts) out.push_back(t.select(0, n));
  return out;
}

struct Config {
  std::string mode;
  int64_t layers;
  bool bidirectional, batch_first, biases, hx_given;
  int64_t proj;
  std::string strategy = "fused";
  int64_t dirs() const { return bidirectional ? 2 : 1; }
  int64_t h_out() const { return proj > 0 ? proj : kH; }
};

// Stacked _flat_weights: per layer and direction w_ih, w_hh[, b_ih, b_hh][, w_hr].
std::vector<at::Tensor> make_params(const Config& c, int64_t n = kN) {
  const int64_t gh = gate_count(c.mode) * kH;
  std::vector<at::Tensor> params;
  for (int64_t l = 0; l < c.layers; ++l) {
    for (int64_t d = 0; d < c.dirs(); ++d) {
      params.push_back(leaf({n, gh, l == 0 ? kI : c.dirs() * c.h_out()}));
      params.push_back(leaf({n, gh, c.h_out()}));
      if (c.biases) {
        params.push_back(leaf({n, gh}));
        params.push_back(leaf({n, gh}));
      }
      if (c.proj > 0) params.push_back(leaf({n, c.proj, kH}));
    }
  }
  return params;
}

at::Tensor make_input(const Config& c, int64_t n = kN, int64_t b = kB) {
  return leaf(c.batch_first ? Ints{n, b, kT, kI} : Ints{n, kT, b, kI});
}

std::vector<at::Tensor> make_hx(const Config& c, int64_t n = kN, int64_t b = kB) {
  std::vector<at::Tensor> hx{leaf({n, c.layers * c.dirs(), b, c.h_out()})};
  if (c.mode == "LSTM") hx.push_back(leaf({n, c.layers * c.dirs(), b, kH}));
  return hx;
}

// A config's input, initial states and parameters, detached from autograd: for the tests that
// call the op itself rather than compare gradients.
struct Detached {
  at::Tensor x;
  std::vector<at::Tensor> hx, params;
};

Detached make_detached(const Config& c) {
  Detached d{make_input(c).detach(), {}, {}};
  for (const auto& p : make_params(c)) d.params.push_back(p.detach());
  for (const auto& h : make_hx(c)) d.hx.push_back(h.detach());
  return d;
}

// Member by member with torch's own ops; hx must be given (zeros stand for an empty list).
std::tuple<at::Tensor, std::vector<at::Tensor>> reference(const Config& c, const at::Tensor& x,
                                                          const std::vector<at::Tensor>& hx,
                                                          const std::vector<at::Tensor>& params,
                                                          double dropout = 0, bool train = false) {
  std::vector<at::Tensor> outs, hs, cs;
  for (int64_t n = 0; n < x.size(0); ++n) {
    const std::vector<at::Tensor> p = members(params, n);
    const at::Tensor xn = x.select(0, n), h0 = hx[0].select(0, n);
    at::Tensor o, h, cn;
    if (c.mode == "LSTM") {
      std::tie(o, h, cn) = at::lstm(xn, {h0, hx[1].select(0, n)}, p, c.biases, c.layers, dropout, train,
                                    c.bidirectional, c.batch_first);
      cs.push_back(cn);
    } else if (c.mode == "GRU") {
      std::tie(o, h) = at::gru(xn, h0, p, c.biases, c.layers, dropout, train, c.bidirectional, c.batch_first);
    } else if (c.mode == "RNN_TANH") {
      std::tie(o, h) = at::rnn_tanh(xn, h0, p, c.biases, c.layers, dropout, train, c.bidirectional, c.batch_first);
    } else {
      std::tie(o, h) = at::rnn_relu(xn, h0, p, c.biases, c.layers, dropout, train, c.bidirectional, c.batch_first);
    }
    outs.push_back(o);
    hs.push_back(h);
  }
  std::vector<at::Tensor> states{at::stack(hs)};
  if (c.mode == "LSTM") states.push_back(at::stack(cs));
  return {at::stack(outs), states};
}

std::vector<at::Tensor> zero_hx(const Config& c, int64_t n = kN, int64_t b = kB) {
  std::vector<at::Tensor> hx{at::zeros({n, c.layers * c.dirs(), b, c.h_out()}, f64())};
  if (c.mode == "LSTM") hx.push_back(at::zeros({n, c.layers * c.dirs(), b, kH}, f64()));
  return hx;
}

std::tuple<at::Tensor, std::vector<at::Tensor>> run(const Config& c, const at::Tensor& x,
                                                    const std::vector<at::Tensor>& hx,
                                                    const std::vector<at::Tensor>& params,
                                                    double dropout = 0, bool train = false) {
  return wide::rnn(x, hx, params, c.mode, c.layers, c.bidirectional, c.batch_first, dropout, train,
                   c.biases, c.proj, c.strategy);
}

// mode, layers, bidirectional, batch_first, has_biases, hx given, proj_size (LSTM only), strategy
using Case = std::tuple<std::string, int64_t, bool, bool, bool, bool, int64_t, std::string>;

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (const char* mode : {"LSTM", "GRU", "RNN_TANH", "RNN_RELU"})
    for (int64_t layers : {1, 2})
      for (bool bidir : {false, true})
        for (bool bf : {false, true})
          for (bool biases : {false, true})
            for (bool hx : {false, true})
              for (int64_t proj : {0, 3})
                for (const char* strategy : {"fused", "loop"}) {
                  if (proj > 0 && std::string(mode) != "LSTM") continue;
                  cases.emplace_back(mode, layers, bidir, bf, biases, hx, proj, strategy);
                }
  return cases;
}

Config config(const Case& k) {
  const auto& [mode, layers, bidir, bf, biases, hx, proj, strategy] = k;
  return Config{mode, layers, bidir, bf, biases, hx, proj, strategy};
}

class WideRnnTest : public ::testing::TestWithParam<Case> {};

TEST_P(WideRnnTest, MatchesPerMemberReferenceWithGradients) {
  const Config c = config(GetParam());
  const at::Tensor x = make_input(c);
  const std::vector<at::Tensor> params = make_params(c);
  const std::vector<at::Tensor> hx = c.hx_given ? make_hx(c) : std::vector<at::Tensor>{};

  const auto [out, states] = run(c, x, hx, params);
  const at::Tensor x_ref = leaf_copy(x);
  const std::vector<at::Tensor> params_ref = leaf_copies(params);
  const std::vector<at::Tensor> hx_ref = c.hx_given ? leaf_copies(hx) : zero_hx(c);
  const auto [out_ref, states_ref] = reference(c, x_ref, hx_ref, params_ref);

  WIDE_EXPECT_CLOSE(out, out_ref);
  ASSERT_EQ(states.size(), states_ref.size());
  for (size_t k = 0; k < states.size(); ++k) WIDE_EXPECT_CLOSE(states[k], states_ref[k]);

  // One random linear functional of every result, so every gradient path is exercised.
  const at::Tensor g = at::randn_like(out);
  at::Tensor loss = out.mul(g).sum(), loss_ref = out_ref.mul(g).sum();
  for (size_t k = 0; k < states.size(); ++k) {
    const at::Tensor gs = at::randn_like(states[k]);
    loss = loss.add(states[k].mul(gs).sum());
    loss_ref = loss_ref.add(states_ref[k].mul(gs).sum());
  }
  loss.backward();
  loss_ref.backward();
  WIDE_EXPECT_CLOSE(x.grad(), x_ref.grad());
  for (size_t k = 0; k < params.size(); ++k) {
    SCOPED_TRACE("param " + std::to_string(k));
    ASSERT_TRUE(params[k].grad().defined());
    WIDE_EXPECT_CLOSE(params[k].grad(), params_ref[k].grad());
  }
  for (size_t k = 0; k < hx.size(); ++k) {
    SCOPED_TRACE("hx " + std::to_string(k));
    WIDE_EXPECT_CLOSE(hx[k].grad(), hx_ref[k].grad());
  }
}

INSTANTIATE_TEST_SUITE_P(Grid, WideRnnTest, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           const Config c = config(info.param);
                           return c.mode + "_L" + std::to_string(c.layers) +
                                  (c.bidirectional ? "_bidir" : "_uni") +
                                  (c.batch_first ? "_bf" : "_tf") + (c.biases ? "_bias" : "_nobias") +
                                  (c.hx_given ? "_hx" : "_nohx") + "_proj" + std::to_string(c.proj) + "_" + c.strategy;
                         });

TEST(WideRnn, DropoutInTrainMode) {
  // Identical members (same input, params and states): only the dropout masks can tell them apart.
  const Config c{"LSTM", 2, true, false, true, true, 0};
  const auto widen = [](const at::Tensor& t) {  // [1, ...] -> N equal members [N, ...]
    Ints sizes = t.sizes().vec();
    sizes[0] = kN;
    return t.detach().expand(sizes).contiguous();
  };
  std::vector<at::Tensor> params, hx;
  for (const auto& p : make_params(c, 1)) params.push_back(widen(p));
  for (const auto& h : make_hx(c, 1)) hx.push_back(widen(h));
  const at::Tensor x = widen(make_input(c, 1));

  const auto [out, states] = run(c, x, hx, params, 0.5, true);
  EXPECT_EQ(out.sizes(), (Ints{kN, kT, kB, 2 * kH}));
  EXPECT_EQ(states[0].sizes(), (Ints{kN, 4, kB, kH}));
  EXPECT_FALSE(at::allclose(out[0], out[1]));
  EXPECT_FALSE(at::allclose(out[1], out[2]));

  // Without dropout (p = 0 in train mode, or eval mode), identical members agree and match torch.
  const auto [out0, states0] = run(c, x, hx, params, 0.0, true);
  EXPECT_TRUE(at::allclose(out0[0], out0[1], kTol, kTol));
  WIDE_EXPECT_CLOSE(out0, std::get<0>(reference(c, x, hx, params)));
  const auto [out_eval, states_eval] = run(c, x, hx, params, 0.5, false);
  WIDE_EXPECT_CLOSE(out_eval, std::get<0>(reference(c, x, hx, params)));

  // One layer: dropout never applies (only between layers), as in torch.
  const Config c1{"GRU", 1, false, true, true, false, 0};
  const at::Tensor x1 = make_input(c1);
  const std::vector<at::Tensor> p1 = make_params(c1);
  WIDE_EXPECT_CLOSE(std::get<0>(run(c1, x1, {}, p1, 0.5, true)),
                    std::get<0>(reference(c1, x1, zero_hx(c1), p1)));
}

TEST(WideRnn, DropoutGradientFlows) {
  const Config c{"GRU", 2, false, false, true, false, 0};
  const at::Tensor x = make_input(c);
  const std::vector<at::Tensor> params = make_params(c);
  std::get<0>(run(c, x, {}, params, 0.3, true)).sum().backward();
  EXPECT_TRUE(x.grad().defined());
  for (const auto& p : params) EXPECT_TRUE(p.grad().defined());
}

TEST(WideRnn, EmptyBatch) {
  for (const char* mode : {"LSTM", "GRU"}) {
    const Config c{mode, 2, true, false, true, false, 0};
    const at::Tensor x = make_input(c, kN, 0);
    const auto [out, states] = run(c, x, {}, make_params(c));
    EXPECT_EQ(out.sizes(), (Ints{kN, kT, 0, 2 * kH})) << mode;
    for (const auto& s : states) EXPECT_EQ(s.sizes(), (Ints{kN, 4, 0, kH})) << mode;
  }
}

TEST(WideRnn, SingleMemberAndFloat32) {
  const Config c{"LSTM", 1, false, true, true, true, 0};
  std::vector<at::Tensor> params;
  for (const auto& p : make_params(c, 1)) params.push_back(p.detach().to(at::kFloat));
  std::vector<at::Tensor> hx;
  for (const auto& h : make_hx(c, 1)) hx.push_back(h.detach().to(at::kFloat));
  const at::Tensor x = make_input(c, 1).detach().to(at::kFloat);
  const auto [out, states] = run(c, x, hx, params);
  const auto [out_ref, states_ref] = reference(c, x, hx, params);
  EXPECT_TRUE(at::allclose(out, out_ref, 1e-5, 1e-5));
  EXPECT_TRUE(at::allclose(states[1], states_ref[1], 1e-5, 1e-5));
}

// The public C++ API (a typed dispatcher call) agrees with the boxed call Python makes.
TEST(WideRnn, CppApiMatchesDispatcher) {
  const Config c{"GRU", 2, true, false, true, true, 0};
  const auto [x, hx, params] = make_detached(c);
  const at::Tensor boxed = call_boxed("wide::rnn", x, hx, params, std::string("GRU"), int64_t{2}, true, false,
                                      0.0, false, true, int64_t{0}, std::string("auto"))
                               .toTensor();
  EXPECT_TRUE(at::allclose(std::get<0>(run(c, x, hx, params)), boxed, kTol, kTol));
}

void expect_rnn_error(const Config& c, const at::Tensor& x, const std::vector<at::Tensor>& hx,
                      const std::vector<at::Tensor>& params, const std::string& fragment) {
  expect_error([&] { run(c, x, hx, params); }, fragment);
}

TEST(WideRnn, Errors) {
  const Config c{"LSTM", 2, true, false, true, true, 0};
  const auto [x, hx, params] = make_detached(c);

  expect_error([&] { wide::rnn(x, hx, params, "LSTM", 2, true, false, 0, false, true, 0, "winograd"); },
               "wide::rnn: expected strategy \"auto\", \"fused\" or \"loop\", got \"winograd\"");
  expect_error([&] { wide::rnn(x, hx, params, "LSMT", 2, true, false, 0, false, true, 0); },
               "wide::rnn: expected mode 'LSTM', 'GRU', 'RNN_TANH' or 'RNN_RELU', got 'LSMT'");
  expect_rnn_error(c, x, hx, std::vector<at::Tensor>(params.begin(), params.end() - 1),
                   "expected 16 params (2 layers x 2 directions x 4: w_ih, w_hh, b_ih, b_hh), got 15");
  {
    std::vector<at::Tensor> bad = params;
    bad[4 + 1] = at::randn({kN, 4 * kH, kH + 1}, f64());  // layer 0 reverse w_hh
    expect_rnn_error(c, x, hx, bad, "expected layer 0 reverse w_hh of shape [N, G*H, H_out] = [3, 16, 4], got [3, 16, 5]");
    bad = params;
    bad[12 + 1] = at::randn({kN, 4 * kH, kH + 1}, f64());  // layer 1 reverse w_hh
    expect_rnn_error(c, x, hx, bad, "expected layer 1 reverse w_hh of shape");
    bad = params;
    bad[8] = at::randn({kN, 4 * kH, kI}, f64());  // layer 1 w_ih takes D*H_out = 8 features
    expect_rnn_error(c, x, hx, bad, "expected layer 1 w_ih of shape [N, G*H, I_l] = [3, 16, 8], got [3, 16, 5]");
    bad = params;
    bad[2] = at::randn({kN + 1, 4 * kH}, f64());
    expect_rnn_error(c, x, hx, bad, "expected layer 0 b_ih of shape [N, G*H] = [3, 16], got [4, 16]");
    bad = params;
    bad[3] = params[3].to(at::kFloat);
    expect_rnn_error(c, x, hx, bad, "expected layer 0 b_hh with the input's dtype and device");
  }
  expect_rnn_error(c, x.select(0, 0), hx, params, "expected input of shape [N, T, B, I] (4 dims), got [4, 2, 5]");
  expect_rnn_error(c, at::zeros({kN, kT, kB, kI}, at::kLong), hx, params, "expected a floating-point input, got Long");
  expect_rnn_error(c, make_input(c, kN + 1).detach(), {}, params, "expected layer 0 w_ih of shape [N, G*H, I_l] = [4, 16, 5], got [3, 16, 5]");
  expect_rnn_error(c, x.narrow(1, 0, 0), hx, params, "expected sequence length > 0");
  expect_rnn_error(c, x, {hx[0]}, params, "expected hx [h0, c0] or an empty list (zeros) for mode LSTM, got 1 tensors");
  expect_rnn_error(c, x, {hx[0], hx[1].narrow(3, 0, 3)}, params,
                   "expected c0 of shape [N, L*D, B, H] = [3, 4, 2, 4], got [3, 4, 2, 3]");
  expect_rnn_error(c, x, {hx[0].narrow(1, 0, 2), hx[1]}, params, "expected h0 of shape [N, L*D, B, H_out] = [3, 4, 2, 4], got [3, 2, 2, 4]");
  expect_error([&] { wide::rnn(x, {}, params, "GRU", 2, true, false, 0, false, true, 3); },
               "expected proj_size = 0 for mode GRU (projections are LSTM only), got 3");
  expect_error([&] { wide::rnn(x, {}, params, "LSTM", 2, true, false, 1.5, true, true, 0); },
               "expected dropout in [0, 1], got 1.5");
  expect_error([&] { wide::rnn(x, {}, params, "GRU", 2, true, false, 0, false, true, 0); },
               "expected layer 0 w_ih of shape [N, G*H, I] with G = 3 for GRU, got [3, 16, 5]");
  {
    const Config cp{"LSTM", 1, false, false, false, true, 3};
    const std::vector<at::Tensor> pp = make_params(cp);
    std::vector<at::Tensor> bad = pp;
    bad[2] = at::randn({kN, 3, kH + 1}, f64());
    expect_rnn_error(cp, x, {}, bad, "expected layer 0 w_hr of shape [N, proj_size, H] = [3, 3, 4], got [3, 3, 5]");
  }
}

// --- rnn_cell ---------------------------------------------------------------------------------------

// mode, batched input, biases (0 none, 1 b_ih only, 2 both), hx given
using CellCase = std::tuple<std::string, bool, int, bool>;

class WideRnnCellTest : public ::testing::TestWithParam<CellCase> {};

OptT opt_member(const OptT& t, int64_t n) { return t ? OptT(t->select(0, n)) : std::nullopt; }

TEST_P(WideRnnCellTest, MatchesPerMemberReferenceWithGradients) {
  const auto& [mode, batched, biases, hx_given] = GetParam();
  const int64_t gh = gate_count(mode) * kH;
  const at::Tensor x = leaf(batched ? Ints{kN, kB, kI} : Ints{kN, kI});
  const at::Tensor w_ih = leaf({kN, gh, kI}), w_hh = leaf({kN, gh, kH});
  const OptT b_ih = biases >= 1 ? OptT(leaf({kN, gh})) : std::nullopt;
  const OptT b_hh = biases >= 2 ? OptT(leaf({kN, gh})) : std::nullopt;
  const Ints state_shape = batched ? Ints{kN, kB, kH} : Ints{kN, kH};
  std::vector<at::Tensor> hx;
  if (hx_given) {
    hx.push_back(leaf(state_shape));
    if (mode == "LSTM") hx.push_back(leaf(state_shape));
  }
  const std::vector<at::Tensor> got = wide::rnn_cell(x, hx, w_ih, w_hh, b_ih, b_hh, mode);

  const at::Tensor x_r = leaf_copy(x), w_ih_r = leaf_copy(w_ih), w_hh_r = leaf_copy(w_hh);
  const OptT b_ih_r = b_ih ? OptT(leaf_copy(*b_ih)) : std::nullopt;
  const OptT b_hh_r = b_hh ? OptT(leaf_copy(*b_hh)) : std::nullopt;
  std::vector<at::Tensor> hx_r = leaf_copies(hx);
  if (!hx_given) {
    hx_r.push_back(at::zeros(state_shape, f64()));
    if (mode == "LSTM") hx_r.push_back(at::zeros(state_shape, f64()));
  }
  std::vector<at::Tensor> hs, cs;
  for (int64_t n = 0; n < kN; ++n) {
    // torch's cells take a batch: an unbatched member is a batch of one, as nn.*Cell does it.
    const auto m = [&](const at::Tensor& t) { return batched ? t.select(0, n) : t.select(0, n).unsqueeze(0); };
    const auto unm = [&](const at::Tensor& t) { return batched ? t : t.squeeze(0); };
    const at::Tensor xn = m(x_r), wi = w_ih_r.select(0, n), wh = w_hh_r.select(0, n);
    const OptT bi = opt_member(b_ih_r, n), bh = opt_member(b_hh_r, n);
    if (mode == "LSTM") {
      const auto [h, c] = at::lstm_cell(xn, {m(hx_r[0]), m(hx_r[1])}, wi, wh, bi, bh);
      hs.push_back(unm(h));
      cs.push_back(unm(c));
    } else if (mode == "GRU") {
      hs.push_back(unm(at::gru_cell(xn, m(hx_r[0]), wi, wh, bi, bh)));
    } else if (mode == "RNN_TANH") {
      hs.push_back(unm(at::rnn_tanh_cell(xn, m(hx_r[0]), wi, wh, bi, bh)));
    } else {
      hs.push_back(unm(at::rnn_relu_cell(xn, m(hx_r[0]), wi, wh, bi, bh)));
    }
  }
  std::vector<at::Tensor> want{at::stack(hs)};
  if (mode == "LSTM") want.push_back(at::stack(cs));
  ASSERT_EQ(got.size(), want.size());
  at::Tensor loss, loss_ref;
  for (size_t k = 0; k < got.size(); ++k) {
    WIDE_EXPECT_CLOSE(got[k], want[k]);
    const at::Tensor g = at::randn_like(want[k]);
    loss = k == 0 ? got[k].mul(g).sum() : loss.add(got[k].mul(g).sum());
    loss_ref = k == 0 ? want[k].mul(g).sum() : loss_ref.add(want[k].mul(g).sum());
  }
  loss.backward();
  loss_ref.backward();
  WIDE_EXPECT_CLOSE(x.grad(), x_r.grad());
  WIDE_EXPECT_CLOSE(w_ih.grad(), w_ih_r.grad());
  WIDE_EXPECT_CLOSE(w_hh.grad(), w_hh_r.grad());
  if (b_ih) WIDE_EXPECT_CLOSE(b_ih->grad(), b_ih_r->grad());
  if (b_hh) WIDE_EXPECT_CLOSE(b_hh->grad(), b_hh_r->grad());
  for (size_t k = 0; k < hx.size(); ++k) WIDE_EXPECT_CLOSE(hx[k].grad(), hx_r[k].grad());
}

INSTANTIATE_TEST_SUITE_P(Grid, WideRnnCellTest,
                         ::testing::Combine(::testing::Values("LSTM", "GRU", "RNN_TANH", "RNN_RELU"),
                                            ::testing::Bool(), ::testing::Values(0, 1, 2), ::testing::Bool()),
                         [](const ::testing::TestParamInfo<CellCase>& info) {
                           // (no structured binding: its commas would split the macro argument)
                           const CellCase& k = info.param;
                           return std::get<0>(k) + (std::get<1>(k) ? "_batched" : "_unbatched") +
                                  "_bias" + std::to_string(std::get<2>(k)) +
                                  (std::get<3>(k) ? "_hx" : "_nohx");
                         });

TEST(WideRnnCell, Errors) {
  const at::Tensor x = at::randn({kN, kB, kI}, f64());
  const at::Tensor w_ih = at::randn({kN, 4 * kH, kI}, f64()), w_hh = at::randn({kN, 4 * kH, kH}, f64());
  const at::Tensor h = at::randn({kN, kB, kH}, f64());
  const auto cell = [&](const at::Tensor& xi, std::vector<at::Tensor> hx, const at::Tensor& wi,
                        const at::Tensor& wh, const OptT& b, const char* mode) {
    return wide::rnn_cell(xi, hx, wi, wh, b, std::nullopt, mode);
  };
  expect_error([&] { cell(x, {h, h}, w_ih, w_hh, std::nullopt, "lstm"); },
               "wide::rnn_cell: expected mode 'LSTM', 'GRU', 'RNN_TANH' or 'RNN_RELU', got 'lstm'");
  expect_error([&] { cell(x, {h}, w_ih, w_hh, std::nullopt, "LSTM"); },
               "expected hx [h, c] or an empty list (zeros) for mode LSTM, got 1 tensors");
  expect_error([&] { cell(x.unsqueeze(0), {}, w_ih, w_hh, std::nullopt, "LSTM"); },
               "expected input of shape [N, B, I] or [N, I]");
  expect_error([&] { cell(x, {}, w_ih.narrow(1, 0, 15), w_hh, std::nullopt, "LSTM"); },
               "expected w_ih of shape [N, G*H, I] with G = 4 for LSTM, got [3, 15, 5]");
  expect_error([&] { cell(x, {}, w_ih, w_hh.narrow(0, 0, 2), std::nullopt, "LSTM"); },
               "expected w_hh of shape [N, G*H, H] = [3, 16, 4], got [2, 16, 4]");
  expect_error([&] { cell(x, {}, w_ih, w_hh, at::randn({kN, 12}, f64()), "LSTM"); },
               "expected b_ih of shape [N, G*H] = [3, 16], got [3, 12]");
  expect_error([&] { cell(x, {h.select(1, 0), h}, w_ih, w_hh, std::nullopt, "LSTM"); },
               "expected h of shape [N, B, H] = [3, 2, 4], got [3, 4]");
  expect_error([&] { cell(x.select(1, 0), {h, h}, w_ih, w_hh, std::nullopt, "LSTM"); },
               "expected h of shape [N, H] = [3, 4], got [3, 2, 4]");
  expect_error([&] { cell(x.to(at::kInt), {}, w_ih, w_hh, std::nullopt, "LSTM"); },
               "expected a floating-point input, got Int");
}

}  // namespace
