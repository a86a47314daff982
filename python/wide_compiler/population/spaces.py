"""Search spaces of a population's members: a member's configuration drawn from the member space,
and the explore step of :class:`~wide_compiler.population.MemberPBT` (Ray Tune's domains are
recognised without importing ray)."""

from __future__ import annotations

import copy
import random
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["sample_member_config"]


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
