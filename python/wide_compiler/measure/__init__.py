"""``wide_compiler.measure``: the one measurement library of the package.

Everything that times something goes through here: the strategy tuner
(:mod:`wide_compiler.tuning`), the model-level tuning check (fx/model_check.py),
:func:`wide_compiler.analyze`, the benchmarks (:mod:`wide_compiler.bench`, built on top of
this) and the CLI. Four parts:

- :mod:`.timing`: the clock (:func:`now`, faked by tests: Note [Fake clock]), THE timing loop
  (:func:`interleave`: interleaved rounds, warm-up, a stop predicate; Note [Interleaved
  timing]), :func:`time_interleaved` (calibrated blocks, median ms), :func:`time_with_baselines`,
  :class:`Stopwatch` and the ``ms`` / speedup formatters;
- :mod:`.contenders`: the ways to run N members that measurements compare, built once: the wide
  model, the member loop (optionally channels-last), ``torch.func`` vmap ensembling and
  ``torch.compile`` of any of them; :func:`make_step` and the per-member comparison
  :func:`max_abs_err`;
- :mod:`.machine`: the machine facts a number depends on (:func:`machine_info`, practical peak
  :func:`peak_gflops`, :func:`end_of_run`, :func:`contention_note`);
- :mod:`.progress`: :class:`Progress`, what a long compile says while it runs (Note [No silent
  pauses]).

Nothing here imports the benchmarks, the tests, the integrations or the CLI.

Example::

    >>> import torch
    >>> from torch import nn
    >>> from wide_compiler import measure
    >>> models = [nn.Linear(8, 4) for _ in range(3)]
    >>> x = torch.randn(3, 2, 8)
    >>> steps = {c.name: measure.make_step(c, x, "inference")
    ...          for c in (measure.loop_contender(models), measure.vmap_contender(models))}
    >>> sorted(measure.time_interleaved(steps, min_run_time=0.01))
    ['loop', 'vmap']
"""

from __future__ import annotations

from . import contenders, machine, progress, timing
from .contenders import (
    MODES,
    CallInputs,
    Contender,
    compiled,
    compiled_loop_contender,
    compiled_vmap_contender,
    loop_contender,
    make_step,
    max_abs_err,
    member_inputs,
    params_max_abs_err,
    stacked_params,
    stored_grads,
    vmap_contender,
    wide_contender,
    wide_params_in_member_order,
)
from .machine import contention_note, end_of_run, hardware, machine_info, peak_gflops
from .progress import Progress
from .timing import (
    Rounds,
    Stopwatch,
    TimingError,
    error_text,
    fmt_ms,
    fmt_x,
    interleave,
    now,
    time_interleaved,
    time_with_baselines,
)

__all__ = [
    "MODES", "CallInputs", "Contender", "Progress", "Rounds", "Stopwatch", "TimingError", "compiled",
    "compiled_loop_contender", "compiled_vmap_contender", "contenders", "contention_note", "end_of_run", "error_text", "fmt_ms", "fmt_x", "hardware",
    "interleave", "loop_contender", "machine", "machine_info", "make_step", "max_abs_err",
    "member_inputs", "now", "params_max_abs_err", "peak_gflops", "progress", "stacked_params", "stored_grads",
    "time_interleaved", "time_with_baselines", "timing", "vmap_contender", "wide_contender",
    "wide_params_in_member_order",
]
