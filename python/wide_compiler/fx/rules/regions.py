"""Widen rules: higher-order regions of the exported graph.

``with torch.no_grad():`` / ``torch.set_grad_enabled(...)`` and ``with torch.autocast(...):``
inside a forward (the ``@torch.no_grad()`` rotary embeddings of decoder LLMs) reach the graph as
``higher_order.wrap_with_set_grad_enabled(enabled, body, *args)`` and
``higher_order.wrap_with_autocast(device, dtype, enabled, cache, body, *args)`` whose body is a
graph module. The body is widened like any graph (every rule applies inside it) into its own wide
graph module, and the region becomes a call of :class:`Region`, which runs it under the same
grad mode or autocast state: no gradient flows through a no-grad region, and autocast picks the
same dtypes as in the member.
Regions next to the other capture special cases: Note [Capture special cases] in fx/capture.py.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from ..table import rule
from ..context import Wide, WidenContext

_HOP = torch.ops.higher_order
_GRAD, _AUTOCAST = _HOP.wrap_with_set_grad_enabled, _HOP.wrap_with_autocast


class Region:
    """A widened region body run under its grad mode (``grad``) or autocast state (``autocast``:
    device type, dtype, enabled, cache_enabled)."""

    def __init__(self, body: fx.GraphModule, name: str, grad: bool | None = None,
                 autocast: tuple | None = None) -> None:
        self.body, self.grad, self.autocast = body, grad, autocast
        self.__name__ = self.__qualname__ = f"wide_region_{name}"
        self.__module__ = __name__

    def __call__(self, *args: Any) -> Any:
        if self.autocast is None:
            with torch.set_grad_enabled(self.grad):
                return self.body(*args)
        device, dtype, enabled, cache = self.autocast
        with torch.autocast(device, dtype=dtype, enabled=enabled, cache_enabled=cache):
            return self.body(*args)

    def __repr__(self) -> str:
        mode = f"grad={self.grad}" if self.autocast is None else f"autocast={self.autocast}"
        return f"<{self.__name__} {mode}>"


def widen_body(ctx: WidenContext, body: fx.GraphModule, inputs: list[Any]) -> tuple[fx.GraphModule, list[Any]]:
    """Widen a region body against the outer values ``inputs``; returns its wide graph module and
    its outputs' values in the body's terms (Wide or shared) for the outer graph to wrap."""
    sub = WidenContext(ctx.n, ctx.strict, ctx.opaque_paths)
    sub.root = ctx.root
    placeholders = [bn for bn in body.graph.nodes if bn.op == "placeholder"]
    for bn, v in zip(placeholders, inputs, strict=True):
        new = sub.graph.placeholder(bn.name)
        sub.env[bn] = Wide(new, v.rank) if isinstance(v, Wide) else new
    outs: list[Any] = []
    for bn in body.graph.nodes:
        if bn.op == "call_function":
            sub.env[bn] = sub.widen_node(bn)
        elif bn.op == "get_attr":  # a nested region
            sub.env[bn] = getattr(body, bn.target)
        elif bn.op == "output":
            outs = [sub.value(o) for o in bn.args[0]]
            sub.graph.output(tuple(sub.unwrap(o) for o in outs))
    sub.graph.lint()
    ctx.fallbacks += sub.fallbacks
    ctx.rules_used |= sub.rules_used
    ctx.random_ops |= sub.random_ops
    return fx.GraphModule(torch.nn.Module(), sub.graph, class_name="WideRegion"), outs


@rule(_GRAD, _AUTOCAST, always=True)
def _region(ctx: WidenContext, node: fx.Node):
    if node.target is _GRAD:
        enabled, body, *inputs = node.args
        options = {"grad": bool(enabled)}
    else:
        device, dtype, enabled, cache, body, *inputs = node.args
        options = {"autocast": (device, dtype, enabled, cache)}
    values = [ctx.value(a) for a in inputs]
    gm, outs = widen_body(ctx, ctx.value(body), values)
    region = Region(gm, node.name, **options)
    out = ctx.emit_wide(region, tuple(ctx.unwrap(v) for v in values), like=node, name=node.name,
                        op=f"region:{region}")
    items = []
    for k, o in enumerate(outs):
        item = ctx.emit(operator.getitem, (out, k), like=node)
        items.append(Wide(item, o.rank) if isinstance(o, Wide) else item)
    return tuple(items)
