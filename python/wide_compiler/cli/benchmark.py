"""``python -m wide_compiler benchmark TARGET``: the registered benchmarks
(:mod:`wide_compiler.bench`) run, printed, written as JSON records and plotted.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import progress
from .inputs import UsageError
from .progress import need_matplotlib

__all__ = ["plot_speedups", "run", "targets_help", "top_records"]


def targets_help() -> str:
    """The registered benchmark targets, one line each with its description, and the presets."""
    from .. import bench

    width = max(map(len, bench.TARGETS))
    lines = ["targets:"] + [f"  {name.ljust(width)}  {t.description}"
                            for name, t in bench.TARGETS.items()]
    lines.append("presets: ci (smoke run, seconds), quick (headline cases, default), "
                 "full (grid, minutes)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run the targets, print their tables, write the records (``--json``, ``--save``) and the
    plot; a target, preset, case or device that does not exist is a usage error (exit 2)."""
    import torch

    from .. import bench

    if args.list:  # machine-readable: one target name a line (the Makefile's `make bench`)
        print("\n".join(bench.TARGETS))
        return 0
    if args.target is None:
        print("usage: python -m wide_compiler benchmark TARGET|all [--preset ci|quick|full] "
              "[--json FILE] [--save] [--top K] [--plot FILE.png] [--compile [MODE]] [--baselines NAMES]\n")
        print(targets_help())
        return 0
    targets = list(bench.TARGETS) if args.target == "all" else [args.target]
    for name in targets:
        if name not in bench.TARGETS:
            raise UsageError(f"unknown benchmark target {name!r}; expected one of "
                             f"{', '.join(bench.TARGETS)} or all")
        if args.preset not in bench.TARGETS[name].presets:
            raise UsageError(f"target {name!r} has no preset {args.preset!r}; "
                             f"expected one of {', '.join(bench.TARGETS[name].presets)}")
    if args.device != "cpu":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {args.device}, but this torch sees no CUDA device "
                             f"(torch {torch.__version__}, cuda={torch.version.cuda or 'none'})")
        unable = [n for n in targets if args.device not in bench.TARGETS[n].devices]
        if unable and args.target != "all":
            raise UsageError(f"target {args.target!r} runs on "
                             f"{', '.join(bench.TARGETS[args.target].devices)} only")
        if unable:
            print(f"note: on {args.device}, skipping the CPU-only targets {', '.join(unable)}", file=sys.stderr)
            targets = [n for n in targets if n not in unable]
    if args.plot and not need_matplotlib():
        return 2
    if args.tuned_allocator:  # the same process-wide setting for every contender
        from ..allocator import tune_cpu_allocator

        tune_cpu_allocator()
    records = []
    bar = not args.quiet and progress.interactive()  # a CI log gets one line per job instead
    paths = [Path(args.json)] if args.json else []

    def job_done(recs: list[dict]) -> None:
        """A log line per record and the records so far in the --json file, as each job ends."""
        if not args.quiet and not bar:
            for r in recs:
                print(_record_line(r), file=sys.stderr, flush=True)
        done.extend(recs)
        for path in paths:
            _write_json(path, [*records, *done])

    for name in targets:
        if not args.quiet and not bar:
            print(f"benchmark {name}/{args.preset} ...", file=sys.stderr, flush=True)
        done: list[dict] = []
        compile_mode = {} if args.compile in (None, "default") else {"mode": args.compile}
        with (bench.engine.compile_all(**compile_mode) if args.compile else contextlib.nullcontext(),
              bench.engine.on_device(args.device), bench.engine.with_baselines(args.baselines)):
            try:
                recs = bench.run(name, args.preset, progress=bar, cases=args.case, on_job=job_done)
            except ValueError as e:
                if not str(e).startswith(f"benchmark {name}/"):
                    raise
                raise UsageError(str(e)) from None
        records += recs
        if not args.quiet:
            print(bench.format_records(name, top_records(recs, args.top) if args.top else recs))
    if args.save:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        paths.append(Path("bench-results") / f"{args.target}-{args.preset}-{stamp}.json")
    for path in paths:
        _write_json(path, records)
        if not args.quiet:
            print(f"wrote {len(records)} records to {path}")
    if args.plot:
        plot_speedups(records, args.plot)
        if not args.quiet:
            print(f"wrote {args.plot}")
    return 0


def _write_json(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(_finite(records), f, indent=1, default=str, allow_nan=False)
        f.write("\n")


def _record_line(r: dict) -> str:
    """One record in a line of a log: case, N, mode, strategy, wide ms, the speedup per baseline."""
    speedups = "  ".join(f"{k} {v:.2f}x" for k, v in (r.get("speedup") or {}).items() if v is not None)
    return (f"  {r.get('case', '')} N={r.get('n')} {r.get('mode', '')} {r.get('strategy', '')}: "
            f"wide {r['wide_ms']:.3f} ms  {speedups}")


def _best_speedup(record: dict) -> float:
    """A record's speedup over its best (fastest) baseline; -inf when it has none."""
    speedups = [v for v in (record.get("speedup") or {}).values() if isinstance(v, (int, float))]
    return min(speedups) if speedups else -math.inf


def top_records(records: Sequence[dict], k: int) -> list[dict]:
    """The ``k`` records with the largest speedup over their best baseline, best first.

    >>> recs = [{"speedup": {"loop": 3.0, "vmap": 1.5}}, {"speedup": {"loop": 2.0}}, {"speedup": {}}]
    >>> [min(r["speedup"].values(), default=None) for r in top_records(recs, 2)]
    [2.0, 1.5]
    """
    return sorted(records, key=_best_speedup, reverse=True)[:k]


_NOT_A_SERIES = frozenset({"target", "mode", "case", "strategy", "n", "preset", "timing", "chosen_strategy",
                           "path"})


def _series_fields(record: dict) -> tuple[tuple[str, Any], ...]:
    """What tells a record's series apart besides case and strategy: its other settings (string,
    integer and boolean fields such as batch or in_features; floats are measurements)."""
    return tuple(sorted((k, v) for k, v in record.items() if k not in _NOT_A_SERIES
                        and isinstance(v, (str, int, bool)) and not isinstance(v, float)))


def plot_speedups(records: Sequence[dict], path: str) -> None:
    """Speedup of wide over each baseline against N (log-scaled), a dashed line at 1x: one panel
    per target and mode; in a panel one colour per setting (case, strategy, and sizes where the
    target has several) and one marker and line style per baseline, so no two series look alike.
    Written to ``path`` (matplotlib: the ``plot`` extra)."""
    from ..analyze_report import _pyplot

    plt = _pyplot()
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter

    panels: dict[tuple[str, str], dict[tuple, list[tuple[int, float]]]] = {}
    for r in records:
        for baseline, x in (r.get("speedup") or {}).items():
            if isinstance(x, (int, float)) and math.isfinite(x) and r.get("n"):
                key = (str(r.get("target") or "?"), str(r.get("mode") or ""))
                setting = (str(r.get("case") or ""), str(r.get("strategy") or ""), _series_fields(r))
                panels.setdefault(key, {}).setdefault((setting, str(baseline)), []).append((int(r["n"]), float(x)))
    targets = list(dict.fromkeys(t for t, _ in panels))
    modes = sorted({m for _, m in panels}, key=lambda m: (m not in ("inference", "train"), m))
    if not panels:
        targets, modes = ["no records with a speedup"], [""]
    fig, axes = plt.subplots(len(targets), len(modes), figsize=(8.5 * len(modes), 3.8 * len(targets)),
                             squeeze=False)
    styles = [("o", "-"), ("s", "--"), ("^", ":"), ("D", "-."), ("v", (0, (5, 1))), ("P", (0, (1, 1)))]
    for row, target in enumerate(targets):
        for col, mode in enumerate(modes):
            ax = axes[row][col]
            series = panels.get((target, mode))
            ax.set_title(f"{target} ({mode})" if mode else target, fontsize=10)
            if not series:
                ax.text(0.5, 0.5, "no records", ha="center", va="center", transform=ax.transAxes)
                ax.set_axis_off()
                continue
            settings = list(dict.fromkeys(setting for setting, _ in sorted(series)))
            baselines = sorted({b for _, b in series})
            # only the fields that differ between this panel's series go into the labels
            varying = {k for k in {k for s in settings for k, _ in s[2]}
                       if len({dict(s[2]).get(k) for s in settings}) > 1}
            colours = _palette(plt, len(settings))
            for (setting, baseline), points in sorted(series.items()):
                points.sort()
                marker, dash = styles[baselines.index(baseline) % len(styles)]
                ax.plot([p[0] for p in points], [p[1] for p in points], marker=marker, linestyle=dash,
                        color=colours[settings.index(setting)])
            ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
            ax.set_xscale("log", base=2)
            ns = sorted({p[0] for pts in series.values() for p in pts})
            ax.set_xticks(ns, [str(k) for k in ns])
            ys = [p[1] for pts in series.values() for p in pts]
            if min(ys) > 0 and max(ys) / min(ys) > 20:  # 0.5x beside 200x: a log axis keeps both readable
                ax.set_yscale("log")
                ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.set_xlabel("N (members)")
            ax.set_ylabel("speedup (baseline ms / wide ms)")
            # one legend entry per colour (the setting) and one per marker (the baseline)
            handles = [Line2D([], [], color=colours[i], linewidth=2,
                              label=" ".join(p for p in (case, strategy, *[f"{k}={v}" for k, v in fields
                                                                           if k in varying]) if p) or target)
                       for i, (case, strategy, fields) in enumerate(settings)]
            handles += [Line2D([], [], color="black", marker=styles[i % len(styles)][0],
                               linestyle=styles[i % len(styles)][1], label=f"vs {b}")
                        for i, b in enumerate(baselines)]
            ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                      borderaxespad=0.0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _palette(plt: Any, k: int) -> list[Any]:
    """``k`` distinct colours: tab10, tab20, then evenly spaced on a continuous map."""
    if k <= 10:
        return [plt.get_cmap("tab10")(i) for i in range(k)]
    if k <= 20:
        return [plt.get_cmap("tab20")(i) for i in range(k)]
    cmap = plt.get_cmap("turbo")
    return [cmap(i / (k - 1)) for i in range(k)]


def _finite(o: Any) -> Any:
    """Records with NaN/inf floats replaced by None: the file stays strict JSON."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o
