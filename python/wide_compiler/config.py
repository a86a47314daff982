"""Compile options: :class:`WideConfig` and its presets."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from pathlib import Path

from .ops import LOOP, WIDE_OPS

__all__ = ["WideConfig", "known_strategies"]


def known_strategies() -> frozenset[str]:
    """Every value ``WideConfig.strategy`` accepts: ``"auto"``, ``"batched"``, ``"loop"`` and
    every strategy a wide op offers (the op table, :mod:`wide_compiler.ops`, which the rules read
    too; config sits below the compiler and imports nothing of fx).

    >>> import wide_compiler as wc
    >>> {"auto", "batched", "loop", "bmm"} <= wc.config.known_strategies()
    True
    """
    return frozenset({"auto", "batched", LOOP}).union(*(op.strategies for op in WIDE_OPS.values()))


@dataclasses.dataclass(frozen=True)
class WideConfig:
    """Options of :func:`wide_compiler.compile`.

    Args:
        strategy: ``"auto"`` lets each wide op choose (measured when ``tune`` is on, a heuristic
            otherwise); ``"batched"`` forces every op's one-kernel strategy (linear ``bmm``, conv
            ``grouped``, layer norm ``fused``), ``"loop"`` every op's loop over members; an op's
            own strategy name (``"bmm"``, ``"grouped"``, ...) forces it on the ops that offer it
            (the others run batched).
        tune: time each op's candidate strategies on the sample shapes (when: ``tune_after_runs``)
            and keep the fastest (cached on disk), then check the picks on the whole graph (the
            model-level check). Off: each op's heuristic default (batched GEMM, grouped conv).
        tune_repeats: timed rounds per op (each runs every candidate once, interleaved; the
            median per-round speedup over the default decides).
        tune_margin: a non-default candidate must be this much faster than the default to be
            chosen (0.1 = 10%), and a tuned graph this much faster than the defaults to be kept,
            so noise does not flip choices: within the margin the default wins.
        tune_budget_s: seconds of measuring allowed per compiled graph (train and eval are
            compiled separately); None: no limit. Ops are measured until 70% of it is spent, the
            model-level check gets the rest; ops left unmeasured keep their default, the give-up
            is logged once and ``summary()`` says so, and a later compile measures them (cached
            picks cost nothing). The default, 5 s: a first compile of an 8-member ResNet-style
            CNN (train graph, sample ``[32, 3, 32, 32]``) on a busy shared 2-core machine took
            2-11 s with it (at most 6 s measuring: the clock is read after every call, so the
            budget overruns by one call), 2-54 s with None, 0.5-4 s with ``fast()`` (README
            "Quick start"). A busy machine measures faster with ``OMP_WAIT_POLICY=PASSIVE`` set
            before torch loads.
        tune_after_runs: when the measuring happens. None (the default): after the graph's first
            runs, enough that the measuring costs at most a fifth of the time they took (80-250
            runs; Note [Tuning after the first runs] in tuning.py), at a call boundary, so a compile
            measures nothing and a short run never pays for tuning; picks already in the strategy
            cache are used from the start. 0: at compile time. k >= 1: after k runs.
            :meth:`~wide_compiler.WideModel.tune` measures at once.
        cache: read/write the strategy cache on disk (off: the compile cache is off too).
        compile_cache: keep each compiled graph (captured, widened, with its strategies and guards)
            on disk under a key of everything it depends on, so that a second compile of the same
            model, in this process or another, skips capture and widening (Note [The compile
            cache] in fx/compile_cache.py; docs/internals.md). Also off with the environment
            variable ``WIDE_COMPILE_CACHE=0``, or ``trace_members``.
        cache_dir: where the cache lives; default ``$WIDE_COMPILER_CACHE_DIR`` or
            ``~/.cache/wide_compiler``.
        validate: after compiling, run the sample through the wide model and every member and
            raise :class:`~wide_compiler.ValidationError` if a member differs.
        strict: raise :class:`~wide_compiler.UnsupportedOperationError` for an op with no wide
            rule instead of running it through the per-member (vmap/loop) fallback.
        run_members: run every member once on the sample (no gradients; buffers untouched) and
            compare the ATen ops it runs and their non-tensor arguments with member 0's: catches
            members whose forward reads different Python constants (globals, closures, class
            attributes) at the cost of N small forwards. On by default.
        trace_members: export every member and compare the traced programs with member 0's
            (slower compile; catches members whose forward reads different Python constants that
            are not module attributes). Module attributes are always compared.
        rtol, atol: tolerances of ``validate``, used only when either differs from its default: at
            the defaults a float32 model is judged against a float64 run of its members (Note [The
            float64 reference] in _equivalence/reference.py), other dtypes within :func:`wide_compiler.testing.tolerance`.
        member_tile: run the graph on chunks of this many members, one chunk after the other
            (Note [Member tiles] in fx/tiling.py: members whose activations are large and ops
            small run faster in chunks whose activations stay in cache); the last chunk may be
            smaller. None (the default): measured at compile time when ``tune`` is on, on a CPU,
            and kept only when faster by more than ``tune_margin``; 0: never; k >= 1: always, by k.
        defer: compile without capturing: each member runs its own program on its slices of the
            stacked weights (exact by construction) until compiling a mode's graph pays, judged from
            the calls the run still expects (:meth:`~wide_compiler.WideModel.expect_calls`, which the
            Lightning and transformers integrations call from their trainers' step counts; without
            it the first call compiles). For short runs, where a capture costs more than fusing
            saves (Note [Running the members until compiling pays] in model_deferred.py). Members
            with per-member constants or registered wide forms, one member, ``pad``, ``validate``
            and ``compile_model`` compile at once.

    Example:
        >>> import wide_compiler as wc
        >>> wc.WideConfig.fast().tune
        False
        >>> wc.WideConfig(strategy="loop").strategy
        'loop'
    """

    strategy: str = "auto"
    tune: bool = True
    tune_repeats: int = 7
    tune_margin: float = 0.1
    tune_budget_s: float | None = 5.0
    tune_after_runs: int | None = None
    cache: bool = True
    cache_dir: str | None = None
    validate: bool = False
    strict: bool = False
    run_members: bool = True
    trace_members: bool = False
    rtol: float = 1e-4
    atol: float = 1e-5
    member_tile: int | None = None
    compile_cache: bool = True
    defer: bool = False

    def __post_init__(self) -> None:
        tile = self.member_tile
        if tile is not None and (isinstance(tile, bool) or not isinstance(tile, int) or tile < 0):
            raise ValueError(f"WideConfig.member_tile: expected None (measured), 0 (never) or a number of "
                             f"members >= 1, got {tile!r}")
        after = self.tune_after_runs
        if after is not None and (isinstance(after, bool) or not isinstance(after, int) or after < 0):
            raise ValueError(f"WideConfig.tune_after_runs: expected None (after the graph's first runs), 0 (at "
                             f"compile time) or a number of runs >= 1, got {after!r}")
        if not isinstance(self.defer, bool):
            raise ValueError(f"WideConfig.defer: expected True or False, got {self.defer!r}")
        known = known_strategies()
        if self.strategy not in known:
            raise ValueError(f"WideConfig.strategy: expected one of {sorted(known)}, got {self.strategy!r}")
        if isinstance(self.tune_repeats, bool) or not isinstance(self.tune_repeats, int) or self.tune_repeats < 1:
            raise ValueError(f"WideConfig.tune_repeats: expected an int >= 1, got {self.tune_repeats!r}")
        if (isinstance(self.tune_margin, bool) or not isinstance(self.tune_margin, (int, float))
                or not 0 <= self.tune_margin < 1):
            raise ValueError(f"WideConfig.tune_margin: expected a fraction in [0, 1) (0.1 = 10%), got "
                             f"{self.tune_margin!r}")
        budget = self.tune_budget_s
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                                   or math.isnan(budget) or budget <= 0):
            raise ValueError(f"WideConfig.tune_budget_s: expected seconds > 0 (or None for no limit), got "
                             f"{budget!r}; WideConfig(tune=False) or WideConfig.fast() skips measuring")

    @classmethod
    def default(cls) -> WideConfig:
        """Measured strategies, cached on disk; no validation."""
        return cls()

    @classmethod
    def fast(cls) -> WideConfig:
        """Fastest compile: no timing at compile time, heuristic strategies."""
        return cls(tune=False)

    @classmethod
    def debug(cls) -> WideConfig:
        """For finding problems: validate every member, strict, no tuning and no cache."""
        return cls(tune=False, cache=False, validate=True, strict=True, trace_members=True)

    @classmethod
    def safe(cls) -> WideConfig:
        """Production with checks: measured strategies, every member traced and validated, strict."""
        return cls(validate=True, strict=True, trace_members=True)

    def replace(self, **changes) -> WideConfig:
        """A copy with some fields changed: ``cfg.replace(validate=True)``."""
        return dataclasses.replace(self, **changes)

    def resolved_cache_dir(self) -> Path:
        """The directory of the strategy cache."""
        if self.cache_dir is not None:
            return Path(self.cache_dir)
        env = os.environ.get("WIDE_COMPILER_CACHE_DIR")
        if env:
            return Path(env)
        return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "wide_compiler"


# WideCompiler 0.x field names -> where that option lives now (refused with this pointer rather
# than accepted with a different meaning).
_SEED_FIELDS = {
    "compile": "wide_compiler.compile(..., compile_model=True) (or WideBuilder(...).compile())",
    "compile_mode": "wide_compiler.compile(..., compile_model=True, compile_options={'mode': ...})",
    "validate_rtol": "WideConfig(rtol=...) (and atol=...)",
    "debug": "WideConfig.debug() (validate, strict, every member traced, no tuning)",
}
_dataclass_init = WideConfig.__init__


@functools.wraps(_dataclass_init)
def _init(self: WideConfig, *args, **kwargs) -> None:
    seed = [k for k in kwargs if k in _SEED_FIELDS]
    if seed:
        raise TypeError("WideConfig: " + "; ".join(f"{k!r} is a WideCompiler 0.x field, now {_SEED_FIELDS[k]}"
                                                    for k in seed))
    _dataclass_init(self, *args, **kwargs)


WideConfig.__init__ = _init
