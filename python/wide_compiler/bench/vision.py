"""``benchmark conv|norm|pool|embedding|models``: vision, audio and tabular layers and whole models
(the models of :mod:`.vision_models`: vision, audio, tabular, a transformer encoder layer, Flux
blocks; DESIGN §10), float32 eager, ``inference`` (forward under ``no_grad``) and ``train`` (forward,
sum of the outputs, gradients of every parameter).

Every member has its own weights and its own input (``[N, B, ...]``, member ``i`` reads
``x[i]``). Wide contenders (the record's ``strategy``):

- ``module:<s>`` / ``module``: the hand-built wide module (``wc.nn.WideConv2d`` /
  ``WideConvTranspose2d`` with strategy ``grouped`` or ``loop``, ``WideBatchNorm2d``,
  ``WideLayerNorm``, ``WideGroupNorm``, ``WideInstanceNorm2d``, ``WideRMSNorm``,
  ``WideEmbedding``, ``WideEmbeddingBag``; in ``models``, the Flux blocks'
  ``wide_compiler.blocks.Wide*StreamBlock``);
- ``compile:auto``: ``wc.compile`` with measured strategies (``tune=True``, fresh: no disk
  cache), i.e. what a first compile on this machine picks. ``chosen_strategy`` summarises
  ``WideModel.strategies`` (e.g. ``"7 grouped, 1 bmm"``), ``strategies`` has them per node and
  ``tuned_ms`` the tuner's timings per node (as in ``WideModel.summary()``), ``compile_s`` the
  seconds of ``wc.compile`` plus the first call in the record's mode (capture, widen, tune);
- ``compile:fast`` (models): ``wc.WideConfig.fast()``, the heuristic strategies
  (grouped convs, bmm linears), no timing at compile time;
- ``compile:loop`` (models, preset full): every wide op forced to its per-member loop.

Baselines: ``loop`` (N separate modules in a Python loop) and ``vmap`` (``torch.func``:
``stack_module_state`` + ``functional_call`` + ``vmap``, ``randomness="different"``). A baseline
that cannot run a case (e.g. vmap of a module that updates buffers in place) is left out of
``baseline_ms`` and its message goes to ``errors``; so does a ``wc.compile`` that fails.

Module state: ``norm`` runs BatchNorm in training mode (batch statistics, running stats
updated) in both modes; ``models`` runs members in ``eval()`` for ``inference`` and ``train()``
for ``train``; buffers are reset to the members' initial values before each mode.

Records are :mod:`.engine` records (``engine.RECORD_KEYS``) plus ``shape`` (the layer or model,
for the table), ``chosen_strategy`` (with "; tiles of k" when the graph runs in member tiles:
Note [Member tiles]), ``member_tile``, ``strategies``, ``tuned_ms``, ``compile_s``,
``fallbacks`` (ops the compiled graph runs per member), ``warnings`` (e.g. vmap's "performance
drop" for an op without a batching rule) and ``preset``.

Reading the numbers: ``max_abs_err`` in train mode can reach 1e-3..1e-2 on a conv weight
gradient in front of a max-pool (e.g. the ResNet stem) when two window values differ by one
float32 rounding: the argmax flips and the gradient moves to the other position (checked against
float64 members; ``vmap`` shows the same). Big single allocations of the wide ops (one
``[B, N*C, H, W]`` output or workspace instead of N small ones) can cost page faults on every call
with glibc malloc's defaults (``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` or jemalloc
change that), and ``compile:*`` returns contiguous outputs (one more copy than ``module``).

Each target is its case builder (``conv_cases`` ...) decorated with ``_vision_target``: one job
per case and N (presets :data:`PRESETS`; ``models``: :data:`MODEL_PRESETS`).

Example::

    >>> from wide_compiler import bench
    >>> recs = bench.run("conv", "ci")                        # doctest: +SKIP
    >>> print(bench.format_records("conv", recs))             # doctest: +SKIP
"""
from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import gc
import logging
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .. import measure
from ..measure import Contender
from ..ops import LOOP, WIDE_OPS
from . import engine
from .registry import Job, Preset, jobs_per_n, target
from .vision_models import MODELS

__all__ = ["MODEL_PRESETS", "PRESETS", "Case", "conv_cases", "embedding_cases", "format_rates", "format_records",
           "model_cases", "norm_cases", "pool_cases", "run_case"]

log = logging.getLogger(__name__)

Inputs = tuple[torch.Tensor, ...]


@dataclasses.dataclass(frozen=True)
class Case:
    """One population: ``make()`` builds one member, ``inputs(lead, g)`` its inputs (a tuple)
    with leading dims ``lead`` (``(N, B)`` for the wide input).

    ``module(models, strategy)`` builds the hand-built wide module (None: none), once per entry
    of ``module_strategies`` (``""``: the module has no strategy). ``compile`` lists the
    ``wc.compile`` variants (``"auto"``, ``"fast"``, ``"loop"``). ``train_state``: the members'
    ``training`` flag in every mode (None: ``train()`` in mode train, ``eval()`` in inference).
    ``check(models, inputs, mode)``, when given, returns the ``check`` of :func:`.engine.run_case`
    (how a result is compared with the members when it cannot equal the loop's, e.g. dropout).
    """

    target: str
    name: str
    shape: str
    make: Callable[[], nn.Module]
    inputs: Callable[[tuple[int, ...], torch.Generator], Inputs]
    batch: int
    module: Callable[[list[nn.Module], str], nn.Module] | None = None
    module_strategies: tuple[str, ...] = ("",)
    compile: tuple[str, ...] = ("auto",)
    train_state: bool | None = None
    baselines: tuple[str, ...] = ("loop", "vmap")  # also "compile_loop", "compile_vmap", "loop_cl" (channels-last)
    check: Callable[[list[nn.Module], Inputs, str], Callable[[Contender, Any], float]] | None = None
    #: the ``size`` its target's builder made it for (set by the registry's jobs; the ``processes``
    #: baseline builds the case again by name in each process)
    size: str = ""


PRESETS: dict[str, Preset] = {  # conv, norm, pool, embedding
    "ci": Preset("tiny shapes, N=4 (seconds)", 0.01, {"ns": (4,), "size": "tiny"}),
    "quick": Preset("moderate shapes, N=16 (< 2 min per target)", 0.2,
                    {"ns": (16,), "size": "small"}),
    "full": Preset("moderate shapes, N in 4, 16, 64 (minutes per target)", 0.2,
                   {"ns": (4, 16, 64), "size": "small"}),
}
#: ``models``: also the ``wc.compile`` variants to time (``compile_variants``, see ``_CONFIGS``).
MODEL_PRESETS: dict[str, Preset] = {
    "ci": Preset("tiny models, N=4 (seconds)", 0.01,
                 {"ns": (4,), "size": "tiny", "compile_variants": ("auto",)}),
    "quick": Preset("small models, N=16, compile auto and fast (minutes)", 0.6,
                    {"ns": (16,), "size": "small", "compile_variants": ("auto", "fast")}),
    "full": Preset("small models, N in 4, 16, 64, compile auto, fast and loop (many minutes)",
                   0.2, {"ns": (4, 16, 64), "size": "small",
                         "compile_variants": ("auto", "fast", "loop")}),
}

#: A set of members at least this large (parameters and buffers) is collected after each mode
#: (Note [Collect after a mode only at real sizes]).
COLLECT_BYTES = 64 << 20

# Note [Collect after a mode only at real sizes]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# run_case drops a mode's copies, wide contenders and baselines before the next mode makes its
# own, and a full gc.collect() frees what reference cycles (compiled graphs, autograd state) still
# hold: at real sizes (GPT-2 at N=4: 2 GB per set of members) two modes' worth do not fit in
# memory. The collection walks the whole heap of the process (torch, transformers, every graph
# compiled so far): 0.3-1 s a call, for nothing at the ``ci`` preset's toy sizes (kilobytes of
# members; the test suite ran ~60 of them). So it runs only when one set of members holds at least
# COLLECT_BYTES; below that Python's own generational collection is left to it.


def _state_bytes(models: Sequence[nn.Module]) -> int:
    """Bytes of the members' parameters and buffers (one set of members)."""
    return sum(t.numel() * t.element_size() for m in models for t in (*m.parameters(), *m.buffers()))


_CONFIGS = {
    "auto": lambda wc: wc.WideConfig(tune=True, cache=False),
    "fast": lambda wc: wc.WideConfig.fast(),
    "loop": lambda wc: wc.WideConfig(strategy="loop", tune=False),
}


# ---------------------------------------------------------------------------------- targets

def _jobs(cases: Callable[[str], list[Case]], p: Preset) -> list[Job]:
    """One job per case of ``cases(p.grid["size"])`` and N of ``p.grid["ns"]``."""
    size = p.grid["size"]
    return jobs_per_n(_run_job, [dataclasses.replace(c, size=size) for c in cases(size)], p,
                      label=lambda case: case.name)


#: The case builders of the vision targets, by target name (:func:`case_by_name`).
_BUILDERS: dict[str, Callable[[str], list[Case]]] = {}


def case_by_name(target: str, size: str, name: str) -> Case:
    """The case ``name`` of vision target ``target`` at ``size`` (as its jobs make it)."""
    for case in _BUILDERS[target](size):
        if case.name == name:
            return dataclasses.replace(case, size=size)
    raise KeyError(f"benchmark {target}: no case {name!r} at size {size!r}")


def _run_job(case: Case, n: int, p: Preset, machine: dict[str, Any]) -> list[dict[str, Any]]:
    return run_case(case, n, compile_variants=p.grid.get("compile_variants"),
                    min_run_time=p.min_run_time, machine=machine)


def format_records(records: Sequence[dict[str, Any]], *, header: bool = True) -> str:
    """:func:`engine.format_table` with the strategy ``compile:auto`` shown with what it chose
    (``compile:auto[loop]``), then the compile warnings/fallbacks worth knowing."""
    shown = []
    for r in records:
        r = dict(r)
        if r.get("strategy", "").startswith("compile:") and r.get("chosen_strategy"):
            r["strategy"] = f"{r['strategy']}[{r['chosen_strategy']}]"
        shown.append(r)
    out = [engine.format_table(shown, header=header)]
    fallbacks = sorted({f"{r['case']}: {fb}" for r in records for fb in r.get("fallbacks") or ()})
    if fallbacks:
        out.append("per-member fallbacks in the compiled graph: " + "; ".join(fallbacks))
    slow = sorted({f"{r['case']}: {w}" for r in records for w in r.get("warnings") or ()
                   if "performance drop" in w})
    for w in slow:
        out.append(f"warning: {w}")
    out += format_rates(records)
    return "\n".join(out)


def _vision_target(name: str, description: str, presets: dict[str, Preset] = PRESETS
                   ) -> Callable[[Callable[[str], list[Case]]], Callable[[str], list[Case]]]:
    """Register the decorated case builder ``cases(size)`` as benchmark target ``name``: one job
    per case and N (:func:`.registry.target`); returns the builder unchanged."""
    def register(cases: Callable[[str], list[Case]]) -> Callable[[str], list[Case]]:
        target(name, presets=presets, formatter=format_records, description=description,
               devices=("cpu", "cuda"))(functools.partial(_jobs, cases))
        _BUILDERS[name] = cases
        return cases
    return register


# ------------------------------------------------------------------------------------ cases

def _randn(*shape: int) -> Callable[[tuple[int, ...], torch.Generator], Inputs]:
    return lambda lead, g: (torch.randn(*lead, *shape, generator=g, device=g.device),)


def _randint(high: int, *shape: int) -> Callable[[tuple[int, ...], torch.Generator], Inputs]:
    return lambda lead, g: (torch.randint(0, high, (*lead, *shape), generator=g, device=g.device),)


def _conv_module(models: list[nn.Module], strategy: str) -> nn.Module:
    import wide_compiler as wc

    cls = wc.nn.WideConvTranspose2d if isinstance(models[0], nn.ConvTranspose2d) else wc.nn.WideConv2d
    return cls.from_modules(models, strategy=strategy)


def _from_modules(cls_name: str) -> Callable[[list[nn.Module], str], nn.Module]:
    def build(models: list[nn.Module], strategy: str) -> nn.Module:
        import wide_compiler as wc

        return getattr(wc.nn, cls_name).from_modules(models)
    return build


@_vision_target("conv", "Conv2d small/medium/depthwise/pointwise and ConvTranspose2d")
def conv_cases(size: str) -> list[Case]:
    """Conv2d small / medium / depthwise / pointwise 1x1 (not tiny), and a ConvTranspose2d."""
    tiny = size == "tiny"
    b, hw = (2, 8) if tiny else (8, 16)
    specs = [  # name, module factory, C_in, spatial size
        ("conv3x3_small", lambda: nn.Conv2d(3, 8, 3, padding=1), 3, hw) if tiny else
        ("conv3x3_small", lambda: nn.Conv2d(16, 32, 3, padding=1), 16, 32),
        ("conv3x3_medium", lambda: nn.Conv2d(8, 8, 3, padding=1), 8, hw) if tiny else
        ("conv3x3_medium", lambda: nn.Conv2d(64, 64, 3, padding=1), 64, 16),
        ("depthwise3x3", lambda: nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False), 8, hw) if tiny
        else ("depthwise3x3", lambda: nn.Conv2d(64, 64, 3, padding=1, groups=64, bias=False), 64, 16),
    ]
    if tiny:
        specs += [("convT4x4_s2", lambda: nn.ConvTranspose2d(8, 4, 4, 2, 1, bias=False), 8, 4)]
    else:
        specs += [("pointwise1x1", lambda: nn.Conv2d(64, 128, 1, bias=False), 64, 16),
                  ("convT4x4_s2", lambda: nn.ConvTranspose2d(32, 16, 4, 2, 1, bias=False), 32, 8)]
    out = []
    for name, make, cin, s in specs:
        m = make()
        shape = (f"{cin}->{m.out_channels} k{m.kernel_size[0]}"
                 f"{' g' + str(m.groups) if m.groups > 1 else ''} {s}x{s}")
        # the hand-built module with the op's default (grouped) and its loop; compile:auto measures all
        out.append(Case("conv", name, shape, make, _randn(cin, s, s), b, _conv_module,
                        (WIDE_OPS["conv"].default, LOOP)))
    return out


@_vision_target("norm", "BatchNorm2d (training), LayerNorm, GroupNorm, InstanceNorm2d, RMSNorm")
def norm_cases(size: str) -> list[Case]:
    """BatchNorm2d (training: batch statistics), LayerNorm, GroupNorm, InstanceNorm2d (affine),
    RMSNorm."""
    tiny = size == "tiny"
    b = 2 if tiny else 8
    c, hw = (8, 8) if tiny else (32, 16)
    t, d = (4, 16) if tiny else (64, 256)
    return [
        Case("norm", "batchnorm2d_train", f"C={c} {hw}x{hw}", lambda: nn.BatchNorm2d(c),
             _randn(c, hw, hw), b, _from_modules("WideBatchNorm2d"), train_state=True),
        Case("norm", "layernorm", f"T={t} D={d}", lambda: nn.LayerNorm(d), _randn(t, d), b,
             _from_modules("WideLayerNorm")),
        Case("norm", "groupnorm", f"G=4 C={c} {hw}x{hw}", lambda: nn.GroupNorm(4, c),
             _randn(c, hw, hw), b, _from_modules("WideGroupNorm")),
        Case("norm", "instancenorm2d", f"C={c} {hw}x{hw} affine", lambda: nn.InstanceNorm2d(c, affine=True),
             _randn(c, hw, hw), b, _from_modules("WideInstanceNorm2d")),
        Case("norm", "rmsnorm", f"T={t} D={d}", lambda: nn.RMSNorm(d), _randn(t, d), b,
             _from_modules("WideRMSNorm")),
    ]


@_vision_target("pool", "MaxPool2d / AvgPool2d / AdaptiveAvgPool2d in compiled tiny models")
def pool_cases(size: str) -> list[Case]:
    """MaxPool2d / AvgPool2d / AdaptiveAvgPool2d in a compiled tiny model: after a 1x1 conv (the pool runs
    on the channel-packed layout), before it (member dim folded into the batch), and the 1x1 conv
    alone (subtract it to see the pool)."""
    tiny = size == "tiny"
    b, c, hw = (2, 4, 8) if tiny else (8, 16, 32)
    specs = [
        ("conv1x1+maxpool2d", lambda: nn.Sequential(nn.Conv2d(c, c, 1), nn.MaxPool2d(2))),
        ("conv1x1+adaptiveavgpool2d", lambda: nn.Sequential(nn.Conv2d(c, c, 1), nn.AdaptiveAvgPool2d(2))),
        ("conv1x1+avgpool2d", lambda: nn.Sequential(nn.Conv2d(c, c, 1), nn.AvgPool2d(2))),
        ("maxpool2d+conv1x1", lambda: nn.Sequential(nn.MaxPool2d(2), nn.Conv2d(c, c, 1))),
        ("conv1x1 (no pool)", lambda: nn.Sequential(nn.Conv2d(c, c, 1))),
    ]
    return [Case("pool", name, f"C={c} {hw}x{hw}", make, _randn(c, hw, hw), b) for name, make in specs]


@_vision_target("embedding", "Embedding and EmbeddingBag (sum, mean)")
def embedding_cases(size: str) -> list[Case]:
    """Embedding lookups and EmbeddingBag (sum, fixed-size bags) on per-member indices."""
    tiny = size == "tiny"
    b, l, v, d = (2, 3, 10, 4) if tiny else (32, 16, 1000, 32)
    return [
        Case("embedding", "embedding", f"V={v} D={d} L={l}", lambda: nn.Embedding(v, d),
             _randint(v, l), b, _from_modules("WideEmbedding")),
        Case("embedding", "embedding_bag_sum", f"V={v} D={d} bag={l}",
             lambda: nn.EmbeddingBag(v, d, mode="sum"), _randint(v, l), b,
             _from_modules("WideEmbeddingBag")),
        Case("embedding", "embedding_bag_mean", f"V={v} D={d} bag={l}",
             lambda: nn.EmbeddingBag(v, d, mode="mean"), _randint(v, l), b,
             _from_modules("WideEmbeddingBag")),
    ]


@_vision_target("models", "whole vision, audio, tabular, transformer and Flux-block models: "
                "wc.compile (and the hand-built Flux blocks)",
                MODEL_PRESETS)
def model_cases(size: str) -> list[Case]:
    """The whole models of :mod:`.vision_models` (one case each)."""
    out = []
    for name, spec in MODELS.items():
        out.append(Case("models", name, f"{name}/{size}", lambda spec=spec: spec.make(size),
                        lambda lead, g, spec=spec: spec.inputs(lead, size, g), spec.batch[size],
                        spec.module, spec.module_strategies,
                        baselines=("loop", "loop_cl", "vmap") if spec.channels_last else ("loop", "vmap")))
    return out


# ------------------------------------------------------------------------------- contenders

def _strategy_summary(strategies: dict[str, str]) -> str:
    counts = collections.Counter(strategies.values())
    return ", ".join(f"{k} x{v}" if len(strategies) > 1 else k for k, v in counts.most_common())


def _reference(models: Sequence[nn.Module]) -> Contender:
    """The members' own results: a copy of the members where a forward can change their float
    buffers (BatchNorm's running statistics move in training), the members themselves otherwise
    (a copy of a real-size model costs its size again: ResNet-50 to GPT-2, N=4, 0.4-2 GB)."""
    mutable = any(b.is_floating_point() for b in models[0].buffers())
    return measure.loop_contender([copy.deepcopy(m) for m in models] if mutable else models, "reference")


def _reset_buffers(wide: nn.Module, members: Sequence[nn.Module]) -> None:
    """The wide model's stacked buffers := the members' (stacked by name)."""
    sd = wide.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, _ in members[0].named_buffers():
            if name in sd:
                sd[name].copy_(torch.stack([m.get_buffer(name) for m in members]))


# ---------------------------------------------------------------------------------- running

def _member_gflop(model: nn.Module, xs: Inputs, train: bool) -> float | None:
    """GFLOP of one member's call on its own input (forward, and backward in ``train``), as
    ``torch.utils.flop_counter`` counts them (matmuls and convolutions); None if it cannot."""
    from torch.utils._pytree import tree_leaves
    from torch.utils.flop_counter import FlopCounterMode

    try:
        m = copy.deepcopy(model)
        with FlopCounterMode(display=False) as counter, torch.set_grad_enabled(train):
            outs = [t for t in tree_leaves(m(*xs)) if isinstance(t, torch.Tensor) and t.requires_grad]
            if train and outs:
                sum(t.float().sum() for t in outs).backward()
        return counter.get_total_flops() / 1e9
    except Exception as e:  # noqa: BLE001 (a rate is extra information: the timing goes on)
        log.warning("%s: FLOPs not counted: %s", type(model).__name__, e)
        return None


def _add_processes(records: list[dict[str, Any]], case: Case, n: int, mode: str, min_run_time: float) -> None:
    """The ``processes`` baseline (:mod:`.processes`) of one case and mode into its records."""
    from .processes import processes_ms

    try:
        if not case.size:
            raise ValueError("the processes baseline needs a case of a target's jobs (it builds it by name)")
        ms = processes_ms(case.target, case.size, case.name, n, mode, str(engine.DEVICE),
                          steps=max(5, round(50 * min_run_time)))
    except Exception as e:  # noqa: BLE001 (a baseline that cannot run is a result: recorded)
        for r in records:
            r["errors"] = {**r["errors"], "processes": measure.error_text(e)}
        return
    for r in records:
        r["baseline_ms"] = {**r["baseline_ms"], "processes": ms}
        if r.get("wide_ms") and math.isfinite(r["wide_ms"]):
            r["speedup"] = {**(r.get("speedup") or {}), "processes": ms / r["wide_ms"]}


def _add_rates(r: dict[str, Any], gflop: float | None) -> None:
    """``gflop`` (all N members' FLOPs per call), the rate each contender achieved
    (``gflops_per_s``: ``"wide"`` and each baseline) and the machine's ``peak_gflops`` (its GEMM
    peak in the record's dtype on the benchmark's device)."""
    if not gflop:
        return
    times = {"wide": r.get("wide_ms"), **(r.get("baseline_ms") or {})}
    r["gflop"] = gflop
    r["gflops_per_s"] = {k: gflop / (ms / 1e3) for k, ms in times.items() if ms and math.isfinite(ms)}
    dtype = getattr(torch, str(r.get("dtype", "float32")).removeprefix("torch."), torch.float32)
    r["peak_gflops"] = measure.peak_gflops(device=str(engine.DEVICE), dtype=dtype)


def format_rates(records: Sequence[dict[str, Any]]) -> list[str]:
    """One line per record that has FLOPs: each contender's GFLOP/s and its share of the peak.

    >>> format_rates([{"case": "m", "n": 4, "mode": "train", "strategy": "compile:auto", "gflop": 2.0,
    ...                "gflops_per_s": {"wide": 20.0, "loop": 10.0}, "peak_gflops": 100.0}])
    ['m N=4 train compile:auto: 2 GFLOP per call; wide 20.0 GFLOP/s (20% of peak 100), loop 10.0 (10%)']
    """
    out = []
    for r in records:
        rates, peak = r.get("gflops_per_s"), r.get("peak_gflops")
        if not rates or not peak:
            continue
        parts = [f"{k} {v:.1f}" + (f" GFLOP/s ({v / peak:.0%} of peak {peak:.0f})" if not i else f" ({v / peak:.0%})")
                 for i, (k, v) in enumerate(rates.items())]
        out.append(f"{r['case']} N={r['n']} {r['mode']} {r['strategy']}: {r['gflop']:.3g} GFLOP per call; "
                   + ", ".join(parts))
    return out


def run_case(case: Case, n: int, *, modes: Sequence[str] = measure.MODES,
             compile_variants: Sequence[str] | None = None, min_run_time: float = 0.2,
             machine: dict[str, Any] | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """Records of one case at ``n`` members, every mode (one record per wide contender)."""
    import wide_compiler as wc

    machine = machine if machine is not None else measure.machine_info()
    torch.manual_seed(seed)
    master = [engine.to_device(case.make()) for _ in range(n)]
    g = torch.Generator().manual_seed(seed)
    xs = engine.to_device(case.inputs((n, case.batch), g))
    sample = tuple(t[0] for t in xs)
    base = {"target": case.target, "case": case.name, "batch": case.batch, "shape": case.shape,
            "dtype": "float32"}

    def _tuner_timings(wide, training: bool) -> dict:
        return {node: t for (mode, node), t in getattr(wide, "_timings", {}).items() if mode == training}

    compiled: dict[str, tuple[nn.Module, float]] = {}
    tuned: dict[tuple[str, bool], dict] = {}  # the tuner's timings per (contender, training)
    compile_errors: dict[str, str] = {}
    for variant in compile_variants if compile_variants is not None else case.compile:
        name = f"compile:{variant}"
        try:
            sw = measure.Stopwatch()
            wide = wc.compile([copy.deepcopy(m) for m in master], sample, config=_CONFIGS[variant](wc))
            compiled[name] = (wide, sw.seconds)
            # timed as a long run runs: its graphs measured (after their first runs by default:
            # Note [Tuning after the first runs] in tuning.py), not in the timed calls
            wide.tune()
            tuned[name, wide.training] = _tuner_timings(wide, wide.training)  # compile built this graph
        except Exception as e:  # noqa: BLE001 (a failed compile is a result: recorded)
            log.warning("%s/%s: wc.compile (%s) failed: %s", case.target, case.name, variant, e)
            compile_errors[name] = measure.error_text(e)

    records = []
    build_s: dict[tuple[str, str], float] = {}
    big = _state_bytes(master) >= COLLECT_BYTES
    for i, mode in enumerate(modes):
        training = case.train_state if case.train_state is not None else mode == "train"
        # The last mode times the master members themselves (one set of members less in memory).
        models = [(m if i == len(modes) - 1 else copy.deepcopy(m)).train(training) for m in master]
        wides = []
        for s in case.module_strategies if case.module is not None else ():
            module = case.module([copy.deepcopy(m) for m in models], s).train(training)
            wides.append(measure.wide_contender(f"module:{s}" if s else "module", module, models[0]))
        for name, (wide, seconds) in compiled.items():
            # The graph of a train/eval mode is captured, widened and tuned on its first call.
            wide.train(training)
            sw = measure.Stopwatch()
            with torch.set_grad_enabled(mode == "train"):
                wide(*xs)
            build_s[name, mode] = seconds + sw.seconds
            wide.tune()
            if (name, training) not in tuned:  # this call captured, widened and tuned the graph
                tuned[name, training] = _tuner_timings(wide, training)
            _reset_buffers(wide, master)
            wides.append(measure.wide_contender(name, wide, models[0]))
        gflop = _member_gflop(models[0], sample, mode == "train")
        gflop = gflop * n if gflop is not None else None
        makers = {"loop": lambda: measure.loop_contender(models),
                  "loop_cl": lambda: measure.loop_contender(models, channels_last=True),
                  "vmap": lambda: measure.vmap_contender(models, randomness="different"),
                  "compile_loop": lambda: measure.compiled_loop_contender(models),
                  "compile_vmap": lambda: measure.compiled_vmap_contender(models, randomness="different")}
        names = engine.BASELINES if engine.BASELINES is not None else case.baselines
        baselines = [makers[b]() for b in names if b != "processes"]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if wides:
                recs = engine.run_case(models, xs, wides, baselines, mode=mode, base=base,
                                       min_run_time=min_run_time, machine=machine,
                                       reference=_reference(models),
                                       check=case.check(models, xs, mode) if case.check else None)
            else:  # nothing wide could be built: one record that says why
                recs = [engine.make_record(base=dict(base, n=n), mode=mode, strategy="compile:auto",
                                           wide_ms=math.nan, baseline_ms={}, max_abs_err=math.nan,
                                           machine=machine)]
        notes = sorted({str(w.message).splitlines()[0][:200] for w in caught})
        if "processes" in names:
            _add_processes(recs, case, n, mode, min_run_time)
        for r in recs:
            _add_rates(r, gflop)
            r["errors"] = {**r["errors"], **compile_errors}
            r["warnings"] = notes
            if r["strategy"] in compiled:
                wide = compiled[r["strategy"]][0]
                strategies = dict(wide.strategies)
                r["strategies"] = strategies
                r["chosen_strategy"] = _strategy_summary(strategies) if strategies else None
                r["member_tile"] = wide._graph_for(training).member_tile  # Note [Member tiles]: 0 untiled
                if r["member_tile"]:
                    r["chosen_strategy"] = f"{r['chosen_strategy'] or ''}; tiles of {r['member_tile']}".lstrip("; ")
                r["tuned_ms"] = {k: v for k, v in tuned.get((r["strategy"], training), {}).items()
                                 if k in strategies and v}
                r["compile_s"] = build_s[r["strategy"], mode]
                r["fallbacks"] = [f"{fb['op']} ({fb['how']})" for fb in wide.fallbacks]
            elif r["strategy"].startswith("module:"):
                r["chosen_strategy"] = r["strategy"].split(":", 1)[1]
        records += recs
        # This mode's copies and baselines go before the next mode makes its own: at real sizes
        # (GPT-2 at N=4: 2 GB per set of members) two modes' worth do not fit in memory.
        del models, wides, baselines, makers
        if big:  # Note [Collect after a mode only at real sizes]
            gc.collect()
    return records
