"""Note [State a forward reads] (fx/state_reads.py), probe 4's findings: Python state the members'
code reads through a module's hooks (F5), a plain class used as a namespace or a tuple holding a
list (F6), another user module's attribute or function, or a closure cell (D1), changed after
compiling, must not leave the wide model on its old value: each call is compared, member by member
in float64, with the member run alone after the change.
"""

from __future__ import annotations

import functools
import logging
import sys
import types

import pytest
import torch
from torch import nn

from support import LinearModel, assert_each_member, check_change, compile_float64, float64_input, set_global

N = 2
S = 1.0  # a module global the hooks and helpers below read; the tests change it (monkeypatch)


_compile = functools.partial(compile_float64, n=N)
_x = functools.partial(float64_input, N)
_check_change = functools.partial(check_change, n=N)
_set_global = functools.partial(set_global, sys.modules[__name__])


# --- F5: hooks of the modules of the tree -------------------------------------------------------------


def _pre_hook(mod, args):
    return (args[0] * S,)


def _post_hook(mod, args, out):
    return out + S


class _PreHooked(LinearModel):
    def __init__(self):
        super().__init__()
        self.hook(self.fc)

    @staticmethod
    def hook(fc):
        fc.register_forward_pre_hook(_pre_hook)

    def forward(self, x):
        return self.fc(x)


class _PostHooked(_PreHooked):
    @staticmethod
    def hook(fc):
        fc.register_forward_hook(_post_hook)


@pytest.mark.parametrize("cls", [_PreHooked, _PostHooked])
def test_a_global_a_modules_hook_reads_is_guarded(cls, monkeypatch):
    _check_change(cls, _set_global("S", 2.5), monkeypatch)


class _SelfHooked(LinearModel):
    K = 1.0  # a class attribute the hook reads of the module it is handed

    def __init__(self):
        super().__init__()
        self.register_forward_hook(lambda mod, args, out: out * mod.K)

    def forward(self, x):
        return self.fc(x)


def test_a_class_attribute_a_hook_reads_of_its_module_is_guarded(monkeypatch):
    _check_change(_SelfHooked, lambda mp: mp.setattr(_SelfHooked, "K", 3.0), monkeypatch)


def _double_linear_inputs(mod, args):
    if isinstance(mod, nn.Linear):
        return (args[0] * 2,)
    return None


class _Plain(LinearModel):
    def forward(self, x):
        return self.fc(x)


@pytest.mark.parametrize("when", ["registered", "removed"])
def test_a_global_module_hook_changed_after_compiling_is_seen(when):
    handle = nn.modules.module.register_module_forward_pre_hook(_double_linear_inputs) if when == "removed" else None
    try:
        wide, members = _compile(_Plain)
        x = _x()
        with torch.no_grad():
            assert_each_member(wide, members, x)
            if when == "registered":
                handle = nn.modules.module.register_module_forward_pre_hook(_double_linear_inputs)
            else:
                handle.remove()
                handle = None
            assert_each_member(wide, members, x)
    finally:
        if handle is not None:
            handle.remove()


# --- F6: a plain class as a namespace, a tuple holding a list -------------------------------------------


class Cfg:
    K = 1.0


class _ClassNamespace(LinearModel):
    def forward(self, x):
        return self.fc(x) * Cfg.K


class Helper:
    K2 = 1.0

    @classmethod
    def cscale(cls, h):
        return h * cls.K2


class _ClassMethod(LinearModel):
    def forward(self, x):
        return Helper.cscale(self.fc(x))


@pytest.mark.parametrize(("cls", "change"), [(_ClassNamespace, lambda mp: mp.setattr(Cfg, "K", 3.0)),
                                             (_ClassMethod, lambda mp: mp.setattr(Helper, "K2", 4.0))],
                         ids=["a plain class's attribute", "one a classmethod reads"])
def test_a_plain_class_attribute_is_guarded(cls, change, monkeypatch):
    _check_change(cls, change, monkeypatch)


TUP = (1.0, [1.0])


class _TupleList(LinearModel):
    def forward(self, x):
        return self.fc(x) * TUP[1][0]


def test_a_list_in_a_global_tuple_is_guarded(monkeypatch):
    try:
        _check_change(_TupleList, lambda mp: TUP[1].__setitem__(0, 2.0), monkeypatch)
    finally:
        TUP[1][0] = 1.0


# --- D1: another user module's attribute and function, closure cells ---------------------------------------


def _user_module(name, source):
    """A module of the user's (its file beside this one), registered in sys.modules."""
    mod = types.ModuleType(name)
    mod.__file__ = __file__.replace("test_guards_reach2.py", f"{name}.py")
    exec(compile(source, mod.__file__, "exec"), mod.__dict__)  # noqa: S102
    sys.modules[name] = mod
    return mod


cfgmod = _user_module("_wc_reach2_cfgmod", "X = 1.0\ndef f(h):\n    return h * X\n")


class _ModuleAttribute(LinearModel):
    def forward(self, x):
        return self.fc(x) * cfgmod.X


class _ModuleFunction(LinearModel):
    def forward(self, x):
        return cfgmod.f(self.fc(x))


@pytest.mark.parametrize("cls", [_ModuleAttribute, _ModuleFunction])
def test_another_user_modules_attribute_is_guarded(cls, monkeypatch):
    _check_change(cls, lambda mp: mp.setattr(cfgmod, "X", 4.0), monkeypatch)


def _make_cell():
    v = 1.0
    box = {"v": 1.0}

    def scaled(h):
        return h * v * box["v"]

    def set_v(new):
        nonlocal v
        v = new

    return scaled, set_v, box


CELL, SET_CELL, BOX = _make_cell()


class _Closure(LinearModel):
    def forward(self, x):
        return CELL(self.fc(x))


@pytest.mark.parametrize("what", ["cell", "dict in a cell"])
def test_a_closure_cell_is_guarded(what, monkeypatch):
    if what == "cell":
        try:
            _check_change(_Closure, lambda mp: SET_CELL(7.0), monkeypatch)
        finally:
            SET_CELL(1.0)
    else:
        _check_change(_Closure, lambda mp: mp.setitem(BOX, "v", 7.0), monkeypatch)


NOT_PLAIN_TUPLE = (1.0, [torch.ones(4, dtype=torch.float64)])


class _TupleOfTensors(LinearModel):
    def forward(self, x):
        return self.fc(x) * NOT_PLAIN_TUPLE[1][0]


def test_a_tuple_holding_what_cannot_be_guarded_is_named_at_capture(caplog):
    with caplog.at_level(logging.WARNING, logger="wide_compiler"):
        _compile(_TupleOfTensors)
    assert "NOT_PLAIN_TUPLE" in caplog.text and "is not seen by the compiled graphs" in caplog.text


class _ReadsGlobals(LinearModel):
    def forward(self, x):
        return self.fc(x) * globals()["S"]


def test_globals_read_through_globals_is_named_at_capture(caplog):
    with caplog.at_level(logging.WARNING, logger="wide_compiler"):
        _compile(_ReadsGlobals)
    assert "globals() in _ReadsGlobals.forward" in caplog.text and "is not seen by the compiled graphs" in caplog.text


def test_an_unpickled_guard_does_not_take_another_process_hooks_for_its_own():
    import pickle

    handle = nn.modules.module.register_module_forward_pre_hook(_double_linear_inputs)
    try:
        wide, _ = _compile(_Plain)
        x = _x()
        guards = wide._graph_for(True).guards
        pdt, pdev = torch.float64, x.device  # the parameters' dtype and device
        assert guards.holds((x,), pdt, pdev)
        again = pickle.loads(pickle.dumps(guards))  # as another process reads it: handle ids are its own
        assert not again.holds((x,), pdt, pdev)
        assert "global module hooks" in again.failed((x,), pdt, pdev)
    finally:
        handle.remove()
    assert not again.holds((x,), pdt, pdev)  # captured with a hook that no longer runs


def _make_counter():
    n = 0
    seen = {"calls": 0}

    def counted(h):
        nonlocal n
        n += 1
        seen["calls"] += 1
        cfgmod.SEEN.append(1)
        return h

    return counted


COUNTED = _make_counter()


class _Counts(LinearModel):
    def forward(self, x):
        return COUNTED(self.fc(x)) * cfgmod.X


def test_state_a_closure_or_another_module_keeps_is_not_a_guard(monkeypatch):
    """``nonlocal n; n += 1``, ``seen["calls"] += 1`` on a closure's dict, ``cfgmod.SEEN.append``:
    guarding them would capture again at every call (and refuse after 8); ``cfgmod.X``, which the
    code only reads, is still guarded."""
    monkeypatch.setattr(cfgmod, "SEEN", [], raising=False)
    wide, members = _compile(_Counts)
    x = _x()
    for _ in range(10):
        assert_each_member(wide, members, x)
    assert 1 + sum(len(v) for v in wide._variants.values()) == 1
    watched = {e[2] for e in wide._graph_for(True).guards.watched}
    assert "X" in watched and not watched & {"n", "seen", "SEEN"}


# --- the code digest of a function: the same in every process ------------------------------------------------


def test_a_functions_key_does_not_depend_on_reference_counts():
    """marshal flags an object referenced more than once, so its bytes (and a digest of them)
    changed with the references a process happens to hold: a compile-cache miss."""
    from wide_compiler.fx.state_reads import _function_key

    ns: dict = {}
    exec(compile("def f(x):\n    return x * 1.23456789 + 9.87654321\n", __file__, "exec"), ns)  # noqa: S102
    before = _function_key(ns["f"])
    held = list(ns["f"].__code__.co_consts)  # another reference to each constant
    assert _function_key(ns["f"]) == before, held


class _All(LinearModel):
    def forward(self, x):
        return CELL(self.fc(x)) * cfgmod.X * Cfg.K


def test_a_graph_from_the_compile_cache_follows_a_module_attribute_a_class_and_a_cell(cache_dir, monkeypatch):
    from support import cache_entries, from_cache

    _compile(_All)
    assert len(cache_entries(cache_dir)) == 1
    wide, members = from_cache(lambda: _compile(_All))  # the guards as unpickled
    x = _x()
    assert_each_member(wide, members, x)
    for change in (lambda: monkeypatch.setattr(cfgmod, "X", 2.0), lambda: monkeypatch.setattr(Cfg, "K", 3.0),
                   lambda: monkeypatch.setitem(BOX, "v", 5.0)):
        change()
        assert_each_member(wide, members, x)
