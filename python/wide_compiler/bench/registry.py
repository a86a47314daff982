"""The benchmark registry: one decorated function per ``python -m wide_compiler benchmark`` target.

A target is a function ``jobs(preset) -> list[Job]`` decorated with :func:`target`, next to its
runner. A new target ``foo`` is a module ``bench/foo.py``::

    @target("foo", description="wide foo vs loop / vmap",
            presets={"ci": Preset("smoke run (seconds)", 0.02, {"ns": (4,)}),
                     "quick": Preset("headline case", 0.5, {"ns": (64,)}),
                     "full": Preset("the grid (minutes)", 0.2, {"ns": (4, 16, 64, 256)})})
    def jobs(p: Preset) -> list[Job]:
        return jobs_per_n(run_one, ["small", "large"], p)  # run_one(item, n, p, machine) -> records

plus its import in ``bench/__init__.py``; the CLI (``benchmark foo``, ``benchmark --list``) and
``make bench`` read the registry.

Every target has the presets ``ci`` (a smoke run of seconds), ``quick`` (the headline cases) and
``full`` (the grid), each a :class:`Preset`: a description, the timing budget and the target's
grid parameters. A :class:`Job` is one unit of work (a case): ``run(machine)`` returns its
records, each built by :func:`.engine.make_record`. :func:`run` does the rest for every target:
the machine facts, the progress bar, the check that every record has the DESIGN §10 fields, and
the stamp of the preset and the machine (:func:`.engine.finish_records`).

Example::

    >>> from wide_compiler import bench
    >>> sorted(bench.TARGETS["linear"].presets)
    ['ci', 'full', 'quick']
"""
from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from .. import measure
from . import engine

__all__ = ["PRESET_NAMES", "TARGETS", "Job", "Preset", "Target", "format_records", "get",
           "jobs_per_n", "run", "target"]

#: The presets every target has.
PRESET_NAMES = ("ci", "quick", "full")

Record = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Preset:
    """One ``--preset`` of a target: what it is for, the ``min_run_time`` of every timing
    (seconds per contender, see :func:`wide_compiler.measure.time_interleaved`) and the target's own grid parameters (Ns, shapes,
    which contenders, ...)."""

    description: str
    min_run_time: float
    grid: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Job:
    """One case of a run: ``label`` for the progress bar, ``run(machine)`` its records."""

    label: str
    run: Callable[[Mapping[str, Any]], list[Record]]


@dataclasses.dataclass(frozen=True)
class Target:
    """A registered target (see :func:`target`)."""

    name: str
    jobs: Callable[[Preset], Sequence[Job]]
    presets: Mapping[str, Preset]
    formatter: Callable[[Sequence[Record]], str]
    description: str
    #: the device types it can run on (:func:`.engine.on_device`); CPU only unless it says so
    devices: tuple[str, ...] = ("cpu",)

    def preset(self, name: str) -> Preset:
        if name not in self.presets:
            raise ValueError(f"benchmark target {self.name!r} has no preset {name!r}; expected "
                             f"one of {list(self.presets)}")
        return self.presets[name]


def jobs_per_n(run: Callable[[Any, int, Preset, Mapping[str, Any]], list[Record]],
               items: Iterable[Any], p: Preset, *, label: Callable[[Any], str] = str
               ) -> list[Job]:
    """One :class:`Job` per item and N of ``p.grid["ns"]`` (item-major):
    ``run(item, n, p, machine)``, labelled ``f"{label(item)} N={n}"``.

    >>> [j.label for j in jobs_per_n(print, ["a", "b"], Preset("", 0.1, {"ns": (4, 8)}))]
    ['a N=4', 'a N=8', 'b N=4', 'b N=8']
    """
    return [Job(f"{label(item)} N={n}", functools.partial(run, item, n, p))
            for item in items for n in p.grid["ns"]]


_REGISTRY: dict[str, Target] = {}
#: Read-only view of the registry: target name -> :class:`Target`.
TARGETS: Mapping[str, Target] = types.MappingProxyType(_REGISTRY)


def target(name: str, *, presets: Mapping[str, Preset], description: str,
           formatter: Callable[[Sequence[Record]], str] | None = None,
           devices: Sequence[str] = ("cpu",),
           ) -> Callable[[Callable[[Preset], Sequence[Job]]], Callable[[Preset], Sequence[Job]]]:
    """Register the decorated ``jobs(preset) -> list[Job]`` as benchmark target ``name``.

    ``presets`` must hold ``ci``, ``quick`` and ``full`` (:data:`PRESET_NAMES`; more are
    allowed); ``formatter`` prints the records (default :func:`.engine.format_table`);
    ``devices``: the device types whose :func:`.engine.on_device` it honours (its members and
    inputs go through :func:`.engine.to_device`). Returns the function unchanged.
    """
    missing = [p for p in PRESET_NAMES if p not in presets]
    if missing:
        raise ValueError(f"benchmark target {name!r} lacks the presets {missing}")
    wrong = [k for k, p in presets.items() if not isinstance(p, Preset)]
    if wrong:
        raise TypeError(f"benchmark target {name!r}: presets {wrong} are not Preset objects")

    def register(jobs: Callable[[Preset], Sequence[Job]]) -> Callable[[Preset], Sequence[Job]]:
        if name in _REGISTRY:
            raise ValueError(f"benchmark target {name!r} is registered twice")
        _REGISTRY[name] = Target(name, jobs, types.MappingProxyType(dict(presets)),
                                 formatter or engine.format_table, description, tuple(devices))
        return jobs

    return register


def get(name: str) -> Target:
    """The registered target ``name`` (ValueError naming the targets when unknown)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown benchmark target {name!r}; expected one of {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def run(name: str, preset: str | Preset = "quick", *, progress: bool = False,
        cases: Sequence[str] | None = None,
        on_job: Callable[[list[Record]], None] | None = None) -> list[Record]:
    """Run target ``name`` with ``preset`` (a preset name, or a :class:`Preset` of your own grid,
    stamped ``"custom"``); returns its records (:mod:`.engine`). ``cases``: run only the jobs
    whose label starts with one of these names (``"resnet18"``, ``"resnet18 N=4"``). ``on_job``
    is called with each job's records as soon as it ends (a run cut short keeps what it measured)."""
    spec = get(name)
    p, label = (preset, "custom") if isinstance(preset, Preset) else (spec.preset(preset), preset)
    if engine.DEVICE.type not in spec.devices:
        raise ValueError(f"benchmark {name}/{label}: runs on {', '.join(spec.devices)} only, "
                         f"not {engine.DEVICE.type}")
    machine = measure.machine_info()
    jobs = list(spec.jobs(p))
    if cases:
        known = sorted({j.label for j in jobs})
        jobs = [j for j in jobs if any(j.label == c or j.label.startswith(c + " ") for c in cases)]
        if not jobs:
            raise ValueError(f"benchmark {name}/{label}: no case matches {list(cases)}; the cases are {known}")
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(jobs), desc=f"{name}/{label}", unit="case", leave=False)
    records: list[Record] = []
    try:
        for job in jobs:
            if bar is not None:
                bar.set_postfix_str(job.label)
            done = list(job.run(machine))
            for r in done:
                missing = [k for k in engine.RECORD_KEYS if k not in r]
                if missing:
                    raise RuntimeError(f"benchmark {name}/{job.label}: a record lacks {missing} "
                                       f"(build records with engine.make_record)")
            records += done
            if on_job is not None:
                on_job(done)
            if bar is not None:
                bar.update()
    finally:
        if bar is not None:
            bar.close()
    return engine.finish_records(records, label, machine)


def format_records(name: str, records: Sequence[Record]) -> str:
    """The plain-text table of target ``name``'s records (its own formatter)."""
    return get(name).formatter(records)
