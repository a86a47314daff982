"""Widen rules: shape ops (view/reshape/expand/permute/transpose/squeeze/slicing/cat/split/...).

Sizes get the member dim prepended, dim arguments shift (see reduction.dim_rule), permutations
keep the member dim first. ``x.size(d)`` reads dim d+1 of the wide tensor: sizes are the same for
every member, so they are shared values.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from ..table import rows, rule
from ..context import Wide, WidenContext, member_rank
from .reduction import dim_rule

aten = torch.ops.aten

# Ops whose only change is shifting their dim arguments.
_DIM_SHAPE_OPS = [
    aten.transpose.int, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
    aten.flatten.using_ints, aten.unflatten.int, aten.select.int, aten.slice.Tensor,
    aten.narrow.default, aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
    aten.unbind.int, aten.tensor_split.sections, aten.tensor_split.indices, aten.flip.default,
    aten.movedim.int, aten.movedim.intlist, aten.diagonal.default,
    aten.repeat_interleave.self_int, aten.unfold.default, aten.swapaxes.default, aten.swapdims.default,
]
rows(dim_rule, _DIM_SHAPE_OPS)


def _wide(ctx: WidenContext, node: fx.Node, i: int = 0) -> Wide:
    v = ctx.value(node.args[i])
    if not isinstance(v, Wide):
        raise ctx.fail(node, "expected a per-member tensor")
    return v


@rule(aten.sym_size.int)
def _sym_size(ctx: WidenContext, node: fx.Node):
    x, d = _wide(ctx, node), node.args[1]
    return ctx.emit(aten.sym_size.int, (x.node, d + 1 if d >= 0 else d), like=node, name=node.name)


@rule(aten.sym_numel.default)
def _sym_numel(ctx: WidenContext, node: fx.Node):
    numel = ctx.emit(aten.sym_numel.default, (_wide(ctx, node).node,), like=node)
    return ctx.emit(operator.floordiv, (numel, ctx.n), like=node, name=node.name)


def _mutated(node: fx.Node) -> bool:
    """Whether some user writes into ``node`` in place (then a view must stay a view)."""
    for user in node.users:
        schema = getattr(user.target, "_schema", None)
        if schema is None:
            continue
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                arg = user.args[i] if i < len(user.args) else user.kwargs.get(a.name)
                if arg is node:
                    return True
    return False


@rule(aten.view.default, aten.reshape.default, aten._unsafe_view.default)
def _view(ctx: WidenContext, node: fx.Node) -> Wide:
    """Member sizes with the member dim prepended. A member's ``view`` of a contiguous tensor may
    meet a wide tensor that is a strided view (the shared-input GEMM returns one), so it becomes a
    ``reshape`` (a view whenever possible, else a copy), unless the view or its base is written in
    place, where aliasing is the point and ``view`` is kept."""
    x, size = _wide(ctx, node), ctx.value(node.args[1])
    target = node.target
    if target is aten.view.default and not (_mutated(node) or _mutated(node.args[0])):
        target = aten.reshape.default
    return Wide(ctx.emit(target, (x.node, [ctx.n, *size]), like=node, name=node.name), len(size))


@rule(aten.expand_as.default, aten.view_as.default, aten.reshape_as.default)
def _as_other(ctx: WidenContext, node: fx.Node) -> Wide:
    x, other = ctx.value(node.args[0]), ctx.value(node.args[1])
    if not isinstance(x, Wide):  # a shared tensor (an index or constant made in the forward) shaped as a
        x = ctx.as_wide(x, member_rank(node.args[0]), node)  # per-member one: every member's is it (probe 17, P17-2)
    rank = member_rank(node.args[1])
    other = ctx.as_wide(other, rank, node)
    base = ctx.align(x, rank, node) if node.target is aten.expand_as.default else x.node
    target = aten.reshape_as.default if node.target is aten.view_as.default and not _mutated(node) else node.target
    return Wide(ctx.emit(target, (base, other.node), like=node, name=node.name), rank)


@rule(aten.expand.default)
def _expand(ctx: WidenContext, node: fx.Node) -> Wide:
    x, size = _wide(ctx, node), ctx.value(node.args[1])
    base = ctx.align(x, len(size), node)
    return Wide(ctx.emit(aten.expand.default, (base, [-1, *size]), like=node, name=node.name), len(size))


@rule(aten.repeat.default)
def _repeat(ctx: WidenContext, node: fx.Node) -> Wide:
    x, reps = _wide(ctx, node), ctx.value(node.args[1])
    base = ctx.align(x, len(reps), node)
    return Wide(ctx.emit(aten.repeat.default, (base, [1, *reps]), like=node, name=node.name), len(reps))


@rule(aten.permute.default)
def _permute(ctx: WidenContext, node: fx.Node) -> Wide:
    x, dims = _wide(ctx, node), node.args[1]
    perm = [0] + [(d % x.rank) + 1 if x.rank else 0 for d in dims]
    return Wide(ctx.emit(aten.permute.default, (x.node, perm), like=node, name=node.name), x.rank)


@rule(aten.t.default, aten.numpy_T.default)
def _t(ctx: WidenContext, node: fx.Node) -> Wide:
    x = _wide(ctx, node)
    perm = [0] + list(range(x.rank, 0, -1))  # reverse the member dims (t: rank <= 2)
    return Wide(ctx.emit(aten.permute.default, (x.node, perm), like=node, name=node.name), x.rank)


@rule(aten.squeeze.default)
def _squeeze(ctx: WidenContext, node: fx.Node) -> Wide:
    # Squeeze the member's size-1 dims only: never the member dim (N may be 1). Sizes traced as
    # symbols are >= 2 (export specialises 0/1), so the static 1s are exactly the squeezed dims.
    x = _wide(ctx, node)
    dims = [i + 1 for i, s in enumerate(node.args[0].meta["val"].shape) if isinstance(s, int) and s == 1]
    return Wide(ctx.emit(aten.squeeze.dims, (x.node, dims), like=node, name=node.name), member_rank(node))


@rule(aten.cat.default, aten.stack.default)
def _cat(ctx: WidenContext, node: fx.Node) -> Wide:
    args = list(node.args[0])
    if node.target is aten.cat.default and member_rank(node) != 1:
        # torch.cat skips 1-D empty inputs of any other rank (legacy; transformers' caches start as
        # torch.tensor([])); widened they would be [N, 0] and refused, so they are dropped here
        kept = [t for t in args if tuple(t.meta["val"].shape) != (0,)]
        args = kept or args[:1]
    tensors = [ctx.value(t) for t in args]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    ranks = [member_rank(t) for t in args]
    nodes = [ctx.as_wide(v, r, node).node for v, r in zip(tensors, ranks)]
    return Wide(ctx.emit(node.target, (nodes, dim + 1 if dim >= 0 else dim), like=node, name=node.name),
                member_rank(node))


@rule(aten.roll.default)
def _roll(ctx: WidenContext, node: fx.Node):
    dims = node.args[2] if len(node.args) > 2 else node.kwargs.get("dims", [])
    if not dims:  # roll of the flattened tensor: per member
        from ..fallback import fallback
        return fallback(ctx, node, reason="roll without dims flattens the member")
    return dim_rule(ctx, node)


def member_index(x: torch.Tensor, rank: int) -> torch.Tensor:
    """``arange(N)`` on ``x``'s device, shaped ``[N, 1 * rank]``: the advanced index that keeps
    member ``i`` reading row ``i`` of a wide tensor (a graph call, so ``.to(device)`` follows)."""
    return torch.arange(x.shape[0], device=x.device).view(-1, *([1] * rank))


@rule(aten.index.Tensor)
def _index(ctx: WidenContext, node: fx.Node):
    """``x[idx, ...]``. Shared indices that are adjacent keep their place behind a full slice for
    the member dim. Otherwise (an index is per member -- CLIP's end-of-text token, Swin's
    relative-position buffer -- or the indices are separated by slices) the member dim gets its
    own advanced index ``arange(N)``, every per-member index ``[N, *s]`` is aligned to the
    members' broadcast shape, and the broadcast dims, which numpy puts first when advanced
    indices are not adjacent, are permuted back behind the member dim where the member has them.
    Boolean masks select a member-dependent count, so a per-member one goes through the fallback."""
    x, indices = _wide(ctx, node), list(ctx.value(node.args[1]))
    present = [i for i, t in enumerate(indices) if t is not None]
    adjacent = present == list(range(present[0], present[-1] + 1)) if present else True
    if not ctx.is_wide(indices) and adjacent:
        return Wide(ctx.emit(aten.index.Tensor, (x.node, [None, *indices]), like=node, name=node.name),
                    member_rank(node))
    metas = [node.args[1][i].meta["val"] for i in present]
    if any(m.dtype in (torch.bool, torch.uint8) for m in metas):
        from ..fallback import fallback
        return fallback(ctx, node, reason="a per-member boolean mask index selects a different count per member")
    shape = torch.broadcast_shapes(*(m.shape for m in metas))
    wide_indices = [ctx.emit(member_index, (x.node, len(shape)), like=node)]
    for t in indices:
        wide_indices.append(ctx.align(t, len(shape), node) if isinstance(t, Wide) else t)
    lead, rank = (present[0] if adjacent else 0), member_rank(node)
    out = ctx.emit(aten.index.Tensor, (x.node, wide_indices), like=node, name=None if lead else node.name)
    if lead:  # numpy put the broadcast dims before the member's leading slices: move them back
        r = len(shape)
        perm = [0, *range(r + 1, r + 1 + lead), *range(1, r + 1), *range(r + 1 + lead, rank + 1)]
        out = ctx.emit(aten.permute.default, (out, perm), like=node, name=node.name)
    return Wide(out, rank)


@rule(operator.getitem)
def _getitem(ctx: WidenContext, node: fx.Node):
    container, i = ctx.value(node.args[0]), node.args[1]
    if isinstance(container, (tuple, list)):
        return container[i]
    raise ctx.fail(node, "getitem on a per-member value that is not a tuple or list")


@rule(aten.detach_.default)
def _detach_(ctx: WidenContext, node: fx.Node) -> Wide:
    """``g.detach_()`` of an intermediate: Note [detach_ of an intermediate]."""
    x = _wide(ctx, node)
    out = ctx.emit(aten.detach.default, (x.node,), like=node)
    src = node.args[0]
    if isinstance(src, fx.Node):
        ctx.env[src] = Wide(out, x.rank)  # later reads of the tensor itself see it detached too
    return Wide(out, x.rank)


# Note [detach_ of an intermediate]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``g = h * 1; g.detach_()`` changes only g's autograd state: later uses of g are cut from the
# graph, earlier ones (already recorded) are not, and the values are g's. The wide tensor of g
# may be a view where the member's is not (a rule's view after a batched op), and torch refuses
# detach_ of a view, so the per-member vmap fallback failed at compile ("Can't detach views
# in-place", probe 6 of issue 44, F14). The widened program is the same without the mutation: an
# out-of-place detach (sharing the storage, as detach_ keeps it), read by every later use of g --
# the detach_ node's users and, through the widen environment, any later reader of g itself. The
# member's own detach_ of a view is refused by torch in the member (and at capture) already.


@rule(aten._assert_tensor_metadata.default)
def _drop_assert(ctx: WidenContext, node: fx.Node):
    # export's check of one member's size/dtype; the wide tensor has the member dim in front
    return None


@rule(aten.mT.default, aten.mH.default, aten.matrix_H.default, aten.adjoint.default, aten.tril.default,
      aten.triu.default)
def _trailing(ctx: WidenContext, node: fx.Node) -> Wide:
    # Ops on the last dims only (negative dim defaults): unchanged on the wide tensor (x.H of a
    # member matrix is the batched mH of the wide tensor).
    x = _wide(ctx, node)
    target = aten.mH.default if node.target is aten.matrix_H.default else node.target
    return Wide(ctx.emit(target, (x.node, *ctx.value(tuple(node.args[1:]))), ctx.value(node.kwargs),
                         like=node, name=node.name), member_rank(node))
