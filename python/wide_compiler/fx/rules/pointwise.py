"""Widen rules: pointwise ops (unary, and binary with broadcasting)."""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Number
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

    args = _zero_dims_promote_as_in_the_member(ctx, node, tuple(convert(a) for a in node.args))
    kwargs = {k: convert(a) for k, a in node.kwargs.items() if k not in _DROP_KWARGS}
    if node.target in _SCALAR_IN_OPMATH and _emitted_by(args[1], as_member_opmath):
        # Note [A 0-dim multiplier in opmath]: the result back in the member's dtype
        out = ctx.emit(node.target, args, kwargs, like=node)
        return Wide(ctx.emit(as_input_dtype, (out, args[0]), like=node, name=node.name), rank)
    return Wide(ctx.emit(node.target, args, kwargs, like=node, name=node.name), rank)


def _emitted_by(a: Any, fn: Any) -> bool:
    return isinstance(a, fx.Node) and a.op == "call_function" and a.target is fn


# In-place writes that ATen does not tag pointwise; the target is per member (see Note [Per-member
# writes into shared tensors] in widen.py). Not pushed through by the layout plan ("nfirst").
_INPLACE = ["copy_", "fill_.Scalar", "zero_", "masked_fill_.Scalar", "abs_"]

# Same member values on packed and N-first tensors of one member shape: "elementwise" layout.
rule(layout="elementwise", tagged_pointwise=True)(_pointwise)  # any op tagged torch.Tag.pointwise
rows(_pointwise, _UNARY + _BINARY, layout="elementwise")
rows(_pointwise, _INPLACE)


# Note [A member's 0-dim operands keep their place in type promotion]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch's type promotion ranks a 0-dim tensor below tensors with dims (and Python numbers below
# both): a float32 ``[B, 4]`` plus a float64 0-dim ``x.sum()`` is float32, computed in float32.
# In the wide graph a per-member 0-dim value is ``[N]`` (aligned ``[N, 1, 1]``), a tensor with
# dims, so the same add promoted to float64 (float64 where each member returned float32; under
# bfloat16 autocast ``mm(W, W) + x.sum()`` or ``h / h.norm()`` float32 where the member returned
# bfloat16; a comparison made in the wider dtype: probe 6 of issue 44, F3). So where a pointwise
# op mixes such an operand with operands that have dims in the member, the operand is first cast
# to the dtype the member's op computes in: what TensorIterator does to a 0-dim operand in the
# member, so the values are the member's too. The dtype is found at the call
# (:func:`as_member_promotes`), from the dtypes the operands have then: under autocast they are
# not the capture's. Not the condition of ``where`` nor the mask of ``masked_fill`` (they take no
# part in promotion), nor the self of an in-place op (its dtype is the result's).
_NOT_PROMOTED = {aten.where.self: (0,), aten.masked_fill.Scalar: (1,), aten.masked_fill_.Scalar: (1,)}
_COMPLEX = {torch.float16: torch.complex32, torch.float32: torch.complex64, torch.float64: torch.complex128}


def _dtype_of(v: Any) -> torch.dtype:
    if isinstance(v, torch.Tensor):
        return v.dtype
    if isinstance(v, bool):
        return torch.bool
    if isinstance(v, int):
        return torch.int64
    return torch.get_default_dtype() if isinstance(v, float) else _COMPLEX[torch.get_default_dtype()]


def _tier(values: Sequence[Any]) -> torch.dtype | None:
    """The promoted dtype of operands of one rank of torch's promotion (None: no operand)."""
    out = None
    for v in values:
        out = _dtype_of(v) if out is None else torch.promote_types(out, _dtype_of(v))
    return out


def _combine(higher: torch.dtype | None, lower: torch.dtype | None) -> torch.dtype | None:
    """torch's promotion between a higher rank of operands and a lower one (dims over 0-dim
    tensors over Python numbers): the lower rank counts only when of a higher category."""
    if higher is None or lower is None:
        return lower if higher is None else higher
    if higher.is_complex:
        return higher
    if lower.is_complex:
        return _COMPLEX.get(higher, lower) if higher.is_floating_point else lower
    if higher.is_floating_point:
        return higher
    if higher == torch.bool or lower.is_floating_point:
        return torch.promote_types(higher, lower)
    return higher


def as_member_promotes(x: torch.Tensor, dims: Sequence[Any], zero_dims: Sequence[Any],
                       numbers: Sequence[Any]) -> torch.Tensor:
    """``x``, a value that is 0-dim in each member, cast to the dtype a member's pointwise op
    computes in when its other operands are ``dims`` (tensors with dims in the member),
    ``zero_dims`` (0-dim tensors) and ``numbers`` (Python numbers), at their dtypes now
    (Note [A member's 0-dim operands keep their place in type promotion]).

    >>> import torch
    >>> as_member_promotes(torch.ones(3, dtype=torch.float64), [torch.ones(2, 4)], [], []).dtype
    torch.float32
    >>> as_member_promotes(torch.ones(3, dtype=torch.float64), [torch.ones(2, dtype=torch.int32)], [], []).dtype
    torch.float64
    """
    dtype = _combine(_tier(dims), _combine(_tier([x, *zero_dims]), _tier(numbers)))
    return x if dtype is None or dtype == x.dtype else x.to(dtype)


def _zero_dims_promote_as_in_the_member(ctx: WidenContext, node: fx.Node, args: tuple) -> tuple:
    """Note [A member's 0-dim operands keep their place in type promotion]."""
    not_promoted = _NOT_PROMOTED.get(node.target, ())
    schema = getattr(node.target, "_schema", None)
    first = schema.arguments[0].alias_info if schema is not None and schema.arguments else None
    inplace = first is not None and first.is_write
    member = {i: (a.meta.get("val") if isinstance(a, fx.Node) else a) for i, a in enumerate(node.args)
              if i not in not_promoted}
    dims = [i for i, v in member.items() if isinstance(v, torch.Tensor) and v.dim() > 0]
    zero_dims = [i for i, v in member.items() if isinstance(v, torch.Tensor) and v.dim() == 0]
    per_member = [i for i in zero_dims if not (inplace and i == 0) and isinstance(ctx.value(node.args[i]), Wide)]
    if not dims or not per_member:
        return args
    numbers = [v for v in member.values() if isinstance(v, Number) and not isinstance(v, torch.Tensor)]
    out = list(args)
    for i in per_member:
        cast = as_member_promotes
        if node.target in _CAST_IN_OPMATH and i == 1 and 0 in dims and member[1].is_floating_point() \
                and member[1].element_size() >= 4:  # Note [A 0-dim multiplier in opmath]
            cast = as_member_opmath
        out[i] = ctx.emit(cast, (args[i], [args[j] for j in dims],
                                 [args[j] for j in zero_dims if j != i], numbers), like=node)
    return tuple(out)


# Note [A 0-dim multiplier in opmath]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ATen's CPU mul and div of a float16/bfloat16 tensor by a 0-dim float32 (or float64) tensor on
# the right read that operand as a scalar in their opmath type, float32, unrounded: the product is
# rounded once, to the tensor's dtype. Cast to the result's dtype first, a per-member multiplier
# (``h * torch.tensor(self.t)``) was rounded twice: 1 ulp off in a quarter of the values of a
# bfloat16 member (probe 20 of issue 44, P20-7). It is cast to float32 instead (as_member_opmath),
# and the product back to the tensor's dtype (as_input_dtype); elsewhere both are what
# as_member_promotes does. (On the left, and for add and sub, ATen rounds the operand first.)
# Only on the CPU: CUDA's kernels read a 0-dim operand as a scalar only when it lives on the CPU;
# one on the GPU is cast to the common dtype first, like any operand (rounded: a GPU run found the
# float32 operand 1 ulp off there), and a per-member value is on the model's device.
_SCALAR_IN_OPMATH = frozenset({aten.mul.Tensor, aten.div.Tensor})
_CAST_IN_OPMATH = _SCALAR_IN_OPMATH | {aten.mul_.Tensor, aten.div_.Tensor}  # in place: written in x's dtype


def as_member_opmath(x: torch.Tensor, dims: Sequence[Any], zero_dims: Sequence[Any],
                     numbers: Sequence[Any]) -> torch.Tensor:
    """Note [A 0-dim multiplier in opmath]: ``x`` in float32 beside a float16/bfloat16 tensor
    (``dims[0]``), else as :func:`as_member_promotes` casts it.

    >>> import torch
    >>> as_member_opmath(torch.ones(3, dtype=torch.float64), [torch.ones(2, dtype=torch.bfloat16)], [], []).dtype
    torch.float32
    """
    first = dims[0] if dims else None
    if isinstance(first, torch.Tensor) and first.is_floating_point() and first.element_size() < 4 \
            and x.is_floating_point() and x.device.type == "cpu":
        return x.to(torch.float32)
    return as_member_promotes(x, dims, zero_dims, numbers)


def as_input_dtype(out: torch.Tensor, x: Any) -> torch.Tensor:
    """Note [A 0-dim multiplier in opmath]: ``out`` back in ``x``'s float16/bfloat16 dtype (else as
    it is)."""
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.element_size() < 4 and out.dtype != x.dtype:
        return out.to(x.dtype)
    return out


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
