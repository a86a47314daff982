"""Checking that a wide model is its N members: the equivalence harness.

Member ``i`` of a wide model must compute exactly what model ``i`` computes alone. This module is
the one place where that is checked -- by the project's tests, by ``compile(..., validate=True)``,
by ``python -m wide_compiler test``, by the benchmarks -- and it is public: it is what you would
write to trust the tool on your own model.

* :func:`check_compile` -- the one-line whole-model check: compile, then compare every member in
  train and eval mode, on per-member inputs and on one shared input.
* :func:`check_equivalence` -- compare a wide model (or any wide callable whose parameters are
  named like the member's) with its members on given inputs: outputs, input gradients, parameter
  gradients and buffers after the call.
* :func:`assert_members_close`, :func:`assert_trees_members_close`, :func:`assert_close`,
  :func:`max_member_error` -- the comparisons, with :func:`tolerance`.
* :func:`member_inputs`, :func:`shared_input`, :func:`stack_inputs` -- sample inputs.

float32: against a float64 run
------------------------------
A wide op computes all N members in one kernel (a batched GEMM, a grouped convolution, one GEMM
against the weights concatenated on the output dim for a shared input) where the reference runs N
separate ops. Both compute the same sums, but BLAS blocks and vectorises them differently, so
floating-point additions happen in a different order. The results are therefore equal only up to
rounding -- and how far rounding moves a result depends on the model: in a deep network in train
mode (BatchNorm over small planes, ReLU kinks, max-pool near-ties) a member's own float32 gradients
can sit 1e-3 away from the exact ones. So by default a float32 model is judged against a float64
run of its members (same weights, buffers, inputs and cotangents): per tensor, the wide model's
error against it must be within ``NOISE_FACTOR`` (4) times the members' own float32 error against
it, or 4 times a floor of ``NOISE_FLOOR_EPS`` (8) float32 eps of the tensor's largest value. A
tensor outside that is judged again with up to ``RESAMPLES`` (6) float32 reruns of the member whose
weights, inputs and op results are nudged by up to ``NUDGE_EPS`` (16) eps, so a value the wide
program rounds to the other side of a kink (a ReLU input within rounding of 0) is taken for the
rounding it is. Both errors are in the report (``print(report)``); the reasoning is Note [The
float64 reference] in
``_equivalence/reference.py``. A failure means the wide model is further from the exact result than rounding
takes the members themselves: a defect, not noise.

Tolerances
----------
float64, bfloat16 and float16 models, calls with explicit ``rtol``/``atol``, and float32 models
whose members cannot run in float64 compare the wide result with the member's directly, within the
table below (:func:`tolerance`). A float64 tensor outside the table (no ``rtol``/``atol`` given) is
judged again against the member's own float64 rounding -- nudged float64 reruns of the member, as
above -- so an ill-conditioned float64 model (BatchNorm over 1x1 planes in batches of 2) is not
failed for rounding it does itself (Note [Rounding in a float64 model] in
``_equivalence/reference.py``):

* float32: an output is a dot product of a few dozen to a few hundred terms; reordering a sum of k
  terms moves the result by about k * eps32 * sum|terms| (eps32 = 1.2e-7). With unit-scale
  activations and the default initialisations that stays under 1e-5, so outputs use
  rtol=atol=1e-5. Gradients go through one more GEMM (and, for a shared input, a sum over
  members), so they get a little more room: 1e-4 absolute / 1e-5 relative. Buffers (BatchNorm
  running statistics) are means and variances over the batch mixed into the old value with a
  momentum: sums like the outputs, so the output tolerance. An optimizer step scales gradients by
  the learning rate, so weights after a step use the output tolerance too.
* float64: the same argument with eps64 = 2.2e-16 gives errors far below 1e-10.
* bfloat16 (8 significant bits, eps = 7.8e-3) and float16 (11 bits, eps = 9.8e-4): CPU and GPU
  kernels accumulate in float32 and round each op's result once, so two accumulation orders give
  results at most an ulp or two apart per op, and a few ops in a row compound that. Outputs and
  buffers allow 2 ulps relative plus an absolute 2 ulps of a unit-scale value (bfloat16: 1.6e-2;
  float16: 2e-3); gradients twice that (their cotangents are rounded too).
* Integer and bool results (indices, masks, ``num_batches_tracked``) must be exact.

A real bug (a member reading another member's weights, a wrong dim, a missing bias) produces
errors of order 1, many orders of magnitude above these bounds.

Example:
    >>> import torch, wide_compiler as wc
    >>> from wide_compiler import testing
    >>> models = [torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    ...           for _ in range(3)]
    >>> wide, report = testing.check_compile(models, torch.randn(5, 4), config=wc.WideConfig.fast())
    >>> sorted(report)
    ['eval/own', 'eval/shared', 'train/own', 'train/shared']
    >>> report["train/own"]["param_grad"] < 1e-4       # max abs difference from the members
    True
    >>> report["train/own"].reference                   # how the differences were judged
    'float64'
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

# The comparisons live one layer down (Note [The harness in two layers] in _equivalence/);
# this module is their public home.
from . import _equivalence
from ._equivalence import (  # noqa: F401
    EquivalenceReport,
    TOLERANCES,
    assert_close,
    assert_members_close,
    assert_trees_members_close,
    check_equivalence,
    make_members,
    max_member_error,
    member_inputs,
    random_ops,
    shared_input,
    stack_inputs,
    tolerance,
    _as_args,
)
from ._equivalence.draws import fixed_draws
from .api import compile as wide_compile

# The harness (_equivalence/), and the whole-model check built on the compiler.
__all__ = ["check_compile"]
__all__ += _equivalence.__all__

log = logging.getLogger(__name__)


# --- the whole-model check ----------------------------------------------------------------------


def check_compile(
    models: nn.Module | Sequence[nn.Module],
    sample: Any,
    *,
    modes: Sequence[str] = ("train", "eval"),
    shared: bool | Sequence[bool] = (False, True),
    inputs: Sequence[Any] | None = None,
    kwargs: Sequence[Mapping[str, Any]] | None = None,
    sample_kwargs: Mapping[str, Any] | None = None,
    grads: bool = True,
    buffers: bool = True,
    seed: int = 0,
    rtol: float | None = None,
    atol: float | None = None,
    strict: bool = False,
    config: Any = None,
    **compile_kwargs: Any,
) -> tuple[Any, dict[str, EquivalenceReport | str]]:
    """Compile ``models`` and check every member in train and eval mode: the one-line check.

    Runs :func:`wide_compiler.compile` (``strict``, ``config``, ``sample_kwargs`` and any other
    keyword are passed on), then :func:`check_equivalence` in every mode of ``modes`` on
    per-member inputs (``inputs``, default: independent perturbations of ``sample``, see
    :func:`member_inputs`) and, with ``True`` in ``shared``, on ``sample`` shared by all members.
    The models are never modified (members run on copies, each switched to the mode checked) and
    the wide model is returned in the models' mode.

    A train graph with random ops (dropout, stochastic depth...) is compared with every random
    draw fixed to one value on both sides (a dropout then keeps every element, scaled; Note
    [Fixed draws in the trust check] in _equivalence/draws.py), so train mode is checked in full;
    where a draw cannot be fixed (``multinomial``...), its train-mode checks are skipped with a
    warning in the log and the report says why.

    Args:
        models: the N members (or one model with ``n=K``: the members are then the wide model's
            own :meth:`~wide_compiler.WideModel.unfuse` copies).
        sample: ONE member's input (a tensor or a tuple of positional inputs).
        modes: ``"train"`` and/or ``"eval"``.
        shared: check on per-member inputs (False), on one shared input (True), or both.
        inputs, kwargs: the per-member inputs (a list of N) and keyword inputs (a list of N dicts)
            to check on, instead of perturbed copies of ``sample``/``sample_kwargs``.
        grads, buffers, seed: as for :func:`check_equivalence`.
        rtol, atol: None (the default): a float32 model is judged against a float64 run of its
            members (the module docstring); given, every comparison is the direct fixed-tolerance
            one, within these (as for :func:`check_equivalence`).

    Returns:
        ``(wide, report)``: the compiled model, and ``{"train/own": EquivalenceReport, ...}`` per
        mode and input layout (a string where a check was skipped).

    Example:
        >>> import torch, wide_compiler as wc
        >>> from wide_compiler import testing
        >>> make = lambda: torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8),
        ...                                    torch.nn.ReLU(), torch.nn.Linear(8, 3))
        >>> models = [make() for _ in range(4)]
        >>> wide, report = testing.check_compile(models, torch.randn(10, 6), config=wc.WideConfig.fast())
        >>> print(report["train/own"])                    # doctest: +ELLIPSIS
        4 members, max abs err against a float64 run (wide / members' own float32): output ...e-0... / ..., input grad ..., param grad ..., buffer ...
        >>> [m.training for m in models], wide.training     # nothing was switched for good
        ([True, True, True, True], True)
    """
    for mode in modes:
        if mode not in ("train", "eval"):
            raise ValueError(f"check_compile: modes must be 'train' and/or 'eval', got {mode!r}")
    layouts = (shared,) if isinstance(shared, bool) else tuple(shared)
    wide = wide_compile(models, sample, strict=strict, config=config,
                        sample_kwargs=dict(sample_kwargs) if sample_kwargs is not None else None,
                        **compile_kwargs)
    members = wide.unfuse() if isinstance(models, nn.Module) else list(models)
    n = len(members)
    args = _as_args(sample)
    kw = dict(sample_kwargs or {})
    if inputs is None:
        _, per_member = member_inputs((args, kw), n, seed=seed)
        inputs = [a for a, _ in per_member]
        kwargs = [k for _, k in per_member]
    report: dict[str, EquivalenceReport | str] = {}
    for mode in modes:
        training = mode == "train"
        random = random_ops(wide, training) if training else []
        for is_shared in layouts:
            key = f"{mode}/{'shared' if is_shared else 'own'}"
            try:
                # a graph with random ops: every draw fixed on both sides (Note [Fixed draws in
                # the trust check] in _equivalence/draws.py)
                with fixed_draws(bool(random)) as unfixed:
                    if is_shared:
                        report[key] = check_equivalence(
                            wide, members, inputs[0], kwargs=(kwargs[0] if kwargs is not None else None),
                            shared=True, grads=grads, buffers=buffers, seed=seed, training=training,
                            rtol=rtol, atol=atol, what=f"{key} output")
                    else:
                        report[key] = check_equivalence(
                            wide, members, inputs, kwargs=kwargs, grads=grads, buffers=buffers, seed=seed,
                            training=training, rtol=rtol, atol=atol, what=f"{key} output")
            except AssertionError as e:  # name the check in every failure (a gradient's too)
                if not unfixed:
                    if str(e).startswith(key):
                        raise
                    raise AssertionError(f"{key}: {e}") from None
            if unfixed:
                report[key] = (f"skipped: the train graph draws random numbers with {', '.join(sorted(unfixed))}, "
                               "which the check cannot fix to one value on both sides, so train values cannot "
                               "match")
                log.warning("wide_compiler.testing.check_compile: %s: %s", key, report[key])
                continue
            if random:
                log.info("wide_compiler.testing.check_compile: %s: random ops (%s) compared with every draw "
                         "fixed (dropout keeps everything)", key, ", ".join(random))
            log.info("wide_compiler.testing.check_compile: %s: %s", key, report[key])
    return wide, report
