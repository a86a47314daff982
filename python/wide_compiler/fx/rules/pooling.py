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

import torch
from torch import fx

from ..table import rule
from ..context import WidenContext, member_rank
from ._fold import fold_batch

aten = torch.ops.aten

# op -> number of spatial dims
_POOLS = {
    "max_pool1d": 1, "max_pool2d": 2, "max_pool3d": 3, "max_pool1d_with_indices": 1,
    "max_pool2d_with_indices": 2, "max_pool3d_with_indices": 3, "avg_pool1d": 1, "avg_pool2d": 2,
    "avg_pool3d": 3, "adaptive_avg_pool1d": 1, "adaptive_avg_pool2d": 2, "adaptive_avg_pool3d": 3,
    "adaptive_max_pool1d": 1, "adaptive_max_pool2d": 2, "adaptive_max_pool3d": 3,
}


def _pool_rule(spatial: int):
    def pool(ctx: WidenContext, node: fx.Node):
        return fold_batch(ctx, node, spatial)

    pool.__name__ = f"pool{spatial}d"
    return pool


for _d in (1, 2, 3):
    rule(*(name for name, d in _POOLS.items() if d == _d), layout="fold")(_pool_rule(_d))


@rule(aten.feature_dropout.default, aten.feature_alpha_dropout.default, layout="fold")
def _feature_dropout(ctx: WidenContext, node: fx.Node):
    """Dropout1d/2d/3d, FeatureAlphaDropout: one mask value per (member, sample, channel), drawn
    independently for every member in one call."""
    if member_rank(node.args[0]) < 2:
        raise ctx.fail(node, "channel dropout of a member input with fewer than 2 dims")
    return fold_batch(ctx, node)


@rule(aten.dropout.default, aten.alpha_dropout.default, layout="elementwise")
@rule(aten.native_dropout.default, aten.dropout_.default)
def _dropout(ctx: WidenContext, node: fx.Node):
    """Dropout / AlphaDropout: elementwise, so one call on the N-first tensor draws an
    independent mask for every member (and element); identity when train=False. A value every
    member shares (position terms computed from shapes) is expanded first, so each member still
    draws its own mask."""
    if ctx.is_wide(ctx.value(tuple(node.args[1:]))):
        raise ctx.fail(node, "expected only the input to be per member")
    x = ctx.as_wide(ctx.value(node.args[0]), member_rank(node.args[0]), node)
    out = ctx.emit(node.target, (x.node, *ctx.value(tuple(node.args[1:]))), ctx.value(node.kwargs),
                   like=node, name=node.name)
    return ctx.outputs(node, out)
