"""Per-member constants after the members' constants are edited (copy_member_weights, a state dict
load, an in-place edit of a ``_per_member`` buffer) and compared (signed zeros, ints and floats,
NaN): write_back writes them, a recapture traces what the members hold now, and two constants are
one only when a program cannot tell them apart (Note [Per-member constants] in fx/constants.py).
Each member is compared with itself run alone, float64."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import wide_compiler as wc
from torch import nn

from wide_compiler.errors import ArchitectureMismatchError
from wide_compiler.router import Tower, WideRouter

FAST = wc.WideConfig.fast()
N = 3


class Scaled(nn.Module):
    """A float constant read twice: as an op's argument and through a LeakyReLU's slope."""

    def __init__(self, s: float) -> None:
        super().__init__()
        self.l = nn.Linear(3, 3)
        self.s = s
        self.a = nn.LeakyReLU(s / 10)

    def forward(self, x):
        return self.a(self.l(x)) * self.s


class Branchy(nn.Module):
    """A branch on a size and the constant together: which branch depends on T and on s."""

    def __init__(self, s: float) -> None:
        super().__init__()
        self.l = nn.Linear(3, 3)
        self.s = s

    def forward(self, x):
        h = self.l(x)
        return h * self.s if x.shape[1] * self.s > 1.5 else h - self.s


def members(cls, values):
    torch.manual_seed(0)
    return [cls(v).double() for v in values]


def run_alone(models, x, grad=False):
    """Each member alone on its row of ``x``: outputs (and input gradients with ``grad``)."""
    outs, grads = [], []
    for i, m in enumerate(models):
        xi = x[i].detach().clone().requires_grad_(grad)
        o = m(xi)
        if grad:
            o.sin().sum().backward()
            grads.append(xi.grad)
        outs.append(o.detach())
    return torch.stack(outs), (torch.stack(grads) if grad else None)


def run_wide(wide, x, grad=False):
    xw = x.detach().clone().requires_grad_(grad)
    o = wide(xw)
    if grad:
        o.sin().sum().backward()
    return o.detach(), (xw.grad if grad else None)


def assert_members_match(wide, expected, x, grad=True):
    ref, gref = run_alone([copy.deepcopy(m) for m in expected], x, grad)
    got, ggot = run_wide(wide, x, grad)
    for i in range(len(expected)):
        torch.testing.assert_close(got[i], ref[i], rtol=1e-12, atol=1e-12, msg=f"member {i} output")
        if grad:
            torch.testing.assert_close(ggot[i], gref[i], rtol=1e-12, atol=1e-12, msg=f"member {i} input grad")


# --- F7: write_back writes the per-member constants -------------------------------------------------
def test_write_back_after_copy_member_weights_writes_the_constants():
    models = members(Scaled, [0.5, 1.5, 2.0])
    wide = wc.compile(copy.deepcopy(models), torch.randn(2, 3, dtype=torch.float64), config=FAST)
    wide.copy_member_weights(src=2, dst=0)
    targets = copy.deepcopy(models)
    s_obj = targets[0].l.weight
    wide.write_back(targets)
    assert targets[0].l.weight is s_obj
    assert [t.s for t in targets] == [2.0, 1.5, 2.0]
    assert [t.a.negative_slope for t in targets] == [0.2, 0.15, 0.2]
    x = torch.randn(N, 2, 3, dtype=torch.float64)
    expected = [models[2], models[1], models[2]]
    ref, _ = run_alone(expected, x)
    got, _ = run_alone(targets, x)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    assert_members_match(wide.eval(), expected, x, grad=False)


def test_write_back_refuses_a_module_without_the_constant_before_writing_anything():
    models = members(Scaled, [0.5, 1.5, 2.0])
    wide = wc.compile(copy.deepcopy(models), torch.randn(2, 3, dtype=torch.float64), config=FAST)
    with torch.no_grad():
        wide.get_parameter("l.weight").add_(1.0)
    targets = copy.deepcopy(models)
    targets[2].s = "two"  # not a number: cannot hold the member's constant
    before = [t.l.weight.detach().clone() for t in targets]
    with pytest.raises(ValueError, match=r"write_back: member 2 \(Scaled\) has no number attribute 's' \(a str\)"):
        wide.write_back(targets)
    for t, b in zip(targets, before):
        assert torch.equal(t.l.weight, b)
    assert [t.s for t in targets[:2]] == [0.5, 1.5]


def test_padded_members_with_differing_constants_are_refused_at_compile():
    """So a padded model's write_back has no per-member constant to lose: sizes only differ."""
    torch.manual_seed(0)

    class P(nn.Module):
        def __init__(self, h, s):
            super().__init__()
            self.l, self.s = nn.Linear(3, h), s

        def forward(self, x):
            return self.l(x) * self.s

    ms = [P(h, s).double() for h, s in [(3, 0.5), (4, 1.5)]]
    with pytest.raises(ArchitectureMismatchError, match="only sizes may differ between padded members"):
        wc.compile(ms, torch.randn(2, 3, dtype=torch.float64), pad=True, config=FAST)


class ScaledTower(Tower):
    def __init__(self, s: float, width: int = 3) -> None:
        super().__init__()
        self.l = nn.Linear(3, width)
        self.s = s

    def forward(self, x):
        return self.l(x) * self.s


def _router(values, towers=None):
    torch.manual_seed(0)
    towers = towers or {f"t{i}": ScaledTower(v).double() for i, v in enumerate(values)}
    # run_members off: towers differing in a constant are grouped (with it on, each runs alone)
    router = WideRouter(config=FAST.replace(run_members=False))
    for n, t in towers.items():
        router.attach(n, t)
    router.discover_towers()
    router.prepare_for_compile(torch.randn(2, 3, dtype=torch.float64))
    return router, towers


def test_router_write_back_writes_each_towers_constants():
    router, towers = _router([0.5, 1.5, 2.0])
    assert router.group_members() == {"t0": ["t0", "t1", "t2"]}
    ref = {n: copy.deepcopy(t) for n, t in towers.items()}
    router.groups["t0"].copy_member_weights(2, 0)
    router.write_back()
    assert [t.s for t in towers.values()] == [2.0, 1.5, 2.0]
    x = torch.randn(2, 3, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(towers["t0"](x), ref["t2"](x), rtol=1e-12, atol=1e-12)
        outs = router.wide_forward(x)
        for n, r in zip(towers, [ref["t2"], ref["t1"], ref["t2"]]):
            torch.testing.assert_close(outs[n], r(x), rtol=1e-12, atol=1e-12, msg=n)


def test_router_write_back_checks_every_group_before_writing_any():
    torch.manual_seed(0)
    towers = {"a0": ScaledTower(0.5), "a1": ScaledTower(1.5), "b0": ScaledTower(0.5, 4), "b1": ScaledTower(1.5, 4)}
    router, towers = _router(None, {n: t.double() for n, t in towers.items()})
    assert router.group_members() == {"a0": ["a0", "a1"], "b0": ["b0", "b1"]}
    before = towers["a0"].l.weight.detach().clone()
    with torch.no_grad():
        router.groups["a0"].get_parameter("l.weight").add_(1.0)
    towers["b1"].s = None  # a tower of the second group cannot take its constant: nothing may be written
    with pytest.raises(ValueError, match=r"member 1 \(ScaledTower\) has no number attribute 's'"):
        router.write_back()
    assert torch.equal(towers["a0"].l.weight, before)


# --- F8: constants compared by type and value, not == ----------------------------------------------
class _Constant(nn.Module):
    """A Linear ``l`` and the constant ``s`` (per member) the subclass's forward uses."""

    def __init__(self, s) -> None:
        super().__init__()
        self.l = nn.Linear(3, 3)
        self.s = s


class Divided(_Constant):
    def forward(self, x):
        return self.l(x) / self.s


def _same_with_nans(a, b):
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def test_signed_zero_constants_are_per_member():
    """1 / -0.0 is -inf: a -0.0 member run with 0.0 flips the sign of every infinity."""
    models = members(Divided, [0.0, -0.0, 0.0])
    wide = wc.compile(copy.deepcopy(models), torch.randn(2, 3, dtype=torch.float64), config=FAST)
    assert "s" in wide.per_member_constants
    assert [math.copysign(1.0, wide.member(i).s) for i in range(N)] == [1.0, -1.0, 1.0]
    x = torch.randn(N, 2, 3, dtype=torch.float64)
    with torch.no_grad():
        ref, _ = run_alone(models, x)
        got, _ = run_wide(wide, x)
    assert ref[1].isinf().all()
    assert _same_with_nans(got, ref)


def test_nan_constant_in_every_member_is_shared_and_in_one_member_per_member():
    models = members(Divided, [math.nan] * N)
    wide = wc.compile(copy.deepcopy(models), torch.randn(2, 3, dtype=torch.float64), config=FAST)
    assert wide.per_member_constants == {}  # nan is nan: nothing differs
    x = torch.randn(N, 2, 3, dtype=torch.float64)
    with torch.no_grad():
        assert wide(x).isnan().all()
    models = members(Divided, [2.0, math.nan, 2.0])
    wide = wc.compile(copy.deepcopy(models), torch.randn(2, 3, dtype=torch.float64), config=FAST)
    assert math.isnan(wide.member(1).s) and wide.member(0).s == 2.0
    with torch.no_grad():
        ref, _ = run_alone(models, x)
        got, _ = run_wide(wide, x)
    assert _same_with_nans(got, ref)
    assert not got[0].isnan().any() and got[1].isnan().all()


class TypeBranch(_Constant):
    def forward(self, x):
        h = self.l(x)
        if isinstance(self.s, bool):
            return h + 100 * self.s
        if isinstance(self.s, int):
            return h + 10 * self.s
        return h * self.s


def test_a_bool_and_a_float_constant_are_refused_naming_both():
    with pytest.raises(ArchitectureMismatchError, match=r"member 1: s is 1\.0, member 0 has True"):
        wc.compile(members(TypeBranch, [True, 1.0, 1.0]), torch.randn(2, 3, dtype=torch.float64), config=FAST)


def test_an_int_and_a_float_constant_differ():
    """1 and 1.0: per member where the program is the same, refused where the type picks a branch."""
    models = members(Divided, [1.0, 1, 2.0])
    wide = wc.compile(copy.deepcopy(models), torch.randn(2, 3, dtype=torch.float64), config=FAST)
    assert [type(wide.member(i).s) for i in range(N)] == [float, int, float]
    assert_members_match(wide, models, torch.randn(N, 2, 3, dtype=torch.float64))
    with pytest.raises(ArchitectureMismatchError, match=r"member 1: s is 1, member 0 has 1\.0"):
        wc.compile(members(TypeBranch, [1.0, 1, 1.0]), torch.randn(2, 3, dtype=torch.float64), config=FAST)


# --- F2: a capture after the members' constants changed traces what they hold now -------------------
def _branchy():
    """s = [0.5, 1.5, 2.0], captured at T = 4 (every member multiplies there; at T = 2 member 0 subtracts)."""
    models = members(Branchy, [0.5, 1.5, 2.0])
    wide = wc.compile(copy.deepcopy(models), torch.randn(2, 4, 3, dtype=torch.float64), config=FAST)
    return models, wide


def _with_s(model, s):
    out = copy.deepcopy(model)
    out.s = s
    return out


def test_capture_at_a_new_size_after_copy_member_weights_traces_the_copied_constants():
    models, wide = _branchy()
    wide.copy_member_weights(src=1, dst=0)  # s = [1.5, 1.5, 2.0]: every member multiplies at T = 2
    x = torch.randn(N, 2, 2, 3, dtype=torch.float64)
    assert_members_match(wide, [models[1], models[1], models[2]], x)
    assert_members_match(wide, [models[1], models[1], models[2]], torch.randn(N, 2, 4, 3, dtype=torch.float64))


def test_a_capture_after_copy_member_weights_leaves_the_users_modules_alone():
    """The capture template that takes member 0's new constants is the compiler's own copy."""
    models = members(Branchy, [0.5, 1.5, 2.0])
    wide = wc.compile(models, torch.randn(2, 4, 3, dtype=torch.float64), config=FAST)  # the user's objects
    wide.copy_member_weights(src=1, dst=0)
    wide(torch.randn(N, 2, 2, 3, dtype=torch.float64))
    wide.eval()(torch.randn(N, 2, 2, 3, dtype=torch.float64))
    assert [m.s for m in models] == [0.5, 1.5, 2.0] and all(m.training for m in models)


def test_capture_at_a_new_size_after_a_state_dict_load_traces_the_loaded_constants():
    models, wide = _branchy()
    sd = wide.state_dict()
    sd["_per_member.s"] = torch.tensor([1.5, 1.5, 2.0], dtype=sd["_per_member.s"].dtype)
    wide.load_state_dict(sd)
    assert_members_match(wide, [_with_s(models[0], 1.5), models[1], models[2]],
                         torch.randn(N, 2, 2, 3, dtype=torch.float64))


def test_capture_at_a_new_size_after_an_in_place_edit_traces_the_edited_constants():
    models, wide = _branchy()
    with torch.no_grad():
        dict(wide.named_buffers())["_per_member.s"][0] = 2.0
    assert_members_match(wide, [_with_s(models[0], 2.0), models[1], models[2]],
                         torch.randn(N, 2, 2, 3, dtype=torch.float64))
    assert wide.member(0).s == 2.0


def test_capture_after_a_state_dict_load_that_rebinds_the_buffers_traces_the_loaded_constants():
    """load_state_dict(assign=True) after a call puts new buffer objects in place of the ones seen."""
    models, wide = _branchy()
    wide(torch.randn(N, 2, 4, 3, dtype=torch.float64))
    sd = {k: v.clone() for k, v in wide.state_dict().items()}
    sd["_per_member.s"] = torch.tensor([2.0, 1.5, 2.0], dtype=sd["_per_member.s"].dtype)
    wide.load_state_dict(sd, assign=True)
    assert_members_match(wide, [_with_s(models[0], 2.0), models[1], models[2]],
                         torch.randn(N, 2, 2, 3, dtype=torch.float64))


def test_a_refused_capture_names_the_members_values_and_the_users_line():
    """Member 0 (s = 0.5) subtracts at T = 2 where member 1 (s = 1.5) multiplies: refused, and the
    message says so with the line of this file, never one of the library's."""
    models, wide = _branchy()
    wide.copy_member_weights(src=0, dst=2)
    with pytest.raises(ValueError, match=r"member 1: s is 1\.5, member 0 has 0\.5") as e:
        wide(torch.randn(N, 2, 2, 3, dtype=torch.float64))
    assert "test_constants_edits.py" in str(e.value) and "wide_compiler/" not in str(e.value)


def test_a_refused_capture_of_code_without_a_file_names_no_library_line():
    """A forward made by exec has no user frame in the capture's stack: the message says there is
    none instead of naming the library's line that called it."""
    scope = {"nn": nn}
    exec("class Made(nn.Module):\n"  # noqa: S102 -- code with no file of its own, as a notebook's or exec'd config's
         "    def __init__(self, s):\n"
         "        super().__init__(); self.l = nn.Linear(3, 3); self.s = s\n"
         "    def forward(self, x):\n"
         "        h = self.l(x)\n"
         "        return h * self.s if x.shape[1] * self.s > 1.5 else h - self.s\n", scope)
    models = members(scope["Made"], [0.5, 1.5, 0.5])
    wide = wc.compile(copy.deepcopy(models), torch.randn(2, 4, 3, dtype=torch.float64), config=FAST)
    with pytest.raises(ValueError, match=r"member 1: s is 1\.5, member 0 has 0\.5") as e:
        wide(torch.randn(N, 2, 2, 3, dtype=torch.float64))
    assert "wide_compiler/" not in str(e.value) and "no source line of the user's code" in str(e.value)


# across ranks: test_constants_proved.py::test_copy_member_weights_across_ranks_carries_the_constants (one gloo world)
