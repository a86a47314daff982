"""Widen rules: pointwise ops (unary, and binary with broadcasting)."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from ..table import rows, rule
from ..context import Wide, WidenContext, member_rank

aten = torch.ops.aten

# --- family: pointwise -----------------------------------------------------------------------
# Unary: the wide tensor is the first argument; the rest are non-tensor options.
_UNARY = [
    "relu", "relu_", "gelu", "silu", "silu_", "tanh", "tanh_", "sigmoid", "sigmoid_",
    "leaky_relu", "leaky_relu_", "hardtanh", "hardtanh_", "elu", "elu_", "celu", "celu_", "selu",
    "selu_", "softplus", "mish", "mish_", "hardswish", "hardswish_", "hardsigmoid", "hardsigmoid_",
    "log_sigmoid", "neg", "abs", "exp", "log", "sqrt", "rsqrt", "sin", "cos", "square",
    "reciprocal", "clamp", "clamp_", "clone", "alias", "detach", "erf", "sign", "rrelu",
    "contiguous", "to.dtype", "to.dtype_layout", "to.device", "masked_fill.Scalar",
    "where.self", "lerp.Scalar", "lerp.Tensor", "addcmul", "addcdiv",
    "clamp.Tensor", "nan_to_num", "logical_not", "bitwise_not",
]
# Binary with broadcasting between any mix of wide tensors, shared tensors and scalars.
_BINARY = [
    "add.Tensor", "add_.Tensor", "sub.Tensor", "sub_.Tensor", "rsub.Tensor", "rsub.Scalar",
    "mul.Tensor", "mul_.Tensor", "div.Tensor", "div_.Tensor", "div.Tensor_mode", "pow.Tensor_Scalar",
    "pow.Tensor_Tensor",
    "maximum.default", "minimum.default", "__and__.Tensor", "__or__.Tensor", "__xor__.Tensor",
    "bitwise_and.Tensor", "bitwise_or.Tensor", "bitwise_xor.Tensor", "logical_and.default",
    "logical_or.default", "logical_xor.default", "multiply.Tensor", "floor_divide.default",
    "where.ScalarOther", "where.ScalarSelf", "where.Scalar",
]
# Memory formats are layouts of one member's dims (channels_last needs a 4-D tensor): the wide
# tensor keeps its own layout; values are unchanged.
_DROP_KWARGS = ("memory_format",)


def _pointwise(ctx: WidenContext, node: fx.Node) -> Wide:
    """Any mix of wide tensors, shared tensors and scalars: wide operands get size-1 dims after
    the member dim up to the output's member rank, so broadcasting stays inside each member."""
    rank = member_rank(node)

    def convert(a: Any) -> Any:
        v = ctx.value(a)
        if isinstance(v, Wide):
            return ctx.align(v, rank, node)
        if ctx.is_wide(v):
            raise ctx.fail(node, "a per-member tensor inside a list argument")
        return v

    args = tuple(convert(a) for a in node.args)
    kwargs = {k: convert(a) for k, a in node.kwargs.items() if k not in _DROP_KWARGS}
    return Wide(ctx.emit(node.target, args, kwargs, like=node, name=node.name), rank)


# In-place writes that ATen does not tag pointwise; the target is per member (see Note [Per-member
# writes into shared tensors] in widen.py). Not pushed through by the layout plan ("nfirst").
_INPLACE = ["copy_", "fill_.Scalar", "zero_", "masked_fill_.Scalar", "abs_"]

# Same member values on packed and N-first tensors of one member shape: "elementwise" layout.
rule(layout="elementwise", tagged_pointwise=True)(_pointwise)  # any op tagged torch.Tag.pointwise
rows(_pointwise, _UNARY + _BINARY, layout="elementwise")
rows(_pointwise, _INPLACE)


@rule("type_as", layout="elementwise")
def _type_as(ctx: WidenContext, node: fx.Node):
    """``x.type_as(other)`` reads only other's dtype: the result is x's, shared when x is (a
    mask made with ``torch.ones(...).type_as(hidden)`` stays one mask for all members)."""
    x, other = ctx.value(node.args[0]), ctx.unwrap(ctx.value(node.args[1]))
    out = ctx.emit(node.target, (ctx.unwrap(x), other), like=node, name=node.name)
    return Wide(out, x.rank) if isinstance(x, Wide) else out


@rule("masked_fill.Tensor", "masked_fill_.Tensor", "fill_.Tensor")
def _fill_value(ctx: WidenContext, node: fx.Node) -> Wide:
    """Fills whose value is a 0-d tensor: a shared value broadcasts as any pointwise operand; a
    per-member value (``x.masked_fill(m, self.w[0])``) cannot be one 0-d tensor, so the fill
    becomes ``where(mask, value, x)`` with the value aligned ``[N, 1, ..., 1]`` (written back with
    ``copy_`` for the in-place forms)."""
    value = ctx.value(node.args[-1])
    if not isinstance(value, Wide):
        return _pointwise(ctx, node)
    rank = member_rank(node.args[0])
    x = ctx.as_wide(ctx.value(node.args[0]), rank, node)
    v = ctx.align(value, rank, node)
    if node.target is aten.fill_.Tensor:
        return Wide(ctx.emit(aten.copy_.default, (x.node, v), like=node, name=node.name), rank)
    mask = ctx.as_wide(ctx.value(node.args[1]), member_rank(node.args[1]), node)
    inplace = node.target is aten.masked_fill_.Tensor
    out = ctx.emit(aten.where.self, (ctx.align(mask, rank, node), v, x.node), like=node,
                   name=None if inplace else node.name)
    if inplace:
        out = ctx.emit(aten.copy_.default, (x.node, out), like=node, name=node.name)
    return Wide(out, rank)
