"""Ray Tune sweeps where ONE trial trains N hyperparameter configurations as ONE wide model.

A Tune trial normally trains one model with one configuration. :func:`fused_trainable` makes a
trial that draws ``n_members`` configurations from a per-member search space, fuses the N models
into one :class:`~wide_compiler.WideModel` with a per-member optimizer (:mod:`wide_compiler.optim`:
every hyperparameter has one value per member) and trains them together: one forward, one
backward and one fused optimizer step per batch for all N. Every ``tune.report`` carries N
results (``members/<i>/<metric>``, the member's hyperparameters, age and status) and the trial's
best (``<metric>``, ``best_config``), so Tune's own schedulers and searchers keep working at
the trial level.

Inside the trial, a member scheduler acts on the MEMBERS, the way Tune's schedulers act on trials:

* :class:`MemberASHA`: asynchronous successive halving. A member below the rung cutoff is stopped;
  its slot restarts with a fresh configuration from the search space (``num_member_samples`` >
  ``n_members``) or is frozen (its weights kept) once that budget is spent.
* :class:`MemberPBT`: population-based training. The bottom quantile of members copies a top
  member (weights, buffers, optimizer state, hyperparameters: ``WideModel.copy_member_weights``)
  and perturbs its hyperparameters (``optimizer.set_member_hyperparameters``), in place.

Checkpoints (``ray.tune.Checkpoint``) hold every member's ``state_dict`` (the original module's
keys, loadable into it), the wide optimizer's state, each member's configuration and record, the
scheduler's state and the random-number generators: a restored trial continues bit-for-bit
(:func:`load_checkpoint`, :func:`best_model`). They are plain data: tensors, and everything else
(configurations, records, generator states) as JSON text, read back with
``torch.load(weights_only=True)``, so loading a checkpoint runs no code. Configurations (and a
custom member scheduler's state) must therefore be plain values: numbers, strings, None, lists,
tuples, dicts (numpy scalars are saved as Python numbers); anything else is refused when the
checkpoint is written, naming where it is.

This module is the Ray Tune adapter: :func:`fused_trainable` and the checkpoint helpers. The
population itself and its schedulers (:class:`Population`, :class:`MemberASHA`,
:class:`MemberPBT`, :class:`MemberScheduler`, :func:`sample_member_config`) live in
:mod:`wide_compiler.population`, which needs no Ray and runs in a plain Python loop; they are
importable from here too. Ray is optional: this module imports without it, and
:func:`fused_trainable` raises an ``ImportError`` naming ``pip install "ray[tune]"`` when it is
missing.

Example (needs Ray):
    >>> import torch, torch.nn.functional as F, wide_compiler as wc
    >>> from ray import tune                                                  # doctest: +SKIP
    >>> from wide_compiler.integrations import ray as wcray
    >>> x, y = torch.randn(256, 8), torch.randn(256, 1)
    >>> def build_model(config):                  # ONE member; the same architecture for all
    ...     return torch.nn.Sequential(torch.nn.Linear(8, config["hidden"]), torch.nn.ReLU(),
    ...                                torch.nn.Linear(config["hidden"], 1))
    >>> def train_step(pop):                      # one iteration for all members; metrics [N]
    ...     losses = wc.optim.member_losses(F.mse_loss, pop.model(x.expand(pop.n, *x.shape)),
    ...                                     y, shared_target=True)
    ...     pop.optimizer.zero_grad(); losses.sum().backward(); pop.optimizer.step()
    ...     return {"loss": losses.detach()}
    >>> trainable = wcray.fused_trainable(                                    # doctest: +SKIP
    ...     build_model, train_step, n_members=16, max_iterations=50,
    ...     member_space={"lr": tune.loguniform(1e-4, 1e-1), "momentum": tune.uniform(0, 0.95)},
    ...     optimizer=lambda params, hp: wc.optim.SGD(params, lr=hp["lr"], momentum=hp["momentum"]),
    ...     sample_input=torch.randn(4, 8), metric="loss", mode="min",
    ...     member_scheduler=wcray.MemberASHA(grace_period=5, reduction_factor=2),
    ...     num_member_samples=64)               # stopped members restart with new samples
    >>> tuner = tune.Tuner(trainable, param_space={"hidden": tune.choice([16, 32])},  # doctest: +SKIP
    ...                    tune_config=tune.TuneConfig(num_samples=4))
    >>> best = tuner.fit().get_best_result(metric="loss", mode="min")        # doctest: +SKIP
    >>> best.metrics["best_config"]                                           # doctest: +SKIP
    {'hidden': 32, 'lr': 0.031..., 'momentum': 0.83...}
    >>> model = wcray.best_model(best.checkpoint, build_model)  # an ordinary nn.Sequential  # doctest: +SKIP
"""

from __future__ import annotations

import copy
import os
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from .. import population
from ..config import WideConfig
from ..population import (
    CHECKPOINT_FILE,
    MemberASHA,
    MemberPBT,
    MemberScheduler,
    Population,
    _best_of,
    _read_checkpoint,
    _seed_of,
    sample_member_config,
)
from ._common import installed, require

# Ray's own entry points, and the whole population API (re-exported: importable from here too).
__all__ = ["best_member", "best_model", "fused_trainable", "load_checkpoint", "ray_available"]
__all__ += population.__all__

INSTALL_HINT = 'wide_compiler.integrations.ray needs Ray Tune: pip install "ray[tune]"'


def ray_available() -> bool:
    """Whether the ``ray`` package is installed, checked without importing it (``ray.tune`` also
    needs the ``ray[tune]`` extras; :func:`fused_trainable` raises an ``ImportError`` naming them)."""
    return installed("ray")


def _require_tune() -> Any:
    return require("ray.tune", INSTALL_HINT)


# ------------------------------------------------------------------------------------------------
# The Tune trainable and checkpoint helpers
# ------------------------------------------------------------------------------------------------
def fused_trainable(
    build_model: Callable[[dict], nn.Module],
    train_step: Callable[[Population], Mapping[str, Any]],
    *,
    optimizer: Callable[[Any, dict[str, list]], Any],
    sample_input: Any,
    metric: str,
    mode: str = "min",
    n_members: int = 8,
    member_space: Mapping[str, Any] | None = None,
    max_iterations: int | None = None,
    member_scheduler: MemberScheduler | Callable[[], MemberScheduler] | None = None,
    num_member_samples: int | None = None,
    checkpoint_every: int = 10,
    wide_config: WideConfig | None = None,
) -> Callable[[dict], None]:
    """A Ray Tune function trainable whose every trial trains ``n_members`` configurations fused.

    Args:
        build_model: ``config -> nn.Module``, ONE member built from its configuration (trial-level
            keys merged with the member's own). All members of a trial must have the same
            architecture: architecture keys belong in the Tuner's ``param_space`` (one value per
            trial), per-member keys (learning rates, regularisation, seeds...) in ``member_space``.
        train_step: ``pop -> {name: per-member values}``, one iteration (a batch, an epoch...) for
            all members of the :class:`Population` ``pop``; returns tensors ``[N]`` (or lists of N
            numbers), ``metric`` among them.
        optimizer: ``(params, hp) -> WideOptimizer``; ``hp[key]`` is the list of the N members'
            values of a config key, e.g. ``lambda params, hp: wc.optim.AdamW(params, lr=hp["lr"],
            weight_decay=hp["wd"])``; keys may be renamed or transformed (``lr=[10 ** x for x
            in hp["log_lr"]]``). When a member restarts or a scheduler changes its configuration,
            the factory is called again with that member's configuration alone (1-element lists)
            on throwaway 1-member parameters, and the hyperparameters it gives are pushed into the
            optimizer for that member: it must have no side effects.
        sample_input: one member's input for :func:`wide_compiler.compile` (or
            ``trial_config -> input``).
        metric, mode: the per-member metric and ``"min"`` / ``"max"``. The report's ``metric`` is
            the trial's best member (finished or running), what Tune's schedulers compare.
        n_members: members trained together (slots of the trial).
        member_space: per-member search space (Tune domains, callables ``f(rng)`` of the
            trial's seeded ``numpy.random.Generator``, constants); each member is one sample. A trial's ``config["members"]`` (a list of
            dicts) gives the first members explicitly; ``config["seed"]`` seeds the trial
            (default: derived from the trial id).
        max_iterations: a member's training budget, in iterations; it then completes.
        member_scheduler: :class:`MemberASHA`, :class:`MemberPBT`, another
            :class:`MemberScheduler`, or a factory of one (a fresh one per trial).
        num_member_samples: configurations a trial may try in all (default ``n_members``);
            members stopped by the scheduler or completed are replaced by new samples until it is
            reached. The trial ends when no member is training any more.
        checkpoint_every: iterations between checkpoints (and always at the end); 0: at the end only.
        wide_config: :class:`WideConfig` of the fused model (default ``WideConfig.fast()``).

    Each ``tune.report`` has ``members/<i>/<name>`` for every metric of member slot ``i``,
    ``members/<i>/config/<key>``, ``members/<i>/id`` (a configuration's number in the trial),
    ``members/<i>/age``, ``members/<i>/active``, ``members/<i>/seed`` (its initial weights are
    ``build_model(config)`` under ``torch.manual_seed(seed)``), the trial's best (``<metric>``, ``best_member``,
    ``best_config``) and counters (``members_started``, ``members_finished``,
    ``members_active``). Checkpoints: :func:`load_checkpoint`, :func:`best_model`.

    Member configurations are random samples of ``member_space`` drawn inside the trial (Tune's
    searchers, e.g. Optuna, choose the trial-level keys only). Tune's own schedulers act on whole
    trials as usual (a trial's ``metric`` is its best member's); Tune's PBT restores a trial from
    another trial's checkpoint, members and their configurations included, with the restoring
    trial's (perturbed) trial-level keys and its own random generators
    (:meth:`Population.from_state`).

    Example:
        >>> trainable = fused_trainable(build_model, train_step, n_members=16,   # doctest: +SKIP
        ...     member_space={"lr": tune.loguniform(1e-4, 1e-1)}, max_iterations=100,
        ...     optimizer=lambda params, hp: wc.optim.Adam(params, lr=hp["lr"]),
        ...     sample_input=torch.randn(8, 2), metric="val_loss",
        ...     member_scheduler=lambda: MemberPBT(perturbation_interval=10,
        ...                                        hyperparam_mutations={"lr": tune.loguniform(1e-4, 1e-1)}))
        >>> tune.Tuner(trainable, tune_config=tune.TuneConfig(num_samples=4)).fit()   # doctest: +SKIP
    """
    tune = _require_tune()
    if checkpoint_every < 0:
        raise ValueError("fused_trainable: checkpoint_every must be >= 0")
    scheduler_proto = member_scheduler

    def new_scheduler() -> MemberScheduler | None:
        if scheduler_proto is None:
            return None
        if isinstance(scheduler_proto, MemberScheduler):
            return copy.deepcopy(scheduler_proto)
        return scheduler_proto()

    if max_iterations is None:
        probe = new_scheduler()
        if getattr(probe, "max_t", None) is None:
            raise ValueError("fused_trainable: give max_iterations (a member's budget in iterations)")

    def wide_trainable(config: dict) -> None:
        config = dict(config)
        explicit = config.pop("members", None)
        seed = config.pop("seed", None)
        trial_id = tune.get_context().get_trial_id() or "local"
        if seed is None:
            seed = _seed_of("wide_compiler", trial_id)
        kwargs = dict(sample_input=sample_input, scheduler=new_scheduler(),
                      max_iterations=max_iterations, member_space=member_space,
                      wide_config=wide_config, trial_config=config, trial_id=trial_id, seed=int(seed))
        checkpoint = tune.get_checkpoint()
        if checkpoint is not None:
            pop = Population.from_state(load_checkpoint(checkpoint), build_model, optimizer, **kwargs)
        else:
            pop = Population.create(build_model, optimizer, n_members=n_members, metric=metric,
                                    mode=mode, member_configs=explicit,
                                    num_member_samples=num_member_samples, **kwargs)
        while not pop.done:
            report = pop.step(train_step)
            if pop.done or (checkpoint_every and pop.iteration % checkpoint_every == 0):
                with tempfile.TemporaryDirectory() as d:
                    pop.save(d)
                    tune.report(report, checkpoint=tune.Checkpoint.from_directory(d))
            else:
                tune.report(report)

    wide_trainable.__name__ = wide_trainable.__qualname__ = f"wide_{getattr(build_model, '__name__', 'model')}"
    return wide_trainable


def load_checkpoint(checkpoint: Any, *, allow_pickle: bool = False) -> dict[str, Any]:
    """The :meth:`Population.state_dict` in a checkpoint of :func:`fused_trainable` (a
    ``ray.tune.Checkpoint``, a ``ray.train.Checkpoint``, or its directory). ``["members"][i]`` is
    member slot ``i``'s ``state_dict`` (loadable into ``build_model(["configs"][i])``),
    ``["finished"]`` the records of the members done, ``["best"]`` the best finished member with
    its ``state_dict``.

    The file is read with ``torch.load(weights_only=True)``: tensors and plain containers only,
    so a crafted checkpoint cannot run code. Tensors are loaded on the CPU (``from_state`` and
    ``load_state_dict`` move them to the model's device). Checkpoints of older wide_compiler versions (the
    state pickled as it was) load the same way when their values are plain; one holding other
    Python objects is refused with a ``ValueError`` saying so, unless ``allow_pickle=True``
    (``torch.load(weights_only=False)``, which runs any code the file holds: only for files you
    trust; logged as a warning)."""
    if callable(getattr(checkpoint, "as_directory", None)):        # a Ray checkpoint
        with checkpoint.as_directory() as d:
            return _read_checkpoint(os.path.join(d, CHECKPOINT_FILE), allow_pickle)
    if isinstance(checkpoint, (str, os.PathLike)):
        return _read_checkpoint(os.path.join(os.fspath(checkpoint), CHECKPOINT_FILE), allow_pickle)
    raise TypeError(f"load_checkpoint: expected a ray Checkpoint or a directory, got "
                    f"{type(checkpoint).__name__}")


def best_member(checkpoint: Any) -> dict[str, Any]:
    """The best member of a checkpointed fused trial, finished or still training when the
    checkpoint was written: ``{"config", "value", "metrics", "state_dict", "id", ...}``.
    ``checkpoint``: what :func:`load_checkpoint` takes, or the state it returned (e.g.
    ``load_checkpoint(old, allow_pickle=True)`` for an older pickled checkpoint you trust)."""
    state = checkpoint if isinstance(checkpoint, Mapping) else load_checkpoint(checkpoint)
    best = _best_of(state)
    if best is None:
        raise ValueError("best_member: the checkpoint has no member with a result yet")
    if "state_dict" not in best:                                     # a running member
        best = {**best, "state_dict": state["members"][best["slot"]]}
    return best


def best_model(checkpoint: Any, build_model: Callable[[dict], nn.Module]) -> nn.Module:
    """The best member of a checkpointed fused trial as an ordinary module:
    ``build_model(config)`` loaded with its weights (its record: :func:`best_member`)."""
    best = best_member(checkpoint)
    model = build_model(dict(best["config"]))
    model.load_state_dict(best["state_dict"])
    return model
