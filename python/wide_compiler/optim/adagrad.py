"""Per-member Adagrad: one fused ``torch.ops.wide.adagrad_step`` per parameter tensor."""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch

from ._base import HParam, WideOptimizer, nonneg
from .adam import _step_dtype

__all__ = ["Adagrad"]


class Adagrad(WideOptimizer):
    """Adagrad, every hyperparameter per member (``initial_accumulator_value`` too).

    Member ``i`` is updated as ``torch.optim.Adagrad([p_i], lr=lr[i], lr_decay=lr_decay[i],
    weight_decay=weight_decay[i], initial_accumulator_value=..., eps=eps[i])`` would update it.
    As in torch.optim, the state (``step``, ``sum``) is created at construction.

    Example:
        >>> import torch, wide_compiler as wc
        >>> w = torch.nn.Parameter(torch.zeros(2, 3))
        >>> opt = wc.optim.Adagrad([w], lr=[0.1, 1.0])
        >>> w.grad = torch.full((2, 3), 2.0)
        >>> opt.step()
        >>> [round(x, 4) for x in w[:, 0].tolist()]      # -lr * g / sqrt(g^2)
        [-0.1, -1.0]
    """

    _hparams = ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps")
    _flags = ("maximize",)
    _rules: ClassVar[dict] = {"lr": (nonneg, "lr >= 0"), "lr_decay": (nonneg, "lr_decay >= 0"),
              "weight_decay": (nonneg, "weight_decay >= 0"), "eps": (nonneg, "eps >= 0"),
              "initial_accumulator_value": (nonneg, "initial_accumulator_value >= 0")}

    def __init__(self, params: Iterable, lr: HParam = 1e-2, lr_decay: HParam = 0.0,
                 weight_decay: HParam = 0.0, initial_accumulator_value: HParam = 0.0,
                 eps: HParam = 1e-10, *, maximize: bool = False, n: int | None = None) -> None:
        defaults = dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                        initial_accumulator_value=initial_accumulator_value, eps=eps,
                        maximize=maximize)
        super().__init__(params, defaults, n=n)
        for group in self.param_groups:
            self._init_state(group)

    def _init_state(self, group) -> None:
        for p in group["params"]:
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros(self.n, dtype=_step_dtype())
                init = group["initial_accumulator_value"].to(p.device, p.dtype)
                state["sum"] = init.view(-1, *([1] * (p.dim() - 1))).expand_as(p).contiguous()

    def add_param_group(self, param_group) -> None:
        super().add_param_group(param_group)
        if getattr(self, "state", None) is not None and len(self.param_groups) > 0:
            self._init_state(self.param_groups[-1])

    def _after_reset(self, member: int) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state.get(p)
                if st and "sum" in st:
                    st["sum"][member].fill_(float(group["initial_accumulator_value"][member]))

    def _step_param(self, p, group, prepared):
        state = self.state[p]
        torch.ops.wide.adagrad_step(
            p, p.grad, state["sum"], state["step"], group["lr"], group["lr_decay"],
            group["weight_decay"], group["eps"], maximize=group["maximize"])
