"""Benchmark target ``sweep``: a size sweep (members that differ in width) fused by padding
(``wc.compile(models, sample, pad=True)``) against the members in a Python loop and against
``by_size``: one wide model per size, run one after the other (what grouping by program gives,
and what the router does without ``pad``). Every member has its own weights and its own input.
Records carry ``padding_overhead``: the padded program's parameter elements over the members' own,
minus one.

Example::

    >>> from wide_compiler import bench
    >>> sorted(bench.TARGETS["sweep"].presets)
    ['ci', 'full', 'quick']
"""
from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import measure
from ..measure import Contender
from ..config import WideConfig
from . import engine
from .registry import Job, Preset, target

__all__ = ["SweepCNN", "SweepMLP", "sweep_jobs"]


class SweepMLP(nn.Module):
    """``Linear(64, h) -> LayerNorm -> GELU -> Linear(h, h) -> GELU -> Linear(h, 10)``."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, hidden), nn.LayerNorm(hidden), nn.GELU(),
                                 nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class SweepCNN(nn.Module):
    """Conv(3, c) -> BatchNorm -> ReLU -> max pool -> Conv(c, 2c) -> GroupNorm(4) -> ReLU ->
    global average pool -> Linear(2c, 10)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.c1, self.bn = nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c)
        self.c2, self.gn = nn.Conv2d(c, 2 * c, 3, padding=1), nn.GroupNorm(4, 2 * c)
        self.fc = nn.Linear(2 * c, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn(self.c1(x))), 2)
        return self.fc(F.relu(self.gn(self.c2(x))).mean((2, 3)))


# case -> (member class, sizes (each size twice: 2 seeds), one member's input shape)
_WIDTHS = (32, 64, 96, 128, 160, 192, 224, 256)
_CASES: dict[str, tuple[Callable[[int], nn.Module], tuple[int, ...], tuple[int, ...]]] = {
    "mlp": (SweepMLP, _WIDTHS, (64, 64)),
    "mlp_batch8": (SweepMLP, _WIDTHS, (8, 64)),  # an RL critic's or a small-batch sweep's size
    "cnn": (SweepCNN, (8, 16, 24, 32), (16, 3, 16, 16)),
}
PRESETS = {
    "ci": Preset("MLP, 4 members (seconds)", 0.02, {"cases": ("mlp",), "sizes": 2}),
    "quick": Preset("MLP 8 widths x 2 seeds at batch 64 and 8, CNN 4 channel counts x 2 seeds", 0.3,
                    {"cases": ("mlp", "mlp_batch8", "cnn"), "sizes": None}),
    "full": Preset("the quick cases, timed longer", 1.0, {"cases": ("mlp", "mlp_batch8", "cnn"), "sizes": None}),
}


@target("sweep", presets=PRESETS,
        description="a size sweep fused by padding (pad=True) vs the loop and one wide model per size")
def sweep_jobs(p: Preset) -> list[Job]:
    return [Job(case, functools.partial(_run, case, p)) for case in p.grid["cases"]]


def _by_size(models: Sequence[nn.Module], sizes: Sequence[int], sample: torch.Tensor,
             config: WideConfig) -> Callable[[torch.Tensor], list[torch.Tensor]]:
    """One wide model per size, each on its members' rows of the input, one after the other."""
    import wide_compiler as wc

    groups: dict[int, list[int]] = {}
    for i, s in enumerate(sizes):
        groups.setdefault(s, []).append(i)
    wides = [(torch.tensor(idx), wc.compile([models[i] for i in idx], sample, config=config))
             for idx in groups.values()]
    order = torch.argsort(torch.cat([idx for idx, _ in wides]))

    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([w(x[idx]) for idx, w in wides])[order]

    forward.parameters = [q for _, w in wides for q in w.parameters()]  # type: ignore[attr-defined]
    forward.modules = [w for _, w in wides]  # type: ignore[attr-defined]
    return forward


def _run(case: str, p: Preset, machine: dict[str, Any]) -> list[dict[str, Any]]:
    import wide_compiler as wc

    make, widths, shape = _CASES[case]
    widths = widths[: p.grid["sizes"]] if p.grid["sizes"] else widths
    sizes = [w for w in widths for _ in range(2)]
    torch.manual_seed(0)
    members = [make(s) for s in sizes]
    n = len(members)
    x = torch.randn(n, *shape)
    config = WideConfig(tune_after_runs=0)  # measured at compile: the timed calls run the steady state
    padded = wc.compile([copy.deepcopy(m) for m in members], x[0], pad=True, config=config)
    by_size = _by_size([copy.deepcopy(m) for m in members], sizes, x[0], config)
    contenders = {"padded": Contender("padded", padded, list(padded.parameters()), "opaque"),
                  "by_size": Contender("by_size", by_size, by_size.parameters, "opaque"),
                  "loop": measure.loop_contender(members)}
    with torch.no_grad():
        want = torch.stack(contenders["loop"].forward(x))
        err = {k: float((contenders[k].forward(x) - want).abs().max()) for k in ("padded", "by_size")}
    overhead = padded._pad.overhead()["extra"]
    records = []
    for mode in measure.MODES:
        for m in (*members, padded, *by_size.modules):  # every contender in the mode timed
            m.train(mode == "train")
        steps = {k: measure.make_step(c, x, mode) for k, c in contenders.items()}
        wide = {"padded": steps.pop("padded")}
        wide_ms, base_ms, errors = measure.time_with_baselines(wide, steps, min_run_time=p.min_run_time)
        records.append(engine.make_record(
            base={"target": "sweep", "case": case, "n": n, "batch": shape[0], "dtype": "float32",
                  "shape": f"{make.__name__} sizes {'/'.join(map(str, widths))} x 2 seeds"},
            mode=mode, strategy="padded", wide_ms=wide_ms["padded"], baseline_ms=base_ms,
            max_abs_err=err["padded"], baseline_max_abs_err={"by_size": err["by_size"]}, errors=errors,
            machine=machine, padding_overhead=overhead))
    return records

