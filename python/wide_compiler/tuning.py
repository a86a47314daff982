"""Strategy choice for wide operators: the strategy pass and its measuring, cached on disk.

The pass (DESIGN §5; the last pass of fx/pipeline.py): a rule that emits a wide op with
strategies attaches a :class:`~wide_compiler.fx.context.TuneSpec` as ``node.meta["wide_tune"]``,
and :func:`choose_strategies` writes the chosen name into the node's ``strategy`` kwarg: forced by
``WideConfig.strategy``, else :func:`measure_strategy` on the sample shapes (the forward for an
eval graph; forward and backward for a train graph, where a strategy with a cheap forward can
have a slow backward). Where nothing is measured, :func:`heuristic_reason` says why the rule's
default is the default.

Each wide op offers several strategies (``torch.ops.wide.linear``: ``bmm`` or ``loop``). At compile
time :func:`measure_strategy` times each candidate on the sample shapes: a few warm-up calls, then
``config.tune_repeats`` rounds in which every candidate runs once (interleaved, so a burst of load
from other processes hits every candidate of that round alike). A candidate replaces the default
only when the median over rounds of its per-round speedup over the default exceeds
``config.tune_margin``: within the margin the default is kept, so picks do not flip between runs
on a noisy machine. Results are cached in ``<cache_dir>/strategies.json`` keyed by op, shapes,
dtype, device, processor (:func:`wide_compiler.measure.hardware`), thread count, library versions
and the measuring method, so a second compile of the same shapes costs nothing and chooses the
same.

Measuring one graph is bounded by a :class:`Budget`: ``config.tune_budget_s``, scaled down to what
tuning can save where the graph's run time is known (Note [Tuning that pays for itself]). Ops are measured
until 70% of it is spent, the rest is left to the model-level check (fx/model_check.py).
An op gets three rounds first (abandoned only when the whole budget is spent: the clock is read
after every call, so the budget overruns by one call at most); when one candidate is then
:func:`clearly_apart` from the others the op is decided, else it gets the remaining rounds while
the ops' 70% lasts (the rounds completed count). Ops not measured keep their default, are not
cached (a later compile measures them), and the give-up is shown by ``summary()`` and logged
(at WARNING once per process, with what to do; at INFO after that).

Note [Tuning that pays for itself]
    Measuring at compile time pays only through the calls that follow: a tuned set is kept only
    when the whole graph runs faster by more than ``tune_margin`` (the model-level check,
    fx/model_check.py), so what tuning saves is a fraction of a run per call. And it costs runs:
    each op's candidates, warm-ups and rounds add up to about a dozen runs of the graph, and the
    model-level check needs one round of two blocks of three runs before it can decide. A check
    cut short by the budget keeps the defaults, uncached, so a budget too small to measure and
    check the graph is spent for nothing, at every compile: ResNet-18 at N=4 (train graph, batch
    8, 64x64) spent 3.7 s measuring and 2 s checking per graph on a busy 2-core machine and kept
    its defaults each time, two thirds of its compile.

    So where the graph's run time R is known (``run_seconds``: one member's eager forward, timed
    by the member check (fx/member_runs.py), times N, times 3 for a train graph's forward and
    backward), the budget is ``min(tune_budget_s, PAYBACK_RUNS * R)`` (at a gain of 20% a call,
    tuning has paid for itself after 5 * PAYBACK_RUNS calls; a short run is never blocked for
    long), and when even :data:`TUNING_RUNS` runs do not fit in ``tune_budget_s`` no op is
    measured: cached picks are used, the other ops keep their defaults, and ``summary()`` says
    why (a larger ``tune_budget_s``, or None, measures). Cached picks that differ from the
    defaults still go through the model-level check where its :data:`CHECK_RUNS` runs fit in
    the budget (a warm strategy cache keeps its use), else the defaults are kept. Where R is not known (no member check,
    a recapture) the budget is ``tune_budget_s``; ``tune_budget_s=None`` is no limit, unscaled.

Note [Tuning after the first runs]
    What a measured strategy saves is a fraction of each later run, so measuring pays only over
    many runs, and at compile time nobody knows how many will come: a cold compile of ResNet-18
    (N=4) on a quiet machine spent up to its whole 5 s budget measuring the eval graph, 1.8x what
    torch.export takes to capture the member, for a 10-step script that never earned it back.
    So by default (``WideConfig.tune_after_runs=None``) a graph that would be measured is
    compiled with its defaults and the picks already in the strategy cache (a :class:`Budget`
    with ``defer_runs`` set: nothing measured, ``summary()`` says when it will be), and the model
    measures it at a call boundary once it has run :func:`deferred_runs` times: enough runs that
    the budget is at most :data:`DEFER_SHARE` of the time they took (so tuning costs a run at most
    20% more than it would have, and only a run long enough to gain from it), then keeps the
    result for the graph, the strategy cache and the compile cache (the entry is written again,
    so a later process starts tuned). The passes run then are the compile's own (``strategies``,
    the model-level check, member tiles) on the model's live state and the capture sample, with
    grad mode on, autocast off and the random streams restored, under the compile lock; a call
    being traced (torch.compile, torch.export, functorch transforms, a dispatch mode) only
    counts. ``WideModel.tune()`` measures at once; ``tune_after_runs=0`` measures at compile
    time, k >= 1 after k runs. A copy of a model (``copy.deepcopy``) shares its graphs, and so
    their measuring: the runs of both count, and whichever runs the graph when its turn comes
    measures it on its own state (strategies depend on the shapes, not on the values). A graph
    captured again for new sizes in place of one still waiting takes over the runs left; a graph
    under ``torch.compile`` is never counted (``tune()`` before compiling measures it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import statistics
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import fx

from . import measure
from .config import WideConfig

__all__ = ["choose_strategies", "clearly_apart", "heuristic_reason", "measure_strategy",
           "cache_key", "Budget", "Choice"]

log = logging.getLogger(__name__)
_CACHE_FILE = "strategies.json"
_WARMUP = 3  # untimed calls per candidate before the timed rounds (first calls pay one-time setup)
MEASURE_SHARE = 0.7  # of the budget, for measuring ops; the rest is the model-level check's
MIN_ROUNDS = 3  # rounds every measured op gets; more only while no candidate is clearly apart
# Note [Tuning that pays for itself]: the budget is at most PAYBACK_RUNS runs of the graph, and
# nothing is measured where TUNING_RUNS runs (the least a measured and checked graph costs) do not
# fit in tune_budget_s
PAYBACK_RUNS = 50
TUNING_RUNS = 20
# Note [Tuning after the first runs]: a graph is measured once its runs took 1 / DEFER_SHARE times its
# budget (DEFER_RUNS where its run time is not known)
DEFER_SHARE = 0.2
DEFER_RUNS = 100
CHECK_RUNS = 6  # the least the model-level check runs the graph (one round: two blocks of three)
_hinted = False  # the budget's give-up was logged at WARNING in this process (once: then INFO)


def scaled_budget(seconds: float | None, run_seconds: float | None) -> tuple[float | None, str | None]:
    """Note [Tuning that pays for itself]: the measuring budget of a graph whose run takes
    ``run_seconds`` (None: not known) under ``tune_budget_s=seconds``, and why nothing is
    measured (None: measure).

    >>> scaled_budget(5.0, None), scaled_budget(5.0, 0.01), scaled_budget(None, 1.0)
    ((5.0, None), (0.5, None), (None, None))
    >>> scaled_budget(5.0, 0.5)[1]
    'a run of this graph takes ~500 ms: measuring and checking it takes at least 20 runs (10 s), more than tune_budget_s=5'
    """
    if seconds is None or run_seconds is None or not run_seconds > 0:
        return seconds, None
    if TUNING_RUNS * run_seconds > seconds:
        return seconds, (f"a run of this graph takes ~{1e3 * run_seconds:.0f} ms: measuring and checking it takes "
                         f"at least {TUNING_RUNS} runs ({TUNING_RUNS * run_seconds:.2g} s), more than "
                         f"tune_budget_s={seconds:g}")
    return min(seconds, PAYBACK_RUNS * run_seconds), None


def deferred_runs(seconds: float | None, run_seconds: float | None, after: int | None) -> int | None:
    """Note [Tuning after the first runs]: after how many runs a graph is measured
    (``after=WideConfig.tune_after_runs``; None: at compile time), its budget being ``seconds``
    (already scaled: :func:`scaled_budget`) and one run ``run_seconds`` (None: not known).

    >>> deferred_runs(5.0, 0.1, None), deferred_runs(0.05, 0.001, None), deferred_runs(5.0, None, None)
    (250, 250, 100)
    >>> deferred_runs(5.0, 0.1, 0), deferred_runs(5.0, 0.1, 3)
    (None, 3)
    """
    if after is not None:
        return after or None
    if seconds is None or run_seconds is None or not run_seconds > 0:
        return DEFER_RUNS
    return max(1, math.ceil(seconds / (DEFER_SHARE * run_seconds) - 1e-9))


def now() -> float:
    """Seconds of the clock tuning and its budget use: the measuring clock,
    :func:`wide_compiler.measure.now` (tests fake it: Note [Fake clock] in measure/timing.py)."""
    return measure.now()


class Budget:
    """The measuring time allowed to one compiled graph (``WideConfig.tune_budget_s``, scaled by
    :func:`scaled_budget` to ``run_seconds``, the graph's run time where known; None: no limit),
    and what happened to it: ``gave_up_at`` (the first node left unmeasured), ``skipped`` (how
    many), ``check`` (the model-level check's outcome, for ``summary()``); ``not_measured``: why
    nothing is measured (Note [Tuning that pays for itself]), else None."""

    def __init__(self, seconds: float | None, run_seconds: float | None = None,
                 after_runs: int | None = 0) -> None:
        self.limit, self.run_seconds = seconds, run_seconds
        self.seconds, self.not_measured = scaled_budget(seconds, run_seconds)
        # Note [Tuning after the first runs]: measured after this many runs of the graph (None: now)
        self.defer_runs = deferred_runs(self.seconds, run_seconds, after_runs) if self.not_measured is None else None
        if self.defer_runs is not None:
            self.not_measured = (f"deferred: measured after the graph's first {self.defer_runs} runs, or at "
                                 f"WideModel.tune() (WideConfig.tune_after_runs)")
        self.checking = False  # the model-level check runs (on cached picks) though no op was measured
        self.start = now()
        self.measured = 0
        self.cached = 0
        self.skipped = 0
        self.gave_up_at: str | None = None
        self.check: str | None = None
        self.tiles: str | None = None  # the member-tile check's outcome (Note [Member tiles])
        self.elapsed: float | None = None
        # where the graph came from when it was loaded from the compile cache (fx/compile_cache.py):
        # what this budget describes then happened at the compile that stored it, not now
        self.from_cache: str | None = None

    def spent(self) -> float:
        return now() - self.start

    def exhausted(self, share: float = 1.0) -> bool:
        if self.not_measured is not None and not self.checking:
            return True
        return self.seconds is not None and self.spent() >= self.seconds * share

    def give_up(self, where: str, op: str) -> None:
        """Record an op left at its default; the first one is logged (at WARNING, with what to
        do, once per process; at INFO after that, and where nothing is measured by design)."""
        global _hinted
        self.skipped += 1
        if self.not_measured is not None:
            if self.skipped == 1:
                log.info("wide_compiler: tuning: nothing measured (%s): cached picks are used, the other ops "
                         "keep their default strategies", self.not_measured)
            return
        if self.gave_up_at is None:
            self.gave_up_at = where
            level = logging.INFO if _hinted else logging.WARNING
            _hinted = True
            hint = ("" if os.environ.get("OMP_WAIT_POLICY") or level == logging.INFO else
                    " (on a busy machine OMP_WAIT_POLICY=PASSIVE, set before torch loads, measures faster)")
            log.log(level, "wide_compiler: tuning budget of %.2g s used up at node '%s' (%s) after %.1f s: the "
                    "ops not yet measured keep their default strategies until a later compile measures "
                    "them%s", self.seconds, where, op, self.spent(), hint)

    def check_fits(self) -> bool:
        """Whether the model-level check's least runs (:data:`CHECK_RUNS`) fit in what is left
        (always, where the graph's run time is not known)."""
        if self.seconds is None or self.run_seconds is None:
            return True
        return CHECK_RUNS * self.run_seconds <= self.seconds - self.spent()

    def finish(self, check: str | None = None) -> None:
        """Stop the clock of :meth:`describe` (after the ops, and again after the model-level
        check, whose outcome ``check`` is kept)."""
        self.elapsed = self.spent()
        if check is not None:
            self.check = check

    @property
    def deferred(self) -> bool:
        """Whether the graph is measured later (Note [Tuning after the first runs])."""
        return getattr(self, "defer_runs", None) is not None  # (a Budget pickled before the field: no)

    def describe(self) -> str:
        """One line for ``summary()``."""
        limit = "no limit" if self.seconds is None else f"budget {self.seconds:.3g} s"
        if self.seconds is not None and self.limit is not None and self.seconds < self.limit:
            limit += f" of {self.limit:g} s: {PAYBACK_RUNS} runs of the graph"
        elapsed = self.elapsed if self.elapsed is not None else self.spent()
        text = (f"tuning: {self.measured} measured, {self.cached} cached, {self.skipped} left at default, "
                f"{elapsed:.2f} s ({limit})")
        where = getattr(self, "from_cache", None)  # (a Budget pickled before the field existed has none)
        if where is not None:
            text = (f"tuning: nothing measured now: the graph and its strategies came from the compile cache "
                    f"({where}); at the compile that stored it, {text.removeprefix('tuning: ')}")
        if self.not_measured is not None:
            text += f"; nothing measured: {self.not_measured}"
        if self.gave_up_at is not None:
            text += f"; budget exhausted at node '{self.gave_up_at}'"
        if self.check is not None:
            text += f"; {self.check}"
        if self.tiles is not None:
            text += f"; {self.tiles}"
        return text


@dataclasses.dataclass(frozen=True)
class Choice:
    """One op's strategy and why: ``source`` is ``"heuristic"`` (not measured: tuning off or
    forced), ``"measured"``, ``"cached"`` or ``"budget"`` (budget exhausted, default kept)."""

    strategy: str
    timings_ms: dict[str, float] | None
    reason: str
    source: str


# What a measurement times, as a number the cache key holds: raised when that changes, so that
# older measurements are taken afresh (2: training candidates get a dense gradient, _timed_calls;
# 3: their gradients are stored into cleared .grad, as after optimizer.zero_grad()).
_MEASURE_METHOD = 3


def cache_key(op: str, **fields: Any) -> str:
    """The cache key of one tuning problem: op, the caller's fields, and the machine/version facts
    a measurement depends on (the processor: :func:`wide_compiler.measure.hardware` of the
    fields' ``device``)."""
    from ._version import __version__

    full = dict(fields, op=op, threads=torch.get_num_threads(), torch=torch.__version__, wide=__version__,
                method=_MEASURE_METHOD, hardware=measure.hardware(str(fields.get("device", "cpu"))))
    return json.dumps(full, sort_keys=True, default=str)


def _valid_entry(value: Any) -> str | None:
    """Why a cache entry is unusable (None when it is fine): ``{"strategy": str, "timings_ms":
    {name: non-negative finite ms} or null}``, the form :func:`_store` writes."""
    if not isinstance(value, dict):
        return f"expected an object, got {type(value).__name__}"
    if not isinstance(value.get("strategy"), str):
        return f"'strategy' must be a string, got {value.get('strategy')!r:.60}"
    timings = value.get("timings_ms")
    if timings is None:
        return None
    if not isinstance(timings, dict):
        return f"'timings_ms' must be an object of milliseconds per strategy, got {timings!r:.60}"
    for name, ms in timings.items():
        if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms < 0:
            return f"'timings_ms'[{name!r}] must be a non-negative number of milliseconds, got {ms!r:.60}"
    return None


_reported: set[tuple[str, int, int]] = set()  # (path, mtime_ns, size) of caches already warned about


def _warn_once(path: os.PathLike, message: str, *args: Any) -> None:
    """One warning per version of the cache file (it is read at every tuned op of every compile)."""
    try:
        st = os.stat(path)
        version = (os.fspath(path), st.st_mtime_ns, st.st_size)
    except OSError:
        version = (os.fspath(path), 0, 0)
    if version in _reported:
        return
    _reported.add(version)
    log.warning(message, *args)


def _load(path: os.PathLike) -> dict[str, Any]:
    """The valid entries of the cache file; nothing when it is missing or unreadable. A corrupt
    or odd cache (not JSON, nested too deeply for the parser, not an object, bad entries) is
    ignored with a log line and never fails compile(): entries are only measurements, and any
    that is dropped is measured again (and the file rewritten by the next store)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, RecursionError, MemoryError) as e:
        _warn_once(path, "wide_compiler: ignoring the strategy cache %s (%s: %.200s); strategies will "
                   "be measured again", path, type(e).__name__, e)
        return {}
    if not isinstance(data, dict):
        _warn_once(path, "wide_compiler: ignoring the strategy cache %s: expected a JSON object of "
                   "entries, got %s; strategies will be measured again", path, type(data).__name__)
        return {}
    entries, bad = {}, {}
    for key, value in data.items():
        why = _valid_entry(value)
        if why is None:
            entries[key] = value
        else:
            bad[key] = why
    if bad:
        key, why = next(iter(bad.items()))
        _warn_once(path, "wide_compiler: the strategy cache %s has %d invalid entr%s, ignored and "
                   "measured again (first: %.200s: %s)", path, len(bad), "y" if len(bad) == 1 else "ies",
                   key, why)
    return entries


def _store(path, key: str, value: dict[str, Any]) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        data = _load(path)
        data[key] = value
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".strategies-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:  # a read-only home must not break compile()
        log.warning("wide_compiler: cannot write the strategy cache %s: %s", path, e)


def clearly_apart(times: Mapping[Any, Sequence[float]], margin: float) -> Any:
    """The candidate whose slowest sample, times ``1 + margin``, is quicker than every other
    candidate's quickest sample (so more rounds cannot change the pick, whichever is the
    default), or None. Needs two samples of each.

    >>> clearly_apart({"a": [1.0, 1.1], "b": [1.5, 1.4]}, 0.1), clearly_apart({"a": [1.0, 1.3], "b": [1.4, 1.5]}, 0.1)
    ('a', None)
    """
    if len(times) < 2 or min(len(v) for v in times.values()) < 2:
        return None
    best = min(times, key=lambda k: max(times[k]))
    slowest = max(times[best]) * (1 + margin)
    return best if all(min(v) > slowest for k, v in times.items() if k != best) else None


def _measure(candidates: Mapping[str, Callable[[], Any]], repeats: int,
             budget: Budget | None = None, margin: float = 0.0) -> dict[str, list[float]] | None:
    """Wall time (ms) of each candidate per round. All are warmed up first (first calls pay one-time
    library initialisation) and then timed round-robin, so drift hits every candidate alike:
    :data:`MIN_ROUNDS` rounds, then, unless one candidate is :func:`clearly_apart` by ``margin``,
    up to ``repeats`` while :data:`MEASURE_SHARE` of ``budget`` lasts (complete rounds count).
    None when the whole ``budget`` ran out before the first rounds were done (abandoned)."""
    def out_of(share: float) -> Callable[[], bool]:
        return lambda: budget is not None and budget.exhausted(share)

    # The budget is asked after every call: it overruns by one call at most. A fixed order (no
    # rotation): the rounds are paired by index (_ratio), every candidate once per round.
    first = min(repeats, MIN_ROUNDS)
    try:
        rounds = measure.interleave(candidates, first, warmup=_WARMUP, rotate=False, stop=out_of(1.0))
        if not rounds.complete:
            return None
        times = {name: [1e3 * s for s in samples] for name, samples in rounds.samples.items()}
        if repeats > first and clearly_apart(times, margin) is None:
            more = measure.interleave(candidates, repeats - first, rotate=False, stop=out_of(MEASURE_SHARE))
            done = min(len(samples) for samples in more.samples.values())
            for name, samples in more.samples.items():
                times[name] += [1e3 * s for s in samples[:done]]
    except measure.TimingError as e:
        raise e.error  # the candidate's own error, with its own traceback
    return times


def _ratio(times: Mapping[str, list[float]], default: str, name: str) -> float:
    """Median over rounds of default's time / ``name``'s time: > 1 when ``name`` is faster. Paired
    by round, so load that comes and goes cancels out."""
    return statistics.median(d / max(t, 1e-9) for d, t in zip(times[default], times[name]))


def _fmt(timings: Mapping[str, float]) -> str:
    return ", ".join(f"{k} {v:.3f} ms" for k, v in timings.items())


def _decide(times: Mapping[str, list[float]], default: str, margin: float) -> tuple[str, str]:
    """The strategy to use and why: the candidate of the largest median speedup over the default
    if that speedup exceeds ``margin``, else the default."""
    medians = {k: statistics.median(v) for k, v in times.items()}
    others = {k: _ratio(times, default, k) for k in times if k != default}
    if default not in times or not others:
        best = min(medians, key=medians.get)
        return best, f"measured: {_fmt(medians)}"
    best = max(others, key=others.get)
    speedup, need = others[best], 1.0 + margin
    if speedup > need:
        return best, (f"measured: {best} {medians[best]:.3f} ms vs default {default} {medians[default]:.3f} ms, "
                      f"{speedup:.2f}x speedup > {need:.2f}x needed (margin)")
    quickest = min(medians, key=medians.get)
    if quickest == default and speedup <= 1.0:
        return default, f"measured: default best ({_fmt(medians)})"
    if quickest != default:
        best = quickest  # the paired speedup can disagree with the medians: name the one they favour
        speedup = others[best]
    return default, (f"kept default: within margin ({best} {medians[best]:.3f} ms vs {default} "
                     f"{medians[default]:.3f} ms, {speedup:.2f}x paired speedup <= {need:.2f}x needed)")


def _describe_cached(strategy: str, default: str, timings: Mapping[str, float] | None) -> str:
    if not timings:
        return f"cached: {strategy}"
    if strategy == default:
        return f"cached: default kept ({_fmt(timings)})"
    return f"cached: {strategy} {timings.get(strategy, float('nan')):.3f} ms vs default {default} " \
           f"{timings.get(default, float('nan')):.3f} ms"


def lookup(key: str, config: WideConfig) -> dict[str, Any] | None:
    """The valid cache entry of ``key`` (None: none, or caching off)."""
    if not config.cache:
        return None
    return _load(os.path.join(config.resolved_cache_dir(), _CACHE_FILE)).get(key)


def remember(key: str, value: dict[str, Any], config: WideConfig) -> None:
    """Store ``{"strategy": str, "timings_ms": {...}}`` under ``key`` (nothing when caching is off)."""
    if config.cache:
        _store(os.path.join(config.resolved_cache_dir(), _CACHE_FILE), key, value)


def measure_strategy(
    op: str,
    key_fields: Mapping[str, Any],
    make_candidates: Callable[[], Mapping[str, Callable[[], Any]]],
    default: str,
    config: WideConfig,
    names: Sequence[str] | None = None,
    *,
    budget: Budget | None = None,
    where: str = "",
    heuristic: str = "",
) -> Choice:
    """Choose one op's strategy and say why (a :class:`Choice`). ``make_candidates()`` returns
    ``{name: zero-argument callable running the op with that strategy}`` (forward only, or forward
    and backward: the caller decides); it is called only when something must be measured.

    ``names``: the op's strategies; a cache entry naming another (a stale cache) is measured again.
    ``budget``: shared by the ops of one graph; once :data:`MEASURE_SHARE` of it is spent, ops keep
    their default (``source="budget"``, not cached). ``where``: the node, for the give-up log.
    ``heuristic``: why the default is the default, for the reasons. Example:

        >>> import torch, wide_compiler as wc
        >>> from wide_compiler.tuning import Budget, measure_strategy
        >>> x, w = torch.randn(4, 8, 16), torch.randn(4, 32, 16)
        >>> make = lambda: {s: (lambda s=s: torch.ops.wide.linear(x, w, strategy=s)) for s in ("bmm", "loop")}
        >>> measure_strategy("linear", {"x": [4, 8, 16]}, make, "bmm", wc.WideConfig(tune=False),
        ...                  heuristic="one batched GEMM").reason
        'default (heuristic: one batched GEMM); tuning off'
        >>> choice = measure_strategy("linear", {"x": [4, 8, 16]}, make, "bmm", wc.WideConfig(cache=False),
        ...                           budget=Budget(5.0))
        >>> choice.source, choice.reason.split(":")[0] in ("measured", "kept default")
        ('measured', True)
    """
    because = f"default (heuristic: {heuristic or default})"
    if not config.tune:
        return Choice(default, None, because + "; tuning off", "heuristic")
    # The default is in the key: a pick is relative to it (a candidate must beat it by the margin).
    key = cache_key(op, **key_fields, default=default,
                    **({"strategies": sorted(names)} if names is not None else {}))
    hit = lookup(key, config)
    if hit is not None:
        if names is None or hit["strategy"] in names:
            log.debug("wide_compiler: strategy cache hit for %s: %s", op, hit["strategy"])
            if budget is not None:
                budget.cached += 1
            return Choice(hit["strategy"], hit.get("timings_ms"),
                          _describe_cached(hit["strategy"], default, hit.get("timings_ms")), "cached")
        log.warning("wide_compiler: the strategy cache %s names %r for %s, which offers %s; measuring "
                    "again", os.path.join(config.resolved_cache_dir(), _CACHE_FILE), hit["strategy"], op,
                    list(names))
    if budget is not None and budget.exhausted(MEASURE_SHARE):
        budget.give_up(where or op, op)
        if budget.deferred:  # Note [Tuning after the first runs]
            return Choice(default, None, because + f"; not measured yet: after the graph's first {budget.defer_runs} "
                          "runs", "budget")
        if budget.not_measured is not None:  # Note [Tuning that pays for itself]
            return Choice(default, None, because + "; not measured: the graph is too slow to tune in the budget",
                          "budget")
        return Choice(default, None, because + "; budget exhausted, not measured", "budget")
    times = _measure(make_candidates(), config.tune_repeats, budget, config.tune_margin)
    if times is None:
        budget.give_up(where or op, op)
        return Choice(default, None, because + "; budget exhausted while measuring", "budget")
    best, reason = _decide(times, default, config.tune_margin)
    timings = {k: statistics.median(v) for k, v in times.items()}
    if budget is not None:
        budget.measured += 1
    log.info("wide_compiler: %s strategy %s (%s)", op, best, reason)
    remember(key, {"strategy": best, "timings_ms": timings}, config)
    return Choice(best, timings, reason, "measured")


# --- the strategy pass ---------------------------------------------------------------------------
# Formerly fx/strategy.py: the pass and the measuring above are one concept, so one module.


def heuristic_reason(node: fx.Node, default: str) -> str:
    """Why ``default`` is the op's strategy when nothing is measured (the rules' heuristics)."""
    op = node.meta.get("wide_op", "")
    shapes = node.meta.get("wide_shapes", {})
    if op in ("wide.conv", "wide.conv_transpose"):
        weight = shapes.get("weight") or []
        few = len(weight) == 4 and weight[1] < 8 and not shapes.get("transposed")
        if default == "loop":
            if math.prod(weight) < 1 << 19 and few:
                return "loop: a 2-d dense conv with < 8 input channels, no max pool after it (Note [Stem layout])"
            return f"loop: member weight of {math.prod(weight):,} elements (>= 512K)"
        if default == "grouped_cl":
            if few and not shapes.get("inference"):
                return "grouped_cl: a 2-d dense conv with < 8 input channels, a max pool after it (Note [Stem layout])"
            return "grouped_cl: the eval graph's conv runs channels-last"
        if few:
            return f"{default}: a grouped/depthwise conv with < 8 channels per group stays channels-first (accuracy)"
        return f"{default}: one grouped conv for all members"
    if op == "wide.rnn" and default == "loop":
        return "loop: ATen's LSTM per member (oneDNN's fused kernel), members in parallel"
    if op == "wide.linear" and default == "bmm":
        return "bmm: one batched GEMM for all members"
    if default == "fused":
        return "fused: one kernel for all members"
    return f"{default}: the op's default"


def choose_strategies(graph: fx.Graph, n: int, config: WideConfig, *, training: bool,
                      dtype: torch.dtype, device: torch.device,
                      run_seconds: float | None = None, defer: bool = False) -> dict[str, dict[str, float] | None]:
    """The strategy pass: set the ``strategy`` kwarg of every tunable node of ``graph``; returns
    the measured timings (ms per candidate, or None when nothing was measured) by node name.

    A tunable node is one whose rule attached a :class:`~wide_compiler.fx.context.TuneSpec` as
    ``node.meta["wide_tune"]``. With ``config.strategy="auto"`` each is :func:`measure_strategy`'d
    under one :class:`Budget`: the forward for an eval graph (``training=False``), forward and
    backward for a train graph, where a strategy with a cheap forward can have a slow backward.
    Otherwise the forced strategy is used where the op offers it (``"batched"``: every op's
    default). ``run_seconds``: what one run of the graph takes, where known (the budget follows
    it: Note [Tuning that pays for itself]). ``defer``: measure per ``config.tune_after_runs``
    (Note [Tuning after the first runs]): nothing now, cached picks used. Left on the graph for ``WideModel.summary()`` and the model-level check:
    ``node.meta["wide_strategy_reason"]`` (why this strategy), ``node.meta["wide_tune_key"]``
    (the op's cache key) and ``graph.owning_module.meta["wide_tuning"]`` (the :class:`Budget`)."""
    opts = {"dtype": dtype, "device": device, "requires_grad": training}
    forced, matched = config.strategy, False
    timings_by_node: dict[str, dict[str, float] | None] = {}
    budget = (Budget(config.tune_budget_s, run_seconds, config.tune_after_runs if defer else 0)
              if config.tune and forced == "auto" else None)
    for node in graph.nodes:
        spec = node.meta.get("wide_tune")
        if spec is None:
            continue
        on_device = dict(spec.device_defaults).get(device.type)
        if on_device is not None and on_device != spec.default and on_device in spec.names:
            spec = node.meta["wide_tune"] = dataclasses.replace(spec, default=on_device)
        device_note = f" on {device.type}" if on_device == spec.default else ""
        if forced != "auto":
            name = spec.default if forced == "batched" else forced
            matched |= name in spec.names
            strategy, timings = (name if name in spec.names else spec.default), None
            reason = (f"forced: WideConfig.strategy={forced!r}" if strategy == name else
                      f"default (heuristic: {heuristic_reason(node, spec.default)}{device_note}); the op has no {forced!r}")
        else:
            key = {"n": n, **node.meta["wide_shapes"], "dtype": str(dtype), "device": str(device),
                   "train": training}
            choice = measure_strategy(
                node.meta["wide_op"], key, lambda spec=spec: _timed_calls(spec.make(n, opts), training),
                spec.default, config, spec.names, budget=budget, where=node.name,
                heuristic=heuristic_reason(node, spec.default) + device_note)
            strategy, timings, reason = choice.strategy, choice.timings_ms, choice.reason
            node.meta["wide_tune_key"] = cache_key(node.meta["wide_op"], **key, default=spec.default,
                                                   strategies=sorted(spec.names))
        node.update_kwarg("strategy", strategy)
        node.meta["wide_strategy_reason"] = reason
        timings_by_node[node.name] = timings
    if forced not in ("auto", "batched", "loop") and not matched:
        raise ValueError(f"WideConfig.strategy={forced!r}: no wide op of this model offers that "
                         "strategy; use 'auto', 'batched', 'loop' or an op's strategy name")
    owner = graph.owning_module
    if budget is not None and timings_by_node and owner is not None:  # a graph with ops to tune
        budget.finish()
        owner.meta["wide_tuning"] = budget
    return timings_by_node


def _leaves(out: torch.Tensor) -> list[torch.Tensor]:
    """The autograd leaves ``out`` depends on (the tensors its backward accumulates into)."""
    found, seen, todo = [], set(), [out.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if hasattr(fn, "variable"):  # an AccumulateGrad node
            found.append(fn.variable)
        todo.extend(f for f, _ in fn.next_functions)
    return found


def _timed_calls(candidates: dict[str, Any], training: bool) -> dict[str, Any]:
    """What tuning times per candidate: forward and backward in training, else the forward alone.

    The backward gets a dense random gradient laid out like the output, as the next op of a model
    hands one back; ``out.sum().backward()`` would hand one value expanded over the output
    (stride 0), which kernels treat differently (ATen's conv backward copies it into a dense
    tensor first, per member for the loop strategy). The leaves' ``.grad`` is cleared before each
    call, as ``optimizer.zero_grad()`` does in a training loop: the gradients are stored as they
    come, so a candidate whose gradient is not laid out like its parameter pays the copy
    (Note [Linear weight gradient layout])."""
    def train(fn):
        grad: list[torch.Tensor] = []
        leaves: list[torch.Tensor] = []

        def run():
            for t in leaves:
                t.grad = None
            out = fn()
            if not grad:
                grad.append(torch.randn_like(out))
                leaves.extend(_leaves(out))
            out.backward(grad[0])
        return run

    def infer(fn):
        def run():
            with torch.no_grad():
                return fn()
        return run

    return {name: (train if training else infer)(fn) for name, fn in candidates.items()}
