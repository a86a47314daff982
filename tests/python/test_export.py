"""WideModel.export / WideModel.package: the eval graph as a torch.export program and as an
AOTInductor package, saved, loaded and run member by member at other batch sizes. (The C++ side,
loading the package from a C++ program, is ctest's cpp_examples.)"""
from __future__ import annotations

import pytest
import torch
import wide_compiler as wc
from torch import nn
from wide_compiler.testing import assert_members_close, make_members

FAST = wc.WideConfig.fast()


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Linear(8 * 4 * 4, 5)

    def forward(self, x):
        return self.head(self.body(x).flatten(1))


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 4), nn.Linear(3, 4)

    def forward(self, x, y, scale=None):
        out = self.a(x) + self.b(y)
        return out if scale is None else out * scale


class NormMLP(nn.Module):
    """Linear -> BatchNorm1d (folded into the Linear) -> ReLU -> Linear -> GroupNorm (N-first)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8), nn.GroupNorm(2, 8))

    def forward(self, x):
        return self.net(x)


@pytest.mark.parametrize("factory,sample,kwargs", [
    (ConvNet, (torch.randn(2, 3, 8, 8),), {}),
    (TwoInputs, (torch.randn(4, 6), torch.randn(4, 3)), {"scale": torch.randn(4, 1)}),
    (NormMLP, (torch.randn(4, 6),), {}),
], ids=["convnet", "two_inputs_and_a_keyword", "norm_mlp"])
def test_export_save_load_matches_members_at_other_batches(factory, sample, kwargs, tmp_path):
    models = _with_statistics(make_members(factory, 3))
    wide = wc.compile(models, sample, sample_kwargs=kwargs or None, config=FAST)
    assert wide.training
    path = tmp_path / "wide.pt2"
    ep = wide.export(path)
    assert wide.training  # mode restored
    assert any(str(n.target).startswith("wide.") for n in ep.graph.nodes if n.op == "call_function")
    loaded = torch.export.load(path).module()
    for m in models:
        m.eval()
    for batch in (1, 5):
        xs = [torch.randn(3, batch, *t.shape[1:]) for t in sample]
        kw = {k: torch.randn(3, batch, *v.shape[1:]) for k, v in kwargs.items()}
        out = loaded(*xs, *kw.values())  # keyword inputs follow the positional ones
        refs = [m(*(x[i] for x in xs), **{k: v[i] for k, v in kw.items()}) for i, m in enumerate(models)]
        assert_members_close(out, refs)


def test_export_reflects_the_current_parameters():
    models = make_members(lambda: nn.Linear(4, 2), 2)
    wide = wc.compile(models, torch.randn(3, 4), config=FAST)
    with torch.no_grad():
        wide.weight.mul_(2.0)
    x = torch.randn(2, 3, 4)
    torch.testing.assert_close(wide.export().module()(x), wide.eval()(x))


def _with_statistics(models):
    for m in models:  # BatchNorm with statistics of its own (the eval graph folds it)
        for mod in m.modules():
            if isinstance(mod, (nn.BatchNorm1d, nn.BatchNorm2d)):
                mod.running_mean.uniform_(-1, 1), mod.running_var.uniform_(0.5, 2)
    return models


def test_package_runs_every_member_at_other_batches(tmp_path):
    models = _with_statistics(make_members(ConvNet, 3))
    wide = wc.compile(models, torch.randn(2, 3, 8, 8), config=FAST)
    path = wide.package(tmp_path / "wide.pt2")
    assert wide.training  # mode restored
    loaded = torch._inductor.aoti_load_package(path)
    for m in models:
        m.eval()
    for batch in (1, 5):
        x = torch.randn(3, batch, 3, 8, 8)
        assert_members_close(loaded(x), [m(x[i]) for i, m in enumerate(models)])

