"""``benchmark mlp``: an MLP ensemble (three ``nn.Linear`` of one width with ReLUs, as RL critic
ensembles and sweeps run them) from N=16 up to N=256 members, inference and training: the rate each
contender achieves (``gflops_per_s``) against the machine's GEMM peak in the same dtype and on the
same device (``peak_gflops``: one large square ``torch.mm``), beside the loop and vmap. Records as
:mod:`.vision` (same fields); ``format_records`` prints the rates and their share of the peak.

Widths: 512 with a batch of 256 on a GPU (``--device cuda``), 128 with a batch of 64 on the CPU
(the CPU's peak is reached at these sizes; a GPU's needs more work per call).

Example::

    >>> from wide_compiler import bench
    >>> recs = bench.run("mlp", "ci")                          # doctest: +SKIP
"""
from __future__ import annotations

from torch import nn

from . import engine
from .registry import Preset
from .vision import Case, _randn, _vision_target

__all__ = ["PRESETS", "mlp_cases"]

PRESETS: dict[str, Preset] = {
    "ci": Preset("tiny: N=4, width 32 (seconds)", 0.01, {"ns": (4,), "size": "tiny"}),
    "quick": Preset("width 512, batch 256 on a GPU (128, 64 on the CPU); N in 16, 64, 256 (minutes)", 0.2,
                    {"ns": (16, 64, 256), "size": "small"}),
    "full": Preset("as quick, N in 4, 16, 64, 256, 1024 (many minutes)", 0.2,
                   {"ns": (4, 16, 64, 256, 1024), "size": "small"}),
}


def _mlp(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, width))


@_vision_target("mlp", "an MLP ensemble up to N=256: achieved GFLOP/s against the GEMM peak", PRESETS)
def mlp_cases(size: str) -> list[Case]:
    """One case: the width and batch of ``size`` on the benchmark's device."""
    gpu = engine.DEVICE.type == "cuda"
    width, batch = {"tiny": (32, 8), "small": (512, 256) if gpu else (128, 64)}[size]
    return [Case("mlp", f"mlp_w{width}", f"3x Linear({width}, {width}), B={batch}",
                 lambda: _mlp(width), _randn(width), batch)]
