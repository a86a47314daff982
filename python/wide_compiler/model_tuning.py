"""A wide model's side of Note [Tuning after the first runs] (tuning.py): the graphs whose strategies
are measured after their first runs, counted at each call, and :meth:`DeferredTuningMixin.tune`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .fx.compilation import COMPILE_LOCK, Compilation
from .fx.state import WideState

if TYPE_CHECKING:
    from .fx.widen import WideGraph

__all__ = ["DeferredTuningMixin", "defer_tuning"]

log = logging.getLogger("wide_compiler.model")


@dataclasses.dataclass
class _Pending:
    """A graph measured later: its compilation (members dropped), after how many runs, and how
    many it has had."""

    c: Compilation
    after: int
    runs: int = 0


# id(graph) -> (a weak reference to it, its pending tuning). Weak: a graph dropped by a recapture or a
# dtype change takes its entry along. (WideGraph, a dataclass, is not hashable: keyed by id, checked
# by the reference.)
_PENDING: dict[int, tuple[weakref.ref, _Pending]] = {}


def _pending(wg: WideGraph) -> _Pending | None:
    entry = _PENDING.get(id(wg))
    return entry[1] if entry is not None and entry[0]() is wg else None


def _forget(key: int, ref: weakref.ref) -> None:
    entry = _PENDING.get(key)
    if entry is not None and entry[0] is ref:
        del _PENDING[key]


def defer_tuning(wg: WideGraph, c: Compilation, runs: int | None = None) -> None:
    """Make ``wg`` (compiled by ``c``) measured after its first runs when its strategy pass deferred
    the measuring (``c``'s tuning budget says so; ``runs``: how many runs are left, for a graph that
    replaces a pending one)."""
    budget = wg.graph_module.meta.get("wide_tuning")
    if runs is None and (budget is None or not budget.deferred):
        return
    after = runs if runs is not None else budget.defer_runs
    ref = weakref.ref(wg, lambda r, key=id(wg): _forget(key, r))
    _PENDING[id(wg)] = (ref, _Pending(dataclasses.replace(c, members=None, state=None, wide=None, log=[]),
                                      max(1, after)))  # (not the graph: the entry must not keep it alive)


def pending_runs(wg: WideGraph) -> int | None:
    """How many more runs ``wg`` has before it is measured (None: not pending)."""
    p = _pending(wg)
    return None if p is None else max(0, p.after - p.runs)


def _detached_state(state: WideState) -> WideState:
    """``state`` with the parameters as new leaves on the same storage (no hooks of the user's
    run during the measuring's backward; tied names stay one tensor) and the buffers cloned (the
    model's are never written)."""
    memo: dict[int, Any] = {}

    def leaf(p: torch.Tensor) -> nn.Parameter:
        if id(p) not in memo:
            memo[id(p)] = nn.Parameter(p.detach(), requires_grad=p.requires_grad)
        return memo[id(p)]

    def copy(b: torch.Tensor) -> torch.Tensor:
        if id(b) not in memo:
            memo[id(b)] = b.detach().clone()
        return memo[id(b)]

    return dataclasses.replace(state, parameters={k: leaf(p) for k, p in state.parameters.items()},
                               buffers={k: copy(b) for k, b in state.buffers.items()})


class DeferredTuningMixin:
    """Note [Tuning after the first runs]: the host class is a WideModel (``_graphs``,
    ``_variants``, ``_config``, ``_live_state()``, ``_ranges``, ``_timings``)."""

    def tune(self) -> Any:
        """Measure now the strategies of every graph of this model still waiting for its first runs
        (Note [Tuning after the first runs] in tuning.py: by default a graph is measured after
        them, not at compile time), and keep the result; returns the model. Each op's outputs are
        the same whatever its strategy, up to float rounding.

        >>> import torch, wide_compiler as wc
        >>> wide = wc.compile([torch.nn.Linear(8, 8) for _ in range(4)], torch.randn(16, 8),
        ...                   config=wc.WideConfig(cache=False))
        >>> "deferred" in wide.summary()
        True
        >>> "deferred" in wide.tune().summary()
        False
        """
        graphs = [*self._graphs.values(), *(g for gs in self._variants.values() for g in gs)]
        for wg in graphs:
            if _pending(wg) is not None:
                self._tune_graph(wg)
        return self

    def _count_run(self, wg: WideGraph) -> None:
        """One more run of ``wg`` (an eager call, not traced): measure it when its turn has come."""
        p = _pending(wg)
        if p is None:
            return
        p.runs += 1
        if p.runs >= p.after and torch._C._functorch.peek_interpreter_stack() is None \
                and not torch._C._len_torch_function_stack():
            self._tune_graph(wg)

    def _tune_graph(self, wg: WideGraph) -> None:
        """Run the strategy pass, the model-level check and the member-tile trial of ``wg`` now, on
        the live state (detached) and the capture sample; keep what they chose, store it in the
        compile cache. A failure keeps the strategies the graph had (logged), never fails a call."""
        from .fx import compile_cache  # Note [The compiler imported when it compiles]
        from .fx.pipeline import PASSES, run_pipeline

        ref = next(self.parameters(), None)
        device = ref.device.type if ref is not None else "cpu"
        # (inference_mode(False) turns grad mode on, as run_pipeline does; both put it back on exit)
        with COMPILE_LOCK, torch.inference_mode(False), torch.autocast(device, enabled=False):
            p = _pending(wg)
            if p is None:  # another thread measured it
                return
            del _PENDING[id(wg)]
            c = dataclasses.replace(p.c, wide=wg, config=self._config, state=_detached_state(self._live_state()),
                                    dtype=ref.dtype if ref is not None else None,
                                    device=ref.device if ref is not None else None,
                                    timings={}, log=[], defer_tuning=False)
            names = ("strategies", "check_tuning") + (("tile_members",) if c.ep is not None else ())
            try:
                run_pipeline(c, [q for q in PASSES if q.name in names])
            except Exception as e:  # noqa: BLE001 -- measuring speed never fails a call
                wg.graph_module.recompile()  # the strategies set so far, each exact
                log.warning("wide_compiler: measuring the strategies of the %s graph failed (%s: %s); it keeps "
                            "the strategies it had", "train" if c.training else "eval", type(e).__name__, e)
                return
            self._timings.update({(c.training, node): t for node, t in c.timings.items()})
            if c.cache_key is not None and c.ep is not None and id(wg) in self._ranges:
                with contextlib.suppress(Exception):  # the cache is an optimisation: store() logs its own failures
                    compile_cache.store(c, c.cache_key, self._ranges[id(wg)])
            budget = wg.graph_module.meta.get("wide_tuning")
            log.info("wide_compiler: %s graph measured after %d runs: %s", "train" if c.training else "eval",
                     p.runs, budget.describe() if budget is not None else "nothing to measure")
