"""Per-member form of scaled dot-product attention: a ``dropout_p`` (or ``scale``) that differs
between members (Note [Per-member constants] in fx/constants.py).

Note [Per-member attention dropout]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A dropout sweep of a transformer (``nn.TransformerEncoderLayer(dropout=p)``, ``nn.MultiheadAttention
(dropout=p)``, ``F.scaled_dot_product_attention(..., dropout_p=self.p)``) gives the attention's
SDPA call a different ``dropout_p`` per member. SDPA takes one Python float, and the dropout sits
between the softmax and the product with ``v``, where no mask argument can reach it, so one
fused call cannot give member i its own rate. The form computes the attention explicitly, as
ATen's own math backend does (the backend SDPA takes on the CPU whenever it drops):

    w = softmax(q * scale @ k^T  [+ float mask | -inf where a bool/causal mask is False])
    out = (w * keep / (1 - p_i)) @ v,   keep = rand_like(w) < 1 - p_i   (0 where p_i = 1)

with the members folded in front (``[N, *batch, H, L, S]``) and ``p_i`` read live from the
``[N]`` buffer, broadcast per member: every element of every member draws its own uniform, so the
members' masks are independent and member i keeps each weight with probability ``1 - p_i``; a
member with ``p_i = 0`` keeps every weight and gets the plain attention. The softmax is
``_safe_softmax`` (a row masked everywhere gives zeros, as the math backend does); half and
bfloat16 compute in float32 and round once at the end. A per-member ``scale`` (a temperature
sweep) takes the same form. ``p`` outside [0, 1] fails the call, naming the node and the buffer.

Cost: the ``[N, B, H, L, S]`` weights are materialised (the math backend's cost, which the CPU
pays in training anyway; a CUDA member alone would use a fused kernel). Only graphs where the
constant differs take this form: in eval the modules pass ``dropout_p=0.0`` for every member, so
the eval graph keeps the one fused SDPA call (fx/rules/matmul.py ``_sdpa``, then
``wide.attention``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from ..context import Wide, WidenContext, member_rank
from ._constants import _keep_and_scale, form, scalar
from .randomness import _check, _and, _cmp

aten = torch.ops.aten


def _static(arg: Any, dim: int) -> int:
    """The traced size of ``arg`` (a member tensor) at ``dim``, or -1 where it is symbolic."""
    val = arg.meta.get("val") if isinstance(arg, fx.Node) else None
    size = val.shape[dim] if isinstance(val, torch.Tensor) else None
    return int(size) if isinstance(size, int) else -1


@form(aten.scaled_dot_product_attention.default)
def _sdpa_per_member(ctx: WidenContext, node: fx.Node, a: dict) -> Wide:
    """SDPA with a per-member ``dropout_p`` and/or ``scale``: the explicit attention of Note
    [Per-member attention dropout]."""
    rank = member_rank(node.args[0])
    if len({member_rank(node.args[i]) for i in range(3)}) != 1:
        raise ctx.fail(node, "query, key and value of different ranks")
    q, k, v = (ctx.as_wide(a[name], rank, node) for name in ("query", "key", "value"))
    mask, causal = a["attn_mask"], a["is_causal"]
    if mask is not None and causal:
        raise ctx.fail(node, "both attn_mask and is_causal=True (SDPA refuses them together)")
    head_dim = _static(node.args[0], -1)
    if head_dim < 0 and a["scale"] is None:
        raise ctx.fail(node, "a per-member dropout_p with a head dim that is not static")
    dtype = node.args[0].meta["val"].dtype
    compute = torch.promote_types(dtype, torch.float32)

    def cast(n: fx.Node) -> fx.Node:
        return ctx.emit(aten._to_copy.default, (n,), {"dtype": compute}, like=node) if compute != dtype else n

    qn, kn, vn = cast(q.node), cast(k.node), cast(v.node)
    if a.get("enable_gqa"):
        hq, hk = _static(node.args[0], -3), _static(node.args[1], -3)
        if hq < 0 or hk < 0:
            raise ctx.fail(node, "enable_gqa=True with head counts that are not static")
        if hq != hk:
            kn = ctx.emit(aten.repeat_interleave.self_int, (kn, hq // hk, -3), like=node)
            vn = ctx.emit(aten.repeat_interleave.self_int, (vn, hq // hk, -3), like=node)
    scale = a["scale"] if a["scale"] is not None else 1.0 / head_dim ** 0.5
    s = scalar(ctx, node, scale, rank, like=qn)
    qs = ctx.emit(aten.mul.Tensor, (qn, s), like=node)
    scores = ctx.emit(aten.matmul.default, (qs, ctx.emit(aten.transpose.int, (kn, -2, -1), like=node)), like=node)
    raw_mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    is_bool = causal or (isinstance(raw_mask, fx.Node) and raw_mask.meta["val"].dtype == torch.bool)
    if causal:  # True on and below the diagonal of [L, S], as SDPA's is_causal
        size = [ctx.emit(aten.sym_size.int, (t, rank - 1), like=node) for t in (qn, kn)]  # L, S
        ones = ctx.emit(aten.new_ones.default, (scores, size), {"dtype": torch.bool}, like=node)
        mask = ctx.emit(aten.tril.default, (ones,), like=node)
    elif isinstance(mask, Wide):
        mask = ctx.align(mask, rank, node)
    if mask is not None and is_bool:
        dropped = ctx.emit(aten.logical_not.default, (mask,), like=node)
        scores = ctx.emit(aten.masked_fill.Scalar, (scores, dropped, float("-inf")), like=node)
    elif mask is not None:
        scores = ctx.emit(aten.add.Tensor, (scores, cast(mask)), like=node)
    weights = ctx.emit(aten._safe_softmax.default, (scores, -1), like=node)
    p = a["dropout_p"]
    if isinstance(p, Wide):
        _check(ctx, node, _and(ctx, node, _cmp(ctx, node, p, "ge", 0.0), _cmp(ctx, node, p, "le", 1.0)),
               "dropout_p is outside [0, 1]")
        keep, rescale = _keep_and_scale(ctx, node, Wide(weights, rank), p)
        weights = ctx.emit(aten.mul.Tensor, (ctx.emit(aten.mul.Tensor, (weights, keep), like=node), rescale),
                           like=node)
    elif p > 0:  # a shared rate beside a per-member scale
        weights = ctx.emit(aten.dropout.default, (weights, p, True), like=node)
    out = ctx.emit(aten.matmul.default, (weights, vn), like=node)
    if compute != dtype:
        out = ctx.emit(aten._to_copy.default, (out,), {"dtype": dtype}, like=node)
    return Wide(out, member_rank(node))
