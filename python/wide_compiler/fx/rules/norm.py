"""Widen rules: normalisations and PReLU.

- ``aten.batch_norm`` / ``aten.instance_norm`` / ``aten.group_norm`` / ``aten.prelu`` ->
  the packed-family ``wide.*`` ops (one ATen call over ``[B, N*C, *]``, see Note [wide norms]),
  followed by ``wide.to_nfirst`` (removed between packed ops by the layout plan). Running stats
  are the stacked buffers themselves: the op updates them in place in train mode, and export's
  ``num_batches_tracked.add_(1)`` is an ordinary pointwise op on the ``[N]`` buffer.
- ``aten.layer_norm`` / ``aten.rms_norm`` -> ``wide.layer_norm`` / ``wide.rms_norm`` (N-first).
"""

from __future__ import annotations

import torch
from torch import fx

from ...ops import WIDE_OPS
from ..table import rule
from ..context import TuneSpec, Wide, WidenContext, concrete_shape, member_rank
from ._autocast import ACTIVATION, FLOAT32_ON_CUDA, LOWER, NOT_CAST
from ._packed import packed_result

aten = torch.ops.aten
wide = torch.ops.wide
# Under torch.autocast (Note [wide autocast]), each as ATen treats the op it replaces: batch and
# instance norm are not cast (computed in float32, the activation's dtype back), group/layer/RMS
# norm are on CUDA's float32 list, prelu on the lower-precision one. The eval graph's forms of these
# norms (fx/layout.py: group_norm_nfirst; fx/eval_rewrites.py: add_layer_norm, a residual add and
# its layer norm) and the kernels they call keep their norm's policy; the fused batch/layer norm
# kernels run inside wide.batch_norm / wide.layer_norm, below its cast.
AUTOCAST = {"batch_norm": ACTIVATION, "instance_norm": ACTIVATION, "prelu": LOWER,
            "group_norm": FLOAT32_ON_CUDA, "group_norm_nfirst": FLOAT32_ON_CUDA, "fused_group_norm": FLOAT32_ON_CUDA,
            "layer_norm": FLOAT32_ON_CUDA, "rms_norm": FLOAT32_ON_CUDA, "add_layer_norm": FLOAT32_ON_CUDA,
            "fused_norm": FLOAT32_ON_CUDA, "fused_norm_backward": NOT_CAST, "fused_batch_norm": NOT_CAST,
            "fused_batch_norm_backward": NOT_CAST}
_LAYER_NORM = WIDE_OPS["layer_norm"]
_LAYER_NORM_STRATEGIES = _LAYER_NORM.strategies


def _param(ctx: WidenContext, node: fx.Node, v, rank: int):
    """A per-member parameter/buffer node (shared values are expanded), or None."""
    if v is None:
        return None
    return ctx.as_wide(v, rank, node).node


def _activation(ctx: WidenContext, node: fx.Node, v, min_rank: int) -> fx.Node:
    rank = member_rank(node.args[0])
    if rank < min_rank:
        raise ctx.fail(node, f"expected a member input of at least {min_rank} dims, got {rank}")
    return ctx.as_wide(v, rank, node).node


def _emit_packed(ctx: WidenContext, node: fx.Node, target, args: tuple) -> fx.Node:
    """The packed-family op ``target`` for ``node``, fed N-first (the layout plan may chain it)."""
    return ctx.emit_wide(target, args, {"packed_input": False}, like=node,
                         shapes={"input": concrete_shape(node.args[0]), "packed_input": False})


def _running_stats_norm(ctx: WidenContext, node: fx.Node, target, min_rank: int, use_stats: str) -> Wide:
    """Batch/instance norm: per-member affine and running statistics (updated in place)."""
    a = ctx.schema_args(node)
    x = _activation(ctx, node, a["input"], min_rank)
    if a["running_mean"] is not None and not isinstance(a["running_mean"], Wide):
        raise ctx.fail(node, "running stats that are not per-member buffers")
    args = (x, _param(ctx, node, a["weight"], 1), _param(ctx, node, a["bias"], 1),
            _param(ctx, node, a["running_mean"], 1), _param(ctx, node, a["running_var"], 1),
            a[use_stats], a["momentum"], a["eps"])
    return packed_result(ctx, node, _emit_packed(ctx, node, target, args))


@rule(aten.batch_norm.default, layout="packed", packed=wide.batch_norm.default)
def _batch_norm(ctx: WidenContext, node: fx.Node) -> Wide:
    return _running_stats_norm(ctx, node, wide.batch_norm.default, 2, "training")


@rule(aten.instance_norm.default, layout="packed", packed=wide.instance_norm.default)
def _instance_norm(ctx: WidenContext, node: fx.Node) -> Wide:
    return _running_stats_norm(ctx, node, wide.instance_norm.default, 3, "use_input_stats")


@rule(aten.group_norm.default, layout="packed", packed=wide.group_norm.default)
def _group_norm(ctx: WidenContext, node: fx.Node) -> Wide:
    a = ctx.schema_args(node)
    x = _activation(ctx, node, a["input"], 2)
    args = (x, ctx.n, a["num_groups"], _param(ctx, node, a["weight"], 1),
            _param(ctx, node, a["bias"], 1), a["eps"])
    return packed_result(ctx, node, _emit_packed(ctx, node, wide.group_norm.default, args))


@rule(aten.prelu.default, layout="packed", packed=wide.prelu.default)
def _prelu(ctx: WidenContext, node: fx.Node) -> Wide:
    a = ctx.schema_args(node)
    rank = member_rank(node.args[0])
    if member_rank(node.args[1]) != 1:
        raise ctx.fail(node, f"expected a 1-d PReLU weight, got {member_rank(node.args[1])}-d")
    if rank == 0:
        raise ctx.fail(node, "PReLU of a 0-dim input")
    x = ctx.as_wide(a["self"], rank, node).node
    unbatched = rank == 1  # a 1-d member input has ONE channel (as in F.prelu)
    if unbatched and concrete_shape(node.args[1])[0] != 1:
        raise ctx.fail(node, "PReLU with several slopes on a 1-d input")
    if unbatched:
        x = ctx.emit(aten.unsqueeze.default, (x, 1), like=node)
    packed = _emit_packed(ctx, node, wide.prelu.default, (x, _param(ctx, node, a["weight"], 1)))
    return packed_result(ctx, node, packed, unbatched)


@rule(aten.layer_norm.default, strategies=_LAYER_NORM_STRATEGIES)
def _layer_norm(ctx: WidenContext, node: fx.Node) -> Wide:
    a = ctx.schema_args(node)
    rank = member_rank(node.args[0])
    x = ctx.as_wide(a["input"], rank, node).node
    k = len(a["normalized_shape"])
    shapes = {"input": concrete_shape(node.args[0]), "normalized_shape": [int(d) for d in a["normalized_shape"]],
              "weight": a["weight"] is not None, "bias": a["bias"] is not None}
    tune = TuneSpec(default=_LAYER_NORM.default,
                    make=lambda n, opts, s=shapes, eps=a["eps"]: _layer_norm_candidates(n, s, eps, opts))
    out = ctx.emit_wide(wide.layer_norm.default, (x, a["normalized_shape"], _param(ctx, node, a["weight"], k),
                                                  _param(ctx, node, a["bias"], k), a["eps"]),
                        {"strategy": "auto"}, like=node, name=node.name, shapes=shapes, tune=tune)
    return Wide(out, rank)


def _layer_norm_candidates(n: int, shapes: dict, eps: float, opts: dict) -> dict:
    x = torch.randn(n, *shapes["input"], **opts)
    w = torch.randn(n, *shapes["normalized_shape"], **opts) if shapes["weight"] else None
    b = torch.randn(n, *shapes["normalized_shape"], **opts) if shapes["bias"] else None
    return {s: (lambda s=s: wide.layer_norm(x, shapes["normalized_shape"], w, b, eps, strategy=s))
            for s in _LAYER_NORM_STRATEGIES}


@rule(aten.rms_norm.default)
def _rms_norm(ctx: WidenContext, node: fx.Node) -> Wide:
    a = ctx.schema_args(node)
    rank = member_rank(node.args[0])
    x = ctx.as_wide(a["input"], rank, node).node
    k = len(a["normalized_shape"])
    out = ctx.emit_wide(wide.rms_norm.default, (x, a["normalized_shape"], _param(ctx, node, a["weight"], k), a["eps"]),
                        like=node, name=node.name, shapes={"input": concrete_shape(node.args[0])})
    return Wide(out, rank)


@rule(aten._weight_norm.default)
def _weight_norm(ctx: WidenContext, node: fx.Node) -> Wide:
    """``weight_norm``'s ``v * (g / ||v||)`` with the norm over each member's dims except ``dim``
    (``dim=-1``: over all of them); ATen's op would take the member dim into the norm."""
    v_old, g_old = node.args[0], node.args[1]
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    rank = member_rank(v_old)
    v = ctx.as_wide(ctx.value(v_old), rank, node)
    g = ctx.align(ctx.as_wide(ctx.value(g_old), member_rank(g_old), node), rank, node)
    keep = None if dim == -1 else dim % rank
    dims = [d + 1 for d in range(rank) if d != keep]
    norm = ctx.emit(aten.linalg_vector_norm.default, (v.node, 2, dims, True), like=node)
    scale = ctx.emit(aten.div.Tensor, (g, norm), like=node)
    return Wide(ctx.emit(aten.mul.Tensor, (v.node, scale), like=node, name=node.name), rank)
