"""Adversarial cases: members that differ in hidden ways or share objects, stale caches, graphs
built outside forward. Each case was silently wrong or unclear before its fix."""
from __future__ import annotations

import functools
import json
import os

import pytest
import torch
import wide_compiler as wc
from support import LinearModel
from torch import nn
from torch.nn import functional as F
from wide_compiler import testing

FAST = wc.WideConfig.fast()


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


# --- members that are not independent ---------------------------------------------------------
def test_the_same_model_object_twice_is_refused():
    m = _mlp()
    with pytest.raises(wc.ArchitectureMismatchError, match="member 1 and member 0 share the same model object"):
        wc.compile([m, m], torch.randn(3, 4), config=FAST)


def test_a_submodule_shared_between_members_is_refused():
    shared = nn.Linear(8, 2)
    a, b = nn.Sequential(nn.Linear(4, 8), shared), nn.Sequential(nn.Linear(4, 8), shared)
    with pytest.raises(wc.ArchitectureMismatchError, match=r"member 1 and member 0 share one Linear object \('1'"):
        wc.compile([a, b], torch.randn(3, 4), config=FAST)


def test_a_parameter_shared_between_members_is_refused():
    a, b = _mlp(), _mlp()
    b[2].weight = a[2].weight
    with pytest.raises(wc.ArchitectureMismatchError, match=r"share one Parameter object \('2.weight'"):
        wc.compile([a, b], torch.randn(3, 4), config=FAST)


def test_a_weight_tied_inside_one_member_is_not_a_sharing_error():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(self.a(x))

    from wide_compiler.fx.member_checks import check_members
    check_members([Tied(), Tied()])  # no sharing error (tied parameters are the real-model issue's)


# --- hidden differences -----------------------------------------------------------------------
class _PartialAct(nn.Module):
    def __init__(self, slope):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = functools.partial(F.leaky_relu, negative_slope=slope)

    def forward(self, x):
        return self.act(self.fc(x))


def test_a_functools_partial_constant_is_compared():
    with pytest.raises(wc.ArchitectureMismatchError,
                       match=r"member 1: act is functools.partial\(.*negative_slope=0.2\), member 0 has .*0.1\)"):
        wc.compile([_PartialAct(0.1), _PartialAct(0.2)], torch.randn(3, 4), config=FAST)
    models = [_PartialAct(0.1), _PartialAct(0.1)]
    wide = wc.compile(models, torch.randn(3, 4), config=FAST)
    xs = torch.randn(2, 3, 4)
    testing.assert_members_close(wide(xs), [m(x) for m, x in zip(models, xs)])


class _Slots:
    __slots__ = ("sign",)

    def __init__(self, sign):
        self.sign = sign


class _SlotsModel(LinearModel):
    fields = ("cfg",)

    def forward(self, x):
        return self.fc(x) * self.cfg.sign


def test_state_kept_in_slots_is_compared():
    with pytest.raises(wc.ArchitectureMismatchError, match=r"member 1: cfg is"):
        wc.compile([_SlotsModel(_Slots(1.0)), _SlotsModel(_Slots(-1.0))], torch.randn(3, 4), config=FAST)


class _TensorAttr(nn.Module):
    def __init__(self, v):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.c = torch.tensor([1.0, v])

    def forward(self, x):
        return self.fc(x) * self.c.sum()


def test_a_differing_tensor_attribute_is_described_by_its_values():
    with pytest.raises(wc.ArchitectureMismatchError) as info:
        wc.compile([_TensorAttr(1.0), _TensorAttr(2.0)], torch.randn(3, 4), config=FAST)
    msg = str(info.value)
    assert "starting [1.0, 2.0]" in msg and "starting [1.0, 1.0]" in msg, msg


# --- caches and lazily built graphs -----------------------------------------------------------
def test_a_stale_cache_entry_naming_a_strategy_the_op_lacks_is_measured_again(tmp_path, caplog, monkeypatch):
    from support import steady_measuring_clock

    steady_measuring_clock(monkeypatch)  # every op measured within the budget, however busy the machine
    models = [_mlp() for _ in range(3)]
    config = wc.WideConfig(cache_dir=str(tmp_path), tune_repeats=1, tune_after_runs=0)
    wc.compile(models, torch.randn(3, 4), config=config)
    path = tmp_path / "strategies.json"
    entries = json.loads(path.read_text())
    assert entries
    # every op's entry names a strategy the op lacks (the model-level check's verdicts are not
    # op strategies: kept as they are)
    path.write_text(json.dumps({k: v if "model_check" in k else {**v, "strategy": "winograd"}
                                for k, v in entries.items()}))
    with caplog.at_level("WARNING", logger="wide_compiler"):
        wide = wc.compile(models, torch.randn(3, 4), config=config)
    assert set(wide.strategies.values()) <= {"bmm", "bmm_t", "loop"}
    assert "names 'winograd'" in caplog.text
    assert "winograd" not in path.read_text()  # the entry was replaced by the new measurement
    xs = torch.randn(3, 3, 4)
    testing.assert_members_close(wide(xs), [m(x) for m, x in zip(models, xs)])
    os.remove(path)


def test_eval_builds_its_graph_outside_forward_so_fullgraph_compile_works():
    models = [nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 2)) for _ in range(3)]
    wide = wc.compile(models, torch.randn(3, 4), config=FAST)  # train mode: only the train graph
    wide.eval()
    for m in models:
        m.eval()
    compiled = torch.compile(wide, fullgraph=True, backend="eager")
    xs = torch.randn(3, 5, 4)
    testing.assert_members_close(compiled(xs), [m(x) for m, x in zip(models, xs)])


# --- optimizers and schedulers -----------------------------------------------------------------
def _params(n=3):
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(n, 4, 2)), nn.Parameter(torch.randn(n, 4))]


def _grads(params):
    for p in params:
        p.grad = torch.ones_like(p)


def test_assigning_a_float_lr_by_hand_works_like_torch_optim():
    params = _params()
    opt = wc.optim.SGD(params, lr=0.1)
    opt.param_groups[0]["lr"] = 1e-2  # the manual-schedule idiom
    before = params[0].detach().clone()
    _grads(params)
    opt.step()
    torch.testing.assert_close(params[0].detach(), before - 1e-2)
    assert opt.param_groups[0]["lr"].tolist() == [1e-2] * 3
    opt.param_groups[0]["lr"] = [0.1, 0.2, 0.3]  # one value per member
    _grads(params)
    opt.step()
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match=r"invalid lr -1.0 for member 0"):
        opt.step()


def test_a_state_dict_of_another_optimizer_is_refused_before_anything_changes():
    params = _params()
    sgd = wc.optim.SGD(params, lr=0.1, momentum=0.9)
    _grads(params)
    sgd.step()
    adam = wc.optim.Adam(params, lr=1e-3)
    with pytest.raises(ValueError, match=r"saved param group 0 has no 'amsgrad', 'betas'.*another optimizer"):
        adam.load_state_dict(sgd.state_dict())
    _grads(params)
    adam.step()  # still usable


def test_optimizer_state_of_the_wrong_shape_is_refused_at_load():
    params = _params()
    opt = wc.optim.Adam(params, lr=1e-3)
    _grads(params)
    opt.step()
    sd = opt.state_dict()
    sd["state"][0]["exp_avg"] = torch.zeros(3, 5, 2)
    fresh = wc.optim.Adam(params, lr=1e-3)
    with pytest.raises(ValueError, match=r"saved state 'exp_avg' of parameter 0 has shape \[3, 5, 2\]; "
                                         r"expected \[3, 4, 2\]"):
        fresh.load_state_dict(sd)


@pytest.mark.parametrize("make", [
    lambda opt: wc.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    lambda opt: wc.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10),
    lambda opt: wc.optim.lr_scheduler.ExponentialLR(opt, gamma=[0.9, 0.8, 0.7]),
], ids=["step", "cosine", "exponential"])
def test_resuming_a_scheduler_keeps_the_learning_rates(make):
    params = _params()
    opt = wc.optim.SGD(params, lr=[0.1, 0.2, 0.3])
    sched = make(opt)
    for _ in range(5):
        _grads(params)
        opt.step()
        sched.step()
    lrs = opt.param_groups[0]["lr"].clone()
    # the standard recipe: new optimizer, load, new scheduler, load
    opt2 = wc.optim.SGD(params, lr=[0.1, 0.2, 0.3])
    opt2.load_state_dict(opt.state_dict())
    sched2 = make(opt2)
    sched2.load_state_dict(sched.state_dict())
    torch.testing.assert_close(opt2.param_groups[0]["lr"], lrs)
    sched.step()
    sched2.step()
    torch.testing.assert_close(opt2.param_groups[0]["lr"], opt.param_groups[0]["lr"])


# --- in-place writes of per-member values into tensors made inside forward --------------------
class _SliceWrite(nn.Module):  # the upstream issue's example
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 4)

    def forward(self, x):
        out = torch.zeros(x.shape[0], 8)
        out[:, 4:].fill_(0.5)
        head = out[:, :4]  # a view taken before the write must see it too
        out[:, :4] = self.fc(x)
        return out * 2, head + 1


class _TimeLoop(nn.Module):  # the seq2seq tutorial's outputs[t] = ...
    def __init__(self):
        super().__init__()
        self.cell = nn.Linear(6, 6)

    def forward(self, x):  # x [T, B, 6]
        outputs = torch.zeros(3, x.shape[1], 6)
        h = x[0]
        for t in range(3):
            h = torch.tanh(self.cell(h) + x[t])
            outputs[t] = h
        return outputs


class _Scatter(nn.Module):  # PyG-style message passing
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):  # x [5, 4]: 5 edges' features; one graph (a constant) for all members
        dst = torch.tensor([0, 1, 1, 0, 2])
        msg = self.fc(x)
        summed = x.new_zeros(3, 4).index_add_(0, dst, msg)
        counts = torch.zeros(3, 4).scatter_add_(0, dst.unsqueeze(1).expand(5, 4), torch.ones_like(msg) * msg)
        return summed + counts


class _MaskedFill(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        scores = torch.ones(x.shape[0], 4)
        scores.masked_fill_(self.fc(x) > 0, -1.0)
        return scores * x


@pytest.mark.parametrize("factory,sample", [
    (_SliceWrite, torch.randn(2, 5)), (_TimeLoop, torch.randn(3, 2, 6)), (_Scatter, torch.randn(5, 4)),
    (_MaskedFill, torch.randn(3, 4)),
], ids=["slice", "time_loop", "scatter", "masked_fill"])
def test_per_member_writes_into_a_tensor_made_in_forward(factory, sample):
    torch.manual_seed(0)
    models = [factory() for _ in range(3)]
    wide = wc.compile(models, sample, config=FAST, strict=True)  # no fallback needed
    xs = torch.randn(3, *sample.shape, requires_grad=True)
    out = wide(xs)
    outs = out if isinstance(out, tuple) else (out,)
    refs = [m(x) for m, x in zip(models, xs.detach())]
    refs = [r if isinstance(r, tuple) else (r,) for r in refs]
    for k, o in enumerate(outs):
        testing.assert_members_close(o, [r[k] for r in refs])
    # gradients: each member's own, through the writes
    sum(o.sum() for o in outs).backward()
    for i, m in enumerate(models):
        xi = xs.detach()[i].clone().requires_grad_()
        r = m(xi)
        sum(t.sum() for t in (r if isinstance(r, tuple) else (r,))).backward()
        torch.testing.assert_close(xs.grad[i], xi.grad, rtol=1e-5, atol=1e-5)
        for name, p in m.named_parameters():
            got = dict(wide.named_parameters())[name].grad
            if p.grad is None:  # no gradient path (masked_fill's mask): none in the wide model either
                assert got is None or not got[i].any(), name
            else:
                torch.testing.assert_close(got[i], p.grad, rtol=1e-5, atol=1e-5)


def test_a_fallback_never_writes_through_a_shared_tensor():
    import torch.fx as tfx
    from wide_compiler.fx.fallback import fallback
    from wide_compiler.fx.widen import Wide, WidenContext

    g = tfx.Graph()
    shared, src = g.placeholder("shared"), g.placeholder("src")
    shared.meta["val"], src.meta["val"] = torch.zeros(4), torch.zeros(4)
    node = g.call_function(torch.ops.aten.copy_.default, (shared, src))
    node.meta["val"] = torch.zeros(4)
    ctx = WidenContext(3)
    ctx.env[shared] = ctx.graph.placeholder("shared")
    ctx.env[src] = Wide(ctx.graph.placeholder("src"), 1)
    with pytest.raises(wc.UnsupportedOperationError, match="writes in place into a value shared by all members"):
        fallback(ctx, node)


class _ScatterBuffer(nn.Module):  # the index is a buffer: stacked per member
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("dst", torch.tensor([0, 1, 1, 0, 2]))

    def forward(self, x):  # index_reduce_ has no wide rule: the fallback writes into the zeros
        return x.new_zeros(3, 4).index_reduce_(0, self.dst, self.fc(x), "amax", include_self=False)


def test_per_member_writes_through_the_fallback_stay_per_member():
    torch.manual_seed(0)
    models = [_ScatterBuffer() for _ in range(3)]
    models[1].dst.copy_(torch.tensor([2, 2, 0, 1, 1]))  # each member its own index
    with pytest.warns(UserWarning, match="index_reduce_"):
        wide = wc.compile(models, torch.randn(5, 4), config=FAST)
    xs = torch.randn(3, 5, 4)
    testing.assert_members_close(wide(xs), [m(x) for m, x in zip(models, xs)])


# --- the wide ops apply PyTorch's run-time checks, per member ---------------------------------
def test_training_batch_norm_on_a_batch_of_one_raises_and_changes_nothing():
    models = [nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)) for _ in range(3)]
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        models[0](torch.randn(1, 4))  # what a member alone does
    wide = wc.compile(models, torch.randn(4, 4), config=FAST)
    before = {k: v.clone() for k, v in wide.state_dict().items()}
    # a batch of 1 is outside the graph's guards (Note [Guards]); capturing a graph for it runs
    # the member's own check, which refuses it before anything runs
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        wide(torch.randn(3, 1, 4))
    for k, v in wide.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed by a failed call"
    wide.eval()
    assert torch.isfinite(wide(torch.randn(3, 1, 4))).all()  # eval on a batch of 1 is fine
    wide.train()
    xs = torch.randn(3, 5, 4)
    testing.assert_members_close(wide(xs), [m(x) for m, x in zip(models, xs)])  # usable after


def test_group_norm_with_one_value_per_group_raises_as_pytorch_does():
    gns = [nn.GroupNorm(3, 3) for _ in range(2)]
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        gns[0](torch.randn(1, 3))
    with pytest.raises(RuntimeError, match="expected more than 1 value per channel"):
        wc.nn.WideGroupNorm.from_modules(gns)(torch.randn(2, 1, 3))


def test_embedding_errors_name_the_member_and_its_own_index():
    embs = [nn.Embedding(10, 4) for _ in range(3)]
    idx = torch.randint(0, 10, (3, 2, 5))
    idx[1, 1, 2] = 10
    with pytest.raises(IndexError, match=r"index 10 of member 1 is not in the valid range \[0, 10\)"):
        wc.nn.WideEmbedding.from_modules(embs)(idx)


def test_one_members_bad_offsets_never_change_another_members_bags():
    bags = [nn.EmbeddingBag(10, 4, mode="sum") for _ in range(3)]
    idx = torch.randint(0, 10, (3, 6))
    offsets = torch.tensor([[0, 2, 4], [0, 3, 9], [0, 1, 5]])  # member 1's last bag starts past T=6
    with pytest.raises(RuntimeError, match=r"offsets of member 1 must be non-decreasing and at most"):
        wc.nn.WideEmbeddingBag.from_modules(bags)(idx, offsets)


class _EvalOnlyBranch(LinearModel):
    def forward(self, x):
        h = self.fc(x)
        if not self.training and h.sum() > 0:  # data-dependent, in eval mode only
            return -h
        return h


def test_a_graph_that_cannot_be_built_leaves_the_model_in_its_mode_and_usable():
    models = [_EvalOnlyBranch() for _ in range(2)]
    wide = wc.compile(models, torch.randn(3, 4), config=FAST)
    with pytest.raises(wc.WideCompileError, match="torch.export could not capture"):
        wide.eval()
    assert wide.training
    with pytest.raises(wc.WideCompileError):  # a second try fails the same way, cleanly
        wide.eval()
    xs = torch.randn(2, 3, 4)
    testing.assert_members_close(wide(xs), [m(x) for m, x in zip(models, xs)])


def test_a_wrong_input_to_a_compiled_wide_model_raises_the_wide_models_error():
    models = [nn.Linear(4, 2) for _ in range(3)]
    wide = wc.compile(models, torch.randn(5, 4), config=FAST, compile_model=True,
                      compile_options={"fullgraph": True, "backend": "eager"})
    assert isinstance(wide, torch._dynamo.eval_frame.OptimizedModule)
    xs = torch.randn(3, 5, 4)
    testing.assert_members_close(wide(xs), [m(x) for m, x in zip(models, xs)])
    with pytest.raises(ValueError, match=r"expected N-first \[3, B, 4\]"):
        wide(torch.randn(4, 5, 4))
    with pytest.raises(ValueError, match="takes the inputs of one member's sample"):
        wide(xs, xs)
    testing.assert_members_close(wide(xs), [m(x) for m, x in zip(models, xs)])  # still fine after


# --- user objects are never modified by an API that does not say so ---------------------------
def _bn_net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Dropout(0.2), nn.Linear(6, 2))


def _snapshot(models):
    return [({k: v.clone() for k, v in m.state_dict().items()}, [s.training for s in m.modules()]) for m in models]


def test_no_api_that_does_not_say_so_modifies_the_users_models():
    torch.manual_seed(0)
    models = [_bn_net() for _ in range(3)]
    x = torch.randn(5, 4)
    before = _snapshot(models)
    wide = wc.compile(models, x, config=FAST, validate=True)
    wc.compile(models[0], x, n=4, config=FAST)
    testing.check_compile(models, x, config=FAST)
    wide(torch.randn(3, 5, 4)).sum().backward()
    wide.unfuse()
    wide.member(1)
    wide.member_state_dict(2)
    wide.eval()
    for (state, modes), (state0, modes0) in zip(_snapshot(models), before):
        assert modes == modes0
        for k in state0:
            assert torch.equal(state[k], state0[k]), k
    assert all(p.grad is None for m in models for p in m.parameters())
    wide.write_back(models)  # says that it writes: now the models hold the wide state
    for i, m in enumerate(models):
        for k, v in m.state_dict().items():
            assert torch.equal(v, wide.member_state_dict(i)[k]), k


def test_nan_in_one_member_stays_in_that_member():
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2)) for _ in range(3)]
    with torch.no_grad():
        models[1][0].weight[0, 0] = float("nan")
    wide = wc.compile(models, torch.randn(5, 4), config=FAST)
    xs = torch.randn(3, 5, 4)
    out = wide(xs)
    out.sum().backward()
    assert torch.isnan(out[1]).any()
    for i in (0, 2):
        ref = models[i](xs[i])
        ref.sum().backward()
        testing.assert_close(out[i], ref)
        for name, p in wide.named_parameters():
            assert torch.isfinite(p.grad[i]).all(), name
            testing.assert_close(p.grad[i], models[i].get_parameter(name).grad, kind="grad")
        for name, b in wide.named_buffers():
            if b.is_floating_point():
                testing.assert_close(b[i], models[i].get_buffer(name), kind="buffer")


def test_module_caches_are_not_compared_by_value():
    """nn.RNN keeps its weights in _flat_weights (the Parameters) and _flat_weight_refs (weakrefs
    to them): per-member state, not configuration."""
    from wide_compiler.fx.member_checks import check_members

    check_members([nn.LSTM(4, 6, num_layers=2, bidirectional=True) for _ in range(3)])
    with pytest.raises(wc.ArchitectureMismatchError, match=r"member 1: hidden_size is 7, member 0 has 6"):
        check_members([nn.GRU(4, 6), nn.GRU(4, 7)])
    a, b = nn.LSTM(4, 6), nn.LSTM(4, 6)
    b.weight_hh_l0.requires_grad_(False)
    with pytest.raises(wc.ArchitectureMismatchError, match="requires_grad"):
        check_members([a, b])
