"""Probe 18 of issue 44 (an independent re-run of the adversarial probe): each finding is a test
that failed before its fix. The padding's own constants (Note [The padding's own constants] in
padded.py), a padded reduction in lower precision or under autocast (Note [A padded reduction runs
in float32 or float64]), and a recurrent layer's initial state given to a padded model."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import wide_compiler as wc
from wide_compiler.errors import UnsupportedOperationError
from support import DEVICE

FAST = wc.WideConfig.fast()


class NormHead(nn.Module):
    """Linear(4, h) -> LayerNorm(h) -> mean over h: a norm and a mean over the swept width."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.a, self.ln = nn.Linear(4, h), nn.LayerNorm(h)

    def forward(self, x):
        y = self.ln(self.a(x))
        return y, y.mean(-1)


class ConvNorm(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv, self.bn, self.ln, self.o = nn.Conv2d(2, c, 3, padding=1), nn.BatchNorm2d(c), nn.LayerNorm(c), nn.Linear(c, 2)

    def forward(self, x):
        h = self.bn(self.conv(x)).mean((2, 3))
        return self.o(self.ln(h))


def _members_match(wide, models, xs, tol):
    outs = wide.member_outputs(wide(torch.stack(xs)))
    for i, m in enumerate(models):
        want = m(xs[i])
        got = outs[i]
        for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            assert g.dtype == w.dtype, (i, g.dtype, w.dtype)
            torch.testing.assert_close(g, w, atol=tol, rtol=tol, msg=f"member {i}")


@pytest.mark.parametrize("fill", [0.0, 1.0])
def test_a_reset_of_every_buffer_leaves_the_paddings_constants_alone(fill):
    """P18-1: ``b.fill_(v)`` over ``wide.buffers()`` (a BatchNorm reset, done on each member too)
    reached the padding's masks and counts: every output NaN (counts 0), or the padding inside the
    LayerNorm (0.93 off in eval)."""
    torch.manual_seed(0)
    models = [ConvNorm(c).double() for c in (3, 5, 8)]
    wide = wc.compile(copy.deepcopy(models), torch.randn(4, 2, 6, 6, dtype=torch.float64), pad=True, config=FAST)
    with torch.no_grad():
        for module in [wide, *models]:
            for b in module.buffers():
                if b.is_floating_point():
                    b.fill_(fill)
    xs = [torch.randn(4, 2, 6, 6, dtype=torch.float64) for _ in models]
    for mode in ("train", "eval"):
        for m in [wide, *models]:
            getattr(m, mode)()
        _members_match(wide, models, xs, 1e-10)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_dtype_round_trip_keeps_the_counts_exact(dtype):
    """P18-4: ``wide.to(bfloat16).float()`` left each member's count rounded for good (257 read as
    256: a float32 LayerNorm 5.5e-3 off); no checkpoint restores them (they are no state)."""
    torch.manual_seed(0)
    models = [NormHead(h) for h in (257, 301, 345)]
    wide = wc.compile(copy.deepcopy(models), torch.randn(3, 4), pad=True, config=FAST)
    for m in [wide, *models]:  # the same round trip on each member: the same rounded weights
        m.to(dtype).float()
    xs = [torch.randn(3, 4) for _ in models]
    _members_match(wide, models, xs, 1e-5)
    sd = wide.state_dict()  # the state as the next call reads it: loads back
    wide.load_state_dict(sd)


def test_a_padded_reduction_in_bfloat16_is_refused_before_it_runs():
    """P18-2: in bfloat16 the counts are rounded and the padded statistics computed in bfloat16,
    where each member's LayerNorm accumulates in float32 (50x the member's own rounding): refused
    at the call, and the model still runs in float32 afterwards."""
    torch.manual_seed(0)
    models = [NormHead(h) for h in (8, 12, 16)]
    wide = wc.compile(copy.deepcopy(models), torch.randn(3, 4), pad=True, config=FAST)
    wide.bfloat16()
    xs = [torch.randn(3, 4) for _ in models]
    with pytest.raises(UnsupportedOperationError, match=r"reduces over a padded dim .* in torch.bfloat16"):
        wide(torch.stack(xs).bfloat16())
    for m in [wide, *models]:
        m.bfloat16().float()
    _members_match(wide, models, xs, 1e-5)


def test_a_padded_reduction_under_autocast_is_refused_and_padding_without_one_runs():
    """P18-3: under CPU autocast the float32 masks and counts promoted the member's bfloat16 values
    (a float32 LayerNorm where the member returns bfloat16): refused. A padded model with no
    reduction over a padded dim runs under autocast as the members do, dtype included."""
    torch.manual_seed(0)
    models = [NormHead(h) for h in (8, 12, 16)]
    wide = wc.compile(copy.deepcopy(models), torch.randn(3, 4), pad=True, config=FAST)
    xs = [torch.randn(3, 4) for _ in models]
    with (torch.autocast(DEVICE.type, dtype=torch.bfloat16),
          pytest.raises(UnsupportedOperationError, match=f"under {DEVICE.type} autocast")):
        wide(torch.stack(xs))
    plain = [nn.Sequential(nn.Linear(4, h), nn.ReLU(), nn.Linear(h, 3)) for h in (8, 12, 16)]
    wide = wc.compile(copy.deepcopy(plain), torch.randn(3, 4), pad=True, config=FAST)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        _members_match(wide, plain, xs, 2e-2)


class GruH0(nn.Module):
    def __init__(self, w: int) -> None:
        super().__init__()
        self.g, self.a, self.o = nn.GRU(5, 4, batch_first=True), nn.Linear(4, w), nn.Linear(w, 2)

    def forward(self, x, h0):
        y, _ = self.g(x, h0)
        return self.o(F.relu(self.a(y)))


def test_a_recurrent_initial_state_input_compiles_padded():
    """P18-5: a GRU's initial state h0 [1, B, H] given as an input was captured with its layer dim
    as a batch (repeated to 2): export's "Expected hidden size" leaked out; the same model compiled
    without pad."""
    torch.manual_seed(0)
    models = [GruH0(w).double() for w in (3, 6, 9)]
    wide = wc.compile(copy.deepcopy(models), (torch.randn(3, 4, 5, dtype=torch.float64),
                                              torch.zeros(1, 3, 4, dtype=torch.float64)), pad=True, config=FAST)
    xs = [torch.randn(3, 4, 5, dtype=torch.float64) for _ in models]
    hs = [torch.randn(1, 3, 4, dtype=torch.float64) for _ in models]
    outs = wide.member_outputs(wide(torch.stack(xs), torch.stack(hs)))
    for i, m in enumerate(models):
        torch.testing.assert_close(outs[i], m(xs[i], hs[i]), atol=1e-12, rtol=1e-12)
