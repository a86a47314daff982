"""What the command line shows while it works: progress on stderr (a bar on a terminal, one line
per stage in CI or a pipe), and the check for matplotlib before a ``--plot`` run.
"""
from __future__ import annotations

import sys
from typing import Any

__all__ = ["Progress", "interactive", "need_matplotlib"]


def interactive(stream: Any = None) -> bool:
    """Whether to draw progress bars: ``stream`` (stderr) is a terminal and ``CI`` is not set
    (``CI=true`` on GitHub Actions, GitLab and most others). Elsewhere: one log line a stage."""
    import os

    stream = sys.stderr if stream is None else stream
    ci = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")
    try:
        return bool(stream.isatty()) and not ci
    except (AttributeError, ValueError):  # a closed or fake stream
        return False


class Progress:
    """``analyze``'s ``progress(stage, done, total)`` callback: a tqdm bar on stderr where that is
    a terminal (:func:`interactive`), one line per stage with the elapsed time elsewhere (a CI
    log gets no bar redraws)."""

    def __init__(self, desc: str, *, bar: bool | None = None) -> None:
        self.desc = desc
        self.use_bar = interactive() if bar is None else bar
        self.bar: Any = None
        from ..measure import Stopwatch

        self.clock = Stopwatch()

    def __call__(self, stage: str, done: int, total: int) -> None:
        elapsed = self.clock.seconds
        if self.use_bar:
            if self.bar is None:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=total, desc=self.desc, unit="stage", leave=False, file=sys.stderr)
            self.bar.update(done - self.bar.n)
            self.bar.set_postfix_str(stage)
            if done >= total:
                self.close()
        elif done >= total:
            print(f"{self.desc}: done in {elapsed:.1f} s", file=sys.stderr, flush=True)
        else:
            print(f"{self.desc} [{done + 1}/{total}] {stage} ({elapsed:.1f} s)", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def need_matplotlib(option: str = "--plot") -> bool:
    """True when matplotlib imports; else says how to get it on stderr (checked before the work)."""
    import importlib

    try:
        importlib.import_module("matplotlib")
    except ImportError:
        print(f"error: {option} needs matplotlib: pip install 'wide_compiler[plot]' (or pip install "
              "matplotlib); nothing was run", file=sys.stderr)
        return False
    return True
