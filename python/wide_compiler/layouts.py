"""Layout tags, and the channel-packed calling convention of a wide model.

Tensors made by :func:`~wide_compiler.pack` or returned by a :class:`~wide_compiler.WideModel`
carry their layout (DESIGN.md §3: N-first ``[N, B, ...]`` or channel-packed ``[B, N*C, ...]``),
so the helpers can refuse the wrong one instead of splitting the wrong dim. The tag is a Python
attribute: ops on the tensor drop it. :class:`PackedWideModel` calls a wide model with packed
tensors (``WideModel.packed``, WideCompiler 0.x's convention).

>>> import torch
>>> from wide_compiler.layouts import layout_of, tag_layout
>>> t = tag_layout(torch.zeros(2, 3), "packed")
>>> layout_of(t), layout_of(t + 1)
('packed', None)
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

if TYPE_CHECKING:
    from .model import WideModel

__all__ = ["PackedWideModel", "layout_of", "tag_layout"]

_LAYOUT_ATTR = "_wide_layout"
# On an output of a padded model whose members' sizes differ (PaddedWideModel._tag_padded_outputs):
# its layouts, {dim: [N, padded size] 0/1 of where each member's own values are} (member_part)
PADDED_OUTPUT = "_wide_padded_layouts"


def tag_layout(t: Any, layout: str) -> Any:
    """Mark tensor ``t`` as ``"nfirst"`` or ``"packed"`` (no-op for other values and under
    ``torch.compile``, where tensors take no Python attributes); returns ``t``."""
    if isinstance(t, torch.Tensor) and not torch.compiler.is_compiling():
        setattr(t, _LAYOUT_ATTR, layout)
    return t


def layout_of(t: torch.Tensor) -> str | None:
    """``"nfirst"``/``"packed"`` for a tensor tagged by :func:`tag_layout`, else None."""
    return getattr(t, _LAYOUT_ATTR, None)


# Note [A padded output after an op]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The mark of a padded output is a Python attribute, so ``out * 2`` (a logit scale, a
# temperature), ``out.clone()`` or ``out[..., :]`` lose it, and ``member_losses`` then counted each
# narrower member's padded classes as its own (probe 16 of issue 44, P16-5: cross-entropy 0.86
# off, with wrong gradients, silently). The marked outputs alive are kept (weakly, by id); a loss
# input of a marked output's shape that is not marked is looked for among what it was computed
# from (its view base, its autograd graph, at most ``_SEARCHED`` nodes): made from one, it is
# refused; with no graph to search (``torch.no_grad``, ``detach``) it is warned about. A tensor of
# another shape (a reduction over the padded dim) is not: it no longer holds the padded dim.
_MARKED: dict[int, weakref.ref] = {}  # id -> a padded output alive (PaddedWideModel._tag_padded_outputs)
_SEARCHED = 4096


def mark_padded_output(t: torch.Tensor, layouts: dict[int, torch.Tensor]) -> None:
    """Mark ``t``, an output of a padded model, with its ``layouts`` (``PADDED_OUTPUT``); Note [A
    padded output after an op]."""
    setattr(t, PADDED_OUTPUT, layouts)
    key = id(t)
    _MARKED[key] = weakref.ref(t, lambda _, key=key: _MARKED.pop(key, None))


def unmarked_padded_source(t: torch.Tensor) -> tuple[torch.Tensor | None, bool]:
    """Note [A padded output after an op]: ``(output, found)`` for an unmarked ``t``: a marked
    padded output alive of ``t``'s shape (None: none, and nothing to say), and whether ``t`` was
    found to be computed from it (False: ``t`` has no graph to search, or it was not)."""
    same = [o for o in (r() for r in list(_MARKED.values())) if o is not None and o.shape == t.shape]
    if not same or getattr(t, PADDED_OUTPUT, None) is not None:
        return None, False
    if t._base is not None:
        base = next((o for o in same if t._base is o or t._base is o._base), None)
        if base is not None:
            return base, True
    # The graph's nodes are compared by identity while they are held: a node's Python object is
    # the same one only while one is alive (``o.grad_fn`` makes a new one each time otherwise, and
    # an id of a dead one can be another's; the search found no source on a GPU run, P16-5 there).
    held = [(o.grad_fn, o) for o in same if o.grad_fn is not None]
    nodes = {id(fn): o for fn, o in held}
    if t.grad_fn is not None and nodes:
        seen, visited, todo = set(), [], [t.grad_fn]  # visited: held, so their ids stay theirs
        while todo and len(seen) < _SEARCHED:
            node = todo.pop()
            if node is None or id(node) in seen:
                continue
            if id(node) in nodes:
                return nodes[id(node)], True
            seen.add(id(node))
            visited.append(node)
            todo.extend(f for f, _ in node.next_functions)
        if len(nodes) == len(same):
            return None, False  # searched: not made from them
    if t.grad_fn is None and t.requires_grad:
        return None, False  # a leaf of the caller's
    return same[0], False  # no graph links them: cannot tell


def member_part(t: torch.Tensor, layouts: dict[int, torch.Tensor], i: int) -> torch.Tensor:
    """Member ``i``'s own values of ``t`` (one member's padded tensor, no member dim), given the
    padded dims' ``layouts`` (a padded model's output layouts)."""
    for d, lay in sorted(layouts.items()):
        t = t.index_select(d, lay[i].nonzero().flatten().to(t.device))
    return t


def _any_packed(args: tuple, kwargs: dict) -> bool:
    """Whether an input was made by :func:`~wide_compiler.pack` (positional tensors: no pytree walk)."""
    leaves = args if not kwargs and all(isinstance(a, torch.Tensor) for a in args) else tree_flatten((args, kwargs))[0]
    return any(isinstance(t, torch.Tensor) and layout_of(t) == "packed" for t in leaves)



class PackedWideModel(nn.Module):
    """A :class:`WideModel` called with channel-packed tensors (see :attr:`WideModel.packed`)."""

    def __init__(self, wide: WideModel) -> None:
        super().__init__()
        self.wide = wide

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        n = self.wide.n
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if any(layout_of(t) == "nfirst" for t in tensors):
            raise ValueError("wide_compiler: packed call given an N-first tensor (a WideModel output): call "
                             "the WideModel itself with N-first inputs, or pack per-member tensors with "
                             "wide_compiler.pack")

        def to_nfirst(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            if t.dim() < 2 or t.shape[1] % n:
                raise ValueError(f"wide_compiler: packed input: expected [B, N*C, ...] with dim 1 divisible "
                                 f"by N={n}, got {list(t.shape)}")
            return t.unflatten(1, (n, -1)).movedim(1, 0)

        def to_packed(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            out = t.movedim(0, 1).flatten(1, 2) if t.dim() >= 3 else t.flatten()
            return tag_layout(out.contiguous(), "packed")

        args, kwargs = tree_map(to_nfirst, (args, kwargs))
        return tree_map(to_packed, self.wide(*args, **kwargs))

