"""The machine facts a measurement depends on: versions, threads, CPU, allocator, load, peak."""

from __future__ import annotations

import functools
import math
import os
import platform
import statistics
import time
from collections.abc import Mapping
from typing import Any

import torch

from .. import allocator
from .timing import interleave

__all__ = ["contention_note", "end_of_run", "hardware", "machine_info", "peak_gflops"]


def machine_info() -> dict[str, Any]:
    """What the numbers depend on: versions, threads, the CPU ISA torch's kernels use, the
    allocator setting (``wc.tune_cpu_allocator()``), the load average and this process's clocks
    (``run_clock``: CPU and wall seconds, for :func:`end_of_run`).

    >>> info = machine_info()
    >>> info["threads"] == torch.get_num_threads(), "cpu_capability" in info
    (True, True)
    """
    return {
        "wide_compiler": _wc_version(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "num_interop_threads": torch.get_num_interop_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "machine": platform.machine(),
        "platform": platform.platform(),
        "processor": platform.processor() or _cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_avg": load_avg(),
        "allocator": "glibc-tuned" if allocator._applied else "default",  # wc.tune_cpu_allocator()
        "run_clock": [time.process_time(), time.monotonic()],
    }


def end_of_run(machine: Mapping[str, Any]) -> dict[str, Any]:
    """``machine`` (:func:`machine_info` at the start of a run) with the load average at its end
    (``load_avg_end``) and this process's own share of it (``own_load``): the cores its threads
    kept busy on average since the start (CPU seconds over wall seconds), weighted as the
    kernel's 1-minute average weighs the run's length. On a 2-core machine a run's own two
    threads raise the load average to ~2; only the rest is other processes'.

    >>> m = end_of_run(machine_info())
    >>> 0 <= m["own_load"] and "load_avg_end" in m
    True
    """
    out = dict(machine, load_avg_end=load_avg())
    clock = machine.get("run_clock")
    if clock:
        cpu, wall = time.process_time() - clock[0], time.monotonic() - clock[1]
        out["own_load"] = round(cpu / wall * (1 - math.exp(-wall / 60)), 2) if wall > 0 else 0.0
    return out


@functools.cache
def peak_gflops(size: int = 1024, reps: int = 9) -> float:
    """The machine's practical float32 peak, GFLOP/s: the median rate of one ``size``-cubed
    ``torch.mm`` (BLAS at its best: large, square, in cache-friendly tiles) with the current
    threads. Measured once per process; records compare a model's achieved rate against it.

    >>> peak_gflops(size=64, reps=3) > 0
    True
    """
    a, b = torch.randn(size, size), torch.randn(size, size)
    seconds = interleave({"mm": lambda: torch.mm(a, b)}, reps, warmup=2).samples["mm"]
    return 2 * size**3 / max(statistics.median(seconds), 1e-12) / 1e9


def load_avg() -> list[float] | None:
    """1/5/15-minute load averages (None where the platform has none): other processes
    competing for the cores spoil timings."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):  # not on every platform
        return None


def contention_note(machine: Mapping[str, Any]) -> str | None:
    """A warning when the machine was busy (1-minute load average at the start of the run, or at
    its end less the run's own share, ``own_load`` of :func:`end_of_run`, at least 75% of the
    CPU count), else None.

    >>> contention_note({"cpu_count": 4, "load_avg": [0.5, 0.4, 0.3]}) is None
    True
    """
    cpus = machine.get("cpu_count") or 0
    start, end = machine.get("load_avg"), machine.get("load_avg_end")
    loads = ([start[0]] if start else []) + ([end[0] - (machine.get("own_load") or 0.0)] if end else [])
    if not cpus or not loads or max(loads) < 0.75 * cpus:
        return None
    return (f"note: load average {max(loads):.1f} from other processes on {cpus} CPUs during the run: "
            f"they competed for the cores, so these timings are unreliable")


def _wc_version() -> str:
    from .._version import __version__

    return __version__


@functools.cache
def hardware(device: str = "cpu") -> str:
    """The processor a measurement on ``device`` ran on: the GPU's name for a CUDA device, else
    the CPU's model name and the instruction set torch's kernels use. Strategy caches key on it
    (:func:`wide_compiler.tuning.cache_key`): a home directory shared by machines, or moved to a
    new one, must not hand one machine's measured choices to another.

    >>> "(" in hardware("cpu")
    True
    """
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(dev)
    return f"{_cpu_model() or platform.processor() or platform.machine()} ({torch.backends.cpu.get_cpu_capability()})"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""
