"""wc.compile on whole models: every member of the wide model must be exactly its own model.

For every model family the check is the same (`wide_compiler.testing.check_equivalence`): member
i gets its own input x[i] (or one shared input x.expand(N, *x.shape)), and its outputs, its input
gradients, its parameter gradients and its buffers must equal those of model i run alone.
"""
from __future__ import annotations

import copy
import inspect
import re

import pytest
import torch
import torch.nn.functional as F
import wide_compiler as wc
from support import Call, LinearModel, OpRecorder, assert_members_trained_alike, cpu_only
from torch import nn
from wide_compiler.testing import assert_close, assert_members_close, check_equivalence

FAST = wc.WideConfig.fast()  # no timing at compile time: keeps the suite quick


def compile_fast(models, sample, **kwargs):
    kwargs.setdefault("config", FAST)
    return wc.compile(models, sample, **kwargs)


# ---------------------------------------------------------------------------------------------
# Model zoo
# ---------------------------------------------------------------------------------------------
ACTIVATIONS = {
    "ReLU": nn.ReLU,
    "GELU": nn.GELU,
    "GELU-tanh": lambda: nn.GELU(approximate="tanh"),
    "SiLU": nn.SiLU,
    "Tanh": nn.Tanh,
    "Sigmoid": nn.Sigmoid,
    "LeakyReLU": lambda: nn.LeakyReLU(0.1),
    "Identity": nn.Identity,
    "ReLU-inplace": lambda: nn.ReLU(inplace=True),
    "F.relu": lambda: Call(F.relu),
    "torch.tanh": lambda: Call(torch.tanh),
    "ELU": nn.ELU,
    "Softplus": nn.Softplus,
    "Hardswish": nn.Hardswish,
}


class MLP(nn.Module):
    def __init__(self, depth=2, act=nn.ReLU, in_features=5, hidden=8, out_features=3):
        super().__init__()
        dims = [in_features] + [hidden] * (depth - 1) + [out_features]
        layers: list[nn.Module] = []
        for k in range(depth):
            layers.append(nn.Linear(dims[k], dims[k + 1]))
            if k < depth - 1:
                layers.append(act())
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


class Residual(nn.Module):
    def __init__(self, act=nn.GELU):
        super().__init__()
        self.fc_in = nn.Linear(5, 8)
        self.fc = nn.Linear(8, 8)
        self.act = act()
        self.fc_out = nn.Linear(8, 3)

    def forward(self, x):
        h = self.fc_in(x)
        h = h + self.act(self.fc(h))
        return self.fc_out(h)


class InplaceResidual(LinearModel):
    linears = {"fc_in": (5, 8), "fc": (8, 8), "fc_out": (8, 3)}

    def forward(self, x):
        h = torch.tanh(self.fc_in(x))
        y = self.fc(h)
        y += h
        return self.fc_out(y)


class Branches(LinearModel):
    """Products and differences of two branches."""

    linears = {"fc_a": (5, 8), "fc_b": (5, 8), "fc_out": (8, 3)}

    def forward(self, x):
        a, b = self.fc_a(x), self.fc_b(x)
        h = torch.relu(a) * torch.sigmoid(b) - (a - b) / 2
        return self.fc_out(h)


class ScalarOps(LinearModel):
    linears = {"fc": (5, 8), "fc_out": (8, 3)}

    def forward(self, x):
        h = self.fc(x)
        h = 0.5 * h + 1.0 - (h * 3.0) / 2.0
        h = 2.0 - torch.tanh(h)
        return self.fc_out(h) * 0.25


class PerMemberScale(nn.Module):
    """Per-member parameters and buffers used in plain arithmetic."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(5, 8)
        self.scale = nn.Parameter(torch.randn(8))
        self.gain = nn.Parameter(torch.tensor(1.0) + torch.rand(()))  # a 0-dim parameter
        self.register_buffer("offset", torch.randn(8))
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.fc1(x)) * self.scale + self.offset
        return self.fc2(h) * self.gain


class TwoInputs(LinearModel):
    linears = {"fc_a": (4, 8), "fc_b": (6, 8), "fc_out": (8, 2)}

    def forward(self, a, b):
        return self.fc_out(torch.relu(self.fc_a(a)) * torch.sigmoid(self.fc_b(b)))


class TwoOutputs(LinearModel):
    linears = {"fc1": (5, 8), "fc2": (8, 3)}

    def forward(self, x):
        h = F.silu(self.fc1(x))
        return self.fc2(h), h


def members(factory, n, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return [factory().to(dtype) for _ in range(n)]


# ---------------------------------------------------------------------------------------------
# Inputs (the check itself is wide_compiler.testing.check_equivalence)
# ---------------------------------------------------------------------------------------------
def per_member_inputs(n, *shapes, dtype=torch.float32):
    return [tuple(torch.randn(s, dtype=dtype) for s in shapes) for _ in range(n)]


# ---------------------------------------------------------------------------------------------
# Equivalence on model families
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("act", list(ACTIVATIONS), ids=list(ACTIVATIONS))
def test_mlp_activations(act):
    models = members(lambda: MLP(2, ACTIVATIONS[act]), 3)
    wide = compile_fast(models, torch.randn(4, 5))
    check_equivalence(wide, models, per_member_inputs(3, (6, 5)))


DEPTH_CASES = [(1, "ReLU")] + [(d, a) for d in (2, 3, 4)
                                for a in ("ReLU", "GELU", "ReLU-inplace", "Sigmoid")]


@pytest.mark.parametrize("depth, act", DEPTH_CASES, ids=[f"depth{d}-{a}" for d, a in DEPTH_CASES])
def test_mlp_depths(depth, act):
    models = members(lambda: MLP(depth, ACTIVATIONS[act]), 3, seed=depth)
    wide = compile_fast(models, torch.randn(4, 5))
    n_linear = sum(isinstance(m, nn.Linear) for m in models[0].modules())
    assert n_linear == depth
    assert len(wide.strategies) == depth, wide.strategies
    check_equivalence(wide, models, per_member_inputs(3, (6, 5)))


@pytest.mark.parametrize("factory", [Residual, lambda: Residual(nn.SiLU), InplaceResidual, Branches,
                                     ScalarOps, PerMemberScale, TwoOutputs],
                         ids=["residual-gelu", "residual-silu", "inplace-residual", "branches",
                              "scalar-ops", "per-member-param", "two-outputs"])
@pytest.mark.parametrize("shared", [False, True], ids=["own-input", "shared-input"])
def test_model_families(factory, shared):
    n = 3
    models = members(factory, n)
    wide = compile_fast(models, torch.randn(4, 5))
    inputs = (torch.randn(6, 5),) if shared else per_member_inputs(n, (6, 5))
    check_equivalence(wide, models, inputs, shared=shared)


def test_two_outputs_keep_their_structure():
    models = members(TwoOutputs, 2)
    wide = compile_fast(models, torch.randn(4, 5))
    out = wide(torch.randn(2, 3, 5))
    assert isinstance(out, tuple) and len(out) == 2
    assert out[0].shape == (2, 3, 3) and out[1].shape == (2, 3, 8)


@pytest.mark.parametrize("act", ["ReLU", "GELU", "Tanh"])
def test_shared_input_equals_each_model_on_x(act):
    n = 4
    models = members(lambda: MLP(3, ACTIVATIONS[act]), n)
    wide = compile_fast(models, torch.randn(4, 5))
    x = torch.randn(7, 5)
    out = check_equivalence(wide, models, (x,), shared=True).wide_output
    # Sanity: the members really are different models.
    assert not torch.allclose(out[0], out[1])


@pytest.mark.parametrize("shared", [False, True])
def test_tuple_of_inputs(shared):
    n = 3
    models = members(TwoInputs, n)
    wide = compile_fast(models, (torch.randn(4, 4), torch.randn(4, 6)))
    inputs = (torch.randn(5, 4), torch.randn(5, 6)) if shared else per_member_inputs(n, (5, 4), (5, 6))
    check_equivalence(wide, models, inputs, shared=shared)


@pytest.mark.parametrize("shared", [False, True])
def test_3d_member_inputs(shared):
    n = 3
    models = members(lambda: MLP(3, nn.GELU), n)
    wide = compile_fast(models, torch.randn(2, 4, 5))
    inputs = (torch.randn(3, 4, 5),) if shared else per_member_inputs(n, (3, 4, 5))
    out = check_equivalence(wide, models, inputs, shared=shared).wide_output
    assert out.shape == (n, 3, 4, 3)


def test_single_member():
    models = members(lambda: MLP(3, nn.SiLU), 1)
    wide = compile_fast(models, torch.randn(4, 5))
    assert wide.n == 1
    check_equivalence(wide, models, per_member_inputs(1, (6, 5)))
    check_equivalence(wide, models, (torch.randn(6, 5),), shared=True)


@pytest.mark.parametrize("sample_batch", [1, 2, 4])
def test_dynamic_batch(sample_batch):
    """One wide model serves batch sizes other than the sample's, including 1."""
    n = 3
    models = members(lambda: MLP(2, nn.ReLU), n)
    wide = compile_fast(models, torch.randn(sample_batch, 5))
    for batch in (1, 2, 7):
        out = check_equivalence(wide, models, per_member_inputs(n, (batch, 5))).wide_output
        assert out.shape == (n, batch, 3)


def test_float64_models():
    n = 3
    models = members(lambda: MLP(3, nn.Tanh), n, dtype=torch.float64)
    wide = compile_fast(models, torch.randn(4, 5, dtype=torch.float64))
    assert all(p.dtype == torch.float64 for p in wide.parameters())
    out = check_equivalence(wide, models, per_member_inputs(n, (6, 5), dtype=torch.float64)).wide_output
    assert out.dtype == torch.float64


def test_default_config_tunes_and_caches_in_the_env_cache_dir(_isolated_cache_dir, monkeypatch):
    from support import steady_measuring_clock

    steady_measuring_clock(monkeypatch)  # every op measured within the budget, however busy the machine
    n = 3
    models = members(lambda: MLP(2, nn.ReLU), n)
    wide = wc.compile(models, torch.randn(4, 5)).tune()  # default config: measured (after its first runs, or now)
    assert set(wide.strategies.values()) <= {"bmm", "bmm_t", "loop"}, wide.strategies
    assert (_isolated_cache_dir / "strategies.json").is_file(), list(_isolated_cache_dir.iterdir())
    check_equivalence(wide, models, per_member_inputs(n, (6, 5)))
    # A second compile of the same shapes reads the cache and chooses the same.
    again = wc.compile(members(lambda: MLP(2, nn.ReLU), n, seed=1), torch.randn(4, 5))
    assert again.strategies == wide.strategies


@pytest.mark.parametrize("strategy", ["bmm", "loop"])
def test_forced_strategy(strategy):
    n = 3
    models = members(lambda: MLP(3, nn.ReLU), n)
    wide = wc.compile(models, torch.randn(4, 5), config=wc.WideConfig(strategy=strategy))
    assert set(wide.strategies.values()) == {strategy}
    assert strategy in wide.summary()
    check_equivalence(wide, models, per_member_inputs(n, (6, 5)))
    check_equivalence(wide, models, (torch.randn(6, 5),), shared=True)


def test_expanded_input_takes_the_shared_gemm_path():
    """DESIGN §3: the first layer detects a stride-0 input; in a training step of a small layer it
    runs ONE GEMM, whatever the strategy chosen for per-member inputs (Note [wide::linear
    strategies]); without a gradient the strategy's batched GEMM reads the expanded input in place
    (no copy of it)."""
    n = 4
    models = members(lambda: MLP(1), n)  # one Linear: only the shared layer
    for config in (FAST, wc.WideConfig(strategy="bmm"), wc.WideConfig(strategy="loop")):
        wide = wc.compile(models, torch.randn(4, 5), config=config)
        x = torch.randn(6, 5)
        with OpRecorder() as rec:
            wide(x.expand(n, *x.shape))
        assert not {"bmm", "baddbmm"} & set(rec.ops), (config.strategy, rec.ops)
        assert sum(op in {"mm", "addmm"} for op in rec.ops) == 1, (config.strategy, rec.ops)
        with torch.no_grad(), OpRecorder() as rec:
            wide(x.expand(n, *x.shape))
        assert "clone" not in rec.ops and "contiguous" not in rec.ops, (config.strategy, rec.ops)


# ---------------------------------------------------------------------------------------------
# compile(one_model, n=K)
# ---------------------------------------------------------------------------------------------
def test_one_model_n_members_are_reinitialised_and_original_untouched():
    torch.manual_seed(0)
    model = MLP(3, nn.GELU)
    before = copy.deepcopy(model.state_dict())
    k = 4
    wide = compile_fast(model, torch.randn(4, 5), n=k)
    assert wide.n == k
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), f"compile changed the original's {name}"
    sd = wide.state_dict()
    for name, stacked in sd.items():
        assert stacked.shape == (k, *before[name].shape)
        for i in range(k):
            assert not torch.equal(stacked[i], before[name]), f"member {i} kept the original {name}"
            for j in range(i):
                assert not torch.equal(stacked[i], stacked[j]), f"members {i} and {j} share {name}"
    x = torch.randn(5, 5)
    out = wide(x.expand(k, *x.shape))
    for i in range(1, k):
        assert not torch.allclose(out[0], out[i]), f"member {i} computes member 0's function"
    # Each member is a valid re-initialised copy: unfused member i reproduces wide member i.
    unfused = wide.unfuse()
    assert_members_close(out, [m(x) for m in unfused])
    # Linear init bound holds for every member.
    for i in range(k):
        w = sd["net.0.weight"][i]
        assert w.abs().max() <= 1 / 5 ** 0.5 + 1e-6


def test_one_model_requires_n():
    with pytest.raises(ValueError, match=r"n=K"):
        compile_fast(MLP(), torch.randn(4, 5))
    with pytest.raises(ValueError, match=r"n >= 1"):
        compile_fast(MLP(), torch.randn(4, 5), n=0)


def test_n_must_match_the_number_of_models():
    with pytest.raises(ValueError, match=r"n=3 but 2 models"):
        compile_fast(members(MLP, 2), torch.randn(4, 5), n=3)


# ---------------------------------------------------------------------------------------------
# validate, unfuse, state_dict, dtype, training
# ---------------------------------------------------------------------------------------------
def test_validate_passes_on_good_models():
    n = 3
    models = members(Branches, n)
    wide = compile_fast(models, torch.randn(4, 5), validate=True)
    assert isinstance(wide, wc.WideModel)
    check_equivalence(wide, models, per_member_inputs(n, (6, 5)))
    wide_dbg = wc.compile(models, torch.randn(4, 5), config=wc.WideConfig.debug())
    assert isinstance(wide_dbg, wc.WideModel)


class NormNet(nn.Module):
    """BatchNorm (running stats, num_batches_tracked) and, optionally, dropout."""

    def __init__(self, p=0.0):
        super().__init__()
        self.fc = nn.Linear(5, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(p) if p else nn.Identity()
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        return self.out(self.drop(torch.relu(self.bn(self.fc(x)))))


def _state(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _assert_same_state(module, before, what):
    after = module.state_dict()
    assert list(after) == list(before), what
    for k, v in before.items():
        assert torch.equal(after[k], v), f"{what}: validate changed {k}"


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_validate_leaves_the_models_and_the_wide_buffers_untouched(training):
    """Was (reliability issue): validate=True ran the user's models in train mode, so their
    BatchNorm running stats and num_batches_tracked changed, and so did the wide model's."""
    models = [m.train(training) for m in members(NormNet, 3)]
    before = [_state(m) for m in models]
    wide = compile_fast(models, torch.randn(4, 5), validate=True)
    for i, m in enumerate(models):
        _assert_same_state(m, before[i], f"original member {i}")
        assert m.training == training
    for name, b in wide.named_buffers():
        if name in before[0]:
            assert torch.equal(b, torch.stack([s[name] for s in before])), f"wide buffer {name} changed"
    assert int(wide.get_buffer("bn.num_batches_tracked").sum()) == 0
    assert wide.training == training
    # The same through WideBuilder and for one model with n=K.
    one = NormNet().train(training)
    state = _state(one)
    wc.compile(one, torch.randn(4, 5), n=2, validate=True, config=FAST)
    _assert_same_state(one, state, "the single model of n=K")


def test_validate_with_dropout_compares_train_mode_with_the_draws_fixed(caplog):
    """Was: members draw different dropout masks than the wide model, so validate raised a false
    ValidationError; then it fell back to eval mode. A train graph with random ops is validated
    in train mode with every draw fixed on both sides (Note [Fixed draws in the trust check])."""
    models = members(lambda: NormNet(p=0.5), 3)
    before = [_state(m) for m in models]
    with caplog.at_level("INFO", logger="wide_compiler.api"):
        wide = compile_fast(models, torch.randn(4, 5), validate=True)
    assert wide.training and all(m.training for m in models)
    assert any("validated 3 members (train mode)" in r.getMessage() for r in caplog.records), \
        [r.getMessage() for r in caplog.records]
    for i, m in enumerate(models):
        _assert_same_state(m, before[i], f"original member {i}")
    assert int(wide.get_buffer("bn.num_batches_tracked").sum()) == 0
    # Validation still checks something: a member that differs is caught in train mode.
    wide = compile_fast(members(lambda: NormNet(p=0.5), 3), torch.randn(4, 5))
    with torch.no_grad():
        wide.get_parameter("out.weight")[1].mul_(-1)
    from wide_compiler.api import _validate
    with pytest.raises(wc.ValidationError, match=r"train mode.*member 1 differs"):
        _validate(wide, members(lambda: NormNet(p=0.5), 3), (torch.randn(4, 5),), {}, FAST)


def test_check_compile_is_the_one_line_check():
    models = members(NormNet, 3)
    before = [_state(m) for m in models]
    wide, report = wc.testing.check_compile(models, torch.randn(6, 5), config=FAST)
    assert set(report) == {"train/own", "train/shared", "eval/own", "eval/shared"}
    for key, r in report.items():
        assert r["output"] is not None and r["param_grad"] is not None and r["buffer"] is not None, key
    for i, m in enumerate(models):
        _assert_same_state(m, before[i], f"member {i}")
    assert wide.training
    # Dropout: train mode is compared with the draws fixed on both sides, eval as usual.
    _, report = wc.testing.check_compile(members(lambda: NormNet(p=0.5), 2), torch.randn(6, 5),
                                         config=FAST, shared=False)
    assert report["train/own"]["param_grad"] is not None and report["eval/own"]["output"] is not None
    # Explicit per-member inputs; and the check fails on a wrong model (members in another order).
    wide, report = wc.testing.check_compile(models, torch.randn(6, 5), config=FAST, modes=("eval",),
                                            inputs=[torch.randn(4, 5) for _ in range(3)])
    assert set(report) == {"eval/own", "eval/shared"} and wide.training  # the models' mode
    with pytest.raises(AssertionError, match=r"member 0 differs"):
        wc.testing.check_equivalence(wide, models[::-1], [torch.randn(6, 5) for _ in range(3)])


def test_unfuse_round_trip():
    n = 3
    models = members(PerMemberScale, n)
    wide = compile_fast(models, torch.randn(4, 5))
    unfused = wide.unfuse()
    assert len(unfused) == n
    x = torch.randn(n, 6, 5)
    out = wide(x)
    for i, m in enumerate(unfused):
        assert type(m) is PerMemberScale
        assert m is not models[i]
        assert_close(m(x[i]), out[i], msg=f"unfused member {i}")
        assert_close(m(x[i]), models[i](x[i]), msg=f"unfused member {i} vs original")
        for name, t in models[i].state_dict().items():
            assert torch.equal(m.state_dict()[name], t), f"unfused member {i}: {name}"
    # Independent copies, both ways.
    with torch.no_grad():
        unfused[1].fc1.weight.add_(1.0)
        unfused[1].offset.add_(1.0)
    assert_close(wide(x), out, msg="editing an unfused module changed the wide model")
    with torch.no_grad():
        wide.get_parameter("fc1.weight")[0].add_(1.0)
    assert_close(unfused[0](x[0]), out[0], msg="editing the wide model changed an unfused module")


def test_unfuse_keeps_train_eval_mode():
    models = members(MLP, 2)
    wide = compile_fast(models, torch.randn(4, 5))
    assert all(m.training for m in wide.unfuse())
    wide.eval()
    x = torch.randn(2, 3, 5)
    assert_members_close(wide(x), [m.eval()(x[i]) for i, m in enumerate(models)])
    assert not any(m.training for m in wide.unfuse())


def test_state_dict_names_and_shapes():
    n = 3
    models = members(PerMemberScale, n)
    wide = compile_fast(models, torch.randn(4, 5))
    sd = wide.state_dict()
    ref = models[0].state_dict()
    assert list(sd.keys()) == list(ref.keys())  # same names, same order as the original
    for name, t in ref.items():
        assert sd[name].shape == (n, *t.shape), name
        for i in range(n):
            assert torch.equal(sd[name][i], models[i].state_dict()[name]), f"{name} member {i}"


def test_load_state_dict_round_trip():
    n = 3
    models = members(PerMemberScale, n, seed=0)
    others = members(PerMemberScale, n, seed=1)
    wide = compile_fast(models, torch.randn(4, 5))
    fresh = compile_fast(others, torch.randn(4, 5))
    x = torch.randn(n, 6, 5)
    assert not torch.allclose(fresh(x), wide(x))
    result = fresh.load_state_dict(wide.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    assert_close(fresh(x), wide(x))
    # A state dict of another N does not load.
    wrong_n = compile_fast(members(PerMemberScale, n + 1), torch.randn(4, 5))
    with pytest.raises(RuntimeError, match=r"size mismatch"):
        fresh.load_state_dict(wrong_n.state_dict())


def test_to_float64():
    n = 3
    models = members(lambda: MLP(3, nn.GELU), n)
    wide = compile_fast(models, torch.randn(4, 5))
    wide64 = wide.to(torch.float64)
    assert wide64 is wide
    assert all(p.dtype == torch.float64 for p in wide.parameters())
    models64 = [copy.deepcopy(m).double() for m in models]
    out = check_equivalence(wide, models64, per_member_inputs(n, (6, 5), dtype=torch.float64)).wide_output
    assert out.dtype == torch.float64


def test_deepcopy_gives_an_independent_wide_model():
    """copy.deepcopy(model) is how users keep a best checkpoint or an EMA copy."""
    n = 3
    models = members(lambda: MLP(2), n)
    wide = compile_fast(models, torch.randn(4, 5))
    x = torch.randn(n, 6, 5)
    clone = copy.deepcopy(wide)
    assert_close(clone(x), wide(x))
    with torch.no_grad():
        clone.get_parameter("net.0.weight").add_(1.0)
    assert_members_close(wide(x), [m(x[i]) for i, m in enumerate(models)])
    assert not torch.allclose(clone(x), wide(x))


def test_state_dict_survives_torch_save(tmp_path):
    n = 2
    wide = compile_fast(members(PerMemberScale, n), torch.randn(4, 5))
    path = tmp_path / "wide.pt"
    torch.save(wide.state_dict(), path)
    fresh = compile_fast(members(PerMemberScale, n, seed=5), torch.randn(4, 5))
    fresh.load_state_dict(torch.load(path, weights_only=True))
    x = torch.randn(n, 3, 5)
    assert_close(fresh(x), wide(x))


def test_inference_mode_and_no_grad():
    n = 3
    models = members(lambda: MLP(3, nn.GELU), n)
    wide = compile_fast(models, torch.randn(4, 5))
    x = torch.randn(n, 6, 5)
    ref = [m(x[i]).detach() for i, m in enumerate(models)]
    with torch.no_grad():
        assert_members_close(wide(x), ref)
    with torch.inference_mode():
        assert_members_close(wide(x), ref)


def test_member_dim_need_not_be_outermost_in_memory():
    n = 3
    models = members(lambda: MLP(2), n)
    wide = compile_fast(models, torch.randn(4, 5))
    x = torch.randn(6, n, 5).transpose(0, 1)  # [N, B, F] view of a [B, N, F] buffer
    assert_members_close(wide(x), [m(x[i]) for i, m in enumerate(models)])


class Passthrough(nn.Module):
    """Outputs that do not depend on the input, and the input itself."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 3)
        self.p = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return self.fc(x), self.p * 2, x


@pytest.mark.parametrize("shared", [False, True])
def test_parameter_only_and_passthrough_outputs(shared):
    n = 2
    models = members(Passthrough, n)
    wide = compile_fast(models, torch.randn(4, 5))
    inputs = (torch.randn(6, 5),) if shared else per_member_inputs(n, (6, 5))
    out = check_equivalence(wide, models, inputs, shared=shared).wide_output
    assert out[1].shape == (n, 3) and out[2].shape == (n, 6, 5)


def test_mixed_shared_and_per_member_inputs():
    n = 3
    models = members(TwoInputs, n)
    wide = compile_fast(models, (torch.randn(4, 4), torch.randn(4, 6)))
    a = torch.randn(5, 4)
    b = torch.randn(n, 5, 6)
    out = wide(a.expand(n, *a.shape), b)
    assert_members_close(out, [m(a, b[i]) for i, m in enumerate(models)])


@pytest.mark.parametrize("factory", [lambda: MLP(3, nn.GELU), PerMemberScale],
                         ids=["mlp", "per-member-param"])
def test_sgd_steps_match_members_trained_alone(factory):
    n, lr, steps = 3, 0.1, 2
    models = members(factory, n)
    originals = [copy.deepcopy(m.state_dict()) for m in models]
    wide = compile_fast(models, torch.randn(4, 5))
    xs = [torch.randn(n, 6, 5) for _ in range(steps)]
    targets = [torch.randn(n, 6, 3) for _ in range(steps)]

    opt = torch.optim.SGD(wide.parameters(), lr=lr, momentum=0.9, weight_decay=0.01)
    for x, t in zip(xs, targets):
        opt.zero_grad()
        # Sum over members of each member's mean loss: member i gets exactly its own gradient.
        loss = ((wide(x) - t) ** 2).mean(dim=(1, 2)).sum()
        loss.backward()
        opt.step()
    for i, m in enumerate(models):
        for name, value in m.state_dict().items():
            assert torch.equal(value, originals[i][name]), f"training the wide model changed {name}"

    assert_members_trained_alike(wide, models, xs, targets, lr=lr, momentum=0.9, weight_decay=0.01)
    for i, m in enumerate(wide.unfuse()):
        for name, p in m.named_parameters():
            assert_close(p, models[i].get_parameter(name), msg=f"unfused trained member {i} {name}")


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("odd, pattern", [
    (lambda: MLP(2, hidden=9), r"member 2: net\.0\.out_features is 9, member 0 has 8"),
    (lambda: MLP(2, act=nn.GELU), r"member 2: type of net\.1 is '?GELU'?, member 0 has '?ReLU'?"),
    (lambda: MLP(2).double(), r"member 2: net\.0\.weight\.dtype is torch\.float64, member 0 has "
                              r"torch\.float32"),
], ids=["hidden-size", "activation-type", "dtype"])
def test_architecture_mismatch(odd, pattern):
    # (members that differ only in a float such as a LeakyReLU slope fuse: test_scalar_sweeps.py)
    torch.manual_seed(0)
    models = [MLP(2), MLP(2), odd()]
    with pytest.raises(wc.ArchitectureMismatchError, match=pattern):
        compile_fast(models, torch.randn(4, 5))
    assert issubclass(wc.ArchitectureMismatchError, ValueError)


def test_architecture_mismatch_bias_presence():
    class NoBias(nn.Module):
        def __init__(self, bias):
            super().__init__()
            self.fc = nn.Linear(5, 3, bias=bias)

        def forward(self, x):
            return self.fc(x)

    with pytest.raises(wc.ArchitectureMismatchError, match=r"member 1\b.*bias") as info:
        compile_fast([NoBias(True), NoBias(False)], torch.randn(4, 5))
    assert "fc.bias" in str(info.value)


class Signed(LinearModel):
    linears, fields = {"fc": (5, 3)}, ("sign",)

    def forward(self, x):
        return self.fc(x) * self.sign


def test_architecture_mismatch_non_tensor_constant():
    with pytest.raises(wc.ArchitectureMismatchError, match=r"member 1: sign is -1, member 0 has 1"):
        compile_fast([Signed(1), Signed(-1)], torch.randn(4, 5))


def test_architecture_mismatch_training_mode_and_requires_grad():
    a, b = MLP(), MLP().eval()
    with pytest.raises(wc.ArchitectureMismatchError, match=r"member 1: .*training is False"):
        compile_fast([a, b], torch.randn(4, 5))
    a, b = MLP(), MLP()
    b.net[0].weight.requires_grad_(False)
    with pytest.raises(wc.ArchitectureMismatchError,
                       match=r"member 1: net\.0\.weight\.requires_grad is False"):
        compile_fast([a, b], torch.randn(4, 5))


class ClosureAct(nn.Module):
    """The activation is a lambda whose closure holds a per-member constant."""

    def __init__(self, sign):
        super().__init__()
        self.fc = nn.Linear(5, 3)
        self.act = lambda h: sign * h

    def forward(self, x):
        return self.act(self.fc(x))


def test_members_differing_only_in_a_closure_constant_are_rejected():
    """Same code, different closure cell: running member 0's constant for everyone would be
    silently wrong (DESIGN §4: 'never silently wrong'), so the DEFAULT config must reject it."""
    with pytest.raises(wc.ArchitectureMismatchError, match=r"member 1"):
        compile_fast([ClosureAct(1.0), ClosureAct(-1.0)], torch.randn(4, 5))


class LenientCfg:
    """A config whose __eq__ ignores its fields: the attribute check trusts __eq__."""

    def __init__(self, sign):
        self.sign = sign

    def __eq__(self, other):
        return isinstance(other, LenientCfg)


class HiddenSign(nn.Module):
    """The members differ in a constant the attribute check cannot see (LenientCfg.__eq__ says
    equal): only tracing every member shows that the programs differ."""

    def __init__(self, sign):
        super().__init__()
        self.fc = nn.Linear(5, 3)
        self.cfg = LenientCfg(sign)

    def forward(self, x):
        return self.fc(x) * self.cfg.sign


def test_trace_members_catches_a_constant_the_attribute_check_cannot_see():
    models = [HiddenSign(1.0), HiddenSign(-1.0)]
    no_run = FAST.replace(run_members=False)
    compile_fast(models, torch.randn(4, 5), config=no_run)  # the attribute check alone does not notice
    with pytest.raises(wc.ArchitectureMismatchError, match=r"member 1: the traced program differs"):
        wc.compile(models, torch.randn(4, 5), config=no_run.replace(trace_members=True))


def test_running_every_member_catches_a_hidden_constant_by_default():
    models = [HiddenSign(1.0), HiddenSign(-1.0)]
    with pytest.raises(wc.ArchitectureMismatchError,
                       match=r"member 1: its forward runs a different program from member 0's at "
                             r".*test_compile.py:\d+ in forward: return self.fc\(x\) \* self.cfg.sign: "
                             r"aten.mul.Tensor with \(tensor\[4, 3\], -1.0\), member 0 runs aten.mul.Tensor "
                             r"with \(tensor\[4, 3\], 1.0\)"):
        compile_fast(models, torch.randn(4, 5))
    before = [dict(m.state_dict()) for m in models]
    compile_fast([HiddenSign(1.0), HiddenSign(1.0)], torch.randn(4, 5))
    assert all(torch.equal(v, before[0][k]) for k, v in models[0].state_dict().items())


def test_closure_mismatch_message_names_the_attribute():
    with pytest.raises(wc.ArchitectureMismatchError, match=r"member 1: act is function .*closure constants"):
        compile_fast([ClosureAct(1.0), ClosureAct(-1.0)], torch.randn(4, 5))


def test_validate_catches_a_member_that_differs(monkeypatch):
    """validate=True is the numerical safety net behind the structural check: with the check
    switched off, members differing in a constant must be caught by validation."""
    import sys

    monkeypatch.setattr(sys.modules["wide_compiler.fx.compilation"], "check_members", lambda models: None)
    models = [Signed(1), Signed(-1)]
    no_run = FAST.replace(run_members=False)
    compile_fast(models, torch.randn(4, 5), config=no_run)  # without validation nothing notices
    with pytest.raises(wc.ValidationError, match=r"member 1 differs"):
        compile_fast(models, torch.randn(4, 5), config=no_run, validate=True)
    # debug() also traces every member, which names the differing node instead.
    with pytest.raises((wc.ValidationError, wc.ArchitectureMismatchError), match=r"member 1"):
        wc.compile(models, torch.randn(4, 5), config=wc.WideConfig.debug())


class Settings:
    """A plain config object without __eq__."""

    def __init__(self):
        self.scale = 2.0


class WithSettings(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 3)
        self.settings = Settings()

    def forward(self, x):
        return self.fc(x) * self.settings.scale


def test_equal_plain_config_objects_are_not_a_mismatch():
    """Each member holds its own (equal) config object: that is the same architecture."""
    models = members(WithSettings, 2)
    wide = compile_fast(models, torch.randn(4, 5))
    check_equivalence(wide, models, per_member_inputs(2, (6, 5)))


def test_frozen_parameters_stay_frozen():
    models = members(lambda: MLP(2), 2)
    for m in models:
        m.net[0].weight.requires_grad_(False)
    wide = compile_fast(models, torch.randn(4, 5))
    assert not wide.get_parameter("net.0.weight").requires_grad
    assert wide.get_parameter("net.2.weight").requires_grad
    x = torch.randn(2, 6, 5)
    wide(x).sum().backward()
    assert wide.get_parameter("net.0.weight").grad is None
    assert wide.get_parameter("net.2.weight").grad is not None


def test_harness_detects_a_wrong_member():
    """The equivalence check itself can fail: members compared in the wrong order must fail."""
    models = members(lambda: MLP(2), 3)
    wide = compile_fast(models, torch.randn(4, 5))
    with pytest.raises(AssertionError, match=r"member 0 of 3"):
        check_equivalence(wide, models[::-1], per_member_inputs(3, (6, 5)))


def test_empty_model_list():
    with pytest.raises(ValueError, match=r"at least one model"):
        compile_fast([], torch.randn(4, 5))


def test_non_module_member():
    with pytest.raises(TypeError, match=r"member 1"):
        compile_fast([MLP(), lambda x: x], torch.randn(4, 5))


class Glue(nn.Module):
    """Linear -> a glue op -> Linear-free output: checks the glue op's per-member semantics (the
    upstream project got softmax(dim=1), x.sum() and flatten wrong across members)."""

    def __init__(self, op, in_features=5, hidden=8):
        super().__init__()
        self.fc = nn.Linear(in_features, hidden)
        self.op = op

    def forward(self, x):
        return self.op(torch.tanh(self.fc(x)), x)


GLUE_OPS = {
    "softmax-dim1": (lambda h, x: torch.softmax(h, dim=1), (6, 5)),
    "softmax-dim-1": (lambda h, x: F.softmax(h, dim=-1), (6, 5)),
    "log_softmax-3d-dim1": (lambda h, x: F.log_softmax(h, dim=1), (6, 3, 5)),
    "softmax-dim0": (lambda h, x: torch.softmax(h, dim=0), (6, 5)),  # over the batch, per member
    "sum-all": (lambda h, x: h.sum(), (6, 5)),
    "mean-all": (lambda h, x: h.mean(), (6, 5)),
    "sum-dim1": (lambda h, x: h.sum(dim=1), (6, 5)),
    "mean-dim0-keepdim": (lambda h, x: h.mean(dim=0, keepdim=True), (6, 5)),
    "flatten": (lambda h, x: h.flatten(1), (6, 3, 5)),
    "view-batch": (lambda h, x: h.view(x.shape[0], 2, 4), (6, 5)),
    "view-minus-one": (lambda h, x: h.view(-1, 2, 4), (6, 5)),
    "reshape-transpose": (lambda h, x: h.reshape(x.size(0), 4, 2).transpose(1, 2), (6, 5)),
}


@pytest.mark.parametrize("name", list(GLUE_OPS))
def test_glue_ops_are_per_member(name):
    """Beyond the first-cut spec (which listed these as unsupported): the widen pass now has rules
    for them, so each must compute exactly what every member computes alone."""
    op, shape = GLUE_OPS[name]
    n = 3
    models = members(lambda: Glue(op), n)
    wide = compile_fast(models, torch.randn(*shape), strict=True)  # strict: no fallback allowed
    check_equivalence(wide, models, per_member_inputs(n, shape))
    check_equivalence(wide, models, (torch.randn(*shape),), shared=True)


class Cdist(LinearModel):
    linears = {"fc": (5, 8)}

    def forward(self, x):
        h = self.fc(x)
        return torch.cdist(h, h)  # NO-RULE-LINE


class Det(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 4)

    def forward(self, x):
        return torch.linalg.det(self.fc(x).view(-1, 2, 2))  # NO-RULE-LINE


NO_RULE = [(Cdist, r"aten\.cdist"), (Det, r"aten\.linalg_det")]


def _marked_line(cls) -> int:
    lines, start = inspect.getsourcelines(cls.forward)
    return start + next(k for k, line in enumerate(lines) if "NO-RULE-LINE" in line)


@pytest.mark.parametrize("cls, op", NO_RULE, ids=["cdist", "det"])
def test_unsupported_operation_strict(cls, op):
    with pytest.raises(wc.UnsupportedOperationError, match=op) as info:
        compile_fast([cls(), cls()], torch.randn(4, 5), strict=True)
    msg = str(info.value)
    assert isinstance(info.value, wc.WideCompileError) and isinstance(info.value, RuntimeError)
    assert f"test_compile.py:{_marked_line(cls)}" in msg, msg
    # The same through the config.
    with pytest.raises(wc.UnsupportedOperationError, match=op):
        wc.compile([cls(), cls()], torch.randn(4, 5), config=FAST.replace(strict=True))


@pytest.mark.parametrize("cls, op", NO_RULE, ids=["cdist", "det"])
def test_unsupported_operation_falls_back_with_a_warning_and_is_correct(cls, op):
    """Not in the first-cut spec (which said: error). The real API (DESIGN §4) runs an op with no
    rule per member through torch.vmap, warning once with the op and the source line."""
    n = 3
    models = members(cls, n)
    with pytest.warns(UserWarning, match=op) as record:
        wide = compile_fast(models, torch.randn(4, 5))
    texts = [str(w.message) for w in record if re.search(op, str(w.message))]
    where = f"test_compile.py:{_marked_line(cls)}"
    assert any(where in t for t in texts), texts
    check_equivalence(wide, models, per_member_inputs(n, (6, 5)))
    check_equivalence(wide, models, (torch.randn(6, 5),), shared=True)
    # The fallback is listed by report().
    report = wide.report()
    assert re.search(op, report) and where in report, report


@pytest.mark.parametrize("bad_shape, hint", [
    ((6, 5), r"N-first \[3, B, 5\]"),        # forgot the member dim
    ((4, 6, 5), r"N-first \[3, B, 5\]"),     # wrong N
    ((3, 6, 7), r"N-first \[3, B, 5\]"),     # wrong features
    ((3, 6, 2, 5), r"N-first \[3, B, 5\]"),  # wrong rank
])
def test_wrong_input_shape(bad_shape, hint):
    wide = compile_fast(members(MLP, 3), torch.randn(4, 5))
    with pytest.raises(ValueError, match=hint) as info:
        wide(torch.randn(bad_shape))
    assert "expand(3" in str(info.value)


def test_wrong_number_of_inputs():
    wide = compile_fast(members(MLP, 3), torch.randn(4, 5))
    with pytest.raises(ValueError):
        wide(torch.randn(3, 6, 5), torch.randn(3, 6, 5))


# ---------------------------------------------------------------------------------------------
# Inspection and torch.compile
# ---------------------------------------------------------------------------------------------
def test_summary_mentions_each_linear_and_its_strategy():
    models = members(lambda: MLP(3, nn.ReLU), 3)
    wide = wc.compile(models, torch.randn(4, 5), config=wc.WideConfig(strategy="loop"))
    text = wide.summary()
    assert isinstance(text, str)
    strategies = wide.strategies
    assert len(strategies) == 3
    lines = text.splitlines()
    for node, strategy in strategies.items():
        row = [ln for ln in lines if ln.split() and ln.split()[0] == node]
        assert len(row) == 1, (node, text)
        assert "wide.linear" in row[0] and strategy in row[0], row[0]
    for path in ("net.0", "net.2", "net.4"):
        assert path in text, text
    assert text.count("wide.linear") == 3


def test_torch_compile_of_wide_model_fullgraph():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    n = 3
    models = members(Branches, n)
    wide = compile_fast(models, torch.randn(4, 5))
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(wide, fullgraph=True, backend=counter)
    x = torch.randn(n, 4, 5)  # the sample's batch size
    assert_close(compiled(x), wide(x))
    for batch in (6, 9):
        x = torch.randn(n, batch, 5)
        torch._dynamo.mark_dynamic(x, 1)
        assert_close(compiled(x), wide(x))
        assert_members_close(compiled(x), [m(x[i]) for i, m in enumerate(models)])
    assert counter.frame_count >= 1
    assert counter.frame_count <= 2, f"recompiled {counter.frame_count} times for a new batch"


def test_torch_save_of_the_whole_wide_model_round_trips(tmp_path):
    models = members(lambda: MLP(2), 3)
    wide = compile_fast(models, torch.randn(4, 5))
    path = tmp_path / "wide.pt"
    torch.save(wide, path)
    loaded = torch.load(path, weights_only=False)
    xs = torch.randn(3, 6, 5)
    torch.testing.assert_close(loaded(xs), wide(xs))
    assert loaded.summary().count("wide.linear") == 2  # graphs rebuilt on first use


def test_outputs_are_contiguous_like_the_members():
    """Wide ops return strided views (the GEMM orientation, the shared-input path); the model's
    outputs are contiguous, so a user's .view() on them works as on the members' outputs."""
    models = members(lambda: MLP(2), 3)
    wide = compile_fast(models, torch.randn(4, 5))
    x = torch.randn(6, 5)
    for inp in (torch.randn(3, 6, 5), x.expand(3, 6, 5)):
        out = wide(inp)
        assert out.is_contiguous()
        assert out.view(3, -1).shape[1] == out[0].numel()


@cpu_only
def test_forced_strategies_apply_per_op_and_unknown_names_are_rejected():
    from wide_compiler.zoo import ConvNet
    models = members(lambda: ConvNet(channels=8), 2)
    sample = torch.randn(2, 3, 8, 8)
    # the RGB stem never runs channels-first grouped (Note [wide::conv strategies]): grouped_cl
    for forced, want in (("batched", {"bmm", "grouped", "grouped_cl"}), ("loop", {"loop"}),
                         ("bmm", {"bmm", "grouped", "grouped_cl"}), ("grouped", {"grouped", "grouped_cl", "bmm"}),
                         ("grouped_cl", {"grouped_cl", "bmm"})):
        wide = wc.compile(models, sample, config=wc.WideConfig(strategy=forced, tune=False))
        assert set(wide.strategies.values()) == want, (forced, wide.strategies)
    with pytest.raises(ValueError, match="no wide op of this model offers that strategy"):
        wc.compile(models, sample, config=wc.WideConfig(strategy="fused", tune=False))


def test_a_top_level_name_that_wide_model_uses_is_refused_with_the_fix():
    """``self.n = nn.LayerNorm(...)``: WideModel.n is the member count, so the stacked submodule
    cannot live under that name; a clear error, not PyTorch's bare KeyError."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.n = nn.Linear(4, 4), nn.LayerNorm(4)

        def forward(self, x):
            return self.n(self.a(x))

    with pytest.raises(wc.WideCompileError, match=r"top-level submodule 'n' has the name of a WideModel attribute"):
        compile_fast([Net(), Net()], torch.randn(2, 4))
