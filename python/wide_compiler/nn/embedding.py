"""WideEmbedding and WideEmbeddingBag over ``torch.ops.wide.embedding`` / ``embedding_bag``."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from .. import functional as WF
from ..ops import WIDE_OPS
from ._common import check_members, check_strategy, stack_param, unstack_member

__all__ = ["WideEmbedding", "WideEmbeddingBag"]

#: The options nn.Embedding and nn.EmbeddingBag share, which the members must agree on.
_TABLE_OPTIONS = ("num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq",
                  "sparse")


class _WideTable(nn.Module):
    _base: type[nn.Module]
    _attrs: tuple[str, ...]
    STRATEGIES = WIDE_OPS["embedding"].choices  # one implementation (embedding_bag too): ("auto",)

    def __init__(self, modules: Sequence[nn.Module], *, strategy: str = "auto") -> None:
        super().__init__()
        self.strategy = check_strategy(self, strategy)
        self.n = len(modules)
        object.__setattr__(self, "_template", copy.deepcopy(modules[0]).to("meta"))
        self.weight = stack_param(modules, "weight")

    @classmethod
    def from_modules(cls, modules: Sequence[nn.Module], *, strategy: str = "auto"):
        """Stack N tables of one configuration (weights copied)."""
        check_strategy(cls, strategy)
        return cls(check_members(modules, cls._base, cls._attrs, cls.__name__), strategy=strategy)

    def unfuse(self) -> list[nn.Module]:
        """N ordinary modules with copies of the members' tables."""
        out = []
        for i in range(self.n):
            m = copy.deepcopy(self._template).to_empty(device=self.weight.device).to(self.weight.dtype)
            unstack_member(m, self, i, ("weight",))
            out.append(m)
        return out

    def extra_repr(self) -> str:
        return f"n={self.n}, {self._template.extra_repr()}, strategy={self.strategy!r}"


class WideEmbedding(_WideTable):
    """N ``nn.Embedding`` tables looked up at once (one lookup into the ``[N*V, D]`` table).
    Indices are N-first ``[N, *]``, or shared: ``idx.expand(N, *idx.shape)``.

    Example:
        >>> import torch, wide_compiler as wc
        >>> embs = [torch.nn.Embedding(10, 4, padding_idx=0) for _ in range(3)]
        >>> wide = wc.nn.WideEmbedding.from_modules(embs)
        >>> idx = torch.randint(0, 10, (3, 2, 5))
        >>> torch.equal(wide(idx)[1], embs[1](idx[1]))
        True
    """

    _base = nn.Embedding
    _attrs = _TABLE_OPTIONS + ("weight",)

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        t = self._template
        return WF.embedding(indices, self.weight, t.padding_idx, t.max_norm, t.norm_type, t.scale_grad_by_freq,
                            t.sparse)


class WideEmbeddingBag(_WideTable):
    """N ``nn.EmbeddingBag`` (sum/mean/max, offsets, per_sample_weights, padding_idx).

    ``forward(input, offsets=None, per_sample_weights=None)`` as the original with a member dim:
    input ``[N, B, L]`` (fixed-size bags), or ``[N, T]`` with offsets ``[N, B]`` or shared ``[B]``.

    Example:
        >>> import torch, wide_compiler as wc
        >>> bags = [torch.nn.EmbeddingBag(10, 4, mode='max') for _ in range(3)]
        >>> wide = wc.nn.WideEmbeddingBag.from_modules(bags)
        >>> idx = torch.randint(0, 10, (3, 2, 5))
        >>> torch.allclose(wide(idx)[2], bags[2](idx[2]))
        True
    """

    _base = nn.EmbeddingBag
    _attrs = _TABLE_OPTIONS + ("mode", "include_last_offset", "weight")

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        t = self._template
        return WF.embedding_bag(input, self.weight, offsets, t.max_norm, t.norm_type, t.scale_grad_by_freq, t.mode,
                                t.sparse, per_sample_weights, t.include_last_offset, t.padding_idx)
