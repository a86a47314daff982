"""Layouts of padded dims (Note [Padded members] in fx/padding.py): a dim whose size differs
between members has a bool ``[N, max]`` layout saying which positions hold member ``i``'s values.
The helpers here make, compare and apply layouts; the padding pass, the op rules and the padded
members (fx/padded_members.py) share them.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["FREE", "Prefer", "flat_layout", "layout_mask", "prefix", "same_layout", "scatter"]

FREE = "free"  # a parameter dim whose layout no consumer has fixed yet (prefix unless one does)


def prefix(sizes: Sequence[int], most: int) -> torch.Tensor:
    return torch.arange(most)[None, :] < torch.tensor(list(sizes))[:, None]


def same_layout(a: Any, b: Any) -> bool:
    if a is None or b is None or isinstance(a, str) or isinstance(b, str):
        return a is b or (isinstance(a, str) and isinstance(b, str))
    return a.shape == b.shape and bool(torch.equal(a, b))


def flat_layout(lay: Any) -> list[Any]:
    """Every dim's entry of a layout (a tuple result's per-output layouts flattened)."""
    if not lay:
        return []
    return [v for sub in lay for v in sub] if isinstance(lay[0], list) else list(lay)


class Prefer(Exception):  # noqa: N818 (a request, not an error)
    """Run the pass again with this parameter dim laid out so (a later split needs it)."""

    def __init__(self, where: tuple[str, int], layout: torch.Tensor) -> None:
        super().__init__(where)
        self.where, self.layout = where, layout


def layout_mask(lay: dict[int, torch.Tensor], rank: int, n: int, dtype: torch.dtype,
                device: torch.device | None = None) -> torch.Tensor:
    """``[N, *shape]`` 0/1 values of a layout ({dim: bool [N, size]}): 1 where a member's own
    values are, size 1 along the dims the layout does not pad (they broadcast)."""
    m = torch.ones((n,) + (1,) * rank, dtype=dtype, device=device)
    for d, v in lay.items():
        view = [n] + [1] * rank
        view[d + 1] = v.shape[1]
        m = m * v.to(device=device, dtype=dtype).view(view)
    return m


def scatter(t: torch.Tensor, lay: dict[int, torch.Tensor], i: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Member ``i``'s tensor ``t`` placed at its layout's positions of a zero tensor of ``shape``."""
    out = t
    for d, v in sorted(lay.items()):
        idx = v[i].nonzero().flatten().to(t.device)
        grown = list(out.shape)
        grown[d] = shape[d]
        z = out.new_zeros(grown)
        z.index_copy_(d, idx, out)
        out = z
    return out.contiguous()
