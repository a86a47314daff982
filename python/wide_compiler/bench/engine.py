"""Benchmark engine: contenders, timing, records and the table printer.

A benchmark compares, in one run on one machine, a *wide* contender (one op or one model for all
N members) against the *baselines* a user would otherwise write: N separate modules in a Python
loop, ``torch.func`` ensembling (``stack_module_state`` + ``functional_call`` + ``vmap``),
``torch.compile`` of the loop, and where it helps a roofline (one plain GEMM with the same FLOPs).
Every member has its own weights and its own input: ``x`` is ``[N, B, ...]`` and member ``i``
gets ``x[i]``.

Timing is interleaved (:func:`time_interleaved`): the wide contenders and the baselines of one
case are timed together, in rounds of one block of calls each (rotating which goes first), and
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
all outputs, gradients of the parameters with ``torch.autograd.grad``); ``execution`` is
``"eager"`` or ``"compiled"`` for the wide contender; ``speedup[name]`` is
``baseline_ms[name] / wide_ms`` (above 1: the wide contender is faster); ``max_abs_err`` is the
largest absolute difference of any member's output (and, in train mode, parameter gradient)
against that member run on its own; ``errors`` maps a baseline that failed (e.g. a
``torch.compile`` that raised) to its error message; ``timing`` says how the times were taken
(``"interleaved"``: :func:`time_interleaved`). Every benchmark builds its records with
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
import copy
import dataclasses
import functools
import gc
import logging
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from .. import allocator, testing

__all__ = [
    "MODES",
    "RECORD_KEYS",
    "COMPILE_OPTIONS",
    "Contender",
    "TimingError",
    "compile_all",
    "compiled",
    "compiled_loop_contender",
    "contention_note",
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
    "params_max_abs_err",
    "run_case",
    "stacked_params",
    "time_interleaved",
    "time_with_baselines",
    "vmap_contender",
    "wide_params_in_member_order",
]

log = logging.getLogger(__name__)

#: Keys every record has (see the module docstring).
RECORD_KEYS = (
    "target", "case", "n", "batch", "in_features", "out_features", "dtype", "mode", "execution",
    "strategy", "wide_ms", "baseline_ms", "speedup", "max_abs_err", "baseline_max_abs_err",
    "errors", "timing", "machine",
)
MODES = ("inference", "train")
_REQUIRED = ("target", "n", "dtype")


@dataclasses.dataclass
class Contender:
    """One way to run all N members.

    ``forward(x)`` takes the N-first input ``[N, B, ...]``. ``layout`` says what it returns:
    ``"wide"``: one N-first output (any pytree of ``[N, ...]`` tensors); ``"members"``: a list of
    N per-member outputs; ``"opaque"``: not comparable per member (a roofline), never checked.
    ``params`` are the tensors whose gradients a train step computes: for ``"wide"``, one stacked
    ``[N, *shape]`` tensor per member parameter in ``member.parameters()`` order; for
    ``"members"``, member-major (all of member 0's parameters, then member 1's, ...).
    """

    name: str
    forward: Callable[[torch.Tensor], Any]
    params: Sequence[torch.Tensor]
    layout: str = "wide"

    def __post_init__(self) -> None:
        if self.layout not in ("wide", "members", "opaque"):
            raise ValueError(
                f"Contender {self.name!r}: layout must be 'wide', 'members' or 'opaque', "
                f"got {self.layout!r}")


def machine_info() -> dict[str, Any]:
    """What the numbers depend on: versions, threads and the CPU ISA torch's kernels use.

    >>> info = machine_info()
    >>> info["threads"] == torch.get_num_threads(), "cpu_capability" in info
    (True, True)
    """
    return {
        "wide_compiler": _wc_version(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "num_interop_threads": torch.get_num_interop_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "machine": platform.machine(),
        "platform": platform.platform(),
        "processor": platform.processor() or _cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_avg": _load_avg(),
        "allocator": "glibc-tuned" if allocator._applied else "default",  # wc.tune_cpu_allocator()
    }


@functools.cache
def peak_gflops(size: int = 1024, reps: int = 9) -> float:
    """The machine's practical float32 peak, GFLOP/s: the median rate of one ``size``-cubed
    ``torch.mm`` (BLAS at its best: large, square, in cache-friendly tiles) with the current
    threads. Measured once per process; records compare a model's achieved rate against it.

    >>> peak_gflops(size=64, reps=3) > 0
    True
    """
    a, b = torch.randn(size, size), torch.randn(size, size)
    for _ in range(2):
        torch.mm(a, b)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t0)
    return 2 * size**3 / statistics.median(times) / 1e9


def _load_avg() -> list[float] | None:
    """1/5/15-minute load averages: other processes competing for the cores spoil timings."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):  # not on every platform
        return None


def contention_note(machine: Mapping[str, Any]) -> str | None:
    """A warning when the machine was busy (1-minute load average, at the start or the end of
    the run, at least 75% of the CPU count), else None."""
    cpus = machine.get("cpu_count") or 0
    loads = [la[0] for la in (machine.get("load_avg"), machine.get("load_avg_end")) if la]
    if not cpus or not loads or max(loads) < 0.75 * cpus:
        return None
    return (f"note: load average {max(loads):.1f} on {cpus} CPUs during the run: other "
            f"processes competed for the cores, so these timings are unreliable")


def _wc_version() -> str:
    import wide_compiler

    if getattr(wide_compiler, "__version__", None):
        return wide_compiler.__version__
    try:
        from importlib.metadata import version

        return version("wide_compiler")
    except Exception:  # noqa: BLE001 (not installed: source tree on sys.path)
        return "unknown"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


class TimingError(RuntimeError):
    """A callable timed by :func:`time_interleaved` raised: ``name`` is its key, ``error`` (also
    ``__cause__``) what it raised."""

    def __init__(self, name: Any, error: BaseException) -> None:
        super().__init__(f"{name}: {_error_text(error)}")
        self.name = name
        self.error = error


def _timed_calls(fn: Callable[[], Any], calls: int) -> float:
    """Seconds that ``calls`` calls of ``fn`` take, garbage collection off (as ``timeit``)."""
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return time.perf_counter() - start
    finally:
        if gc_was_enabled:
            gc.enable()


def time_interleaved(fns: Mapping[Any, Callable[[], Any]], *, min_run_time: float = 0.2,
                     rounds: int = 10, warmup: int = 2, min_rounds: int = 3) -> dict[Any, float]:
    """Median wall time of one call of each of ``fns``, in milliseconds, timed interleaved.

    Every callable is called ``warmup`` times, then calibrated: ``k`` calls per block so that one
    block takes about ``min_run_time / rounds`` seconds (at least one call). Then, ``rounds``
    times, one block of each callable is timed, the order rotating by one every round (so none
    always follows the same one); the result is each one's median over the rounds of block time
    / ``k``. Machine speed drifting over the run thus affects every callable alike, and ratios of
    the results hold far better than those of callables timed one after another. Each callable
    runs about ``min_run_time`` seconds in all; when one call of the slowest takes longer than
    ``min_run_time / rounds``, fewer rounds are run (``min_run_time`` over that call, at least
    ``min(min_rounds, rounds)``). A callable that raises raises :class:`TimingError` naming it.

    >>> ms = time_interleaved({"sum": lambda: torch.ones(4).sum(),
    ...                        "mm": lambda: torch.ones(64, 64) @ torch.ones(64, 64)},
    ...                       min_run_time=0.01)
    >>> sorted(ms), all(v > 0 for v in ms.values())
    (['mm', 'sum'], True)
    """
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    names = list(fns)
    if not names:
        return {}

    def timed(name: Any, calls: int) -> float:
        try:
            return _timed_calls(fns[name], calls)
        except Exception as e:  # re-raised, naming the callable
            raise TimingError(name, e) from e

    block_s = min_run_time / rounds
    per_call: dict[Any, float] = {}
    for name in names:
        if warmup > 0:
            timed(name, warmup)
        calls, elapsed = 1, timed(name, 1)
        while elapsed < block_s / 4 and calls < 1 << 20:  # a few calls: enough to calibrate
            calls *= 2
            elapsed = timed(name, calls)
        per_call[name] = max(elapsed / calls, 1e-9)
    k = {name: max(1, round(block_s / per_call[name])) for name in names}
    slowest = max(per_call.values())
    n_rounds = min(rounds, max(min(min_rounds, rounds), int(min_run_time / slowest)))

    samples: dict[Any, list[float]] = {name: [] for name in names}
    for r in range(n_rounds):
        start = r % len(names)
        for name in names[start:] + names[:start]:
            samples[name].append(timed(name, k[name]) / k[name])
    return {name: statistics.median(samples[name]) * 1e3 for name in names}


def time_with_baselines(wides: Mapping[Any, Callable[[], Any]],
                        baselines: Mapping[str, Callable[[], Any]], *, min_run_time: float = 0.2,
                        errors: dict[str, str] | None = None
                        ) -> tuple[dict[Any, float], dict[str, float], dict[str, str]]:
    """:func:`time_interleaved` of the wide callables and the baselines together; returns
    ``(wide_ms, baseline_ms, errors)``. A baseline that raises is left out (its message in
    ``errors``, which is updated in place when given, and a log warning) and the rest are timed
    again; a wide callable that raises propagates what it raised.

    >>> def broken():
    ...     raise RuntimeError("no")
    >>> wide_ms, base_ms, errors = time_with_baselines(
    ...     {"wide": lambda: torch.ones(4).sum()}, {"loop": lambda: torch.ones(4).sum(),
    ...                                             "broken": broken}, min_run_time=0.01)
    >>> sorted(wide_ms), sorted(base_ms), errors
    (['wide'], ['loop'], {'broken': 'RuntimeError: no'})
    """
    errors = errors if errors is not None else {}
    fns: dict[Any, Callable[[], Any]] = {("wide", k): f for k, f in wides.items()}
    fns.update({("baseline", k): f for k, f in baselines.items()})
    while True:
        try:
            ms = time_interleaved(fns, min_run_time=min_run_time)
            break
        except TimingError as e:
            kind, name = e.name
            if kind == "wide":
                raise e.error  # the wide callable's own error, with its own traceback
            log.warning("baseline %s failed: %s", name, _error_text(e.error))
            errors[name] = _error_text(e.error)
            del fns[e.name]
    wide_ms = {k: ms["wide", k] for k in wides}
    baseline_ms = {k: ms["baseline", k] for k in baselines if ("baseline", k) in ms}
    return wide_ms, baseline_ms, errors


# ---------------------------------------------------------------------------------- baselines

def loop_contender(models: Sequence[nn.Module], name: str = "loop") -> Contender:
    """N separate modules in a Python loop; member ``i`` gets ``x[i]``."""
    models = list(models)

    def forward(x: torch.Tensor) -> list[Any]:
        return [m(x[i]) for i, m in enumerate(models)]

    return Contender(name, forward, [p for m in models for p in m.parameters()], "members")


def vmap_contender(models: Sequence[nn.Module], *, shared: bool = False,
                   name: str = "vmap") -> Contender:
    """``torch.func`` ensembling: ``stack_module_state`` + ``functional_call`` + ``vmap``.

    With ``shared=True`` the input is not mapped (``in_dims=None``): every member reads ``x[0]``,
    as a user with one batch for all members would write it.
    """
    from torch.func import functional_call, stack_module_state, vmap

    params, buffers = stack_module_state(list(models))
    base = copy.deepcopy(models[0]).to("meta")

    def call(p: dict, b: dict, x: torch.Tensor) -> Any:
        return functional_call(base, (p, b), (x,))

    mapped = vmap(call, in_dims=(0, 0, None if shared else 0))

    def forward(x: torch.Tensor) -> Any:
        return mapped(params, buffers, x[0] if shared else x)

    return Contender(name, forward, list(params.values()), "wide")


def compiled_loop_contender(models: Sequence[nn.Module], name: str = "compile_loop",
                            **compile_kwargs: Any) -> Contender:
    """``torch.compile`` of the Python loop (:func:`compiled`)."""
    return compiled(loop_contender(models), name, **compile_kwargs)


def compiled(contender: Contender, name: str, **compile_kwargs: Any) -> Contender:
    """``torch.compile`` of a contender's forward. Compiles lazily: failures surface on first call.

    Resets dynamo first, so that compiling many populations in one process never hits the
    recompile limit (which would silently fall back to eager).
    """
    torch.compiler.reset()
    return Contender(name, torch.compile(contender.forward, **compile_kwargs), contender.params, contender.layout)


def stacked_params(models: Sequence[nn.Module]) -> list[torch.Tensor]:
    """One ``[N, *shape]`` leaf per member parameter (``parameters()`` order), requiring grad."""
    per_member = [list(m.parameters()) for m in models]
    return [torch.stack([ps[j].detach() for ps in per_member]).requires_grad_()
            for j in range(len(per_member[0]))]


def wide_params_in_member_order(wide: nn.Module, member: nn.Module) -> list[torch.Tensor]:
    """The wide model's stacked parameters, in ``member.named_parameters()`` order.

    Relies on the wide model's ``state_dict(keep_vars=True)`` being keyed by the member's
    parameter names with the stacked ``[N, *shape]`` parameters as values.
    """
    sd = wide.state_dict(keep_vars=True)
    out = []
    for name, p in member.named_parameters():
        t = sd.get(name)
        if not isinstance(t, torch.Tensor) or not t.requires_grad or t.shape[1:] != p.shape:
            raise RuntimeError(
                f"wide model's state_dict(keep_vars=True)[{name!r}] is not a stacked parameter "
                f"[N, {', '.join(map(str, p.shape))}] (got "
                f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}); "
                f"cannot compare gradients per member")
        out.append(t)
    return out


# ---------------------------------------------------------------------------------- running

def _loss(out: Any) -> torch.Tensor:
    leaves = tree_leaves(out)
    if len(leaves) == 1:
        return leaves[0].sum()
    return torch.stack([t.sum() for t in leaves]).sum()


def make_step(contender: Contender, x: torch.Tensor, mode: str) -> Callable[[], Any]:
    """The timed callable: ``"inference"`` is a forward under ``torch.no_grad``; ``"train"`` is
    forward, sum of every output, and ``torch.autograd.grad`` of the contender's params."""
    if mode == "inference":
        def step() -> Any:
            with torch.no_grad():
                return contender.forward(x)
    elif mode == "train":
        params = list(contender.params)

        def step() -> Any:
            out = contender.forward(x)
            return out, torch.autograd.grad(_loss(out), params)
    else:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return step


def _member_outputs(contender: Contender, out: Any, n: int) -> list[list[torch.Tensor]]:
    if contender.layout == "members":
        return [tree_leaves(o) for o in out]
    leaves = tree_leaves(out)
    return [[t[i] for t in leaves] for i in range(n)]


def _stacked_grads(contender: Contender, grads: Sequence[torch.Tensor], n: int
                   ) -> list[torch.Tensor]:
    if contender.layout == "members":
        per = len(grads) // n
        return [torch.stack([grads[i * per + j] for i in range(n)]) for j in range(per)]
    return list(grads)


def max_abs_err(reference: Contender, ref_result: Any, other: Contender, result: Any,
                n: int, mode: str) -> float:
    """Largest |difference| of any member's outputs (and, for train, parameter gradients)."""
    if mode == "train":
        ref_out, ref_grads = ref_result
        out, grads = result
    else:
        ref_out, ref_grads, out, grads = ref_result, (), result, ()
    err = 0.0
    ref_members = _member_outputs(reference, ref_out, n)
    members = _member_outputs(other, out, n)
    for i, (r, o) in enumerate(zip(ref_members, members, strict=True)):
        if len(r) != len(o):
            raise ValueError(f"member {i}: {other.name} returned {len(o)} outputs, "
                             f"{reference.name} returned {len(r)}")
        for a, b in zip(r, o):
            err = max(err, _diff(a, b, f"member {i} output of {other.name}"))
    if mode == "train":
        rg = _stacked_grads(reference, ref_grads, n)
        og = _stacked_grads(other, grads, n)
        if len(rg) != len(og):
            raise ValueError(f"{other.name} has {len(og)} stacked parameters, "
                             f"{reference.name} has {len(rg)}")
        for j, (a, b) in enumerate(zip(rg, og)):
            err = max(err, _diff(a, b, f"gradient of parameter {j} of {other.name}"))
    return err


def params_max_abs_err(reference: Sequence[Sequence[torch.Tensor]],
                       stacked: Sequence[torch.Tensor]) -> float:
    """Largest |difference| of member ``i``'s tensors ``reference[i]`` against the stacked
    ``[t[i] for t in stacked]`` (e.g. parameters after an optimizer step): :func:`max_abs_err`
    of a ``"members"`` and a ``"wide"`` result.

    >>> a, b = torch.zeros(2, 3), torch.ones(2)
    >>> params_max_abs_err([[a[0], b[0]], [a[1], b[1] + 0.5]], [a, b])
    0.5
    """
    def unused(x: torch.Tensor) -> None:
        raise NotImplementedError

    ref = Contender("reference", unused, [], "members")
    wide = Contender("wide", unused, [], "wide")
    return max_abs_err(ref, [list(r) for r in reference], wide, list(stacked), len(reference),
                       "inference")


def _diff(a: torch.Tensor, b: torch.Tensor, what: str) -> float:
    """|a - b| at most, as wide_compiler.testing measures it (float64, NaN == NaN)."""
    if a.shape != b.shape:
        raise ValueError(f"{what}: expected shape {tuple(a.shape)}, got {tuple(b.shape)}")
    return testing.max_member_error(b.unsqueeze(0), [a])


def _error_text(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    first = text.splitlines()[0] if text else type(e).__name__
    return first[:300]


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
    )
    record.update(extra)
    return record


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
            log.warning("baseline %s failed: %s", b.name, _error_text(e))
            errors[b.name] = _error_text(e)

    wides = list(wides)
    wide_steps: dict[int, Callable[[], Any]] = {}
    wide_err: dict[int, float] = {}
    for i, w in enumerate(wides):
        wide_steps[i] = make_step(w, x, mode)
        wide_err[i] = check(w, wide_steps[i]())

    # all together, interleaved: the ratios wide / baseline hold on a machine whose speed drifts
    wide_ms, baseline_ms, errors = time_with_baselines(wide_steps, baseline_steps,
                                                       min_run_time=min_run_time, errors=errors)
    return [make_record(base=base, mode=mode, strategy=w.name, wide_ms=wide_ms[i],
                        baseline_ms=baseline_ms, max_abs_err=wide_err[i],
                        baseline_max_abs_err=baseline_err, errors=errors, execution=execution,
                        machine=machine)
            for i, w in enumerate(wides)]


# ---------------------------------------------------------------------------------- table

def fmt_ms(v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.3f}" if v < 10 else f"{v:.1f}" if v < 1000 else f"{v:.0f}"


def fmt_x(v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.2f}x" if v < 10 else f"{v:.1f}x"


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
    """Stamp every record of a run with its preset and the machine facts (load average at the
    end included, so a busy run is visible in the JSON)."""
    machine["load_avg_end"] = machine_info()["load_avg"]
    for r in records:
        r["preset"] = preset
        r["machine"] = dict(machine)
    return records
