// wide::nn modules and wide::optim::{Adam, SGD} (the C++ module API) against N separate LibTorch
// modules and torch::optim: outputs, input and parameter gradients, buffers after a train step,
// eval mode, round trips back to ordinary modules, per-member optimizer steps, and the errors.
#include <gtest/gtest.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/modules/rnn.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <functional>
#include <string>
#include <vector>

#include "wide/nn/modules.h"
#include "wide/optim/optimizer.h"
#include "wide_test_utils.h"

namespace {

namespace tnn = torch::nn;
using wide_test::expect_error;

constexpr double kRtol = 1e-5, kAtol = 1e-6;  // float32: only the reduction order differs

void expect_close(const torch::Tensor& a, const torch::Tensor& b, const std::string& what) {
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  EXPECT_TRUE(torch::allclose(a, b, kRtol, kAtol)) << what << ": max diff "
                                                   << (a - b).abs().max().item<double>();
}

template <typename Holder, typename Make>
std::vector<Holder> make_members(int64_t n, Make make) {
  std::vector<Holder> out;
  for (int64_t i = 0; i < n; ++i) out.push_back(make(i));
  return out;
}

// Runs member i on input.select(0, i) and the wide module on input; compares outputs, the input
// gradient and every parameter's gradient (a loss with a different weight per output element).
template <typename Holder, typename Wide>
void check_forward_backward(std::vector<Holder>& members, Wide& wide, const torch::Tensor& input,
                            const std::string& what) {
  const bool float_input = input.is_floating_point();
  torch::Tensor x = float_input ? input.detach().clone().requires_grad_() : input;
  torch::Tensor y = wide->forward(x);
  torch::Tensor g = torch::randn_like(y);
  (y * g).sum().backward();
  for (size_t i = 0; i < members.size(); ++i) {
    torch::Tensor xi = float_input ? input[i].detach().clone().requires_grad_() : input[i];
    torch::Tensor yi = members[i]->forward(xi);
    expect_close(y[i], yi, what + " output of member " + std::to_string(i));
    (yi * g[i]).sum().backward();
    if (float_input) expect_close(x.grad()[i], xi.grad(), what + " input grad " + std::to_string(i));
    for (const auto& p : members[i]->named_parameters()) {
      const torch::Tensor& wg = wide->named_parameters()[p.key()].grad();
      expect_close(wg[i], p.value().grad(), what + " grad of " + p.key() + " member " + std::to_string(i));
    }
  }
}

TEST(WideNN, LinearMatchesMembersAndRoundTrips) {
  torch::manual_seed(0);
  auto members = make_members<tnn::Linear>(3, [](int64_t) { return tnn::Linear(5, 4); });
  auto wide = wide::nn::from_modules(members);
  EXPECT_EQ(wide->n(), 3);
  EXPECT_EQ(wide->weight.sizes(), (std::vector<int64_t>{3, 4, 5}));
  check_forward_backward(members, wide, torch::randn({3, 2, 7, 5}), "Linear");
  auto back = wide->unfuse();
  for (size_t i = 0; i < members.size(); ++i) {
    EXPECT_TRUE(torch::equal(back[i]->weight, members[i]->weight));
    EXPECT_TRUE(torch::equal(back[i]->bias, members[i]->bias));
    EXPECT_FALSE(back[i]->weight.is_same(members[i]->weight));
  }
  // A wide module built from options starts as N separately initialised modules would: distinct.
  wide::nn::Linear fresh(4, tnn::LinearOptions(5, 4).bias(false));
  EXPECT_FALSE(fresh->bias.defined());
  EXPECT_FALSE(torch::equal(fresh->weight[0], fresh->weight[1]));
  EXPECT_EQ(fresh->forward(torch::randn({4, 2, 5})).sizes(), (std::vector<int64_t>{4, 2, 4}));
}

TEST(WideNN, LinearCloneIsDeepAndDtypeFollowsMembers) {
  auto members = make_members<tnn::Linear>(2, [](int64_t) {
    tnn::Linear m(3, 2);
    m->to(torch::kDouble);
    return m;
  });
  auto wide = wide::nn::from_modules(members);
  EXPECT_EQ(wide->weight.scalar_type(), torch::kDouble);
  auto copy = std::dynamic_pointer_cast<wide::nn::LinearImpl>(wide->clone());
  ASSERT_TRUE(copy);
  EXPECT_TRUE(torch::equal(copy->weight, wide->weight));
  EXPECT_FALSE(copy->weight.is_same(wide->weight));
  torch::Tensor x = torch::randn({2, 4, 3}, torch::kDouble);
  EXPECT_TRUE(torch::allclose(copy->forward(x), wide->forward(x)));
}

TEST(WideNN, Conv2dMatchesMembers) {
  torch::manual_seed(1);
  for (auto opts : {tnn::Conv2dOptions(3, 4, 3).stride(2).padding(1),
                    tnn::Conv2dOptions(4, 6, {2, 3}).padding(torch::kSame).groups(2),
                    tnn::Conv2dOptions(3, 2, 1).bias(false)}) {
    auto members = make_members<tnn::Conv2d>(3, [&](int64_t) { return tnn::Conv2d(opts); });
    auto wide = wide::nn::from_modules(members);
    check_forward_backward(members, wide, torch::randn({3, 2, opts.in_channels(), 7, 6}), "Conv2d");
  }
}

TEST(WideNN, BatchNorm2dTrainStepUpdatesEachMembersStatisticsAndEvalUsesThem) {
  torch::manual_seed(2);
  auto members = make_members<tnn::BatchNorm2d>(3, [](int64_t i) {
    tnn::BatchNorm2d m(tnn::BatchNormOptions(4).momentum(0.3));
    torch::NoGradGuard g;
    m->weight.uniform_(0.5, 1.5);
    m->bias.normal_();
    m->running_mean.normal_();
    m->running_var.uniform_(0.5, 2.0 + i);
    return m;
  });
  auto wide = wide::nn::from_modules(members);
  // Each member its own input scale: the statistics differ per member.
  torch::Tensor x = torch::randn({3, 5, 4, 3, 3}) * torch::arange(1, 4).view({3, 1, 1, 1, 1});
  check_forward_backward(members, wide, x, "BatchNorm2d train");
  for (int64_t i = 0; i < 3; ++i) {
    expect_close(wide->running_mean[i], members[i]->running_mean, "running_mean");
    expect_close(wide->running_var[i], members[i]->running_var, "running_var");
    EXPECT_EQ(wide->num_batches_tracked[i].item<int64_t>(), members[i]->num_batches_tracked.item<int64_t>());
  }
  wide->eval();
  for (auto& m : members) m->eval();
  torch::NoGradGuard g;
  torch::Tensor y = wide->forward(x);
  for (int64_t i = 0; i < 3; ++i) expect_close(y[i], members[i]->forward(x[i]), "BatchNorm2d eval");
  auto back = wide->unfuse();
  EXPECT_FALSE(back[0]->is_training());
  EXPECT_TRUE(torch::equal(back[2]->running_var, wide->running_var[2]));
}

TEST(WideNN, LayerNormAndEmbeddingMatchMembers) {
  torch::manual_seed(3);
  auto norms = make_members<tnn::LayerNorm>(4, [](int64_t) {
    tnn::LayerNorm m(tnn::LayerNormOptions({3, 5}).eps(1e-4));
    torch::NoGradGuard g;
    m->weight.normal_();
    m->bias.normal_();
    return m;
  });
  auto wide_norm = wide::nn::from_modules(norms);
  check_forward_backward(norms, wide_norm, torch::randn({4, 2, 3, 5}), "LayerNorm");

  auto tables = make_members<tnn::Embedding>(3, [](int64_t) {
    return tnn::Embedding(tnn::EmbeddingOptions(10, 4).padding_idx(-1));
  });
  auto wide_table = wide::nn::from_modules(tables);
  torch::Tensor idx = torch::randint(0, 10, {3, 2, 6});
  idx.index_put_({0, 0, 0}, 9);  // the padding row gets no gradient
  check_forward_backward(tables, wide_table, idx, "Embedding");
  EXPECT_EQ(wide_table->weight.grad()[0][9].abs().sum().item<double>(), 0.0);
}

TEST(WideNN, LstmAndGruMatchMembers) {
  torch::manual_seed(4);
  for (bool batch_first : {false, true}) {
    auto opts = tnn::LSTMOptions(3, 5).num_layers(2).bidirectional(true).batch_first(batch_first);
    auto lstms = make_members<tnn::LSTM>(3, [&](int64_t) { return tnn::LSTM(opts); });
    auto wide = wide::nn::from_modules(lstms);
    torch::Tensor x = torch::randn({3, 4, 2, 3});
    auto [y, state] = wide->forward(x);
    for (int64_t i = 0; i < 3; ++i) {
      auto [yi, si] = lstms[i]->forward(x[i]);
      expect_close(y[i], yi, "LSTM output");
      expect_close(std::get<0>(state)[i], std::get<0>(si), "LSTM h_n");
      expect_close(std::get<1>(state)[i], std::get<1>(si), "LSTM c_n");
    }
    // With an initial state, through the module's forward (the state is N-first too).
    torch::Tensor h0 = torch::randn({3, 4, batch_first ? 4 : 2, 5}), c0 = torch::randn_like(h0);
    auto [y2, s2] = wide->forward(x, std::make_tuple(h0, c0));
    auto [y2_0, s2_0] = lstms[1]->forward(x[1], std::make_tuple(h0[1], c0[1]));
    expect_close(y2[1], y2_0, "LSTM output with hx");
  }
  auto grus = make_members<tnn::GRU>(2, [](int64_t) { return tnn::GRU(tnn::GRUOptions(3, 4)); });
  auto wide_gru = wide::nn::from_modules(grus);
  torch::Tensor x = torch::randn({2, 5, 3, 3}).requires_grad_();
  auto [y, h] = wide_gru->forward(x);
  (y.sum() + h.sum()).backward();
  for (int64_t i = 0; i < 2; ++i) {
    torch::Tensor xi = x[i].detach().requires_grad_();
    auto [yi, hi] = grus[i]->forward(xi);
    expect_close(y[i], yi, "GRU output");
    expect_close(h[i], hi, "GRU h_n");
    (yi.sum() + hi.sum()).backward();
    expect_close(x.grad()[i], xi.grad(), "GRU input grad");
    expect_close(wide_gru->named_parameters()["weight_hh_l0"].grad()[i], grus[i]->named_parameters()["weight_hh_l0"].grad(),
                 "GRU weight_hh grad");
  }
}

TEST(WideNN, FromModulesRefusesMembersThatDiffer) {
  std::vector<tnn::Linear> linears{tnn::Linear(3, 2), tnn::Linear(3, 2), tnn::Linear(4, 2)};
  expect_error([&] { wide::nn::from_modules(linears); }, "member 2 differs from member 0 in in_features");
  std::vector<tnn::Conv2d> convs{tnn::Conv2d(tnn::Conv2dOptions(2, 2, 3)),
                                 tnn::Conv2d(tnn::Conv2dOptions(2, 2, 3).stride(2))};
  expect_error([&] { wide::nn::from_modules(convs); }, "member 1 differs from member 0 in stride");
  expect_error([&] { wide::nn::from_modules(std::vector<tnn::Linear>{}); }, "at least one member");
  std::vector<tnn::Linear> mixed{tnn::Linear(3, 2), tnn::Linear(3, 2)};
  mixed[1]->to(torch::kDouble);
  expect_error([&] { wide::nn::from_modules(mixed); }, "member 1 weight is Double");
  expect_error([] { wide::nn::Conv2d(2, tnn::Conv2dOptions(2, 2, 3).padding_mode(torch::kCircular)); },
               "only padding_mode zeros");
  auto wide = wide::nn::from_modules(std::vector<tnn::Conv2d>{tnn::Conv2d(2, 3, 3), tnn::Conv2d(2, 3, 3)});
  expect_error([&] { wide->forward(torch::randn({3, 1, 2, 5, 5})); }, "expected an N-first input [2, B, 2, H, W]");
}

// Per-member Adam / SGD on a wide Linear against torch::optim on each member, over several steps.
template <typename WideOpt, typename MakeTorchOpt>
void check_optimizer(WideOpt make_wide_opt, MakeTorchOpt make_torch_opt, const std::string& what) {
  torch::manual_seed(5);
  const int64_t n = 3;
  auto members = make_members<tnn::Linear>(n, [](int64_t) { return tnn::Linear(4, 3); });
  auto wide = wide::nn::from_modules(members);
  auto opt = make_wide_opt(wide->parameters());
  std::vector<std::unique_ptr<torch::optim::Optimizer>> refs;
  for (int64_t i = 0; i < n; ++i) refs.push_back(make_torch_opt(members[i]->parameters(), i));
  for (int step = 0; step < 4; ++step) {
    torch::Tensor x = torch::randn({n, 5, 4});
    wide->forward(x).pow(2).sum().backward();
    opt.step();
    opt.zero_grad();
    for (int64_t i = 0; i < n; ++i) {
      members[i]->forward(x[i]).pow(2).sum().backward();
      refs[i]->step();
      refs[i]->zero_grad();
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    expect_close(wide->weight[i], members[i]->weight, what + " weight of member " + std::to_string(i));
    expect_close(wide->bias[i], members[i]->bias, what + " bias of member " + std::to_string(i));
  }
  EXPECT_FALSE(wide->weight.grad().defined());
}

TEST(WideOptim, AdamMatchesTorchOptimPerMember) {
  const std::vector<double> lr{1e-3, 1e-2, 5e-2}, wd{0.0, 0.1, 0.01}, b1{0.9, 0.8, 0.5};
  for (bool decoupled : {false, true}) {
    for (bool amsgrad : {false, true}) {
      check_optimizer(
          [&](std::vector<torch::Tensor> p) {
            return wide::optim::Adam(p, wide::optim::AdamOptions().lr(lr).weight_decay(wd)
                                            .betas(b1, {0.999}).amsgrad(amsgrad)
                                            .decoupled_weight_decay(decoupled));
          },
          [&](std::vector<torch::Tensor> p, int64_t i) -> std::unique_ptr<torch::optim::Optimizer> {
            if (decoupled) {
              return std::make_unique<torch::optim::AdamW>(p, torch::optim::AdamWOptions(lr[i])
                  .weight_decay(wd[i]).betas({b1[i], 0.999}).amsgrad(amsgrad));
            }
            return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(lr[i])
                .weight_decay(wd[i]).betas({b1[i], 0.999}).amsgrad(amsgrad));
          },
          std::string("Adam decoupled=") + (decoupled ? "1" : "0") + " amsgrad=" + (amsgrad ? "1" : "0"));
    }
  }
}

TEST(WideOptim, SgdMatchesTorchOptimPerMember) {
  const std::vector<double> lr{1e-2, 5e-2, 1e-1}, momentum{0.0, 0.9, 0.5};
  check_optimizer(
      [&](std::vector<torch::Tensor> p) {
        return wide::optim::SGD(p, wide::optim::SGDOptions().lr(lr).momentum(momentum).weight_decay({1e-3}));
      },
      [&](std::vector<torch::Tensor> p, int64_t i) -> std::unique_ptr<torch::optim::Optimizer> {
        return std::make_unique<torch::optim::SGD>(
            p, torch::optim::SGDOptions(lr[i]).momentum(momentum[i]).weight_decay(1e-3));
      },
      "SGD");
  check_optimizer(
      [&](std::vector<torch::Tensor> p) {
        return wide::optim::SGD(p, wide::optim::SGDOptions().lr(lr).momentum({0.9, 0.8, 0.7}).nesterov(true));
      },
      [&](std::vector<torch::Tensor> p, int64_t i) -> std::unique_ptr<torch::optim::Optimizer> {
        return std::make_unique<torch::optim::SGD>(
            p, torch::optim::SGDOptions(lr[i]).momentum(0.9 - 0.1 * i).nesterov(true));
      },
      "SGD nesterov");
}

TEST(WideOptim, MemberAccessCopyAndErrors) {
  auto wide = wide::nn::Linear(3, tnn::LinearOptions(2, 2));
  wide::optim::Adam opt(wide->parameters(), wide::optim::AdamOptions().lr({0.1, 0.2, 0.3}));
  EXPECT_EQ(opt.n(), 3);
  EXPECT_DOUBLE_EQ(opt.get("lr", 1), 0.2);
  opt.set("lr", -1, 0.5);
  EXPECT_DOUBLE_EQ(opt.get("lr", 2), 0.5);
  wide->forward(torch::randn({3, 4, 2})).sum().backward();
  opt.step();
  opt.copy_member(2, 0);
  EXPECT_DOUBLE_EQ(opt.get("lr", 0), 0.5);
  const auto& state = opt.state(0);
  EXPECT_TRUE(torch::equal(state.at("exp_avg")[0], state.at("exp_avg")[2]));
  EXPECT_FALSE(torch::equal(state.at("exp_avg")[0], state.at("exp_avg")[1]));
  expect_error([&] { opt.set("lr", 0, -1.0); }, "member 0 has lr = -1");
  expect_error([&] { opt.get("momentum", 0); }, "no hyperparameter 'momentum'");
  expect_error([&] { opt.get("lr", 3); }, "member index 3 out of range for 3 members");
  expect_error([&] { wide::optim::Adam(wide->parameters(), wide::optim::AdamOptions().lr({0.1, 0.2})); },
               "lr needs one value or one per member (3), got 2");
  expect_error([] { wide::optim::SGD({torch::zeros({2, 3}), torch::zeros({3, 3})}); },
               "parameter 1 holds 3 members; parameter 0 holds 2");
  expect_error([&] { wide::optim::SGD(wide->parameters(), wide::optim::SGDOptions().nesterov(true)); },
               "nesterov momentum requires momentum > 0");
}

// The README's C++ snippet ("The C++ API"), as written there: keep the two in sync.
TEST(WideNN, ReadmeSnippet) {
  std::vector<torch::nn::Linear> members;                    // N models' layers, as you have them
  for (int i = 0; i < 8; ++i) members.emplace_back(16, 1);
  auto wide = wide::nn::from_modules(members);               // one batched GEMM for all 8
  wide::optim::Adam opt(wide->parameters(), wide::optim::AdamOptions().lr({1e-4, 3e-4, 1e-3, 3e-3,
                                                                          1e-2, 3e-2, 1e-1, 3e-1}));
  torch::Tensor x = torch::randn({128, 16}), y = torch::randn({128, 1});
  torch::Tensor loss = (wide(x.expand({8, 128, 16})) - y).pow(2).mean({1, 2});  // [8]: one per member
  loss.sum().backward();
  opt.step();
  EXPECT_EQ(loss.sizes(), (std::vector<int64_t>{8}));
  for (int i = 0; i < 8; ++i) {
    EXPECT_FALSE(torch::equal(wide->weight[i], members[i]->weight)) << "member " << i << " did not move";
  }
}

}  // namespace
