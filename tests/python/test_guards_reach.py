"""Note [State a forward reads] (fx/guards.py): how far the static read of the members' code
reaches. A module global, class attribute, function or tensor read anywhere the members' code
goes (a base class's forward reached by ``super()``, a decorated forward, a child's method, a
helper handed the module, a registry of functions) and changed after compiling must not leave
the wide model on its old value: every call is compared, member by member in float64, with the
member run alone after the change.
"""

from __future__ import annotations

import functools
import logging
import pickle
import sys

import pytest
import torch
from torch import nn

from support import LinearModel, assert_each_member, check_change, compile_float64, cpu_only, float64_input, set_global

N = 3
S = 2.0  # module globals the forwards below read; the tests change them (monkeypatch)
MASK = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)


def act(h):
    return h.tanh()


_compile = functools.partial(compile_float64, n=N)
_x = functools.partial(float64_input, N)
_check_change = functools.partial(check_change, n=N)
_set_global = functools.partial(set_global, sys.modules[__name__])


# --- F6: a base class's forward reached by super() or Base.forward(self, x) -----------------------


class _Base(LinearModel):
    K = 1.5

    def forward(self, x):
        return self.fc(x) * S * self.K


class _Super(_Base):
    def forward(self, x):
        return super().forward(x) + 1


class _Named(_Base):
    def forward(self, x):
        return _Base.forward(self, x) + 1


@pytest.mark.parametrize("cls", [_Super, _Named])
@pytest.mark.parametrize("what", ["global", "class attribute"])
def test_a_base_class_forward_is_read(cls, what, monkeypatch):
    change = _set_global("S", 5.0) if what == "global" else (lambda mp: mp.setattr(_Base, "K", 3.0))
    _check_change(cls, change, monkeypatch)


# --- F12: a decorated forward ----------------------------------------------------------------------


def _logged(fn):
    @functools.wraps(fn)
    def wrapper(self, *a, **k):
        return fn(self, *a, **k)
    return wrapper


class _Decorated(LinearModel):
    @_logged
    def forward(self, x):
        return self.fc(x) * S


class _NoGrad(LinearModel):
    @torch.no_grad()
    def forward(self, x):
        return self.fc(x) * S


@pytest.mark.parametrize("cls", [_Decorated, _NoGrad])
def test_a_decorated_forward_is_read(cls, monkeypatch):
    _check_change(cls, _set_global("S", 3.0), monkeypatch)


# --- F11: a child module's own method ----------------------------------------------------------


class _Child(nn.Module):
    K = 1.0

    def forward(self, h):
        return h

    def scale_it(self, h):
        return h * S * self.K


class _Parent(LinearModel):
    def __init__(self):
        super().__init__()
        self.child = _Child()

    def forward(self, x):
        return self.child.scale_it(self.fc(x))


@pytest.mark.parametrize("what", ["global", "class attribute"])
def test_a_childs_method_is_read(what, monkeypatch):
    change = _set_global("S", 3.0) if what == "global" else (lambda mp: mp.setattr(_Child, "K", 5.0))
    _check_change(_Parent, change, monkeypatch)


# --- F3: a class attribute read in a helper handed the module -----------------------------------


def _scaled(mod, h):
    return h * mod.K


class _Helper(LinearModel):
    K = 1.5

    def forward(self, x):
        return _scaled(self, self.fc(x))


class _Held(LinearModel):
    K = 1.5

    def __init__(self):
        super().__init__()
        self.body = _scaled

    def forward(self, x):
        return self.body(self, self.fc(x))


@pytest.mark.parametrize("cls", [_Helper, _Held])
def test_a_class_attribute_read_in_a_helper_is_guarded(cls, monkeypatch):
    _check_change(cls, lambda mp: mp.setattr(cls, "K", 2.5), monkeypatch)


# --- F1: a module-level tensor -------------------------------------------------------------------


class _Masked(LinearModel):
    def forward(self, x):
        return self.fc(x) * MASK


def test_a_global_tensor_changed_in_place_is_followed(monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "MASK", MASK.clone())  # its own tensor, changed in place
    wide, members = _compile(_Masked)
    x = _x()
    assert_each_member(wide, members, x)
    MASK.mul_(2)
    assert_each_member(wide, members, x)
    MASK.div_(2)  # the captured values again: the first graph holds (no third capture)
    assert_each_member(wide, members, x)
    assert 1 + sum(len(v) for v in wide._variants.values()) == 2


def test_a_global_tensor_rebound_is_followed(monkeypatch):
    _check_change(_Masked, _set_global("MASK", torch.tensor([4.0, 3.0, 2.0, 1.0], dtype=torch.float64)),
                  monkeypatch)


# --- F2: a module-level function rebound ----------------------------------------------------------


class _Act(LinearModel):
    def forward(self, x):
        return act(self.fc(x))


@pytest.mark.parametrize("new", [torch.sin, lambda h: h * 2])
def test_a_global_function_rebound_is_followed(new, monkeypatch):
    _check_change(_Act, _set_global("act", new), monkeypatch)


@cpu_only
def test_guards_on_a_function_and_a_tensor_survive_pickling():
    wide, _ = _compile(_Act)
    x = _x()
    guards = wide._graph_for(True).guards
    again = pickle.loads(pickle.dumps(guards))
    pdt, pdev = torch.float64, torch.device("cpu")
    assert again.failed((x,), pdt, pdev) is None and again.holds((x,), pdt, pdev)


# --- the registry dict of user functions ------------------------------------------------------------


def _scaled_tanh(h):
    return torch.tanh(h) * S


ACTS = {"st": _scaled_tanh}


class _Registry(LinearModel):
    def forward(self, x):
        return ACTS["st"](self.fc(x))


@pytest.mark.parametrize("what", ["global its function reads", "entry"])
def test_a_registry_of_functions_is_followed(what, monkeypatch, caplog):
    if what == "entry":
        change = lambda mp: mp.setitem(ACTS, "st", torch.sin)  # noqa: E731
    else:
        change = _set_global("S", 3.0)
    with caplog.at_level(logging.WARNING, logger="wide_compiler"):
        _check_change(_Registry, change, monkeypatch)
    assert "not seen" not in caplog.text  # followed, not named as unseen


# --- F9: a branch on an input's requires_grad -----------------------------------------------------


class _Grad(LinearModel):
    def forward(self, x):
        return self.fc(x) * (2 if x.requires_grad else 3)


def test_a_branch_on_an_inputs_requires_grad_is_guarded():
    wide, members = _compile(_Grad)
    x = _x()
    assert_each_member(wide, members, x)
    assert_each_member(wide, members, x.clone().requires_grad_())
    assert_each_member(wide, members, x)
    assert 1 + sum(len(v) for v in wide._variants.values()) == 2


def test_a_forward_that_reads_no_requires_grad_takes_both_on_one_graph():
    wide, members = _compile(_Act)
    x = _x()
    assert_each_member(wide, members, x)
    assert_each_member(wide, members, x.clone().requires_grad_())
    assert not wide._variants.get(True)


class _Both(LinearModel):
    def forward(self, x):
        return act(self.fc(x)) * MASK


def test_a_graph_from_the_compile_cache_follows_a_global_tensor_and_function(cache_dir, monkeypatch):
    from support import cache_entries, from_cache

    monkeypatch.setattr(sys.modules[__name__], "MASK", MASK.clone())
    _compile(_Both)
    assert len(cache_entries(cache_dir)) == 1
    wide, members = from_cache(lambda: _compile(_Both))  # the guards as unpickled
    x = _x()
    assert_each_member(wide, members, x)
    MASK.mul_(3)
    assert_each_member(wide, members, x)
    monkeypatch.setattr(sys.modules[__name__], "act", torch.sin)
    assert_each_member(wide, members, x)


class _ClassRegistry(LinearModel):
    ACTS = {"st": _scaled_tanh}  # a registry held by the class

    def forward(self, x):
        return self.ACTS["st"](self.fc(x))


def test_a_class_attribute_registry_of_functions_is_followed(monkeypatch):
    _check_change(_ClassRegistry, _set_global("S", 3.0), monkeypatch)
