"""Widen rules: random fills in place (``bernoulli_``, ``uniform_``, ``normal_``, ``exponential_``)
and the per-member forms of random ops whose float arguments differ between members.

Note [Random ops per member]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
A member that draws random numbers in training (dropout, stochastic depth, drop path, router
jitter, Gumbel noise) draws them for itself: member i of the wide model must draw its own
numbers, independent of every other member's, from the distribution member i alone draws from.
Dropout does it by one call on the N-first tensor (fx/rules/pooling.py ``_dropout``): every
element draws independently, so every member does. The ops here follow the same design:

- **In-place fills** (``x.bernoulli_(p)``, ``uniform_``, ``normal_``, ``exponential_``) draw
  every element independently, so the same op on the per-member ``[N, ...]`` tensor draws for
  every member at once. The tensor they fill is often made inside forward from shared values
  only: ``torch.empty([x.shape[0], 1, 1, 1]).bernoulli_(keep)`` (torchvision's stochastic depth),
  ``x.new_empty(shape).bernoulli_(keep)`` (timm's drop path), ``torch.empty(2).uniform_(-s, s)``.
  Such a tensor is ONE shared tensor in the wide graph; the widen pass gives it a member dim
  before the fill writes into it (Note [Per-member writes into shared tensors] in fx/widen.py,
  run for every random op with a row here), so the ``empty`` creation op needs no rule of its
  own, and each member's mask has its own draw.
- ``randperm`` has no row: the per-member fallback draws N permutations in a loop (correct, and
  cheap for the sizes models draw; tests/python/test_widen_errors.py uses it as the example of a
  random op with no rule).
- ``rand``/``randn``/``randint``/``normal(mean, std, size)`` and the ``*_like`` ones are
  creation ops (fx/rules/creation.py): they draw ``[N, *size]``, or on the N-first tensor.
- **Per-member probabilities and ranges** (a swept ``drop_path_rate``: Note [Per-member
  constants] in fx/constants.py): the float argument arrives as a ``[N]`` buffer and the form
  draws with it broadcast per member: ``bernoulli_(x, p[:, None, ...])`` (ATen's tensor-``p``
  overload, p kept in the buffer's dtype, float64, so a bfloat16 mask keeps member i's exact
  rate), and for the location-scale families a standard draw moved per member
  (``uniform_(0, 1) * (to - from) + from``, ``normal_(0, 1) * std + mean``,
  ``exponential_(1) / lambd``), which is the same distribution. ATen refuses a bad argument
  (``p`` outside [0, 1], ``from > to``, ``std < 0``, ``lambd <= 0``) when the member runs; the
  forms check the ``[N]`` values at every call with ``aten._assert_async`` (raises on CPU; a
  device assert elsewhere), naming the op, the node and the buffer, since the buffer can change
  after compiling (``load_state_dict``).

An explicit ``generator=`` is refused: members alone would each advance their own generator (export
already makes the generator a graph input, which the widen pass refuses; the rules check again). The
random ops of a graph are listed by ``wide_compiler.testing.random_ops`` (ATen's
``nondeterministic_seeded`` tag, fx/widen.py ``_draws``), so ``check_compile`` compares train
outputs with every draw fixed to one value on both sides (Note [Fixed draws in the trust check]
in _equivalence/draws.py: the forms here move a fixed standard draw as the member's own op
fixes its draw); tests/python/test_random_ops.py replays the wide model's draws into each
member run alone and compares exactly.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from ..context import Wide, WidenContext, member_rank
from ..source import assert_message, source_line
from ..table import rule
from ._constants import form, scalar

aten = torch.ops.aten

_FILLS = (aten.bernoulli_.float, aten.bernoulli_.Tensor, aten.uniform_.default, aten.normal_.default,
          aten.exponential_.default)


def _no_generator(ctx: WidenContext, node: fx.Node, a: dict) -> None:
    if a.get("generator") is not None:
        raise ctx.fail(node, "an explicit generator= (every member alone would advance its own generator; "
                             "the wide model has one): draw from the default generator instead")


def _target(ctx: WidenContext, node: fx.Node, v: Any) -> Wide:
    """The per-member tensor an in-place fill writes: the widen pass made a shared one per member
    before the rule ran (Note [Random ops per member])."""
    if not isinstance(v, Wide):
        raise ctx.fail(node, "internal error: the tensor a random fill writes is not per member (each member "
                             "would share one draw); please report it")
    return v


@rule(*_FILLS)
def _fill(ctx: WidenContext, node: fx.Node) -> Wide:
    """``x.bernoulli_(p)``, ``x.uniform_(a, b)``, ``x.normal_(m, s)``, ``x.exponential_(l)``:
    the same op on the N-first tensor draws every element, so every member, independently; a
    tensor ``p`` (bernoulli_.Tensor) broadcasts inside each member."""
    a = ctx.schema_args(node)
    _no_generator(ctx, node, a)
    x = _target(ctx, node, a["self"])
    args = [x.node]
    if node.target is aten.bernoulli_.Tensor:
        p = a["p"]
        args.append(ctx.align(p, x.rank, node) if isinstance(p, Wide) else p)
    else:
        args += [a[s.name] for s in node.target._schema.arguments[1:] if not s.kwarg_only]
    return Wide(ctx.emit(node.target, tuple(args), like=node, name=node.name), x.rank)


# --- per-member forms (Note [Per-member constants]) ------------------------------------------
def _op(ctx: WidenContext, node: fx.Node, target, *args: Any, **kwargs: Any) -> fx.Node:
    return ctx.emit(target, tuple(ctx.unwrap(a) for a in args), kwargs, like=node)


def _check(ctx: WidenContext, node: fx.Node, ok: fx.Node | None, what: str) -> None:
    """Fail the call unless every member's value satisfies ``ok`` (a ``[N]`` bool node)."""
    if ok is None:
        return
    bufs = ", ".join(ctx.per_member_args.get(node.name, {}).values())
    msg = (f"wide_compiler: {node.target} at node '{node.name}': {what} for some member (per-member values in "
           f"{bufs}); that member alone would fail here too ({source_line(node)})")
    ctx.emit(aten._assert_async.msg, (ctx.emit(aten.all.default, (ok,), like=node), assert_message(msg)), like=node)


def _cmp(ctx: WidenContext, node: fx.Node, v: Any, op: str, c: float) -> fx.Node | None:
    """``v op c`` for a per-member ``v`` (None for a shared one: the member's own op checks it)."""
    if not isinstance(v, Wide):
        return None
    return _op(ctx, node, getattr(aten, op).Scalar, v.node, c)


def _and(ctx: WidenContext, node: fx.Node, *conds: fx.Node | None) -> fx.Node | None:
    conds = [c for c in conds if c is not None]
    out = conds[0] if conds else None
    for c in conds[1:]:
        out = _op(ctx, node, aten.logical_and.default, out, c)
    return out


def _p(ctx: WidenContext, node: fx.Node, p: Wide, rank: int) -> fx.Node:
    """A checked per-member probability ``[N, 1, ..., 1]``, in the buffer's own dtype."""
    _check(ctx, node, _and(ctx, node, _cmp(ctx, node, p, "ge", 0.0), _cmp(ctx, node, p, "le", 1.0)),
           "p is outside [0, 1]")
    return ctx.align(p, rank, node)


@form(aten.bernoulli_.float)
def _bernoulli_inplace(ctx: WidenContext, node: fx.Node, a: dict) -> Wide:
    _no_generator(ctx, node, a)
    x = _target(ctx, node, a["self"])
    out = _op(ctx, node, aten.bernoulli_.Tensor, x.node, _p(ctx, node, a["p"], x.rank))
    return Wide(out, x.rank)


@form(aten.bernoulli.p)
def _bernoulli(ctx: WidenContext, node: fx.Node, a: dict) -> Wide:
    _no_generator(ctx, node, a)
    rank = member_rank(node.args[0])
    x = ctx.as_wide(a["self"], rank, node)
    t = _op(ctx, node, aten.empty_like.default, x.node, memory_format=torch.contiguous_format)
    return Wide(_op(ctx, node, aten.bernoulli_.Tensor, t, _p(ctx, node, a["p"], rank)), rank)


def _moved(ctx: WidenContext, node: fx.Node, x: fx.Node, rank: int, scale: Any, shift: Any,
           divide: bool = False) -> fx.Node:
    """``x * scale + shift`` (``x / scale`` when ``divide``) in place, each a Python float or a
    per-member value broadcast in ``x``'s dtype."""
    if isinstance(scale, Wide) or scale != 1:
        s = scalar(ctx, node, scale, rank, like=x)
        op = (aten.div_ if divide else aten.mul_).Tensor
        x = _op(ctx, node, op, x, s)
    if isinstance(shift, Wide) or shift != 0:
        x = _op(ctx, node, aten.add_.Tensor, x, scalar(ctx, node, shift, rank, like=x))
    return x


def _minus(ctx: WidenContext, node: fx.Node, hi: Any, lo: Any) -> Any:
    """``hi - lo`` of per-member ``[N]`` values and/or Python floats."""
    if not isinstance(hi, Wide) and not isinstance(lo, Wide):
        return hi - lo
    if not isinstance(hi, Wide):
        return Wide(_op(ctx, node, aten.rsub.Scalar, lo.node, hi), 0)
    return Wide(_op(ctx, node, aten.sub.Tensor, hi.node, ctx.unwrap(lo)), 0)


@form(aten.uniform_.default)
def _uniform(ctx: WidenContext, node: fx.Node, a: dict) -> Wide:
    _no_generator(ctx, node, a)
    x = _target(ctx, node, a["self"])
    lo, hi = a["from"], a["to"]
    span = _minus(ctx, node, hi, lo)
    if isinstance(span, Wide):
        _check(ctx, node, _cmp(ctx, node, span, "ge", 0.0), "from > to")
    elif span < 0:
        raise ctx.fail(node, f"from > to ({lo} > {hi})")
    u = _op(ctx, node, aten.uniform_.default, x.node, 0.0, 1.0)
    return Wide(_moved(ctx, node, u, x.rank, span, lo), x.rank)


@form(aten.normal_.default)
def _normal_inplace(ctx: WidenContext, node: fx.Node, a: dict) -> Wide:
    _no_generator(ctx, node, a)
    x = _target(ctx, node, a["self"])
    _check(ctx, node, _cmp(ctx, node, a["std"], "ge", 0.0), "std < 0")
    z = _op(ctx, node, aten.normal_.default, x.node, 0.0, 1.0)
    return Wide(_moved(ctx, node, z, x.rank, a["std"], a["mean"]), x.rank)


@form(aten.exponential_.default)
def _exponential(ctx: WidenContext, node: fx.Node, a: dict) -> Wide:
    _no_generator(ctx, node, a)
    x = _target(ctx, node, a["self"])
    _check(ctx, node, _cmp(ctx, node, a["lambd"], "gt", 0.0), "lambd <= 0")
    e = _op(ctx, node, aten.exponential_.default, x.node, 1.0)
    return Wide(_moved(ctx, node, e, x.rank, a["lambd"], 0.0, divide=True), x.rank)


@form(aten.normal.float_float)
def _normal(ctx: WidenContext, node: fx.Node, a: dict) -> Wide:
    """``torch.normal(mean, std, size)`` with a per-member mean and/or std: ``[N, *size]``
    standard normals, moved per member."""
    _no_generator(ctx, node, a)
    _check(ctx, node, _cmp(ctx, node, a["std"], "ge", 0.0), "std < 0")
    rank = member_rank(node)
    opts = {k: a[k] for k in ("dtype", "layout", "device", "pin_memory") if a.get(k) is not None}
    z = _op(ctx, node, aten.randn.default, [ctx.n, *a["size"]], **opts)
    return Wide(_moved(ctx, node, z, rank, a["std"], a["mean"]), rank)
