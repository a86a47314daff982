"""Findings P8-3, P8-4 and P8-5 of the eighth independent probe (issue 44): state a forward or a
hook keeps in plain objects (an object its module holds, the object a hook is bound to). Each test
failed before its fix."""

from __future__ import annotations

import dataclasses
import functools
import types

import pytest
import torch
from torch import nn

import wide_compiler as wc
from support import LinearModel

FAST = wc.WideConfig.fast()


@dataclasses.dataclass
class _State:
    step: int = 0
    seen: list = dataclasses.field(default_factory=list)


class _Plain:
    def __init__(self):
        self.inner = types.SimpleNamespace(step=0)


def _holder(kind):
    if kind == "dataclass":
        return _State()
    if kind == "namespace":
        return types.SimpleNamespace(step=0, seen=[])
    if kind == "in a dict":
        return {"a": _State()}
    return _Plain()  # two levels: self.state.inner.step


def _step(state):
    return state["a"] if isinstance(state, dict) else state.inner if isinstance(state, _Plain) else state


class _Warmup(LinearModel):
    """A warm-up schedule kept in an object the module holds: reads the count it writes."""

    fields = ("state",)

    def forward(self, x):
        s = _step(self.state)
        s.step += 1
        return self.fc(x) * min(1.0, s.step / 4)


class _OnlyCounts(LinearModel):
    """Writes into its held object, never reads it into an output: a call counter and a log."""

    fields = ("state",)

    def forward(self, x):
        self.state.step += 1
        self.state.seen.append(tuple(x.shape))
        return self.fc(x)


class _Scratch(LinearModel):
    """Sets its held object's attribute before reading it at every call (scratch state)."""

    fields = ("state",)

    def forward(self, x):
        self.state.step = x.shape[0]
        return self.fc(x) * self.state.step


def _held_state(models):
    return [dataclasses.asdict(m.state) if dataclasses.is_dataclass(m.state) else dict(vars(m.state))
            for m in models]


@pytest.mark.parametrize("kind,says", [
    ("dataclass", "self.state.step of the root (_Warmup): 0 -> 1"),
    ("namespace", "self.state.step of the root (_Warmup): 0 -> 1"),
    ("in a dict", "self.state['a'].step of the root (_Warmup): 0 -> 1"),
    ("plain object", "self.state.inner.step of the root (_Warmup): 0 -> 1"),
])
def test_a_forward_writing_an_object_its_module_holds_is_refused(kind, says):
    """P8-3: ``self.state.step += 1`` on a dataclass, namespace or plain object the module holds
    compiled, and the wide model ran the capture's count at every call (0.2-2.1 off). Refused now,
    naming the path; the users' objects are left as they were."""
    torch.manual_seed(0)
    models = [_Warmup(_holder(kind)) for _ in range(2)]
    with pytest.raises(wc.WideCompileError, match="writes Python attributes of its modules") as err:
        wc.compile(models, torch.randn(3, 4), config=FAST)
    assert says in str(err.value) and "register_buffer" in str(err.value)
    assert all(_step(m.state).step == 0 for m in models)


def test_compile_leaves_the_members_held_objects_as_they_were():
    """P8-4: the member check ran each member in place and put back its modules' attributes but
    not the objects they hold: after compile every member's ``state.step`` was 1 and ``state.seen``
    held the sample's shape. Now compile changes none of them (and the forward, whose writes only
    feed themselves, compiles: Note [A forward that writes its module's attributes])."""
    torch.manual_seed(0)
    models = [_OnlyCounts(types.SimpleNamespace(step=0, seen=[])) for _ in range(3)]
    seen = [m.state.seen for m in models]
    wide = wc.compile(models, torch.randn(3, 4), config=FAST)
    assert _held_state(models) == [{"step": 0, "seen": []}] * 3
    assert all(m.state.seen is s for m, s in zip(models, seen))
    x = torch.randn(3, 2, 4)
    torch.testing.assert_close(wide(x), torch.stack([m(x[i]) for i, m in enumerate(models)]))


def test_a_refused_compile_leaves_the_members_held_objects_as_they_were():
    """P8-4, refused: the compile that refuses the warm-up forward changed nothing either."""
    models = [_Warmup(_State()) for _ in range(3)]
    with pytest.raises(wc.WideCompileError):
        wc.compile(models, torch.randn(3, 4), config=FAST)
    assert _held_state(models) == [{"step": 0, "seen": []}] * 3


def test_held_state_that_only_feeds_itself_or_is_set_first_still_compiles():
    """The Note's allowances hold one level down: a counter and a log that never reach an output,
    and scratch state set before it is read at every call, compile and match the members."""
    torch.manual_seed(0)
    for cls, state in ((_OnlyCounts, lambda: _State()), (_Scratch, lambda: types.SimpleNamespace(step=0))):
        models = [cls(state()) for _ in range(2)]
        wide = wc.compile(models, torch.randn(3, 4), config=FAST)
        for batch in (3, 5):
            x = torch.randn(2, batch, 4)
            with torch.no_grad():
                torch.testing.assert_close(wide(x), torch.stack([m(x[i]) for i, m in enumerate(models)]))


class _Recorder:
    def __init__(self):
        self.items = []

    def __call__(self, mod, inp, out):
        self.items.append(out.detach())


class _Counted:
    def __init__(self):
        self.n = 0

    def hook(self, mod, inp, out):
        self.n += 1
        return out * self.n

    def log(self, out):
        self.last = out

    def via_method(self, mod, inp, out):
        self.log(out)


def _record(store, mod, inp, out):
    store.append(out)


def _scaled(scale, mod, inp, out):
    return out * scale


def _mlp():
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))


@pytest.mark.parametrize("hook,says", [
    (lambda: _Recorder(), "(self.items, state of the _Recorder object it is bound to)"),
    (lambda: _Counted().hook, "(self.n, state of the _Counted object it is bound to)"),
    (lambda: _Counted().via_method, "(self.last, state of the _Counted object it is bound to)"),
    (lambda: functools.partial(_record, []), "(store, state of the list object it is bound to)"),
])
def test_a_hook_writing_the_object_it_is_bound_to_is_refused(hook, says):
    """P8-5: a forward hook that is a callable object recording activations, or a bound method
    counting its calls, compiled: the recorder was never fed by wide calls, the counter was baked
    in (0.18-0.33 off). Refused now, as a closure writing outside itself is, before any member runs
    (the recorders stay empty)."""
    torch.manual_seed(0)
    models, hooks = [_mlp() for _ in range(2)], []
    for m in models:
        hooks.append(hook())
        m[0].register_forward_hook(hooks[-1])
    # (on a GPU the capture's placeholder is found in the recorder first: "...: it writes into ...")
    with pytest.raises(wc.WideCompileError, match="writes into state outside it") as err:
        wc.compile(models, torch.randn(3, 4), config=FAST)
    assert says in str(err.value)
    for h in hooks:
        owner = h.func if isinstance(h, functools.partial) else getattr(h, "__self__", h)
        if isinstance(owner, _Recorder):
            assert owner.items == []
        if isinstance(owner, _Counted):
            assert owner.n == 0 and not hasattr(owner, "last")
        if isinstance(h, functools.partial):
            assert h.args[0] == []


def test_a_bound_hook_that_only_reads_its_object_still_compiles():
    """A hook bound to an object (a partial's scale, a method reading its object) that writes
    nothing compiles and matches the members."""
    torch.manual_seed(0)
    models = [_mlp() for _ in range(2)]
    for m in models:
        m[0].register_forward_hook(functools.partial(_scaled, 2.0))
    wide = wc.compile(models, torch.randn(3, 4), config=FAST)
    x = torch.randn(2, 3, 4)
    with torch.no_grad():
        torch.testing.assert_close(wide(x), torch.stack([m(x[i]) for i, m in enumerate(models)]))
