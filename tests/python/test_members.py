"""WideModel member operations: write_back, member_state_dict, copy_member_weights (with optimizer)."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
import wide_compiler as wc
from torch import nn
from support import DEVICE

N = 4


def make(n=N):
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 2)) for _ in range(n)]
    wide = wc.compile(models, torch.randn(3, 5), config=wc.WideConfig.fast())
    return models, wide


def train(wide, opt, steps=3):
    for s in range(steps):
        g = torch.Generator(DEVICE).manual_seed(s)
        x, y = torch.randn(N, 6, 5, generator=g), torch.randn(N, 6, 2, generator=g)
        opt.zero_grad()
        wc.optim.member_losses(F.mse_loss, wide(x), y).sum().backward()
        opt.step()


def test_write_back_updates_the_originals_in_place():
    models, wide = make()
    ids = [id(m[0].weight) for m in models]
    opt = wc.optim.Adam(wide.parameters(), lr=[0.1, 0.01, 0.001, 0.0])
    train(wide, opt)
    wide.write_back(models)
    assert [id(m[0].weight) for m in models] == ids
    x = torch.randn(N, 7, 5)
    y = wide(x)
    for i, m in enumerate(models):
        torch.testing.assert_close(m(x[i]), y[i], rtol=1e-5, atol=1e-5)
        for k, v in m.state_dict().items():
            assert torch.equal(v, wide.member_state_dict(i)[k])


def test_write_back_checks_before_writing():
    models, wide = make()
    before = [copy.deepcopy(m.state_dict()) for m in models]
    with pytest.raises(ValueError, match="expected 4 modules"):
        wide.write_back(models[:3])
    bad = models[:3] + [nn.Sequential(nn.Linear(5, 9), nn.ReLU(), nn.Linear(9, 2))]
    with torch.no_grad():
        wide.get_parameter("0.weight").add_(1)
    with pytest.raises(ValueError, match="member 3 parameter '0.weight'"):
        wide.write_back(bad)
    for m, sd in zip(models, before):
        for k, v in m.state_dict().items():
            assert torch.equal(v, sd[k])


def test_member_state_dict_loads_into_the_original_class():
    models, wide = make()
    sd = wide.member_state_dict(2)
    fresh = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 2))
    fresh.load_state_dict(sd)
    x = torch.randn(3, 5)
    torch.testing.assert_close(fresh(x), models[2](x))
    sd["0.weight"].zero_()            # a copy, not a view
    assert torch.count_nonzero(wide.get_parameter("0.weight")[2]) > 0
    m = wide.member(1)
    torch.testing.assert_close(m(x), models[1](x))
    with pytest.raises(IndexError):
        wide.member_state_dict(N)


def test_load_member_state_dict():
    models, wide = make()
    other = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 2))
    wide.load_member_state_dict(0, other.state_dict())
    x = torch.randn(N, 3, 5)
    torch.testing.assert_close(wide(x)[0], other(x[0]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(wide(x)[1], models[1](x[1]), rtol=1e-5, atol=1e-5)
    with pytest.raises(KeyError, match="missing"):
        wide.load_member_state_dict(0, {"0.weight": torch.zeros(8, 5)})


def test_copy_member_weights_with_optimizer_then_training_matches():
    """After copy_member_weights(src, dst, opt), dst continues exactly as src does (same weights, same
    optimizer state, same hyperparameters): the PBT exploit step."""
    models, wide = make()
    opt = wc.optim.AdamW(wide.parameters(), lr=[0.03, 0.01, 0.003, 0.001], weight_decay=[0, 0.1, 0.2, 0.3])
    train(wide, opt)
    wide.copy_member_weights(1, 3, opt)
    for name, p in wide.named_parameters():
        assert torch.equal(p[3], p[1]), name
        for key, t in opt.state[p].items():
            assert torch.equal(t[3], t[1]), (name, key)
    assert opt.member_hyperparameters(3) == opt.member_hyperparameters(1)
    # same data for members 1 and 3 -> they stay identical
    for s in range(3):
        x = torch.randn(N, 6, 5)
        x[3] = x[1]
        y = torch.randn(N, 6, 2)
        y[3] = y[1]
        opt.zero_grad()
        wc.optim.member_losses(F.mse_loss, wide(x), y).sum().backward()
        opt.step()
    for name, p in wide.named_parameters():
        assert torch.equal(p[3], p[1]), name
    assert not torch.equal(wide.get_parameter("0.weight")[0], wide.get_parameter("0.weight")[1])


def test_copy_member_weights_rejects_bad_arguments():
    _, wide = make()
    with pytest.raises(IndexError):
        wide.copy_member_weights(0, N)
    with pytest.raises(TypeError, match="copy_member_weights: SGD has no copy_member_state"):
        wide.copy_member_weights(0, 1, torch.optim.SGD(wide.parameters(), lr=0.1))


def test_old_copy_member_names_are_deprecated_aliases(monkeypatch):
    """WideModel.copy_member and WideOptimizer.copy_member still work: each warns once
    (DeprecationWarning naming the new name), then copies as the new method does."""
    from wide_compiler import _deprecation

    monkeypatch.setattr(_deprecation, "_warned", set())
    _, wide = make()
    opt = wc.optim.SGD(wide.parameters(), lr=[0.1, 0.2, 0.3, 0.4], momentum=0.9)
    train(wide, opt, steps=1)
    with pytest.warns(DeprecationWarning, match="WideModel.copy_member is deprecated.*copy_member_weights"):
        wide.copy_member(3, 0, opt)
    for name, p in wide.named_parameters():
        assert torch.equal(p[0], p[3]), name
        assert torch.equal(opt.state[p]["momentum_buffer"][0], opt.state[p]["momentum_buffer"][3]), name
    assert opt.member_hyperparameters(0) == opt.member_hyperparameters(3)
    with pytest.warns(DeprecationWarning, match="WideOptimizer.copy_member is deprecated.*copy_member_state"):
        opt.copy_member(1, 2, hyperparameters=False)
    assert opt.param_groups[0]["lr"][2].item() == pytest.approx(0.3)   # hyperparameters kept
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # once only
        wide.copy_member(2, 1)
        opt.copy_member(2, 1)


def test_member_is_in_the_wide_models_dtype_after_to():
    """``member(i)`` after ``wide.to(dtype)`` is in that dtype, as ``unfuse()`` is (it was in the
    compile's dtype: float64 parameters and BatchNorm buffers from a float32 wide model), with the
    wide model's values (float64 values are not rounded through float32); tied weights stay tied."""

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.bn, self.b = nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(self.bn(self.a(x)))

    torch.manual_seed(0)
    models = [Tied() for _ in range(3)]
    for target in (torch.float64, torch.float32):
        wide = wc.compile(models, torch.randn(5, 4), config=wc.WideConfig.fast()).to(target)
        with torch.no_grad():
            wide.get_parameter("a.bias")[1] += 1e-12  # representable in float64 only
        for i in range(3):
            m, u = wide.member(i), wide.unfuse()[i]
            assert {t.dtype for t in [*m.parameters(), *m.buffers()] if t.is_floating_point()} == {target}
            assert m.a.weight is m.b.weight
            for (name, t), (_, v) in zip(m.state_dict().items(), u.state_dict().items()):
                assert t.dtype == v.dtype and torch.equal(t, v), name


def test_members_of_two_classes_of_one_name_are_refused_saying_so():
    """A class defined again (a notebook cell run twice) or made per module (torch.fx
    symbolic_trace): the refusal said "type ... is 'M', member 0 has 'M'"."""

    def make():
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(3, 2)

            def forward(self, x):
                return self.fc(x)
        return M()

    with pytest.raises(wc.ArchitectureMismatchError, match=r"member 1: type of the model \(M\) is .*another class of "
                                                           r"that name.*member 0 has .*test_members\..*M'"):
        wc.compile([make(), make()], torch.randn(4, 3), config=wc.WideConfig.fast())
