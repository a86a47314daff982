"""The guard against optimizers that hold parameters grouping replaced: a global optimizer step
pre-hook that refuses to step one while its router is alive (stepping it would train nothing)."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

if TYPE_CHECKING:
    from .core import WideRouter

__all__: list[str] = []

# -- optimizers holding parameters that grouping replaced -------------------------------------
# id(parameter) -> (weak ref to it, weak ref to its router, why it is stale). A global optimizer
# step pre-hook refuses to step an optimizer that holds one of them while its router is alive:
# such a parameter no longer takes part in the router's forward, so its step would train nothing.
_retired: dict[int, tuple[weakref.ref, weakref.ref, str]] = {}
_retired_version = [0]
_checked_optimizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_retired_lock = threading.Lock()
_hook_handle: list[Any] = []


def _retire(tensors: Iterable[torch.Tensor], router: WideRouter, why: str) -> None:
    """Mark ``tensors`` as no longer ``router``'s live parameters (see :func:`_check_optimizer`)."""
    rref = weakref.ref(router)
    with _retired_lock:
        for t in tensors:
            k = id(t)

            def gone(r: weakref.ref, k: int = k) -> None:
                entry = _retired.get(k)
                if entry is not None and entry[0] is r:
                    _retired.pop(k, None)

            _retired[k] = (weakref.ref(t, gone), rref, why)
        _retired_version[0] += 1
        if not _hook_handle:
            _hook_handle.append(register_optimizer_step_pre_hook(_check_optimizer))


def _revive(tensors: Iterable[torch.Tensor]) -> None:
    """Undo :func:`_retire` (a tower ungrouped: its own parameters are live again)."""
    with _retired_lock:
        for t in tensors:
            entry = _retired.get(id(t))
            if entry is not None and entry[0]() is t:
                del _retired[id(t)]
        _retired_version[0] += 1


def _check_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global optimizer step pre-hook (registered at the first grouping): raise when the optimizer
    holds a parameter that a live router's grouping (or ungrouping) replaced, whatever mode the
    grouping ran in. Cached per optimizer: a step costs a few dict lookups unless the optimizer's
    parameters or the set of replaced parameters changed."""
    if not _retired:
        return
    groups = optimizer.param_groups
    stamp = (_retired_version[0], len(groups), sum(len(g["params"]) for g in groups))
    try:
        if _checked_optimizers.get(optimizer) == stamp:
            return
    except TypeError:  # cannot be weakly referenced: checked at every step
        pass
    stale: dict[str, int] = {}
    for g in groups:
        for p in g["params"]:
            entry = _retired.get(id(p))
            if entry is not None and entry[0]() is p and entry[1]() is not None:
                stale[entry[2]] = stale.get(entry[2], 0) + 1
    if stale:
        what = "; ".join(f"{n} {why}" for why, n in stale.items())
        raise RuntimeError(
            f"WideRouter: this {type(optimizer).__name__} holds parameters that are no longer the router's "
            f"live parameters ({what}), so stepping it would train nothing. Create the optimizer after "
            "grouping: call router.prepare_for_compile(sample_input) (or run one wide_forward) first, then "
            "build it from router.parameters(). To train a tower module on its own, take a fresh copy "
            "with router.unfuse()[name]")
    try:
        _checked_optimizers[optimizer] = stamp
    except TypeError:
        pass
