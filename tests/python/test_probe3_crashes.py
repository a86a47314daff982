"""Internal crashes and a false trust-check failure found by an independent probe (issue 44,
probe 3: F4, F4b, F5, F8, F10). Each case either works exactly (float64, each member against
itself run alone) or is refused at compile with what, where and why -- never an internal error.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import wide_compiler as wc
from torch import nn
from wide_compiler.errors import UnsupportedOperationError

FAST = wc.WideConfig.fast()
DT = torch.float64


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape, (a.shape, b.shape)
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- F4: tied weights with pad=True
class Tied(nn.Module):
    """A language-model head tied to its embedding (``fc.weight = e.weight``)."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.e = nn.Embedding(vocab, dim)
        self.fc = nn.Linear(dim, vocab, bias=False)
        self.fc.weight = self.e.weight

    def forward(self, i):
        return self.fc(torch.tanh(self.e(i)))


@pytest.mark.parametrize("sizes", [((5, 4), (8, 4)), ((5, 4), (5, 6))], ids=["vocab", "dim"])
def test_tied_weights_pad_train_exact(sizes):
    """Was ``KeyError: 'fc.weight'`` in fx/padding.py; now padded, tied, and exact through a step."""
    torch.manual_seed(0)
    models = [Tied(*s).to(DT) for s in sizes]
    own = [copy.deepcopy(m) for m in models]
    x = torch.tensor([[0, 4, 2], [1, 1, 3]])
    wide = wc.compile(models, x, pad=True, config=FAST)
    outs = wide.member_outputs(wide(torch.stack([x, x])))
    sum((o ** 2).sum() for o in outs).backward()
    torch.optim.SGD(wide.parameters(), lr=0.1).step()
    for i, m in enumerate(own):
        out = m(x)
        _close(outs[i].detach(), out.detach())
        (out ** 2).sum().backward()
        torch.optim.SGD(m.parameters(), lr=0.1).step()
        member = wide.member(i)
        assert member.fc.weight is member.e.weight  # still tied
        assert set(wide.member_state_dict(i)) == set(m.state_dict())
        for k, v in m.state_dict().items():
            _close(wide.member_state_dict(i)[k], v)


def test_no_grad_region_over_unpadded_values_is_padded():
    """A region export captures as a graph of its own (a ``torch.no_grad()`` block) that reads only
    values of one size for all members is left as it is; padding goes on around it."""

    class M(nn.Module):
        def __init__(self, h: int) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(4, h), nn.Linear(h, 2)

        def forward(self, x):
            with torch.no_grad():
                s = x.abs().mean() + 1
            return self.fc2(torch.relu(self.fc1(x))) * s

    torch.manual_seed(0)
    models = [M(h).to(DT) for h in (3, 5)]
    x = torch.randn(5, 4, dtype=DT)
    wide = wc.compile(models, x, pad=True, config=FAST)
    for i, o in enumerate(wide.member_outputs(wide(torch.stack([x, x])))):
        _close(o.detach(), models[i](x).detach())


def test_spectral_norm_pad_refused_clearly():
    """Was ``KeyError: 'submod_1'``: spectral_norm's power iteration is a no_grad region over the
    padded weight; refused at compile naming the region, its module and why."""
    from torch.nn.utils.parametrizations import spectral_norm

    def mk(h):
        return nn.Sequential(spectral_norm(nn.Linear(4, h)), nn.ReLU(), nn.Linear(h, 2))

    torch.manual_seed(0)
    models = [mk(h) for h in (3, 6)]
    before = [copy.deepcopy(m.state_dict()) for m in models]
    with pytest.raises(UnsupportedOperationError, match=r"wrap_with_set_grad_enabled.*0\.parametrizations.*"
                                                        r"graph of its own"):
        wc.compile(models, torch.randn(5, 4), pad=True, config=FAST)
    for m, sd in zip(models, before):
        for k, v in m.state_dict().items():
            assert torch.equal(v, sd[k])


# ---------------------------------------------------------------- F5: the trust check with pad=True
def _sweep(sizes, dtype=torch.float32):
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(4, h), nn.BatchNorm1d(h), nn.LayerNorm(h), nn.Tanh(), nn.Linear(h, 2)).to(dtype)
            for h in sizes]


@pytest.mark.parametrize("dtype", [torch.float32, DT], ids=["float32", "float64"])
def test_check_compile_pad_checks_each_member_at_its_own_size(dtype):
    """Was ``AssertionError: train/own: grad of 0.weight: member 0: shape (6, 4) != expected (3, 4)``
    on a correct padded model: each member's results are placed in the padded shapes."""
    models = _sweep((3, 6, 4), dtype)
    wide, report = wc.testing.check_compile(models, torch.randn(5, 4, dtype=dtype), pad=True, config=FAST)
    assert type(wide).__name__ == "PaddedWideModel"
    assert sorted(report) == ["eval/own", "eval/shared", "train/own", "train/shared"]
    for key in report:
        assert report[key]["param_grad" if key.startswith("train") else "output"] is not None


def test_validate_pad_compares_with_the_padded_members():
    """``compile(pad=True, validate=True)`` compares the wide model with its padded members (the
    padded sizes already): nothing is placed, and it passes."""
    models = _sweep((3, 5), DT)
    wide = wc.compile(models, torch.randn(5, 4, dtype=DT), pad=True, validate=True, config=FAST)
    assert type(wide).__name__ == "PaddedWideModel"


def test_check_equivalence_pad_catches_a_wrong_member():
    """The padded check still fails where a member is not its model: members 0 and 2 (one size)
    swapped."""
    models = _sweep((3, 6, 3), DT)
    x = torch.randn(5, 4, dtype=DT)
    wide = wc.compile(models, x, pad=True, config=FAST)
    wc.testing.check_equivalence(wide, models, x, shared=True)
    with pytest.raises(AssertionError, match="member 0"):
        wc.testing.check_equivalence(wide, [models[2], models[1], models[0]], x, shared=True)


# ---------------------------------------------------------------- F8: export with per-member constants
class Scaled(nn.Module):
    """A LeakyReLU slope per member, and a value derived from a constant (``1 - s``)."""

    def __init__(self, s: float) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(4, 6), nn.LeakyReLU(s), nn.Linear(6, 2)
        self.s = s

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x))) * (1 - self.s)


def test_export_with_per_member_constants_matches_every_member(tmp_path):
    """Was ``GuardOnDataDependentSymNode`` from ``_sync_constants`` inside torch.export; now the
    constants are checked on their values before tracing and the program is every member's."""
    torch.manual_seed(0)
    models = [Scaled(0.1 * (i + 1)).to(DT).eval() for i in range(3)]
    wide = wc.compile(models, torch.randn(5, 4, dtype=DT), config=FAST).eval()
    assert wide.per_member_constants
    wide.export(tmp_path / "m.pt2")
    program = torch.export.load(tmp_path / "m.pt2").module()
    x = torch.randn(3, 7, 4, dtype=DT)  # another batch size
    y = program(x)
    for i, m in enumerate(models):
        _close(y[i], m(x[i]))
    _close(y, wide(x))
    with pytest.raises(ValueError, match=r"wide\.export\(\)"):  # around export(): refused, naming it
        torch.export.export(wide, (x,), strict=False)


# ---------------------------------------------------------------- F10: a buffer updated in place, then read
class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count += 1
        return self.fc(x) * self.count


def test_buffer_counter_used_after_its_update_trains():
    """Was autograd's ``modified by an inplace operation`` in the wide backward (export's write-back
    ``copy_(count, add_)`` of the buffer into itself); now two training steps match every member."""
    torch.manual_seed(0)
    models = [Counter().to(DT) for _ in range(3)]
    own = [copy.deepcopy(m) for m in models]
    wide = wc.compile(models, torch.randn(2, 4, dtype=DT), config=FAST)
    opt = torch.optim.SGD(wide.parameters(), lr=0.1)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in own]
    for _ in range(2):
        x = torch.randn(3, 2, 4, dtype=DT)
        y = wide(x)
        (y ** 2).sum().backward()
        opt.step()
        opt.zero_grad()
        for i, (m, o) in enumerate(zip(own, opts)):
            yi = m(x[i])
            _close(y[i].detach(), yi.detach())
            (yi ** 2).sum().backward()
            o.step()
            o.zero_grad()
    for i, m in enumerate(own):
        for k, v in m.state_dict().items():
            _close(wide.member_state_dict(i)[k], v)
