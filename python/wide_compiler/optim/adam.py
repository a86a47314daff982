"""Per-member Adam and AdamW: one fused ``torch.ops.wide.adam_step`` per parameter tensor."""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch

from ._base import HParam, WideOptimizer, in_unit, nonneg, zeros_state

__all__ = ["Adam", "AdamW"]


class Adam(WideOptimizer):
    """Adam (optionally AMSGrad), every hyperparameter per member.

    Member ``i`` of every ``[N, ...]`` parameter is updated as
    ``torch.optim.Adam([p_i], lr=lr[i], betas=(beta1[i], beta2[i]), eps=eps[i],
    weight_decay=weight_decay[i], amsgrad=amsgrad, maximize=maximize)`` would update it alone,
    bias corrections included (fp32: within 1e-6 relative). ``lr``, ``eps``, ``weight_decay`` and
    each of ``betas`` are a float or N values; ``amsgrad``/``maximize`` are shared flags. State per
    parameter: ``step`` (float32 ``[N]``), ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``.

    Example:
        >>> import torch, wide_compiler as wc
        >>> w = torch.nn.Parameter(torch.zeros(3, 2))
        >>> opt = wc.optim.Adam([w], lr=[0.1, 0.01, 0.001], betas=(0.9, [0.99, 0.999, 0.9999]))
        >>> w.grad = torch.ones(3, 2)
        >>> opt.step()
        >>> [round(x, 6) for x in w[:, 0].tolist()]     # the first Adam step is -lr * sign(grad)
        [-0.1, -0.01, -0.001]
    """

    _hparams = ("lr", "eps", "weight_decay")
    _pairs = ("betas",)
    _flags = ("amsgrad", "maximize")
    _rules: ClassVar[dict] = {"lr": (nonneg, "lr >= 0"), "eps": (nonneg, "eps >= 0"),
              "weight_decay": (nonneg, "weight_decay >= 0"),
              "betas[0]": (in_unit, "0 <= beta1 < 1"), "betas[1]": (in_unit, "0 <= beta2 < 1")}
    _decoupled = False

    def __init__(self, params: Iterable, lr: HParam = 1e-3,
                 betas: tuple[HParam, HParam] = (0.9, 0.999), eps: HParam = 1e-8,
                 weight_decay: HParam = 0.0, amsgrad: bool = False, *, maximize: bool = False,
                 n: int | None = None) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize)
        super().__init__(params, defaults, n=n)

    def _step_param(self, p, group, prepared):
        beta1, beta2 = group["betas"]
        amsgrad = group["amsgrad"]
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros(self.n, dtype=_step_dtype())
            state["exp_avg"] = zeros_state(p)
            state["exp_avg_sq"] = zeros_state(p)
        if amsgrad and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = zeros_state(p)
        torch.ops.wide.adam_step(
            p, p.grad, state["exp_avg"], state["exp_avg_sq"],
            state["max_exp_avg_sq"] if amsgrad else None, state["step"], group["lr"],
            beta1, beta2, group["eps"], group["weight_decay"],
            decoupled_weight_decay=self._decoupled, amsgrad=amsgrad,
            maximize=group["maximize"])


class AdamW(Adam):
    """AdamW: :class:`Adam` with decoupled weight decay (``param *= 1 - lr * weight_decay``),
    every hyperparameter per member; matches ``torch.optim.AdamW`` per member (default
    ``weight_decay=1e-2`` as there).

    Example:
        >>> import torch, wide_compiler as wc
        >>> w = torch.nn.Parameter(torch.ones(2, 3))
        >>> opt = wc.optim.AdamW([w], lr=0.1, weight_decay=[0.0, 0.5])
        >>> w.grad = torch.zeros(2, 3)
        >>> opt.step()
        >>> [round(x, 4) for x in w[:, 0].tolist()]
        [1.0, 0.95]
    """

    _decoupled = True

    def __init__(self, params: Iterable, lr: HParam = 1e-3,
                 betas: tuple[HParam, HParam] = (0.9, 0.999), eps: HParam = 1e-8,
                 weight_decay: HParam = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 n: int | None = None) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize, n=n)


def _step_dtype() -> torch.dtype:
    # torch.optim keeps `step` in float32 (float64 when that is the default dtype).
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
