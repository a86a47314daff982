"""Per-member SGD: one fused ``torch.ops.wide.sgd_step`` per parameter tensor."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from ._base import HParam, WideOptimizer, first_member, nonneg, zeros_state

__all__ = ["SGD"]


class SGD(WideOptimizer):
    """SGD with momentum, dampening, Nesterov and weight decay, every hyperparameter per member.

    Member ``i`` of every ``[N, ...]`` parameter is updated exactly as
    ``torch.optim.SGD([p_i], lr=lr[i], momentum=momentum[i], ...)`` would update it alone
    (fp32 results are bit-identical on AVX2/AVX512 CPUs). ``lr``, ``momentum``, ``dampening`` and
    ``weight_decay`` are each a float (shared) or N values (a sequence or a tensor ``[N]``);
    ``nesterov`` and ``maximize`` are shared flags. A member whose momentum is 0 uses plain SGD.

    Args:
        params: ``[N, ...]`` tensors (dim 0 is the member dim) or param group dicts.
        n: number of members; default: dim 0 of the first parameter.

    Example:
        >>> import torch, wide_compiler as wc
        >>> w = torch.nn.Parameter(torch.ones(4, 3))           # 4 members of a 3-vector
        >>> opt = wc.optim.SGD([w], lr=[0.1, 0.2, 0.3, 0.4], momentum=0.9)
        >>> w.grad = torch.ones(4, 3)
        >>> opt.step()
        >>> w[:, 0].tolist()
        [0.8999999761581421, 0.800000011920929, 0.699999988079071, 0.6000000238418579]
    """

    _hparams = ("lr", "momentum", "dampening", "weight_decay")
    _flags = ("nesterov", "maximize")
    _rules: ClassVar[dict] = {"lr": (nonneg, "lr >= 0"), "momentum": (nonneg, "momentum >= 0"),
              "weight_decay": (nonneg, "weight_decay >= 0"),
              "dampening": (lambda t: torch.isfinite(t), "a finite dampening")}

    def __init__(self, params: Iterable, lr: HParam = 1e-3, momentum: HParam = 0.0,
                 dampening: HParam = 0.0, weight_decay: HParam = 0.0, nesterov: bool = False, *,
                 maximize: bool = False, n: int | None = None) -> None:
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize)
        super().__init__(params, defaults, n=n)

    def _check_group(self, group: dict[str, Any]) -> None:
        if group.get("nesterov"):
            i = first_member((group["momentum"] <= 0) | (group["dampening"] != 0))
            if i is not None:
                raise ValueError(
                    f"{self._name}: nesterov momentum requires momentum > 0 and dampening == 0 for "
                    f"every member; member {i} has momentum {group['momentum'][i].item()} and "
                    f"dampening {group['dampening'][i].item()}")

    def _member_state_absent(self, group, member):
        return {"momentum_buffer"} if float(group["momentum"][member]) == 0 else set()

    def _prepare_group(self, group):
        return bool((group["momentum"] != 0).any())  # like torch.optim: no state without momentum

    def _step_param(self, p, group, use_buffer):
        buf, init = None, False
        if use_buffer:
            state = self.state[p]
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = zeros_state(p)
                init = True
        torch.ops.wide.sgd_step(
            p, p.grad, buf, group["lr"], group["weight_decay"],
            group["momentum"], group["dampening"], nesterov=group["nesterov"],
            maximize=group["maximize"], init_buffer=init)
