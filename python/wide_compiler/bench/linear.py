"""``benchmark linear``: ``torch.ops.wide.linear`` against the ways a user runs N ``nn.Linear``.

Cases (each member has its own weights; ``case="separate"``: its own input ``x[i]``):

- wide: ``torch.ops.wide.linear`` with ``strategy`` ``"auto"``, ``"bmm"`` and ``"loop"``, called as
  ``wc.nn.WideLinear`` calls it (``wide_compiler.functional.linear``: the call and its backward
  in the wide caching allocator, Note [Page faults on wide activations]); in
  presets quick/full also ``"tuned"`` (the op with the strategy the tuner of ``wc.compile``
  picks, fresh, no disk cache; ``chosen_strategy`` in the record) and ``"wc.compile"`` (the
  compiled ``WideModel`` itself: the same op plus the model's per-call overhead);
- baselines: ``loop`` (N ``nn.Linear`` in a Python loop), ``vmap`` (``torch.func`` ensembling),
  and in preset ``full`` ``compile_loop`` (``torch.compile`` of the loop);
- ``case="shared"``: one batch for all members, ``x.expand(N, B, I)``, which the op runs as ONE
  GEMM against the weights concatenated on the output dim; its roofline baseline ``gemm`` is one
  plain ``torch.addmm`` of ``[B, I] x [I, N*O]`` (the same FLOPs), so ``speedup["gemm"]`` is the
  fraction of the roofline reached.

Example::

    >>> from wide_compiler import bench
    >>> recs = bench.run("linear", "ci")                     # doctest: +SKIP
    >>> print(bench.format_records("linear", recs))          # doctest: +SKIP
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .. import functional as WF
from .. import measure
from ..measure import Contender
from ..ops import WIDE_OPS
from . import engine
from .registry import Job, Preset, target

__all__ = ["PRESETS", "STRATEGIES", "LinearCase", "build_case", "jobs", "run_case"]

log = logging.getLogger(__name__)

STRATEGIES = WIDE_OPS["linear"].choices  # ("auto", "bmm", "bmm_t", "loop")


@dataclasses.dataclass(frozen=True)
class LinearCase:
    """One population of N ``nn.Linear(in_features, out_features)`` fed ``[N, batch, in]``."""

    n: int
    batch: int
    in_features: int
    out_features: int
    dtype: torch.dtype = torch.float32
    shared: bool = False

    def base(self) -> dict[str, Any]:
        return {"target": "linear", "case": "shared" if self.shared else "separate",
                "n": self.n, "batch": self.batch, "in_features": self.in_features,
                "out_features": self.out_features, "dtype": str(self.dtype).removeprefix("torch.")}


def _grid(ns: Sequence[int], layers: Sequence[tuple[int, int]], batch: int, shared: bool
          ) -> tuple[LinearCase, ...]:
    return tuple(LinearCase(n, batch, i, o, shared=shared) for i, o in layers for n in ns)


_HEADLINE = LinearCase(64, 32, 64, 128)
_SMALL, _LARGE = (64, 128), (512, 1024)

PRESETS: dict[str, Preset] = {
    "ci": Preset(
        "tiny smoke run (seconds)", 0.02,
        {"cases": _grid((4, 16), [(16, 32)], 8, False) + (LinearCase(16, 8, 16, 32, shared=True),),
         "tuned": False, "compile_loop": False}),
    "quick": Preset(
        "headline: N=64, B=32, Linear 64->128, float32, + shared input (< 1 min)", 0.5,
        {"cases": (_HEADLINE, dataclasses.replace(_HEADLINE, shared=True)),
         "tuned": True, "compile_loop": False}),
    "full": Preset(
        "N in 4,16,64,256 x Linear 64->128 and 512->1024, B=32 (a few minutes)", 0.2,
        {"cases": _grid((4, 16, 64, 256), [_SMALL, _LARGE], 32, False)
         + _grid((4, 16, 64, 256), [_SMALL, _LARGE], 32, True),
         "tuned": True, "compile_loop": True}),
}


def build_case(case: LinearCase, *, seed: int = 0
               ) -> tuple[list[nn.Linear], torch.Tensor, list[torch.Tensor]]:
    """The members (each its own init), the N-first input and the stacked ``[W, b]`` leaves.

    >>> models, x, (W, b) = build_case(LinearCase(3, 2, 8, 4))
    >>> x.shape, W.shape, b.shape
    (torch.Size([3, 2, 8]), torch.Size([3, 4, 8]), torch.Size([3, 4]))
    """
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    models = [engine.to_device(nn.Linear(case.in_features, case.out_features, dtype=case.dtype))
              for _ in range(case.n)]
    if case.shared:
        x0 = engine.to_device(torch.randn(case.batch, case.in_features, generator=g, device=g.device, dtype=case.dtype))
        x = x0.expand(case.n, *x0.shape)
    else:
        x = engine.to_device(torch.randn(case.n, case.batch, case.in_features, generator=g, device=g.device, dtype=case.dtype))
    return models, x, measure.stacked_params(models)


def _op_contender(strategy: str, W: torch.Tensor, b: torch.Tensor) -> Contender:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return WF.linear(x, W, b, strategy=strategy)

    return Contender(strategy, forward, [W, b])


def _gemm_roofline(models: Sequence[nn.Linear]) -> Contender:
    # [N*O, I] and [N*O]: one GEMM computing every member's output for one shared batch.
    Wcat = torch.cat([m.weight.detach() for m in models]).requires_grad_()
    bcat = torch.cat([m.bias.detach() for m in models]).requires_grad_()

    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(bcat, x[0], Wcat.t())

    return Contender("gemm", forward, [Wcat, bcat], "opaque")


def _tuned_contenders(models: Sequence[nn.Linear], x: torch.Tensor, W: torch.Tensor,
                      b: torch.Tensor) -> tuple[list[Contender], str | None]:
    """``"tuned"``: the op with the strategy ``wc.compile``'s tuner picks for this population;
    ``"wc.compile"``: the compiled :class:`~wide_compiler.WideModel` itself (the same op plus the
    model's per-call overhead). Returns ``([], None)`` when ``wc.compile`` is not available."""
    import wide_compiler as wc

    if not hasattr(wc, "compile"):
        log.info("wide_compiler.compile is not available: no 'tuned' rows")
        return [], None
    # Fresh measurement (no disk cache): what a first compile on this machine picks.
    wide = wc.compile(list(models), x[0], config=wc.WideConfig(tune=True, cache=False, tune_after_runs=0))
    chosen = sorted(set(wide.strategies.values()))
    if len(chosen) != 1:
        raise RuntimeError(f"expected one wide op with one strategy, got {wide.strategies}")
    tuned = _op_contender(chosen[0], W, b)
    tuned.name = "tuned"
    model = Contender("wc.compile", wide, measure.wide_params_in_member_order(wide, models[0]))
    return [tuned, model], chosen[0]


def run_case(case: LinearCase, *, modes: Sequence[str] = measure.MODES,
             strategies: Sequence[str] = STRATEGIES, tuned: bool = False,
             compile_loop: bool = False, min_run_time: float = 0.2,
             machine: dict[str, Any] | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """Records of one case, for every mode (one record per wide contender and mode)."""
    models, x, (W, b) = build_case(case, seed=seed)
    machine = machine or measure.machine_info()
    if case.shared:
        # A stride-0 input always takes the shared path, whatever the strategy: time it once.
        wides = [_op_contender("auto", W, b)]
        baselines = [measure.loop_contender(models), measure.vmap_contender(models, shared=True),
                     _gemm_roofline(models)]
    else:
        wides = [_op_contender(s, W, b) for s in strategies]
        baselines = [measure.loop_contender(models), measure.vmap_contender(models)]
    extra_errors: dict[str, str] = {}
    chosen = None
    if tuned:
        try:
            more, chosen = _tuned_contenders(models, x, W, b)
            # A stride-0 input takes the shared path whatever the strategy: "tuned" == "auto".
            wides += [c for c in more if not (case.shared and c.name == "tuned")]
        except Exception as e:  # noqa: BLE001 (reported in the records, the run goes on)
            log.warning("tuned (wc.compile) failed: %s", e)
            extra_errors["wc.compile"] = measure.error_text(e)

    records = []
    for mode in modes:
        bl = list(baselines)
        if compile_loop and not case.shared:
            bl.append(measure.compiled_loop_contender(models))
        recs = engine.run_case(models, x, wides, bl, mode=mode, base=case.base(),
                               min_run_time=min_run_time, machine=machine)
        for r in recs:
            if case.shared:
                r["path"] = "shared"
            if r["strategy"] in ("tuned", "wc.compile"):
                r["chosen_strategy"] = chosen
            r["errors"].update(extra_errors)
        records += recs
    return records


@target("linear", presets=PRESETS, devices=("cpu", "cuda"),
        description="torch.ops.wide.linear per strategy vs loop / vmap / GEMM roofline")
def jobs(p: Preset) -> list[Job]:
    """One job per case of ``p.grid["cases"]`` (``tuned``, ``compile_loop``: see :func:`run_case`).

    >>> [j.label for j in jobs(PRESETS["ci"])]
    ['separate N=4 16->32', 'separate N=16 16->32', 'shared N=16 16->32']
    """
    return [Job(f"{case.base()['case']} N={case.n} {case.in_features}->{case.out_features}",
                functools.partial(_run_job, case, p))
            for case in p.grid["cases"]]


def _run_job(case: LinearCase, p: Preset, machine: dict[str, Any]) -> list[dict[str, Any]]:
    return run_case(case, tuned=p.grid.get("tuned", False),
                    compile_loop=p.grid.get("compile_loop", False),
                    min_run_time=p.min_run_time, machine=machine)
