"""Calls a wide model must not run silently wrong, found by an independent probe (issue 44,
probe 4: F3, F4, F1). A non-tensor input is compared by type and value (F3); a custom
torch.autograd.Function is refused in a training graph, whose backward is the Function's own
(F4); a call that needs a new capture under torch.compile gets a clear wide_compiler error (F1).
Each member is compared with itself run alone, in float64.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import wide_compiler as wc
from torch import nn

FAST = wc.WideConfig.fast()
DT = torch.float64


# ---------------------------------------------------------------- F3: non-tensor inputs by type and value
class Typed(nn.Module):
    """A forward whose program depends on the type and sign of a Python scalar input."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(3, 3)

    def forward(self, x, scale=1.0):
        h = self.l(x)
        if isinstance(scale, (list, tuple, dict)):
            vals = list(scale.values()) if isinstance(scale, dict) else list(scale)
            return h + sum(100.0 if isinstance(v, int) else v for v in vals)
        if isinstance(scale, bool):
            return h - 100
        if isinstance(scale, int):
            return h + 10 * scale
        if math.isnan(scale):
            return h * 3
        return h * scale + math.copysign(1.0, scale)


def _typed_wide(sample):
    torch.manual_seed(0)
    models = [Typed().to(DT) for _ in range(2)]
    wide = wc.compile([copy.deepcopy(m) for m in models], torch.randn(2, 3, dtype=DT), config=FAST,
                      sample_kwargs={"scale": sample})
    return models, wide


@pytest.mark.parametrize("compiled, called", [
    (1.0, True), (1.0, 1), (2, 2.0), (True, 1), (0.0, -0.0), (0.0, False), (0.0, 0),
    ([1.0, 2.0], [1, 2.0]), ((1.0,), (True,)), ({"a": 2}, {"a": 2.0}),
], ids=repr)
def test_a_non_tensor_input_equal_under_eq_but_of_another_type_or_sign_is_refused(compiled, called):
    """Was: ``==`` let True/1 through for 1.0, 2.0 for 2, -0.0 for 0.0 (also inside lists, tuples
    and dicts): the graph of the compiled value ran, off by 2 to 110."""
    models, wide = _typed_wide(compiled)
    x = torch.randn(2, 4, 3, dtype=DT)
    with torch.no_grad():
        out = wide(x, scale=compiled)  # the compiled value runs, exactly
        for i, m in enumerate(models):
            torch.testing.assert_close(out[i], m(x[i], scale=compiled), rtol=1e-12, atol=1e-12)
        with pytest.raises(ValueError, match=r"input 'scale.*compiled with .*another (type|sign)"):
            wide(x, scale=called)


def test_a_nan_input_compiled_matches_a_nan_call():
    """A NaN is the same value as a NaN (it was refused: ``nan != nan``); 1.0 is not."""
    models, wide = _typed_wide(float("nan"))
    x = torch.randn(2, 4, 3, dtype=DT)
    with torch.no_grad():
        out = wide(x, scale=float("nan"))
        for i, m in enumerate(models):
            torch.testing.assert_close(out[i], m(x[i], scale=float("nan")), rtol=1e-12, atol=1e-12)
        with pytest.raises(ValueError, match="input 'scale'"):
            wide(x, scale=1.0)


# ---------------------------------------------------------------- F4: custom autograd.Functions in training
class _OutlierGuard(torch.autograd.Function):
    """Forward: the identity. Backward: autograd's (the identity) on ordinary values, 0 beyond 6 --
    equal to autograd's on one random sample, not on large inputs."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * torch.where(x.abs() > 6, 0.0, 1.0)


class _Guarded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(3, 3)

    def forward(self, x):
        return _OutlierGuard.apply(self.l(x)).sum(-1, keepdim=True)


def test_a_custom_function_is_refused_in_training_even_when_its_backward_matches_autograds_on_a_sample(caplog):
    """Was: accepted when its backward equalled autograd's on one random sample; the wide model's
    backward then was autograd's, and inputs x50 gave parameter gradients 179 off."""
    torch.manual_seed(0)
    models = [_Guarded().to(DT) for _ in range(2)]
    with pytest.raises(wc.WideCompileError, match=r"(?s)custom autograd function _OutlierGuard.*"
                                                   r"test_probe4_calls\.py:\d+ in forward.*member 0.*eval mode"):
        wc.compile([copy.deepcopy(m) for m in models], torch.randn(2, 3, dtype=DT), config=FAST)
    evals = [copy.deepcopy(m).eval() for m in models]
    with caplog.at_level("WARNING", logger="wide_compiler"):
        wide = wc.compile(evals, torch.randn(2, 3, dtype=DT), config=FAST)
    assert any("_OutlierGuard" in r.getMessage() and "backward" in r.getMessage() for r in caplog.records)
    x = torch.randn(2, 4, 3, dtype=DT) * 50
    with torch.no_grad():  # the eval forward is the members'
        out = wide(x)
        for i, m in enumerate(evals):
            torch.testing.assert_close(out[i], m(x[i]), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- F1: a new capture needed under torch.compile
_SC = 1.0  # a module global the forward reads (a guard of the capture)


class _Global(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(3, 3)

    def forward(self, x):
        return self.l(x) * _SC


def test_a_call_needing_a_new_capture_under_torch_compile_says_so_and_an_eager_call_captures_it():
    """Was: Dynamo's "Unsupported context manager RLock" (a changed global) and a wrapped "sizes ...
    were fixed at capture" for a size an eager call captures again."""
    global _SC
    torch.manual_seed(0)
    models = [_Global().to(DT) for _ in range(2)]
    wide = wc.compile([copy.deepcopy(m) for m in models], torch.randn(2, 4, 3, dtype=DT), config=FAST)
    compiled = torch.compile(wide, fullgraph=True, backend="eager")
    x4, x5 = torch.randn(2, 2, 4, 3, dtype=DT), torch.randn(2, 2, 5, 3, dtype=DT)

    def members(x):
        return torch.stack([m(x[i]) for i, m in enumerate(models)])

    try:
        with torch.no_grad():
            torch.testing.assert_close(compiled(x4), members(x4), rtol=1e-12, atol=1e-12)
            with pytest.raises(Exception, match=r"(?s)needs a new capture.*input 'x', another size in dim 2.*"
                                                r"once outside torch.compile") as e:
                compiled(x5)
            assert "fixed at capture" not in str(e.value)
            _SC = 2.0
            with pytest.raises(Exception, match=r"(?s)needs a new capture.*_SC == 1\.0.*once outside torch.compile"):
                compiled(x4)
            torch.testing.assert_close(wide(x5), members(x5), rtol=1e-12, atol=1e-12)  # eager: captured
            torch.testing.assert_close(compiled(x5), members(x5), rtol=1e-12, atol=1e-12)  # then compiled
            _SC = 3.0  # without fullgraph, Dynamo breaks the graph at the refusal and the call runs eagerly
            loose = torch.compile(wide, backend="eager")
            torch.testing.assert_close(loose(x5), members(x5), rtol=1e-12, atol=1e-12)
    finally:
        _SC = 1.0


def test_non_tensor_inputs_under_torch_compile_are_compared_by_type_and_value():
    """The guards' check of a non-tensor input traces under torch.compile (a float kept symbolic
    by Dynamo: no repr); another type or sign is refused as in eager (was: 2.0 ran 2's graph)."""
    models, wide = _typed_wide(2)
    compiled = torch.compile(wide, fullgraph=True, backend="eager")
    x = torch.randn(2, 4, 3, dtype=DT)
    with torch.no_grad():
        out = compiled(x, scale=2)
        for i, m in enumerate(models):
            torch.testing.assert_close(out[i], m(x[i], scale=2), rtol=1e-12, atol=1e-12)
        for other in (2.0, 3):
            with pytest.raises(Exception, match=r"(?s)input 'scale' is .*compiled with.*compile again"):
                compiled(x, scale=other)
    models, wide = _typed_wide(1.5)  # a float input: Dynamo keeps it symbolic
    compiled = torch.compile(wide, fullgraph=True, backend="eager")
    with torch.no_grad():
        out = compiled(x, scale=1.5)
        torch.testing.assert_close(out[1], models[1](x[1], scale=1.5), rtol=1e-12, atol=1e-12)
