"""The eval fold cache and module-global state, found by an independent probe (issue 44, probe 5:
F18, F21, F19, F20). Each member is compared with itself run alone.
"""
from __future__ import annotations

import pytest
import torch
import wide_compiler as wc
from torch import nn

FAST = wc.WideConfig.fast()


# ------------------------------------------------ F18: running statistics changed between eval calls
@pytest.mark.parametrize("backward", [False, True])
def test_fold_cache_sees_running_stats_updated_by_a_train_call(backward: bool) -> None:
    """A train-mode call updates only the BatchNorm running statistics (no optimizer step); the
    next eval call folds them again (the wide batch_norm bumps their version counters, as torch's
    BatchNorm does, and its backward still runs)."""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).double() for _ in range(3)]
    wide = wc.compile(models, torch.randn(5, 4, dtype=torch.float64), config=FAST)
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    wide.eval()
    with torch.no_grad():
        wide(x)  # the folded weights are cached
    wide.train()
    with torch.set_grad_enabled(backward):
        out = wide(x)
        if backward:
            out.sum().backward()
        for i, m in enumerate(models):
            m.train()(x[i])
    wide.eval()
    with torch.no_grad():
        out = wide(x)
        for i, m in enumerate(models):
            torch.testing.assert_close(out[i], m.eval()(x[i]))


# ------------------------------------------------ F21: a module or parameter held as a module global
PROJ = nn.Linear(4, 4)
W = nn.Parameter(torch.ones(4))
ACT = nn.GELU()


class ReadsGlobalModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.project(self.fc(x))

    def project(self, h):  # a method the forward calls: read too
        return ACT(PROJ(h))


class ReadsGlobalParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return ACT(self.fc(x)) * W


@pytest.mark.parametrize("model, name", [(ReadsGlobalModule, "PROJ"), (ReadsGlobalParameter, "W")])
def test_global_module_or_parameter_is_refused(model: type, name: str) -> None:
    """Its parameters would be baked into the graph: no gradient, later changes not seen."""
    torch.manual_seed(0)
    models = [model() for _ in range(2)]
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in models]
    with pytest.raises(wc.UnsupportedOperationError, match=rf"module global {__name__}\.{name}, .* in "
                       rf"ReadsGlobal\w+\.(project|forward) \(.*test_probe5_fold\.py:\d+\).*submodule"):
        wc.compile(models, torch.randn(5, 4), config=FAST)
    assert all(torch.equal(b[k], m.state_dict()[k]) for b, m in zip(before, models) for k in b)


def test_global_module_without_state_and_frozen_parameter_compile(caplog: pytest.LogCaptureFixture) -> None:
    """A global GELU holds nothing to train (named in a warning: its attributes are read at
    capture); a frozen parameter is a guarded constant."""
    torch.manual_seed(0)
    W.requires_grad_(False)
    try:
        models = [ReadsGlobalParameter() for _ in range(2)]
        x = torch.randn(2, 5, 4)
        with caplog.at_level("WARNING", logger="wide_compiler"):
            wide = wc.compile(models, x[0], config=FAST)
        assert f"module global(s) {__name__}.ACT, nn.Module(s) without parameters" in caplog.text
        out = wide(x)
        for i, m in enumerate(models):
            torch.testing.assert_close(out[i], m(x[i]))
    finally:
        W.requires_grad_(True)


# ------------------------------------------------ F19: .float() under swap_module_params_on_conversion
def test_float_with_swapped_params_after_an_eval_call() -> None:
    """The eval fold cache's weak references to the stacked tensors are dropped before the
    conversion, so torch.utils.swap_tensors may swap them."""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.Flatten()).double().eval() for _ in range(2)]
    x = torch.randn(2, 2, 2, 4, 4, dtype=torch.float64)
    wide = wc.compile(models, x[0], config=FAST).eval()
    with torch.no_grad():
        wide(x)  # the folded weights are cached
    was = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        wide.float()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(was)
    assert {p.dtype for p in wide.parameters()} == {torch.float32}
    with torch.no_grad():
        out = wide(x.float())
        for i, m in enumerate(models):
            torch.testing.assert_close(out[i], m.float()(x[i].float()))


# ------------------------------------------------ F20: TransformerEncoder's nested-tensor fast path
class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True), 1)

    def forward(self, x, mask):
        return self.enc(x, src_key_padding_mask=mask)


def test_nested_tensor_fast_path_is_warned_once(caplog: pytest.LogCaptureFixture, monkeypatch) -> None:
    """The members alone return 0.0 at padded positions in eval under no_grad; the wide model the
    ordinary path's values: named at compile, once per process."""
    from wide_compiler.fx import fast_paths

    monkeypatch.setattr(fast_paths, "_warned", [])
    torch.manual_seed(0)
    models = [Encoder().eval() for _ in range(2)]
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[0, 3:] = True
    x = torch.randn(2, 2, 5, 8)
    with caplog.at_level("WARNING", logger="wide_compiler"):
        wide = wc.compile(models, (x[0], mask), config=FAST).eval()
        fast_paths.warn_nested_tensor_fast_path(models[0])  # once per process
    said = [r.getMessage() for r in caplog.records if "nested-tensor fast path" in r.getMessage()]
    assert len(said) == 1 and "members' enc is an nn.TransformerEncoder" in said[0]
    with torch.no_grad():  # valid positions agree
        out = wide(x, mask.expand(2, 2, 5))
        for i, m in enumerate(models):
            torch.testing.assert_close(out[i][~mask], m(x[i], mask)[~mask])
