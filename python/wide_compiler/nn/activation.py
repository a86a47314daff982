"""WidePReLU over ``torch.ops.wide.prelu``."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .. import functional as WF
from ..ops import WIDE_OPS
from ._common import check_members, check_strategy, stack_param

__all__ = ["WidePReLU"]


class WidePReLU(nn.Module):
    """N ``nn.PReLU`` (1 or C slopes per member) as one PReLU over the packed channels; input
    N-first ``[N, B, C, *]`` (or ``[N, C]`` for unbatched members), output N-first.

    Example:
        >>> import torch, wide_compiler as wc
        >>> acts = [torch.nn.PReLU(3, init=0.1 * (i + 1)) for i in range(4)]
        >>> wide = wc.nn.WidePReLU.from_modules(acts)
        >>> x = torch.randn(4, 2, 3, 5)
        >>> torch.allclose(wide(x)[3], acts[3](x[3]))
        True
    """

    STRATEGIES = WIDE_OPS["prelu"].choices  # one implementation: ("auto",)

    def __init__(self, weight: nn.Parameter, *, strategy: str = "auto") -> None:
        super().__init__()
        self.strategy = check_strategy(self, strategy)
        self.n, self.num_parameters = weight.shape
        self.weight = weight

    @classmethod
    def from_modules(cls, modules: Sequence[nn.PReLU], *, strategy: str = "auto") -> WidePReLU:
        """Stack the slopes of N ``nn.PReLU`` with the same num_parameters (copied)."""
        check_strategy(cls, strategy)
        modules = check_members(modules, nn.PReLU, ("num_parameters", "weight"), cls.__name__)
        return cls(stack_param(modules, "weight"), strategy=strategy)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return WF.prelu(x, self.weight)

    def unfuse(self) -> list[nn.PReLU]:
        """N ordinary ``nn.PReLU`` with copies of the members' slopes."""
        out = []
        for i in range(self.n):
            m = nn.PReLU(self.num_parameters, device=self.weight.device, dtype=self.weight.dtype)
            with torch.no_grad():
                m.weight.copy_(self.weight[i])
            out.append(m)
        return out

    def extra_repr(self) -> str:
        return f"n={self.n}, num_parameters={self.num_parameters}, strategy={self.strategy!r}"
