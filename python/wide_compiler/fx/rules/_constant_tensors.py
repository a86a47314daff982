"""Per-member forms of tensors a forward makes from per-member constants (Note [Per-member
constants] in fx/constants.py): registered in the forms table of fx/rules/_constants.py.

Note [Per-member tensor constants]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``torch.tensor(self.s)``, ``torch.as_tensor(self.s)`` and ``x.new_tensor(self.s)`` in a forward
make a tensor from a Python float: export lifts it out of the graph as a *constant* input (member
0's value) read by ``aten.lift_fresh_copy``. Where the probes of fx/constants.py find its values
differ between members, every element ``e`` of it is a ``[N]`` float64 buffer (the attribute's own
buffer where the element is the attribute itself for every member, else a derived one with each
member's value from its own probe), and the ``lift_fresh_copy`` is widened to
``stack(elements, 1).view(N, *shape).to(dtype)`` (a copy, not a view: the ``detach_`` export puts
after it runs on that whole copy): each member reads its own tensor, in the dtype the member made
it (float64 holds every float32, float16, bfloat16 and integer up to 2**53 exactly). Small tensors only (``MAX_TENSOR_ELEMENTS``); read by anything but ``lift_fresh_copy``
it is refused (fx/constants.py).

``torch.full(size, self.s)``, ``torch.full_like``, ``x.new_full``, ``torch.scalar_tensor`` and
``fill``/``fill_`` keep the float as an argument: their fill value is per member as any scalar
argument is, and the result is each member's own value broadcast to the size, materialised
(contiguous, writable: a later in-place op writes each member's own copy).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from ..context import Wide, WidenContext, member_rank
from ._constants import form

aten = torch.ops.aten


def _val(node: fx.Node) -> torch.Tensor:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise AssertionError(f"wide_compiler: internal error: node '{node.name}' has no tensor value")
    return val


def _emit(ctx: WidenContext, node: fx.Node, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
    return ctx.emit(target, args, kwargs, like=node)


def _per_member(ctx: WidenContext, node: fx.Node, v: Any, dtype: torch.dtype) -> fx.Node:
    """A per-member fill value ``[N]`` in ``dtype`` (a shared one: refused, it is no per-member argument)."""
    if not isinstance(v, Wide):
        raise ctx.fail(node, "internal error: the fill value named per member is not a per-member value")
    return _emit(ctx, node, aten._to_copy.default, v.node, dtype=dtype)


def _filled(ctx: WidenContext, node: fx.Node, value: fx.Node, size: Any = None, like: Any = None) -> Wide:
    """Each member's ``value`` ([N]) broadcast to the member size ``size`` (a list) or to the
    wide tensor ``like``, materialised."""
    rank = len(size) if size is not None else like.rank
    t = _emit(ctx, node, aten.view.default, value, [-1] + [1] * rank)
    if size is not None:
        t = _emit(ctx, node, aten.expand.default, t, [-1, *size])
    else:
        t = _emit(ctx, node, aten.expand_as.default, t, like.node)
    t = _emit(ctx, node, aten.clone.default, t, memory_format=torch.contiguous_format)
    return Wide(t, rank)


@form(aten.lift_fresh_copy.default, aten.lift_fresh.default)
def _lifted(ctx: WidenContext, node: fx.Node, a: dict) -> Wide:
    """A lifted tensor constant made from per-member constants (Note [Per-member tensor constants])."""
    val = _val(node)
    cols = []
    for e in range(val.numel()):
        col = a.get(f"self.{e}")
        if not isinstance(col, Wide):
            raise ctx.fail(node, f"internal error: element {e} of a per-member tensor constant has no per-member value")
        cols.append(col.node)
    t = _emit(ctx, node, aten.stack.default, cols, 1)
    t = _emit(ctx, node, aten.view.default, t, [-1, *val.shape])
    t = _emit(ctx, node, aten._to_copy.default, t, dtype=val.dtype)  # a tensor of its own, not a view
    return Wide(t, val.dim())


@form(aten.detach_.default)
def _detach_(ctx: WidenContext, node: fx.Node, a: dict) -> Wide:
    """The ``detach_`` export puts after a ``lift_fresh_copy``: on the whole per-member tensor (its
    own copy), as the member detaches its own."""
    x = a["self"]
    if not isinstance(x, Wide):
        raise ctx.fail(node, "internal error: detach_ of a per-member tensor constant that is not per member")
    return Wide(_emit(ctx, node, aten.detach_.default, x.node), x.rank)


@form(aten.full.default)
def _full(ctx: WidenContext, node: fx.Node, a: dict) -> Wide:
    return _filled(ctx, node, _per_member(ctx, node, a["fill_value"], _val(node).dtype), size=list(a["size"]))


@form(aten.new_full.default)
def _new_full(ctx: WidenContext, node: fx.Node, a: dict) -> Wide:
    return _filled(ctx, node, _per_member(ctx, node, a["fill_value"], _val(node).dtype), size=list(a["size"]))


@form(aten.scalar_tensor.default)
def _scalar_tensor(ctx: WidenContext, node: fx.Node, a: dict) -> Wide:
    return Wide(_per_member(ctx, node, a["s"], _val(node).dtype), 0)


@form(aten.full_like.default, aten.fill.Scalar)
def _full_like(ctx: WidenContext, node: fx.Node, a: dict) -> Wide:
    x = ctx.as_wide(a["self"], member_rank(node.args[0]), node)
    value = a["fill_value"] if "fill_value" in a else a["value"]
    return _filled(ctx, node, _per_member(ctx, node, value, _val(node).dtype), like=x)


@form(aten.fill_.Scalar)
def _fill_(ctx: WidenContext, node: fx.Node, a: dict) -> Wide:
    x = a["self"]
    if not isinstance(x, Wide):
        raise ctx.fail(node, "fills a tensor shared by every member with a per-member value (in place): each "
                             "member would need its own copy; fill a tensor made in the forward instead")
    out = _filled(ctx, node, _per_member(ctx, node, a["value"], _val(node).dtype), like=x)
    return Wide(_emit(ctx, node, aten.copy_.default, x.node, out.node), x.rank)
