"""The strategy pass: choose each wide op's strategy (DESIGN §5).

A rule that emits a wide op with strategies attaches a :class:`~.widen.TuneSpec` as
``node.meta["wide_tune"]``; this pass writes the chosen name into the node's ``strategy`` kwarg.
With ``WideConfig.strategy="auto"`` the candidates are measured on the sample shapes (see
tuning.py, cached on disk): the forward for an eval graph, forward and backward for a train
graph, where a strategy with a cheap forward can have a slow backward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from .. import tuning
from ..config import WideConfig

__all__ = ["choose_strategies"]


def choose_strategies(graph: fx.Graph, n: int, config: WideConfig, *, training: bool,
                      dtype: torch.dtype, device: torch.device) -> dict[str, dict[str, float] | None]:
    """Set the ``strategy`` kwarg of every tunable node of ``graph``; returns the measured
    timings (ms per candidate, or None when nothing was measured) by node name."""
    opts = {"dtype": dtype, "device": device, "requires_grad": training}
    forced, matched = config.strategy, False
    timings_by_node: dict[str, dict[str, float] | None] = {}
    for node in graph.nodes:
        spec = node.meta.get("wide_tune")
        if spec is None:
            continue
        if forced != "auto":
            name = spec.default if forced == "batched" else forced
            matched |= name in spec.names
            strategy, timings = (name if name in spec.names else spec.default), None
        else:
            key = {"n": n, **node.meta["wide_shapes"], "dtype": str(dtype), "device": str(device),
                   "train": training}
            strategy, timings = tuning.choose_strategy(
                node.meta["wide_op"], key, lambda spec=spec: _timed_calls(spec.make(n, opts), training),
                spec.default, config, spec.names)
        node.update_kwarg("strategy", strategy)
        timings_by_node[node.name] = timings
    if forced not in ("auto", "batched", "loop") and not matched:
        raise ValueError(f"WideConfig.strategy={forced!r}: no wide op of this model offers that "
                         "strategy; use 'auto', 'batched', 'loop' or an op's strategy name")
    return timings_by_node


def _timed_calls(candidates: dict[str, Any], training: bool) -> dict[str, Any]:
    """What tuning times per candidate: forward and backward in training, else the forward alone."""
    def train(fn):
        return lambda: fn().sum().backward()

    def infer(fn):
        def run():
            with torch.no_grad():
                return fn()
        return run

    return {name: (train if training else infer)(fn) for name, fn in candidates.items()}
