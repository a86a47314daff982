"""Probe 17 of issue 44 (an independent re-run of the adversarial probe): each finding as a test
that failed before its fix."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import wide_compiler as wc

FAST = wc.WideConfig.fast()


def _matches_its_members(members, x, *, pad, grad_tol=1e-10):
    """Compile ``members`` (float64) on ``x[0]``, then each member's output and input gradient
    (of the sum of squares) against the member alone on ``x[i]``; returns the wide model."""
    x = x.detach().requires_grad_()
    wide = wc.compile(copy.deepcopy(members), x[0].detach(), pad=pad, config=FAST)
    out = wide(x)
    out = wide.member_outputs(out) if pad else list(out)
    sum(o.square().sum() for o in out).backward()
    for i, m in enumerate(members):
        xi = x[i].detach().requires_grad_()
        own = m(xi)
        own.square().sum().backward()
        torch.testing.assert_close(out[i], own, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(x.grad[i], xi.grad, rtol=grad_tol, atol=grad_tol)
    return wide


class NonPersistent(nn.Module):
    def __init__(self, h, used):
        super().__init__()
        self.a, self.o, self.used = nn.Linear(5, h), nn.Linear(h, 3), used
        self.register_buffer("nb", torch.rand(h) + 1.0, persistent=False)  # RoPE's inv_freq is such a buffer

    def forward(self, x):
        h = self.a(x)
        if self.used:
            h = torch.layer_norm(h * self.nb, (h.shape[-1],)) + self.nb.sum()
        return self.o(h)


@pytest.mark.parametrize("used", [False, True], ids=["unused", "used"])
def test_a_non_persistent_buffer_of_a_swept_size_is_padded_as_state(used):
    """P17-1: a non-persistent buffer whose size follows the width (used or not) was refused as "a
    tensor made in the forward from a number" (export lists it among its constants)."""
    torch.manual_seed(0)
    members = [NonPersistent(h, used).double() for h in (4, 8)]
    wide = _matches_its_members(members, torch.randn(2, 3, 5, dtype=torch.float64), pad=True)
    for i, m in enumerate(members):
        torch.testing.assert_close(wide.member(i).nb, m.nb)
    assert "nb" not in wide.state_dict() and "nb" not in wide.member_state_dict(0)


class SharedShapedAs(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.l, self.kind = nn.Linear(6, 6), kind

    def forward(self, x):
        h = self.l(x)
        if self.kind == "gather":
            return h.gather(1, torch.arange(x.shape[1] - 1, -1, -1).view(1, -1, 1).expand_as(h))
        if self.kind == "add":
            return h + torch.linspace(0, 1, 6).view(1, 1, 6).expand_as(h)
        return h * torch.arange(6.0).reshape_as(h[0, 0])


@pytest.mark.parametrize("kind", ["gather", "add", "reshape_as"])
def test_a_shared_tensor_shaped_as_a_per_member_one_is_widened(kind):
    """P17-2: ``torch.arange(T).view(1, -1, 1).expand_as(h)`` (a shared index or constant made in
    the forward, shaped as a per-member activation) was refused: "expected a per-member tensor"."""
    torch.manual_seed(0)
    members = [SharedShapedAs(kind).double() for _ in range(3)]
    _matches_its_members(members, torch.randn(3, 3, 5, 6, dtype=torch.float64), pad=False, grad_tol=1e-12)


def test_a_stacked_submodules_mode_set_apart_from_the_model_warns_and_changes_nothing():
    """P17-3: ``wide.bn.eval()`` under ``wide.train()`` (a frozen BatchNorm) changed the stacked
    container's flag only: it read False while the train graph ran BatchNorm in train mode and
    updated its statistics (1.15 off the frozen members), silently."""
    members = [nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)) for _ in range(3)]
    wide = wc.compile(members, torch.randn(5, 4), config=FAST)
    with pytest.warns(UserWarning, match=r"eval\(\) on a stacked BatchNorm1d of a wide model changes nothing"):
        wide.get_submodule("1").eval()
    assert wide.get_submodule("1").training  # the flag says what the graph does
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the model's own switches set every submodule, silently
        wide.eval()
        assert not wide.get_submodule("1").training
        wide.train()
        assert wide.get_submodule("1").training


class AlongTime(nn.Module):
    def __init__(self, h, op):
        super().__init__()
        self.a, self.o, self.op = nn.Linear(3, h), nn.Linear(h, 2), op

    def forward(self, x):
        h = torch.tanh(self.a(x))  # [B, T, h]: only h differs between members
        op = self.op
        if op == "flip":
            h = h.flip(1)
        elif op == "roll":
            h = h.roll(2, 1)
        elif op == "index_select":
            h = h.index_select(1, torch.tensor([4, 0, 2]))
        elif op == "cumsum":
            h = h.cumsum(1) + h.cumprod(1)
        elif op == "chunk":
            h = torch.cat(h.chunk(5, 1)[::-1], 1)
        elif op == "split":
            a, b = h.split([2, 3], 1)
            h = torch.cat([b, a * 2], 1)
        elif op == "unbind_stack":
            h = torch.stack(h.unbind(1)[::-1], 1)
        elif op == "clamp_":
            h = self.a(x).clamp_(min=0) + self.a(x).clamp_(-0.5, 0.5)
        return self.o(h)


@pytest.mark.parametrize("op", ["flip", "roll", "index_select", "cumsum", "chunk", "split", "unbind_stack", "clamp_"])
def test_positional_ops_along_a_dim_no_member_pads_and_in_place_clamps_holding_zero(op):
    """P17-4: with pad=True over a hidden-size sweep, flip/roll/index_select/cumsum/chunk/split/unbind/
    stack along the time dim (not padded) were refused, blaming padding in that dim (Note [Positions
    along a dim that is not padded]); P17-5: ``clamp_(min=0)`` and ``clamp_(-0.5, 0.5)`` were
    refused though 0 stays 0."""
    torch.manual_seed(0)
    members = [AlongTime(h, op).double() for h in (4, 8, 6)]
    _matches_its_members(members, torch.randn(3, 2, 5, 3, dtype=torch.float64), pad=True)


class AlongWidth(AlongTime):
    def forward(self, x):
        return self.o(torch.tanh(self.a(x)).flip(-1))


def test_a_positional_op_along_a_padded_dim_is_still_refused_naming_the_dim():
    with pytest.raises(wc.UnsupportedOperationError, match=r"flip.*along dim 2, which is padded: it reads or writes"):
        wc.compile([AlongWidth(h, "") for h in (4, 8)], torch.randn(2, 5, 3), pad=True, config=FAST)
