"""Findings of the eighth independent probe of issue 44 fixed in the member check (the others:
test_probe8_writes.py, test_probe8_guards.py). Each test failed before its fix."""

import functools

import pytest
import torch
from torch import nn

import wide_compiler as wc
from wide_compiler.errors import UnsupportedOperationError

N = 3
FAST = wc.WideConfig.fast()


class _Holder:
    def __init__(self, m):
        self.m = m


class _Student(nn.Module):
    """A member reading a teacher that is not registered in it (P8-6), held as ``kind`` says."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.l = nn.Linear(4, 4)
        t = nn.Linear(4, 4)
        if kind == "list":
            self.held = [t]
        elif kind == "tuple":
            self.held = (t,)
        elif kind == "dict":
            self.held = {"t": t}
        elif kind == "closure":
            self.f = lambda x: t(x)
        elif kind == "holder":
            self.held = _Holder(t)
        elif kind == "setattr":
            object.__setattr__(self, "teacher", t)
        elif kind == "partial":
            self.f = functools.partial(t.forward)
        elif kind == "params":  # the missing nn.ParameterList
            self.ws = [nn.Parameter(torch.randn(4, 4))]

    def forward(self, x):
        k = self.kind
        if k == "params":
            return self.l(x) + x @ self.ws[0]
        with torch.no_grad():
            if k in ("closure", "partial"):
                tgt = self.f(x)
            elif k == "setattr":
                tgt = self.teacher(x)
            elif k == "holder":
                tgt = self.held.m(x)
            else:
                tgt = self.held[0 if k != "dict" else "t"](x)
        return self.l(x) + tgt


@pytest.mark.parametrize("kind", ["list", "tuple", "dict", "closure", "holder", "setattr", "partial", "params"])
def test_p8_6_a_parameter_held_outside_the_member_is_refused(kind):
    """Before: every member ran member 0's teacher (0.7-4.2 off), no warning."""
    torch.manual_seed(0)
    models = [_Student(kind) for _ in range(N)]
    with pytest.raises(UnsupportedOperationError, match="reads an nn.Parameter that is not registered in it") as e:
        wc.compile(models, torch.randn(3, 4), config=FAST)
    assert "test_probe8.py" in str(e.value) and "nn.ModuleList" in str(e.value)


class _Masked(nn.Module):
    def __init__(self, table):
        super().__init__()
        self.l = nn.Linear(4, 4)
        self.box = [table]

    def forward(self, x):
        return self.l(x) * self.box[0]


def test_p8_6_a_plain_tensor_held_outside_with_the_same_values_still_compiles():
    """No false refusal: a plain tensor (not a parameter) the members hold with the same values."""
    torch.manual_seed(0)
    shared = torch.rand(4)
    models = [_Masked(shared.clone()) for _ in range(N)]
    wide = wc.compile(models, torch.randn(3, 4), config=FAST)
    x = torch.randn(N, 3, 4)
    assert all(torch.allclose(wide(x)[i], m(x[i]), atol=1e-6) for i, m in enumerate(models))
