"""``python -m wide_compiler analyze MODEL``: compile, time, profile and size N members of a model
(:func:`wide_compiler.analyze.analyze`) and print the report; ``--json``/``--markdown``/``--plot``
also write it to files.
"""
from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

from .inputs import UsageError
from .models import model_and_sample
from .progress import Progress, need_matplotlib

__all__ = ["run"]


def _sizes(text: str) -> list[int]:
    """``-n 4,16`` -> [4, 16]; a UsageError for anything but positive integers."""
    try:
        ns = [int(k) for k in str(text).split(",") if k.strip()]
    except ValueError:
        ns = []
    if not ns or min(ns) < 1:
        raise UsageError(f"-n {text!r}: expected population sizes of at least 1, like 4,16")
    return ns


def _checked_options(args: argparse.Namespace) -> tuple[list[int], list[str]]:
    """The options ``analyze`` would otherwise refuse after loading the model: sizes, modes,
    the memory budget, the output files' folders (made here, as ``benchmark --json`` does)."""
    from .. import measure
    from ..analyze import parse_bytes

    ns = _sizes(args.n)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in measure.MODES for m in modes):
        raise UsageError(f"--modes {args.modes!r}: expected a comma-separated subset of "
                         f"{','.join(measure.MODES)}")
    if args.memory is not None:
        try:
            parse_bytes(args.memory)
        except ValueError:
            raise UsageError(f"--memory {args.memory!r}: expected bytes or a size like 8GB, 512MiB") from None
    for option in ("json", "markdown", "plot"):
        path = getattr(args, option)
        if path:
            parent = Path(path).parent
            if parent.exists() and not parent.is_dir():
                raise UsageError(f"--{option} {path}: {parent} is not a folder")
            parent.mkdir(parents=True, exist_ok=True)
    return ns, modes


def run(args: argparse.Namespace) -> int:
    """Check the options and the model's input first (usage errors, exit 2), then analyze: exit 1
    with the compiler's message when the model cannot be compiled."""
    import wide_compiler as wc
    from ..analyze import analyze, plot

    if args.plot and not need_matplotlib():  # before minutes of work, not after
        return 2
    ns, modes = _checked_options(args)
    loaded, _, sample = model_and_sample(args, "analyze", 0)
    progress = None if args.quiet else Progress(f"analyze {loaded.label}")
    try:
        report = analyze(loaded.factory, sample.args, sample_kwargs=sample.kwargs or None, n=ns,
                         memory=args.memory, modes=modes, repeats=args.repeats,
                         config=getattr(wc.WideConfig, args.config)(), progress=progress)
    except wc.WideCompileError as e:
        if progress is not None:
            progress.close()  # the bar off the terminal before the message
        print(f"wide_compiler analyze: {loaded.label} cannot be fused: {e}", file=sys.stderr, flush=True)
        if args.verbose:
            traceback.print_exc()
        return 1
    finally:
        if progress is not None:
            progress.close()
    print(report)
    if args.json:
        Path(args.json).write_text(report.to_json())
    if args.markdown:
        Path(args.markdown).write_text(report.to_markdown())
    if args.plot:
        plot(report, args.plot)
        print(f"wrote {args.plot}")
    return 0
