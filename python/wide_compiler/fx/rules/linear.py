"""Widen rules: linear layers -> torch.ops.wide.linear."""

from __future__ import annotations

import torch
from torch import fx

from ...ops import WIDE_OPS
from ..table import rule
from ..context import TuneSpec, Wide, WidenContext, concrete_shape, member_rank
from ._autocast import LOWER

aten = torch.ops.aten
_OP = WIDE_OPS["linear"]
_STRATEGIES = _OP.strategies
# Under torch.autocast (Note [wide autocast]): cast as ATen casts aten::linear.
AUTOCAST = {"linear": LOWER}


def _linear_candidates(n: int, shapes: dict, has_bias: bool, opts: dict) -> dict:
    """Zero-argument callables running each strategy on random tensors of the sample shapes."""
    x = torch.randn(n, *shapes["input"], **opts)
    w = torch.randn(n, *shapes["weight"], **opts)
    b = torch.randn(n, shapes["weight"][0], **opts) if has_bias else None
    return {s: (lambda s=s: torch.ops.wide.linear(x, w, b, strategy=s)) for s in _STRATEGIES}



@rule(aten.linear.default, strategies=_STRATEGIES)
def _linear(ctx: WidenContext, node: fx.Node) -> Wide:
    x, w, *rest = node.args
    b = rest[0] if rest else node.kwargs.get("bias")
    xv, wv, bv = ctx.value(x), ctx.value(w), ctx.value(b)
    if member_rank(w) != 2:
        raise ctx.fail(node, f"expected a 2-D weight, got {member_rank(w)}-D")
    rank = member_rank(x)
    if rank == 0:
        raise ctx.fail(node, "linear of a 0-dim input")
    add_bias = b is not None and rank >= 3 and not _contiguous(x)  # Note [A bias added after the product]
    args = [ctx.as_wide(xv, rank, node).node, ctx.as_wide(wv, 2, node).node]
    args.append(ctx.as_wide(bv, 1, node).node if b is not None and not add_bias else None)
    shapes = {"input": concrete_shape(x), "weight": concrete_shape(w), "bias": args[2] is not None}
    tune = TuneSpec(default=_OP.default, strategies=_STRATEGIES,
                    make=lambda n, opts, s=shapes: _linear_candidates(n, s, s["bias"], opts))
    out = ctx.emit_wide(torch.ops.wide.linear.default, tuple(args), {"strategy": "auto"}, like=node, name=node.name,
                        shapes=shapes, tune=tune)
    if add_bias:
        bias = ctx.align(ctx.as_wide(bv, 1, node), rank, node)
        out = ctx.emit(aten.add.Tensor, (out, ctx.emit(aten.type_as.default, (bias, out), like=node)), like=node)
    return Wide(out, member_rank(node))


# Note [A bias added after the product]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ATen's linear adds the bias inside the product (one rounding: addmm) for a 2-D input or a
# contiguous one, but for a non-contiguous input of 3 or more dims (a batch_first RNN's output
# transposed, x.transpose(0, 1)) it runs matmul and then adds the bias: two roundings, which under
# bfloat16 autocast differ from one in a third of the outputs by one bfloat16 ulp (probe 13 of issue
# 44, P13-5: a GRU followed by a Linear head). So the member's own order is kept: the wide product
# without the bias, then the bias added in the product's dtype (autocast casts linear's bias with
# its inputs).


def _contiguous(x: fx.Node) -> bool:
    """Whether the member's input (its traced value) is contiguous; True where unknown."""
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return True
    try:
        return bool(val.is_contiguous())
    except Exception:  # noqa: BLE001 (a symbolic stride that does not decide it)
        return True
