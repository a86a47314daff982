"""The :class:`Population` itself: the N members of one fused trial, their construction, the
member operations a scheduler uses, the training loop and the population's state."""

from __future__ import annotations

import copy
import operator
import os
import random
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..config import WideConfig
from .checkpoint import _FORMAT, CHECKPOINT_FILE, _write_checkpoint
from .hyperparameters import _make_optimizer, _member_hparams, _push_change, _push_hparams
from .records import _best_of, _member_record, _per_member, _seed_of, _sort_key
from .spaces import sample_member_config

if TYPE_CHECKING:
    from .schedulers import MemberScheduler

__all__ = ["Population"]



class Population:
    """The N members of one fused trial: the wide model, its per-member optimizer, each member's
    configuration and record, and the member operations schedulers use (:meth:`stop`,
    :meth:`restart`, :meth:`exploit`, :meth:`set_hyperparameters`).

    ``train_step(pop)`` receives this object. Read ``pop.model`` (the :class:`WideModel`),
    ``pop.optimizer``, ``pop.configs[i]`` (member ``i``'s configuration: hyperparameters that
    are not the optimizer's, e.g. a loss weight, are read from here), ``pop.n``,
    ``pop.iteration``, ``pop.active[i]``, and draw random numbers from ``pop.generator`` (a
    ``torch.Generator`` saved in checkpoints, so a restored trial continues identically).

    Without Ray, :meth:`create` and :meth:`step` run the same loop as
    :func:`~wide_compiler.integrations.ray.fused_trainable`.

    Example:
        >>> import torch, torch.nn.functional as F, wide_compiler as wc
        >>> from wide_compiler.population import MemberASHA, Population
        >>> _ = torch.manual_seed(0)
        >>> x, y = torch.randn(64, 3), torch.randn(64, 1)
        >>> def train_step(pop):
        ...     losses = wc.optim.member_losses(F.mse_loss, pop.model(x.expand(pop.n, *x.shape)),
        ...                                     y, shared_target=True)
        ...     pop.optimizer.zero_grad(); losses.sum().backward(); pop.optimizer.step()
        ...     return {"loss": losses.detach()}
        >>> pop = Population.create(
        ...     lambda cfg: torch.nn.Linear(3, 1), lambda params, hp: wc.optim.SGD(params, lr=hp["lr"]),
        ...     sample_input=torch.randn(2, 3), n_members=4, metric="loss", mode="min",
        ...     member_configs=[{"lr": lr} for lr in (1e-3, 1e-2, 1e-1, 3e-1)], max_iterations=8,
        ...     scheduler=MemberASHA(grace_period=2, reduction_factor=2), seed=0)
        >>> while not pop.done:
        ...     report = pop.step(train_step)
        >>> len(pop.finished), pop.best["config"]["lr"]
        (4, 0.3)
    """

    def __init__(self) -> None:  # use create() or from_state()
        self.model: Any = None
        self.optimizer: Any = None
        self.n = 0
        self.configs: list[dict[str, Any]] = []
        self.iteration = 0

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def create(cls, build_model: Callable[[dict], nn.Module], optimizer: Callable[..., Any], *,
               sample_input: Any, n_members: int, metric: str, mode: str = "min",
               max_iterations: int | None = None, member_space: Mapping[str, Any] | None = None,
               member_configs: Sequence[Mapping[str, Any]] | None = None,
               trial_config: Mapping[str, Any] | None = None, num_member_samples: int | None = None,
               scheduler: MemberScheduler | None = None,
               wide_config: WideConfig | None = None, seed: int = 0,
               trial_id: str | None = None) -> Population:
        """A new population: ``member_configs`` first, then samples of ``member_space``, each merged
        over ``trial_config`` (keys shared by all members, e.g. architecture sizes); member ``i``'s
        initial weights are ``build_model(config)`` under ``torch.manual_seed(seeds[i])``.
        ``num_member_samples`` (default ``n_members``) is the number of configurations this
        population may try in all: a stopped member's slot restarts with a new sample while
        some remain. ``trial_id`` (saved in checkpoints) tells :meth:`from_state` whether it
        restores this trial or another one (Tune's PBT)."""
        self = cls()
        self._init_spec(build_model, optimizer, sample_input=sample_input, n_members=n_members,
                        metric=metric, mode=mode, max_iterations=max_iterations,
                        member_space=member_space, trial_config=trial_config,
                        num_member_samples=num_member_samples, scheduler=scheduler,
                        wide_config=wide_config)
        import numpy as np

        self.seed, self.trial_id = int(seed), trial_id
        self.rng = random.Random(self.seed)
        self.np_rng = np.random.default_rng(self.seed)
        self.generator = torch.Generator().manual_seed(self.seed)
        given = [dict(c) for c in (member_configs or [])]
        if len(given) > n_members:
            raise ValueError(f"wide_compiler.integrations.ray: {len(given)} member configs for "
                             f"n_members={n_members}")
        configs = [self._merge(c) for c in given]
        while len(configs) < n_members:
            configs.append(self._new_config())
        self.configs = configs
        self.seeds = [self.rng.randrange(2**31) for _ in range(n_members)]
        self.member_ids = list(range(n_members))
        self.started = n_members
        self.ages = [0] * n_members
        self.active = [True] * n_members
        self.last: list[dict[str, float]] = [{} for _ in range(n_members)]
        self.finished: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.best: dict[str, Any] | None = None
        self.iteration = 0
        self.restores: list[int] = []
        models = [self._build(c, s) for c, s in zip(configs, self.seeds)]
        self._fuse(models)
        self.optimizer = _make_optimizer(self, configs)
        self._frozen: dict[int, dict[str, torch.Tensor]] = {}
        return self

    def _init_spec(self, build_model, optimizer, *, sample_input, n_members, metric, mode,
                   max_iterations, member_space, trial_config, num_member_samples, scheduler,
                   wide_config) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"wide_compiler.integrations.ray: mode must be 'min' or 'max', got {mode!r}")
        if not isinstance(n_members, int) or n_members < 1:
            raise ValueError(f"wide_compiler.integrations.ray: n_members must be >= 1, got {n_members!r}")
        budget = n_members if num_member_samples is None else int(num_member_samples)
        if budget < n_members:
            raise ValueError(f"wide_compiler.integrations.ray: num_member_samples={budget} < "
                             f"n_members={n_members}")
        if budget > n_members and member_space is None:
            raise ValueError("wide_compiler.integrations.ray: num_member_samples > n_members needs "
                             "a member_space to draw the restarted members from")
        if max_iterations is None and scheduler is not None:
            max_iterations = getattr(scheduler, "max_t", None)
        self.build_model, self.make_optimizer = build_model, optimizer
        self.sample_input, self.n, self.metric, self.mode = sample_input, n_members, metric, mode
        self.max_iterations = max_iterations
        self.member_space = dict(member_space or {})
        self.trial_config = dict(trial_config or {})
        self.budget = budget
        self.scheduler = scheduler
        self.wide_config = wide_config or WideConfig.fast()
        overlap = sorted(set(self.member_space) & set(self.trial_config))
        if overlap:
            raise ValueError(f"wide_compiler.integrations.ray: {overlap} are both trial-level keys "
                             "(the Tuner's param_space) and per-member keys (member_space); keep "
                             "each key in one of them")

    def _merge(self, member: Mapping[str, Any]) -> dict[str, Any]:
        return {**copy.deepcopy(self.trial_config), **member}

    def _new_config(self) -> dict[str, Any]:
        return self._merge(sample_member_config(self.member_space, self.np_rng))

    def _build(self, config: Mapping[str, Any], seed: int) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = self.build_model(dict(config))
        if not isinstance(model, nn.Module):
            raise TypeError(f"wide_compiler.integrations.ray: build_model returned a "
                            f"{type(model).__name__}, expected an nn.Module")
        return model

    def _fuse(self, models: list[nn.Module]) -> None:
        from ..api import compile as wide_compile

        sample = self.sample_input(self.trial_config) if callable(self.sample_input) else self.sample_input
        self.model = wide_compile(models, sample, config=self.wide_config)

    # -- member operations -------------------------------------------------------------------------
    def _slot(self, i: Any, what: str) -> int:
        """``i`` as a member slot in ``[0, N)``; ``IndexError`` naming ``what`` otherwise."""
        try:
            k = None if isinstance(i, bool) else operator.index(i)
        except TypeError:
            k = None
        if k is None or not 0 <= k < self.n:
            raise IndexError(f"wide_compiler.integrations.ray: {what}: member {i!r} out of range for "
                             f"a population of N={self.n} members (slots 0..{self.n - 1})")
        return k

    def value(self, i: int) -> float | None:
        """Member ``i``'s latest value of the metric (None before its first iteration)."""
        return self.last[self._slot(i, "value")].get(self.metric)

    def sort_key(self, v: float | None) -> float:
        """Smaller is better, whatever the mode; NaN and missing values are the worst."""
        return _sort_key(v, self.mode)

    def set_hyperparameters(self, i: int, **values: Any) -> None:
        """Change member ``i``'s configuration. The optimizer hyperparameters the change affects
        (as the optimizer factory derives them from a configuration, however it names or
        transforms the keys) are pushed into the optimizer for that member only, the others (e.g. a learning rate under a schedule) are left as
        they are. The new values are validated (by the factory and the optimizer) before
        anything changes. ``IndexError`` for a slot outside ``[0, N)``."""
        i = self._slot(i, f"set_hyperparameters({i!r}, ...)")
        new = {**self.configs[i], **copy.deepcopy(values)}
        _push_change(self, i, self.configs[i], new)
        self.configs[i] = new

    def restart(self, i: int, config: Mapping[str, Any] | None = None, seed: int | None = None) -> None:
        """Slot ``i`` starts a new member: ``config`` (default: a fresh sample of the member
        space), weights of ``build_model(config)`` under ``seed``, a zeroed optimizer state."""
        i = self._slot(i, f"restart({i!r})")
        config = self._new_config() if config is None else self._merge(config)
        seed = self.rng.randrange(2**31) if seed is None else int(seed)
        hparams = _member_hparams(self, i, config)
        self.model.load_member_state_dict(i, self._build(config, seed).state_dict())
        _push_hparams(self, i, hparams)
        self.optimizer.reset_member_state(i)
        self.configs[i] = config
        self.seeds[i], self.member_ids[i] = seed, self.started
        self.started += 1
        self.ages[i], self.active[i], self.last[i] = 0, True, {}
        self._frozen.pop(i, None)
        self.events.append({"iteration": self.iteration, "event": "restart", "slot": i,
                            "id": self.member_ids[i], "config": copy.deepcopy(config)})

    def exploit(self, src: int, dst: int) -> None:
        """Member ``dst`` becomes a copy of member ``src``: weights, buffers, optimizer state,
        hyperparameters, configuration and age (``WideModel.copy_member_weights``). ``dst`` must be
        training (a done member's frozen slot keeps its weights). ``IndexError`` for a slot
        outside ``[0, N)``."""
        src = self._slot(src, f"exploit({src!r}, {dst!r}): src")
        dst = self._slot(dst, f"exploit({src!r}, {dst!r}): dst")
        if not self.active[dst]:
            raise ValueError(f"wide_compiler.integrations.ray: exploit({src}, {dst}): slot {dst} "
                             "is done (frozen, its weights kept); restart it first")
        self.model.copy_member_weights(src, dst, self.optimizer)
        self.configs[dst] = copy.deepcopy(self.configs[src])
        self.ages[dst], self.last[dst] = self.ages[src], dict(self.last[src])

    def stop(self, i: int, status: str = "stopped") -> None:
        """Member ``i`` is done (``"stopped"`` by a scheduler, or ``"completed"``): its record goes
        to :attr:`finished`, then the slot restarts with a new sample while the population's
        ``num_member_samples`` allows, or is frozen (weights kept, no longer trained)."""
        i = self._slot(i, f"stop({i!r})")
        if not self.active[i]:
            return
        record = self._record(i, status)
        self.finished.append(record)
        self.events.append({"iteration": self.iteration, "event": status, "slot": i,
                            "id": self.member_ids[i], "value": self.value(i)})
        if self.best is None or self.sort_key(record["value"]) < self.sort_key(self.best["value"]):
            self.best = {**record, "state_dict": self.model.member_state_dict(i)}
        if self.started < self.budget:
            self.restart(i)
        else:
            self.active[i] = False
            self._frozen[i] = self.model.member_state_dict(i)

    def _record(self, i: int, status: str) -> dict[str, Any]:
        return _member_record(vars(self), i, status)

    @property
    def done(self) -> bool:
        """No member is training any more."""
        return not any(self.active)

    # -- the loop ----------------------------------------------------------------------------------
    def step(self, train_step: Callable[[Population], Mapping[str, Any]]) -> dict[str, Any]:
        """One iteration: ``train_step(self)`` trains every member and returns per-member metrics
        (each a tensor ``[N]`` or N numbers, ``metric`` among them); then members that reached
        ``max_iterations`` complete, the member scheduler acts, and the report (what
        :func:`~wide_compiler.integrations.ray.fused_trainable` passes to ``tune.report``) is
        returned."""
        if self.done:
            raise RuntimeError("wide_compiler.integrations.ray: every member is done")
        raw = train_step(self)
        if not isinstance(raw, Mapping) or self.metric not in raw:
            raise ValueError(f"wide_compiler.integrations.ray: train_step must return a dict of "
                             f"per-member metrics containing {self.metric!r}; got "
                             f"{sorted(raw) if isinstance(raw, Mapping) else type(raw).__name__}")
        values = {k: _per_member(k, v, self.n) for k, v in raw.items()}
        self._restore_frozen()
        self.iteration += 1
        for i in range(self.n):
            if self.active[i]:
                self.ages[i] += 1
                self.last[i] = {k: v[i] for k, v in values.items()}
        report = self.report()                 # this iteration's results, before any change
        if self.max_iterations is not None:
            for i in range(self.n):
                if self.active[i] and self.ages[i] >= self.max_iterations:
                    self.stop(i, "completed")
        if self.scheduler is not None:
            self.scheduler.on_iteration(self)
        for i, m in report["members"].items():  # whether the member that reported still trains
            m["active"] = int(self.active[int(i)] and self.member_ids[int(i)] == m["id"])
        report.update(self._counters())
        return report

    def _restore_frozen(self) -> None:
        for i, sd in self._frozen.items():
            self.model.load_member_state_dict(i, sd)

    def report(self) -> dict[str, Any]:
        """The N members' latest results and the trial's best, as reported to Tune."""
        members = {}
        for i in range(self.n):
            members[str(i)] = {**self.last[i], "id": self.member_ids[i], "age": self.ages[i],
                               "active": int(self.active[i]), "seed": self.seeds[i],
                               "config": copy.deepcopy(self.configs[i])}
        best = _best_of(vars(self))
        out: dict[str, Any] = {"members": members}
        if best is not None:
            out.update({self.metric: best["value"], "best_member": best["id"],
                        "best_config": copy.deepcopy(best["config"])})
        out.update(self._counters())
        return out

    def _counters(self) -> dict[str, Any]:
        return {"members_started": self.started, "members_finished": len(self.finished),
                "members_active": sum(self.active), "n_members": self.n}

    # -- checkpoints ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue identically: each member's ``state_dict`` (the original
        module's keys), the optimizer, the configurations and records, the scheduler and the
        generators (this population's and torch's global one)."""
        return {
            "format": _FORMAT, "n": self.n, "metric": self.metric, "mode": self.mode,
            "seed": self.seed, "trial_id": self.trial_id, "iteration": self.iteration,
            "members": [self.model.member_state_dict(i) for i in range(self.n)],
            "optimizer": self.optimizer.state_dict(),
            "configs": copy.deepcopy(self.configs), "seeds": list(self.seeds),
            "member_ids": list(self.member_ids), "ages": list(self.ages), "active": list(self.active),
            "last": copy.deepcopy(self.last), "started": self.started, "budget": self.budget,
            "finished": copy.deepcopy(self.finished), "events": copy.deepcopy(self.events),
            "best": self.best, "restores": list(self.restores), "trial_config": copy.deepcopy(self.trial_config),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "rng": self.rng.getstate(), "np_rng": self.np_rng.bit_generator.state,
            "generator": self.generator.get_state(), "torch_rng": torch.get_rng_state(),
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any], build_model: Callable[[dict], nn.Module],
                   optimizer: Callable[..., Any], *, sample_input: Any,
                   scheduler: MemberScheduler | None = None, max_iterations: int | None = None,
                   member_space: Mapping[str, Any] | None = None,
                   wide_config: WideConfig | None = None, trial_config: Mapping[str, Any] | None = None,
                   trial_id: str | None = None, seed: int | None = None) -> Population:
        """The population saved by :meth:`state_dict` (``scheduler`` gets its saved state).

        Restored into the trial that saved it (``trial_id`` None or the saved one, e.g. a trial
        retried after a failure), it continues bit for bit. Restored into ANOTHER trial (Tune's
        PBT exploit: ``trial_id`` differs from the saved one), the members (weights, optimizer
        state, configurations, records) are the checkpoint's, but the generators (the
        population's, the member scheduler's and torch's) are reseeded from ``(seed, trial_id)``
        so that the two trials diverge. In both cases the trial-level keys of ``trial_config``
        (default: the saved ones; Tune passes the restoring trial's, perturbed by its PBT) replace
        the saved ones in every member's configuration, and reach the optimizer as
        :meth:`set_hyperparameters` does. A trial-level key that changes the architecture cannot
        load the saved weights: ``ValueError`` naming the changed keys."""
        import numpy as np

        if state.get("format") != _FORMAT:
            raise ValueError(f"wide_compiler.integrations.ray: unknown checkpoint format {state.get('format')!r}")
        other = trial_id is not None and trial_id != state.get("trial_id")
        saved_trial = state["trial_config"]
        new_trial = copy.deepcopy(dict(saved_trial if trial_config is None else trial_config))
        changed = {k: v for k, v in new_trial.items() if k not in saved_trial or saved_trial[k] != v}
        removed = [k for k in saved_trial if k not in new_trial]
        self = cls()
        self._init_spec(build_model, optimizer, sample_input=sample_input, n_members=state["n"],
                        metric=state["metric"], mode=state["mode"], max_iterations=max_iterations,
                        member_space=member_space, trial_config=new_trial,
                        num_member_samples=state["budget"], scheduler=scheduler,
                        wide_config=wide_config)
        for key in ("seed", "iteration", "seeds", "member_ids", "ages", "active", "last", "started",
                    "finished", "events", "best", "restores"):
            setattr(self, key, copy.deepcopy(state[key]))
        self.trial_id = state.get("trial_id") if trial_id is None else trial_id
        saved = copy.deepcopy(state["configs"])
        self.configs = [{**{k: v for k, v in c.items() if k not in removed}, **copy.deepcopy(changed)}
                        for c in saved]
        models = []
        for i, (config, s, sd) in enumerate(zip(self.configs, self.seeds, state["members"])):
            m = self._build(config, s)
            try:
                m.load_state_dict(sd)
            except RuntimeError as e:
                raise ValueError(
                    f"wide_compiler.integrations.ray: member {i}'s weights in the checkpoint do not "
                    f"fit build_model(config) with this trial's configuration; trial-level keys "
                    f"changed from the checkpoint's: {sorted(changed)}, removed: {removed}. Keys "
                    "that change the architecture cannot differ between a checkpoint and the trial "
                    "restoring it (keep them out of Tune PBT's hyperparam_mutations)") from e
            models.append(m)
        self._fuse(models)
        self.optimizer = _make_optimizer(self, saved)
        self.optimizer.load_state_dict(state["optimizer"])
        if changed or removed:
            for i in range(self.n):
                _push_change(self, i, saved[i], self.configs[i])
        self._frozen = {i: self.model.member_state_dict(i) for i in range(self.n) if not self.active[i]}
        if scheduler is not None and state.get("scheduler") is not None:
            scheduler.load_state_dict(state["scheduler"])
        if other:
            self.seed = _seed_of("wide_compiler", "restored", state["seed"] if seed is None else int(seed),
                                 trial_id)
            self.rng = random.Random(self.seed)
            self.np_rng = np.random.default_rng(self.seed)
            self.generator = torch.Generator().manual_seed(self.seed)
            torch.manual_seed(self.seed)
            if scheduler is not None:
                scheduler.reseed(self.seed)
            self.events.append({"iteration": self.iteration, "event": "restored_from_trial",
                                "from_trial": state.get("trial_id"), "changed": copy.deepcopy(changed)})
        else:
            self.rng = random.Random()
            self.rng.setstate(state["rng"])
            self.np_rng = np.random.default_rng()
            self.np_rng.bit_generator.state = state["np_rng"]
            self.generator = torch.Generator()
            self.generator.set_state(state["generator"])
            torch.set_rng_state(state["torch_rng"])
        self.restores.append(self.iteration)
        return self

    def save(self, directory: str | os.PathLike) -> str:
        """Write :meth:`state_dict` into ``directory`` (the content of a Tune checkpoint), as
        plain data that :func:`~wide_compiler.integrations.ray.load_checkpoint` reads with ``torch.load(weights_only=True)``:
        the tensors, and everything else as JSON text. Written atomically (a temporary file of
        an unpredictable name, then renamed). Raises ``TypeError`` naming the value when a
        configuration (or a scheduler's state) holds something other than plain values."""
        path = os.path.join(os.fspath(directory), CHECKPOINT_FILE)
        _write_checkpoint(self.state_dict(), path)
        return path

