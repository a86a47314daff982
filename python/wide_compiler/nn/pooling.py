"""WideAdaptive{Avg,Max}Pool{1,2,3}d: N adaptive pools as one call with the member dim folded into
the batch (pooling treats every (sample, channel) plane on its own)."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from .. import functional as WF
from ..errors import ArchitectureMismatchError
from ._common import check_members, check_strategy

__all__ = ["WideAdaptiveAvgPool1d", "WideAdaptiveAvgPool2d", "WideAdaptiveAvgPool3d", "WideAdaptiveMaxPool1d",
           "WideAdaptiveMaxPool2d", "WideAdaptiveMaxPool3d"]


class _WideAdaptivePool(nn.Module):
    """N adaptive pools of one ``output_size``: input N-first ``[N, B, C, *spatial]`` (folded to
    ``[N*B, C, *spatial]``) or unbatched members ``[N, C, *spatial]`` (N is the batch); output
    N-first, ``(output, indices)`` for max pools with ``return_indices=True``."""

    _base: type[nn.Module]
    _d: int
    _attrs: tuple[str, ...] = ("output_size",)
    STRATEGIES = ("auto",)  # one implementation: ATen's pool on the folded batch

    def __init__(self, n: int, *args, strategy: str = "auto", **kwargs) -> None:
        super().__init__()
        self.strategy = check_strategy(self, strategy)
        if n < 1:
            raise ValueError(f"{type(self).__name__}: expected n >= 1 members, got {n}")
        self.n = n
        self.pool = self._base(*args, **kwargs)  # parameter-free: runs on any device and dtype

    @classmethod
    def from_modules(cls, modules: Sequence[nn.Module], *, strategy: str = "auto"):
        """One wide pool from N pools with the same ``output_size`` (and ``return_indices``)."""
        check_strategy(cls, strategy)
        modules = check_members(modules, cls._base, cls._attrs[1:], cls.__name__)
        size = lambda m: tuple(WF.spatial_list(m.output_size, cls._d))
        for i, m in enumerate(modules):
            if size(m) != size(modules[0]):
                raise ArchitectureMismatchError(f"member {i}: output_size is {m.output_size!r}, "
                                                f"member 0 has {modules[0].output_size!r}")
        return cls(len(modules), **{a: getattr(modules[0], a) for a in cls._attrs}, strategy=strategy)

    def forward(self, x: torch.Tensor):
        d, name = self._d, type(self).__name__
        if x.dim() not in (d + 2, d + 3) or x.shape[0] != self.n:
            raise ValueError(f"{name}: expected an N-first input [N, B, C, *] with N={self.n} members and "
                             f"{d + 3} dims (or {d + 2} for unbatched members), got {list(x.shape)}")
        if x.dim() == d + 2:  # unbatched members: the N-first tensor is a batch
            return self.pool(x)
        out = self.pool(x.flatten(0, 1))
        unfold = lambda t: t.unflatten(0, (self.n, x.shape[1]))
        return tuple(unfold(t) for t in out) if isinstance(out, tuple) else unfold(out)

    def unfuse(self) -> list[nn.Module]:
        """N ordinary pool modules (copies)."""
        return [copy.deepcopy(self.pool) for _ in range(self.n)]

    def extra_repr(self) -> str:
        return f"n={self.n}, strategy={self.strategy!r}"


class WideAdaptiveAvgPool1d(_WideAdaptivePool):
    """N ``nn.AdaptiveAvgPool1d``: ``[N, B, C, L]`` or ``[N, C, L]`` in, N-first out.

    Example:
        >>> import torch, wide_compiler as wc
        >>> pools = [torch.nn.AdaptiveAvgPool1d(3) for _ in range(2)]
        >>> x = torch.randn(2, 4, 5, 10)
        >>> torch.equal(wc.nn.WideAdaptiveAvgPool1d.from_modules(pools)(x)[1], pools[1](x[1]))
        True
    """

    _base, _d = nn.AdaptiveAvgPool1d, 1


class WideAdaptiveAvgPool2d(_WideAdaptivePool):
    """N ``nn.AdaptiveAvgPool2d`` (``output_size`` may hold None: keep that dim): input
    ``[N, B, C, H, W]`` or ``[N, C, H, W]``.

    Example:
        >>> import torch, wide_compiler as wc
        >>> wide = wc.nn.WideAdaptiveAvgPool2d(3, (2, None))
        >>> wide(torch.randn(3, 4, 8, 6, 5)).shape
        torch.Size([3, 4, 8, 2, 5])
    """

    _base, _d = nn.AdaptiveAvgPool2d, 2


class WideAdaptiveAvgPool3d(_WideAdaptivePool):
    """N ``nn.AdaptiveAvgPool3d``: input ``[N, B, C, D, H, W]`` or ``[N, C, D, H, W]``."""

    _base, _d = nn.AdaptiveAvgPool3d, 3


class _WideAdaptiveMaxPool(_WideAdaptivePool):
    _attrs = ("output_size", "return_indices")


class WideAdaptiveMaxPool1d(_WideAdaptiveMaxPool):
    """N ``nn.AdaptiveMaxPool1d``; with ``return_indices=True`` returns ``(output, indices)``, both
    N-first, indices within each member's channel plane as the member's.

    Example:
        >>> import torch, wide_compiler as wc
        >>> pools = [torch.nn.AdaptiveMaxPool1d(2, return_indices=True) for _ in range(3)]
        >>> x = torch.randn(3, 2, 4, 7)
        >>> out, idx = wc.nn.WideAdaptiveMaxPool1d.from_modules(pools)(x)
        >>> torch.equal(idx[2], pools[2](x[2])[1])
        True
    """

    _base, _d = nn.AdaptiveMaxPool1d, 1


class WideAdaptiveMaxPool2d(_WideAdaptiveMaxPool):
    """N ``nn.AdaptiveMaxPool2d``: input ``[N, B, C, H, W]`` or ``[N, C, H, W]``."""

    _base, _d = nn.AdaptiveMaxPool2d, 2


class WideAdaptiveMaxPool3d(_WideAdaptiveMaxPool):
    """N ``nn.AdaptiveMaxPool3d``: input ``[N, B, C, D, H, W]`` or ``[N, C, D, H, W]``."""

    _base, _d = nn.AdaptiveMaxPool3d, 3
