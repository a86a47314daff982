"""Widen rules: dim-taking ops (softmax, cumsum, reductions, sort/topk, ...), derived from the
schema: non-negative dims shift by one (the member dim comes first), negative dims stay; a
reduction over "all dims" (``dim=None``, ``[]``, or an overload without ``dim``) reduces over the
member's dims only."""

from __future__ import annotations

import torch
from torch import fx

from ..table import rows, rule
from ..context import Wide, WidenContext, member_rank

aten = torch.ops.aten

# Schema argument names that hold dimension indices.
DIM_ARGS = ("dim", "dims", "dim0", "dim1", "dim2", "start_dim", "end_dim", "source", "destination",
            "axis0", "axis1", "dimension")
# Ops that work on the flattened tensor when dim is None, like a reduction over all dims.
FLATTEN_WHEN_NO_DIM = {aten.repeat_interleave.self_int, aten.repeat_interleave.self_Tensor}


def shift_dim(d: int) -> int:
    """A member dim index -> the wide dim index (negative indices count from the end: unchanged)."""
    return d + 1 if d >= 0 else d


def _arg_type(op, name: str):
    for a in op._schema.arguments:
        if a.name == name:
            t = a.type
            return t.getElementType() if isinstance(t, torch.OptionalType) else t
    return None


def is_tensor_arg(op, name: str) -> bool:
    return isinstance(_arg_type(op, name), torch.TensorType)


def shift_dims(value):
    if isinstance(value, (list, tuple)):
        return [shift_dim(d) for d in value]
    return shift_dim(value)


def dim_rule(ctx: WidenContext, node: fx.Node):
    """Generic: shift every dim argument. Other tensor arguments (src, values, same-rank indices
    of gather/scatter) become wide with their own member rank (a shared 0-d one stays shared).
    Ops whose ``index`` is a list of positions (index_select, index_add, ...) are not for this
    rule: rules/indexing.py widens them. A reduction over all dims reduces the
    member's dims: ``dim=None``/``[]`` with a list-typed ``dim`` becomes the list of member dims;
    with an int-typed ``dim`` the member's dims are flattened into one first (argmax, ...)."""
    values = ctx.schema_args(node)
    first = next(iter(values))
    self_v = values[first]
    if not isinstance(self_v, Wide):
        raise ctx.fail(node, "expected the per-member tensor as the first argument")
    rank = self_v.rank
    reduction = "keepdim" in values
    flattened = False
    # Note [A dim op on a 0-d member value]: torch takes dim 0 or -1 (and all dims) of a 0-d tensor
    # as its one element; on the wide [N] those would be the member dim (a reduction over all dims
    # with no member dims left, ``sum(x, [])``, summed over the members: ``h.sum().sum()``, probe 19
    # of issue 44, P19-1). The op runs on the [N, 1] view instead, its result back to [N].
    zero_d = rank == 0
    if zero_d:
        values[first] = Wide(ctx.emit(aten.reshape.default, (self_v.node, [ctx.n, 1]), like=node), 1)
        rank = 1
        for name in DIM_ARGS:
            v = values.get(name)
            if name in values and not is_tensor_arg(node.target, name) and v is not None:
                values[name] = [0] * len(v) if isinstance(v, (list, tuple)) else 0
    for name in DIM_ARGS:
        if name not in values or is_tensor_arg(node.target, name):  # index_add's `source` is a tensor
            continue
        v = values[name]
        list_typed = isinstance(_arg_type(node.target, name), torch.ListType)
        all_dims = reduction or node.target in FLATTEN_WHEN_NO_DIM
        if all_dims and name == "dim" and (v is None or (list_typed and len(v) == 0)):
            if list_typed:
                values[name] = list(range(1, rank + 1))
            else:  # one int dim: flatten the member's dims into dim 1
                values[first] = Wide(ctx.emit(aten.reshape.default, (self_v.node, [ctx.n, -1]), like=node), 1)
                values[name] = 1
                flattened = True
        elif v is not None:
            values[name] = shift_dims(v)
    for name, v in values.items():
        if name == first or not isinstance(v, (Wide, fx.Node)) or not is_tensor_arg(node.target, name):
            continue
        arg_rank = _member_rank_of(node, name)
        if arg_rank == 0 and not isinstance(v, Wide):
            continue  # a shared 0-d tensor (index_fill's value) is the same scalar for every member
        values[name] = ctx.as_wide(v, arg_rank, node)
    out = ctx.outputs(node, ctx.emit_schema(node.target, values, like=node, name=node.name))
    if zero_d:  # Note [A dim op on a 0-d member value]: [N, ...] -> [N]
        back = lambda w: Wide(ctx.emit(aten.reshape.default, (w.node, [ctx.n]), like=node), 0) if w.rank == 0 else w  # noqa: E731
        return type(out)(back(w) for w in out) if isinstance(out, (tuple, list)) else back(out)
    if flattened and values.get("keepdim"):  # [N, 1] -> [N, 1, ..., 1] (member rank dims)
        reshape = lambda w: Wide(ctx.emit(aten.reshape.default, (w.node, [ctx.n] + [1] * rank), like=node), rank)  # noqa: E731
        out = type(out)(reshape(w) for w in out) if isinstance(out, (tuple, list)) else reshape(out)
    return out


def _member_rank_of(node: fx.Node, name: str) -> int:
    for i, a in enumerate(node.target._schema.arguments):
        if a.name == name:
            raw = node.args[i] if i < len(node.args) and not a.kwarg_only else node.kwargs.get(name)
            return member_rank(raw)
    return 0


_DIM_OPS = [
    "softmax.int", "log_softmax.int", "special_softmax.default", "special_log_softmax.default", "cumsum.default",
    "cumprod.default", "logcumsumexp.default", "sum.dim_IntList", "mean.dim", "amax.default",
    "amin.default", "argmax.default", "argmin.default", "var.correction", "var.dim", "std.correction",
    "std.dim", "var_mean.correction", "std_mean.correction", "linalg_vector_norm.default",
    "norm.ScalarOpt_dim", "max.dim", "min.dim", "logsumexp.default", "prod.dim_int", "any.dim",
    "any.dims", "all.dim", "all.dims", "topk.default", "sort.default", "sort.stable", "argsort.default",
    "argsort.stable", "cummax.default", "cummin.default", "median.dim", "mode.default",
    "kthvalue.default", "nansum.default", "glu.default", "aminmax.default",
    "var_mean.dim", "std_mean.dim", "select_scatter.default", "slice_scatter.default",
    "diagonal_scatter.default", "diag_embed.default",
    # ops taking an index tensor (gather, scatter*, index_*) are rules/indexing.py's
]

rows(dim_rule, _DIM_OPS)


# Reductions with no dim at all: reduce over the member's dims, per member.
def _member_dims(ctx: WidenContext, x: Wide, node: fx.Node) -> tuple[fx.Node, list[int]]:
    """``x`` and its member dims to reduce over all of: a 0-d member value as [N, 1] and dim 1 (an
    empty list would reduce over the members too: Note [A dim op on a 0-d member value])."""
    if x.rank == 0:
        return ctx.emit(aten.reshape.default, (x.node, [ctx.n, 1]), like=node), [1]
    return x.node, list(range(1, x.rank + 1))


@rule(aten.sum.default, aten.mean.default)
def _reduce_all(ctx: WidenContext, node: fx.Node) -> Wide:
    x, dims = _member_dims(ctx, ctx.value(node.args[0]), node)
    target = aten.sum.dim_IntList if node.target is aten.sum.default else aten.mean.dim
    kwargs = {"dtype": node.kwargs["dtype"]} if node.kwargs.get("dtype") is not None else {}
    out = ctx.emit(target, (x, dims, False), kwargs, like=node, name=node.name)
    return Wide(out, 0)


@rule(aten.max.default, aten.min.default)
def _extreme_all(ctx: WidenContext, node: fx.Node) -> Wide:
    x, dims = _member_dims(ctx, ctx.value(node.args[0]), node)
    target = aten.amax.default if node.target is aten.max.default else aten.amin.default
    return Wide(ctx.emit(target, (x, dims), like=node, name=node.name), 0)


@rule(aten.prod.default, aten.all.default, aten.any.default)
def _flat_reduce(ctx: WidenContext, node: fx.Node) -> Wide:
    x = ctx.value(node.args[0])
    flat = ctx.emit(aten.reshape.default, (x.node, [ctx.n, -1]), like=node)
    target = {aten.prod.default: aten.prod.dim_int, aten.all.default: aten.all.dim,
              aten.any.default: aten.any.dim}[node.target]
    kwargs = {k: v for k, v in node.kwargs.items() if k == "dtype"}
    return Wide(ctx.emit(target, (flat, 1), kwargs, like=node, name=node.name), 0)


@rule(aten.norm.Scalar, aten.std.default, aten.var.default)
def _flat_stat(ctx: WidenContext, node: fx.Node) -> Wide:
    x = ctx.value(node.args[0])
    flat = ctx.emit(aten.reshape.default, (x.node, [ctx.n, -1]), like=node)
    if node.target is aten.norm.Scalar:
        p = node.args[1] if len(node.args) > 1 else 2
        out = ctx.emit(aten.linalg_vector_norm.default, (flat, p, [1]), like=node, name=node.name)
    else:
        unbiased = node.args[1] if len(node.args) > 1 else node.kwargs.get("unbiased", True)
        target = aten.std.correction if node.target is aten.std.default else aten.var.correction
        out = ctx.emit(target, (flat, [1]), {"correction": 1 if unbiased else 0}, like=node, name=node.name)
    return Wide(out, 0)
