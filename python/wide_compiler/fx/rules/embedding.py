"""Widen rules: embeddings -> torch.ops.wide.embedding / embedding_bag / embedding_renorm_.

N tables ``[N, V, D]`` are looked up as one ``[N*V, D]`` table with indices offset by ``n*V``
(Note [wide embeddings]); shared indices (a tensor every member reads) are expanded with stride 0
and offset by broadcasting. ``max_norm`` arrives from export as an in-place
``aten.embedding_renorm_`` on the detached weight before the lookup.
"""

from __future__ import annotations

import torch
from torch import fx

from ..table import rule
from ..context import Wide, WidenContext, concrete_shape, member_rank
from ._autocast import NOT_CAST

aten = torch.ops.aten
wide = torch.ops.wide
# Under torch.autocast (Note [wide autocast]): ATen casts no embedding op, nor do the wide ones.
AUTOCAST = {"embedding": NOT_CAST, "embedding_bag": NOT_CAST, "embedding_renorm_": NOT_CAST}


def _table(ctx: WidenContext, node: fx.Node, v) -> fx.Node:
    if not isinstance(v, Wide) or v.rank != 2:
        raise ctx.fail(node, "expected a per-member 2-d embedding table")
    return v.node


@rule(aten.embedding.default)
def _embedding(ctx: WidenContext, node: fx.Node) -> Wide:
    a = ctx.schema_args(node)
    if a["sparse"]:
        raise ctx.fail(node, "sparse=True embedding gradients are not supported by the wide form")
    idx = ctx.as_wide(a["indices"], member_rank(node.args[1]), node).node
    out = ctx.emit_wide(wide.embedding.default, (_table(ctx, node, a["weight"]), idx, a["padding_idx"],
                                                 a["scale_grad_by_freq"], False), like=node, name=node.name,
                        shapes={"input": concrete_shape(node.args[1]), "weight": concrete_shape(node.args[0])})
    return Wide(out, member_rank(node))


@rule(aten.embedding_renorm_.default)
def _embedding_renorm(ctx: WidenContext, node: fx.Node) -> Wide:
    a = ctx.schema_args(node)
    idx = ctx.as_wide(a["indices"], member_rank(node.args[1]), node).node
    out = ctx.emit(wide.embedding_renorm_.default, (_table(ctx, node, a["self"]), idx, a["max_norm"],
                                                    a["norm_type"]), like=node, name=node.name)
    return Wide(out, 2)


@rule(aten.embedding_bag.default, aten.embedding_bag.padding_idx)
def _embedding_bag(ctx: WidenContext, node: fx.Node):
    a = ctx.schema_args(node)
    if a["sparse"]:
        raise ctx.fail(node, "sparse=True embedding gradients are not supported by the wide form")
    if member_rank(node.args[1]) != 1:
        raise ctx.fail(node, "expected 1-d member indices with offsets (export flattens 2-d input)")
    idx = ctx.as_wide(a["indices"], 1, node).node
    offsets = ctx.unwrap(a["offsets"])  # shared [B] or per member [N, B]
    psw = a["per_sample_weights"]
    psw = ctx.as_wide(psw, 1, node).node if psw is not None else None
    pad = a.get("padding_idx")
    out = ctx.emit_wide(wide.embedding_bag.default,
                        (_table(ctx, node, a["weight"]), idx, offsets, a["scale_grad_by_freq"], a["mode"], False,
                         psw, a["include_last_offset"], -1 if pad is None else pad), like=node, name=node.name,
                        shapes={"input": concrete_shape(node.args[1]), "weight": concrete_shape(node.args[0])})

    def unused(k: int):
        return None  # offset2bag / bag_size / max_indices: internal outputs nobody reads

    return (Wide(out, 2), *[unused(k) for k in range(1, 4)])
