"""Non-tensor inputs of a router's towers and of check_equivalence's members compared by type and
value, as the guards of a compiled graph compare them (``fx.guards.same_input``): ``1`` is not
``1.0`` nor ``True`` and ``-0.0`` is not ``0.0``, so towers or members given those never share a
program captured with one of them."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import wide_compiler as wc
from torch import nn
from wide_compiler.router import Tower, WideRouter
from wide_compiler.router.inputs import _stack
from wide_compiler.testing import check_equivalence, stack_inputs

from support import router_with_refs

FAST = wc.WideConfig.fast()


class SignedTower(Tower):
    """A forward whose program depends on the sign of a zero and on a value's type."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x, k):
        y = self.fc(x) * math.copysign(1.0, k)  # 0.0 -> +y, -0.0 -> -y
        return y * 2 if isinstance(k, float) else y  # 1 -> y, 1.0 -> 2y


def _router(n: int = 2) -> tuple[WideRouter, dict[str, nn.Module]]:
    torch.manual_seed(0)
    return router_with_refs({f"t{i}": SignedTower() for i in range(n)})


@pytest.mark.parametrize("values", [(0.0, -0.0), (1, 1.0), (True, 1)], ids=["zero-sign", "int-float", "bool-int"])
def test_router_towers_given_equal_but_different_values_never_share_a_program(values):
    """Before: 0.0 == -0.0 and 1 == 1.0 == True, so both towers were one group captured with
    tower t0's value, and t1 got t0's program (its output negated or halved), silently."""
    router, refs = _router()
    x = torch.randn(5, 4)
    per = {"t0": (x, values[0]), "t1": (x, values[1])}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a tower that runs alone may say so
        outs = router.wide_forward(per)
    for n, (xi, k) in per.items():
        torch.testing.assert_close(outs[n], refs[n](xi, k), rtol=0, atol=0)
    assert not any(set(m) == {"t0", "t1"} for m in router.group_members().values())


@pytest.mark.parametrize("values", [(0.0, -0.0), (1, 1.0), (1, True)], ids=["zero-sign", "int-float", "int-bool"])
def test_router_stack_refuses_towers_of_one_group_given_different_values(values):
    x = torch.randn(5, 4)
    with pytest.raises(ValueError, match=r"different non-tensor inputs .*args\[1\]"):
        _stack([((x, values[0]), {}), ((x, values[1]), {})], ["t0", "t1"])
    assert _stack([((x, values[0]), {}), ((x, values[0]), {})], ["t0", "t1"])[0][1] is values[0]


def test_router_group_compiled_for_one_value_runs_another_member_by_member():
    """A group prepared with k=0.0 called with k=-0.0 for one tower: not the compiled inputs
    (before, the structures compared equal and the wide call used the program for 0.0)."""
    router, refs = _router()
    x = torch.randn(5, 4)
    router.prepare_for_compile({"t0": (x, 0.0), "t1": (x, 0.0)})
    assert list(router.group_members().values()) == [["t0", "t1"]]
    per = {"t0": (x, 0.0), "t1": (x, -0.0)}
    with pytest.warns(UserWarning, match="compiled for other inputs"):
        outs = router.wide_forward(per)
    for n, (xi, k) in per.items():
        torch.testing.assert_close(outs[n], refs[n](xi, k), rtol=0, atol=0)


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x, k):
        return self.fc(x) * k


@pytest.mark.parametrize("values", [(1, 1.0), (0.0, -0.0), (1, True)], ids=["int-float", "zero-sign", "int-bool"])
def test_check_equivalence_refuses_members_given_equal_but_different_values(values):
    torch.manual_seed(0)
    models = [Scaled(), Scaled()]
    wide = wc.compile(models, (torch.randn(5, 4), values[0]), config=FAST)
    x = [torch.randn(5, 4), torch.randn(5, 4)]
    with pytest.raises(ValueError, match=r"non-tensor input 1 is .* for member 1 but .* for member 0"):
        check_equivalence(wide, models, [(x[0], values[0]), (x[1], values[1])])
    with pytest.raises(ValueError, match=r"non-tensor input 1 is .* for member 1 but .* for member 0"):
        stack_inputs([(x[0], values[0]), (x[1], values[1])])
