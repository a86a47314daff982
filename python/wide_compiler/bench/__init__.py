"""Benchmarks: the wide model against the baselines a user would otherwise pick (DESIGN §10).

Built on :mod:`wide_compiler.measure` (the contenders, the interleaved timing and the machine
facts live there); this package adds the targets, their presets, the records and the tables.

Every ``python -m wide_compiler benchmark <target>`` is one function decorated with
:func:`.registry.target` in a module of this package (:mod:`.linear`: ``linear``;
:mod:`.vision`: ``conv``, ``norm``, ``pool``, ``embedding``, ``models``; :mod:`.optim`: ``optim``,
``train``; :mod:`.rnn`: ``rnn``; :mod:`.router`: ``router``; :mod:`.attention`: ``attention``;
:mod:`.dropout`: ``dropout``; :mod:`.real_models`: ``real``; :mod:`.sweep`: ``sweep``; :mod:`.compile`: ``compile``; :mod:`.integrations`: ``integrations``; :mod:`.mlp`: ``mlp``); a new target is one such function in its own module, imported below. :data:`TARGETS` is the read-only registry (name -> :class:`Target`,
with its presets ``ci``, ``quick`` and ``full`` and its description), :func:`run` runs a target,
:func:`format_records` prints its records; every record is built by :func:`.engine.make_record`.

Example::

    >>> from wide_compiler import bench
    >>> "linear" in bench.TARGETS and sorted(bench.TARGETS["train"].presets)
    ['ci', 'full', 'quick']
    >>> records = bench.run("linear", "ci")                  # doctest: +SKIP
    >>> print(bench.format_records("linear", records))       # doctest: +SKIP
"""
from __future__ import annotations

from . import engine, registry
from .engine import RECORD_KEYS, format_table, machine_info
from .registry import (
    PRESET_NAMES,
    TARGETS,
    Job,
    Preset,
    Target,
    format_records,
    run,
    target,
)

# Importing a target module registers its targets, in this order (that of `benchmark --list`).
from . import linear  # isort: skip
from . import vision  # isort: skip
from . import optim  # isort: skip
from . import rnn  # isort: skip
from . import router  # isort: skip
from . import attention  # isort: skip
from . import dropout  # isort: skip
from . import real_models  # isort: skip
from . import sweep  # isort: skip
from . import compile  # isort: skip  # noqa: A004
from . import integrations  # isort: skip
from . import mlp  # isort: skip

__all__ = ["PRESET_NAMES", "RECORD_KEYS", "TARGETS", "Job", "Preset", "Target", "attention",
           "dropout", "engine", "format_records", "format_table", "linear", "machine_info", "mlp", "optim",
           "real_models", "registry", "run", "rnn", "router", "target", "vision"]
