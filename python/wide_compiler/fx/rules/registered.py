"""Widen rule: a module with a user-registered wide form (``@wide_compiler.register``), captured
as one opaque op, becomes a call of the user's wide module held by the WideModel."""

from __future__ import annotations

import torch
from torch import fx

from ...registry import call_registered
from ..table import rule
from ..context import WidenContext, member_rank

_OPAQUE = torch.ops.wide_compiler.opaque_module.default

@rule(_OPAQUE, always=True)
def _registered(ctx: WidenContext, node: fx.Node):
    path = ctx.opaque_paths.get(node.args[0])
    if path is None or ctx.root is None:
        raise ctx.fail(node, "an opaque module call that this wide model did not register")
    inputs = [ctx.as_wide(ctx.value(a), member_rank(a), node).node for a in node.args[1]]
    out = ctx.emit_wide(call_registered, (ctx.root, path, *inputs), like=node, name=node.name,
                        op=f"registered:{path}")
    return ctx.outputs(node, out)
