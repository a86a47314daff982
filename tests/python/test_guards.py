"""Note [Guards] (fx/guards.py): a graph runs only for inputs within the assumptions of its capture.

Each model below branches in Python on a size or a dtype; export captures the sample's branch
only. Every call is compared, member by member in float64, with the member run alone: the wide
model must give each member's own result (capturing another graph where the first does not hold)
or refuse clearly, never run the sample's branch for other inputs.
"""

from __future__ import annotations

import copy
import logging
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import wide_compiler as wc
from wide_compiler.fx.guards import MAX_GRAPHS

from support import LinearModel

N = 3
FAST = wc.WideConfig.fast()


def _members(cls, *args, **kwargs):
    torch.manual_seed(0)
    return [cls(*args, **kwargs).double() for _ in range(N)]


def _assert_members(wide, members, *xs):
    out = wide(*xs)
    for i, m in enumerate(members):
        ref = m(*(x[i] for x in xs))
        assert out[i].shape == ref.shape, f"member {i}: shape {tuple(out[i].shape)} != {tuple(ref.shape)}"
        torch.testing.assert_close(out[i], ref, rtol=1e-12, atol=1e-12, msg=lambda m, i=i: f"member {i}: {m}")
    return out


def _x(*shape, dtype=torch.float64):
    return torch.randn(N, *shape, dtype=dtype)


class Parity(LinearModel):
    """Branches on the parity of the length, on ``T == 1`` (a decode step) and on the batch's parity."""

    linears = {"lin": (4, 4)}

    def forward(self, x):
        h = self.lin(x)
        if x.shape[1] % 2 == 0:
            h = h * 2
        if x.shape[1] == 1:
            return h - 1
        if x.shape[0] % 2 == 1:
            h = h.flip(0)
        return h + 1


@pytest.mark.parametrize("shape", [(2, 6, 4), (2, 1, 4), (3, 5, 4), (1, 5, 4), (1, 1, 4), (2, 7, 4)])
def test_size_branches_follow_every_call(shape):
    members = _members(Parity)
    wide = wc.compile(members, torch.randn(2, 5, 4, dtype=torch.float64), config=FAST)
    _assert_members(wide, members, _x(2, 5, 4))  # the sample's own sizes
    _assert_members(wide, members, _x(*shape))
    _assert_members(wide, members, _x(2, 5, 4))  # the first graph still serves the sample's sizes


def test_graphs_are_kept_and_reused():
    members = _members(Parity)
    wide = wc.compile(members, torch.randn(2, 5, 4, dtype=torch.float64), config=FAST)
    for shape in [(2, 6, 4), (4, 8, 4), (2, 1, 4), (2, 3, 4), (4, 10, 4), (2, 1, 4)]:
        _assert_members(wide, members, _x(*shape))
    # even lengths, length 1: two graphs beside the first (odd lengths, even batches)
    assert len(wide._variants[True]) == 2


class PadToFour(LinearModel):
    """Pads the length to a multiple of 4 when it is not one (a common attention-block pattern)."""

    linears = {"lin": (4, 3)}

    def forward(self, x):
        pad = (-x.shape[1]) % 4
        if pad:
            x = F.pad(x, (0, 0, 0, pad))
        return self.lin(x).mean(1)


@pytest.mark.parametrize("t", [4, 5, 8, 6])
def test_padding_to_a_multiple(t):
    members = _members(PadToFour)
    wide = wc.compile(members, torch.randn(2, 7, 4, dtype=torch.float64), config=FAST)
    _assert_members(wide, members, _x(2, t, 4))


class OddImage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)

    def forward(self, x):
        if x.shape[-1] % 2 == 1:
            x = F.pad(x, (0, 1, 0, 1))
        return F.avg_pool2d(self.conv(x), 2)


@pytest.mark.parametrize("size", [8, 7])
def test_odd_image_size(size):
    members = _members(OddImage)
    wide = wc.compile(members, torch.randn(2, 2, 10, 10, dtype=torch.float64), config=FAST)
    wide(_x(2, 2, 12, 12))  # a new image size: that dim captured dynamic (Note [Dynamic sizes on demand])
    _assert_members(wide, members, _x(2, 2, size, size))


class Squeezed(LinearModel):
    linears = {"lin": (4, 2)}

    def forward(self, x):
        return self.lin(x).squeeze()  # squeezes the batch too when it is 1


def test_a_squeeze_at_batch_one_gives_the_members_shape():
    members = _members(Squeezed)
    wide = wc.compile(members, torch.randn(5, 4, dtype=torch.float64), config=FAST)
    out = _assert_members(wide, members, _x(1, 4))
    assert out.shape == (N, 2)


class MaskDtype(LinearModel):
    """A branch on an input's dtype leaves no trace in the captured graph."""

    linears = {"lin": (4, 4)}

    def forward(self, x, mask):
        if mask.dtype == torch.bool:
            mask = torch.where(mask, 0.0, -1.0).to(x.dtype)
        return self.lin(x) + mask.to(x.dtype)


def test_an_input_dtype_branch_follows_the_call():
    members = _members(MaskDtype)
    wide = wc.compile(members, (torch.randn(2, 4, dtype=torch.float64), torch.ones(2, 4, dtype=torch.bool)),
                      config=FAST)
    x = _x(2, 4)
    _assert_members(wide, members, x, torch.rand(N, 2, 4) > 0.5)
    _assert_members(wide, members, x, torch.randn(N, 2, 4, dtype=torch.float64))
    assert "mask.dtype == torch.bool" in wide._graphs[True].guards.describe()


class Tied(LinearModel):
    """Two inputs whose lengths the forward makes equal (export ties them to one size)."""

    linears = {"lin": (4, 4)}

    def forward(self, x, y):
        return self.lin(x) * y


def test_sizes_export_found_equal_are_checked():
    members = _members(Tied)
    wide = wc.compile(members, (torch.randn(2, 4, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64)),
                      config=FAST)
    assert any("==" in g for g in wide._graphs[True].guards.shown)
    # y broadcast over the batch: the member broadcasts, so must the wide model
    _assert_members(wide, members, _x(3, 4), _x(1, 4))
    with pytest.raises(ValueError, match="outside what the train graph was captured for"):
        wide(_x(3, 4), _x(2, 4))  # each member raises too: no graph can be captured


class Threshold(LinearModel):
    linears = {"lin": (4, 4)}

    def forward(self, x):
        return self.lin(x) * (2 if x.shape[1] > 8 else 3)


def test_a_threshold_branch_is_refused_not_run():
    members = _members(Threshold)
    wide = wc.compile(members, torch.randn(2, 10, 4, dtype=torch.float64), config=FAST)
    _assert_members(wide, members, _x(2, 12, 4))
    with pytest.raises(ValueError, match="holds for sizes"):
        wide(_x(2, 5, 4))


def test_graphs_per_mode_are_bounded_and_the_refusal_names_the_guard():
    class Modulo(LinearModel):
        linears = {"lin": (4, 4)}

        def __init__(self) -> None:
            super().__init__()
            self.table = [float(k) for k in range(16)]

        def forward(self, x):
            return self.lin(x) * self.table[x.shape[1] % 16]  # a Python index: one graph per residue

    members = _members(Modulo)
    wide = wc.compile(members, torch.randn(2, 2, 4, dtype=torch.float64), config=FAST)
    # the length captured dynamic (the graph holds for the sample's residue 2), then one graph per residue
    for t in range(3, 2 + MAX_GRAPHS):
        _assert_members(wide, members, _x(2, t, 4))
    assert 1 + len(wide._variants[True]) == MAX_GRAPHS
    with pytest.raises(ValueError, match=rf"% 16\) == 2\).*at most {MAX_GRAPHS} graphs per mode"):
        wide(_x(2, 2 + MAX_GRAPHS, 4))
    _assert_members(wide, members, _x(2, 5, 4))  # a refused call changed nothing


def test_a_capture_for_new_inputs_is_logged_once(caplog):
    members = _members(Parity)
    wide = wc.compile(members, torch.randn(2, 5, 4, dtype=torch.float64), config=FAST)
    with caplog.at_level(logging.WARNING, logger="wide_compiler"):
        wide(_x(2, 1, 4))
        wide(_x(2, 1, 4))
    warnings = [r for r in caplog.records if "outside what the train graph" in r.getMessage()]
    assert len(warnings) == 1 and "x.size()[1] >= 2" in warnings[0].getMessage()


def test_eval_mode_has_its_own_graphs():
    members = _members(Parity)
    wide = wc.compile(members, torch.randn(2, 5, 4, dtype=torch.float64), config=FAST).eval()
    for m in members:
        m.eval()
    with torch.no_grad():
        _assert_members(wide, members, _x(2, 1, 4))
    assert len(wide._variants[False]) == 1 and not wide._variants.get(True)


def test_copies_and_pickles_keep_following_the_calls():
    members = _members(Parity)
    wide = wc.compile(members, torch.randn(2, 5, 4, dtype=torch.float64), config=FAST)
    wide(_x(2, 6, 4))
    for other in (copy.deepcopy(wide), pickle.loads(pickle.dumps(wide))):
        _assert_members(other, members, _x(2, 6, 4))
        _assert_members(other, members, _x(2, 1, 4))


def test_check_inputs_captures_before_a_compiled_call():
    members = _members(Parity)
    wide = wc.compile(members, torch.randn(2, 5, 4, dtype=torch.float64), config=FAST)
    x = _x(2, 1, 4)
    wide.check_inputs(x)  # captures the graph for length 1 here, in eager Python
    assert len(wide._variants[True]) == 1
    compiled = torch.compile(wide, fullgraph=True, backend="eager")
    out = compiled(x)
    for i, m in enumerate(members):
        torch.testing.assert_close(out[i], m(x[i]))


# --- Note [What export does not capture] (fx/capture.py) ------------------------------------------


class _GradModeBranch(LinearModel):
    def forward(self, x):
        h = self.fc(x)
        return h * 2 if torch.is_grad_enabled() else h * 3


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_a_forward_that_reads_the_grad_mode_follows_the_calls_mode(mode):
    members = _members(_GradModeBranch)
    wide = wc.compile(members, torch.randn(2, 4, dtype=torch.float64), config=FAST)
    wide.train(mode == "train")
    for m in members:
        m.train(mode == "train")
    x = _x(2, 4)
    with torch.no_grad():
        _assert_members(wide, members, x)
    _assert_members(wide, members, x)


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.round()

    @staticmethod
    def backward(ctx, g):
        return g


class _Quantised(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.b(_StraightThrough.apply(self.a(x) * 4))


def test_a_custom_autograd_function_is_refused_in_training_not_run_without_its_backward(caplog):
    with pytest.raises(wc.WideCompileError, match="custom autograd function _StraightThrough"):
        wc.compile(_members(_Quantised), torch.randn(2, 4, dtype=torch.float64), config=FAST)
    members = [m.eval() for m in _members(_Quantised)]
    with caplog.at_level(logging.WARNING, logger="wide_compiler"):
        wide = wc.compile(members, torch.randn(2, 4, dtype=torch.float64), config=FAST)
    assert any("a backward through it would not run" in r.getMessage() for r in caplog.records)
    with torch.no_grad():
        _assert_members(wide, members, _x(2, 4))  # the eval forward is the members'


class _Hooked(LinearModel):
    def forward(self, x):
        h = self.fc(x)
        h.register_hook(lambda g: g * 4)
        return h.tanh()


def test_backward_hooks_are_refused_in_training():
    with pytest.raises(wc.WideCompileError, match="Tensor.register_hook"):
        wc.compile(_members(_Hooked), torch.randn(2, 4, dtype=torch.float64), config=FAST)
    members = [nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(N)]
    for m in members:
        m[0].register_full_backward_pre_hook(lambda mod, go: (go[0] * 4,))
    with pytest.raises(wc.WideCompileError, match=r"0 \(Linear\) has a backward hook"):
        wc.compile(members, torch.randn(2, 4), config=FAST)


class _ExactGelu(torch.autograd.Function):
    """A custom Function whose backward is autograd's gradient of its forward (as BLOOM's GeLU)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(1.702 * x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(1.702 * x)
        return g * (s + 1.702 * x * s * (1 - s))


class _GeluNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.b(_ExactGelu.apply(self.a(x)))


def test_a_custom_function_whose_backward_is_autograds_is_refused_in_training_too():
    """Note [Custom Functions are not sampled]: equality with autograd's gradient on a sample is
    not proof (it was accepted that way once); the eval graph's forward is exact."""
    with pytest.raises(wc.WideCompileError, match=r"(?s)custom autograd function _ExactGelu.*eval mode"):
        wc.compile(_members(_GeluNet), torch.randn(2, 4, dtype=torch.float64), config=FAST)
    members = [m.eval() for m in _members(_GeluNet)]
    wide = wc.compile(members, torch.randn(2, 4, dtype=torch.float64), config=FAST)
    with torch.no_grad():
        _assert_members(wide, members, _x(2, 4))


def test_inputs_follow_the_models_dtype_after_to():
    torch.manual_seed(0)
    members = [Parity() for _ in range(N)]
    wide = wc.compile(members, torch.randn(2, 5, 4), config=FAST).double()
    members = [m.double() for m in members]
    _assert_members(wide, members, _x(2, 5, 4))  # float64 inputs: the model's dtype now, no capture
    assert not wide._variants.get(True)
