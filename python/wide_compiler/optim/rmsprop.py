"""Per-member RMSprop: one fused ``torch.ops.wide.rmsprop_step`` per parameter tensor."""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch

from ._base import HParam, WideOptimizer, nonneg, zeros_state
from .adam import _step_dtype

__all__ = ["RMSprop"]


class RMSprop(WideOptimizer):
    """RMSprop (optionally centered, with momentum), every hyperparameter per member.

    Member ``i`` is updated as ``torch.optim.RMSprop([p_i], lr=lr[i], alpha=alpha[i], eps=eps[i],
    weight_decay=weight_decay[i], momentum=momentum[i], centered=centered)`` would update it alone.
    A member whose momentum is 0 takes the plain update (the momentum buffer exists when any
    member has momentum > 0).

    Example:
        >>> import torch, wide_compiler as wc
        >>> w = torch.nn.Parameter(torch.zeros(2, 3))
        >>> opt = wc.optim.RMSprop([w], lr=[0.01, 0.001], alpha=0.99)
        >>> w.grad = torch.ones(2, 3)
        >>> opt.step()
        >>> [round(x, 4) for x in w[:, 0].tolist()]      # -lr / sqrt(1 - alpha)
        [-0.1, -0.01]
    """

    _hparams = ("lr", "alpha", "eps", "weight_decay", "momentum")
    _flags = ("centered", "maximize")
    _rules: ClassVar[dict] = {"lr": (nonneg, "lr >= 0"), "alpha": (nonneg, "alpha >= 0"),
              "eps": (nonneg, "eps >= 0"), "weight_decay": (nonneg, "weight_decay >= 0"),
              "momentum": (nonneg, "momentum >= 0")}

    def __init__(self, params: Iterable, lr: HParam = 1e-2, alpha: HParam = 0.99,
                 eps: HParam = 1e-8, weight_decay: HParam = 0.0, momentum: HParam = 0.0,
                 centered: bool = False, *, maximize: bool = False, n: int | None = None) -> None:
        defaults = dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum,
                        centered=centered, maximize=maximize)
        super().__init__(params, defaults, n=n)

    def _member_state_absent(self, group, member):
        return {"momentum_buffer"} if float(group["momentum"][member]) <= 0 else set()

    def _prepare_group(self, group):
        return bool((group["momentum"] > 0).any())

    def _step_param(self, p, group, use_buffer):
        centered = group["centered"]
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros(self.n, dtype=_step_dtype())
            state["square_avg"] = zeros_state(p)
        if use_buffer and "momentum_buffer" not in state:
            state["momentum_buffer"] = zeros_state(p)
        if centered and "grad_avg" not in state:
            state["grad_avg"] = zeros_state(p)
        torch.ops.wide.rmsprop_step(
            p, p.grad, state["square_avg"], state["grad_avg"] if centered else None,
            state["momentum_buffer"] if use_buffer else None, state["step"], group["lr"],
            group["alpha"], group["eps"], group["weight_decay"], group["momentum"],
            centered=centered, maximize=group["maximize"])
