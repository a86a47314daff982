"""Per-member learning-rate schedules for :mod:`wide_compiler.optim` optimizers.

Each scheduler gives member ``i`` the learning rate that the ``torch.optim.lr_scheduler`` of the
same name gives a single model with member ``i``'s settings, and every scheduler hyperparameter
(``gamma``, ``step_size``, ``T_max``, ``eta_min``, ``max_lr``, ``pct_start``, ``factor``,
``patience``...) may be one value or N values. Learning rates are computed in closed form in
float64 from the base learning rates (``group["initial_lr"]``); torch's chained forms agree to
~1e-16 relative. Usage is torch's: ``optimizer.step()`` then ``scheduler.step()``.

Per-param-group values. Where torch takes a list as one value per param group (OneCycleLR's
``max_lr``, ``base_momentum``, ``max_momentum``; ReduceLROnPlateau's ``min_lr``), so does this
module, and each group's entry may itself be one value or N values (one per member):

- a float, or a tensor (0-d: shared; ``[N]``: one per member), is used for every param group;
  a tensor ``[G, N]`` gives row ``k`` to param group ``k``;
- a list or tuple holding lists or tensors is one entry per param group (torch's meaning), each
  entry a float or N values: ``max_lr=[[0.5, 0.4, 0.3], 0.01]``;
- a list or tuple of numbers is per param group when its length is the number of param groups
  (torch's meaning) and per member (every group) when its length is N. When it is both (N equals
  the number of groups, N > 1) it is refused as ambiguous: write per-group values as a list of
  per-group entries of N values each (``[[0.5, 0.5], [0.01, 0.01]]``) and per-member values as a
  float64 tensor (``torch.tensor([0.5, 0.01], dtype=torch.float64)``; a float32 tensor's values
  are its float32 roundings).

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
from numbers import Real
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


def _is_number(v: Any) -> bool:
    """A single value: a real number (not a bool) or a 0-d tensor."""
    if isinstance(v, torch.Tensor):
        return v.dim() == 0
    return isinstance(v, Real) and not isinstance(v, bool)


def _per_group(sched, value, name, optimizer: WideOptimizer, **rules) -> list[torch.Tensor]:
    """``value`` of a hyperparameter that torch takes per param group (a float, or a list of one
    value per param group) as one float64 tensor ``[N]`` per param group, each checked as
    :func:`_hp` checks one. Reading (see the module's docstring): a float or a tensor ``[N]`` is
    used for every group, a tensor ``[G, N]`` row by row; a list or tuple is one entry per group
    (each a float or N values), except that a flat list of N numbers whose length is not the
    number of groups G is one value per member; a flat list whose length is both N and G (N > 1)
    is refused as ambiguous, never guessed.

    Example:
        >>> import torch, wide_compiler as wc
        >>> w, b = torch.nn.Parameter(torch.zeros(3, 4)), torch.nn.Parameter(torch.zeros(3))
        >>> opt = wc.optim.SGD([{"params": [w]}, {"params": [b]}], lr=0.1)
        >>> s = wc.optim.lr_scheduler.ReduceLROnPlateau(opt, min_lr=[0.01, [0.1, 0.2, 0.3]])
        >>> [t.tolist() for t in s.min_lrs]
        [[0.01, 0.01, 0.01], [0.1, 0.2, 0.3]]
    """
    n, g = sched.n, len(optimizer.param_groups)
    cls = type(sched).__name__
    if isinstance(value, torch.Tensor) and value.dim() == 2:
        if value.shape[0] != g:
            raise ValueError(f"{cls}: {name} is a tensor of shape {list(value.shape)}; a 2-d {name} is "
                             f"one row per param group ([G, N] = [{g}, {n}])")
        return [_hp(sched, value[k], f"{name} (param group {k})", **rules) for k in range(g)]
    if not isinstance(value, (list, tuple)):
        t = _hp(sched, value, name, **rules)
        return [t.clone() for _ in range(g)]
    items = list(value)
    flat = all(_is_number(v) for v in items)
    if flat and len(items) == g == n and n > 1:
        shown = [float(v) for v in items]
        raise ValueError(
            f"{cls}: {name}={list(value)!r} is ambiguous: it has {len(items)} values and there are "
            f"both N={n} members and {g} param groups. torch.optim.lr_scheduler.{cls} reads a list "
            f"as one {name} per param group; wide_compiler.optim also takes N values as one per "
            f"member. Write one {name} per param group as one entry per group holding N values, "
            f"{name}={[[v] * n for v in shown]!r}, or one {name} per member (for every param "
            f"group) as a tensor, {name}=torch.tensor({shown!r}, dtype=torch.float64)")
    if flat and len(items) != g:
        if len(items) == n:
            t = _hp(sched, items, name, **rules)  # one value per member (N != G)
            return [t.clone() for _ in range(g)]
        raise ValueError(
            f"{cls}: {name} has {len(items)} values; expected one per param group ({g}, "
            f"torch's meaning) or one per member (N={n}), or a float for all")
    if len(items) != g:
        raise ValueError(
            f"{cls}: {name} is a list of {len(items)} entries holding lists or tensors, read as one "
            f"entry per param group (each a float or {n} values, one per member), but the "
            f"optimizer has {g} param groups; for one value per member in every group pass a "
            f"tensor of {n} values")
    return [_hp(sched, v, f"{name} (param group {k})", **rules) for k, v in enumerate(items)]


def _given_per_group(value, optimizer: WideOptimizer) -> bool:
    """Whether :func:`_per_group` read ``value`` as one entry per param group (not one value, or
    one per member, for every group)."""
    if isinstance(value, torch.Tensor):
        return value.dim() == 2
    if not isinstance(value, (list, tuple)):
        return False
    return len(value) == len(optimizer.param_groups) or not all(_is_number(v) for v in value)


def _of_group(values, k: int) -> torch.Tensor:
    """Param group ``k``'s entry of a per-group list (or the tensor ``[N]`` of a scheduler state
    saved before hyperparameters were per group)."""
    return values if isinstance(values, torch.Tensor) else values[k]


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
        self.__dict__.update(_on_the_cpu(state_dict))
        for g, lr in zip(self.optimizer.param_groups, self._last_lr):
            g["lr"] = lr.clone()


def _on_the_cpu(state: dict[str, Any]) -> dict[str, Any]:
    """A schedule's state with its tensors on the CPU, where schedules keep them whatever the
    default device (a state made or saved elsewhere mixed devices at the next step)."""
    def cpu(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.cpu()
        return type(v)(cpu(x) for x in v) if isinstance(v, (list, tuple)) else v
    return {k: cpu(v) for k, v in state.items()}


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
        count = torch.tensor([bisect.bisect_right(m, epoch) for m in self.milestones], dtype=torch.float64,
                             device="cpu")
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
    beta1 (Adam, AdamW) cycles inversely to the learning rate.

    ``max_lr``, ``base_momentum`` and ``max_momentum`` are per param group as in torch: a list or
    tuple gives one entry per param group, each a float or N values (one per member). A flat list
    of N numbers is one value per member only where N is not the number of param groups; where it
    is (N > 1) the list is refused as ambiguous: give per-group values as ``[[a] * N, [b] * N]``
    and per-member values as a tensor, ``torch.tensor([...], dtype=torch.float64)`` (a tensor of
    N values is always per member; see the module's docstring).

    Example:
        >>> import torch, wide_compiler as wc
        >>> w, b = torch.nn.Parameter(torch.zeros(2, 4)), torch.nn.Parameter(torch.zeros(2))
        >>> opt = wc.optim.SGD([{"params": [w]}, {"params": [b]}], lr=0.1, momentum=0.9)
        >>> sched = wc.optim.lr_scheduler.OneCycleLR(           # torch's per-group max_lr
        ...     opt, max_lr=[[0.5, 0.5], [0.01, 0.01]], total_steps=10)
        >>> [g["max_lr"].tolist() for g in opt.param_groups]
        [[0.5, 0.5], [0.01, 0.01]]
        >>> sched = wc.optim.lr_scheduler.OneCycleLR(           # one max_lr per member
        ...     opt, max_lr=torch.tensor([0.5, 0.01], dtype=torch.float64), total_steps=10)
        >>> [g["max_lr"].tolist() for g in opt.param_groups]
        [[0.5, 0.01], [0.5, 0.01]]
    """

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
        max_lrs = _per_group(self, max_lr, "max_lr", optimizer, nonneg=True)
        div = _hp(self, div_factor, "div_factor", positive=True)
        final_div = _hp(self, final_div_factor, "final_div_factor", positive=True)
        self.cycle_momentum = cycle_momentum
        groups = optimizer.param_groups
        if cycle_momentum:
            if "momentum" not in optimizer.defaults and "betas" not in optimizer.defaults:
                raise ValueError("OneCycleLR: cycle_momentum=True needs an optimizer with momentum or betas")
            self.use_beta1 = "betas" in optimizer.defaults
            # one tensor [N] per param group
            self.base_momentum = _per_group(self, base_momentum, "base_momentum", optimizer, nonneg=True)
            self.max_momentum = _per_group(self, max_momentum, "max_momentum", optimizer, nonneg=True)
        if last_epoch == -1:
            for k, (g, top) in enumerate(zip(groups, max_lrs)):
                g["initial_lr"] = top / div
                g["max_lr"] = top.clone()
                g["min_lr"] = g["initial_lr"] / final_div
                if cycle_momentum:
                    self._set_momentum(g, self.max_momentum[k])
        super().__init__(optimizer, last_epoch)

    def _set_momentum(self, g, m):
        if self.use_beta1:
            g["betas"] = (m.clone(), g["betas"][1])
        else:
            g["momentum"] = m.clone()

    def _phases(self, g, k: int):
        t, pct = self.total_steps, self.pct_start
        if self.cycle_momentum:
            top, low = _of_group(self.max_momentum, k), _of_group(self.base_momentum, k)
        else:
            top = low = None
        if self.three_phase:
            return [(pct * t - 1, g["initial_lr"], g["max_lr"], top, low),
                    (2 * pct * t - 2, g["max_lr"], g["initial_lr"], low, top),
                    (torch.full_like(pct, t - 1.0), g["initial_lr"], g["min_lr"], top, top)]
        return [(pct * t - 1, g["initial_lr"], g["max_lr"], top, low),
                (torch.full_like(pct, t - 1.0), g["max_lr"], g["min_lr"], low, top)]

    def _anneal(self, start, end, pct):
        if self.anneal_strategy == "cos":
            return end + (start - end) / 2.0 * (torch.cos(math.pi * pct) + 1)
        return (end - start) * pct + start

    def _compute(self, g, k: int, step):
        lr = torch.zeros(self.n, dtype=torch.float64, device="cpu")
        mom = torch.zeros(self.n, dtype=torch.float64, device="cpu")
        done = torch.zeros(self.n, dtype=torch.bool, device="cpu")
        start = torch.zeros(self.n, dtype=torch.float64, device="cpu")
        phases = self._phases(g, k)
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
        return [self._compute(g, k, float(step))[0] for k, g in enumerate(self.optimizer.param_groups)]

    def step(self) -> None:
        super().step()
        if self.cycle_momentum:
            for k, g in enumerate(self.optimizer.param_groups):
                self._set_momentum(g, self._compute(g, k, float(self.last_epoch))[1])


class ReduceLROnPlateau:
    """Reduce each member's learning rate when ITS metric stops improving: ``step(metrics)``
    takes N metrics (a tensor ``[N]`` or a sequence), one per member, and keeps per-member best
    values, bad-epoch counts and cooldowns, as ``torch.optim.lr_scheduler.ReduceLROnPlateau``
    does for one model. ``factor``, ``patience``, ``threshold``, ``cooldown``, ``min_lr`` and
    ``eps`` may be per member; ``mode`` and ``threshold_mode`` are shared.

    ``min_lr`` is per param group as in torch (``min_lrs``: one tensor ``[N]`` per group): a
    list or tuple gives one entry per param group, each a float or N values. A flat list of N
    numbers is one value per member only where N is not the number of param groups; where it is
    (N > 1) it is refused as ambiguous: give per-group values as ``[[a] * N, [b] * N]`` and
    per-member values as a tensor, ``torch.tensor([...], dtype=torch.float64)`` (see the
    module's docstring). A ``min_lr`` given as one value (or N) also covers param groups added
    later; one given per group does not (a ``RuntimeError`` at the next reduction, as torch's).

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
        self.min_lrs = _per_group(self, min_lr, "min_lr", optimizer, nonneg=True)
        # torch's default_min_lr: the value for param groups added later (None: given per group)
        self.default_min_lr = None if _given_per_group(min_lr, optimizer) else self.min_lrs[0].clone()
        self.eps = _hp(self, eps, "eps", nonneg=True)
        self.mode, self.threshold_mode = mode, threshold_mode
        self.last_epoch = 0
        self.best = torch.full((self.n,), math.inf if mode == "min" else -math.inf, dtype=torch.float64,
                               device="cpu")
        self.num_bad_epochs = torch.zeros(self.n, dtype=torch.float64, device="cpu")
        self.cooldown_counter = torch.zeros(self.n, dtype=torch.float64, device="cpu")
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
            groups = self.optimizer.param_groups
            if len(groups) != len(self.min_lrs):
                if self.default_min_lr is None:
                    raise RuntimeError(
                        f"ReduceLROnPlateau: the optimizer has {len(groups)} param groups and "
                        f"min_lr was given for {len(self.min_lrs)} (a param group added since?); "
                        f"set min_lrs to one tensor [N] per param group")
                self.min_lrs = [self.default_min_lr.clone() for _ in groups]
            for g, floor in zip(groups, self.min_lrs):
                old = g["lr"]
                new = torch.maximum(old * self.factor, floor)
                g["lr"] = torch.where(reduce & (old - new > self.eps), new, old)
            self.cooldown_counter = torch.where(reduce, self.cooldown, self.cooldown_counter)
            self.num_bad_epochs = torch.where(reduce, torch.zeros_like(current), self.num_bad_epochs)
        self._last_lr = [g["lr"].clone() for g in self.optimizer.param_groups]

    def get_last_lr(self) -> list[torch.Tensor]:
        return self._last_lr

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "optimizer"}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = _on_the_cpu(state_dict)
        self.__dict__.update(state_dict)
        if "min_lrs" not in state_dict and "min_lr" in state_dict:  # saved when min_lr was per member only
            self.default_min_lr = state_dict["min_lr"]
            self.min_lrs = [state_dict["min_lr"].clone() for _ in self.optimizer.param_groups]
            del self.__dict__["min_lr"]
