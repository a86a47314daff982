"""Widen rules: parameter-free spatial ops (padding, interpolation, pixel shuffle) that treat dim 0
as a batch: the member dim is folded into the batch ([N, B, ...] -> [N*B, ...]) and unfolded after.
Constant padding only touches trailing dims, so it runs on the wide tensor as it is."""

from __future__ import annotations

import torch
from torch import fx

from ..widen import Wide, WidenContext, member_rank, rule

aten = torch.ops.aten


def fold_batch(ctx: WidenContext, node: fx.Node) -> Wide:
    """Run ``node``'s op with the member dim folded into the member's batch dim."""
    x = ctx.value(node.args[0])
    if not isinstance(x, Wide) or ctx.is_wide(ctx.value(tuple(node.args[1:]))):
        raise ctx.fail(node, "expected only the first argument to be per member")
    folded = ctx.emit(aten.flatten.using_ints, (x.node, 0, 1), like=node)
    out = ctx.emit(node.target, (folded, *ctx.value(tuple(node.args[1:]))), ctx.value(node.kwargs), like=node)
    return Wide(ctx.emit(aten.unflatten.int, (out, 0, [ctx.n, -1]), like=node, name=node.name), member_rank(node))


_FOLD = [
    "upsample_nearest1d.vec", "upsample_nearest2d.vec", "upsample_nearest3d.vec",
    "_upsample_nearest_exact1d.vec", "_upsample_nearest_exact2d.vec", "_upsample_nearest_exact3d.vec",
    "upsample_linear1d.vec", "upsample_bilinear2d.vec", "upsample_bicubic2d.vec",
    "upsample_trilinear3d.vec", "_upsample_bilinear2d_aa.vec", "_upsample_bicubic2d_aa.vec",
    "pixel_shuffle.default", "pixel_unshuffle.default", "channel_shuffle.default",
    "reflection_pad1d.default", "reflection_pad2d.default", "reflection_pad3d.default",
    "replication_pad1d.default", "replication_pad2d.default", "replication_pad3d.default",
]
for _spec in _FOLD:
    _name, _, _ovl = _spec.partition(".")
    _op = getattr(getattr(aten, _name, None), _ovl, None)
    if _op is not None:
        rule(_op)(fold_batch)


@rule(aten.pad.default)
def _pad(ctx: WidenContext, node: fx.Node) -> Wide:
    mode = node.args[2] if len(node.args) > 2 else node.kwargs.get("mode", "constant")
    pad = node.args[1]
    rank = member_rank(node.args[0])
    if mode == "constant" or rank == len(pad) // 2 + 1:  # trailing dims only / unbatched member
        x = ctx.value(node.args[0])
        return Wide(ctx.emit(node.target, (x.node, *ctx.value(tuple(node.args[1:]))), ctx.value(node.kwargs),
                             like=node, name=node.name), rank)
    return fold_batch(ctx, node)


@rule(aten.constant_pad_nd.default)
def _constant_pad(ctx: WidenContext, node: fx.Node) -> Wide:
    x = ctx.value(node.args[0])
    return Wide(ctx.emit(node.target, (x.node, *ctx.value(tuple(node.args[1:]))), ctx.value(node.kwargs),
                         like=node, name=node.name), member_rank(node))
