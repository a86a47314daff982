"""Widen rules: ops that take an index tensor (index_select/add/copy/fill, gather, scatter*,
index_put). An index is shared (a constant of the forward) or per member (a buffer each member
holds, such as a GCN's ``edge_index``, or computed from per-member values); both are widened:

* **Position lists** (``index_select``, ``index_add``, ``index_copy``, ``index_fill``): ``index``
  is a list of positions along ``dim`` (1-D, or 0-d), whatever the rank of ``self``. A shared
  list stays as it is and the op runs along ``dim + 1``. A per-member list ``[N, K]`` becomes
  positions into the tensor with the member dim folded into ``dim`` (member i's position p is
  ``i * size + p``) and the op runs once on that (:func:`index_per_member`). A position outside
  the member's range (which the member's own op refuses) is mapped outside the folded tensor, so
  the wide op refuses it too instead of reaching into another member.
* **Same-rank indices** (``gather``, ``scatter``, ``scatter_add``, ``scatter_reduce``): ``index``
  has the rank of ``self``; shared ones are expanded over the members (stride 0) and the op runs
  along ``dim + 1`` on N-first tensors (the generic dim rule), a shared ``self`` being expanded too
  when the index or the source is per member.
* **index_put** (``x[idx] = v``): as ``aten.index`` (rules/shape.py): shared adjacent indices keep
  their place behind a full slice for the member dim; otherwise the member dim gets its own
  advanced index ``arange(N)`` and ``values`` are permuted like the indexed result. A per-member
  boolean mask with a single value (``x[x > 0] = 0``) is a ``where``; a per-member mask with a
  tensor of values selects a different count per member and goes to the fallback.
"""

from __future__ import annotations

import torch
from torch import fx

from ..table import rule
from ..context import Wide, WidenContext, member_rank
from .reduction import dim_rule
from .shape import member_index

aten = torch.ops.aten


def _fallback(ctx: WidenContext, node: fx.Node, reason: str):
    from ..fallback import fallback

    return fallback(ctx, node, reason=reason)


# --- position lists --------------------------------------------------------------------------


def _folded_positions(index: torch.Tensor, n: int, size: int, wrap: bool) -> torch.Tensor:
    """Per-member positions ``[N, K]`` (or ``[N]``) along a dim of ``size`` -> positions into the
    ``[N * size, ...]`` tensor that folds the member dim into that dim. Positions outside
    ``[0, size)`` (``[-size, size)`` with ``wrap``, negative ones counting from the end) become
    ``N * size``, out of range, so the op raises as the member's would."""
    index = index.reshape(n, -1).long()
    if wrap:
        index = torch.where(index < 0, index + size, index)
    valid = (index >= 0) & (index < size)
    offsets = torch.arange(n, device=index.device).unsqueeze(1) * size
    return torch.where(valid, index + offsets, n * size).reshape(-1)


def _fold(t: torch.Tensor, dim: int) -> torch.Tensor:
    return t.movedim(dim, 1).flatten(0, 1)


def _unfold(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    return t.unflatten(0, (n, -1)).movedim(1, dim)


def index_per_member(op: str, x: torch.Tensor, dim: int, index: torch.Tensor, *rest):
    """``x.<op>(dim, index, *rest)`` for every member at once, with a per-member ``index``
    ``[N, K]``: the member dim is folded into ``dim`` (a graph call, so it runs as the ATen ops
    it is made of under autograd, ``torch.compile`` and ``torch.export``). ``op`` is
    ``index_select``, ``index_add`` (rest: source, alpha), ``index_copy`` (rest: source) or
    ``index_fill`` (rest: value)."""
    n, size = x.shape[0], x.shape[dim]
    flat = _folded_positions(index, n, size, wrap=op == "index_fill")
    folded = _fold(x, dim)
    if op == "index_select":
        out = folded.index_select(0, flat)
    elif op == "index_add":
        source, alpha = rest
        out = folded.index_add(0, flat, _fold(source, dim), alpha=alpha)
    elif op == "index_copy":
        out = folded.index_copy(0, flat, _fold(rest[0], dim))
    elif op == "index_fill":
        out = folded.index_fill(0, flat, rest[0])
    else:
        raise ValueError(f"wide_compiler: index_per_member: unknown op {op!r}")
    return _unfold(out, n, dim)


# op -> (name for index_per_member, in place, the schema names of its extra arguments)
_POSITION_OPS = {
    aten.index_select.default: ("index_select", False, ()),
    aten.index_add.default: ("index_add", False, ("source", "alpha")),
    aten.index_add_.default: ("index_add", True, ("source", "alpha")),
    aten.index_copy.default: ("index_copy", False, ("source",)),
    aten.index_copy_.default: ("index_copy", True, ("source",)),
    aten.index_fill.int_Scalar: ("index_fill", False, ("value",)),
    aten.index_fill_.int_Scalar: ("index_fill", True, ("value",)),
    aten.index_fill.int_Tensor: ("index_fill", False, ("value",)),
    aten.index_fill_.int_Tensor: ("index_fill", True, ("value",)),
}


@rule(*_POSITION_OPS)
def _positions(ctx: WidenContext, node: fx.Node):
    """A position-list op (see the module notes): a shared list runs the op itself along
    ``dim + 1``, a per-member list goes through :func:`index_per_member`; a per-member 0-d fill
    value becomes ``where(positions, value, x)`` with the positions marked by an ``index_fill`` of
    a mask. The in-place forms of the last two write the result back with ``copy_``."""
    name, inplace, extra = _POSITION_OPS[node.target]
    values = ctx.schema_args(node)
    rank = member_rank(node.args[0])
    if rank == 0:
        return _fallback(ctx, node, f"{name} of a 0-d tensor")
    x = ctx.as_wide(values["self"], rank, node)
    dim = values["dim"] % rank + 1  # the wide dim
    index = values["index"]
    sources = {}
    for arg in extra:
        v = values[arg]
        if arg == "source":
            if member_rank(_old_arg(node, arg)) != rank:
                return _fallback(ctx, node, f"{name} with a source of another rank than self")
            v = ctx.as_wide(v, rank, node).node
        sources[arg] = v
    value = sources.get("value")
    if isinstance(value, Wide):  # a per-member 0-d fill value: fill a mask, then where
        mask = ctx.emit(aten.zeros_like.default, (x.node,), {"dtype": torch.bool}, like=node)
        mask = _fill_positions(ctx, node, mask, dim, index, True)
        out = ctx.emit(aten.where.self, (mask, ctx.align(value, rank, node), x.node), like=node,
                       name=None if inplace else node.name)
    elif isinstance(index, Wide):
        args = [sources[a] for a in extra]
        out = ctx.emit(index_per_member, (name, x.node, dim, index.node, *args), like=node,
                       name=None if inplace else node.name)
    else:  # shared positions: the op itself (in place where the member's is) along dim + 1
        target = node.target
        if name == "index_fill":
            tensor_value = isinstance(value, fx.Node)
            target = {(False, False): aten.index_fill.int_Scalar, (False, True): aten.index_fill.int_Tensor,
                      (True, False): aten.index_fill_.int_Scalar, (True, True): aten.index_fill_.int_Tensor}[
                          (inplace, tensor_value)]
        kwargs = {"alpha": sources["alpha"]} if name == "index_add" else {}
        args = [sources[a] for a in extra if a != "alpha"]
        return Wide(ctx.emit(target, (x.node, dim, index, *args), kwargs, like=node, name=node.name), rank)
    if inplace:
        out = ctx.emit(aten.copy_.default, (x.node, out), like=node, name=node.name)
    return Wide(out, rank)


def _fill_positions(ctx: WidenContext, node: fx.Node, t: fx.Node, dim: int, index, value) -> fx.Node:
    if isinstance(index, Wide):
        return ctx.emit(index_per_member, ("index_fill", t, dim, index.node, value), like=node)
    return ctx.emit(aten.index_fill.int_Scalar, (t, dim, index, value), like=node)


def _old_arg(node: fx.Node, name: str):
    for i, a in enumerate(node.target._schema.arguments):
        if a.name == name:
            return node.args[i] if i < len(node.args) and not a.kwarg_only else node.kwargs.get(name)
    return None


# --- same-rank indices -----------------------------------------------------------------------

_SAME_RANK = [
    "gather.default", "scatter.src", "scatter.value", "scatter_add.default", "scatter_reduce.two",
    "scatter_.src", "scatter_.value", "scatter_add_.default", "scatter_reduce_.two",
]


@rule(*_SAME_RANK)
def _same_rank(ctx: WidenContext, node: fx.Node):
    """``index`` has the rank of ``self``: every tensor argument N-first (shared ones expanded,
    a shared ``self`` too when the index or the source is per member) and ``dim + 1``."""
    rank = member_rank(node.args[0])
    if rank == 0:
        return _fallback(ctx, node, f"{node.target.__name__} of a 0-d tensor")
    self_v = ctx.value(node.args[0])
    if not isinstance(self_v, Wide):
        # out of place on a shared tensor (in-place targets were made per member already)
        original = ctx.env[node.args[0]]
        ctx.env[node.args[0]] = ctx.as_wide(self_v, rank, node)
        try:
            return dim_rule(ctx, node)
        finally:
            ctx.env[node.args[0]] = original
    return dim_rule(ctx, node)


# --- index_put -------------------------------------------------------------------------------


def _is_mask(t: torch.Tensor) -> bool:
    return t.dtype in (torch.bool, torch.uint8)


@rule(aten.index_put.default, aten.index_put_.default)
def _index_put(ctx: WidenContext, node: fx.Node):
    """``x[indices] = values`` (``accumulate``: ``+=``), see the module notes."""
    rank = member_rank(node.args[0])
    inplace = node.target is aten.index_put_.default
    old_indices = list(node.args[1])
    indices = [ctx.value(t) for t in old_indices]
    present = [i for i, t in enumerate(old_indices) if t is not None]
    metas = {i: old_indices[i].meta["val"] for i in present}
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    x = ctx.as_wide(ctx.value(node.args[0]), rank, node)
    old_values = node.args[2]
    values = ctx.value(old_values)
    v_rank = member_rank(old_values)
    masks = [i for i in present if _is_mask(metas[i])]
    wide_index = any(isinstance(indices[i], Wide) for i in present)

    adjacent = present == list(range(present[0], present[-1] + 1)) if present else True
    if masks and wide_index:
        if len(present) == 1 and v_rank == 0:
            return _masked_put(ctx, node, x, present[0], indices[present[0]], values, accumulate, inplace)
        return _fallback(ctx, node, "a per-member boolean mask index selects a different count per member")
    if masks and not adjacent:
        return _fallback(ctx, node, "a boolean mask index among indices separated by slices")
    # the indexed result of one member: the broadcast dims of the indices replace the dims they index
    b_rank = max((1 if _is_mask(metas[i]) else metas[i].dim()) for i in present) if present else 0
    consumed = sum(metas[i].dim() if _is_mask(metas[i]) else 1 for i in present)
    r_res = rank - consumed + b_rank
    if v_rank > r_res:
        return _fallback(ctx, node, "values of more dims than the indexed result")
    v = ctx.align(ctx.as_wide(values, v_rank, node), r_res, node)
    if not wide_index and adjacent:
        wide_indices = [None, *(ctx.unwrap(t) for t in indices)]
    else:
        wide_indices = [ctx.emit(member_index, (x.node, b_rank), like=node)]
        wide_indices += [ctx.align(t, b_rank, node) if isinstance(t, Wide) else t for t in indices]
        lead = present[0] if adjacent else 0
        if lead:  # numpy puts the broadcast dims first: values in the member's order, permuted so
            perm = [0, *range(lead + 1, lead + 1 + b_rank), *range(1, lead + 1), *range(lead + 1 + b_rank, r_res + 1)]
            v = ctx.emit(aten.permute.default, (v, perm), like=node)
    out = ctx.emit(node.target, (x.node, wide_indices, v, accumulate), like=node, name=node.name)
    return Wide(out, rank)


def _masked_put(ctx: WidenContext, node: fx.Node, x: Wide, lead: int, mask: Wide, value, accumulate: bool,
                inplace: bool) -> Wide:
    """``x[mask] = value`` (``+=`` with ``accumulate``) for a per-member boolean mask over the
    member dims ``[lead, lead + mask rank)`` and one value: ``where(mask, value, x)``, the value
    cast to x's dtype as ``index_put`` does."""
    rank = member_rank(node.args[0])
    old_mask, old_value = node.args[1][lead], node.args[2]
    m = mask.node
    if old_mask.meta["val"].dtype is not torch.bool:
        m = ctx.emit(aten.to.dtype, (m, torch.bool), like=node)
    for _ in range(lead):
        m = ctx.emit(aten.unsqueeze.default, (m, 1), like=node)
    for _ in range(rank - lead - old_mask.meta["val"].dim()):
        m = ctx.emit(aten.unsqueeze.default, (m, -1), like=node)
    v = ctx.align(value, rank, node) if isinstance(value, Wide) else value
    dtype = node.args[0].meta["val"].dtype
    if old_value.meta["val"].dtype != dtype:
        v = ctx.emit(aten.to.dtype, (v, dtype), like=node)
    if accumulate:
        v = ctx.emit(aten.add.Tensor, (x.node, v), like=node)
    out = ctx.emit(aten.where.self, (m, v, x.node), like=node, name=None if inplace else node.name)
    if inplace:
        out = ctx.emit(aten.copy_.default, (x.node, out), like=node, name=node.name)
    return Wide(out, rank)
