"""Widen rules: tensor creation inside forward.

``*_like(x)`` of a per-member tensor is per member (random ones draw independently per member);
``x.new_zeros(size)`` and friends only read x's dtype/device, so they stay shared; random creation
ops (``torch.randn(size)``, ...) draw ``[N, *size]`` so every member gets its own draw.
"""

from __future__ import annotations

import torch
from torch import fx

from ..table import rule
from ..context import Wide, WidenContext, member_rank

aten = torch.ops.aten


@rule(aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default,
      aten.rand_like.default, aten.randn_like.default, aten.randint_like.default,
      aten.randint_like.low_dtype, aten.bernoulli.default, aten.bernoulli.p)
def _like(ctx: WidenContext, node: fx.Node) -> Wide:
    x = ctx.value(node.args[0])
    rank = member_rank(node.args[0])
    x = ctx.as_wide(x, rank, node)  # a random op of a shared tensor still draws per member
    args = (x.node, *ctx.value(tuple(node.args[1:])))
    if any(isinstance(a, Wide) for a in args[1:]):
        raise ctx.fail(node, "a per-member tensor in a non-input argument")
    return Wide(ctx.emit(node.target, args, ctx.value(node.kwargs), like=node, name=node.name), rank)


@rule(aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default, aten.new_full.default)
def _new(ctx: WidenContext, node: fx.Node):
    # Reads only dtype/device of its input: the result is the same for every member (shared).
    return ctx.emit(node.target, ctx.unwrap(ctx.value(node.args)), ctx.value(node.kwargs),
                    like=node, name=node.name)


@rule(aten.rand.default, aten.randn.default, aten.randint.default, aten.randint.low,
      aten.normal.float_float)
def _random(ctx: WidenContext, node: fx.Node) -> Wide:
    values = ctx.schema_args(node)
    if ctx.is_wide(list(values.values())):
        raise ctx.fail(node, "a per-member tensor argument of a random creation op")
    values["size"] = [ctx.n, *values["size"]]
    return Wide(ctx.emit_schema(node.target, values, like=node, name=node.name), member_rank(node))
