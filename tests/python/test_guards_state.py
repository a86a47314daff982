"""Note [State a forward reads] (fx/guards.py) and Note [What export does not capture] (fx/capture.py):
a forward that branches on the state of the process (``torch.compiler.is_compiling()``, an input's
memory layout, a global flag, a module global or class attribute, a device) must not have the
branch of capture time baked into the wide model. Every call is compared, member by member in
float64, with the member run alone under the same state: the wide model gives each member's own
result (capturing another graph where the first does not hold) or refuses clearly.
"""

from __future__ import annotations

import logging
import pickle
import re
import sys
import types

import pytest
import torch
from torch import are_deterministic_algorithms_enabled as _deterministic  # readers imported by name
from torch import is_grad_enabled as _grad_enabled
from torch import nn
from torch.compiler import is_compiling as _is_compiling  # a name bound at import

import wide_compiler as wc
from support import DEVICE, LinearModel, all_to_eval, cpu_only

N = 3
FAST = wc.WideConfig.fast()
SCALE = 2.0  # module globals the forwards below read; the tests change them (monkeypatch)
OFFSET = (1.0, -1.0)


def _members(cls, *args, **kwargs):
    torch.manual_seed(0)
    return [cls(*args, **kwargs).double() for _ in range(N)]


def _assert_members(wide, members, *xs, rtol=1e-12, atol=1e-12):
    out = wide(*xs)
    for i, m in enumerate(members):
        ref = m(*(x[i] for x in xs))
        assert out[i].dtype == ref.dtype, f"member {i}: {out[i].dtype} != {ref.dtype}"
        torch.testing.assert_close(out[i], ref, rtol=rtol, atol=atol, msg=lambda m, i=i: f"member {i}: {m}")
    return out


def _x(*shape):
    return torch.randn(N, *shape, dtype=torch.float64)


def _compile(cls, *shape):
    members = _members(cls)
    return wc.compile(members, torch.randn(*shape, dtype=torch.float64), config=FAST), members


def _graphs(wide):
    return 1 + sum(len(v) for v in wide._variants.values())


# --- 1. torch.compiler.is_compiling() ------------------------------------------------------------


class _Compiling(LinearModel):
    fields = ("ask",)

    def forward(self, x):
        h = self.fc(x)
        return h * 2 if self.ask() else h * 3


ASKS = {"torch.compiler.is_compiling": lambda: torch.compiler.is_compiling(),
        "torch.compiler.is_exporting": lambda: torch.compiler.is_exporting(),
        "torch._dynamo.is_compiling": lambda: torch._dynamo.is_compiling(),
        "bound is_compiling": lambda: _is_compiling()}


@pytest.mark.parametrize("ask", sorted(ASKS))
def test_a_forward_asking_is_compiling_gets_what_each_member_gets_alone(ask):
    members = _members(_Compiling, ASKS[ask])
    wide = wc.compile(members, torch.randn(2, 4, dtype=torch.float64), config=FAST)
    _assert_members(wide, members, _x(2, 4))
    assert not torch.compiler.is_compiling()  # the functions are torch's own again


class _CompilingCheck(LinearModel):
    """Validates its input in eager mode only (a data-dependent check export cannot capture)."""

    def forward(self, x):
        if not torch.compiler.is_compiling() and bool((x.abs() > 100).any()):
            raise ValueError("input out of range")
        return self.fc(x)


def test_an_eager_branch_export_cannot_capture_is_refused_naming_is_compiling():
    with pytest.raises(wc.WideCompileError, match=r"is_compiling\(\).*test_guards_state.py"):
        wc.compile(_members(_CompilingCheck), torch.randn(2, 4, dtype=torch.float64), config=FAST)


# --- 2. an input's memory layout -----------------------------------------------------------------


class _Contiguous(LinearModel):
    def forward(self, x):
        h = self.fc(x)
        return h * 2 if x.is_contiguous() else h * 3


class _Strides(LinearModel):
    def forward(self, x):
        return self.fc(x) + (1.0 if x.stride(-1) == 1 else -1.0)


class _ChannelsLast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 1)

    def forward(self, x):
        h = self.conv(x)
        return h + 1 if x.is_contiguous(memory_format=torch.channels_last) else h - 1


@pytest.mark.parametrize("cls", [_Contiguous, _Strides])
def test_a_layout_branch_follows_the_calls_layout(cls):
    wide, members = _compile(cls, 2, 5, 4)
    _assert_members(wide, members, _x(2, 5, 4))
    transposed = torch.randn(N, 2, 4, 5, dtype=torch.float64).transpose(2, 3)  # each member's slice too
    _assert_members(wide, members, transposed)
    assert _graphs(wide) == 2
    _assert_members(wide, members, _x(2, 5, 4))  # the first graph again, no third one
    _assert_members(wide, members, torch.randn(N, 2, 4, 5, dtype=torch.float64).transpose(2, 3))
    assert _graphs(wide) == 2


def test_a_channels_last_branch_follows_the_calls_memory_format():
    wide, members = _compile(_ChannelsLast, 2, 2, 3, 3)
    x = _x(2, 2, 3, 3)
    _assert_members(wide, members, x)
    last = torch.stack([xi.contiguous(memory_format=torch.channels_last) for xi in x])
    assert last[0].is_contiguous(memory_format=torch.channels_last)
    _assert_members(wide, members, last)


def test_a_forward_that_reads_no_layout_takes_any_layout_on_one_graph():
    class Plain(LinearModel):
        def forward(self, x):
            return self.fc(x) * 2

    wide, members = _compile(Plain, 2, 5, 4)
    _assert_members(wide, members, torch.randn(N, 2, 4, 5, dtype=torch.float64).transpose(2, 3))
    assert _graphs(wide) == 1 and not wide._graph_for(True).guards.layout


# --- 3. global flags -------------------------------------------------------------------------------


class _Flag(LinearModel):
    fields = ("read",)

    def forward(self, x):
        h = self.fc(x)
        return h * 2 if self.read() else h * 3


class _BoundFlag(LinearModel):
    def forward(self, x):
        h = self.fc(x)
        return h * 2 if _deterministic() else h * 3


FLAGS = {"torch.are_deterministic_algorithms_enabled": (_Flag, lambda: torch.are_deterministic_algorithms_enabled()),
         "bound are_deterministic_algorithms_enabled": (_BoundFlag,)}


@pytest.mark.parametrize("flag", sorted(FLAGS))
def test_a_deterministic_algorithms_branch_follows_the_flag(flag):
    members = _members(*FLAGS[flag])
    wide = wc.compile(members, torch.randn(2, 4, dtype=torch.float64), config=FAST)
    before = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(not before)
        _assert_members(wide, members, _x(2, 4))
    finally:
        torch.use_deterministic_algorithms(before)
    _assert_members(wide, members, _x(2, 4))
    assert _graphs(wide) == 2


class _BoundGradMode(LinearModel):
    def forward(self, x):
        h = self.fc(x)
        return h * 2 if _grad_enabled() else h * 3


def test_a_grad_mode_reader_imported_by_name_is_guarded():
    wide, members = _compile(_BoundGradMode, 2, 4)
    x = _x(2, 4)
    _assert_members(wide, members, x)
    with torch.no_grad():
        _assert_members(wide, members, x)


def test_a_default_dtype_branch_follows_the_default_dtype():
    members = _members(_Flag, lambda: torch.get_default_dtype() == torch.float32)
    wide = wc.compile(members, torch.randn(2, 4, dtype=torch.float64), config=FAST)
    before = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        _assert_members(wide, members, _x(2, 4))
    finally:
        torch.set_default_dtype(before)
    _assert_members(wide, members, _x(2, 4))


class _LiftedConstant(LinearModel):
    def forward(self, x):
        return self.fc(x) * torch.tensor(0.1)  # made in the default dtype of the call


def test_a_tensor_made_in_the_default_dtype_follows_the_default_dtype():
    wide, members = _compile(_LiftedConstant, 2, 4)
    x = _x(2, 4)
    _assert_members(wide, members, x)
    before = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        _assert_members(wide, members, x)
    finally:
        torch.set_default_dtype(before)
    _assert_members(wide, members, x)


def test_an_autocast_branch_follows_the_autocast_state():
    members = [m.float() for m in _members(_Flag, lambda: torch.is_autocast_enabled("cpu"))]
    wide = wc.compile(members, torch.randn(2, 4), config=FAST)
    x = torch.randn(N, 2, 4)
    _assert_members(wide, members, x, rtol=1e-6, atol=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _assert_members(wide, members, x, rtol=1e-2, atol=1e-2)
    _assert_members(wide, members, x, rtol=1e-6, atol=1e-6)


# --- 4. module globals and class attributes ----------------------------------------------------------


def _shift(h):
    return h + OFFSET[0]


class _Globals(LinearModel):
    FACTOR = 1.5

    def forward(self, x):
        return _shift(self.fc(x) * SCALE) * self.FACTOR


@pytest.mark.parametrize("change", ["SCALE", "OFFSET", "FACTOR"])
def test_a_changed_module_global_or_class_attribute_is_followed(change, monkeypatch):
    wide, members = _compile(_Globals, 2, 4)
    x = _x(2, 4)
    _assert_members(wide, members, x)
    if change == "FACTOR":
        monkeypatch.setattr(_Globals, "FACTOR", -4.0)
    else:
        monkeypatch.setattr(sys.modules[__name__], change, 3.0 if change == "SCALE" else (5.0, 1.0))
    _assert_members(wide, members, x)
    assert _graphs(wide) == 2
    monkeypatch.undo()
    _assert_members(wide, members, x)  # the first graph holds again: no third capture
    assert _graphs(wide) == 2


class _TensorOfGlobal(LinearModel):
    def forward(self, x):
        return self.fc(x) * torch.tensor(SCALE, dtype=torch.float64)  # a lifted constant per capture


def test_a_graph_captured_for_a_changed_global_reads_its_own_constants(monkeypatch):
    wide, members = _compile(_TensorOfGlobal, 2, 4)
    x = _x(2, 4)
    _assert_members(wide, members, x)
    monkeypatch.setattr(sys.modules[__name__], "SCALE", 5.0)
    _assert_members(wide, members, x)
    monkeypatch.undo()
    _assert_members(wide, members, x)
    assert _graphs(wide) == 2


class _ModeConstant(LinearModel):
    def forward(self, x):
        return self.fc(x) * torch.tensor(0.5 if self.training else 2.0, dtype=torch.float64)


def test_the_train_and_eval_graphs_read_their_own_lifted_constants():
    wide, members = _compile(_ModeConstant, 2, 4)
    x = _x(2, 4)
    _assert_members(wide, members, x)
    all_to_eval(wide, members)
    _assert_members(wide, members, x)


def test_an_equal_value_is_not_a_change_but_an_int_for_a_float_is(monkeypatch):
    wide, members = _compile(_Globals, 2, 4)
    x = _x(2, 4)
    wide(x)
    monkeypatch.setattr(sys.modules[__name__], "SCALE", float("2.0"))  # another object, the same value
    _assert_members(wide, members, x)
    assert _graphs(wide) == 1
    monkeypatch.setattr(sys.modules[__name__], "SCALE", 2)
    _assert_members(wide, members, x)
    assert _graphs(wide) == 2


@cpu_only
def test_guards_with_globals_survive_pickling(monkeypatch):
    wide, _ = _compile(_Globals, 2, 4)
    x = _x(2, 4)
    guards = wide._graph_for(True).guards
    assert {e[2] for e in guards.watched} >= {"SCALE", "OFFSET", "FACTOR"}
    again = pickle.loads(pickle.dumps(guards))
    pdt, pdev = torch.float64, torch.device("cpu")
    assert again.holds((x,), pdt, pdev) and again.failed((x,), pdt, pdev) is None
    monkeypatch.setattr(_Globals, "FACTOR", 7.0)
    assert not again.holds((x,), pdt, pdev)
    assert "FACTOR" in again.failed((x,), pdt, pdev)


CFG = {"act": "tanh", "scale": 1.0}  # mutable globals: guarded by their contents
NS = types.SimpleNamespace(shift=0.5)
LAYERS = [1.0, 2.0]
NOT_PLAIN = {"w": [1.0, 2.0], "t": torch.ones(1)}  # a value that is not plain (a tensor in a dict): named in a warning at capture


class _Contents(LinearModel):
    TABLE = {"gain": 2.0}  # a class attribute that is a dict

    def forward(self, x):
        h = self.fc(x) * CFG["scale"] * self.TABLE["gain"] + NS.shift + LAYERS[-1]
        return torch.tanh(h) if CFG["act"] == "tanh" else torch.relu(h)


@cpu_only
@pytest.mark.parametrize("change", ["dict item", "dict branch", "namespace", "list", "class dict"])
def test_the_contents_of_a_mutable_global_are_followed(change):
    """A dict item, a namespace attribute, a list item, a class attribute's item changed after
    compiling: the next call captures a graph for it (it ran the old branch or value: 0.5-1 off)."""
    wide, members = _compile(_Contents, 2, 4)
    x = _x(2, 4)
    _assert_members(wide, members, x)
    target, key, value = {"dict item": (CFG, "scale", 3.0), "dict branch": (CFG, "act", "relu"),
                          "namespace": (NS, "shift", -2.0), "list": (LAYERS, 1, 5.0),
                          "class dict": (_Contents.TABLE, "gain", -1.0)}[change]
    was = target[key] if not isinstance(target, types.SimpleNamespace) else getattr(target, key)
    put = (lambda v: setattr(target, key, v)) if isinstance(target, types.SimpleNamespace) else \
        (lambda v: target.__setitem__(key, v))
    put(value)  # in place: the object stays the same one
    try:
        _assert_members(wide, members, x)
        assert _graphs(wide) == 2
    finally:
        put(was)
    _assert_members(wide, members, x)  # the first graph holds again
    assert _graphs(wide) == 2
    again = pickle.loads(pickle.dumps(wide._graph_for(True).guards))  # the compile cache's copy
    assert again.failed((x,), torch.float64, torch.device("cpu")) is None


class _NotPlain(LinearModel):
    def forward(self, x):
        return self.fc(x) * NOT_PLAIN["w"][0]


def test_a_mutable_global_that_cannot_be_guarded_is_named_at_capture(caplog):
    with caplog.at_level(logging.WARNING, logger="wide_compiler"):
        _compile(_NotPlain, 2, 4)
    assert "reads test_guards_state.NOT_PLAIN, mutable" in caplog.text
    assert "is not seen by the compiled graphs" in caplog.text


STATS = {"calls": 0}  # state a forward keeps in a mutable global: not a setting to guard
SEEN: list = []


class _Counts(LinearModel):
    def forward(self, x):
        STATS["calls"] += 1
        SEEN.append(1.0)
        return self.fc(x) * CFG["scale"]


def test_a_mutable_global_the_forward_changes_is_state_not_a_guard():
    """``STATS["calls"] += 1`` and ``SEEN.append(...)`` in the forward: guarding their contents
    would capture again at every call (and refuse after 8); the dict the forward only reads is
    still guarded."""
    wide, members = _compile(_Counts, 2, 4)
    x = _x(2, 4)
    for _ in range(10):
        _assert_members(wide, members, x)
    assert _graphs(wide) == 1
    watched = {e[2] for e in wide._graph_for(True).guards.watched}
    assert "CFG" in watched and not watched & {"STATS", "SEEN"}


# --- 5. devices -------------------------------------------------------------------------------------


@cpu_only
def test_an_input_on_another_device_than_the_parameters_is_refused_naming_it():
    wide, _ = _compile(_Contiguous, 2, 4)
    with pytest.raises(ValueError, match=r"input 'x' is on meta, but the model's parameters are on cpu"):
        wide(torch.randn(N, 2, 4, dtype=torch.float64, device="meta"))


class _DeviceBranch(LinearModel):
    def forward(self, x):
        h = self.fc(x)
        return h * 2 if x.device.type == "cpu" else h * 3


@cpu_only
def test_a_device_branch_is_guarded_on_the_parameters_device():
    wide, members = _compile(_DeviceBranch, 2, 4)
    x = _x(2, 4)
    _assert_members(wide, members, x)
    guards = wide._graph_for(True).guards
    assert guards.device == "cpu"
    assert guards.holds((x,), torch.float64, torch.device("cpu"))
    # the model moved (as by .to()): the graph does not hold, and says why
    assert not guards.holds((x,), torch.float64, torch.device("meta"))
    with pytest.raises(ValueError, match="input 'x' is on cpu, but the model's parameters are on meta"):
        guards.failed((x,), torch.float64, torch.device("meta"))
    moved = torch.empty_like(x, device="meta")
    assert "reads a tensor's device" in guards.failed((moved,), torch.float64, torch.device("meta"))


# --- what the scan follows, and the watch's patches ---------------------------------------------------


class _Helpers(LinearModel):
    LIMIT = 0.5

    @property
    def gain(self):
        return SCALE + 1

    def clip(self, h):
        return h.clamp(-self.LIMIT, self.LIMIT)

    def forward(self, x):
        return self.clip(self.fc(x)) * self.gain


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _Helpers()

    def forward(self, x):
        return self.inner(x) + 1


@pytest.mark.parametrize("change", ["SCALE", "LIMIT"])
def test_globals_read_by_methods_and_properties_of_submodules_are_followed(change, monkeypatch):
    wide, members = _compile(_Outer, 2, 4)
    x = _x(2, 4)
    _assert_members(wide, members, x)
    if change == "LIMIT":
        monkeypatch.setattr(_Helpers, "LIMIT", 0.1)
    else:
        monkeypatch.setattr(sys.modules[__name__], "SCALE", -1.0)
    _assert_members(wide, members, x)


def test_the_watch_leaves_torch_as_it_was_after_captures_in_two_threads():
    import threading

    saved = (torch.is_grad_enabled, torch.are_deterministic_algorithms_enabled, torch.compiler.is_compiling.__code__,
             torch.autograd.function.Function.__dict__["apply"])
    errors = []

    def run():
        try:
            _compile(_Contiguous, 2, 4)
        except Exception as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert saved == (torch.is_grad_enabled, torch.are_deterministic_algorithms_enabled,
                     torch.compiler.is_compiling.__code__, torch.autograd.function.Function.__dict__["apply"])
    assert not {"is_contiguous", "stride", "is_cuda", "is_cpu"} & set(torch.Tensor.__dict__)


# --- random ops: what draws, and an explicit generator ------------------------------------------------


class _Bernoulli(LinearModel):
    fields = ("p",)

    def forward(self, x):
        h = self.fc(x)
        return h * torch.empty_like(h).bernoulli_(self.p)


@pytest.mark.parametrize("p", [0.0, 1.0])
def test_a_bernoulli_with_p_0_or_1_does_not_draw_and_is_compared(p):
    members = _members(_Bernoulli, p)
    wide = wc.compile(members, torch.randn(2, 4, dtype=torch.float64), config=FAST)
    assert wc.testing.random_ops(wide) == []
    _assert_members(wide, members, _x(2, 4))
    assert wc.testing.random_ops(wc.compile(_members(_Bernoulli, 0.5), torch.randn(2, 4, dtype=torch.float64),
                                            config=FAST)) != []


GENERATOR = torch.Generator(DEVICE).manual_seed(0)


class _Generator(LinearModel):
    def __init__(self, own: bool) -> None:
        super().__init__()
        self.gen = torch.Generator(DEVICE).manual_seed(0) if own else GENERATOR

    def forward(self, x):
        h = self.fc(x)
        return h * torch.empty_like(h).bernoulli_(0.5, generator=self.gen)


@pytest.mark.parametrize("own", [True, False])
def test_an_explicit_generator_is_refused_naming_the_op_and_line(own):
    # (on a GPU torch.export stops at the generator argument itself, before any op: the line alone)
    with pytest.raises(wc.WideCompileError, match=r"member 0 \(_Generator\) draws random numbers with an explicit "
                                                  r"generator= \((aten.bernoulli_.float )?at .*test_guards_state.py"):
        wc.compile(_members(_Generator, own), torch.randn(2, 4, dtype=torch.float64), config=FAST)


def test_exports_own_refusal_of_a_generator_argument_is_named_as_one():
    """torch.export on a GPU stops at a CUDA generator argument itself ("argument of type:
    <class 'torch._C.Generator'>", torch 2.11), before the capture could name the op: the error
    still says an explicit generator= is the cause, with the line of the forward."""
    from wide_compiler.fx.capture_errors import capture_error

    def forward():  # stands in for the member's forward, a frame of this (user) file
        raise NotImplementedError("argument of type: <class 'torch._C.Generator'>")

    try:
        forward()
    except NotImplementedError as e:
        err = capture_error(_Generator(True), e)
    assert re.search(r"member 0 \(_Generator\) draws random numbers with an explicit generator= \(at "
                     r".*test_guards_state.py:\d+ in forward: raise NotImplementedError", str(err)), err
    assert "default generator" in str(err)


CALLS = 0


class _Counter(LinearModel):
    """Counts its calls in a module global: state it keeps, not a setting to guard."""

    def forward(self, x):
        global CALLS
        CALLS += 1
        return self.fc(x) * SCALE


def test_a_global_the_forward_writes_is_not_guarded():
    wide, members = _compile(_Counter, 2, 4)
    for _ in range(10):
        _assert_members(wide, members, _x(2, 4))  # the members' calls count up CALLS
    assert _graphs(wide) == 1  # 10 calls: more than MAX_GRAPHS captures had each been one
    assert "CALLS" not in {e[2] for e in wide._graph_for(True).guards.watched}
    assert "SCALE" in {e[2] for e in wide._graph_for(True).guards.watched}
