"""WideDropout and WideDropout{1,2,3}d: N dropout layers, each member with its own p and its own
random mask, in one masked multiply."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ._common import check_members, check_strategy

__all__ = ["WideDropout", "WideDropout1d", "WideDropout2d", "WideDropout3d"]


class _WideDropoutNd(nn.Module):
    """N dropout layers; ``p`` is one float for every member or one per member. In training each
    member draws an INDEPENDENT mask (one keep/drop draw per element, or per (sample, channel)
    for channel dropout) and scales what it keeps by ``1 / (1 - p_i)``; in eval it is the identity."""

    _base: type[nn.Module]
    STRATEGIES = ("auto",)  # one implementation: a per-member Bernoulli mask

    def __init__(self, n: int, p: float | Sequence[float] = 0.5, inplace: bool = False, *,
                 strategy: str = "auto") -> None:
        super().__init__()
        name = type(self).__name__
        self.strategy = check_strategy(self, strategy)
        if n < 1:
            raise ValueError(f"{name}: expected n >= 1 members, got {n}")
        ps = [float(v) for v in p] if isinstance(p, (Sequence, torch.Tensor)) else [float(p)] * n
        if len(ps) != n:
            raise ValueError(f"{name}: expected one p per member ({n}), got {len(ps)}")
        for i, v in enumerate(ps):
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name}: dropout probability has to be between 0 and 1, but member {i} has {v}")
        self.n, self.p, self.inplace = n, tuple(ps), inplace

    @classmethod
    def from_modules(cls, modules: Sequence[nn.Module], *, strategy: str = "auto"):
        """One wide layer from N dropout modules (each member keeps its own ``p``; ``inplace``
        and the training mode must be the same for all)."""
        check_strategy(cls, strategy)
        modules = check_members(modules, cls._base, ("inplace", "training"), cls.__name__)
        return cls(len(modules), [m.p for m in modules], modules[0].inplace, strategy=strategy).train(modules[0].training)

    def _mask_dims(self, rank: int) -> int:
        """How many leading dims of a member input of ``rank`` dims the mask varies over."""
        return rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 1 or x.shape[0] != self.n:
            raise ValueError(f"{type(self).__name__}: expected an N-first input with N={self.n} members, "
                             f"got shape {list(x.shape)}")
        k = self._mask_dims(x.dim() - 1)
        if not self.training or not any(self.p):
            return x
        if k == x.dim() - 1 and len(set(self.p)) == 1:
            # One p for all and an elementwise mask: every element draws independently either
            # way, so ATen's fused dropout is the same distribution in one kernel.
            return F.dropout(x, self.p[0], True, self.inplace)
        dtype = torch.promote_types(x.dtype, torch.float32)  # draws at least in float32 (half: coarse)
        shape = list(x.shape[:k + 1]) + [1] * (x.dim() - 1 - k)
        keep = 1.0 - torch.tensor(self.p, dtype=dtype, device=x.device).view(-1, *[1] * (len(shape) - 1))
        draw = torch.rand(shape, dtype=dtype, device=x.device) < keep
        mask = (draw * torch.where(keep > 0, 1.0 / keep, torch.zeros_like(keep))).to(x.dtype)
        return x.mul_(mask) if self.inplace else x * mask

    def unfuse(self) -> list[nn.Module]:
        """N ordinary dropout modules, member ``i`` with its own ``p``."""
        return [self._base(p, self.inplace).train(self.training) for p in self.p]

    def extra_repr(self) -> str:
        p = self.p[0] if len(set(self.p)) == 1 else self.p
        return f"n={self.n}, p={p}, inplace={self.inplace}, strategy={self.strategy!r}"


class WideDropout(_WideDropoutNd):
    """N ``nn.Dropout`` (each with its own ``p``) as one masked multiply; any N-first input
    ``[N, *]``; an independent elementwise mask per member in training, identity in eval.

    Example:
        >>> import torch, wide_compiler as wc
        >>> wide = wc.nn.WideDropout.from_modules([torch.nn.Dropout(p) for p in (0.0, 0.5, 1.0)])
        >>> y = wide(torch.ones(3, 4, 100))
        >>> bool((y[0] == 1).all()), bool((y[2] == 0).all()), set(y[1].unique().tolist()) <= {0.0, 2.0}
        (True, True, True)
        >>> torch.equal(wide.eval()(torch.ones(3, 4, 100)), torch.ones(3, 4, 100))
        True
        >>> [m.p for m in wide.unfuse()]
        [0.0, 0.5, 1.0]
    """

    _base = nn.Dropout


class WideDropout1d(_WideDropoutNd):
    """N ``nn.Dropout1d`` (channel dropout): member input ``[B, C, L]`` or unbatched ``[C, L]``,
    N-first ``[N, B, C, L]`` / ``[N, C, L]``; one draw per member, sample and channel.

    Example:
        >>> import torch, wide_compiler as wc
        >>> wide = wc.nn.WideDropout1d(2, p=[0.5, 0.0])
        >>> y = wide(torch.ones(2, 8, 4, 10))
        >>> bool((y[1] == 1).all()), bool((y[0] == y[0][..., :1]).all())   # whole channels kept or dropped
        (True, True)
    """

    _base = nn.Dropout1d

    def _mask_dims(self, rank: int) -> int:
        if rank not in (2, 3):
            raise ValueError("WideDropout1d: expected an N-first input [N, B, C, L] or [N, C, L] (members "
                             f"[B, C, L] or [C, L]), got {rank + 1} dims")
        return rank - 1


class WideDropout2d(_WideDropoutNd):
    """N ``nn.Dropout2d`` (channel dropout): N-first ``[N, B, C, H, W]``; one draw per member, sample
    and channel. As ``nn.Dropout2d``, a 3-d member input ``[B, C, L]`` drops channels per sample
    (with torch's warning) and other ranks drop along their first two member dims.

    Example:
        >>> import torch, wide_compiler as wc
        >>> wide = wc.nn.WideDropout2d.from_modules([torch.nn.Dropout2d(0.3) for _ in range(3)])
        >>> wide(torch.randn(3, 2, 4, 5, 5)).shape
        torch.Size([3, 2, 4, 5, 5])
    """

    _base = nn.Dropout2d

    def _mask_dims(self, rank: int) -> int:
        if rank < 2:
            raise ValueError(f"WideDropout2d: expected member inputs of at least 2 dims, got {rank}")
        if rank == 3:
            warnings.warn("WideDropout2d: a 3-D member input is read as [B, C, L] (channel-wise 1-D dropout), "
                          "as nn.Dropout2d does; use WideDropout1d to silence this", stacklevel=3)
        return 2


class WideDropout3d(_WideDropoutNd):
    """N ``nn.Dropout3d`` (channel dropout): N-first ``[N, B, C, D, H, W]`` or unbatched members
    ``[N, C, D, H, W]``; one draw per member, sample and channel.

    Example:
        >>> import torch, wide_compiler as wc
        >>> wide = wc.nn.WideDropout3d(2, p=0.5)
        >>> wide(torch.randn(2, 3, 4, 2, 2, 2)).shape
        torch.Size([2, 3, 4, 2, 2, 2])
    """

    _base = nn.Dropout3d

    def _mask_dims(self, rank: int) -> int:
        if rank < 1:
            raise ValueError(f"WideDropout3d: expected member inputs of at least 1 dim, got {rank}")
        return 2 if rank == 5 else 1  # as F.dropout3d: anything but 5-d is one unbatched sample

