"""A population of N hyperparameter configurations trained as ONE wide model, without Ray.

:class:`Population` holds the N members of one sweep: the fused :class:`~wide_compiler.WideModel`,
its per-member optimizer (:mod:`wide_compiler.optim`: every hyperparameter has one value per
member), each member's configuration and record, and the member operations a scheduler uses:
:meth:`~Population.stop`, :meth:`~Population.restart`, :meth:`~Population.exploit` (member ``dst``
becomes a copy of member ``src``: weights, buffers, optimizer state, hyperparameters) and
:meth:`~Population.set_hyperparameters` (explore). :meth:`Population.step` runs one iteration
of a user's ``train_step`` and lets the member scheduler act:

* :class:`MemberASHA`: asynchronous successive halving over the members. A member below the rung
  cutoff is stopped; its slot restarts with a fresh configuration from the member space or is
  frozen (its weights kept) once the population's ``num_member_samples`` is spent.
* :class:`MemberPBT`: population-based training over the members. The bottom quantile copies a
  top member (exploit) and perturbs its hyperparameters (explore), in place.
* :class:`MemberScheduler`: the base class, for schedulers of your own.

:meth:`Population.state_dict` / :meth:`Population.from_state` continue a population bit for bit
(the random generators included); :meth:`Population.save` writes it as plain data (tensors, and
everything else as JSON text) that ``torch.load(weights_only=True)`` reads, so loading one runs no
code.

Nothing here needs Ray: ``train_step`` and a ``while not pop.done`` loop are enough (see
:class:`Population`). :mod:`wide_compiler.integrations.ray` runs a population inside each Ray
Tune trial (:func:`~wide_compiler.integrations.ray.fused_trainable`) and reads its checkpoints
back (:func:`~wide_compiler.integrations.ray.load_checkpoint`, ``best_model``); its error
messages name it, as they did before this module was split from it.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import numbers
import operator
import os
import pickle
import random
import re
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ._files import atomic_write
from .config import WideConfig

__all__ = [
    "CHECKPOINT_FILE",
    "MemberASHA",
    "MemberPBT",
    "MemberScheduler",
    "Population",
    "sample_member_config",
]

CHECKPOINT_FILE = "wide_population.pt"        # the file Population.save writes in its directory
_FORMAT = 1                                   # the structure of Population.state_dict()
_FILE_FORMAT = "wide_compiler.population"     # the checkpoint file: tensors + JSON text
_FILE_VERSION = 2                             # (version 1: the state_dict pickled as it is)

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------
# Search spaces
# ------------------------------------------------------------------------------------------------
def _is_domain(v: Any) -> bool:
    """A Ray Tune search domain (``ray.tune.search.sample.Domain``), recognised without importing ray."""
    return any(c.__name__ == "Domain" and c.__module__.startswith("ray.") for c in type(v).__mro__)


def sample_member_config(space: Mapping[str, Any], rng: Any) -> dict[str, Any]:
    """One member's configuration drawn from ``space``.

    Values may be Ray Tune domains (``tune.loguniform(1e-4, 1e-1)``, ``tune.choice([...])``, ...),
    callables ``f(rng)`` taking a ``numpy.random.Generator``, nested dicts, or constants.
    ``tune.grid_search`` has no meaning per member and is refused (put it in the Tuner's
    ``param_space``: a trial-level key, shared by the trial's members).

    Example:
        >>> import numpy as np
        >>> space = {"lr": lambda rng: float(10 ** rng.uniform(-4, -1)), "wd": 0.0}
        >>> cfg = sample_member_config(space, np.random.default_rng(0))
        >>> sorted(cfg), 1e-4 <= cfg["lr"] <= 1e-1
        (['lr', 'wd'], True)
    """
    out: dict[str, Any] = {}
    for key, v in space.items():
        if isinstance(v, Mapping):
            if "grid_search" in v:
                raise ValueError(
                    f"wide_compiler.integrations.ray: member_space[{key!r}] is a grid_search; a "
                    "member's values are sampled, so put grid searches in the Tuner's param_space "
                    "(trial-level keys shared by the trial's members)")
            out[key] = sample_member_config(v, rng)
        elif _is_domain(v):
            out[key] = v.sample(random_state=rng)
        elif callable(v):
            out[key] = v(rng)
        else:
            out[key] = copy.deepcopy(v)
    return out


def _missing_mutation_keys(config: Mapping[str, Any], mutations: Mapping[str, Any],
                           prefix: str = "") -> list[str]:
    """The keys of ``mutations`` (nested ones as ``a/b``) that ``config`` lacks."""
    out = []
    for key, dist in mutations.items():
        if key not in config:
            out.append(prefix + key)
        elif isinstance(dist, Mapping):
            sub = config[key]
            out += (_missing_mutation_keys(sub, dist, f"{prefix}{key}/") if isinstance(sub, Mapping)
                    else [prefix + key])
    return out


def _explore(config: Mapping[str, Any], mutations: Mapping[str, Any], rng: random.Random,
             np_rng: Any, resample_probability: float,
             factors: Sequence[float]) -> tuple[dict[str, Any], dict[str, str]]:
    """Ray Tune PBT's explore step, on one member's config, with seeded generators (a callable
    mutation is called ``dist(np_rng)``, like a ``member_space`` callable)."""
    new = copy.deepcopy(dict(config))
    ops: dict[str, Any] = {}
    for key, dist in mutations.items():
        old = config[key]       # keys checked by MemberPBT (_missing_mutation_keys) beforehand
        if isinstance(dist, Mapping):
            new[key], ops[key] = _explore(old, dist, rng, np_rng, resample_probability, factors)
            continue
        if isinstance(dist, (list, tuple)):
            if rng.random() < resample_probability or old not in dist:
                new[key], ops[key] = rng.choice(list(dist)), "resample"
            else:
                i = list(dist).index(old)
                j = min(max(i + rng.choice([-1, 1]), 0), len(dist) - 1)
                new[key], ops[key] = dist[j], f"shift {j - i:+d}"
            continue
        if not (_is_domain(dist) or callable(dist)):
            raise ValueError(f"wide_compiler MemberPBT: mutation of {key!r} is a "
                             f"{type(dist).__name__}; expected a tune domain, a list or a callable")
        if rng.random() < resample_probability:
            new[key] = dist.sample(random_state=np_rng) if _is_domain(dist) else dist(np_rng)
            ops[key] = "resample"
        else:
            f = rng.choice(list(factors))
            new[key], ops[key] = old * f, f"* {f}"
        if isinstance(old, bool):
            new[key] = bool(new[key])
        elif isinstance(old, int):
            new[key] = int(round(new[key]))
    return new, ops


# ------------------------------------------------------------------------------------------------
# The population of one fused trial
# ------------------------------------------------------------------------------------------------
def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _sort_key(v: Any, mode: str) -> float:
    """Smaller is better, whatever the mode; NaN and missing values are the worst."""
    if not _finite(v):
        return math.inf
    return v if mode == "min" else -v


def _member_record(s: Mapping[str, Any], i: int, status: str) -> dict[str, Any]:
    """Slot ``i``'s member record; ``s``: a Population's ``vars()`` or its ``state_dict()``."""
    return {"id": s["member_ids"][i], "slot": i, "config": copy.deepcopy(s["configs"][i]),
            "seed": s["seeds"][i], "iterations": s["ages"][i], "status": status,
            "value": s["last"][i].get(s["metric"]), "metrics": dict(s["last"][i])}


def _best_of(s: Mapping[str, Any]) -> dict[str, Any] | None:
    """The best of the best finished member and the running members with a result (None if
    none has one); ``s``: a Population's ``vars()`` or its ``state_dict()``."""
    cands = [] if s["best"] is None else [s["best"]]
    cands += [_member_record(s, i, "running") for i in range(s["n"])
              if s["active"][i] and s["last"][i].get(s["metric"]) is not None]
    return min(cands, key=lambda r: _sort_key(r["value"], s["mode"]), default=None)


def _seed_of(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "little")


def _metric_number(name: str, k: int, v: Any, n: int) -> float:
    """Member ``k``'s value of metric ``name`` as a float; ``TypeError`` for anything but a real
    number (an int, a float, a bool, a numpy number, a one-element real tensor)."""
    if isinstance(v, torch.Tensor) and v.numel() == 1 and not v.is_complex():
        return float(v.detach().reshape(()).item())
    if isinstance(v, numbers.Real) and not isinstance(v, (str, bytes)):
        return float(v)
    if type(v).__module__ == "numpy" and getattr(v, "ndim", None) == 0 and v.dtype.kind in "biuf":
        return float(v)                                       # numpy bools, 0-d arrays
    text = repr(v)
    text = text if len(text) <= 40 else text[:37] + "..."
    raise TypeError(f"wide_compiler.integrations.ray: train_step returned metric {name!r} with a "
                    f"{type(v).__name__} ({text}) for member {k}; expected one real number per "
                    f"member ({n}: a tensor [N] or a list of N ints/floats)")


def _per_member(name: str, value: Any, n: int) -> list[float]:
    """Metric ``name`` as ``n`` floats, one per member: from a real tensor with ``n`` elements or
    a sequence of ``n`` real numbers. ``TypeError`` for other types (strings included, which
    would otherwise be read character by character), ``ValueError`` for another count."""
    where = f"wide_compiler.integrations.ray: train_step returned metric {name!r}"
    if isinstance(value, torch.Tensor):
        if value.is_complex():
            raise TypeError(f"{where} as a complex tensor ({value.dtype}); expected real values, "
                            f"one per member ({n})")
        values = value.detach().to("cpu", torch.float64).reshape(-1).tolist()
    elif isinstance(value, numbers.Number) or getattr(value, "ndim", None) == 0:
        raise ValueError(f"{where} = {value!r}, one number; expected one value per member ({n} "
                         f"values: a tensor [N] or a list)")
    elif isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__iter__"):
        text = repr(value)
        text = text if len(text) <= 40 else text[:37] + "..."
        raise TypeError(f"{where} as a {type(value).__name__} ({text}); expected one real number "
                        f"per member ({n}): a tensor [N] or a list of N ints/floats")
    else:
        values = [_metric_number(name, k, v, n) for k, v in enumerate(value)]
    if len(values) != n:
        raise ValueError(f"wide_compiler.integrations.ray: train_step returned {len(values)} values "
                         f"for {name!r}; expected one per member ({n})")
    return values


# ------------------------------------------------------------------------------------------------
# Checkpoint files: tensors + JSON text, readable with torch.load(weights_only=True)
# ------------------------------------------------------------------------------------------------
_TAG = "__wide_compiler__"


def _to_plain(obj: Any, tensors: list[torch.Tensor], where: str) -> Any:
    """``obj`` as JSON-able data: tensors become references into ``tensors``; tuples, dicts with
    keys other than strings (and the tag key) are tagged so they come back as they were; numpy
    scalars become Python numbers. Anything else raises ``TypeError`` naming ``where``."""
    if obj is None or type(obj) in (bool, str, int, float):
        return obj
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach())
        return {_TAG: "tensor", "index": len(tensors) - 1}
    if type(obj).__module__ == "numpy" and getattr(obj, "ndim", None) == 0 and hasattr(obj, "item"):
        value = obj.item()                                   # np.float64(0.1) -> 0.1, np.int64 -> int
        if type(value) in (bool, int, float, str):
            return value
    elif type(obj) is list:
        return [_to_plain(v, tensors, f"{where}[{k}]") for k, v in enumerate(obj)]
    elif type(obj) is tuple:
        return {_TAG: "tuple", "items": [_to_plain(v, tensors, f"{where}[{k}]") for k, v in enumerate(obj)]}
    elif type(obj) in (dict, OrderedDict):
        if all(type(k) is str for k in obj) and _TAG not in obj:
            return {k: _to_plain(v, tensors, f"{where}[{k!r}]") for k, v in obj.items()}
        return {_TAG: "dict", "items": [[_to_plain(k, tensors, f"{where} (key {k!r})"),
                                         _to_plain(v, tensors, f"{where}[{k!r}]")] for k, v in obj.items()]}
    text = repr(obj)
    text = text if len(text) <= 60 else text[:57] + "..."
    raise TypeError(f"wide_compiler.integrations.ray: cannot checkpoint {where}: a "
                    f"{type(obj).__module__}.{type(obj).__qualname__} ({text}). Checkpoints hold "
                    f"tensors and plain values only (None, bool, int, float, str, list, tuple, dict) "
                    f"so that loading one runs no code: use a plain value in the configuration "
                    f"(e.g. a name that build_model maps to the object)")


def _from_plain(obj: Any, tensors: list[torch.Tensor], where: str) -> Any:
    """The inverse of :func:`_to_plain`."""
    if isinstance(obj, list):
        return [_from_plain(v, tensors, where) for v in obj]
    if not isinstance(obj, dict):
        return obj
    tag = obj.get(_TAG)
    if tag is None:
        return {k: _from_plain(v, tensors, where) for k, v in obj.items()}
    if tag == "tensor" and type(obj.get("index")) is int and 0 <= obj["index"] < len(tensors):
        return tensors[obj["index"]]
    if tag == "tuple" and isinstance(obj.get("items"), list):
        return tuple(_from_plain(v, tensors, where) for v in obj["items"])
    if tag == "dict" and isinstance(obj.get("items"), list) and all(
            isinstance(kv, list) and len(kv) == 2 for kv in obj["items"]):
        out = {}
        for k, v in obj["items"]:
            k = _from_plain(k, tensors, where)
            try:
                out[k] = _from_plain(v, tensors, where)
            except TypeError as e:  # an unhashable key (a list): not something _to_plain writes
                raise ValueError(f"wide_compiler.integrations.ray: {where} is corrupt (a dict key "
                                 f"{k!r}: {e})") from e
        return out
    raise ValueError(f"wide_compiler.integrations.ray: {where} is corrupt (an unknown entry "
                     f"{json.dumps(obj)[:80]})")


def _write_checkpoint(state: Mapping[str, Any], path: str) -> None:
    tensors: list[torch.Tensor] = []
    text = json.dumps(_to_plain(dict(state), tensors, "the population state"))
    payload = {"format": _FILE_FORMAT, "version": _FILE_VERSION, "state": text, "tensors": tensors}
    atomic_write(path, lambda f: torch.save(payload, f), "wide_compiler.integrations.ray: Population.save")


def _read_checkpoint(path: str, allow_pickle: bool) -> dict[str, Any]:
    where = f"wide_compiler.integrations.ray: load_checkpoint: {path}"
    if allow_pickle:
        log.warning("%s: loaded with pickle (allow_pickle=True, torch.load(weights_only=False)): "
                    "this runs any code the file holds; do it only for files you trust", where)
        obj = torch.load(path, map_location="cpu", weights_only=False)
    else:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            raise ValueError(
                f"{where} holds Python objects that a safe load (torch.load(weights_only=True)) "
                f"refuses: a checkpoint written by wide_compiler before checkpoints became plain "
                f"data (with non-plain configuration values), or a crafted file. Loading it with "
                f"pickle runs any code it holds: only if you trust the file, pass "
                f"allow_pickle=True. ({str(e).splitlines()[0]})") from e
        except (RuntimeError, EOFError, ValueError) as e:   # truncated or not a torch.save file
            raise ValueError(f"{where} cannot be read as a checkpoint file ({type(e).__name__}: "
                             f"{e})") from e
    if isinstance(obj, dict) and obj.get("format") == _FILE_FORMAT:
        if obj.get("version") != _FILE_VERSION or not isinstance(obj.get("state"), str) \
                or not isinstance(obj.get("tensors"), list):
            raise ValueError(f"{where}: unknown checkpoint file version {obj.get('version')!r} (this "
                             f"wide_compiler reads version {_FILE_VERSION})")
        try:
            plain = json.loads(obj["state"])
        except (ValueError, RecursionError) as e:
            raise ValueError(f"{where}: its state is not valid JSON ({e})") from e
        state = _from_plain(plain, obj["tensors"], where)
    elif isinstance(obj, dict) and obj.get("format") == _FORMAT and "members" in obj:
        state = obj                                   # version 1: the state_dict pickled as it is
    else:
        raise ValueError(f"{where} is not a checkpoint of wide_compiler.integrations.ray")
    if not isinstance(state, dict):
        raise ValueError(f"{where} is not a checkpoint of wide_compiler.integrations.ray")
    return state


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
        self.optimizer = self._make_optimizer(configs)
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
        from .api import compile as wide_compile

        sample = self.sample_input(self.trial_config) if callable(self.sample_input) else self.sample_input
        self.model = wide_compile(models, sample, config=self.wide_config)

    def _make_optimizer(self, configs: list[dict[str, Any]]) -> Any:
        keys = sorted({k for c in configs for k in c})
        columns = {k: [c.get(k) for c in configs] for k in keys}
        opt = self.make_optimizer(self.model.parameters(), columns)
        if not callable(getattr(opt, "set_member_hyperparameters", None)):
            raise TypeError(f"wide_compiler.integrations.ray: optimizer returned a "
                            f"{type(opt).__name__}; expected a wide_compiler.optim optimizer "
                            "(per-member hyperparameters), e.g. lambda params, hp: "
                            "wc.optim.Adam(params, lr=hp['lr'])")
        return opt

    def _member_hparams(self, i: int, config: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The optimizer hyperparameters (per param group) that ``config`` gives member ``i``:
        the optimizer factory called with that config alone (each key a 1-element list) on
        throwaway 1-member parameters (meta tensors shaped like the model's), so factories that
        rename or transform keys (``lr=[10 ** x for x in hp["log_lr"]]``) are followed. Raises
        the factory's ``ValueError``/``TypeError`` for invalid values, naming member ``i`` (the
        throwaway optimizer's only member is its member 0)."""
        params = [torch.empty((1, *p.shape[1:]), dtype=p.dtype, device="meta")
                  for p in self.model.parameters()]
        try:
            probe = self.make_optimizer(params, {k: [v] for k, v in config.items()})
        except (ValueError, TypeError) as e:
            kind = TypeError if isinstance(e, TypeError) else ValueError
            detail = re.sub(r"\bmember 0\b", f"member {i}", str(e))
            raise kind(f"wide_compiler.integrations.ray: member {i}'s configuration {dict(config)!r} "
                       f"is refused by the optimizer factory: {detail}") from e
        if len(probe.param_groups) != len(self.optimizer.param_groups):
            raise ValueError(f"wide_compiler.integrations.ray: the optimizer factory made "
                             f"{len(probe.param_groups)} param groups for one member but "
                             f"{len(self.optimizer.param_groups)} for the population; its groups must "
                             "depend on the parameters it is given only")

        def per_member(v: Any) -> bool:
            return isinstance(v, float) or (isinstance(v, tuple) and all(isinstance(x, float) for x in v))

        return [{k: v for k, v in probe.member_hyperparameters(0, g).items() if per_member(v)}
                for g in range(len(probe.param_groups))]

    def _push_hparams(self, i: int, groups: list[dict[str, Any]]) -> None:
        for g, values in enumerate(groups):
            if values:
                self.optimizer.set_member_hyperparameters(i, group=g, **values)

    def _push_change(self, i: int, old: Mapping[str, Any], new: Mapping[str, Any]) -> None:
        """Push into member ``i``'s optimizer the hyperparameters that changing its configuration
        from ``old`` to ``new`` changes (validated before anything changes)."""
        before, after = self._member_hparams(i, old), self._member_hparams(i, new)
        self._push_hparams(i, [{k: v for k, v in a.items() if b.get(k) != v} for a, b in zip(after, before)])

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
        self._push_change(i, self.configs[i], new)
        self.configs[i] = new

    def restart(self, i: int, config: Mapping[str, Any] | None = None, seed: int | None = None) -> None:
        """Slot ``i`` starts a new member: ``config`` (default: a fresh sample of the member
        space), weights of ``build_model(config)`` under ``seed``, a zeroed optimizer state."""
        i = self._slot(i, f"restart({i!r})")
        config = self._new_config() if config is None else self._merge(config)
        seed = self.rng.randrange(2**31) if seed is None else int(seed)
        hparams = self._member_hparams(i, config)
        self.model.load_member_state_dict(i, self._build(config, seed).state_dict())
        self._push_hparams(i, hparams)
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
        self.optimizer = self._make_optimizer(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        if changed or removed:
            for i in range(self.n):
                self._push_change(i, saved[i], self.configs[i])
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


# ------------------------------------------------------------------------------------------------
# Member schedulers
# ------------------------------------------------------------------------------------------------
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
