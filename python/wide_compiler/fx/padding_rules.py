"""The padding of each op (Note [Padded members] in fx/padding.py): how a padded input maps to
the layout of the result, what a rule rewrites to stay exact (a mask after, a decomposition with
each member's count, -inf before a max), and what it refuses. A rule is ``rule(padder, node)`` and
sets ``padder.lay[node]``; :data:`RULES` maps an ATen op's name to its rule (the rules of the ops
that compute values are in fx/padding_rules_math.py, those of the ops that move, size or pick
values in fx/padding_rules_shapes.py), ops in :data:`ZERO_UNARY` keep zero padding as it is, ops
in :data:`MASK_UNARY` are masked after, and :data:`REFUSED` names the ops a widen rule handles
that are refused with padded members, and why. Every op of the widen rule table (fx/table.py) is
in one of them (or is ``getitem``, which the pass follows itself):
tests/python/test_rule_coverage.py fails for a new widen rule whose padding is not stated here.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import math
import re

import torch
from torch import fx

from .padding_rules_math import MATH_INT_ARGS_OK, MATH_RULES
from .padding_rules_shapes import _POSITIONS, _WHOLE_DIM, SHAPE_INT_ARGS_OK, SHAPE_RULES

if TYPE_CHECKING:
    from .padding_pass import Padder

__all__ = ["BY_THE_PASS", "INT_ARGS_OK", "MASK_UNARY", "REFUSED", "RULES", "ZERO_UNARY", "mask_unary", "zero_unary"]

# f(0) = 0 and f'(0) finite: a clean input gives a clean output
ZERO_UNARY = {
    "relu", "gelu", "silu", "tanh", "neg", "leaky_relu", "elu", "celu", "selu", "mish",
    "hardswish", "abs", "sin", "sinh", "asinh", "atan", "erf", "sign", "softsign", "tanhshrink",
    "hardshrink", "softshrink", "relu6", "clone", "alias", "detach", "detach_", "contiguous", "_to_copy", "to",
    "dropout", "native_dropout", "lift_fresh_copy", "square", "expm1", "log1p", "type_as", "rrelu",
    "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "avg_pool1d",
    "avg_pool2d", "avg_pool3d", "max_pool1d", "max_pool2d", "max_pool3d", "max_pool2d_with_indices",
    "adaptive_max_pool2d", "upsample_nearest2d", "upsample_bilinear2d",
}
# finite with a finite derivative at 0, but f(0) != 0: masked after (anything else is refused:
# log, rsqrt, reciprocal, pow with a negative exponent would put inf or NaN into the padding)
MASK_UNARY = {"sigmoid", "exp", "cos", "cosh", "hardsigmoid", "softplus", "logsigmoid", "clamp",
              "clamp_min", "clamp_max", "fill", "ones_like", "full_like"}


_SPATIAL = re.compile(r"(pool|upsample_\w+?)([123])d")  # pooling and resampling over the last 1-3 dims


def zero_unary(p: Padder, node: fx.Node) -> None:
    src = node.args[0]
    lay = p.layout(src)
    name = getattr(getattr(node.target, "overloadpacket", None), "__name__", "")
    spatial = _SPATIAL.search(name)
    if spatial and any(v is not None for v in lay[len(lay) - int(spatial[2]):]):
        # a window over a padded dim reads the padding as values (a max with 0 where the member's own
        # edge pads with -inf, an average counting it) and spreads values into it (P10-11)
        p.refuse(node, "it pools or resamples along a padded dim, where each member's window would meet the "
                       "other members' padding instead of its own edge")
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):  # (result, mask/indices): both shaped like the input
        p.lay[node] = [list(lay) for _ in val]
        return
    if len(lay) != val.dim():
        p.refuse(node, "the result's dims do not follow its input's")
    p.lay[node] = lay


# Note [In-place ops on padded values]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# export keeps in-place ops (``relu_`` of ``nn.ReLU(inplace=True)``, ``silu_``, a residual
# ``out += identity``): their result is their input itself, and the input's later uses read the
# written values. Where the op keeps zero padding zero (f(0) = 0 for an activation; operands
# that all cover the padding for an add, one for a multiply), the input's layout holds after the
# write as before it, and the op is padded as its out-of-place form. Where it would not (an
# activation with f(0) != 0, a scalar added), a mask after the op would reach its own users
# only, not the input's: refused. Every stock torchvision ResNet, ShuffleNet, EfficientNet and
# MNASNet width sweep was refused on ``relu_``/``silu_`` (probe 16 of issue 44, P16-1).
ZERO_IN_PLACE = {f"{name}_" for name in ("relu", "silu", "elu", "celu", "selu", "leaky_relu", "hardswish", "mish",
                                         "tanh", "abs", "neg", "zero", "dropout")}


def clamp_in_place(p: Padder, node: fx.Node) -> None:
    """``hardtanh_`` (ReLU6(inplace=True)) and ``clamp_`` (``clamp_min_``, ``clamp_max_``): clean
    where their bounds hold 0 (Note [In-place ops on padded values]; probe 17, P17-5: ``clamp_(min=0)``
    was refused)."""
    name = node.target.overloadpacket.__name__
    keys = {"hardtanh_": (("min_val", -1.0), ("max_val", 1.0)), "clamp_": (("min", None), ("max", None)),
            "clamp_min_": (("min", None),), "clamp_max_": (("max", None),)}[name]
    given = [node.args[k + 1] if len(node.args) > k + 1 else node.kwargs.get(key, default)
             for k, (key, default) in enumerate(keys)]
    if name == "clamp_max_":
        given = [None, *given]
    bounds = [-math.inf if given[0] is None else given[0], math.inf if len(given) < 2 or given[1] is None else given[1]]
    if not (all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in bounds) and bounds[0] <= 0 <= bounds[1]):
        p.refuse(node, "its bounds do not hold 0, so it writes them into the padding of its input in place, which "
                       "no mask after the op can take back from the input's later uses")
    zero_unary(p, node)


def mask_unary(p: Padder, node: fx.Node) -> None:
    operands = [a for a in node.args if isinstance(a, fx.Node)]
    lay = p.operand_layouts(node, operands)
    p.lay[node] = lay
    p.mask_after(node, lay)



def pow_rule(p: Padder, node: fx.Node) -> None:
    """``x ** e`` with a number ``e >= 1`` keeps zero padding clean (0 ** e = 0, derivative
    e * 0 ** (e - 1) finite: ``h ** 2`` of a variance or an L2 term); any other exponent, or a
    tensor one, is refused (0 ** e is inf for e < 0, 1 for e = 0, with an infinite derivative
    for 0 < e < 1)."""
    exponent = node.args[1] if len(node.args) > 1 else node.kwargs.get("exponent")
    if node.target is not torch.ops.aten.pow.Tensor_Scalar or isinstance(exponent, bool) \
            or not isinstance(exponent, (int, float)) or not exponent >= 1:
        p.refuse(node, "its exponent is not a number of at least 1, and " + _NOT_FINITE)
    zero_unary(p, node)


def hardtanh_rule(p: Padder, node: fx.Node) -> None:
    """``hardtanh(x, min_val, max_val)`` is ``clamp``: 0 stays 0 only where ``min_val <= 0 <=
    max_val`` (ReLU6, the default [-1, 1]); ``Hardtanh(0.2, 0.8)`` makes the padding 0.2, which a
    sum or a norm over the padded dim then counts, so it is masked after (probe 13, P13-4)."""
    bounds = [node.args[k] if len(node.args) > k else node.kwargs.get(key, default)
              for k, key, default in ((1, "min_val", -1.0), (2, "max_val", 1.0))]
    numbers = all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in bounds)
    if numbers and bounds[0] <= 0 <= bounds[1]:
        zero_unary(p, node)
    else:
        mask_unary(p, node)


def select_rule(p: Padder, node: fx.Node) -> None:
    """``masked_fill(x, mask, value)`` and ``where(cond, a, b)`` are elementwise: a mask over the
    members' own dims (a causal or sequence mask broadcast over padded heads or units) or laid out
    as the values are picks the same positions in every member, so they are padded as a binary op
    is (operands padded differently are refused). The padding gets the fill value or the other
    operand where the mask holds there: zeroed after (by ``where``: a fill of -inf), unless what
    masked_fill writes is 0 (probe 13 of issue 44, P13-3: refused as a positional op)."""
    operands = [a for a in node.args if isinstance(a, fx.Node)]
    lay = p.operand_layouts(node, operands)
    p.lay[node] = lay
    value = node.args[2] if len(node.args) > 2 else None
    zero_fill = node.target is torch.ops.aten.masked_fill.Scalar and isinstance(value, (int, float)) and value == 0
    if not zero_fill:
        p.mask_after(node, lay)


def _no_value(p: Padder, node: fx.Node) -> None:
    """An op that checks and returns nothing (export's ``_assert_tensor_metadata`` of a no-op
    ``.to(device)`` or ``.to(dtype)``: GPT-2's position embeddings, Llama's RMSNorm); the widen rule
    drops it (probe 11 of issue 44, P11-7: refused with 'no padding rule')."""
    p.lay[node] = []


RULES: dict[str, Callable[[Padder, fx.Node], None]] = {**MATH_RULES, **SHAPE_RULES, "pow": pow_rule,
                                                       "hardtanh": hardtanh_rule, "masked_fill": select_rule,
                                                       "where": select_rule, "_assert_tensor_metadata": _no_value,
                                                       **dict.fromkeys(("hardtanh_", "clamp_", "clamp_min_",
                                                                        "clamp_max_"), clamp_in_place),
                                                       **dict.fromkeys(ZERO_IN_PLACE, zero_unary)}
# rules that pad integer arguments which differ between members (any other rule refuses them)
INT_ARGS_OK = MATH_INT_ARGS_OK | SHAPE_INT_ARGS_OK

# Ops a widen rule handles that are refused with padded members (a refusal names the op, its line
# and this reason); the reasons, shortest first:
_NO_RULE = "no padding rule for this op yet"
_NEW = "it makes values whose padding would not be zero (random, uninitialised or a fill value)"
_REGION = ("it runs a region that export captured as a graph of its own (a torch.no_grad(), enable_grad() or "
           "autocast block inside the forward, or a parametrization's, such as spectral_norm's power iteration), "
           "and the padding rules do not reach into such regions")
_IN_PLACE = ("it writes into its input in place values that are not zero where the input is zero (its padding), "
             "which no mask after the op can take back from the input's later uses (Note [In-place ops on padded values])")
_NOT_FINITE = "it is infinite, or has an infinite derivative, at 0: it would put inf or NaN into the padding"
REFUSED: dict[str, str] = {
    **dict.fromkeys(("bernoulli", "empty_like", "new_empty", "new_full", "new_ones", "normal", "rand",
                     "rand_like", "randint", "randint_like", "randn", "randn_like", "bernoulli_", "exponential_",
                     "normal_", "uniform_", "alpha_dropout", "feature_alpha_dropout"), _NEW),
    **dict.fromkeys(("fill_", "hardsigmoid_", "masked_fill_", "sigmoid_"), _IN_PLACE),
    **dict.fromkeys(("log", "rsqrt", "reciprocal", "sqrt"), _NOT_FINITE),
    **dict.fromkeys(("gather", "index_add", "index_add_", "index_copy", "index_copy_", "index_fill", "index_fill_",
                     "index_put", "index_put_", "scatter", "scatter_", "scatter_add", "scatter_add_",
                     "scatter_reduce", "scatter_reduce_", "index", "narrow", "tensor_split", "diagonal", "tril", "triu",
                     "unfold", "diag_embed", "diagonal_scatter", "select_scatter", "slice_scatter", "glu",
                     "pixel_shuffle", "pixel_unshuffle", "channel_shuffle", "repeat", "repeat_interleave"),
                    _POSITIONS),
    **dict.fromkeys(("all", "amin", "aminmax", "any", "argmax", "argmin", "argsort", "cummax", "cummin",
                     "kthvalue", "linalg_vector_norm", "logcumsumexp", "logsumexp", "median", "min", "mode",
                     "nansum", "norm", "prod", "sort", "std", "std_mean", "topk", "var", "var_mean"), _WHOLE_DIM),
    **dict.fromkeys((
        "embedding_bag", "addmm", "baddbmm", "dot", "einsum", "mv", "outer", "vdot", "_weight_norm", "prelu",
        "__and__", "__or__", "__xor__", "bitwise_and", "bitwise_not", "bitwise_or", "bitwise_xor", "logical_and",
        "logical_not", "logical_or", "logical_xor", "addcdiv", "addcmul", "floor_divide", "lerp", "log_sigmoid",
        "multiply", "nan_to_num", "adaptive_max_pool1d", "adaptive_max_pool3d", "max_pool1d_with_indices",
        "max_pool3d_with_indices", "feature_dropout", "special_log_softmax", "special_softmax",
        "opaque_module", "gru_cell", "lstm_cell",
        "rnn_relu_cell", "rnn_tanh_cell", "adjoint", "expand_as", "mH", "mT",
        "matrix_H", "movedim", "numpy_T", "reshape_as", "swapdims", "sym_numel",
        "_upsample_bicubic2d_aa", "_upsample_bilinear2d_aa", "_upsample_nearest_exact1d",
        "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "upsample_bicubic2d", "upsample_linear1d",
        "upsample_nearest1d", "upsample_nearest3d", "upsample_trilinear3d", "constant_pad_nd", "pad", "col2im",
        "im2col"), _NO_RULE),
    **dict.fromkeys(("wrap_with_autocast", "wrap_with_set_grad_enabled"), _REGION),
}
# Followed by the pass itself, not by a rule: a tuple element takes its own part of the tuple's layout.
BY_THE_PASS = frozenset({"getitem"})
