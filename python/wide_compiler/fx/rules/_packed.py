"""Shared by the channel-packed families (conv, norms, PReLU): the N-first value of a packed op's
result. Every value the other rules see is N-first; the layout plan (fx/layout.py) removes the
``to_nfirst`` between consecutive packed ops."""

from __future__ import annotations

import torch
from torch import fx

from ..context import Wide, WidenContext, member_rank
from ._autocast import NOT_CAST

aten = torch.ops.aten
wide = torch.ops.wide
# Under torch.autocast (Note [wide autocast]): layout conversions keep their input's dtype.
AUTOCAST = {"to_packed": NOT_CAST, "to_nfirst": NOT_CAST, "to_channels_first": NOT_CAST}


def packed_result(ctx: WidenContext, node: fx.Node, packed: fx.Node, unbatched: bool = False) -> Wide:
    """``to_nfirst`` of a packed op's result (and the unbatched squeeze), as the node's value."""
    out = ctx.emit(wide.to_nfirst.default, (packed, ctx.n), like=node,
                   name=None if unbatched else node.name)
    shape = node.meta["val"].shape
    out.meta["wide_member_shape"] = tuple(str(s) for s in ((1, *shape) if unbatched else shape))
    if unbatched:
        out = ctx.emit(aten.squeeze.dim, (out, 1), like=node, name=node.name)
    return Wide(out, member_rank(node))
