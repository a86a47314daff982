"""``benchmark integrations``: a short fused training run end to end, compile included, against
the same members trained one after the other (issue 45: "a 3-member, 10-step Lightning fit and a
3-member, 10-step ``WideTrainer`` run, end to end with compiling: no slower than the three runs
one after the other").

Two frameworks, the models of docs/integrations.md:

- ``lightning``: the guide's ``Regressor`` (an MLP 4-32-1, AdamW + StepLR, batches of 64, a
  validation loader, the guide's ``Trainer`` settings with its default sanity check) for
  ``steps`` steps: one ``WideLightningModule`` of N members fitted by ONE ``Trainer`` (``fused``)
  against N ``Trainer.fit`` runs, one per member (``sequential``);
- ``transformers``: the BERT classifier of ``examples/hf_trainer_seeds.py`` (hidden 64, 2 layers,
  sequences of 24, batches of 32, AdamW + cosine schedule with warm-up, dropout 0) for ``steps``
  steps: ONE ``WideTrainer`` of N members (``fused``) against N ``transformers.Trainer`` runs.

Every run is a fresh Python process on one CPU thread; its clock starts after ``import torch``
and the framework (both contenders need them) and stops when the last member's training ends. It
counts building the members, ``import wide_compiler`` (fused only: ``import_s`` says how much of
it) and the compile. ``fused`` runs with a new, empty cache directory and the compile cache on
(``cold``: a first run) and again with the cache a cold run filled (``warm``: a second run of the
same members). Imports read bytecode as an installed package does (Note [Bytecode in the timed
runs]), after an untimed run of each contender. The three contenders are run in rounds (``repeats`` of them, interleaved, the order
rotated each round) and each one's median is reported, so a machine whose load drifts slows every
contender alike.

One record per framework: ``wide_ms`` the cold fused run's median, ``baseline_ms``
``{"sequential": ..., "fused_warm": ...}``, ``speedup["sequential"]`` the issue's target (at
least 1), ``cold_s``/``warm_s``/``sequential_s`` (medians), ``*_all`` (every run), ``import_s``,
``max_abs_err`` the largest difference of a member's final weights between the fused and its own
run. ``python -m wide_compiler benchmark integrations --preset quick --json out.json``.

Example::

    >>> from wide_compiler import bench
    >>> sorted(bench.TARGETS["integrations"].presets)
    ['ci', 'full', 'quick']
"""
from __future__ import annotations

import functools
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from typing import Any

from .registry import Job, Preset, target

__all__: list[str] = []

log = logging.getLogger(__name__)

PRESETS = {
    "ci": Preset("lightning, N=2, 3 steps, one round, no untimed runs (a smoke run: seconds)", 0.01,
                 {"ns": (2,), "steps": 3, "repeats": 1, "frameworks": ("lightning",), "untimed": False}),
    "quick": Preset("lightning and transformers, N=3, 10 steps, 3 rounds of fresh processes (minutes)", 0.5,
                    {"ns": (3,), "steps": 10, "repeats": 3, "frameworks": ("lightning", "transformers")}),
    "full": Preset("the quick cases, 5 rounds, and N=8", 0.5,
                   {"ns": (3, 8), "steps": 10, "repeats": 5, "frameworks": ("lightning", "transformers")}),
}
CONTENDERS = ("fused_cold", "sequential", "fused_warm")


def _fresh(framework: str, fused: bool, n: int, steps: int, weights: str, cache_dir: str) -> dict[str, float]:
    arg = json.dumps({"framework": framework, "fused": fused, "n": n, "steps": steps, "weights": weights})
    env = dict(os.environ, WIDE_COMPILER_CACHE_DIR=cache_dir, OMP_NUM_THREADS="1")
    env.pop("WIDE_COMPILE_CACHE", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # a user's import reads bytecode (Note [Bytecode in the timed runs])
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_integrations_child.py")
    done = subprocess.run([sys.executable, script, arg],
                          capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"benchmark integrations: a {framework} run (fused={fused}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# Note [Bytecode in the timed runs]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Where PYTHONDONTWRITEBYTECODE is set (this project's agent sessions set it), every fresh process
# compiles wide_compiler's ~100 modules from source: 0.4 s CPU of a warm Lightning fit of 0.8 s,
# paid by the fused run only (the sequential runs never import it), and not what an installed
# package costs (pip writes its bytecode). So the runs are started without it: the first one writes
# the bytecode an installed package has (in the package's own __pycache__, which git ignores), and
# every run reads torch's and the framework's from where pip wrote it (a PYTHONPYCACHEPREFIX of the
# run's own, as before, hid that: the first run compiled all of torch and Lightning, ~15 s). Two
# untimed runs, one of each contender, come before the timed rounds. The ``ci`` smoke run skips
# them (its times are not compared): its cold run fills the warm run's cache.


def _max_abs_err(a: str, b: str) -> float:
    import torch

    wa, wb = torch.load(a), torch.load(b)
    return max(float((x[k].double() - y[k].double()).abs().max()) for x, y in zip(wa, wb) for k in y
               if k in x and y[k].is_floating_point())


def _run(framework: str, n: int, p: Preset, machine: Mapping[str, Any]) -> list[dict[str, Any]]:
    from . import engine

    try:
        __import__("lightning" if framework == "lightning" else "transformers")
    except ImportError as e:
        log.warning("benchmark integrations: %s skipped (%s)", framework, e)
        return []
    steps, repeats = p.grid["steps"], p.grid["repeats"]
    runs: dict[str, list[dict[str, float]]] = {c: [] for c in CONTENDERS}
    with tempfile.TemporaryDirectory(prefix="wide_integrations_bench_") as tmp:
        if p.grid.get("untimed", True):
            # not timed: fill the warm cache, and the bytecode of both contenders' imports
            warm_cache = os.path.join(tmp, "warm")
            _fresh(framework, True, n, steps, os.path.join(tmp, "w.pt"), warm_cache)
            _fresh(framework, False, n, steps, os.path.join(tmp, "w.pt"), os.path.join(tmp, "unused"))
        else:  # the smoke run: the first round's cold run (first in its order) fills the warm cache
            warm_cache = os.path.join(tmp, "cold0")
        for r in range(repeats):
            order = CONTENDERS[r % 3:] + CONTENDERS[:r % 3]
            for c in order:
                cache = warm_cache if c == "fused_warm" else os.path.join(tmp, f"cold{r}")
                runs[c].append(_fresh(framework, c != "sequential", n, steps, os.path.join(tmp, f"{c}.pt"), cache))
        err = max(_max_abs_err(os.path.join(tmp, "fused_cold.pt"), os.path.join(tmp, "sequential.pt")),
                  _max_abs_err(os.path.join(tmp, "fused_warm.pt"), os.path.join(tmp, "sequential.pt")))
    med = {c: statistics.median(x["seconds"] for x in v) for c, v in runs.items()}
    base = {"target": "integrations", "case": framework, "n": n, "batch": 64 if framework == "lightning" else 32,
            "dtype": "float32", "shapes": {}}
    return [engine.make_record(
        base=base, mode="train", strategy="fast" if framework == "lightning" else "auto",
        wide_ms=1e3 * med["fused_cold"],
        baseline_ms={"sequential": 1e3 * med["sequential"], "fused_warm": 1e3 * med["fused_warm"]},
        max_abs_err=err, machine=machine, timing=f"fresh processes, median of {repeats} interleaved rounds",
        steps=steps, cold_s=med["fused_cold"], warm_s=med["fused_warm"], sequential_s=med["sequential"],
        cold_all=[x["seconds"] for x in runs["fused_cold"]], warm_all=[x["seconds"] for x in runs["fused_warm"]],
        sequential_all=[x["seconds"] for x in runs["sequential"]],
        import_s=statistics.median(x["import_s"] for x in runs["fused_cold"]),
        cold_cpu_s=statistics.median(x["cpu_s"] for x in runs["fused_cold"]),
        sequential_cpu_s=statistics.median(x["cpu_s"] for x in runs["sequential"]))]


def _format(records) -> str:
    """One row per framework and N: the medians, and fused/sequential."""
    rows = [("framework", "N", "steps", "fused cold s", "fused warm s", "sequential s", "cold/seq", "warm/seq",
             "import s", "max err")]
    for r in records:
        rows.append((r["case"], str(r["n"]), str(r["steps"]), f"{r['cold_s']:.2f}", f"{r['warm_s']:.2f}",
                     f"{r['sequential_s']:.2f}", f"{r['cold_s'] / r['sequential_s']:.2f}",
                     f"{r['warm_s'] / r['sequential_s']:.2f}", f"{r['import_s']:.2f}", f"{r['max_abs_err']:.1e}"))
    widths = [max(len(row[k]) for row in rows) for k in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows)


@target("integrations", presets=PRESETS, formatter=_format,
        description="a short Lightning / WideTrainer run end to end, compile included, vs the members one after "
                    "the other")
def integration_jobs(p: Preset) -> list[Job]:
    return [Job(f"{fw} N={n}", functools.partial(_run, fw, n, p)) for fw in p.grid["frameworks"]
            for n in p.grid["ns"]]
