"""Widen rules: products between activations (and activations and parameters): matmul/mm/bmm,
einsum, and scaled dot-product attention with the member dim folded into the batch.

Note [Autocast parity of widened ops]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Under ``torch.autocast`` the wide graph's ops are cast by ATen's autocast as they run, each by its
own policy, so a wide form built of other ops than the member's must pick ops that autocast
treats as it treats the member's op, on every device, or the member gets a dtype (or values
rounded to lower precision) that it does not get alone. ATen's lists (the ops with a kernel for
the device's autocast dispatch key; ``rules/_autocast.py`` reads them from the dispatcher):

* ``addmm``/``baddbmm`` are lower precision (CPU and CUDA): a ``matmul`` then ``+ bias`` gave a
  lower-precision product plus a float32 bias, float32. Their wide form is ``baddbmm`` itself
  (members folded into its batch), which autocast casts as it casts the member's op.
* ``mv``, ``dot`` and ``vdot`` are not listed on the CPU (the member computes in its inputs' dtype, and
  raises on mixed ones); on CUDA ``mv`` is lower precision and ``dot``/``vdot`` "promote" (to the widest
  floating type). Their wide form, a batched ``matmul``, runs through
  :class:`~._autocast.AsATenOp`, which applies the member op's policy for the device: autocast
  off where ATen does not list the op, the arguments promoted where it promotes them.
* ops with no rule (``addmv``, ``addbmm``, ``addr``, ...) reach the per-op fallback, which under
  autocast runs each member's op itself (fx/fallback.py) instead of ``torch.vmap``, whose
  batching rules decompose the op into others that autocast casts differently.

tests/python/test_autocast_parity.py checks every op of ATen's CPU list that a rule handles.
"""

from __future__ import annotations

import string

import torch
from torch import fx

from ..table import rule
from ..context import Wide, WidenContext, member_rank
from ._autocast import LOWER, AsATenOp

aten = torch.ops.aten
# Under torch.autocast (Note [wide autocast]): SDPA's wide forms (the eval graph's wide.attention,
# fx/eval_rewrites.py, and the small-sequence kernel it calls) are cast as aten::scaled_dot_product_attention.
AUTOCAST = {"attention": LOWER, "small_attention": LOWER}


# Note [Autocast parity of widened ops]
_AS_ATEN = {aten.mv.default: AsATenOp(aten.matmul.default, "aten::mv", "lower"),
            aten.dot.default: AsATenOp(aten.matmul.default, "aten::dot", "promote"),
            aten.vdot.default: AsATenOp(aten.matmul.default, "aten::vdot", "promote")}


@rule(aten.matmul.default, aten.mm.default, aten.bmm.default, aten.mv.default, aten.dot.default)
def _matmul(ctx: WidenContext, node: fx.Node) -> Wide:
    a, b = ctx.value(node.args[0]), ctx.value(node.args[1])
    ra, rb = member_rank(node.args[0]), member_rank(node.args[1])
    out_rank = member_rank(node)
    matmul = _AS_ATEN.get(node.target, aten.matmul.default)
    # A shared matrix against a per-member operand of rank >= 2 broadcasts correctly as it is.
    if (not isinstance(a, Wide) and ra == 2 and rb >= 2) or (not isinstance(b, Wide) and rb <= 2 and ra >= 2):
        args = (ctx.unwrap(a), ctx.unwrap(b))
        return Wide(ctx.emit(matmul, args, like=node, name=node.name), out_rank)
    a, b = ctx.as_wide(a, ra, node), ctx.as_wide(b, rb, node)
    # 1-D members are a row (left) or a column (right) vector, squeezed away after.
    an = ctx.emit(aten.unsqueeze.default, (a.node, 1), like=node) if ra == 1 else a.node
    bn = ctx.emit(aten.unsqueeze.default, (b.node, -1), like=node) if rb == 1 else b.node
    ea, eb = max(ra, 2), max(rb, 2)
    rank = max(ea, eb)
    an, bn = ctx.align(Wide(an, ea), rank, node), ctx.align(Wide(bn, eb), rank, node)
    out = ctx.emit(matmul, (an, bn), like=node, name=node.name)
    if rb == 1:
        out = ctx.emit(aten.squeeze.dim, (out, -1), like=node)
    if ra == 1:
        out = ctx.emit(aten.squeeze.dim, (out, -1 if rb == 1 else -2), like=node)
    return Wide(out, out_rank)


@rule(aten.einsum.default)
def _einsum(ctx: WidenContext, node: fx.Node) -> Wide:
    equation = node.args[0].replace(" ", "")
    operands = [ctx.value(t) for t in node.args[1]]
    if "->" not in equation:
        from ..fallback import fallback
        return fallback(ctx, node, reason="einsum with an implicit output")
    lhs, rhs = equation.split("->")
    free = [c for c in string.ascii_letters if c not in equation]
    m = free[0]
    terms = [(m + t if isinstance(v, Wide) else t) for t, v in zip(lhs.split(","), operands)]
    out = ctx.emit(aten.einsum.default, (f"{','.join(terms)}->{m}{rhs}", [ctx.unwrap(v) for v in operands]),
                   {k: v for k, v in node.kwargs.items()}, like=node, name=node.name)
    return Wide(out, member_rank(node))


@rule(aten.scaled_dot_product_attention.default)
def _sdpa(ctx: WidenContext, node: fx.Node) -> Wide:
    """One SDPA call for all members: [N, B, H, L, E] is folded to [N*B, H, L, E] (members are
    independent batch entries); unbatched members ([H, L, E]) use N as the batch directly."""
    values = ctx.schema_args(node)
    rank = member_rank(node.args[0])
    qkv = [ctx.as_wide(values[k], member_rank(node.args[i]), node) for i, k in enumerate(("query", "key", "value"))]
    if len({member_rank(node.args[i]) for i in range(3)}) != 1:
        raise ctx.fail(node, "query, key and value of different ranks")
    mask = values.get("attn_mask")
    fold = rank >= 4  # the member has its own batch dim(s)
    if mask is not None:
        mrank = member_rank(node.args[3] if len(node.args) > 3 else node.kwargs["attn_mask"])
        if isinstance(mask, Wide) or (fold and mrank == rank):
            mask = Wide(ctx.align(ctx.as_wide(mask, mrank, node), rank, node), rank)
            if fold:  # broadcast over the member's batch so it folds like q: [N, B, ...]
                batch = ctx.emit(aten.sym_size.int, (qkv[0].node, 1), like=node)
                mask = Wide(ctx.emit(aten.expand.default, (mask.node, [-1, batch] + [-1] * (rank - 1)),
                                     like=node), rank)
    if fold:
        flat = lambda w: ctx.emit(aten.flatten.using_ints, (w.node, 0, 1), like=node)  # noqa: E731
        values["query"], values["key"], values["value"] = (flat(w) for w in qkv)
        values["attn_mask"] = flat(mask) if isinstance(mask, Wide) else mask
        out = ctx.emit_schema(node.target, values, like=node)
        out = ctx.emit(aten.unflatten.int, (out, 0, [ctx.n, -1]), like=node, name=node.name)
    else:
        values["query"], values["key"], values["value"] = qkv
        values["attn_mask"] = mask
        out = ctx.emit_schema(node.target, values, like=node, name=node.name)
    return Wide(out, rank)


@rule(aten.outer.default)
def _outer(ctx: WidenContext, node: fx.Node) -> Wide:
    a = ctx.as_wide(ctx.value(node.args[0]), 1, node)
    b = ctx.as_wide(ctx.value(node.args[1]), 1, node)
    col = ctx.emit(aten.unsqueeze.default, (a.node, -1), like=node)
    row = ctx.emit(aten.unsqueeze.default, (b.node, -2), like=node)
    return Wide(ctx.emit(aten.mul.Tensor, (col, row), like=node, name=node.name), 2)


@rule(aten.addmm.default, aten.baddbmm.default)
def _addmm(ctx: WidenContext, node: fx.Node) -> Wide:
    """beta * input + alpha * (mat1 @ mat2) (``baddbmm``: batch1 @ batch2), with input broadcast
    inside each member; ``beta=0`` ignores input (NaN included), as ATen does. One ``baddbmm``
    with the members in its batch (folded with the member's own batch for ``baddbmm``), which
    autocast casts as it casts the member's op (Note [Autocast parity of widened ops])."""
    values = ctx.schema_args(node)
    rank = 2 if node.target is aten.addmm.default else 3
    first, second = ("mat1", "mat2") if rank == 2 else ("batch1", "batch2")
    a, b = ctx.as_wide(values[first], rank, node), ctx.as_wide(values[second], rank, node)
    kwargs = {k: values[k] for k in ("beta", "alpha") if values[k] != 1}
    bias = values["self"]
    if rank == 2:  # [N, m, k] @ [N, k, n]; a member's bias [m, n] / [n] broadcasts as it is
        bias = ctx.align(bias, rank, node) if isinstance(bias, Wide) else bias
        return Wide(ctx.emit(aten.baddbmm.default, (bias, a.node, b.node), kwargs, like=node, name=node.name), 2)
    # [N, B, m, k] @ [N, B, k, n] as [N*B, m, k] @ [N*B, k, n]
    size = [ctx.n] + [ctx.emit(aten.sym_size.int, (a.node, d), like=node) for d in (1, 2)] + \
        [ctx.emit(aten.sym_size.int, (b.node, 3), like=node)]
    src = node.args[0] if node.args else node.kwargs.get("self")
    if isinstance(bias, Wide) or (isinstance(src, fx.Node) and member_rank(src) == 3):
        bias = ctx.align(bias, rank, node) if isinstance(bias, Wide) else bias  # a per-member batch
        bias = ctx.emit(aten.expand.default, (bias, size), like=node)
        bias = ctx.emit(aten.flatten.using_ints, (bias, 0, 1), like=node)
    flat = [ctx.emit(aten.flatten.using_ints, (w.node, 0, 1), like=node) for w in (a, b)]
    out = ctx.emit(aten.baddbmm.default, (bias, *flat), kwargs, like=node)
    return Wide(ctx.emit(aten.unflatten.int, (out, 0, [ctx.n, -1]), like=node, name=node.name), rank)


@rule(aten.vdot.default)
def _vdot(ctx: WidenContext, node: fx.Node) -> Wide:
    """conj(a) . b of 1-d members (spectral_norm's sigma): ``[N, 1, k] @ [N, k, 1]``, run as
    ATen's autocast runs ``vdot`` (Note [Autocast parity of widened ops])."""
    a = ctx.as_wide(ctx.value(node.args[0]), 1, node)
    b = ctx.as_wide(ctx.value(node.args[1]), 1, node)
    row = ctx.emit(aten.unsqueeze.default, (ctx.emit(aten.conj.default, (a.node,), like=node), 1), like=node)
    col = ctx.emit(aten.unsqueeze.default, (b.node, -1), like=node)
    out = ctx.emit(_AS_ATEN[aten.vdot.default], (row, col), like=node)
    return Wide(ctx.emit(aten.reshape.default, (out, [ctx.n]), like=node, name=node.name), 0)
