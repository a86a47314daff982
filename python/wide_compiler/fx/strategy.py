"""The strategy pass: choose each wide op's strategy (DESIGN §5).

A rule that emits a wide op with strategies attaches a :class:`~.widen.TuneSpec` as
``node.meta["wide_tune"]``; this pass writes the chosen name into the node's ``strategy`` kwarg.
With ``WideConfig.strategy="auto"`` the candidates are measured on the sample shapes (see
tuning.py, cached on disk): the forward for an eval graph, forward and backward for a train
graph, where a strategy with a cheap forward can have a slow backward. Measuring one graph is
bounded by ``WideConfig.tune_budget_s``.

What the pass leaves for ``WideModel.summary()`` and the model-level check:
``node.meta["wide_strategy_reason"]`` (why this strategy), ``node.meta["wide_tune_key"]`` (the
op's cache key) and ``graph_module.meta["wide_tuning"]`` (the graph's :class:`~..tuning.Budget`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import fx

from .. import tuning
from ..config import WideConfig

__all__ = ["choose_strategies", "heuristic_reason"]


def heuristic_reason(node: fx.Node, default: str) -> str:
    """Why ``default`` is the op's strategy when nothing is measured (the rules' heuristics)."""
    op = node.meta.get("wide_op", "")
    shapes = node.meta.get("wide_shapes", {})
    if op in ("wide.conv", "wide.conv_transpose"):
        weight = shapes.get("weight") or []
        if default == "loop":
            return f"loop: member weight of {math.prod(weight):,} elements (>= 512K)"
        if default == "grouped_cl":
            if len(weight) == 4 and weight[1] < 8 and not shapes.get("transposed"):
                return "grouped_cl: a 2-d dense conv with < 8 input channels (accurate weight gradients)"
            return "grouped_cl: the eval graph's conv runs channels-last"
        if len(weight) == 4 and weight[1] < 8 and not shapes.get("transposed"):
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
                      dtype: torch.dtype, device: torch.device) -> dict[str, dict[str, float] | None]:
    """Set the ``strategy`` kwarg of every tunable node of ``graph``; returns the measured
    timings (ms per candidate, or None when nothing was measured) by node name."""
    opts = {"dtype": dtype, "device": device, "requires_grad": training}
    forced, matched = config.strategy, False
    timings_by_node: dict[str, dict[str, float] | None] = {}
    budget = tuning.Budget(config.tune_budget_s) if config.tune and forced == "auto" else None
    for node in graph.nodes:
        spec = node.meta.get("wide_tune")
        if spec is None:
            continue
        if forced != "auto":
            name = spec.default if forced == "batched" else forced
            matched |= name in spec.names
            strategy, timings = (name if name in spec.names else spec.default), None
            reason = (f"forced: WideConfig.strategy={forced!r}" if strategy == name else
                      f"default (heuristic: {heuristic_reason(node, spec.default)}); the op has no {forced!r}")
        else:
            key = {"n": n, **node.meta["wide_shapes"], "dtype": str(dtype), "device": str(device),
                   "train": training}
            choice = tuning.measure_strategy(
                node.meta["wide_op"], key, lambda spec=spec: _timed_calls(spec.make(n, opts), training),
                spec.default, config, spec.names, budget=budget, where=node.name,
                heuristic=heuristic_reason(node, spec.default))
            strategy, timings, reason = choice.strategy, choice.timings_ms, choice.reason
            node.meta["wide_tune_key"] = tuning.cache_key(node.meta["wide_op"], **key,
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
