"""Widen rules: pooling (max/avg/adaptive, 1-3d, with indices) and channel dropout.

These act on every (sample, channel) plane on its own, so members run as one call with the
member dim folded into the batch: ``[N, B, C, *] -> [N*B, C, *] -> op -> [N, B, C', *]``; an
unbatched member input ``[C, *]`` is already a batched input when N-first. On a channel-packed
value (after a conv/norm) the layout plan runs them on ``[B, N*C, *]`` directly, with no
conversion (fx/layout.py). Multi-output ops (``max_pool2d_with_indices``,
``adaptive_max_pool2d``) return both outputs per member; indices are positions within each
channel plane, identical in either layout.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from ..widen import Wide, WidenContext, member_rank, rule

aten = torch.ops.aten

# op -> number of spatial dims
_POOLS = {
    "max_pool1d": 1, "max_pool2d": 2, "max_pool3d": 3, "max_pool1d_with_indices": 1,
    "max_pool2d_with_indices": 2, "max_pool3d_with_indices": 3, "avg_pool1d": 1, "avg_pool2d": 2,
    "avg_pool3d": 3, "adaptive_avg_pool1d": 1, "adaptive_avg_pool2d": 2, "adaptive_avg_pool3d": 3,
    "_adaptive_avg_pool2d": 2, "_adaptive_avg_pool3d": 3, "adaptive_max_pool1d": 1,
    "adaptive_max_pool2d": 2, "adaptive_max_pool3d": 3,
}


def fold_member_batch(ctx: WidenContext, node: fx.Node, spatial: int | None) -> object:
    """Run ``node``'s op per member with the member dim folded into the batch (see module doc).
    ``spatial``: spatial dims of the op (member ranks spatial+1 and spatial+2 are accepted), or
    None for any member rank >= 2 (channel dropout)."""
    x = ctx.value(node.args[0])
    rest = ctx.value(tuple(node.args[1:]))
    if not isinstance(x, Wide) or ctx.is_wide(rest) or ctx.is_wide(ctx.value(node.kwargs)):
        raise ctx.fail(node, "expected only the first argument to be per member")
    rank = x.rank
    val = node.meta.get("val")
    vals = list(val) if isinstance(val, (tuple, list)) else [val]
    if spatial is not None and rank == spatial + 1:  # unbatched member: N-first is a batch
        out = ctx.emit(node.target, (x.node, *rest), ctx.value(node.kwargs), like=node, name=node.name)
        return ctx.outputs(node, out)
    if (spatial is not None and rank != spatial + 2) or rank < 2:
        raise ctx.fail(node, f"expected a member input of {spatial + 1} or {spatial + 2} dims, got {rank}"
                       if spatial is not None else f"expected a member input of at least 2 dims, got {rank}")
    folded = ctx.emit(aten.flatten.using_ints, (x.node, 0, 1), like=node)
    out = ctx.emit(node.target, (folded, *rest), ctx.value(node.kwargs), like=node)
    results = []
    for k, v in enumerate(vals):
        item = out if not isinstance(val, (tuple, list)) else ctx.emit(operator.getitem, (out, k), like=node)
        unflat = ctx.emit(aten.unflatten.int, (item, 0, [ctx.n, -1]), like=node,
                          name=node.name if not isinstance(val, (tuple, list)) else None)
        unflat.meta["wide_member_shape_hint"] = tuple(str(s) for s in v.shape)
        results.append(Wide(unflat, v.dim()))
    if isinstance(val, (tuple, list)):
        return tuple(results) if isinstance(val, tuple) else results
    return results[0]


def _register() -> None:
    for name, d in _POOLS.items():
        packet = getattr(aten, name, None)
        if packet is None:
            continue
        op = packet.default
        rule(op)(lambda ctx, node, d=d: fold_member_batch(ctx, node, d))


_register()


@rule(aten.feature_dropout.default, aten.feature_alpha_dropout.default)
def _feature_dropout(ctx: WidenContext, node: fx.Node):
    """Dropout1d/2d/3d, FeatureAlphaDropout: one mask value per (member, sample, channel), drawn
    independently for every member in one call."""
    if member_rank(node.args[0]) < 2:
        raise ctx.fail(node, "channel dropout of a member input with fewer than 2 dims")
    return fold_member_batch(ctx, node, None)


@rule(aten.dropout.default, aten.alpha_dropout.default, aten.native_dropout.default)
def _dropout(ctx: WidenContext, node: fx.Node):
    """Dropout / AlphaDropout: elementwise, so one call on the N-first tensor draws an
    independent mask for every member (and element); identity when train=False."""
    x = ctx.value(node.args[0])
    if not isinstance(x, Wide) or ctx.is_wide(ctx.value(tuple(node.args[1:]))):
        raise ctx.fail(node, "expected only the input to be per member")
    out = ctx.emit(node.target, (x.node, *ctx.value(tuple(node.args[1:]))), ctx.value(node.kwargs),
                   like=node, name=node.name)
    return ctx.outputs(node, out)
