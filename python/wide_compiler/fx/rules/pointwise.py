"""Widen rules: pointwise ops (unary, and binary with broadcasting)."""

from __future__ import annotations

from typing import Any

from torch import fx

from ..table import rows, rule
from ..widen import Wide, WidenContext, member_rank

# --- family: pointwise -----------------------------------------------------------------------
# Unary: the wide tensor is the first argument; the rest are non-tensor options.
_UNARY = [
    "relu", "relu_", "gelu", "gelu_", "silu", "silu_", "tanh", "tanh_", "sigmoid", "sigmoid_",
    "leaky_relu", "leaky_relu_", "hardtanh", "hardtanh_", "elu", "elu_", "celu", "celu_", "selu",
    "selu_", "softplus", "mish", "mish_", "hardswish", "hardswish_", "hardsigmoid", "hardsigmoid_",
    "log_sigmoid", "neg", "abs", "exp", "log", "sqrt", "rsqrt", "sin", "cos", "square",
    "reciprocal", "clamp", "clamp_", "clone", "alias", "detach", "erf", "sign", "rrelu",
    "contiguous", "lift_fresh_copy", "to.dtype", "to.dtype_layout", "to.device", "to.other",
    "_to_copy", "type_as", "masked_fill.Scalar", "masked_fill.Tensor", "where.self", "lerp.Scalar",
    "lerp.Tensor", "addcmul", "addcdiv", "clamp.Tensor", "nan_to_num", "logical_not", "bitwise_not",
]
# Binary with broadcasting between any mix of wide tensors, shared tensors and scalars.
_BINARY = [
    "add.Tensor", "add_.Tensor", "add.Scalar", "sub.Tensor", "sub_.Tensor", "sub.Scalar",
    "rsub.Tensor", "rsub.Scalar", "mul.Tensor", "mul_.Tensor", "mul.Scalar", "div.Tensor",
    "div_.Tensor", "div.Scalar", "div.Tensor_mode", "pow.Tensor_Scalar", "pow.Tensor_Tensor",
    "maximum.default", "minimum.default", "__and__.Tensor", "__or__.Tensor", "__xor__.Tensor",
    "bitwise_and.Tensor", "bitwise_or.Tensor", "bitwise_xor.Tensor", "logical_and.default",
    "logical_or.default", "logical_xor.default",
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
_INPLACE = ["copy_", "fill_.Scalar", "fill_.Tensor", "zero_", "masked_fill_.Scalar", "masked_fill_.Tensor"]

# Same member values on packed and N-first tensors of one member shape: "elementwise" layout.
rule(layout="elementwise", tagged_pointwise=True)(_pointwise)  # any op tagged torch.Tag.pointwise
rows(_pointwise, _UNARY + _BINARY, layout="elementwise")
rows(_pointwise, _INPLACE)
