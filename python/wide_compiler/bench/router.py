"""Benchmark target ``router``: :class:`~wide_compiler.WideRouter.wide_forward` over a collective
of towers of 1-3 architectures (MLPs of different widths, equal numbers of towers each) against
calling the towers in a Python loop and against ``torch.func.vmap`` over each architecture's
aligned towers (one vmap per group, as a user of vmap ensembling would write it). Every tower has
its own weights; all read one shared input, as in a collective. ``inference``: forward under
``no_grad``; ``train``: forward + ``.backward()`` of the sum of outputs into every parameter's
cleared ``.grad``, as a training loop runs it. ``max_abs_err``: the router's outputs against the
loop's, tower by tower.

Example::

    >>> from wide_compiler import bench
    >>> sorted(bench.TARGETS["router"].presets)
    ['ci', 'full', 'quick']
"""
from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import measure
from ..config import WideConfig
from ..router import Tower, WideRouter
from . import engine
from .registry import Job, Preset, target

__all__ = ["MLPTower", "router_jobs"]

PRESETS = {
    "ci": Preset("8 towers, 1 architecture (seconds)", 0.02, {"towers": (8,), "archs": (1,)}),
    "quick": Preset("8 and 32 towers in 1 and 3 architectures", 0.2, {"towers": (8, 32), "archs": (1, 3)}),
    "full": Preset("8-64 towers in 1-3 architectures (minutes)", 0.2,
                   {"towers": (8, 16, 32, 64), "archs": (1, 2, 3)}),
}
_WIDTHS = (64, 128, 256)  # hidden width of architecture k
_BATCH, _IN, _OUT = 32, 64, 16


class MLPTower(Tower):
    """A tower: ``Linear(64, width) -> GELU -> Linear(width, 16)``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(_IN, width), nn.GELU(), nn.Linear(width, _OUT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@target("router", presets=PRESETS,
        description="WideRouter.wide_forward over towers of 1-3 architectures vs loop / vmap per group")
def router_jobs(p: Preset) -> list[Job]:
    return [Job(f"{t} towers/{a} archs", functools.partial(_run, t, a, p))
            for t in p.grid["towers"] for a in p.grid["archs"]]


def _vmap_groups(groups: list[list[nn.Module]]
                 ) -> tuple[Callable[[torch.Tensor], list[torch.Tensor]], list[torch.Tensor]]:
    """One ``torch.func`` vmap per architecture group (:func:`wide_compiler.measure.vmap_contender`
    with one input shared by the towers); returns ``(call(x), stacked params)``."""
    vmaps = [measure.vmap_contender(towers, shared=True) for towers in groups]
    return (lambda x: [v.forward(x.unsqueeze(0)) for v in vmaps]), [t for v in vmaps for t in v.params]


def _run(towers: int, archs: int, p: Preset, machine: dict[str, Any]) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    per = towers // archs
    groups = [[MLPTower(_WIDTHS[k]) for _ in range(per)] for k in range(archs)]
    members = [t for g in groups for t in g]
    names = [f"t{i}" for i in range(len(members))]
    router = WideRouter(config=WideConfig.fast())
    for name, t in zip(names, copy.deepcopy(members)):
        router.attach(name, t)
    router.discover_towers()
    x = torch.randn(_BATCH, _IN)
    router.prepare_for_compile(x)
    vmapped, vmap_params = _vmap_groups(groups)
    loop_params = [q for t in members for q in t.parameters()]
    with torch.no_grad():
        got = router.wide_forward(x)
        want = [t(x) for t in members]
    err = max(float((got[n] - w).abs().max()) for n, w in zip(names, want))

    def steps(mode: str) -> dict[str, Callable[[], Any]]:
        fns = {"wide": lambda: list(router.wide_forward(x).values()), "loop": lambda: [t(x) for t in members],
               "vmap": lambda: vmapped(x)}
        params = {"wide": list(router.parameters()), "loop": loop_params, "vmap": vmap_params}
        if mode == "inference":
            return {k: (lambda f=f: _no_grad(f)) for k, f in fns.items()}
        return {k: (lambda f=f, ps=params[k]: measure.stored_grads(sum(o.sum() for o in f()), ps))
                for k, f in fns.items()}

    records = []
    for mode in measure.MODES:
        fns = steps(mode)
        wide = {"wide": fns.pop("wide")}  # timed with the baselines, interleaved
        wide_ms, base_ms, errors = measure.time_with_baselines(wide, fns, min_run_time=p.min_run_time)
        records.append(engine.make_record(
            base={"target": "router", "case": f"{towers} towers/{archs} archs", "n": towers, "batch": _BATCH,
                  "dtype": "float32", "shape": f"MLP {_IN}-{'/'.join(map(str, _WIDTHS[:archs]))}-{_OUT}"},
            mode=mode, strategy="wide_forward", wide_ms=wide_ms["wide"], baseline_ms=base_ms,
            max_abs_err=err, errors=errors, machine=machine))
    return records


def _no_grad(fn: Callable[[], Any]) -> Any:
    with torch.no_grad():
        return fn()

