"""The one timing loop of wide_compiler: a clock tests can fake, interleaved rounds, medians.

Every measurement in the package (the strategy tuner, the model-level tuning check,
``analyze``, the benchmarks, the CLI's self-test) reads :func:`now` and times calls with
:func:`interleave` (or :func:`time_interleaved`, which calibrates the block sizes first).

Note [Interleaved timing]: callables timed one after another on a machine whose speed drifts
over seconds (other processes, frequency scaling, a noisy neighbour) give ratios that say more
about the drift than about the callables. :func:`interleave` instead runs ``rounds`` rounds; in
every round each callable runs one block (its optional ``setup``, ``block_warmup`` untimed
calls, then ``per_block`` samples of ``calls`` calls each), in an order chosen so that no
callable keeps following the same one: what a block leaves behind (caches, the heap, pages
returned to the system) otherwise always hits the same next callable. Measured: with a rotation
by one per round, two WideModels running the same graph in `benchmark models` took 62-68 and
52-58 ms per training step, the one timed after vmap's blocks in every round being the slower
(2026-11-26). Reversing every other round did not cure it: a rotation's last callable precedes
the reversed next round's first, so with 5 callables and 3 rounds (ResNet-18 at N=16) the first
wide model still followed vmap in all three, and measured 672-723 ms against 614-665 ms for the
same graph (2026-11-27). So each round takes, of the orders that step through the callables by
a stride coprime to their number (rotations, their reverses, and the others), the one whose
(predecessor, callable) pairs were seen least so far, its first callable's predecessor being the
last of the round before (:func:`_round_orders`). And :func:`time_interleaved` starts each block
of a single call (slow callables) with one untimed call, which pays what the block before left
behind. Drift then hits every callable of a round
alike: medians over rounds, or the median of per-round ratios (the tuner's paired speedup), hold
far better. Garbage collection is off while a sample runs (as ``timeit`` does), and the clock
is read around every call, warm-up calls included, so a ``stop`` predicate (a time budget) is
asked after every call and overruns by one call at most.

Note [Fake clock]: :data:`_clock` is the clock every measurement reads (through :func:`now`);
tests replace it (``monkeypatch.setattr(wide_compiler.measure.timing, "_clock", fake)``) with
a clock that moves only when the faked callables advance it, so no assertion depends on the
speed of the machine.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
import statistics
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["Rounds", "Stopwatch", "TimingError", "error_text", "fmt_ms", "fmt_x", "interleave",
           "now", "time_interleaved", "time_with_baselines"]

log = logging.getLogger(__name__)

#: The clock of every measurement, in seconds (Note [Fake clock]: tests replace it).
_clock: Callable[[], float] = time.perf_counter


def now() -> float:
    """Seconds on the clock of every measurement (:data:`_clock`; Note [Fake clock]).

    >>> t0 = now(); now() >= t0
    True
    """
    return _clock()


class Stopwatch:
    """Seconds since it was made (or :meth:`restart`), on the measuring clock: the one way the
    package times a stage (a compile, a self-check) outside a timing loop.

    >>> sw = Stopwatch(); sw.seconds >= 0 and sw.ms >= 0
    True
    """

    def __init__(self) -> None:
        self.start = now()

    def restart(self) -> None:
        self.start = now()

    @property
    def seconds(self) -> float:
        return now() - self.start

    @property
    def ms(self) -> float:
        return 1e3 * self.seconds


def error_text(e: BaseException) -> str:
    """The first line of ``"Type: message"`` (300 characters at most): how a failed contender is
    reported in records and tables.

    >>> error_text(ValueError("bad\\nmore"))
    'ValueError: bad'
    """
    text = f"{type(e).__name__}: {e}".strip()
    first = text.splitlines()[0] if text else type(e).__name__
    return first[:300]


class TimingError(RuntimeError):
    """A callable timed by :func:`interleave` raised: ``name`` is its key, ``error`` (also
    ``__cause__``) what it raised."""

    def __init__(self, name: Any, error: BaseException) -> None:
        super().__init__(f"{name}: {error_text(error)}")
        self.name = name
        self.error = error


@dataclasses.dataclass
class Rounds:
    """What :func:`interleave` measured: ``samples[name]`` is the seconds per call of each
    sample, in the order taken; ``complete`` is False when ``stop`` ended the rounds early."""

    samples: dict[Any, list[float]]
    complete: bool = True

    def medians_ms(self) -> dict[Any, float]:
        """Median milliseconds per call of every callable that has samples."""
        return {k: 1e3 * statistics.median(v) for k, v in self.samples.items() if v}


def _synchronize() -> None:
    """Wait for queued CUDA work (once CUDA is in use): a sample times what its calls computed,
    not what they queued."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _timed_calls(fn: Callable[[], Any], calls: int) -> float:
    """Seconds that ``calls`` calls of ``fn`` take, garbage collection off (as ``timeit``)."""
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        _synchronize()
        start = now()
        for _ in range(calls):
            fn()
        _synchronize()
        return now() - start
    finally:
        if gc_was_enabled:
            gc.enable()


def interleave(fns: Mapping[Hashable, Callable[[], Any]], rounds: int, *,
               calls: int | Mapping[Hashable, int] = 1, warmup: int = 0, per_block: int = 1,
               block_warmup: int = 0, rotate: bool = True,
               setup: Callable[[Hashable], Any] | None = None,
               stop: Callable[[], bool] | None = None) -> Rounds:
    """Time ``fns`` in interleaved rounds (Note [Interleaved timing]); the package's one loop.

    First ``warmup`` untimed calls of each callable (in order). Then ``rounds`` rounds: each
    callable, in turn (in an order that changes every round when ``rotate``, so that none keeps
    following the same one: :func:`_round_orders`), runs one block:
    ``setup(name)`` when given, ``block_warmup`` untimed calls, then ``per_block`` samples; a
    sample is ``calls`` calls (an int, or one per name) timed together, recorded as seconds per
    call. ``stop()`` is asked after every call of a warm-up and after every sample; when it says
    True the rounds end and the result is marked incomplete. A callable that raises raises
    :class:`TimingError` naming it.

    >>> r = interleave({"a": lambda: None, "b": lambda: None}, 3, warmup=1)
    >>> sorted(r.samples), [len(v) for v in r.samples.values()], r.complete
    (['a', 'b'], [3, 3], True)
    """
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    names = list(fns)
    per_name = calls if isinstance(calls, Mapping) else dict.fromkeys(names, calls)
    samples: dict[Hashable, list[float]] = {name: [] for name in names}

    def timed(name: Hashable, n: int) -> float:
        try:
            return _timed_calls(fns[name], n)
        except Exception as e:  # re-raised, naming the callable
            raise TimingError(name, e) from e

    def stopped() -> bool:
        return stop is not None and stop()

    for name in names:
        for _ in range(warmup):
            timed(name, 1)
            if stopped():
                return Rounds(samples, complete=False)
    for order in (_round_orders(names, rounds) if rotate else [names] * rounds):
        for name in order:
            if setup is not None:
                setup(name)
            for _ in range(block_warmup):
                timed(name, 1)
                if stopped():
                    return Rounds(samples, complete=False)
            k = per_name[name]
            for _ in range(per_block):
                samples[name].append(timed(name, k) / k)
                if stopped():
                    return Rounds(samples, complete=False)
    return Rounds(samples)


def _round_orders(names: list, rounds: int) -> Iterator[list]:
    """The order of each round (Note [Interleaved timing]): of the orders stepping through
    ``names`` by a stride coprime to their number, from any start (reversed orders included),
    the one whose (predecessor, callable) pairs were seen least (their largest count, then their
    sum; ties: the first), the first callable's predecessor being the previous round's last
    (``names[-1]`` for the first round: the warm-up and calibration run in ``names`` order).

    >>> list(_round_orders(["a", "b", "c", "d", "e"], 3))  # "a" follows "e", then "d", then "c"
    [['a', 'b', 'c', 'd', 'e'], ['b', 'd', 'a', 'c', 'e'], ['c', 'a', 'd', 'b', 'e']]
    """
    k = len(names)
    candidates = [[names[(start + j * step) % k] for j in range(k)]
                  for step in range(1, max(k, 2)) if math.gcd(step, k) == 1 for start in range(k)] or [names]
    seen: Counter = Counter()
    last = names[-1] if names else None
    for _ in range(rounds):
        def cost(order: list) -> tuple[int, int]:
            counts = [seen[pair] for pair in zip([last, *order[:-1]], order)]
            return max(counts, default=0), sum(counts)
        best = min(candidates, key=cost)
        seen.update(zip([last, *best[:-1]], best))
        last = best[-1] if best else last
        yield best


def _calibrated(fns: Mapping[Hashable, Callable[[], Any]], min_run_time: float, rounds: int,
                warmup: int, min_rounds: int) -> dict[Hashable, float]:
    """Median ms per call, raising :class:`TimingError` (see :func:`time_interleaved`)."""
    names = list(fns)
    block_s = min_run_time / rounds
    per_call: dict[Hashable, float] = {}
    for name in names:
        one = {name: fns[name]}
        if warmup > 0:
            interleave(one, 1, calls=warmup)
        calls = 1
        elapsed = interleave(one, 1).samples[name][0]
        while elapsed < block_s / 4 and calls < 1 << 20:  # a few calls: enough to calibrate
            calls *= 2
            elapsed = interleave(one, 1, calls=calls).samples[name][0] * calls
        per_call[name] = max(elapsed / calls, 1e-9)
    k = {name: max(1, round(block_s / per_call[name])) for name in names}
    slowest = max(per_call.values())
    n_rounds = min(rounds, max(min(min_rounds, rounds), int(min_run_time / slowest)))
    return interleave(fns, n_rounds, calls=k, block_warmup=int(min(k.values()) == 1)).medians_ms()


def time_interleaved(fns: Mapping[Hashable, Callable[[], Any]], *, min_run_time: float = 0.2,
                     rounds: int = 10, warmup: int = 2, min_rounds: int = 3,
                     errors: dict[Hashable, str] | None = None) -> dict[Hashable, float]:
    """Median wall time of one call of each of ``fns``, in milliseconds, timed interleaved.

    Every callable is called ``warmup`` times, then calibrated: ``k`` calls per block so that one
    block takes about ``min_run_time / rounds`` seconds (at least one call). Then
    :func:`interleave` runs ``rounds`` rounds of one block each, in changing orders (where a
    block is one call, an untimed call starts every block: Note [Interleaved timing]); the result is each
    one's median over the rounds of block time / ``k``. Each callable runs about
    ``min_run_time`` seconds in all; when one call of the slowest takes longer than
    ``min_run_time / rounds``, fewer rounds are run (``min_run_time`` over that call, at least
    ``min(min_rounds, rounds)``). A callable that raises raises :class:`TimingError` naming it;
    with ``errors`` (a dict, updated in place) it is left out instead (its message in
    ``errors``, a log warning) and the rest are timed again.

    >>> import torch
    >>> ms = time_interleaved({"sum": lambda: torch.ones(4).sum(),
    ...                        "mm": lambda: torch.ones(64, 64) @ torch.ones(64, 64)},
    ...                       min_run_time=0.01)
    >>> sorted(ms), all(v > 0 for v in ms.values())
    (['mm', 'sum'], True)
    """
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    fns = dict(fns)
    while True:
        if not fns:
            return {}
        try:
            return _calibrated(fns, min_run_time, rounds, warmup, min_rounds)
        except TimingError as e:
            if errors is None:
                raise
            log.warning("%s failed: %s", e.name, error_text(e.error))
            errors[e.name] = error_text(e.error)
            del fns[e.name]


def time_with_baselines(wides: Mapping[Any, Callable[[], Any]],
                        baselines: Mapping[str, Callable[[], Any]], *, min_run_time: float = 0.2,
                        errors: dict[str, str] | None = None
                        ) -> tuple[dict[Any, float], dict[str, float], dict[str, str]]:
    """:func:`time_interleaved` of the wide callables and the baselines together; returns
    ``(wide_ms, baseline_ms, errors)``. A baseline that raises is left out (its message in
    ``errors``, which is updated in place when given, and a log warning) and the rest are timed
    again; a wide callable that raises propagates what it raised.

    >>> import torch
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
            log.warning("baseline %s failed: %s", name, error_text(e.error))
            errors[name] = error_text(e.error)
            del fns[e.name]
    wide_ms = {k: ms["wide", k] for k in wides}
    baseline_ms = {k: ms["baseline", k] for k in baselines if ("baseline", k) in ms}
    return wide_ms, baseline_ms, errors


def fmt_ms(v: float | None) -> str:
    """Milliseconds for a table: 3 decimals below 10, 1 below 1000, none above; ``-`` for
    missing or NaN.

    >>> fmt_ms(0.21), fmt_ms(12.34), fmt_ms(None)
    ('0.210', '12.3', '-')
    """
    if v is None or (isinstance(v, float) and v != v):
        return "-"
    return f"{v:.3f}" if v < 10 else f"{v:.1f}" if v < 1000 else f"{v:.0f}"


def fmt_x(v: float | None) -> str:
    """A speedup for a table (``2.50x``); ``-`` for missing or NaN.

    >>> fmt_x(2.5), fmt_x(12.0)
    ('2.50x', '12.0x')
    """
    if v is None or (isinstance(v, float) and v != v):
        return "-"
    return f"{v:.2f}x" if v < 10 else f"{v:.1f}x"
