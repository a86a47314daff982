"""The fold-into-batch template shared by the families whose ops treat dim 0 as a batch of
independent samples (pooling, padding, upsampling, pixel shuffle, channel dropout): the member dim
is folded into the member's batch, ``[N, B, C, *] -> [N*B, C, *] -> op -> [N, B, C', *]``. On a
channel-packed value the layout plan runs these ops on ``[B, N*C, *]`` directly (rows registered
with ``layout="fold"``, fx/layout.py)."""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from ..context import Wide, WidenContext

aten = torch.ops.aten


def fold_batch(ctx: WidenContext, node: fx.Node, spatial: int | None = None) -> Any:
    """Run ``node``'s op with the member dim folded into the batch (see the module doc).

    ``spatial``: the op's number of spatial dims; a member input of ``spatial + 1`` dims is
    unbatched, so the N-first tensor is already a batch and runs as it is, and ranks other than
    ``spatial + 1`` / ``spatial + 2`` are refused. ``None``: any member rank, always folded.
    Multi-output ops (``max_pool2d_with_indices``) fold every tensor output back."""
    x = ctx.value(node.args[0])
    rest = ctx.value(tuple(node.args[1:]))
    kwargs = ctx.value(node.kwargs)
    if not isinstance(x, Wide) or ctx.is_wide(rest) or ctx.is_wide(kwargs):
        raise ctx.fail(node, "expected only the first argument to be per member")
    if spatial is not None and x.rank == spatial + 1:  # unbatched member: N-first is a batch
        return ctx.outputs(node, ctx.emit(node.target, (x.node, *rest), kwargs, like=node, name=node.name))
    if spatial is not None and x.rank != spatial + 2:
        raise ctx.fail(node, f"expected a member input of {spatial + 1} or {spatial + 2} dims, got {x.rank}")
    folded = ctx.emit(aten.flatten.using_ints, (x.node, 0, 1), like=node)
    out = ctx.emit(node.target, (folded, *rest), kwargs, like=node)
    val = node.meta.get("val")
    multi = isinstance(val, (tuple, list))
    results = []
    for k, v in enumerate(val if multi else [val]):
        item = ctx.emit(operator.getitem, (out, k), like=node) if multi else out
        unflat = ctx.emit(aten.unflatten.int, (item, 0, [ctx.n, -1]), like=node, name=None if multi else node.name)
        unflat.meta["wide_member_shape_hint"] = tuple(str(s) for s in v.shape)
        results.append(Wide(unflat, v.dim()))
    if multi:
        return tuple(results) if isinstance(val, tuple) else results
    return results[0]
