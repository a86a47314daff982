"""The ``processes`` baseline: N training (or inference) processes side by side, one member each,
started together, as users share one GPU between N runs (issue 47). Its time is the wall time of
one step of all N members: the processes each run ``steps`` steps of their own member on its own
input after a warm-up, released at once, and the time until the last finishes is divided by
``steps``. Every process builds its member from the benchmark case by name
(``python -m wide_compiler.bench._processes_child``), on the benchmark's device, with
``cores / N`` CPU threads (at least one).

Only the vision targets take it (``--baselines ...,processes``): it has no output to compare with
the members (each process checks nothing), so its records carry no ``baseline_max_abs_err`` for it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

__all__ = ["MAX_PROCESSES", "processes_ms"]

#: The most processes the baseline starts: each holds its own torch and CUDA context (~0.5 GB of
#: GPU memory and seconds to start), so N=256 would take minutes to start and most of a GPU's
#: memory before the first step. Above it the baseline is recorded as not run, saying why.
MAX_PROCESSES = 32


def processes_ms(target: str, size: str, case: str, n: int, mode: str, device: str, *, steps: int = 20,
                 warmup: int = 3, timeout: float = 900.0) -> float:
    """Milliseconds per step of ``n`` processes, member ``i`` in process ``i``, started together
    (see the module's docstring). Raises RuntimeError naming the process that failed, and
    ValueError for ``n`` above :data:`MAX_PROCESSES`."""
    if n > MAX_PROCESSES:
        raise ValueError(f"N={n} processes: more than MAX_PROCESSES={MAX_PROCESSES} (each holds its own "
                         f"torch and device context); not run")
    threads = max(1, (os.cpu_count() or 1) // n)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    procs = []
    try:
        for i in range(n):
            spec = {"target": target, "size": size, "case": case, "member": i, "mode": mode, "device": device,
                    "steps": steps, "warmup": warmup, "threads": threads}
            procs.append(subprocess.Popen([sys.executable, "-m", "wide_compiler.bench._processes_child",
                                           json.dumps(spec)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, env=env))
        deadline = time.monotonic() + timeout
        for i, p in enumerate(procs):
            _expect(p, i, "ready", deadline)
        start = time.perf_counter()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        for i, p in enumerate(procs):
            _expect(p, i, "done", deadline)
        return (time.perf_counter() - start) / steps * 1e3
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def _expect(p: subprocess.Popen, i: int, word: str, deadline: float) -> None:
    line = p.stdout.readline().strip()
    if line != word or time.monotonic() > deadline:
        p.kill()
        err = p.stderr.read()[-2000:] if p.stderr else ""
        raise RuntimeError(f"processes baseline: process {i} said {line!r} where {word!r} was due"
                           f"{': ' + err if err else ''}")
