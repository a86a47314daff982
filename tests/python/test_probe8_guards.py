"""Findings P8-1, P8-2 and P8-7 of the eighth independent probe (issue 44), each a test that
failed before its fix: a method patched on its class after compiling (Note [A method patched on
its class] in fx/state_reads.py), per-member constants of inf/nan in softplus, leaky_relu and
hardtanh (Note [Per-member gradients at non-finite constants] in fx/rules/_constants.py), and a
BatchNorm inside a non-reentrant checkpoint (Note [State updated inside a checkpoint] in
fx/capture.py)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as cp
from torch import nn

import wide_compiler as wc
from support import check_change
from wide_compiler.errors import ArchitectureMismatchError, WideCompileError
from wide_compiler.fx.state_reads import FunctionRef

FAST = wc.WideConfig.fast()


# --- P8-7: methods and forwards reassigned on a class after compiling ------------------------------
class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x):
        return self.l(x)


class Base(nn.Module):
    def scale(self, h):
        return h * 2


class Patched(Base):
    def __init__(self) -> None:
        super().__init__()
        self.inner, self.out = Inner(), nn.Linear(4, 3)

    def act(self, h):
        return torch.tanh(h)

    def scale(self, h):
        return super().scale(h) + 1

    def forward(self, x):
        return self.out(self.scale(self.act(self.inner(x))))


def _lora_forward(self, x):
    return F.linear(x, self.weight, self.bias) + 1


def _sigmoid_act(self, h):
    return torch.sigmoid(h)


def _root_forward(self, x):
    return self.out(torch.sigmoid(self.inner(x)))


def _inner_forward(self, x):
    return self.l(x) * 2


def _base_scale(self, h):
    return h * 3


@pytest.mark.parametrize("owner,name,fn", [
    (Patched, "act", _sigmoid_act),  # a helper method the forward calls
    (Patched, "forward", _root_forward),  # the root class's forward
    (Inner, "forward", _inner_forward),  # a child module class's forward
    (nn.Linear, "forward", _lora_forward),  # torch's class, LoRA-style
    (Base, "scale", _base_scale),  # a base class's method reached through super()
], ids=["helper", "root_forward", "child_forward", "linear_forward", "super_method"])
def test_a_method_patched_on_its_class_after_compiling_is_followed(owner, name, fn, monkeypatch):
    """P8-7: the wide model kept the captured code (0.25-1.6 off); now the method's identity is a
    guard, so the call captures a graph with the patched method."""
    check_change(Patched, lambda mp: mp.setattr(owner, name, fn), monkeypatch, 2)


def test_a_method_set_back_runs_the_first_program(monkeypatch, caplog):
    """Setting the method back reuses the first graph (no third capture) with its values."""
    wide = wc.compile([Patched().double() for _ in range(2)], torch.randn(2, 4, dtype=torch.float64), config=FAST)
    x = torch.randn(2, 2, 4, dtype=torch.float64)
    first = wide(x)
    original = Patched.act
    monkeypatch.setattr(Patched, "act", _sigmoid_act)
    assert not torch.allclose(wide(x), first)
    monkeypatch.setattr(Patched, "act", original)
    caplog.clear()
    with caplog.at_level("INFO", logger="wide_compiler"):
        again = wide(x)
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    assert not [r for r in caplog.records if "captured the" in r.getMessage()]


def test_a_method_using_super_matches_itself_after_unpickling():
    """A guard's method read back from the compile cache matches the same method: a forward that
    calls ``super()`` has a ``__class__`` cell, which used to make its digest unknown (the graph
    was then captured again in every process)."""
    ref = pickle.loads(pickle.dumps(FunctionRef(Patched.scale)))
    assert ref.matches(Patched.scale)
    assert not ref.matches(Base.scale)


def _local_class() -> type[nn.Module]:
    class Local(nn.Module):  # qualname _local_class.<locals>.Local: not found by its name
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(4, 4)

        def act(self, h):
            return torch.tanh(h)

        def forward(self, x):
            return self.act(self.l(x))

    return Local


def test_a_class_defined_in_a_function_reuses_its_cached_graph(cache_dir, caplog, monkeypatch):
    """The forward guard of a class defined inside a function finds the class again when the compile
    cache reads the graph back in the same process (else every cached graph was captured again at
    its first call), and still follows a patch of its method."""
    from support import from_cache

    local = _local_class()

    def build():
        torch.manual_seed(0)
        members = [local().double() for _ in range(2)]
        return wc.compile(members, torch.randn(2, 4, dtype=torch.float64), config=FAST), members

    build()
    wide, members = from_cache(build)
    x = torch.randn(2, 2, 4, dtype=torch.float64)
    caplog.clear()
    with caplog.at_level("INFO", logger="wide_compiler"):
        out = wide(x)
    assert not [r for r in caplog.records if "captured the" in r.getMessage()]
    for i, m in enumerate(members):
        torch.testing.assert_close(out[i], m(x[i]))
    monkeypatch.setattr(local, "act", _sigmoid_act)
    out = wide(x)
    for i, m in enumerate(members):
        torch.testing.assert_close(out[i], m(x[i]))


# --- P8-1: non-finite per-member constants in softplus / leaky_relu / hardtanh ---------------------
class Act(nn.Module):
    def __init__(self, kind: str, s: float) -> None:
        super().__init__()
        self.a, self.kind, self.s = nn.Linear(4, 3), kind, s

    def forward(self, x):
        h = self.a(x)
        if self.kind == "softplus":
            return F.softplus(h, beta=self.s)
        if self.kind == "leaky":
            return F.leaky_relu(h, self.s)
        return F.hardtanh(h, -abs(self.s), abs(self.s))


@pytest.mark.parametrize("kind,values", [
    ("softplus", (1.0, float("inf"), -float("inf"), 0.5)),
    ("leaky", (0.1, float("inf"), float("nan"), -float("inf"))),
])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_non_finite_per_member_constant_gradients_are_torchs(kind, values, mode):
    """P8-1: the member with beta or slope inf/-inf/nan got NaN gradients where torch's are finite
    (0 * inf in the form's chain behind a ``where``)."""
    torch.manual_seed(0)
    models = [Act(kind, v).double() for v in values]
    wide = wc.compile(models, torch.randn(6, 4, dtype=torch.float64), config=FAST)
    assert wide.fallbacks == []
    getattr(wide, mode)()
    x = torch.randn(len(values), 6, 4, dtype=torch.float64, requires_grad=True)
    y = wide(x)
    y.sum().backward()
    weights = dict(wide.named_parameters())["a.weight"].grad
    for i, m in enumerate(models):
        m = copy.deepcopy(m)
        getattr(m, mode)()
        xi = x[i].detach().clone().requires_grad_()
        yi = m(xi)
        yi.sum().backward()
        torch.testing.assert_close(y[i], yi, equal_nan=True, msg=lambda s, i=i: f"member {i} output: {s}")
        torch.testing.assert_close(x.grad[i], xi.grad, equal_nan=True, msg=lambda s, i=i: f"member {i} dx: {s}")
        torch.testing.assert_close(weights[i], m.a.weight.grad, equal_nan=True,
                                   msg=lambda s, i=i: f"member {i} dW: {s}")


def test_hardtanh_nan_bound_is_refused_naming_it():
    """P8-1: a NaN hardtanh bound: ATen's own gradient depends on the tensor's size there (its
    vectorized and scalar loops disagree), so the form cannot follow it: refused, not silently off."""
    models = [Act("hardtanh", v).double() for v in (1.0, float("nan"), 2.0)]
    with pytest.raises(ArchitectureMismatchError, match=r"member 1: s is nan.*aten\.hardtanh.*NaN"):
        wc.compile(models, torch.randn(6, 4, dtype=torch.float64), config=FAST)
    inf = [Act("hardtanh", v).double() for v in (1.0, float("inf"), 2.0)]  # an infinite bound is a number
    wc.compile(inf, torch.randn(6, 4, dtype=torch.float64), config=FAST)


# --- P8-2: BatchNorm inside torch.utils.checkpoint (non-reentrant) ----------------------------------
class Checkpointed(nn.Module):
    def __init__(self, norm: bool = True) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(4) if norm else nn.Identity()
        self.fc = nn.Linear(4, 4)

    def block(self, t):
        return self.fc(torch.relu(self.bn(t)))

    def forward(self, x):
        return cp.checkpoint(self.block, x, use_reentrant=False)


def test_batchnorm_inside_a_checkpoint_is_refused_in_training():
    """P8-2: each member alone updates the BatchNorm's running statistics again when its backward
    recomputes the block; the wide graph updated them once (num_batches_tracked 1 vs 2). Refused at
    compile naming the module; eval compiles and matches the members."""
    torch.manual_seed(0)
    models = [Checkpointed().double() for _ in range(2)]
    sample = torch.randn(6, 4, dtype=torch.float64)
    with pytest.raises(WideCompileError, match=r"module 'bn' \(BatchNorm1d: .*num_batches_tracked.*checkpoint at"):
        wc.compile(models, sample, config=FAST)
    before = [copy.deepcopy(m.state_dict()) for m in models]
    for m, sd in zip(models, before):  # nothing changed by the refusal
        for k, v in m.state_dict().items():
            assert torch.equal(v, sd[k])
    for m in models:
        m.eval()
    wide = wc.compile(models, sample, config=FAST)
    x = torch.randn(2, 6, 4, dtype=torch.float64, requires_grad=True)
    out = wide(x)
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m(x[i]))


def test_a_checkpoint_without_state_updates_still_trains():
    """No false refusal: a checkpointed block that updates no buffer (and a BatchNorm outside any
    checkpoint) compiles in training and matches the members, gradients included."""
    torch.manual_seed(0)
    models = [Checkpointed(norm=False).double() for _ in range(2)]
    wide = wc.compile(models, torch.randn(6, 4, dtype=torch.float64), config=FAST)
    x = torch.randn(2, 6, 4, dtype=torch.float64, requires_grad=True)
    wide(x).sum().backward()
    grads = dict(wide.named_parameters())["fc.weight"].grad
    for i, m in enumerate(models):
        xi = x[i].detach().clone().requires_grad_()
        m(xi).sum().backward()
        torch.testing.assert_close(x.grad[i], xi.grad)
        torch.testing.assert_close(grads[i], m.fc.weight.grad)
