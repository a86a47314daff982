"""No silent pauses: :class:`Progress` says what a long stage (a compile, a recapture) is doing.

Note [No silent pauses]
    A compile takes seconds (an export, widening, tuning), a recapture for a new input size too,
    and a pause of seconds with nothing shown looks like a hang. A stage run under
    :class:`Progress` says nothing when it ends within ``after`` seconds (2 s by default: most
    compiles of small models); past that it says which step it is in: on a terminal (stderr is a
    tty) one status line on stderr, rewritten in place as the steps go and erased at the end;
    otherwise (a log file, a notebook, CI) one INFO log line per step that starts after the
    first ``after`` seconds, and one at the end with the time and the slowest steps. A step that
    alone runs past ``after`` is announced while it runs (a daemon thread waits for it), so even
    one long export is not silent. The clock is the measuring clock
    (:func:`~wide_compiler.measure.now`: tests fake it, Note [Fake clock]); the thread only
    decides when to look.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any, TextIO

from .timing import now

__all__ = ["Progress"]

log = logging.getLogger("wide_compiler.progress")

_active = threading.local()  # the Progress of this thread's outermost stage (nested stages join it)


class Progress:
    """Tell what ``what`` (e.g. ``"compiling the train graph of ResNet18"``) is doing once it has
    taken ``after`` seconds (Note [No silent pauses]). Use as a context manager and call
    :meth:`step` as each step starts; ``stream``: where the status line goes (default
    ``sys.stderr``, used only when it is a terminal; else log lines at INFO).

    A stage inside another (a pipeline run inside a compile) joins the outer one: its steps are
    the outer stage's, and only the outer one reports its end.

    Example:
        >>> import io
        >>> with Progress("compiling", after=60.0, stream=io.StringIO()) as p:
        ...     p.step("capture")
        >>> p.steps[0][0], p.reported
        ('capture', False)
    """

    def __init__(self, what: str, *, after: float = 2.0, stream: TextIO | None = None) -> None:
        self.what, self.after = what, after
        self.stream = stream if stream is not None else sys.stderr
        self.steps: list[tuple[str, float]] = []  # (step, start time)
        self.reported = False  # whether anything was said (then the end is said too)
        self._start = 0.0
        self._shown: str | None = None  # the last step said
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._outer: Progress | None = None
        self._thread: threading.Thread | None = None

    def _tty(self) -> bool:
        try:
            return bool(self.stream.isatty())
        except (AttributeError, ValueError):  # a closed or odd stream: no status line
            return False

    def __enter__(self) -> Progress:
        self._outer = getattr(_active, "progress", None)
        if self._outer is not None:
            return self
        _active.progress = self
        self._start = now()
        if self.after > 0:
            self._thread = threading.Thread(target=self._watch, name="wide_compiler-progress", daemon=True)
            self._thread.start()
        return self

    def step(self, name: str) -> None:
        """Step ``name`` starts now (said at once when the stage has run ``after`` seconds)."""
        if self._outer is not None:
            self._outer.step(name)
            return
        self.steps.append((name, now()))
        if now() - self._start >= self.after:
            self._say()

    def _watch(self) -> None:
        """Wake ``after`` seconds in, then twice a second: say the step running (once a step)."""
        wait = self.after
        while not self._done.wait(wait):
            if now() - self._start >= self.after:
                self._say()
            wait = 0.5

    def _say(self) -> None:
        with self._lock:
            if self._done.is_set() or not self.steps:
                return
            name, _ = self.steps[-1]
            elapsed = now() - self._start
            if self._tty():
                self.stream.write(f"\r\x1b[K{self.what}: {name} ({elapsed:.0f} s)")
                self.stream.flush()
            elif name != self._shown:
                log.info("wide_compiler: %s: %s (%.1f s so far)", self.what, name, elapsed)
            self._shown, self.reported = name, True

    def __exit__(self, *exc: Any) -> None:
        if self._outer is not None:
            return
        _active.progress = None
        with self._lock:
            self._done.set()
        if self._thread is not None:
            self._thread.join()
        if not self.reported:
            return
        end = now()
        if self._tty():
            self.stream.write("\r\x1b[K")
            self.stream.flush()
        times = [(name, (self.steps[k + 1][1] if k + 1 < len(self.steps) else end) - t)
                 for k, (name, t) in enumerate(self.steps)]
        slowest = ", ".join(f"{name} {s:.1f} s" for name, s in sorted(times, key=lambda x: -x[1])[:3])
        log.info("wide_compiler: %s: done in %.1f s (%s)%s", self.what, end - self._start, slowest,
                 " (failed)" if exc and exc[0] is not None else "")
