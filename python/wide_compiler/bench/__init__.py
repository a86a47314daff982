"""Benchmarks: the wide model against the baselines a user would otherwise pick (DESIGN §10).

``TARGETS`` maps a ``python -m wide_compiler benchmark <target>`` name to its runner
``run(preset, *, progress=False) -> list[dict]``, ``PRESETS`` to its preset names and
``FORMATTERS`` (optional; default :func:`format_table`) to its table printer. A new target is one
row in each.

Example::

    >>> from wide_compiler import bench
    >>> records = bench.run("linear", "ci")                  # doctest: +SKIP
    >>> print(bench.format_records("linear", records))       # doctest: +SKIP
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from . import engine, linear, optim, vision
from .engine import RECORD_KEYS, format_table, machine_info

__all__ = ["FORMATTERS", "PRESETS", "RECORD_KEYS", "TARGETS", "engine", "format_records",
           "format_table", "linear", "machine_info", "optim", "run", "vision"]

TARGETS: dict[str, Callable[..., list[dict[str, Any]]]] = {
    "linear": linear.run, "optim": optim.run_optim, "train": optim.run_train,
    "conv": vision.run_conv, "norm": vision.run_norm, "pool": vision.run_pool,
    "embedding": vision.run_embedding, "models": vision.run_models}
PRESETS: dict[str, tuple[str, ...]] = {
    "linear": tuple(linear.PRESETS), "optim": tuple(optim.PRESETS), "train": tuple(optim.PRESETS),
    "conv": tuple(vision.PRESETS), "norm": tuple(vision.PRESETS), "pool": tuple(vision.PRESETS),
    "embedding": tuple(vision.PRESETS), "models": tuple(vision.PRESETS)}
FORMATTERS: dict[str, Callable[[Sequence[dict[str, Any]]], str]] = {
    "optim": optim.format_records, "train": optim.format_records,
    "conv": vision.format_records, "norm": vision.format_records, "pool": vision.format_records,
    "embedding": vision.format_records, "models": vision.format_records}


def run(target: str, preset: str = "quick", *, progress: bool = False) -> list[dict[str, Any]]:
    """Run benchmark ``target`` with ``preset``; returns its records (see :mod:`.engine`)."""
    if target not in TARGETS:
        raise ValueError(f"unknown benchmark target {target!r}; expected one of {sorted(TARGETS)}")
    if preset not in PRESETS.get(target, ()):
        raise ValueError(f"benchmark target {target!r} has no preset {preset!r}; expected one "
                         f"of {list(PRESETS.get(target, ()))}")
    return TARGETS[target](preset, progress=progress)


def format_records(target: str, records: Sequence[dict[str, Any]]) -> str:
    """The plain-text table of ``target``'s records (its own formatter, else :func:`format_table`)."""
    return FORMATTERS.get(target, format_table)(records)
