"""The member schedulers of a population: :class:`MemberScheduler` (the base class),
:class:`MemberASHA` (successive halving over the members) and :class:`MemberPBT`
(population-based training over the members)."""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .records import _seed_of, _sort_key
from .spaces import _explore, _missing_mutation_keys

if TYPE_CHECKING:
    from .core import Population

__all__ = ["MemberASHA", "MemberPBT", "MemberScheduler"]


class MemberScheduler:
    """Base of the schedulers acting on the members of one fused trial. After every iteration,
    :meth:`on_iteration` reads ``pop.last`` / ``pop.ages`` and calls ``pop.stop``,
    ``pop.exploit`` or ``pop.set_hyperparameters``. ``metric`` / ``mode`` default to the
    trainable's."""

    max_t: int | None = None

    def __init__(self, metric: str | None = None, mode: str | None = None) -> None:
        self.metric, self.mode = metric, mode

    def _key(self, pop: Population, i: int) -> float:
        return _sort_key(pop.last[i].get(self.metric or pop.metric), self.mode or pop.mode)

    def on_iteration(self, pop: Population) -> None:
        """Act on the members after iteration ``pop.iteration`` (their results are in
        ``pop.last``): stop, exploit or change members through ``pop``'s member operations."""
        raise NotImplementedError

    def reseed(self, seed: int) -> None:
        """New random generators from ``seed`` (a checkpoint restored into another trial)."""

    def state_dict(self) -> dict[str, Any]:
        """The scheduler's state for :meth:`Population.state_dict`: plain values only (numbers,
        strings, None, lists, tuples, dicts), since checkpoints hold no other Python objects."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""


class MemberASHA(MemberScheduler):
    """Asynchronous successive halving (``ray.tune.schedulers.ASHAScheduler``) over members.

    Rungs are at member ages ``grace_period * reduction_factor**k`` below ``max_t``. A member
    reaching a rung records its metric there; it is stopped when it is worse than the
    ``1 - 1/reduction_factor`` quantile of everything recorded at that rung (in this trial,
    restarted members included), the cutoff Ray's ASHA uses. Members reaching a rung in the same
    iteration are recorded together before the cutoff is computed, so none is judged against an
    empty rung. ``max_t`` defaults to the trainable's ``max_iterations``.

    Example:
        >>> asha = MemberASHA(grace_period=1, reduction_factor=2, max_t=8)
        >>> asha.milestones()
        [1, 2, 4]
    """

    def __init__(self, *, metric: str | None = None, mode: str | None = None,
                 max_t: int | None = None, grace_period: int = 1, reduction_factor: float = 4) -> None:
        super().__init__(metric, mode)
        if grace_period < 1 or reduction_factor <= 1:
            raise ValueError("MemberASHA: needs grace_period >= 1 and reduction_factor > 1")
        self.max_t, self.grace_period, self.reduction_factor = max_t, grace_period, reduction_factor
        self.rungs: dict[int, list[float]] = {}

    def milestones(self, max_t: int | None = None) -> list[int]:
        """The member ages of the rungs, ``grace_period * reduction_factor**k`` below ``max_t``
        (default: the scheduler's)."""
        max_t = max_t or self.max_t
        if max_t is None:
            raise ValueError("MemberASHA: max_t is not set (pass max_t= or the trainable's max_iterations)")
        out, k = [], 0
        while round(self.grace_period * self.reduction_factor ** k) < max_t:
            out.append(int(round(self.grace_period * self.reduction_factor ** k)))
            k += 1
        return out

    def cutoff(self, recorded: Sequence[float]) -> float | None:
        """The rung's cutoff on sort keys (smaller is better): stop a member whose key is larger."""
        import numpy as np

        finite = [v for v in recorded if math.isfinite(v)]
        if not finite:
            return None
        return float(np.percentile(finite, 100 / self.reduction_factor))

    def on_iteration(self, pop: Population) -> None:
        """Record the members reaching a rung at this iteration, then stop those below its cutoff."""
        milestones = set(self.milestones(self.max_t or pop.max_iterations))
        arriving: dict[int, list[int]] = {}
        for i in range(pop.n):
            if pop.active[i] and pop.ages[i] in milestones:
                arriving.setdefault(pop.ages[i], []).append(i)
        for rung, slots in arriving.items():
            recorded = self.rungs.setdefault(rung, [])
            recorded.extend(self._key(pop, i) for i in slots)
            cut = self.cutoff(recorded)
            for i in slots:
                k = self._key(pop, i)
                if cut is None or k > cut:
                    pop.stop(i, "stopped")

    def state_dict(self) -> dict[str, Any]:
        """The values recorded at every rung."""
        return {"rungs": {k: list(v) for k, v in self.rungs.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.rungs = {int(k): list(v) for k, v in state["rungs"].items()}


class MemberPBT(MemberScheduler):
    """Population-based training (``ray.tune.schedulers.PopulationBasedTraining``) over members.

    Every ``perturbation_interval`` iterations, members are ranked by the metric; each member of
    the bottom ``quantile_fraction`` copies a random member of the top one (exploit:
    :meth:`Population.exploit`, weights + optimizer state + hyperparameters) and perturbs the
    keys of ``hyperparam_mutations`` (explore, as Ray's PBT does: a tune domain or callable is
    resampled with ``resample_probability``, else multiplied by one of ``perturbation_factors``;
    a list value moves to a neighbour or is resampled). A callable is called ``f(rng)`` with
    the population's seeded ``numpy.random.Generator``, like a ``member_space`` callable (Ray's
    PBT calls it without arguments). Every key must be in the members' configurations
    (``member_space`` or trial-level keys): checked at the first iteration. The changed keys go
    into the optimizer for that member only (:meth:`Population.set_hyperparameters`). The events
    are in ``pop.events``.

    Example:
        >>> pbt = MemberPBT(perturbation_interval=10, hyperparam_mutations={"lr": [1e-3, 1e-2, 1e-1]})
        >>> pbt.quantile_fraction
        0.25
    """

    def __init__(self, *, perturbation_interval: int, hyperparam_mutations: Mapping[str, Any],
                 metric: str | None = None, mode: str | None = None, quantile_fraction: float = 0.25,
                 resample_probability: float = 0.25,
                 perturbation_factors: Sequence[float] = (1.2, 0.8),
                 custom_explore_fn: Callable[[dict], dict] | None = None, seed: int | None = None) -> None:
        super().__init__(metric, mode)
        if perturbation_interval < 1:
            raise ValueError("MemberPBT: perturbation_interval must be >= 1")
        if not 0 < quantile_fraction <= 0.5:
            raise ValueError("MemberPBT: quantile_fraction must be in (0, 0.5]")
        if not hyperparam_mutations and custom_explore_fn is None:
            raise ValueError("MemberPBT: give hyperparam_mutations or custom_explore_fn")
        self.perturbation_interval = perturbation_interval
        self.mutations = dict(hyperparam_mutations)
        self.quantile_fraction, self.resample_probability = quantile_fraction, resample_probability
        self.perturbation_factors = tuple(perturbation_factors)
        self.custom_explore_fn, self.seed = custom_explore_fn, seed
        self._rng: random.Random | None = None
        self._checked = False

    def _generators(self, pop: Population) -> tuple[random.Random, Any]:
        if self._rng is None:
            self._rng = random.Random(_seed_of("MemberPBT", pop.seed if self.seed is None else self.seed))
        return self._rng, pop.np_rng

    def on_iteration(self, pop: Population) -> None:
        """Every ``perturbation_interval`` iterations: exploit and explore the bottom quantile."""
        if not self._checked:
            for config in pop.configs:
                missing = _missing_mutation_keys(config, self.mutations)
                if missing:
                    raise ValueError(f"MemberPBT: hyperparam_mutations has {missing}, not in the "
                                     f"members' configurations (keys {sorted(config)}); add them to "
                                     "member_space or the trial-level config")
            self._checked = True
        if pop.iteration % self.perturbation_interval != 0:
            return
        ranked = sorted((i for i in range(pop.n) if pop.active[i] and pop.ages[i] > 0),
                        key=lambda i: (self._key(pop, i), i))
        q = int(math.ceil(len(ranked) * self.quantile_fraction))
        q = min(q, len(ranked) // 2)
        if q == 0:
            return
        top, bottom = ranked[:q], ranked[-q:]
        rng, np_rng = self._generators(pop)
        for dst in bottom:
            src = rng.choice(top)
            old = copy.deepcopy(pop.configs[dst])
            pop.exploit(src, dst)
            new, ops = _explore(pop.configs[dst], self.mutations, rng, np_rng,
                                self.resample_probability, self.perturbation_factors)
            if self.custom_explore_fn is not None:
                new = self.custom_explore_fn(new)
            changed = {k: v for k, v in new.items() if pop.configs[dst].get(k) != v}
            if changed:
                pop.set_hyperparameters(dst, **changed)
            pop.events.append({"iteration": pop.iteration, "event": "exploit", "slot": dst,
                               "src": src, "src_id": pop.member_ids[src], "id": pop.member_ids[dst],
                               "old_config": old, "config": copy.deepcopy(pop.configs[dst]),
                               "operations": ops})

    def reseed(self, seed: int) -> None:
        """A new generator for the exploit choices, from ``seed`` and this scheduler's own seed."""
        self._rng = random.Random(_seed_of("MemberPBT", self.seed, seed))

    def state_dict(self) -> dict[str, Any]:
        """The state of the generator of the exploit choices."""
        return {"rng": self._rng.getstate() if self._rng is not None else None}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        if state.get("rng") is not None:
            self._rng = random.Random()
            self._rng.setstate(state["rng"])
