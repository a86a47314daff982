"""Benchmarks: the wide model against the baselines a user would otherwise pick (DESIGN §10).

``TARGETS`` maps a ``python -m wide_compiler benchmark <target>`` name to its runner
``run(preset, *, progress=False) -> list[dict]``; ``PRESETS`` to its presets.

Example::

    >>> from wide_compiler import bench
    >>> records = bench.run("linear", "ci")                  # doctest: +SKIP
    >>> print(bench.format_table(records))                   # doctest: +SKIP
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import engine, linear
from .engine import RECORD_KEYS, format_table, machine_info

__all__ = ["TARGETS", "PRESETS", "RECORD_KEYS", "run", "format_table", "machine_info", "engine",
           "linear"]

TARGETS: dict[str, Callable[..., list[dict[str, Any]]]] = {"linear": linear.run}
PRESETS: dict[str, tuple[str, ...]] = {"linear": tuple(linear.PRESETS)}


def run(target: str, preset: str = "quick", *, progress: bool = False) -> list[dict[str, Any]]:
    """Run benchmark ``target`` with ``preset``; returns its records (see :mod:`.engine`)."""
    if target not in TARGETS:
        raise ValueError(f"unknown benchmark target {target!r}; expected one of {sorted(TARGETS)}")
    return TARGETS[target](preset, progress=progress)
