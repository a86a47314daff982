"""Per-member forms: ops whose scalar arguments are per-member constants (Note [Per-member
constants] in fx/constants.py).

A node whose float argument differs between members gets that argument as a ``[N]`` float64
buffer; its form here broadcasts it per member (``[N, 1, ..., 1]``, cast to the op's dtype):

- ``dropout`` / ``dropout_`` / ``native_dropout`` with per-member ``p``: keep mask ``rand < 1 - p_i``,
  kept values scaled by ``1 / (1 - p_i)`` (0 where ``p_i = 1``), as ATen's dropout on CPU; its
  channel (``feature_dropout``: Dropout1d/2d/3d) and alpha forms (``alpha_dropout``,
  ``feature_alpha_dropout``) with ATen's formulas (Note [Channel and alpha dropout per member]);
- ``leaky_relu``: ``x * where(x > 0, 1, slope)``; ``elu``/``celu``: ATen's formula with
  ``expm1``; ``softplus``: ``where(x * beta > threshold, x, log1p(exp(x * beta)) / beta)`` with
  ATen's gradient (Note [Per-member gradients at non-finite constants]);
  ``clamp``/``clamp_min``/``clamp_max`` with per-member bounds: ``clamp.Tensor`` with bound tensors;
  ``hardtanh``: clamp's value with hardtanh's gradient (Note [Per-member bounds]);
- ``mul``/``div``/``add``/``sub``/``rsub``/``pow`` by a scalar: by the broadcast tensor (for ``mul``
  and ``div`` of a float16/bfloat16 tensor in float32, as ATen takes a Python scalar there, then
  rounded to the tensor's dtype);
- ``layer_norm``/``rms_norm`` with per-member ``eps``: the composite (``var_mean`` + eps).

Not rule-table rows (the table widens ops by their tensors; hence the leading ``_``):
:func:`widen_per_member` is called by the widen pass for the nodes the constants plan names. An
op without a form here refuses, naming the op and the constant.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from ..context import Wide, WidenContext, member_rank
from ._autocast import NormResult, at_least_float32

aten = torch.ops.aten

FORMS: dict[Any, Callable] = {}


def form(*ops: Any) -> Callable:
    def deco(fn: Callable) -> Callable:
        for op in ops:
            FORMS[op] = fn
        return fn

    return deco


def widen_per_member(ctx: WidenContext, node: fx.Node) -> Any:
    """The wide value of ``node`` whose arguments ``ctx.per_member_args[node.name]`` are per member."""
    names = ctx.per_member_args[node.name]
    fn = FORMS.get(node.target)
    if fn is None:
        consts = ", ".join(f"{a} ({b.removeprefix('_per_member.')})" for a, b in names.items())
        raise ctx.fail(node, f"its argument(s) {consts} differ between members (per-member constants), and this "
                             "op has no per-member form; make that constant the same for every member, or read it "
                             "from a buffer (a tensor) instead of a Python float")
    a = ctx.schema_args(node)
    for name, buf in names.items():
        a[name] = ctx.per_member_inputs[buf]
    return fn(ctx, node, a)


def refused_values(node: fx.Node, name: str, values: list[Any]) -> tuple[int, str] | None:
    """``(member, why)`` where a member's value of the per-member argument ``name`` of ``node`` is
    one its form cannot follow (Note [Per-member gradients at non-finite constants]: a NaN bound of
    ``hardtanh``), else None; ``why`` continues "member j: s is nan, member 0 has 1.0, and ...".

    >>> g = fx.Graph(); x = g.placeholder("x")
    >>> ht = g.call_function(aten.hardtanh.default, (x, -1.0, 1.0))
    >>> refused_values(ht, "min_val", [-1.0, float("nan")])[0], refused_values(ht, "min_val", [-1.0, -2.0])
    (1, None)
    """
    if node.target in (aten.hardtanh.default, aten.hardtanh_.default) and name in ("min_val", "max_val"):
        j = next((j for j, v in enumerate(values) if isinstance(v, float) and v != v), None)
        if j is not None:
            return j, (f"they change argument(s) ['{name}'] of aten.hardtanh at node '{node.name}' to NaN, where "
                       "ATen's own hardtanh gradient depends on the tensor's size (its vectorized and scalar loops "
                       "disagree at a NaN bound), which no per-member form can follow (Note [Per-member gradients "
                       "at non-finite constants]); give every member a bound that is a number (inf is one)")
    return None


def _dtype(node: fx.Node) -> torch.dtype:
    val = node.meta.get("val")
    val = val[0] if isinstance(val, (tuple, list)) else val
    return val.dtype if isinstance(val, torch.Tensor) else torch.get_default_dtype()


def scalar(ctx: WidenContext, node: fx.Node, v: Any, rank: int, like: Any = None) -> Any:
    """A per-member value ``[N, 1, ..., 1]`` (member rank ``rank``) in the dtype of the tensor
    ``like`` at run time (the model may be moved to another dtype after compiling), else in the
    op's traced dtype; a shared Python scalar as it is."""
    if not isinstance(v, Wide):
        return v
    if isinstance(like, fx.Node):
        t = ctx.emit(aten.type_as.default, (v.node, like), like=node)
    else:
        t = ctx.emit(aten._to_copy.default, (v.node,), {"dtype": _dtype(node)}, like=node)
    return ctx.align(Wide(t, 0), rank, node)


def _floating(arg: Any) -> bool:
    val = arg.meta.get("val") if isinstance(arg, fx.Node) else None
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def _input(ctx: WidenContext, node: fx.Node, x: Any) -> Wide:
    return ctx.as_wide(x, member_rank(node.args[0]), node)


def _op(ctx: WidenContext, node: fx.Node, target, *args: Any, **kwargs: Any) -> fx.Node:
    return ctx.emit(target, tuple(ctx.unwrap(a) for a in args), kwargs, like=node)


def _mul(ctx: WidenContext, node: fx.Node, a: Any, b: Any) -> Any:
    """a * b where either may be a Python scalar (multiplied here) or a node."""
    if not isinstance(a, fx.Node) and not isinstance(b, fx.Node):
        return a * b
    if not isinstance(a, fx.Node):
        a, b = b, a
    return _op(ctx, node, aten.mul.Tensor, a, b)


def _result(ctx: WidenContext, node: fx.Node, x: Wide, out: fx.Node, inplace: bool) -> Wide:
    if inplace:
        out = _op(ctx, node, aten.copy_.default, x.node, out)
    return Wide(out, x.rank)


# --- dropout ---------------------------------------------------------------------------------
def _keep_and_scale(ctx: WidenContext, node: fx.Node, x: Wide, p: Any,
                    noise_like: fx.Node | None = None) -> tuple[fx.Node, fx.Node]:
    q = _op(ctx, node, aten.rsub.Scalar, ctx.unwrap(p), 1.0)  # [N] keep probability, float64
    q = scalar(ctx, node, Wide(q, 0), x.rank, like=x.node)
    noise = _op(ctx, node, aten.rand_like.default, x.node if noise_like is None else noise_like)
    keep = _op(ctx, node, aten.lt.Tensor, noise, q)
    inv = _op(ctx, node, aten.reciprocal.default, q)
    scale = _op(ctx, node, aten.where.ScalarOther, _op(ctx, node, aten.gt.Scalar, q, 0), inv, 0.0)
    return keep, scale


@form(aten.dropout.default, aten.dropout_.default)
def _dropout(ctx: WidenContext, node: fx.Node, a: dict) -> Wide:
    x = _input(ctx, node, a["input"] if "input" in a else a["self"])  # dropout_ names it self
    if isinstance(a["train"], Wide):
        raise ctx.fail(node, "a per-member train flag")
    if a["train"] is False:
        return x
    keep, scale = _keep_and_scale(ctx, node, x, a["p"])
    out = _op(ctx, node, aten.mul.Tensor, _op(ctx, node, aten.mul.Tensor, x.node, keep), scale)
    return _result(ctx, node, x, out, node.target is aten.dropout_.default)


# Note [Channel and alpha dropout per member]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ATen's dropout family on CPU (``_dropout_impl``) with keep probability q = 1 - p: the input
# when p == 0 or not training, ``input * 0`` when p == 1, else ``input * noise`` with noise a
# Bernoulli(q) draw scaled by 1/q. The channel forms (``feature_*``: Dropout1d/2d/3d,
# FeatureAlphaDropout) draw one value per (sample, channel), the noise's shape being the input's
# first two sizes then ones; the alpha forms (AlphaDropout, FeatureAlphaDropout) keep SELU's
# statistics: with alpha = 1.7580993408473766 and a = 1 / sqrt((alpha^2 p + 1) q), they return
# ``input * keep * a + alpha * a * (keep - q)``. Per member here, with p_i from the [N] buffer:
# the keep mask ``rand < q_i`` (on ``[N, B, C, 1, ...]`` for the channel forms), scale 1/q_i or
# a_i, and 0 for both where p_i == 1 (so ``input * 0``, NaN staying NaN, as ATen). p_i == 0 keeps
# everything at scale 1 and shift 0: the member's input exactly, as ATen returns it.
_ALPHA = 1.7580993408473766  # ATen's alpha dropout: SELU's scale times its alpha


def _channel_dropout(ctx: WidenContext, node: fx.Node, a: dict) -> Wide:
    """Dropout1d/2d/3d, AlphaDropout and FeatureAlphaDropout with a per-member ``p`` (Note
    [Channel and alpha dropout per member])."""
    x = _input(ctx, node, a["input"] if "input" in a else a["self"])
    if isinstance(a["train"], Wide):
        raise ctx.fail(node, "a per-member train flag")
    if a["train"] is False:
        return x
    name = node.target.overloadpacket.__name__  # feature_dropout_, alpha_dropout ...
    noise_like = None
    if name.startswith("feature"):
        if x.rank < 2:
            raise ctx.fail(node, "channel dropout of a member input with fewer than 2 dims")
        noise_like = x.node
        for d in range(3, x.rank + 1):  # the member's dims after its channel dim: one draw each
            noise_like = _op(ctx, node, aten.slice.Tensor, noise_like, d, 0, 1)
    keep, scale = _keep_and_scale(ctx, node, x, a["p"], noise_like)
    if "alpha" not in name:
        out = _op(ctx, node, aten.mul.Tensor, _op(ctx, node, aten.mul.Tensor, x.node, keep), scale)
        return _result(ctx, node, x, out, name.endswith("_"))
    p = ctx.unwrap(a["p"])  # [N] float64
    q = _op(ctx, node, aten.rsub.Scalar, p, 1.0)
    var = _op(ctx, node, aten.mul.Tensor, _op(ctx, node, aten.add.Scalar,
                                                _op(ctx, node, aten.mul.Scalar, p, _ALPHA * _ALPHA), 1.0), q)
    gain = _op(ctx, node, aten.where.ScalarOther, _op(ctx, node, aten.gt.Scalar, q, 0),
               _op(ctx, node, aten.rsqrt.default, var), 0.0)  # [N]: a, 0 where p == 1
    shift = _op(ctx, node, aten.mul.Scalar, gain, _ALPHA)
    gain, shift, q = (scalar(ctx, node, Wide(v, 0), x.rank, like=x.node) for v in (gain, shift, q))
    kept = _op(ctx, node, aten.type_as.default, keep, x.node)
    out = _op(ctx, node, aten.add.Tensor, _op(ctx, node, aten.mul.Tensor, _op(ctx, node, aten.mul.Tensor, x.node, kept),
                                               gain),
              _op(ctx, node, aten.mul.Tensor, _op(ctx, node, aten.sub.Tensor, kept, q), shift))
    return _result(ctx, node, x, out, name.endswith("_"))


for _op_name in ("feature_dropout", "alpha_dropout", "feature_alpha_dropout"):
    form(getattr(aten, _op_name).default, getattr(aten, _op_name + "_").default)(_channel_dropout)


@form(aten.native_dropout.default)
def _native_dropout(ctx: WidenContext, node: fx.Node, a: dict) -> tuple:
    x = _input(ctx, node, a["input"])
    if isinstance(a["train"], Wide):
        raise ctx.fail(node, "a per-member train flag")
    if a["train"] is False:
        mask = _op(ctx, node, aten.ones_like.default, x.node, dtype=torch.bool)
        return Wide(_op(ctx, node, aten.clone.default, x.node), x.rank), Wide(mask, x.rank)
    keep, scale = _keep_and_scale(ctx, node, x, a["p"])
    out = _op(ctx, node, aten.mul.Tensor, _op(ctx, node, aten.mul.Tensor, x.node, keep), scale)
    return Wide(out, x.rank), Wide(keep, x.rank)


# --- activations -----------------------------------------------------------------------------
@form(aten.leaky_relu.default, aten.leaky_relu_.default)
def _leaky_relu(ctx: WidenContext, node: fx.Node, a: dict) -> Wide:
    """``x * where(x > 0, 1, slope)``: ATen's value (``x > 0 ? x : x * slope``) and gradient
    (``x > 0 ? g : g * slope``) for every slope; a ``where`` between ``x`` and ``x * slope`` would
    pass ``0 * slope`` back where ``x > 0``, NaN for an infinite or NaN slope (Note [Per-member
    gradients at non-finite constants])."""
    x = _input(ctx, node, a["self"])
    xf = _opmath(ctx, node, x)
    slope = scalar(ctx, node, a["negative_slope"], x.rank, like=xf)
    pos = _op(ctx, node, aten.gt.Scalar, xf, 0)
    if isinstance(slope, fx.Node):
        factor = _op(ctx, node, aten.where.ScalarSelf, pos, 1.0, slope)
        out = _op(ctx, node, aten.mul.Tensor, xf, factor)
    else:
        out = _op(ctx, node, aten.where.self, pos, xf, _mul(ctx, node, xf, slope))
    return _result(ctx, node, x, _op(ctx, node, aten.type_as.default, out, x.node),
                   node.target is aten.leaky_relu_.default)


def _opmath(ctx: WidenContext, node: fx.Node, x: Wide) -> fx.Node:
    """``x`` in the dtype ATen's activation kernels compute in: float32 for a float16/bfloat16
    ``x`` (the result rounded once, at the end), else ``x`` itself. The forms computed in ``x``'s
    dtype with the constant rounded to it first: 1 ulp off the member in 30% of the negative
    values of a bfloat16 LeakyReLU or ELU with per-member slopes (probe 11 of issue 44, P11-8)."""
    return _op(ctx, node, at_least_float32, x.node)


def _elu_form(ctx: WidenContext, node: fx.Node, x: Wide, xf: fx.Node, alpha: Any, scale: Any, input_scale: Any,
              inplace: bool, grad_input_scale: Any = None) -> Wide:
    """ATen's elu on ``xf`` (``x`` in its compute dtype, :func:`_opmath`), returned in ``x``'s
    dtype; ``grad_input_scale``: the input scale its gradient takes instead (celu's)."""
    # the negative branch on min(x, 0): where x > 0 its exp could overflow, and the gradient
    # where passes it (0 * inf) would be NaN where ATen's is finite
    le = _op(ctx, node, aten.le.Scalar, xf, 0)
    neg_x = _op(ctx, node, aten.where.ScalarOther, le, xf, 0.0)

    def negative(s: Any) -> Any:
        return _mul(ctx, node, _op(ctx, node, aten.expm1.default, _mul(ctx, node, neg_x, s)), _mul(ctx, node, alpha, scale))

    neg = negative(input_scale)
    if grad_input_scale is not None:  # the value of neg, the gradient of g: neg.detach() + (g - g.detach())
        g = negative(grad_input_scale)  # finite: expm1 of a value <= 0, so g - g is 0
        neg = _op(ctx, node, aten.add.Tensor, _op(ctx, node, aten.detach.default, neg),
                  _op(ctx, node, aten.sub.Tensor, g, _op(ctx, node, aten.detach.default, g)))
    out = _op(ctx, node, aten.where.self, le, neg, _mul(ctx, node, xf, scale))
    return _result(ctx, node, x, _op(ctx, node, aten.type_as.default, out, x.node), inplace)


@form(aten.elu.default, aten.elu_.default)
def _elu(ctx: WidenContext, node: fx.Node, a: dict) -> Wide:
    x = _input(ctx, node, a["self"])
    xf = _opmath(ctx, node, x)
    s = {k: scalar(ctx, node, a[k], x.rank, like=xf) for k in ("alpha", "scale", "input_scale")}
    return _elu_form(ctx, node, x, xf, s["alpha"], s["scale"], s["input_scale"], node.target is aten.elu_.default)


@form(aten.celu.default, aten.celu_.default)
def _celu(ctx: WidenContext, node: fx.Node, a: dict) -> Wide:
    x = _input(ctx, node, a["self"])
    xf = _opmath(ctx, node, x)
    alpha = scalar(ctx, node, a["alpha"], x.rank, like=xf)
    inv = _op(ctx, node, aten.reciprocal.default, alpha) if isinstance(alpha, fx.Node) else 1.0 / alpha
    grad_inv = None
    if isinstance(alpha, fx.Node) and _dtype(node) == torch.float64:
        # ATen's celu gradient scales the input by 1 / alpha rounded to float32 (derivatives.yaml:
        # ``1.0/alpha.toFloat()``), its value by 1 / alpha: a float64 member's own gradient
        alpha32 = _op(ctx, node, aten._to_copy.default, _op(ctx, node, aten._to_copy.default, alpha, dtype=torch.float32),
                      dtype=torch.float64)
        grad_inv = _op(ctx, node, aten.reciprocal.default, alpha32)
    return _elu_form(ctx, node, x, xf, alpha, 1.0, inv, node.target is aten.celu_.default, grad_inv)


# Note [Per-member gradients at non-finite constants]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A form written as a chain of ops gets the chain's gradient, which is the op's own only where
# every factor of the chain is finite: a ``where`` passes 0 back to the branch it did not take,
# and ``0 * inf`` or ``0 * nan`` in the chain behind it is NaN. With a per-member constant of
# inf, -inf or nan (or 0, which a chain divides by) the member's gradient came out NaN where
# ATen's is finite. So the forms build their gradient as ATen's backward writes it:
#
# * ``leaky_relu``: ``x * where(x > 0, 1, slope)``: value and gradient are ATen's
#   (``x > 0 ? g : g * slope``) for every slope, with no factor on the branch not taken.
# * ``softplus``: ATen's value from the chain (detached), plus a term whose value is 0 and whose
#   gradient is ATen's ``x * beta > threshold ? g : g * z / (z + 1)`` with ``z = exp(x * beta)``:
#   ``(xf - xf.detach()) * d`` with ``d = where(above, 0, z / (z + 1))`` detached and ``xf`` the
#   input where it is finite (0 elsewhere, so the term's value is 0, not ``inf - inf``), and the
#   input itself taken by a ``where`` where ``above`` (gradient ``g``). ``d`` is NaN only where
#   ``x * beta`` is, where ATen's value and gradient are NaN too. Rounding: ``g * (z / (z + 1))``
#   against ATen's ``g * z / (z + 1)``, an ulp at most; an infinite input's gradient is 0 (ATen's
#   ``g * 0``). Where ``z`` overflows (``x * beta`` past ~88 in float32 but not above a threshold
#   that large) ``d`` is 1, so the value stays ATen's ``inf`` (``0 * nan`` would make it NaN);
#   ATen's gradient there is ``g * inf / inf``, NaN, the form's ``g``.
# * ``hardtanh`` with a NaN bound is refused (:func:`refused_values`): its value is NaN, and ATen's
#   own gradient there depends on the tensor's size (Note [Per-member bounds]: its vectorized and
#   scalar loops disagree), which no form can follow.
@form(aten.softplus.default)
def _softplus(ctx: WidenContext, node: fx.Node, a: dict) -> Wide:
    """ATen's softplus with a per-member beta or threshold: its value from the formula, its gradient
    as ATen's backward (Note [Per-member gradients at non-finite constants])."""
    x = _input(ctx, node, a["self"])
    xf = _opmath(ctx, node, x)  # float16/bfloat16 in float32, rounded once (probe 11, P11-8b: 10x the member's error)
    beta, threshold = (scalar(ctx, node, a[k], x.rank, like=xf) for k in ("beta", "threshold"))
    xb = _mul(ctx, node, xf, beta)
    above = _op(ctx, node, aten.gt.Tensor if isinstance(threshold, fx.Node) else aten.gt.Scalar, xb, threshold)
    # log1p(exp(.)) of the elements below the threshold only: above it exp could overflow
    below = _op(ctx, node, aten.detach.default, _op(ctx, node, aten.where.ScalarSelf, above, 0.0, xb))
    z = _op(ctx, node, aten.exp.default, below)
    soft = _op(ctx, node, aten.div.Tensor, _op(ctx, node, aten.log1p.default, z), beta)
    slope = _op(ctx, node, aten.div.Tensor, z, _op(ctx, node, aten.add.Scalar, z, 1.0))
    slope = _op(ctx, node, aten.where.ScalarSelf, _op(ctx, node, aten.isinf.default, z), 1.0, slope)
    slope = _op(ctx, node, aten.where.ScalarSelf, above, 0.0, slope)
    finite = _op(ctx, node, aten.where.ScalarOther, _op(ctx, node, aten.isfinite.default, xf), xf, 0.0)
    zero = _op(ctx, node, aten.mul.Tensor, _op(ctx, node, aten.sub.Tensor, finite,
                                               _op(ctx, node, aten.detach.default, finite)), slope)
    soft = _op(ctx, node, aten.add.Tensor, soft, zero)
    out = _op(ctx, node, aten.where.self, above, xf, soft)
    return Wide(_op(ctx, node, aten.type_as.default, out, x.node), x.rank)


# --- bounds: clamp, clamp_min, clamp_max, hardtanh -----------------------------------------
# Note [Per-member bounds]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# A per-member bound must give what the member's own op gives for every bound and input: lo > hi,
# NaN and infinite bounds, NaN inputs, and the op's gradient. Two ``where``s (one per side) do not:
# with lo > hi they return lo where ATen returns hi, and they ignore a NaN bound where ATen
# returns NaN. ATen's rules (the CPU/CUDA kernels and derivatives.yaml):
#
# * ``clamp(x, lo, hi)`` is ``min(max(x, lo), hi)`` with NaN propagated from x and from either
#   bound (so hi when lo > hi); its gradient passes where ``lo <= x <= hi`` (ties included; none
#   at a NaN x or bound). ``clamp.Tensor`` with the bounds as ``[N, 1, ..., 1]`` tensors is that
#   op itself, values and gradient; a shared (Python) bound beside a per-member one becomes a
#   tensor of the same shape. ``clamp_min``/``clamp_max`` are its one-sided forms.
# * ``hardtanh(x, lo, hi)`` has clamp's value (``F.hardtanh`` refuses lo > hi in Python; the op
#   itself clamps), but its gradient passes only where ``lo < x < hi`` (strict: none at a bound).
#   That is the rule of ATen's vectorized CPU kernel; its scalar loop, which only takes the few
#   elements past the last full vector, writes it as ``x <= lo || x >= hi ? 0 : grad`` and so passes
#   the gradient at a NaN input or beside a NaN bound: ATen disagrees with itself there, and the
#   form follows the vectorized rule (as CUDA's kernel) for a NaN input; a NaN bound, whose
#   member gradient then depends on the member's tensor size, is refused (Note [Per-member
#   gradients at non-finite constants]). The form: clamp's, except at a tie
#   (``x == lo`` or ``x == hi``), where it takes the clamped bound (``clamp(lo, lo, hi)`` or
#   ``clamp(hi, lo, hi)``, the same value) with no gradient path to x.
#
# Off the CPU ATen's kernels differ (a GPU run, torch 2.11), and the forms follow the device the
# wide model runs on, decided at the call (a model moves with ``.to()``):
# * ``clamp(x, max=nan)`` (one bound given, NaN) returns the input on CUDA: ATen's clamp fills NaN
#   for a NaN bound only when both are given (clamp_min and clamp_max always do), and hands one
#   bound to the device's kernel, where ``min(v, nan)`` is ``v`` (the CPU's is NaN). Its gradient
#   is clamp's, 0 (``x <= nan`` is false): :func:`one_sided_nan_bound` gives those members the
#   input, detached.
# * CUDA's hardtanh backward is ``x <= lo || x >= hi ? 0 : grad``: at a NaN input it passes the
#   gradient (the CPU's vectorized kernel does not): :func:`nan_passes_gradient` gives those
#   elements the input itself (its value is NaN either way).
# On the CPU both return the form's value as it is: no kernel more.
def _off_the_cpu(x: torch.Tensor) -> bool:
    return x.device.type != "cpu"


def one_sided_nan_bound(out: torch.Tensor, x: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """Note [Per-member bounds]: a one-bound ``clamp``'s value ``out``, off the CPU with the input
    ``x`` (detached) for the members whose bound is NaN."""
    return torch.where(bound.isnan(), x.detach(), out) if _off_the_cpu(x) else out


def nan_passes_gradient(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Note [Per-member bounds]: a hardtanh's value ``out``, off the CPU with its input ``x`` (and
    so its gradient) where ``x`` is NaN."""
    return torch.where(x.isnan(), x, out) if _off_the_cpu(x) else out


def _bound(ctx: WidenContext, node: fx.Node, v: Any, rank: int, like: fx.Node | None, other: Any) -> Any:
    """A bound as a per-member ``[N, 1, ..., 1]`` tensor: a per-member one cast (``scalar``), a
    shared Python number filled into the shape of ``other`` (a per-member bound's tensor)."""
    if v is None:
        return None
    if isinstance(v, Wide):
        return scalar(ctx, node, v, rank, like=like)
    return _op(ctx, node, aten.full_like.default, other, v)


def _bounds(ctx: WidenContext, node: fx.Node, x: Wide, lo: Any, hi: Any, like: fx.Node | None) -> tuple:
    lo_t = scalar(ctx, node, lo, x.rank, like=like) if isinstance(lo, Wide) else None
    hi_t = scalar(ctx, node, hi, x.rank, like=like) if isinstance(hi, Wide) else None
    if lo_t is None and lo is not None:
        lo_t = _bound(ctx, node, lo, x.rank, like, hi_t)
    if hi_t is None and hi is not None:
        hi_t = _bound(ctx, node, hi, x.rank, like, lo_t)
    return lo_t, hi_t


def _unaliased(ctx: WidenContext, node: fx.Node, x: Wide, inplace: bool) -> fx.Node:
    """``x``, or for an in-place op a clone of it: clamp's gradient reads its input, which the
    copy back into ``x`` would overwrite."""
    return _op(ctx, node, aten.clone.default, x.node) if inplace else x.node


_CLAMPS = {  # op -> (name of the lower bound, of the upper bound, in place)
    aten.clamp.default: ("min", "max", False), aten.clamp_.default: ("min", "max", True),
    aten.clamp_min.default: ("min", None, False), aten.clamp_min_.default: ("min", None, True),
    aten.clamp_max.default: (None, "max", False), aten.clamp_max_.default: (None, "max", True),
}


@form(*_CLAMPS)
def _clamp(ctx: WidenContext, node: fx.Node, a: dict) -> Wide:
    """``clamp.Tensor`` with per-member bound tensors: ATen's values and gradient (Note
    [Per-member bounds]). An integer input is clamped by floating bounds in the op's result
    dtype, as type promotion gives it."""
    x = _input(ctx, node, a["self"])
    lo_key, hi_key, inplace = _CLAMPS[node.target]
    like = x.node if _floating(node.args[0]) else None
    lo, hi = _bounds(ctx, node, x, a.get(lo_key) if lo_key else None, a.get(hi_key) if hi_key else None, like)
    xn = _unaliased(ctx, node, x, inplace)
    out = _op(ctx, node, aten.clamp.Tensor, xn, lo, hi)
    if lo_key is not None and hi_key is not None and (lo is None) != (hi is None):  # clamp(x, max=...)
        out = _op(ctx, node, one_sided_nan_bound, out, xn, lo if hi is None else hi)
    return _result(ctx, node, x, out, inplace)


@form(aten.hardtanh.default, aten.hardtanh_.default)
def _hardtanh(ctx: WidenContext, node: fx.Node, a: dict) -> Wide:
    """clamp's value with hardtanh's gradient (passed only where ``lo < x < hi``): Note
    [Per-member bounds]."""
    x = _input(ctx, node, a["self"])
    lo, hi = _bounds(ctx, node, x, a["min_val"], a["max_val"], x.node)
    xn = _unaliased(ctx, node, x, node.target is aten.hardtanh_.default)
    at_lo = _op(ctx, node, aten.eq.Tensor, xn, lo)
    tie = _op(ctx, node, aten.logical_or.default, at_lo, _op(ctx, node, aten.eq.Tensor, xn, hi))
    at_bound = _op(ctx, node, aten.clamp.Tensor, _op(ctx, node, aten.where.self, at_lo, lo, hi), lo, hi)
    out = _op(ctx, node, aten.where.self, tie, at_bound, _op(ctx, node, aten.clamp.Tensor, xn, lo, hi))
    out = _op(ctx, node, nan_passes_gradient, out, xn)
    return _result(ctx, node, x, out, node.target is aten.hardtanh_.default)


# --- arithmetic by a scalar ------------------------------------------------------------------
_TENSOR_FORM = {
    aten.mul.Tensor: aten.mul.Tensor, aten.mul.Scalar: aten.mul.Tensor, aten.mul_.Tensor: aten.mul_.Tensor,
    aten.div.Tensor: aten.div.Tensor, aten.div.Scalar: aten.div.Tensor, aten.div_.Tensor: aten.div_.Tensor,
    aten.add.Tensor: aten.add.Tensor, aten.add.Scalar: aten.add.Tensor, aten.add_.Tensor: aten.add_.Tensor,
    aten.sub.Tensor: aten.sub.Tensor, aten.sub.Scalar: aten.sub.Tensor, aten.sub_.Tensor: aten.sub_.Tensor,
    aten.rsub.Scalar: aten.rsub.Tensor, aten.rsub.Tensor: aten.rsub.Tensor,
    aten.pow.Tensor_Scalar: aten.pow.Tensor_Tensor,
}


_OPMATH_SCALAR = frozenset({aten.mul.Tensor, aten.mul_.Tensor, aten.div.Tensor, aten.div_.Tensor})


@form(*_TENSOR_FORM)
def _arithmetic(ctx: WidenContext, node: fx.Node, a: dict) -> Wide:
    """``x op c`` with a per-member ``c`` (and/or ``alpha``): the same op with ``c`` a tensor
    ``[N, 1, ..., 1]``; an ``alpha`` multiplies it first."""
    rank = member_rank(node)
    target = _TENSOR_FORM[node.target]
    x = ctx.value(node.args[0])
    like = ctx.unwrap(x) if _floating(node.args[0]) else None
    x = ctx.align(x, rank, node) if isinstance(x, Wide) else x
    other_name = "exponent" if "exponent" in a else "other"
    other = a[other_name]
    alpha = a.get("alpha", 1)
    # mul and div take a Python scalar in their opmath dtype, unrounded (float32 beside a float16 x: 70000
    # stays finite); add, sub and pow round it to x's dtype first (ATen's CPU kernels, checked bit for bit)
    raised = like is not None and target in _OPMATH_SCALAR
    if other_name in ctx.per_member_args[node.name]:
        other = _opmath_scalar(ctx, node, other, rank, like) if raised else scalar(ctx, node, other, rank, like=like)
    elif isinstance(other, Wide):
        other = ctx.align(other, rank, node)
    if isinstance(alpha, Wide):
        other = _mul(ctx, node, other, scalar(ctx, node, alpha, rank, like=like))
        alpha = 1
    kwargs = {"alpha": alpha} if "alpha" in a and alpha != 1 else {}
    if "rounding_mode" in a and a["rounding_mode"] is not None:
        kwargs["rounding_mode"] = a["rounding_mode"]
    back = raised and not node.target._schema.is_mutable  # an in-place op writes x's dtype itself
    out = ctx.emit(target, (x, other), kwargs, like=node, name=None if back else node.name)
    if back:  # a no-op where x is float32 or float64
        out = ctx.emit(aten.type_as.default, (out, like), like=node, name=node.name)
    return Wide(out, rank)


def opmath_like(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-member scalar ``v`` in the dtype ATen computes ``like op scalar`` in: float32 for a
    float16/bfloat16 ``like`` (its opmath type: a Python scalar is not rounded to the tensor's dtype
    first), else ``like``'s dtype."""
    low = like.is_floating_point() and like.element_size() < 4
    return v.to(torch.float32 if low else like.dtype)


def _opmath_scalar(ctx: WidenContext, node: fx.Node, v: Any, rank: int, like: fx.Node) -> Any:
    """:func:`scalar` in the dtype ATen computes a multiplication or division by a Python scalar in
    (:func:`opmath_like`): a float16 member multiplied by 70000.0 is finite, where the constant cast
    to float16 is inf (probe 9 of issue 44, P9-11)."""
    if not isinstance(v, Wide):
        return v
    return ctx.align(Wide(ctx.emit(opmath_like, (v.node, like), like=node), 0), rank, node)


# --- norms -----------------------------------------------------------------------------------
_NORM_RESULT = {aten.layer_norm.default: NormResult("aten::layer_norm"),
                aten.rms_norm.default: NormResult("aten::rms_norm")}


@form(aten.layer_norm.default, aten.rms_norm.default)
def _norm_eps(ctx: WidenContext, node: fx.Node, a: dict) -> Wide:
    """``layer_norm``/``rms_norm`` with a per-member eps: the composite (what the fused op
    computes, up to rounding): ``(x - mean) * rsqrt(var + eps) * w + b`` over the normalised dims
    (``x * rsqrt(mean(x^2) + eps) * w`` for RMS), in float32 at least (the input's dtype at run
    time: a bfloat16 one under autocast), and returned in the dtype ATen returns (``NormResult``:
    the input's, or float32 where autocast lists the op for the device)."""
    x = _input(ctx, node, a["input"])
    dims = list(range(-len(a["normalized_shape"]), 0))
    xc = _op(ctx, node, at_least_float32, x.node)
    eps = a["eps"]
    if eps is None:  # rms_norm's default: the dtype's machine epsilon
        eps = torch.finfo(_dtype(node)).eps
    if node.target is aten.layer_norm.default:
        vm = _op(ctx, node, aten.var_mean.correction, xc, dims, correction=0, keepdim=True)
        var, mean = (_op(ctx, node, operator.getitem, vm, k) for k in (0, 1))
        centred = _op(ctx, node, aten.sub.Tensor, xc, mean)
    else:
        var = _op(ctx, node, aten.mean.dim, _op(ctx, node, aten.mul.Tensor, xc, xc), dims, True)
        centred = xc
    eps = scalar(ctx, node, eps, x.rank, like=var)
    add = aten.add.Tensor
    y = _op(ctx, node, aten.mul.Tensor, centred, _op(ctx, node, aten.rsqrt.default, _op(ctx, node, add, var, eps)))
    for key, op in (("weight", aten.mul.Tensor), ("bias", aten.add.Tensor)):
        v = a.get(key)
        if v is None:
            continue
        if isinstance(v, Wide):
            v = ctx.align(v, x.rank, node)
        y = _op(ctx, node, op, y, v)
    return Wide(_op(ctx, node, _NORM_RESULT[node.target], y, x.node), x.rank)
