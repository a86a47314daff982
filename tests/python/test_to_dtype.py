"""``wide.to(dtype)`` when the forward cannot be captured in the new dtype (Note [A graph runs in
the dtype it was captured in], model.py): the conversion completes (nothing half-changed), says
why with one warning, the next call raises the capture's error, and converting back runs again.
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
