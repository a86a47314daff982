"""Measured strategy choice for wide operators, cached on disk.

Each wide op offers several strategies (``torch.ops.wide.linear``: ``bmm`` or ``loop``). At compile
time :func:`choose_strategy` times each candidate on the sample shapes (a few warm-up calls, then
the median of ``config.tune_repeats`` timed calls) and keeps the fastest; the default candidate
wins unless another is faster by ``config.tune_margin``, so timing noise does not flip choices.
Results are cached in ``<cache_dir>/strategies.json`` keyed by op, shapes, dtype, device, thread
count and library versions, so a second compile of the same shapes costs nothing.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .config import WideConfig

__all__ = ["choose_strategy", "cache_key"]

log = logging.getLogger(__name__)
_CACHE_FILE = "strategies.json"


def cache_key(op: str, **fields: Any) -> str:
    """The cache key of one tuning problem: op, the caller's fields, and the machine/version facts
    a measurement depends on."""
    from . import __version__

    full = dict(fields, op=op, threads=torch.get_num_threads(), torch=torch.__version__, wide=__version__)
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


def _median_ms(candidates: Mapping[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median wall time (ms) of each candidate. All are warmed up first (first calls pay one-time
    library initialisation) and then timed round-robin, so drift hits every candidate alike."""
    for fn in candidates.values():
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn()
            times[name].append(1e3 * (time.perf_counter() - start))
    return {name: statistics.median(t) for name, t in times.items()}


def choose_strategy(
    op: str,
    key_fields: Mapping[str, Any],
    make_candidates: Callable[[], Mapping[str, Callable[[], Any]]],
    default: str,
    config: WideConfig,
    names: Sequence[str] | None = None,
) -> tuple[str, dict[str, float] | None]:
    """Pick the fastest strategy. ``make_candidates()`` returns ``{name: zero-argument callable
    running the op with that strategy}`` (forward only, or forward and backward: the caller
    decides); it is called only when something must be measured.

    ``names``: the op's strategies; a cache entry naming another (a stale cache) is measured again.

    Returns ``(strategy, timings_ms)``; ``timings_ms`` is ``None`` when nothing was measured
    (tuning off, forced strategy). Example:

        >>> import torch, wide_compiler as wc
        >>> from wide_compiler.tuning import choose_strategy
        >>> x, w = torch.randn(4, 8, 16), torch.randn(4, 32, 16)
        >>> make = lambda: {s: (lambda s=s: torch.ops.wide.linear(x, w, strategy=s)) for s in ("bmm", "loop")}
        >>> choose_strategy("linear", {"x": [4, 8, 16]}, make, "bmm", wc.WideConfig(tune=False))
        ('bmm', None)
        >>> choose_strategy("linear", {"x": [4, 8, 16]}, make, "bmm", wc.WideConfig(cache=False))[0] in ("bmm", "loop")
        True
    """
    if not config.tune:
        return default, None
    key = cache_key(op, **key_fields, **({"strategies": sorted(names)} if names is not None else {}))
    path = os.path.join(config.resolved_cache_dir(), _CACHE_FILE)
    if config.cache:
        hit = _load(path).get(key)
        if isinstance(hit, dict) and isinstance(hit.get("strategy"), str):
            if names is None or hit["strategy"] in names:
                log.debug("wide_compiler: strategy cache hit for %s: %s", op, hit["strategy"])
                return hit["strategy"], hit.get("timings_ms")
            log.warning("wide_compiler: the strategy cache %s names %r for %s, which offers %s; measuring "
                        "again", path, hit["strategy"], op, list(names))
    timings = _median_ms(make_candidates(), config.tune_repeats)
    best = min(timings, key=timings.get)
    if best != default and timings[default] <= timings[best] * (1.0 + config.tune_margin):
        best = default
    log.info("wide_compiler: %s strategy %s (%s)", op, best,
             ", ".join(f"{k} {v:.3f} ms" for k, v in timings.items()))
    if config.cache:
        _store(path, key, {"strategy": best, "timings_ms": timings})
    return best, timings
