"""Benchmark engine: records, running one case, and the table printer, on top of
:mod:`wide_compiler.measure` (the contenders, the timing loop and the machine facts live there;
their names are re-exported here for old imports).

A benchmark compares, in one run on one machine, a *wide* contender (one op or one model for all
N members) against the *baselines* a user would otherwise write: N separate modules in a Python
loop, ``torch.func`` ensembling (``stack_module_state`` + ``functional_call`` + ``vmap``),
``torch.compile`` of the loop, and where it helps a roofline (one plain GEMM with the same FLOPs).
Every member has its own weights and its own input: ``x`` is ``[N, B, ...]`` and member ``i``
gets ``x[i]``.

Timing is interleaved (:func:`wide_compiler.measure.time_interleaved`): the wide contenders and the baselines of one
case are timed together, in rounds of one block of calls each (in orders where no contender keeps
following the same one), and
each one's median over the rounds is reported; a machine whose speed drifts over seconds (other
processes, frequency scaling) then slows every contender alike, so the ratios hold even when the
absolute times swing.

One record (a JSON-able ``dict``) per wide contender, mode and case::

    {"target": "linear", "case": "separate", "n": 64, "batch": 32,
     "in_features": 64, "out_features": 128, "dtype": "float32",
     "mode": "inference", "execution": "eager", "strategy": "bmm",
     "wide_ms": 0.21, "baseline_ms": {"loop": 1.9, "vmap": 0.6},
     "speedup": {"loop": 9.0, "vmap": 2.9}, "max_abs_err": 9.5e-07,
     "baseline_max_abs_err": {"vmap": 0.0}, "errors": {}, "timing": "interleaved",
     "machine": {...}}

``mode`` is ``"inference"`` (forward under ``torch.no_grad``) or ``"train"`` (forward, sum of
all outputs, ``.backward()`` into the parameters' cleared ``.grad``: :func:`make_step`);
``execution`` is ``"eager"`` or ``"compiled"`` for the wide contender; ``speedup[name]`` is
``baseline_ms[name] / wide_ms`` (above 1: the wide contender is faster); ``max_abs_err`` is the
largest absolute difference of any member's output (and, in train mode, parameter gradient)
against that member run on its own; ``errors`` maps a baseline that failed (e.g. a
``torch.compile`` that raised) to its error message; ``timing`` says how the times were taken
(``"interleaved"``: :func:`wide_compiler.measure.time_interleaved`). Every benchmark builds its records with
:func:`make_record` and compares with :func:`max_abs_err` (the one comparison:
:func:`params_max_abs_err` goes through it too); targets are registered in :mod:`.registry`.

Example::

    >>> import torch
    >>> from torch import nn
    >>> from wide_compiler.bench import engine
    >>> models = [nn.Linear(8, 4) for _ in range(3)]
    >>> x = torch.randn(3, 2, 8)
    >>> W = torch.stack([m.weight.detach() for m in models]).requires_grad_()
    >>> b = torch.stack([m.bias.detach() for m in models]).requires_grad_()
    >>> wide = engine.Contender("bmm", lambda x: torch.ops.wide.linear(x, W, b, strategy="bmm"),
    ...                         [W, b])
    >>> recs = engine.run_case(models, x, [wide], [engine.loop_contender(models)],
    ...                        mode="inference", min_run_time=0.01,
    ...                        base={"target": "linear", "dtype": "float32"})
    >>> recs[0]["max_abs_err"] < 1e-5
    True
"""
from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .. import allocator, measure

# Moved to wide_compiler.measure (the package's one measurement library); re-exported here so
# that ``wide_compiler.bench.engine.<name>`` keeps working.
from ..measure import (  # noqa: F401
    MODES,
    Contender,
    TimingError,
    compiled,
    compiled_loop_contender,
    contention_note,
    end_of_run,
    fmt_ms,
    fmt_x,
    loop_contender,
    machine_info,
    make_step,
    max_abs_err,
    params_max_abs_err,
    peak_gflops,
    stacked_params,
    time_interleaved,
    time_with_baselines,
    vmap_contender,
    wide_params_in_member_order,
)

__all__ = [
    "MODES",
    "RECORD_KEYS",
    "BASELINES",
    "COMPILE_OPTIONS",
    "DEVICE",
    "Contender",
    "TimingError",
    "compile_all",
    "compiled",
    "compiled_loop_contender",
    "contention_note",
    "device_name",
    "finish_records",
    "fmt_ms",
    "fmt_x",
    "format_table",
    "frame_table",
    "loop_contender",
    "machine_info",
    "peak_gflops",
    "make_record",
    "make_step",
    "max_abs_err",
    "on_device",
    "params_max_abs_err",
    "run_case",
    "stacked_params",
    "time_interleaved",
    "time_with_baselines",
    "to_device",
    "vmap_contender",
    "wide_params_in_member_order",
    "with_baselines",
]

log = logging.getLogger(__name__)

#: Keys every record has (see the module docstring).
RECORD_KEYS = (
    "target", "case", "n", "batch", "in_features", "out_features", "dtype", "mode", "execution",
    "strategy", "wide_ms", "baseline_ms", "speedup", "max_abs_err", "baseline_max_abs_err",
    "errors", "timing", "machine", "device",
)
_REQUIRED = ("target", "n", "dtype")


def make_record(*, base: Mapping[str, Any], mode: str, strategy: str, wide_ms: float,
                baseline_ms: Mapping[str, float], max_abs_err: float,
                baseline_max_abs_err: Mapping[str, float] | None = None,
                errors: Mapping[str, str] | None = None, execution: str = "eager",
                machine: Mapping[str, Any] | None = None, timing: str = "interleaved",
                **extra: Any) -> dict[str, Any]:
    """Build one record, the only way every benchmark builds one: ``base`` fields (target, case,
    n, batch, shapes, dtype; ``target``, ``n`` and ``dtype`` required) + timings + speedups +
    errors + ``timing`` + machine; ``extra`` fields go last. See the module docstring for the keys.

    >>> r = make_record(base={"target": "linear", "n": 4, "dtype": "float32"}, mode="inference",
    ...                 strategy="bmm", wide_ms=0.5, baseline_ms={"loop": 2.0}, max_abs_err=0.0,
    ...                 machine={})
    >>> r["speedup"], r["case"]
    ({'loop': 4.0}, 'separate')
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    missing = [k for k in _REQUIRED if base.get(k) is None]
    if missing:
        raise ValueError(f"a benchmark record needs {missing} in base (got {sorted(base)})")
    record: dict[str, Any] = {k: None for k in RECORD_KEYS}
    record.update({"case": "separate", "execution": execution})
    record.update(base)
    record.update(
        mode=mode,
        strategy=strategy,
        wide_ms=wide_ms,
        baseline_ms=dict(baseline_ms),
        speedup={k: (v / wide_ms if wide_ms > 0 else math.nan) for k, v in baseline_ms.items()},
        max_abs_err=max_abs_err,
        baseline_max_abs_err=dict(baseline_max_abs_err or {}),
        errors=dict(errors or {}),
        timing=timing,
        machine=dict(machine if machine is not None else machine_info()),
        device=device_name(),
    )
    record.update(extra)
    return record


#: Where the targets that support it (:attr:`.registry.Target.devices`) put the members and their
#: inputs: the CLI's ``--device``. Set with :func:`on_device`; read with :func:`to_device`.
DEVICE = torch.device("cpu")


@contextlib.contextmanager
def on_device(device: str | torch.device) -> Iterator[None]:
    """Within the block, targets build their members and inputs on ``device`` (every contender
    alike; timings synchronize CUDA, see :func:`wide_compiler.measure.interleave`)."""
    global DEVICE
    before, DEVICE = DEVICE, torch.device(device)
    try:
        yield
    finally:
        DEVICE = before


def to_device(obj: Any) -> Any:
    """``obj`` (a module, a tensor, or a tuple/list of them) on :data:`DEVICE`.

    >>> to_device((torch.ones(2), nn.Linear(2, 1)))[0].device
    device(type='cpu')
    """
    if isinstance(obj, (torch.Tensor, nn.Module)):
        return obj.to(DEVICE)
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_device(o) for o in obj)
    return obj


def device_name() -> str:
    """``"cpu"``, or ``"cuda: <the GPU's name>"``: what a record's timings ran on."""
    if DEVICE.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(DEVICE)}"
    return DEVICE.type


#: The baselines the targets that name theirs (``models``, ``real`` and the other vision targets)
#: time instead of their own: the CLI's ``--baselines``; None: each case's. Set with
#: :func:`with_baselines`.
BASELINES: tuple[str, ...] | None = None


@contextlib.contextmanager
def with_baselines(names: Iterable[str] | None) -> Iterator[None]:
    """Within the block, the vision targets time the baselines ``names`` (``loop``, ``loop_cl``,
    ``vmap``, ``compile_loop``, ``compile_vmap``, ``processes``: :mod:`.processes`) instead of each
    case's own; None keeps those."""
    global BASELINES
    before, BASELINES = BASELINES, (tuple(names) if names is not None else None)
    try:
        yield
    finally:
        BASELINES = before


#: ``torch.compile`` options applied to every contender of :func:`run_case` (the CLI's
#: ``--compile``); None: eager. Set with :func:`compile_all`.
COMPILE_OPTIONS: dict[str, Any] | None = None


@contextlib.contextmanager
def compile_all(**options: Any) -> Iterator[None]:
    """Within the block, :func:`run_case` runs every wide contender and every baseline under
    ``torch.compile(**options)`` (a baseline that is already compiled is kept), checked against
    the eager loop; records say ``execution="compiled"``."""
    global COMPILE_OPTIONS
    before, COMPILE_OPTIONS = COMPILE_OPTIONS, dict(options)
    try:
        yield
    finally:
        COMPILE_OPTIONS = before


def run_case(models: Sequence[nn.Module], x: torch.Tensor, wides: Iterable[Contender],
             baselines: Iterable[Contender], *, mode: str, base: Mapping[str, Any],
             min_run_time: float = 0.2, machine: Mapping[str, Any] | None = None,
             reference: Contender | None = None,
             check: Callable[[Contender, Any], float] | None = None) -> list[dict[str, Any]]:
    """Time every wide contender and every baseline in ``mode``, all together
    (:func:`time_with_baselines`, interleaved); one record per wide contender.

    ``reference`` (default: the loop over ``models``) gives each member's own result; every wide
    contender and every checkable baseline is compared with it. ``check(contender, result)``,
    when given, replaces that comparison: it returns the ``max_abs_err`` of one result of
    :func:`make_step` (for contenders whose results cannot equal the members' own, e.g. a train
    step through dropout, where every contender draws its own masks). A baseline that raises
    (while built lazily, at warm-up or while timed) is left out of ``baseline_ms`` and its message
    goes to ``errors``; a wide contender that raises propagates.
    """
    n = len(models)
    if check is None:
        reference = reference or loop_contender(models)
        ref_result = make_step(reference, x, mode)()

        def check(contender: Contender, result: Any) -> float:
            return max_abs_err(reference, ref_result, contender, result, n, mode)
    execution = "eager"
    if COMPILE_OPTIONS is not None:
        execution = "compiled"
        wides = [compiled(w, w.name, **COMPILE_OPTIONS) for w in wides]
        baselines = [b if b.name.startswith("compile") else compiled(b, b.name, **COMPILE_OPTIONS)
                     for b in baselines]
    machine = dict(machine) if machine is not None else machine_info()
    base = dict(base, n=n)

    baseline_err: dict[str, float] = {}
    errors: dict[str, str] = {}
    baseline_steps: dict[str, Callable[[], Any]] = {}
    for b in baselines:
        try:
            step = make_step(b, x, mode)
            if b.layout != "opaque":
                baseline_err[b.name] = check(b, step())
            baseline_steps[b.name] = step
        except Exception as e:  # noqa: BLE001 (a baseline failing is a result, not a crash)
            log.warning("baseline %s failed: %s", b.name, measure.error_text(e))
            errors[b.name] = measure.error_text(e)

    wides = list(wides)
    wide_steps: dict[int, Callable[[], Any]] = {}
    wide_err: dict[int, float] = {}
    for i, w in enumerate(wides):
        wide_steps[i] = make_step(w, x, mode)
        wide_err[i] = check(w, wide_steps[i]())
    # The reference's result is not needed while timing: in train mode it holds every member's
    # gradients (2 GB for GPT-2 at N=4, where `benchmark real` fills this machine's 24 GiB).
    check = ref_result = None

    # all together, interleaved: the ratios wide / baseline hold on a machine whose speed drifts
    wide_ms, baseline_ms, errors = time_with_baselines(wide_steps, baseline_steps,
                                                       min_run_time=min_run_time, errors=errors)
    # The wide cache's free blocks are sized for this case's graphs; the next case's rarely fit.
    allocator.empty_cache()
    return [make_record(base=base, mode=mode, strategy=w.name, wide_ms=wide_ms[i],
                        baseline_ms=baseline_ms, max_abs_err=wide_err[i],
                        baseline_max_abs_err=baseline_err, errors=errors, execution=execution,
                        machine=machine)
            for i, w in enumerate(wides)]


# ---------------------------------------------------------------------------------- table

def format_table(records: Sequence[Mapping[str, Any]], *, header: bool = True) -> str:
    """Plain-text table with aligned columns: one row per record, one ``ms`` and one speedup
    column per baseline (in first-seen order), and the max abs error.

    >>> r = make_record(base={"target": "linear", "n": 4, "batch": 2, "in_features": 8,
    ...                       "out_features": 4, "dtype": "float32"}, mode="train",
    ...                 strategy="bmm", wide_ms=0.5, baseline_ms={"loop": 2.0},
    ...                 max_abs_err=0.0, machine={})
    >>> print(format_table([r], header=False))
    target  case      N  B  shape  dtype    mode   strategy  wide ms  loop ms  vs loop  max err
    ------  --------  -  -  -----  -------  -----  --------  -------  -------  -------  -------
    linear  separate  4  2  8->4   float32  train  bmm         0.500    2.000    4.00x  0.0e+00
    """
    baselines: list[str] = []
    for r in records:
        for k in list(r.get("baseline_ms") or {}) + list(r.get("errors") or {}):
            if k not in baselines:
                baselines.append(k)

    cols = ["target", "case", "N", "B", "shape", "dtype", "mode", "strategy", "wide ms"]
    for b in baselines:
        cols += [f"{b} ms", f"vs {b}"]
    cols.append("max err")
    right = {"N", "B", "wide ms", "max err"} | {c for c in cols if c.endswith(" ms")
                                                 or c.startswith("vs ")}

    rows = []
    for r in records:
        mode = r.get("mode", "")
        if r.get("execution", "eager") != "eager":
            mode = f"{mode}/{r['execution']}"
        shape = (str(r["shape"]) if r.get("shape") else
                 f"{r['in_features']}->{r['out_features']}"
                 if r.get("in_features") is not None else "-")
        row = [str(r.get("target", "")), str(r.get("case", "")), str(r.get("n", "")),
               str(r.get("batch", "")), shape, str(r.get("dtype", "")), mode,
               str(r.get("strategy", "")), fmt_ms(r.get("wide_ms"))]
        for b in baselines:
            if b in (r.get("errors") or {}):
                row += ["error", "-"]
            else:
                row += [fmt_ms((r.get("baseline_ms") or {}).get(b)),
                        fmt_x((r.get("speedup") or {}).get(b))]
        err = r.get("max_abs_err")
        row.append("-" if err is None else f"{err:.1e}")
        rows.append(row)

    widths = [max([len(c)] + [len(row[i]) for row in rows]) for i, c in enumerate(cols)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if name in right else c.ljust(w)
                         for c, w, name in zip(cells, widths, cols)).rstrip()

    body = [line(cols), line(["-" * w for w in widths])] + [line(row) for row in rows]
    return frame_table(records, body, header=header)


def frame_table(records: Sequence[Mapping[str, Any]], body: Sequence[str], *,
                header: bool = True) -> str:
    """A table's ``body`` lines framed as every benchmark table is: with ``header``, the machine
    line above (torch, threads, CPU capability); below, the :func:`contention_note` and one line
    per failed baseline (``errors``)."""
    out = []
    m = (records[0].get("machine") or {}) if records else {}
    if header and m:
        out.append(f"torch {m.get('torch')}, {m.get('threads')} threads, "
                   f"CPU capability {m.get('cpu_capability')}, "
                   f"wide_compiler {m.get('wide_compiler')}")
    out += body
    note = contention_note(m)
    if note:
        out.append(note)
    errs = {(k, v) for r in records for k, v in (r.get("errors") or {}).items()}
    for k, v in sorted(errs):
        out.append(f"{k} failed: {v}")
    return "\n".join(out)


def finish_records(records: list[dict[str, Any]], preset: str, machine: dict[str, Any]) -> list[dict[str, Any]]:
    """Stamp every record of a run with its preset and the machine facts (the load average at the
    end and the CPUs other processes kept busy, :func:`end_of_run`, so a busy run is visible in
    the JSON)."""
    machine.update(end_of_run(machine))
    for r in records:
        r["preset"] = preset
        r["machine"] = dict(machine)
    return records
