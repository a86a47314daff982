"""Widen rules: parameter-free spatial ops (padding, interpolation, pixel shuffle) that treat dim 0
as a batch: the member dim is folded into the batch ([N, B, ...] -> [N*B, ...]) and unfolded after.
Constant padding only touches trailing dims, so it runs on the wide tensor as it is ("pad"
layout: on a packed tensor too, when it pads spatial dims only; other modes fold)."""

from __future__ import annotations

import torch
from torch import fx

from ..table import rows, rule
from ..context import Wide, WidenContext, member_rank
from ._fold import fold_batch

aten = torch.ops.aten


# Per-channel ops: on a channel-packed tensor they give the same member values ("fold" layout).
_FOLD = [
    "upsample_nearest1d.vec", "upsample_nearest2d.vec", "upsample_nearest3d.vec",
    "_upsample_nearest_exact1d.vec", "_upsample_nearest_exact2d.vec", "_upsample_nearest_exact3d.vec",
    "upsample_linear1d.vec", "upsample_bilinear2d.vec", "upsample_bicubic2d.vec",
    "upsample_trilinear3d.vec",
]
rows(fold_batch, _FOLD, layout="fold")
# Ops that mix channels (channel_shuffle would mix members on a packed tensor) or are not
# proven layout-transparent: folded, but always N-first.
rows(fold_batch, ["_upsample_bilinear2d_aa.vec", "_upsample_bicubic2d_aa.vec", "pixel_shuffle.default",
                  "pixel_unshuffle.default", "channel_shuffle.default"])
# unfold/fold (ConvBERT's span conv): ``im2col`` takes [C, H, W] or [B, C, H, W], ``col2im``
# [C*kh*kw, L] or [B, C*kh*kw, L]; an unbatched member's N-first tensor is already a batch.
@rule(aten.im2col.default)
def _im2col(ctx: WidenContext, node: fx.Node) -> Wide:
    return fold_batch(ctx, node, spatial=2)


@rule(aten.col2im.default)
def _col2im(ctx: WidenContext, node: fx.Node) -> Wide:
    return fold_batch(ctx, node, spatial=1)


@rule(aten.pad.default, layout="pad")
def _pad(ctx: WidenContext, node: fx.Node) -> Wide:
    mode = node.args[2] if len(node.args) > 2 else node.kwargs.get("mode", "constant")
    pad = node.args[1]
    rank = member_rank(node.args[0])
    if mode == "constant" or rank == len(pad) // 2 + 1:  # trailing dims only / unbatched member
        x = ctx.value(node.args[0])
        return Wide(ctx.emit(node.target, (x.node, *ctx.value(tuple(node.args[1:]))), ctx.value(node.kwargs),
                             like=node, name=node.name), rank)
    return fold_batch(ctx, node)


@rule(aten.constant_pad_nd.default, layout="pad")
def _constant_pad(ctx: WidenContext, node: fx.Node) -> Wide:
    x = ctx.value(node.args[0])
    return Wide(ctx.emit(node.target, (x.node, *ctx.value(tuple(node.args[1:]))), ctx.value(node.kwargs),
                         like=node, name=node.name), member_rank(node))
