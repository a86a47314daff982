"""Optuna studies whose trials train N at a time, fused into one wide model.

An Optuna objective trains one model per trial. :func:`optimize` asks the study for trials
(``study.ask()``), builds one member per trial with the user's ``build(trial)`` (where the
``trial.suggest_*`` calls are), fuses ``n_members`` trials of one architecture into one
:class:`~wide_compiler.WideModel` with a per-member optimizer (:mod:`wide_compiler.optim`: each
trial's learning rate, weight decay, ... is its member's own), and trains them together: one
forward, one backward and one fused optimizer step per step for all N. Each step, every member
reports its own value (``trial.report(value, step)``) and asks Optuna's pruner about itself
(``trial.should_prune()``): a pruned member is frozen (its weights, buffers and optimizer state
stay exactly as they were when it was pruned) while the others go on; each trial is told its own
result (``study.tell``: the last value when it completes, ``TrialState.PRUNED`` when pruned).

Trials whose parameters change the architecture (a hidden size, a number of layers, a dropout
rate: anything that makes the built modules different programs, checked with the same member
check as :func:`wide_compiler.compile`) are grouped: each fused run holds trials of one
architecture only, so no member ever runs with another member's value.

Optuna is optional: ``import wide_compiler`` never imports it; :func:`optimize` raises an
``ImportError`` naming ``pip install optuna`` when it is missing.

Example:
    >>> import optuna, torch, torch.nn.functional as F, wide_compiler as wc
    >>> from wide_compiler.integrations.optuna import optimize
    >>> optuna.logging.set_verbosity(optuna.logging.WARNING)
    >>> g = torch.Generator().manual_seed(0)                 # a toy regression task
    >>> x = torch.randn(256, 4, generator=g); y = x.sum(1, keepdim=True).sin()
    >>> def build(trial):                                     # ONE member from its trial
    ...     trial.suggest_float("lr", 1e-3, 1e-1, log=True)   # read by the optimizer below
    ...     h = trial.suggest_categorical("hidden", [16, 32])  # an architecture key: grouped
    ...     return torch.nn.Sequential(torch.nn.Linear(4, h), torch.nn.Tanh(), torch.nn.Linear(h, 1))
    >>> def train_step(run):                                  # one step for ALL members
    ...     losses = wc.optim.member_losses(F.mse_loss, run.model(x.expand(run.n, *x.shape)), y,
    ...                                     shared_target=True)
    ...     run.optimizer.zero_grad(); losses.sum().backward(); run.optimizer.step()
    ...     return losses.detach()                            # each member's value at this step
    >>> study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0),
    ...                             pruner=optuna.pruners.MedianPruner(n_warmup_steps=5))
    >>> trials = optimize(study, build, train_step, n_trials=8, n_members=4, n_steps=20,
    ...                   optimizer=lambda params, hp: wc.optim.Adam(params, lr=hp["lr"]),
    ...                   sample_input=x[:2])
    >>> len(study.trials), study.best_value < 0.5
    (8, True)
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..config import WideConfig
from ._common import installed, require

__all__ = ["FusedRun", "optimize", "optuna_available"]

INSTALL_HINT = "wide_compiler.integrations.optuna needs Optuna: pip install optuna (or: pip install \"wide_compiler[optuna]\")"

log = logging.getLogger(__name__)


def optuna_available() -> bool:
    """Whether the ``optuna`` package is installed, checked without importing it."""
    return installed("optuna")


def _require_optuna() -> Any:
    return require("optuna", INSTALL_HINT)


class _Columns(Mapping):
    """``hp[key]``: the N members' values of trial parameter ``key`` (one list), for the optimizer
    factory. A key some member's trial lacks is a ``KeyError`` naming the member and its trial,
    never a silent shared or missing value."""

    def __init__(self, params: Sequence[Mapping[str, Any]], numbers_: Sequence[int]) -> None:
        self._params, self._numbers = list(params), list(numbers_)

    def __getitem__(self, key: str) -> list[Any]:
        for i, p in enumerate(self._params):
            if key not in p:
                raise KeyError(f"wide_compiler.integrations.optuna: member {i} (trial "
                               f"{self._numbers[i]}) has no parameter {key!r}; its parameters are "
                               f"{sorted(p)} (suggest {key!r} in build(trial) for every trial)")
        return [p[key] for p in self._params]

    def get(self, key: str, default: Any = None) -> Any:
        """``hp[key]``, or ``default`` when NO member has ``key``; a key that some members have
        and others lack is a ``KeyError`` (a default would silently stand in for them)."""
        if not any(key in p for p in self._params):
            return default
        return self[key]

    def __contains__(self, key: object) -> bool:
        return all(key in p for p in self._params)

    def __iter__(self) -> Iterator[str]:
        seen: dict[str, None] = {}
        for p in self._params:
            seen.update(dict.fromkeys(p))
        return iter(seen)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class FusedRun:
    """The trials of one fused run, what ``train_step(run)`` receives.

    Attributes:
        model: the :class:`~wide_compiler.WideModel` (member ``i`` is trial ``trials[i]``).
        optimizer: the per-member optimizer made by ``optimizer(params, hp)``.
        trials: the N ``optuna.Trial`` objects (read ``run.trials[i].params`` for per-member
            values that are not the optimizer's, e.g. a loss weight).
        n: the number of members.
        step: the index of the step being run (0-based; what ``trial.report`` gets).
        active: ``active[i]`` is False once member ``i`` is pruned (it is frozen).
        seeds: member ``i``'s initial weights are ``build(trials[i])`` under
            ``torch.manual_seed(seeds[i])`` (also ``trials[i].user_attrs["wide_seed"]``).
        values: each member's latest value (None before its first step).
    """

    def __init__(self, model: Any, optimizer: Any, trials: list[Any], seeds: list[int]) -> None:
        self.model, self.optimizer, self.trials, self.seeds = model, optimizer, trials, seeds
        self.n = len(trials)
        self.step = 0
        self.active = [True] * self.n
        self.values: list[float | None] = [None] * self.n
        self._frozen: dict[int, tuple[dict[str, torch.Tensor], list[tuple[dict, str, torch.Tensor | None]]]] = {}

    # -- freezing a pruned member ------------------------------------------------------------------
    def _member_state_tensors(self) -> Iterator[tuple[dict, str, torch.Tensor]]:
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                st = self.optimizer.state.get(p)
                for k, v in (st or {}).items():
                    if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == self.n:
                        yield st, k, v

    @torch.no_grad()
    def freeze(self, i: int) -> None:
        """Member ``i`` stops changing: its weights, buffers and optimizer state (every per-member
        state tensor's slice ``[i]``) are put back as they are now after every later step."""
        if i in self._frozen:
            return
        opt = [(st, k, v[i].clone()) for st, k, v in self._member_state_tensors()]
        self._frozen[i] = (self.model.member_state_dict(i), opt)
        self.active[i] = False

    @torch.no_grad()
    def _restore_frozen(self) -> None:
        for i, (weights, opt) in self._frozen.items():
            self.model.load_member_state_dict(i, weights)
            saved = {(id(st), k): v for st, k, v in opt}
            for st, k, v in self._member_state_tensors():
                old = saved.get((id(st), k))
                if old is None:      # state created after the member was frozen: it had none
                    v[i].zero_()
                else:
                    v[i].copy_(old)


def _values(raw: Any, n: int) -> list[float]:
    """``train_step``'s result as n floats (a tensor [N] or a sequence of N real numbers)."""
    where = "wide_compiler.integrations.optuna: train_step returned"
    if isinstance(raw, torch.Tensor):
        if raw.is_complex() or raw.numel() != n:
            raise ValueError(f"{where} a tensor of shape {list(raw.shape)} ({raw.dtype}); expected "
                             f"one real value per member: shape [{n}]")
        return raw.detach().to("cpu", torch.float64).reshape(-1).tolist()
    if isinstance(raw, (str, bytes, Mapping)) or not isinstance(raw, Sequence):
        raise TypeError(f"{where} a {type(raw).__name__}; expected one value per member ({n}): a "
                        "tensor [N] or a list of N floats")
    if len(raw) != n:
        raise ValueError(f"{where} {len(raw)} values; expected one per member ({n})")
    out = []
    for i, v in enumerate(raw):
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"{where} {v!r} for member {i}; expected a real number")
        out.append(float(v))
    return out


def _same_architecture(a: nn.Module, b: nn.Module) -> str | None:
    """None when ``a`` and ``b`` can be members of one wide model, else why not."""
    from ..errors import ArchitectureMismatchError
    from ..fx.member_checks import check_members

    try:
        constants = check_members([a, b])
    except ArchitectureMismatchError as e:
        return str(e).replace("member 1:", "").strip()
    if constants:  # per-member constants would fuse, but runs stay grouped by every attribute
        return "; ".join(f"{k} is {v[1]!r}, not {v[0]!r}" for k, v in constants.items())
    return None


def _build(build: Callable[[Any], nn.Module], trial: Any, seed: int) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build(trial)
    if not isinstance(model, nn.Module):
        raise TypeError(f"wide_compiler.integrations.optuna: build(trial) returned a "
                        f"{type(model).__name__} for trial {trial.number}; expected an nn.Module "
                        "(one member)")
    return model


def optimize(
    study: Any,
    build: Callable[[Any], nn.Module],
    train_step: Callable[[FusedRun], Any],
    *,
    n_trials: int,
    n_steps: int,
    optimizer: Callable[[Any, Mapping[str, list]], Any],
    sample_input: Any,
    n_members: int = 8,
    seed: int = 0,
    wide_config: WideConfig | None = None,
    callbacks: Sequence[Callable[[Any, Any], None]] | None = None,
    on_member_done: Callable[[FusedRun, int, Any], None] | None = None,
    catch: tuple[type[Exception], ...] = (),
) -> list[Any]:
    """Run ``n_trials`` new trials of ``study``, ``n_members`` at a time fused into one wide model.

    What an Optuna objective does for one trial, split in three:

    Args:
        study: an ``optuna.Study`` (single objective; its sampler and pruner are used as they are).
        build: ``trial -> nn.Module``, ONE member built from its trial: the ``trial.suggest_*``
            calls go here (all of them, the optimizer's included, so that every parameter is known
            before the run starts). Called under ``torch.manual_seed(seed + trial.number)``.
        train_step: ``run -> values``, one training step for all members of the
            :class:`FusedRun` ``run`` (forward, ``backward``, ``run.optimizer.step()``); returns each
            member's value at this step (a tensor ``[N]`` or N floats), reported as
            ``trials[i].report(values[i], run.step)``.
        n_trials: trials to ask the study for in this call.
        n_steps: steps per trial; a trial that is not pruned completes after ``n_steps`` steps
            with its last value (``study.tell(trial, value)``).
        optimizer: ``(params, hp) -> optimizer``; ``hp[key]`` is the list of the N trials'
            values of parameter ``key`` (``trial.params``), e.g. ``lambda params, hp:
            wc.optim.AdamW(params, lr=hp["lr"], weight_decay=hp["wd"])``; keys may be renamed or
            transformed (``lr=[10 ** x for x in hp["log_lr"]]``).
        sample_input: one member's input for :func:`wide_compiler.compile`, or ``trial -> input``
            (called with a run's first trial) when it depends on the architecture.
        n_members: members per fused run (the last runs of each architecture may have fewer).
        seed: member ``i``'s weights are ``build(trial)`` under ``torch.manual_seed(seed +
            trial.number)`` (recorded as ``trial.user_attrs["wide_seed"]``), so a trial can be
            trained again alone.
        wide_config: :class:`WideConfig` of the fused models (default ``WideConfig.fast()``).
        callbacks: Optuna-style ``callback(study, frozen_trial)``, called after each trial is told.
        on_member_done: ``f(run, i, frozen_trial)``, called when member ``i``'s trial has been
            told (pruned or complete), e.g. to keep its weights: ``run.model.member(i)``.
        catch: exception types of ``train_step`` that fail the run's running trials
            (``TrialState.FAIL``) and go on with the next run; others fail them and propagate.

    Returns:
        The ``FrozenTrial`` of every trial this call ran, in trial order.

    Trials are asked one by one and built right away (the sampler sees every trial asked before,
    as with parallel workers); a trial joins the pending run of its architecture (the same
    program as :func:`wide_compiler.compile` requires: module types, sizes, attributes such as a
    dropout rate), and a run starts when it has ``n_members`` trials. Each step, every running
    member reports first, then each asks ``trial.should_prune()`` (a pruner comparing trials sees
    the whole run's values at that step). A pruned member is told ``TrialState.PRUNED``
    (Optuna records its last value) and frozen; the run ends when every member is pruned or
    complete. A NaN final value fails the trial, as in ``study.optimize``.

    Example:
        >>> import optuna, torch, wide_compiler as wc
        >>> from wide_compiler.integrations.optuna import optimize
        >>> optuna.logging.set_verbosity(optuna.logging.WARNING)
        >>> x = torch.randn(64, 3); y = x @ torch.tensor([[1.0], [-2.0], [0.5]])
        >>> def train_step(run):
        ...     losses = (run.model(x.expand(run.n, *x.shape)) - y).pow(2).mean(dim=(1, 2))
        ...     run.optimizer.zero_grad(); losses.sum().backward(); run.optimizer.step()
        ...     return losses.detach()
        >>> def build(trial):
        ...     trial.suggest_float("log_lr", -3, -1)            # the optimizer's, per member
        ...     return torch.nn.Linear(3, 1)
        >>> study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
        >>> done = optimize(study, build, train_step, n_trials=4, n_members=4, n_steps=30,
        ...                 sample_input=x[:2], optimizer=lambda params, hp: wc.optim.SGD(
        ...                     params, lr=[10 ** v for v in hp["log_lr"]]))
        >>> [t.state.name for t in done]
        ['COMPLETE', 'COMPLETE', 'COMPLETE', 'COMPLETE']
    """
    optuna = _require_optuna()
    if len(study.directions) != 1:
        raise ValueError("wide_compiler.integrations.optuna: optimize() supports single-objective "
                         f"studies (reports and pruning are per value); the study has "
                         f"{len(study.directions)} objectives")
    for name, v, low in (("n_trials", n_trials, 0), ("n_steps", n_steps, 1), ("n_members", n_members, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"wide_compiler.integrations.optuna: {name} must be an int >= {low}, got {v!r}")
    wide_config = wide_config or WideConfig.fast()
    pending: list[list[tuple[Any, nn.Module, int]]] = []    # groups of (trial, module, seed)
    numbers_done: list[int] = []

    def start(group: list[tuple[Any, nn.Module, int]]) -> None:
        numbers_done.extend(t.number for t, _, _ in group)
        _run_group(optuna, study, group, train_step, n_steps=n_steps, optimizer=optimizer,
                   sample_input=sample_input, wide_config=wide_config,
                   callbacks=list(callbacks or []), on_member_done=on_member_done, catch=catch)

    def fail_pending() -> None:      # trials asked but not run: never left RUNNING
        for group in pending:
            for t, _, _ in group:
                study.tell(t, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
        pending.clear()

    try:
        for _ in range(n_trials):
            trial = study.ask()
            member_seed = int(seed) + trial.number
            trial.set_user_attr("wide_seed", member_seed)
            try:
                model = _build(build, trial, member_seed)
            except BaseException:
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
                raise
            for group in pending:
                why = _same_architecture(group[0][1], model)
                if why is None:
                    group.append((trial, model, member_seed))
                    break
                differ = sorted(k for k in set(trial.params) | set(group[0][0].params)
                                if trial.params.get(k, "<absent>") != group[0][0].params.get(k, "<absent>"))
                log.debug("trial %d is not in the run of trial %d: %s (parameters that differ: %s)",
                          trial.number, group[0][0].number, why, differ)
            else:
                group = [(trial, model, member_seed)]
                pending.append(group)
            if len(group) == n_members:
                pending.remove(group)
                start(group)
        while pending:
            start(pending.pop(0))
    except BaseException:
        fail_pending()
        raise
    by_number = {t.number: t for t in study.get_trials()}
    return [by_number[k] for k in sorted(numbers_done)]


def _run_group(optuna: Any, study: Any, group: list[tuple[Any, nn.Module, int]],
               train_step: Callable[[FusedRun], Any], *, n_steps: int, optimizer: Callable,
               sample_input: Any, wide_config: WideConfig, callbacks: list, on_member_done: Any,
               catch: tuple[type[Exception], ...]) -> None:
    from ..api import compile as wide_compile
    from ..errors import ArchitectureMismatchError

    TrialState = optuna.trial.TrialState
    trials = [t for t, _, _ in group]
    told: set[int] = set()

    def tell(i: int, run: FusedRun | None, **kwargs: Any) -> None:
        frozen = study.tell(trials[i], **kwargs)
        told.add(i)
        if run is not None and on_member_done is not None:
            on_member_done(run, i, frozen)
        for cb in callbacks:
            cb(study, frozen)

    def fail_running() -> None:
        for i in range(len(trials)):
            if i not in told:
                tell(i, None, state=TrialState.FAIL)

    try:
        sample = sample_input(trials[0]) if callable(sample_input) else sample_input
        try:
            model = wide_compile([m for _, m, _ in group], sample, config=wide_config)
        except ArchitectureMismatchError as e:
            where = ", ".join(f"member {i} = trial {t.number} {t.params}" for i, t in enumerate(trials))
            raise ArchitectureMismatchError(f"wide_compiler.integrations.optuna: the trials of one "
                                            f"fused run are not one program ({where}): {e}") from e
        opt = optimizer(model.parameters(), _Columns([t.params for t in trials],
                                                     [t.number for t in trials]))
        run = FusedRun(model, opt, trials, [s for _, _, s in group])
    except BaseException:
        fail_running()
        raise
    log.info("fused run of trials %s (%d members)", [t.number for t in trials], run.n)
    try:
        for step in range(n_steps):
            if not any(run.active):
                break
            run.step = step
            values = _values(train_step(run), run.n)
            run._restore_frozen()
            live = [i for i in range(run.n) if run.active[i]]
            for i in live:
                run.values[i] = values[i]
                trials[i].report(values[i], step)
            for i in live:
                if trials[i].should_prune():
                    tell(i, run, state=TrialState.PRUNED)
                    run.freeze(i)
        for i in range(run.n):
            if run.active[i]:
                v = run.values[i]
                if v is None or math.isnan(v):
                    log.warning("trial %d failed: its final value is %s", trials[i].number, v)
                    tell(i, run, state=TrialState.FAIL)
                else:
                    tell(i, run, values=v)
                run.freeze(i)
    except BaseException as e:
        fail_running()
        if isinstance(e, Exception) and isinstance(e, catch):
            log.warning("fused run of trials %s failed: %r", [t.number for t in trials], e)
            return
        raise
