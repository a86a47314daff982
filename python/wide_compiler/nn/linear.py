"""WideLinear: N independent ``nn.Linear`` layers as one module over ``torch.ops.wide.linear``."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from .. import functional as WF
from ..errors import ArchitectureMismatchError
from ..ops import WIDE_OPS
from ._common import check_strategy

__all__ = ["WideLinear"]


class WideLinear(nn.Module):
    """N linear layers of the same shape evaluated as one batched GEMM.

    Member ``i`` computes ``x[i] @ weight[i].T + bias[i]``. Input is N-first ``[N, B, *, in]``; a
    shared input ``x.expand(N, *x.shape)`` takes the one-GEMM shared path.

    Args:
        n: number of members.
        in_features, out_features, bias: as ``nn.Linear``.
        strategy: ``"auto"``, ``"bmm"``, ``"bmm_t"`` or ``"loop"`` (see ``torch.ops.wide.linear``).

    Example:
        >>> import torch, wide_compiler as wc
        >>> layers = [torch.nn.Linear(4, 3) for _ in range(5)]
        >>> wide = wc.nn.WideLinear.from_modules(layers)
        >>> x = torch.randn(5, 2, 4)
        >>> torch.allclose(wide(x)[1], layers[1](x[1]), atol=1e-6)
        True
        >>> back = wide.unfuse()
        >>> torch.equal(back[1].weight, layers[1].weight)
        True
    """

    STRATEGIES = WIDE_OPS["linear"].choices  # ("auto", "bmm", "bmm_t", "loop")

    def __init__(self, n: int, in_features: int, out_features: int, bias: bool = True, *,
                 strategy: str = "auto", device=None, dtype=None) -> None:
        super().__init__()
        if n < 1:
            raise ValueError(f"WideLinear: expected n >= 1 members, got {n}")
        check_strategy(self, strategy)
        factory = {"device": device, "dtype": dtype}
        self.n = n
        self.in_features = in_features
        self.out_features = out_features
        self.strategy = strategy
        self.weight = nn.Parameter(torch.empty(n, out_features, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(n, out_features, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each member initialised as ``nn.Linear`` would be: U(-1/sqrt(in), 1/sqrt(in))."""
        bound = 1.0 / math.sqrt(self.in_features) if self.in_features > 0 else 0.0
        with torch.no_grad():
            self.weight.uniform_(-bound, bound)
            if self.bias is not None:
                self.bias.uniform_(-bound, bound)

    @classmethod
    def from_modules(cls, modules: Sequence[nn.Linear], *, strategy: str = "auto") -> WideLinear:
        """Stack the weights of ``modules`` (copied) into one WideLinear."""
        check_strategy(cls, strategy)
        modules = list(modules)
        if not modules:
            raise ValueError("WideLinear.from_modules: expected at least one nn.Linear, got none")
        first = modules[0]
        for i, m in enumerate(modules):
            if not isinstance(m, nn.Linear):
                raise ArchitectureMismatchError(f"member {i}: expected nn.Linear, got {type(m).__name__}")
            for what, a, b in (
                ("in_features", m.in_features, first.in_features),
                ("out_features", m.out_features, first.out_features),
                ("bias", m.bias is not None, first.bias is not None),
                ("weight.dtype", m.weight.dtype, first.weight.dtype),
                ("weight.device", m.weight.device, first.weight.device),
            ):
                if a != b:
                    raise ArchitectureMismatchError(f"member {i}: {what} is {a}, member 0 has {b}")
        wide = cls(len(modules), first.in_features, first.out_features, first.bias is not None,
                   strategy=strategy, device="meta")
        with torch.no_grad():
            wide.weight = nn.Parameter(torch.stack([m.weight.detach() for m in modules]))
            if first.bias is not None:
                wide.bias = nn.Parameter(torch.stack([m.bias.detach() for m in modules]))
        return wide

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return WF.linear(x, self.weight, self.bias, strategy=self.strategy)

    def unfuse(self) -> list[nn.Linear]:
        """N ordinary ``nn.Linear`` modules holding copies of the members' weights."""
        out = []
        for i in range(self.n):
            m = nn.Linear(self.in_features, self.out_features, self.bias is not None,
                          device=self.weight.device, dtype=self.weight.dtype)
            with torch.no_grad():
                m.weight.copy_(self.weight[i])
                if self.bias is not None:
                    m.bias.copy_(self.bias[i])
            out.append(m)
        return out

    def extra_repr(self) -> str:
        return (f"n={self.n}, in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, strategy={self.strategy!r}")
