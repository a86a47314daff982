"""The machine facts a measurement depends on: versions, threads, CPU, allocator, load, peak."""

from __future__ import annotations

import functools
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
    (``run_clock``: its CPU seconds, wall seconds and all CPUs' busy seconds, for :func:`end_of_run`).

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
        "run_clock": [time.process_time(), time.monotonic(), _busy_cpu_s()],
    }


def _busy_cpu_s() -> float | None:
    """Seconds all CPUs spent busy since boot (``/proc/stat``: all but idle and iowait), or None
    where there is no ``/proc/stat``."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (sum(ticks) - ticks[3] - (ticks[4] if len(ticks) > 4 else 0)) / os.sysconf("SC_CLK_TCK")


def end_of_run(machine: Mapping[str, Any]) -> dict[str, Any]:
    """``machine`` (:func:`machine_info` at the start of a run) with the load average at its end
    (``load_avg_end``) and ``others_load``: the CPUs other processes kept busy on average since
    the start (all CPUs' busy seconds from ``/proc/stat`` less this process's CPU seconds, over
    the wall seconds; None without ``/proc/stat``). The load average counts the run's own
    threads: on a 2-core machine a run of 2 threads raises it to ~2 by itself, and in ``benchmark
    all`` the targets before a target raise its start value.

    >>> m = end_of_run(machine_info())
    >>> "load_avg_end" in m and (m["others_load"] is None or m["others_load"] >= 0)
    True
    """
    out = dict(machine, load_avg_end=load_avg(), others_load=None)
    clock, busy = machine.get("run_clock"), _busy_cpu_s()
    if clock and clock[2] is not None and busy is not None:
        cpu, wall = time.process_time() - clock[0], time.monotonic() - clock[1]
        if wall > 0:
            out["others_load"] = round(max(0.0, (busy - clock[2] - cpu) / wall), 2)
    return out


@functools.cache
def peak_gflops(size: int | None = None, reps: int = 9, *, device: str = "cpu",
                dtype: torch.dtype = torch.float32) -> float:
    """The machine's practical GEMM peak in ``dtype`` on ``device``, GFLOP/s: the median rate of
    one ``size``-cubed ``torch.mm`` (BLAS or cuBLAS at its best: large and square; ``size``
    1024 on the CPU, 8192 on a GPU by default) with the current threads. Measured once per
    process and setting; records compare a model's achieved rate against it.

    >>> peak_gflops(size=64, reps=3) > 0
    True
    """
    size = size or (8192 if torch.device(device).type == "cuda" else 1024)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
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
    """A warning when other processes competed for the CPUs (``others_load`` of
    :func:`end_of_run`: a quarter of the CPU count or more on average during the run; where it
    was not measured, a 1-minute load average at the start or the end of at least 75% of the CPU
    count), else None.

    >>> contention_note({"cpu_count": 4, "load_avg": [0.5, 0.4, 0.3]}) is None
    True
    """
    cpus = machine.get("cpu_count") or 0
    others = machine.get("others_load")
    if cpus and others is not None:
        if others < 0.25 * cpus:
            return None
        return (f"note: other processes kept {others:.1f} of {cpus} CPUs busy on average during the run: "
                f"they competed for the cores, so these timings are unreliable")
    loads = [la[0] for la in (machine.get("load_avg"), machine.get("load_avg_end")) if la]
    if not cpus or not loads or max(loads) < 0.75 * cpus:
        return None
    return (f"note: load average {max(loads):.1f} on {cpus} CPUs during the run: other "
            f"processes competed for the cores, so these timings are unreliable")


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
