"""Wide normalisation modules: BatchNorm, InstanceNorm, GroupNorm, LayerNorm, RMSNorm."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from .. import functional as WF
from ..ops import WIDE_OPS
from ._common import (
    check_members,
    check_strategy,
    stack_buffer,
    stack_param,
    unstack_member,
)

__all__ = [
    "WideBatchNorm1d",
    "WideBatchNorm2d",
    "WideBatchNorm3d",
    "WideGroupNorm",
    "WideInstanceNorm1d",
    "WideInstanceNorm2d",
    "WideInstanceNorm3d",
    "WideLayerNorm",
    "WideRMSNorm",
]

_STATE = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")


class _WideNorm(nn.Module):
    """Stacked ``[N, ...]`` parameters/buffers of N norm modules plus a meta template holding the
    hyperparameters (for unfuse). ``strategy``: one of ``STRATEGIES``, the names the module's
    ``torch.ops.wide`` op accepts (``"auto"`` alone where the op has one implementation)."""

    _base: type[nn.Module]
    _attrs: tuple[str, ...] = ()
    STRATEGIES: tuple[str, ...] = ("auto",)

    def __init__(self, modules: Sequence[nn.Module], *, strategy: str = "auto") -> None:
        super().__init__()
        self.strategy = check_strategy(self, strategy)
        self.n = len(modules)
        object.__setattr__(self, "_template", copy.deepcopy(modules[0]).to("meta"))
        for name in _STATE:
            if name in modules[0]._parameters:
                self.register_parameter(name, stack_param(modules, name))
            elif name in modules[0]._buffers:
                self.register_buffer(name, stack_buffer(modules, name))
        self.train(modules[0].training)

    @classmethod
    def from_modules(cls, modules: Sequence[nn.Module], *, strategy: str = "auto"):
        """Stack N modules of one configuration (parameters and buffers copied)."""
        check_strategy(cls, strategy)
        return cls(check_members(modules, cls._base, cls._attrs + ("training",), cls.__name__), strategy=strategy)

    def unfuse(self) -> list[nn.Module]:
        """N ordinary modules with copies of the members' parameters and buffers."""
        ref = next(iter(self.parameters()), None)
        ref = ref if ref is not None else next(iter(self.buffers()), None)
        out = []
        for i in range(self.n):
            m = copy.deepcopy(self._template)
            if ref is not None:
                m = m.to_empty(device=ref.device)
                m = m.to(ref.dtype) if ref.is_floating_point() else m
            unstack_member(m, self, i, _STATE)
            out.append(m.train(self.training))
        return out

    def extra_repr(self) -> str:
        return f"n={self.n}, {self._template.extra_repr()}, strategy={self.strategy!r}"


class _WideBatchNorm(_WideNorm):
    _attrs = ("num_features", "eps", "momentum", "affine", "track_running_stats")
    _ranks: tuple[int, ...] = ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self._template
        if x.dim() - 1 not in self._ranks:
            raise ValueError(f"{type(self).__name__}: expected N-first input with {[r + 1 for r in self._ranks]} "
                             f"dims, got {list(x.shape)}")
        factor = 0.0
        if self.training and t.track_running_stats:
            self.num_batches_tracked.add_(1)
            factor = WF.batch_norm_factor(t.momentum, self.num_batches_tracked)
        use_batch = self.training or (self.running_mean is None and self.running_var is None)
        keep = not self.training or t.track_running_stats
        return WF.batch_norm(x, self.running_mean if keep else None, self.running_var if keep else None,
                             self.weight, self.bias, use_batch, factor, t.eps)


class WideBatchNorm1d(_WideBatchNorm):
    """N ``nn.BatchNorm1d`` as one batch norm over N*C channels; input ``[N, B, C]`` or
    ``[N, B, C, L]``; running statistics and ``num_batches_tracked`` per member.

    Example:
        >>> import torch, wide_compiler as wc
        >>> bns = [torch.nn.BatchNorm1d(4) for _ in range(3)]
        >>> wide = wc.nn.WideBatchNorm1d.from_modules(bns)
        >>> x = torch.randn(3, 8, 4)
        >>> y = wide(x)
        >>> torch.allclose(y[2], bns[2](x[2]), atol=1e-6)
        True
        >>> torch.allclose(wide.running_mean[2], bns[2].running_mean)
        True
    """

    _base, _ranks = nn.BatchNorm1d, (2, 3)


class WideBatchNorm2d(_WideBatchNorm):
    """N ``nn.BatchNorm2d``; input ``[N, B, C, H, W]`` (see :class:`WideBatchNorm1d`)."""

    _base, _ranks = nn.BatchNorm2d, (4,)


class WideBatchNorm3d(_WideBatchNorm):
    """N ``nn.BatchNorm3d``; input ``[N, B, C, D, H, W]``."""

    _base, _ranks = nn.BatchNorm3d, (5,)


class _WideInstanceNorm(_WideNorm):
    _attrs = ("num_features", "eps", "momentum", "affine", "track_running_stats")
    _d: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self._template
        return WF.instance_norm(x, getattr(self, "running_mean", None), getattr(self, "running_var", None),
                                self.weight, self.bias, self.training or not t.track_running_stats,
                                t.momentum if t.momentum is not None else 0.0, t.eps, spatial=self._d)


class WideInstanceNorm1d(_WideInstanceNorm):
    """N ``nn.InstanceNorm1d``; input ``[N, B, C, L]`` (or ``[N, C, L]``).

    Example:
        >>> import torch, wide_compiler as wc
        >>> ins = [torch.nn.InstanceNorm1d(3, affine=True) for _ in range(2)]
        >>> x = torch.randn(2, 4, 3, 7)
        >>> torch.allclose(wc.nn.WideInstanceNorm1d.from_modules(ins)(x)[1], ins[1](x[1]), atol=1e-6)
        True
    """

    _base, _d = nn.InstanceNorm1d, 1


class WideInstanceNorm2d(_WideInstanceNorm):
    """N ``nn.InstanceNorm2d``; input ``[N, B, C, H, W]``."""

    _base, _d = nn.InstanceNorm2d, 2


class WideInstanceNorm3d(_WideInstanceNorm):
    """N ``nn.InstanceNorm3d``; input ``[N, B, C, D, H, W]``."""

    _base, _d = nn.InstanceNorm3d, 3


class WideGroupNorm(_WideNorm):
    """N ``nn.GroupNorm`` as one group norm with N*num_groups groups; input ``[N, B, C, *]``.

    Example:
        >>> import torch, wide_compiler as wc
        >>> gns = [torch.nn.GroupNorm(2, 6) for _ in range(3)]
        >>> x = torch.randn(3, 4, 6, 5)
        >>> torch.allclose(wc.nn.WideGroupNorm.from_modules(gns)(x)[0], gns[0](x[0]), atol=1e-6)
        True
    """

    _base = nn.GroupNorm
    _attrs = ("num_groups", "num_channels", "eps", "affine")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self._template
        return WF.group_norm(x, t.num_groups, self.weight, self.bias, t.eps)


class WideLayerNorm(_WideNorm):
    """N ``nn.LayerNorm`` (any normalized_shape, elementwise_affine, bias); N-first in and out.
    ``strategy``: ``"auto"``, ``"fused"`` (one norm over all members) or ``"loop"`` (one per member).

    Example:
        >>> import torch, wide_compiler as wc
        >>> lns = [torch.nn.LayerNorm([4, 5], bias=False) for _ in range(3)]
        >>> x = torch.randn(3, 2, 4, 5)
        >>> torch.allclose(wc.nn.WideLayerNorm.from_modules(lns)(x)[1], lns[1](x[1]), atol=1e-6)
        True
    """

    _base = nn.LayerNorm
    _attrs = ("normalized_shape", "eps", "elementwise_affine", "bias")
    STRATEGIES = WIDE_OPS["layer_norm"].choices

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self._template
        return WF.layer_norm(x, t.normalized_shape, self.weight, self.bias, t.eps, strategy=self.strategy)


class WideRMSNorm(_WideNorm):
    """N ``nn.RMSNorm``; N-first in and out.

    Example:
        >>> import torch, wide_compiler as wc
        >>> rms = [torch.nn.RMSNorm(6) for _ in range(2)]
        >>> x = torch.randn(2, 3, 6)
        >>> torch.allclose(wc.nn.WideRMSNorm.from_modules(rms)(x)[0], rms[0](x[0]), atol=1e-6)
        True
    """

    _base = nn.RMSNorm
    _attrs = ("normalized_shape", "eps", "elementwise_affine")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self._template
        return WF.rms_norm(x, t.normalized_shape, self.weight, t.eps)
