"""Findings of the seventh independent probe (issue 44), each a test that failed before its fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import wide_compiler as wc

FAST = wc.WideConfig.fast()
ALPHA = 1.7580993408473766  # ATen's alpha dropout constant


@pytest.mark.parametrize("cls,shape", [(nn.Dropout1d, (3, 7)), (nn.Dropout2d, (3, 5, 5)), (nn.Dropout3d, (3, 2, 2, 2)),
                                       (nn.AlphaDropout, (3, 5, 5)), (nn.FeatureAlphaDropout, (3, 5, 5))])
def test_channel_and_alpha_dropout_sweep_draws_each_members_own_rate(cls, shape):
    """P7-2: a ``p`` sweep of Dropout1d/2d/3d, AlphaDropout and FeatureAlphaDropout was refused (no
    per-member form of ``aten.feature_dropout``/``alpha_dropout``). Each member now draws its own
    mask at its own rate, with ATen's scale and shift; p = 0 is the member exactly, p = 1 zero."""
    torch.manual_seed(0)
    ps = (0.0, 0.3, 1.0, 0.7)
    models = [cls(p).double() for p in ps]
    wide = wc.compile(models, torch.randn(2, *shape, dtype=torch.float64), config=FAST)
    assert wide.fallbacks == []
    x = torch.randn(len(ps), 400, *shape, dtype=torch.float64, requires_grad=True)
    out = wide(x)
    out.sum().backward()
    grad = x.grad
    feature = cls in (nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.FeatureAlphaDropout)
    for i, p in enumerate(ps):
        q = 1 - p
        if p == 0:
            torch.testing.assert_close(out[i], x[i], rtol=0, atol=0)
            assert bool((grad[i] == 1).all())
            continue
        if p == 1:
            assert bool((out[i] == 0).all()) and bool((grad[i] == 0).all())
            continue
        kept = grad[i] != 0
        if cls in (nn.AlphaDropout, nn.FeatureAlphaDropout):
            a = 1 / ((ALPHA * ALPHA * p + 1) * q) ** 0.5
            torch.testing.assert_close(grad[i][kept], torch.full_like(grad[i][kept], a))
            expected = torch.where(kept, x[i] * a + ALPHA * a * p, torch.full_like(x[i], -ALPHA * a * q))
        else:
            torch.testing.assert_close(grad[i][kept], torch.full_like(grad[i][kept], 1 / q))
            expected = x[i] * grad[i]
        torch.testing.assert_close(out[i], expected.detach())
        if feature:  # one draw per (sample, channel): a plane is kept or dropped whole
            planes = kept.flatten(2)
            assert bool((planes.all(-1) | ~planes.any(-1)).all())
            rate = 1 - planes[..., 0].double().mean().item()
        else:
            rate = 1 - kept.double().mean().item()
        assert abs(rate - p) < 0.1, (i, p, rate)
    # the members' masks are drawn independently: two members at the same rate differ
    twins = wc.compile([cls(0.5).double() for _ in range(2)], torch.randn(2, *shape, dtype=torch.float64), config=FAST)
    y = twins(torch.ones(2, 400, *shape, dtype=torch.float64))
    assert not torch.equal(y[0], y[1])
    wide.eval()
    torch.testing.assert_close(wide(x.detach()), x.detach(), rtol=0, atol=0)


def test_scaler_refusing_a_dampened_first_step_of_wc_sgd_gives_advice_that_applies_to_it():
    """P7-3: wc.optim.SGD with dampening, one member overflowing at the first step: the refusal told
    the user to "use the wide_compiler.optim optimizer", which they were using. Its advice now is
    what works (dampening=0 is exact: test_probe6's _sgd_run), and nothing changed."""
    torch.manual_seed(0)
    wide = wc.compile([nn.Linear(4, 2) for _ in range(3)], torch.randn(5, 4), config=FAST)
    before = {k: v.clone() for k, v in wide.state_dict().items()}
    opt = wc.optim.SGD(wide.parameters(), lr=0.1, momentum=0.9, dampening=0.5)
    scaler = wc.amp.GradScaler()
    loss = wide(torch.randn(3, 5, 4)).square().mean((1, 2)) * torch.tensor([1.0, float("inf"), 1.0])
    scaler.scale(loss).sum().backward()
    with pytest.raises(RuntimeError, match=r"member\(s\) \[1\].*dampening") as err:
        scaler.step(opt)
    assert "Use the wide_compiler.optim optimizer" not in str(err.value)
    assert "use dampening=0, or one optimizer and one torch.amp.GradScaler per member" in str(err.value)
    assert all(torch.equal(v, before[k]) for k, v in wide.state_dict().items()) and not opt.state


class _Act(nn.Module):
    def forward(self, x):
        return torch.tanh(x)


class _WrongInTrain(nn.Module):
    """An injected defect: the wide form of _Act is off by 2x in train mode only."""

    @classmethod
    def from_modules(cls, modules):
        return cls()

    def forward(self, x):
        return torch.tanh(x) * (2.0 if self.training else 1.0)

    def unfuse(self):
        return [_Act()]


def _dropout_mlp(p: float) -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), _Act(), nn.Dropout(p), nn.Linear(16, 4))


def test_trust_check_compares_train_mode_of_a_graph_with_dropout_and_catches_a_train_only_defect(monkeypatch):
    """P7-4: check_compile skipped every train check of a graph with a random op, so a program wrong
    in train mode passed on any model with a Dropout (stock mobilenet_v2, efficientnet_b0). Train
    mode is now compared with every draw fixed on both sides: a correct dropout sweep passes in
    train mode (compared, not skipped), and the injected train-only defect fails it and validate."""
    torch.manual_seed(0)
    members = [_dropout_mlp(p) for p in (0.1, 0.3, 0.5)]
    _, report = wc.testing.check_compile(members, torch.randn(6, 8), config=FAST)
    assert sorted(report) == ["eval/own", "eval/shared", "train/own", "train/shared"]
    assert not any(isinstance(rep, str) for rep in report.values()), report
    from wide_compiler import registry

    monkeypatch.setitem(registry._REGISTRY, _Act, _WrongInTrain)  # wc.register(_Act), undone after
    with pytest.raises(AssertionError, match=r"^train/own output: member 0 differs"):
        wc.testing.check_compile(members, torch.randn(6, 8), config=FAST)
    with pytest.raises(wc.ValidationError, match=r"validate \(train mode"):
        wc.compile(members, torch.randn(6, 8), config=FAST, validate=True)
    assert all(m.training for m in members)  # the users' models stay as they were


def test_fixed_draws_agree_between_each_random_op_and_the_wide_forms_that_replace_it():
    """The fixed values are consistent: a Bernoulli(p) draw is 1 where p > 0 (what ``rand < p``
    gives with rand fixed at 0), uniform/normal/exponential draws sit at their low end or mean, so
    a per-member form that moves a standard draw gives the member's own fixed value; the check's
    own draws (an explicit generator) are untouched; an op with no fixed value is reported."""
    from wide_compiler._equivalence.draws import fixed_draws

    gen = torch.Generator().manual_seed(0)
    with fixed_draws() as unfixed:
        p = torch.tensor([0.0, 0.3, 1.0])
        assert torch.equal(torch.empty(3).bernoulli_(p), (torch.rand(3) < p).float())
        assert torch.equal(torch.bernoulli(p), torch.tensor([0.0, 1.0, 1.0]))
        assert torch.equal(torch.empty(2).uniform_(-2.0, 3.0), torch.empty(2).uniform_(0, 1) * 5.0 - 2.0)
        assert torch.equal(torch.empty(2).normal_(1.5, 2.0), torch.empty(2).normal_(0, 1) * 2.0 + 1.5)
        assert torch.equal(torch.empty(2).exponential_(4.0), torch.empty(2).exponential_(1.0) / 4.0)
        assert torch.equal(torch.nn.functional.dropout(torch.ones(3), 1.0, True), torch.zeros(3))
        assert torch.equal(torch.randperm(4), torch.arange(4))
        assert not torch.equal(torch.rand(8, generator=gen), torch.zeros(8))
        assert unfixed == set()
        torch.multinomial(torch.ones(3), 1)
    assert unfixed == {"aten.multinomial.default"}
