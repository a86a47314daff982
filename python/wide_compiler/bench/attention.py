"""``benchmark attention``: N ``nn.MultiheadAttention`` self-attention layers (batch first), float32
eager, ``inference`` and ``train``, against N separate modules in a Python loop and
``torch.func`` ensembling (``vmap``).

Every member has its own weights and its own tokens ``[B, L, E]`` (N-first ``[N, B, L, E]``).
Cases: ``mha_self`` (``mha(x, x, x, need_weights=False)``, the SDPA path a transformer layer
takes), ``mha_self_weights`` (``mha(x, x, x)``, torch's default: the averaged attention
weights are returned too) and ``sdpa`` (the attention core alone, ``F.scaled_dot_product_attention``
of a member's own ``q, k, v [B, H, L, E]``: in the eval graph ``wide.attention``, the small-sequence
kernel, against ATen's SDPA per member). Wide contenders (the record's ``strategy``):

- ``compile:auto``: ``wc.compile`` of the member (a module wrapping the attention), strategies
  measured (``tune=True``, no disk cache);
- ``module:auto``: the hand-built ``wc.nn.WideMultiheadAttention.from_modules`` (projections on
  ``torch.ops.wide.linear``, one attention over ``N*B`` sequences).

Records as :mod:`.vision` (same fields; ``shape`` is ``E=.. H=.. L=..``).

Example::

    >>> from wide_compiler import bench
    >>> [(case.name, case.shape) for case in bench.attention.attention_cases("tiny")]
    [('mha_self', 'E=16 H=2 L=8'), ('mha_self_weights', 'E=16 H=2 L=8'), ('sdpa', 'E=8 H=2 L=8')]
    >>> recs = bench.run("attention", "ci")                   # doctest: +SKIP
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .vision import Case, _randn, _vision_target

__all__ = ["Sdpa", "SelfAttention", "attention_cases"]

#: (embed dim, heads, tokens L, batch B) per size; ``small`` is the issue's reference point
#: (d=64, T=32, B=8; N=16 in preset quick).
_SIZES = {"tiny": (16, 2, 8, 2), "small": (64, 4, 32, 8)}


class SelfAttention(nn.Module):
    """Self-attention ``mha(x, x, x)`` of a member (``nn.MultiheadAttention``) or of its wide form
    (``wc.nn.WideMultiheadAttention``, N-first ``x``): the output, and with ``need_weights`` the
    head-averaged attention weights too."""

    def __init__(self, mha: nn.Module, need_weights: bool = False) -> None:
        super().__init__()
        self.mha, self.need_weights = mha, need_weights

    def forward(self, x: torch.Tensor) -> Any:
        out, weights = self.mha(x, x, x, need_weights=self.need_weights)
        return (out, weights) if self.need_weights else out


class Sdpa(nn.Module):
    """``F.scaled_dot_product_attention(q * temperature, k, v)`` of one input ``[B, 3, H, L, E]``
    (q, k, v stacked on dim 1): the attention core of a transformer layer, with one learnable
    scalar so that members have weights of their own (and a training step has a gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.temperature = nn.Parameter(torch.ones(()))

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        q, k, v = qkv.unbind(-4)
        return F.scaled_dot_product_attention(q * self.temperature, k, v)


def _module(models: list[nn.Module], strategy: str) -> nn.Module:
    import wide_compiler as wc

    wide = wc.nn.WideMultiheadAttention.from_modules([m.mha for m in models], strategy=strategy)
    return SelfAttention(wide, models[0].need_weights)


@_vision_target("attention", "nn.MultiheadAttention self-attention: wc.compile and "
                "WideMultiheadAttention vs loop / vmap")
def attention_cases(size: str) -> list[Case]:
    """Self-attention without and with the attention weights, and the attention core alone
    (tiny: E=16, 2 heads, L=8; small: E=64, 4 heads, L=32, B=8; the core's head dim is E/heads)."""
    e, h, length, b = _SIZES["tiny" if size == "tiny" else "small"]
    return [
        Case("attention", name, f"E={e} H={h} L={length}",
             lambda w=weights: SelfAttention(nn.MultiheadAttention(e, h, batch_first=True), w),
             _randn(length, e), b, _module, ("auto",))
        for name, weights in (("mha_self", False), ("mha_self_weights", True))
    ] + [Case("attention", "sdpa", f"E={e // h} H={h} L={length}", Sdpa, _randn(3, h, length, e // h), b,
              compile=("fast",))]
