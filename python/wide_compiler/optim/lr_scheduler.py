"""Per-member learning-rate schedules for :mod:`wide_compiler.optim` optimizers.

Each scheduler gives member ``i`` the learning rate that the ``torch.optim.lr_scheduler`` of the
same name gives a single model with member ``i``'s settings, and every scheduler hyperparameter
(``gamma``, ``step_size``, ``T_max``, ``eta_min``, ``max_lr``, ``pct_start``, ``factor``,
``patience``...) may be one value or N values. Learning rates are computed in closed form in
float64 from the base learning rates (``group["initial_lr"]``); torch's chained forms agree to
~1e-16 relative. Usage is torch's: ``optimizer.step()`` then ``scheduler.step()``.

Example:
    >>> import torch, wide_compiler as wc
    >>> w = torch.nn.Parameter(torch.zeros(3, 2))
    >>> opt = wc.optim.SGD([w], lr=[1.0, 0.5, 0.1])
    >>> sched = wc.optim.lr_scheduler.StepLR(opt, step_size=[1, 2, 3], gamma=0.5)
    >>> for _ in range(3):
    ...     opt.step(); sched.step()
    >>> sched.get_last_lr()[0].tolist()
    [0.125, 0.25, 0.05]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ._base import WideOptimizer, first_member, per_member

__all__ = [
    "CosineAnnealingLR",
    "ExponentialLR",
    "LinearLR",
    "MultiStepLR",
    "OneCycleLR",
    "ReduceLROnPlateau",
    "StepLR",
    "WideLRScheduler",
]


def _members(sched, optimizer) -> int:
    if not isinstance(optimizer, WideOptimizer):
        raise TypeError(f"{type(sched).__name__}: expected a wide_compiler.optim optimizer (per-member "
                        f"hyperparameters), got {type(optimizer).__name__}")
    return optimizer.n


def _hp(sched, value, name, *, integer=False, positive=False, nonneg=False) -> torch.Tensor:
    t = per_member(value, sched.n, what=f"wide_compiler.optim.lr_scheduler.{type(sched).__name__}: {name}")
    if integer and not torch.equal(t, t.round()):
        raise ValueError(f"{type(sched).__name__}: {name} must be integers, got {t.tolist()}")
    i = first_member((t <= 0) if positive else (t < 0) if nonneg else torch.zeros_like(t, dtype=torch.bool))
    if i is not None:
        raise ValueError(f"{type(sched).__name__}: invalid {name} {t[i].item()} for member {i}; "
                         f"expected {'> 0' if positive else '>= 0'}")
    return t


class WideLRScheduler:
    """Base: per-member learning rates ``[N]`` per param group, computed by ``_lr(base, epoch)``.

    ``base_lrs[g]`` (a tensor ``[N]``) is param group g's ``initial_lr``; change one member's
    entry to restart its schedule from a new base (population-based training).
    """

    def __init__(self, optimizer: WideOptimizer, last_epoch: int = -1) -> None:
        if not isinstance(optimizer, WideOptimizer):
            raise TypeError(f"{type(self).__name__}: expected a wide_compiler.optim optimizer (per-member "
                            f"hyperparameters), got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.n = _members(self, optimizer)
        if last_epoch == -1:
            for g in optimizer.param_groups:
                g.setdefault("initial_lr", g["lr"].clone())
        elif any("initial_lr" not in g for g in optimizer.param_groups):
            raise KeyError(f"{type(self).__name__}: param 'initial_lr' is not specified in every "
                           f"param group when resuming (last_epoch={last_epoch})")
        self.base_lrs = [g["initial_lr"] for g in optimizer.param_groups]
        self.last_epoch = last_epoch
        self._last_lr: list[torch.Tensor] = []
        self.step()

    def _lr(self, group: int, base: torch.Tensor, epoch: int) -> torch.Tensor:
        raise NotImplementedError

    def get_lr(self) -> list[torch.Tensor]:
        """The learning rates ``[N]`` of every param group at the current epoch."""
        return [self._lr(k, base, self.last_epoch) for k, base in enumerate(self.base_lrs)]

    def step(self) -> None:
        """Advance one epoch (or iteration) and set every group's per-member learning rates."""
        self.last_epoch += 1
        lrs = self.get_lr()
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr
        self._last_lr = [lr.clone() for lr in lrs]

    def get_last_lr(self) -> list[torch.Tensor]:
        """The learning rates ``[N]`` per param group set by the last ``step()``."""
        return self._last_lr

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "optimizer"}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume: the schedule's position and the learning rates it last set, which are written
        back into the optimizer (constructing the scheduler reset them to the base rates)."""
        self.__dict__.update(state_dict)
        for g, lr in zip(self.optimizer.param_groups, self._last_lr):
            g["lr"] = lr.clone()


class StepLR(WideLRScheduler):
    """``lr = base * gamma ** (epoch // step_size)`` per member (``step_size``, ``gamma``: one
    value or N)."""

    def __init__(self, optimizer, step_size, gamma=0.1, last_epoch: int = -1) -> None:
        self.n = _members(self, optimizer)
        self.step_size = _hp(self, step_size, "step_size", integer=True, positive=True)
        self.gamma = _hp(self, gamma, "gamma")
        super().__init__(optimizer, last_epoch)

    def _lr(self, group, base, epoch):
        return base * self.gamma ** torch.div(epoch, self.step_size, rounding_mode="floor")


class MultiStepLR(WideLRScheduler):
    """``lr = base * gamma ** (number of milestones <= epoch)``; ``milestones`` is one list for
    all members or N lists (one per member)."""

    def __init__(self, optimizer, milestones: Sequence[int] | Sequence[Sequence[int]], gamma=0.1,
                 last_epoch: int = -1) -> None:
        self.n = _members(self, optimizer)
        ms = list(milestones)
        if ms and all(isinstance(m, (list, tuple)) for m in ms):
            if len(ms) != self.n:
                raise ValueError(f"MultiStepLR: got {len(ms)} milestone lists but there are N={self.n} "
                                 f"members; pass one list for all or one per member")
            self.milestones = [sorted(int(x) for x in m) for m in ms]
        else:
            self.milestones = [sorted(int(x) for x in ms)] * self.n
        self.gamma = _hp(self, gamma, "gamma")
        super().__init__(optimizer, last_epoch)

    def _lr(self, group, base, epoch):
        import bisect
        count = torch.tensor([bisect.bisect_right(m, epoch) for m in self.milestones], dtype=torch.float64)
        return base * self.gamma ** count


class ExponentialLR(WideLRScheduler):
    """``lr = base * gamma ** epoch`` per member."""

    def __init__(self, optimizer, gamma, last_epoch: int = -1) -> None:
        self.n = _members(self, optimizer)
        self.gamma = _hp(self, gamma, "gamma")
        super().__init__(optimizer, last_epoch)

    def _lr(self, group, base, epoch):
        return base * self.gamma ** epoch


class CosineAnnealingLR(WideLRScheduler):
    """``lr = eta_min + (base - eta_min) * (1 + cos(pi * epoch / T_max)) / 2`` per member
    (``T_max``, ``eta_min``: one value or N)."""

    def __init__(self, optimizer, T_max, eta_min=0.0, last_epoch: int = -1) -> None:
        self.n = _members(self, optimizer)
        self.T_max = _hp(self, T_max, "T_max", positive=True)
        self.eta_min = _hp(self, eta_min, "eta_min", nonneg=True)
        super().__init__(optimizer, last_epoch)

    def _lr(self, group, base, epoch):
        return self.eta_min + (base - self.eta_min) * (1 + torch.cos(math.pi * epoch / self.T_max)) / 2


class LinearLR(WideLRScheduler):
    """Linear warm-up (or decay): the factor goes from ``start_factor`` to ``end_factor`` over
    ``total_iters`` steps, then stays; all three may be per member."""

    def __init__(self, optimizer, start_factor=1.0 / 3, end_factor=1.0, total_iters=5,
                 last_epoch: int = -1) -> None:
        self.n = _members(self, optimizer)
        self.start_factor = _hp(self, start_factor, "start_factor", positive=True)
        self.end_factor = _hp(self, end_factor, "end_factor", nonneg=True)
        self.total_iters = _hp(self, total_iters, "total_iters", integer=True, positive=True)
        if (self.start_factor > 1).any() or (self.end_factor > 1).any():
            raise ValueError("LinearLR: start_factor and end_factor must be in (0, 1] and [0, 1]")
        super().__init__(optimizer, last_epoch)

    def _lr(self, group, base, epoch):
        e = torch.clamp(torch.full_like(self.total_iters, float(epoch)), max=self.total_iters)
        return base * (self.start_factor + (self.end_factor - self.start_factor) * e / self.total_iters)


class OneCycleLR(WideLRScheduler):
    """The 1cycle policy (torch.optim.lr_scheduler.OneCycleLR) per member: ``max_lr``,
    ``pct_start``, ``div_factor``, ``final_div_factor``, ``base_momentum`` and ``max_momentum``
    may each be per member; ``total_steps`` (or ``epochs * steps_per_epoch``), ``anneal_strategy``
    and ``three_phase`` are shared. With ``cycle_momentum`` the momentum (SGD, RMSprop) or
    beta1 (Adam, AdamW) cycles inversely to the learning rate."""

    def __init__(self, optimizer, max_lr, total_steps: int | None = None, epochs: int | None = None,
                 steps_per_epoch: int | None = None, pct_start=0.3, anneal_strategy: str = "cos",
                 cycle_momentum: bool = True, base_momentum=0.85, max_momentum=0.95,
                 div_factor=25.0, final_div_factor=1e4, three_phase: bool = False,
                 last_epoch: int = -1) -> None:
        self.n = _members(self, optimizer)
        if total_steps is None:
            if epochs is None or steps_per_epoch is None:
                raise ValueError("OneCycleLR: give total_steps, or epochs and steps_per_epoch")
            total_steps = epochs * steps_per_epoch
        if total_steps <= 0:
            raise ValueError(f"OneCycleLR: expected total_steps > 0, got {total_steps}")
        if anneal_strategy not in ("cos", "linear"):
            raise ValueError(f"OneCycleLR: anneal_strategy must be 'cos' or 'linear', got {anneal_strategy!r}")
        self.total_steps = int(total_steps)
        self.anneal_strategy = anneal_strategy
        self.three_phase = three_phase
        self.pct_start = _hp(self, pct_start, "pct_start")
        if ((self.pct_start < 0) | (self.pct_start > 1)).any():
            raise ValueError(f"OneCycleLR: pct_start must be in [0, 1], got {self.pct_start.tolist()}")
        max_lr_t = _hp(self, max_lr, "max_lr", nonneg=True)
        div = _hp(self, div_factor, "div_factor", positive=True)
        final_div = _hp(self, final_div_factor, "final_div_factor", positive=True)
        self.cycle_momentum = cycle_momentum
        groups = optimizer.param_groups
        if cycle_momentum:
            if "momentum" not in optimizer.defaults and "betas" not in optimizer.defaults:
                raise ValueError("OneCycleLR: cycle_momentum=True needs an optimizer with momentum or betas")
            self.use_beta1 = "betas" in optimizer.defaults
            self.base_momentum = _hp(self, base_momentum, "base_momentum", nonneg=True)
            self.max_momentum = _hp(self, max_momentum, "max_momentum", nonneg=True)
        if last_epoch == -1:
            for g in groups:
                g["initial_lr"] = max_lr_t / div
                g["max_lr"] = max_lr_t.clone()
                g["min_lr"] = g["initial_lr"] / final_div
                if cycle_momentum:
                    self._set_momentum(g, self.max_momentum)
        super().__init__(optimizer, last_epoch)

    def _set_momentum(self, g, m):
        if self.use_beta1:
            g["betas"] = (m.clone(), g["betas"][1])
        else:
            g["momentum"] = m.clone()

    def _phases(self, g):
        t, pct = self.total_steps, self.pct_start
        if self.three_phase:
            return [(pct * t - 1, g["initial_lr"], g["max_lr"], self.max_momentum, self.base_momentum),
                    (2 * pct * t - 2, g["max_lr"], g["initial_lr"], self.base_momentum, self.max_momentum),
                    (torch.full_like(pct, t - 1.0), g["initial_lr"], g["min_lr"], self.max_momentum, self.max_momentum)]
        return [(pct * t - 1, g["initial_lr"], g["max_lr"], self.max_momentum if self.cycle_momentum else None,
                 self.base_momentum if self.cycle_momentum else None),
                (torch.full_like(pct, t - 1.0), g["max_lr"], g["min_lr"],
                 self.base_momentum if self.cycle_momentum else None, self.max_momentum if self.cycle_momentum else None)]

    def _anneal(self, start, end, pct):
        if self.anneal_strategy == "cos":
            return end + (start - end) / 2.0 * (torch.cos(math.pi * pct) + 1)
        return (end - start) * pct + start

    def _compute(self, g, step):
        lr = torch.zeros(self.n, dtype=torch.float64)
        mom = torch.zeros(self.n, dtype=torch.float64)
        done = torch.zeros(self.n, dtype=torch.bool)
        start = torch.zeros(self.n, dtype=torch.float64)
        phases = self._phases(g)
        for k, (end, lr0, lr1, m0, m1) in enumerate(phases):
            here = ~done & ((step <= end) if k < len(phases) - 1 else torch.ones_like(done))
            pct = (step - start) / (end - start)
            lr = torch.where(here, self._anneal(lr0, lr1, pct), lr)
            if self.cycle_momentum:
                mom = torch.where(here, self._anneal(m0, m1, pct), mom)
            done |= here
            start = torch.where(done, start, end)
        return lr, mom

    def get_lr(self):
        step = self.last_epoch
        if step > self.total_steps:
            raise ValueError(f"OneCycleLR: tried to step {step} times; total_steps is {self.total_steps}")
        return [self._compute(g, float(step))[0] for g in self.optimizer.param_groups]

    def step(self) -> None:
        super().step()
        if self.cycle_momentum:
            for g in self.optimizer.param_groups:
                self._set_momentum(g, self._compute(g, float(self.last_epoch))[1])


class ReduceLROnPlateau:
    """Reduce each member's learning rate when ITS metric stops improving: ``step(metrics)``
    takes N metrics (a tensor ``[N]`` or a sequence), one per member, and keeps per-member best
    values, bad-epoch counts and cooldowns, as ``torch.optim.lr_scheduler.ReduceLROnPlateau``
    does for one model. ``factor``, ``patience``, ``threshold``, ``cooldown``, ``min_lr`` and
    ``eps`` may be per member; ``mode`` and ``threshold_mode`` are shared.

    Example:
        >>> import torch, wide_compiler as wc
        >>> w = torch.nn.Parameter(torch.zeros(2, 3))
        >>> opt = wc.optim.SGD([w], lr=1.0)
        >>> sched = wc.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
        >>> sched.step(torch.tensor([1.0, 1.0])); sched.step(torch.tensor([0.5, 2.0]))
        >>> opt.param_groups[0]["lr"].tolist()     # member 1 got worse: halved
        [1.0, 0.5]
    """

    def __init__(self, optimizer: WideOptimizer, mode: str = "min", factor=0.1, patience=10,
                 threshold=1e-4, threshold_mode: str = "rel", cooldown=0, min_lr=0.0, eps=1e-8) -> None:
        if not isinstance(optimizer, WideOptimizer):
            raise TypeError("ReduceLROnPlateau: expected a wide_compiler.optim optimizer")
        if mode not in ("min", "max") or threshold_mode not in ("rel", "abs"):
            raise ValueError(f"ReduceLROnPlateau: mode must be 'min'/'max' and threshold_mode "
                             f"'rel'/'abs', got {mode!r}, {threshold_mode!r}")
        self.optimizer = optimizer
        self.n = _members(self, optimizer)
        self.factor = _hp(self, factor, "factor", nonneg=True)
        if (self.factor >= 1).any():
            raise ValueError("ReduceLROnPlateau: factor should be < 1.0")
        self.patience = _hp(self, patience, "patience", integer=True, nonneg=True)
        self.threshold = _hp(self, threshold, "threshold", nonneg=True)
        self.cooldown = _hp(self, cooldown, "cooldown", integer=True, nonneg=True)
        self.min_lr = _hp(self, min_lr, "min_lr", nonneg=True)
        self.eps = _hp(self, eps, "eps", nonneg=True)
        self.mode, self.threshold_mode = mode, threshold_mode
        self.last_epoch = 0
        self.best = torch.full((self.n,), math.inf if mode == "min" else -math.inf, dtype=torch.float64)
        self.num_bad_epochs = torch.zeros(self.n, dtype=torch.float64)
        self.cooldown_counter = torch.zeros(self.n, dtype=torch.float64)
        self._last_lr = [g["lr"].clone() for g in optimizer.param_groups]

    def _is_better(self, a: torch.Tensor) -> torch.Tensor:
        if self.mode == "min":
            ref = self.best * (1.0 - self.threshold) if self.threshold_mode == "rel" else self.best - self.threshold
            return a < ref
        ref = self.best * (self.threshold + 1.0) if self.threshold_mode == "rel" else self.best + self.threshold
        return a > ref

    def step(self, metrics) -> None:
        """One epoch with metrics ``[N]`` (one per member)."""
        current = per_member(metrics, self.n, what="ReduceLROnPlateau.step: metrics")
        self.last_epoch += 1
        better = self._is_better(current)
        self.best = torch.where(better, current, self.best)
        self.num_bad_epochs = torch.where(better, torch.zeros_like(current), self.num_bad_epochs + 1)
        cool = self.cooldown_counter > 0
        self.cooldown_counter = torch.where(cool, self.cooldown_counter - 1, self.cooldown_counter)
        self.num_bad_epochs = torch.where(cool, torch.zeros_like(current), self.num_bad_epochs)
        reduce = self.num_bad_epochs > self.patience
        if reduce.any():
            for g in self.optimizer.param_groups:
                old = g["lr"]
                new = torch.maximum(old * self.factor, self.min_lr)
                g["lr"] = torch.where(reduce & (old - new > self.eps), new, old)
            self.cooldown_counter = torch.where(reduce, self.cooldown, self.cooldown_counter)
            self.num_bad_epochs = torch.where(reduce, torch.zeros_like(current), self.num_bad_epochs)
        self._last_lr = [g["lr"].clone() for g in self.optimizer.param_groups]

    def get_last_lr(self) -> list[torch.Tensor]:
        return self._last_lr

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "optimizer"}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.__dict__.update(state_dict)
