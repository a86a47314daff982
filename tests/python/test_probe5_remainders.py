"""What was left of probe 5 of issue 44. ``wide.to(dtype)`` when the forward cannot be captured in
the new dtype (Note [A graph runs in the dtype it was captured in], model.py): the conversion
completes (nothing half-changed), says why with one warning, the next call raises the capture's
error, and converting back runs again. A global pre-hook that changes every module's arguments
applies once per module, as on the member alone (Note [Global hooks do not run on export's own
modules], fx/capture.py).
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch
import wide_compiler as wc
from torch import nn


class RefusesBFloat16(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if self.fc.weight.dtype == torch.bfloat16:
            raise TypeError("this model refuses bfloat16")
        return self.fc(x)


def test_a_conversion_whose_capture_fails_completes_and_the_call_raises(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    models = [RefusesBFloat16() for _ in range(2)]
    wide = wc.compile(models, torch.randn(5, 4), config=wc.WideConfig.fast())
    with caplog.at_level(logging.WARNING, logger="wide_compiler"):
        wide.to(torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in wide.parameters())
    assert any("cannot be captured in torch.bfloat16" in r.getMessage() and "refuses bfloat16" in r.getMessage()
               for r in caplog.records)
    for _ in range(2):  # every call says why, and changes nothing
        with pytest.raises(wc.WideCompileError, match="refuses bfloat16"):
            wide(torch.randn(2, 5, 4, dtype=torch.bfloat16))
    wide.float()  # back: captured again in float32, with the weights rounded through bfloat16
    refs = [copy.deepcopy(m).bfloat16().float() for m in models]
    x = torch.randn(2, 5, 4)
    out = wide(x)
    for i, m in enumerate(refs):
        torch.testing.assert_close(out[i], m(x[i]), atol=1e-6, rtol=1e-6)
    assert all(p.dtype == torch.float32 for m in models for p in m.parameters())  # the members untouched


def _scale_every_tensor_argument(module: nn.Module, args: tuple):
    if args and isinstance(args[0], torch.Tensor):
        return (args[0] * 1.5, *args[1:])
    return None


def _double_every_tensor_output(module: nn.Module, args: tuple, out):
    return out * 2 if isinstance(out, torch.Tensor) else None


@pytest.mark.parametrize("register", ["pre", "post"])
def test_a_global_hook_on_every_module_applies_once_per_module(register: str) -> None:
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).double() for _ in range(2)]
    handle = (register_module_forward_pre_hook(_scale_every_tensor_argument) if register == "pre"
              else register_module_forward_hook(_double_every_tensor_output))
    try:
        wide = wc.compile(models, torch.randn(3, 4, dtype=torch.float64), config=wc.WideConfig.fast())
        x = torch.randn(2, 3, 4, dtype=torch.float64)
        out = wide(x)
        for i, m in enumerate(models):
            torch.testing.assert_close(out[i], m(x[i]))  # the root's hook once, as on the member alone
    finally:
        handle.remove()
    from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks
    assert not _global_forward_pre_hooks and not _global_forward_hooks  # the capture put the tables back
