"""``benchmark rnn``: N recurrent networks (LSTM, GRU) as one time loop, against N separate
modules in a Python loop and ``torch.compile`` of that loop, inference and training.

``torch.func.vmap`` is run too but cannot batch ``aten::lstm``/``gru`` (no batching rule,
pytorch#105982): its error is recorded in each record's ``errors`` and the table shows it as
missing. Every member has its own weights and its own batch-first input ``[B, T, I]``. Wide
contenders: ``module:fused`` / ``module:loop`` (``wc.nn.WideLSTM``/``WideGRU.from_modules`` with
that strategy: one time loop for all members, or ATen's op per member) and ``compile:auto``
(``wc.compile`` of the member, strategy measured). Records as :mod:`.vision` (same fields).

Example::

    >>> from wide_compiler import bench
    >>> recs = bench.run("rnn", "ci")                          # doctest: +SKIP
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..ops import WIDE_OPS
from .registry import Preset
from .vision import Case, _randn, _vision_target

__all__ = ["PRESETS", "rnn_cases"]

PRESETS: dict[str, Preset] = {
    "ci": Preset("tiny: N=4, hidden 16, T=8 (seconds)", 0.01, {"ns": (4,), "size": "tiny"}),
    "quick": Preset("2-layer LSTM 64->128, T=32, B=16 and a GRU, N in 16 and 64 (minutes)", 0.2,
                    {"ns": (16, 64), "size": "small"}),
    "full": Preset("N in 4, 16, 64; hidden 64 and 256; T 32 and 128 (many minutes)", 0.2,
                   {"ns": (4, 16, 64), "size": "full"}),
}


class _Output(nn.Module):
    """A recurrent layer (a member's, or its wide form) whose forward returns the output sequence."""

    def __init__(self, rnn: nn.Module) -> None:
        super().__init__()
        self.rnn = rnn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


def _module(models: list[nn.Module], strategy: str) -> nn.Module:
    import wide_compiler as wc

    cls = wc.nn.WideLSTM if isinstance(models[0].rnn, nn.LSTM) else wc.nn.WideGRU
    return _Output(cls.from_modules([m.rnn for m in models], strategy=strategy))


def _case(kind: str, layers: int, hidden: int, t: int, batch: int, features: int = 64) -> Case:
    cls: Callable[..., nn.Module] = nn.LSTM if kind == "lstm" else nn.GRU
    return Case("rnn", f"{kind}{layers}_h{hidden}_t{t}", f"{layers}x{kind.upper()} {features}->{hidden} T={t} B={batch}",
                lambda: _Output(cls(features, hidden, num_layers=layers, batch_first=True)),
                _randn(t, features), batch, _module, module_strategies=WIDE_OPS["rnn"].strategies,
                baselines=("loop", "compile_loop", "vmap"))


@_vision_target("rnn", "LSTM and GRU layers: one time loop for all members", PRESETS)
def rnn_cases(size: str) -> list[Case]:
    """The README's point (2-layer LSTM 64->128, T=32, B=16) and a GRU; ``full`` adds the grid
    hidden {64, 256} x T {32, 128}."""
    if size == "tiny":
        return [_case("lstm", 2, 16, 8, 4, features=8), _case("gru", 1, 16, 8, 4, features=8)]
    if size == "small":
        return [_case("lstm", 2, 128, 32, 16), _case("gru", 1, 128, 32, 16)]
    return [_case(kind, 2, h, t, 16) for kind in ("lstm", "gru") for h in (64, 256) for t in (32, 128)]
