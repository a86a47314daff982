"""WideConv{1,2,3}d and WideConvTranspose{1,2,3}d over ``torch.ops.wide.conv`` /
``torch.ops.wide.conv_transpose``."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from .. import functional as WF
from ..ops import WIDE_OPS
from ._common import check_members, check_strategy, stack_param, unstack_member

__all__ = ["WideConv1d", "WideConv2d", "WideConv3d", "WideConvTranspose1d", "WideConvTranspose2d",
           "WideConvTranspose3d"]

_ATTRS = ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups",
          "padding_mode", "output_padding", "transposed", "weight", "bias")


class _WideConvNd(nn.Module):
    """N convolutions of one shape as one grouped convolution (see Note [wide::conv strategies])."""

    _base: type[nn.Module]
    _d: int
    STRATEGIES = WIDE_OPS["conv"].choices  # wide::conv and wide::conv_transpose offer the same

    def __init__(self, template: nn.Module, weight: nn.Parameter, bias: nn.Parameter | None, *,
                 strategy: str = "auto") -> None:
        super().__init__()
        self.n = weight.shape[0]
        self.strategy = check_strategy(self, strategy)
        # Hyperparameters only (meta tensors, never run on data); hidden from state_dict and .to().
        object.__setattr__(self, "_template", copy.deepcopy(template).to("meta"))
        self.weight = weight
        self.bias = bias

    @classmethod
    def from_modules(cls, modules: Sequence[nn.Module], *, strategy: str = "auto"):
        """Stack the weights of N ``nn.Conv*`` modules of one configuration (copied)."""
        check_strategy(cls, strategy)
        modules = check_members(modules, cls._base, _ATTRS, cls.__name__)
        return cls(modules[0], stack_param(modules, "weight"), stack_param(modules, "bias"), strategy=strategy)

    def unfuse(self) -> list[nn.Module]:
        """N ordinary modules holding copies of the members' weights."""
        out = []
        for i in range(self.n):
            m = copy.deepcopy(self._template).to_empty(device=self.weight.device).to(self.weight.dtype)
            unstack_member(m, self, i, ("weight", "bias"))
            out.append(m)
        return out

    def extra_repr(self) -> str:
        return f"n={self.n}, {self._template.extra_repr()}, strategy={self.strategy!r}"


class _WideConv(_WideConvNd):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self._template
        return WF.conv(x, self.weight, self.bias, t.stride, t.padding, t.dilation, t.groups,
                       padding_mode=t.padding_mode, strategy=self.strategy)


class _WideConvTranspose(_WideConvNd):
    def forward(self, x: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        t = self._template
        output_padding = t._output_padding(x[0], output_size, t.stride, t.padding, t.kernel_size,
                                           self._d, t.dilation)
        return WF.conv_transpose(x, self.weight, self.bias, t.stride, t.padding, output_padding, t.groups,
                                 t.dilation, strategy=self.strategy)


class WideConv1d(_WideConv):
    """N ``nn.Conv1d`` as one op. Input N-first ``[N, B, C_in, L]``; a shared input
    ``x.expand(N, ...)`` runs as ONE conv with N*C_out filters.

    Example:
        >>> import torch, wide_compiler as wc
        >>> convs = [torch.nn.Conv1d(2, 4, 3, padding='same') for _ in range(3)]
        >>> wide = wc.nn.WideConv1d.from_modules(convs)
        >>> x = torch.randn(3, 5, 2, 8)
        >>> torch.allclose(wide(x)[1], convs[1](x[1]), atol=1e-6)
        True
    """

    _base, _d = nn.Conv1d, 1


class WideConv2d(_WideConv):
    """N ``nn.Conv2d`` as one grouped conv (strategy ``"auto"``, ``"grouped"``, ``"grouped_cl"`` or ``"loop"``).

    Example:
        >>> import torch, wide_compiler as wc
        >>> convs = [torch.nn.Conv2d(3, 8, 3, padding=1, padding_mode='reflect') for _ in range(4)]
        >>> wide = wc.nn.WideConv2d.from_modules(convs)
        >>> x = torch.randn(4, 2, 3, 10, 10)
        >>> torch.allclose(wide(x)[3], convs[3](x[3]), atol=1e-5)
        True
        >>> torch.equal(wide.unfuse()[2].weight, convs[2].weight)
        True
    """

    _base, _d = nn.Conv2d, 2


class WideConv3d(_WideConv):
    """N ``nn.Conv3d`` as one op; input ``[N, B, C_in, D, H, W]``."""

    _base, _d = nn.Conv3d, 3


class WideConvTranspose1d(_WideConvTranspose):
    """N ``nn.ConvTranspose1d`` as one op; ``forward(x, output_size=None)`` as the original."""

    _base, _d = nn.ConvTranspose1d, 1


class WideConvTranspose2d(_WideConvTranspose):
    """N ``nn.ConvTranspose2d`` as one op.

    Example:
        >>> import torch, wide_compiler as wc
        >>> ups = [torch.nn.ConvTranspose2d(4, 2, 4, stride=2, padding=1) for _ in range(3)]
        >>> wide = wc.nn.WideConvTranspose2d.from_modules(ups)
        >>> x = torch.randn(3, 2, 4, 5, 5)
        >>> torch.allclose(wide(x)[0], ups[0](x[0]), atol=1e-5)
        True
    """

    _base, _d = nn.ConvTranspose2d, 2


class WideConvTranspose3d(_WideConvTranspose):
    """N ``nn.ConvTranspose3d`` as one op."""

    _base, _d = nn.ConvTranspose3d, 3
