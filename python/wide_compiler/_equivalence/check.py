""":func:`check_equivalence`, the trust check: member ``i`` of a wide model computes what its own
model computes alone; and :func:`random_ops`, the random ops that keep a train graph from being
compared value by value."""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import sys
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from .inputs import _Inputs, _prepare_inputs
from .members import _own_rounding, _run_members, _run_members_float64
from .report import EquivalenceReport
from .wide import _padded_references, _run_wide, _Tolerance, _wide_tensors

__all__ = ["check_equivalence", "random_ops"]


log = logging.getLogger("wide_compiler.testing")  # the public harness's logger, as before the split

# --- check_equivalence, in phases ----------------------------------------------------------------
#
# Note [check_equivalence in phases]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# check_equivalence runs four phases, one function each, in this order; it is also the order of
# the errors a caller can meet (a malformed input fails before any member runs, a member that
# cannot be copied before the wide model is looked at):
#
# 1. _prepare_inputs: the per-member inputs, checked, and the wide inputs made from them (their
#    N-first stack, the caller's own N-first tensor, or a shared input's expand);
# 2. _run_members: every member alone on a deep copy, under a random cotangent per output leaf:
#    the references (outputs, input and parameter gradients, buffers after the call);
# 3. _wide_tensors: which wide parameters and buffers stand for which member names;
# 4. _run_wide: the wide model once, its buffers and train/eval mode restored afterwards
#    (_wide_state_kept), and its outputs, buffers and gradients compared with the references
#    (_compare_outputs, _compare_buffers, _compare_grads_of_wide).



def check_equivalence(
    wide: Any,
    models: Sequence[nn.Module],
    inputs: Any,
    *,
    kwargs: Any = None,
    shared: bool = False,
    grads: bool = True,
    buffers: bool = True,
    seed: int = 0,
    training: bool | None = None,
    dtype: torch.dtype | None = None,
    wide_params: Mapping[str, torch.Tensor | None] | None = None,
    wide_buffers: Mapping[str, torch.Tensor | None] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    equal_nan: bool = False,
    what: str = "output",
) -> EquivalenceReport:
    """Check that member ``i`` of ``wide`` computes what ``models[i]`` computes alone.

    Every member runs on its own input on a deep copy (the models you pass are never modified);
    ``wide`` runs once on the N-first inputs. Then, member by member:

    * outputs (any pytree; integer/bool leaves exactly);
    * with ``grads``: under a random cotangent per member and output (seeded by ``seed``), the
      gradients of the floating inputs (for a shared input: the sum over members) and of every
      parameter, by name;
    * with ``buffers``: every buffer after the call (BatchNorm running statistics,
      ``num_batches_tracked``).

    How floating results are judged depends on the compute dtype. In float32 (without ``rtol`` or
    ``atol``), every member also runs in float64 (a deep copy cast with ``.double()``, same state,
    inputs and cotangents), and per tensor the wide model's error against that float64 run must be
    within :data:`NOISE_FACTOR` (4) times the members' own float32 error against it, or 4 times a
    floor of :data:`NOISE_FLOOR_EPS` (8) float32 eps of the tensor's largest value (Note [The
    float64 reference]): the wide model must be as close to the exact result as the members
    themselves, however ill-conditioned the model. A member that cannot run in float64 falls back
    to the fixed table, with a warning and ``report.fallback`` saying why. In any other dtype, or
    with ``rtol``/``atol``, the wide result is compared with the member's directly, within
    :func:`tolerance` (or ``rtol``/``atol``). Integer and bool results are always exact.

    The wide model's buffers are restored after the call and gradients are taken with
    ``torch.autograd.grad``, so no ``.grad`` is written: the check leaves both sides as they were.

    Args:
        wide: a :class:`~wide_compiler.WideModel`, a ``torch.compile``'d one, a hand-built
            ``wide_compiler.nn`` module, or any callable taking N-first inputs.
        models: the N members.
        inputs: a list of N per-member inputs (each a tensor or a tuple of positional inputs,
            possibly nested); an N-first tensor counts as the list of its rows and is passed to
            ``wide`` as it is (strides kept). With ``shared=True``: ONE member's input, given to
            every member and to ``wide`` as ``x.expand(N, *x.shape)``.
        kwargs: keyword inputs: a list of N dicts (one dict with ``shared=True``).
        training: run in this mode (the member copies and, for the call, ``wide``); default: as
            they are.
        dtype: the compute dtype for the tolerances and the choice above (default: the members'
            first floating parameter's dtype, else their buffers', else the inputs').
        wide_params, wide_buffers: member name -> stacked ``[N, ...]`` tensor of ``wide`` (entries
            that are None are skipped). Default: ``wide``'s own named parameters / buffers, whose
            names must be the member's (a torch.compile ``_orig_mod.`` prefix is ignored; buffers
            the members do not have, such as lifted constants, are skipped).
        rtol, atol: compare with the members directly within these, for every comparison (no
            float64 run; the fixed-tolerance check).
        equal_nan: NaN in the same place on both sides counts as equal.
        what: label of the outputs in failure messages.

    Returns:
        An :class:`EquivalenceReport`: the max abs difference from the members per kind
        (``output``, ``input_grad``, ``param_grad``, ``buffer``; None where nothing was compared);
        ``.wide_output`` is the wide output; ``.reference`` is ``"float64"`` or ``"fixed"``, and
        with a float64 run ``.wide_error``/``.own_error`` hold, per kind, the wide model's and the
        members' own largest error against it (``print(report)`` shows both).

    Raises:
        AssertionError: naming what differs (``grad of fc.weight: member 2 differs ...``).

    Example:
        >>> import torch, wide_compiler as wc
        >>> from wide_compiler import testing
        >>> layers = [torch.nn.Linear(3, 2) for _ in range(4)]
        >>> wide = wc.nn.WideLinear.from_modules(layers)          # parameters 'weight', 'bias'
        >>> report = testing.check_equivalence(wide, layers, torch.randn(4, 5, 3))
        >>> sorted(k for k, v in report.items() if v is not None)
        ['input_grad', 'members', 'output', 'param_grad']
        >>> print(report)                                          # doctest: +ELLIPSIS
        4 members, max abs err against a float64 run (wide / members' own float32): output ... / ..., input grad ...
        >>> testing.check_equivalence(wide, layers[::-1], torch.randn(4, 5, 3))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        AssertionError: output: member 0 differs from its own model (member 0 of 4): against a float64 run ...
    """
    models = list(models)
    n = len(models)
    if n == 0:
        raise ValueError("wide_compiler.testing.check_equivalence: expected at least one model")
    # The four phases: Note [check_equivalence in phases].
    inp = _prepare_inputs(n, inputs, kwargs, shared=shared, grads=grads)
    if dtype is None:
        dtype = next((p.dtype for p in models[0].parameters() if p.is_floating_point()), None)
    tol = _Tolerance(dtype, rtol, atol, equal_nan)
    refs = _run_members(models, inp, grads=grads, training=training, seed=seed)
    refs64, fallback = None, None
    if rtol is None and atol is None and _compute_dtype(dtype, models[0], inp) == torch.float64:
        # Note [Rounding in a float64 model]: the table first, then the members' own rounding
        tol = dataclasses.replace(tol, own_rounding=True)
        refs64 = _own_rounding(models, inp, refs, grads=grads, training=training)
    elif rtol is None and atol is None and _compute_dtype(dtype, models[0], inp) == torch.float32:
        refs64, fallback = _run_members_float64(models, inp, refs, grads=grads, training=training)
        if fallback is not None:
            log.warning("wide_compiler.testing: %s: %s, so the members are compared with fixed float32 "
                        "tolerances instead of against a float64 run (Note [The float64 reference])",
                        what, fallback)
    if callable(getattr(wide, "member_padded", None)) and not _at_wide_sizes(wide, models):
        # Note [Checking padded members]
        mode = training if training is not None else bool(getattr(wide, "training", True))
        refs = _padded_references(wide, refs, training=mode)
        refs64 = None if refs64 is None else _padded_references(wide, refs64, training=mode)
    params_map, buffers_map = _wide_tensors(wide, models[0], wide_params, wide_buffers, buffers=buffers)
    try:
        report = _run_wide(wide, inp, refs, refs64, params_map, buffers_map, tol, n=n, shared=shared,
                           grads=grads, training=training, what=what)
    except AssertionError as e:
        if fallback is None:
            raise
        raise AssertionError(f"{e}\n(compared with fixed float32 tolerances: {fallback})") from None
    report.fallback = fallback
    if report.blind:  # Note [A float32 judgement that cannot tell]
        report.float64_recheck = _recheck_in_float64(
            wide, models, inputs, kwargs, report.blind, wide_params=wide_params, wide_buffers=wide_buffers,
            shared=shared, grads=grads, buffers=buffers, seed=seed, training=training, equal_nan=equal_nan,
            what=what)
    log.debug("wide_compiler.testing: %s", report)
    return report


def _recheck_in_float64(wide: Any, models: Sequence[nn.Module], inputs: Any, kwargs: Any,
                        blind: Mapping[str, float], *, wide_params: Mapping[str, torch.Tensor | None] | None,
                        wide_buffers: Mapping[str, torch.Tensor | None] | None, shared: bool, grads: bool,
                        buffers: bool, seed: int, training: bool | None, equal_nan: bool,
                        what: str) -> EquivalenceReport:
    """Note [A float32 judgement that cannot tell]: the check made again on float64 deep copies of
    ``wide`` (its parameters' gradient hooks kept; ``wide_params``/``wide_buffers`` followed to the
    copy's tensors of the same names) and of ``models``, on the inputs cast alike; raises
    AssertionError where it cannot be made."""
    worst = sorted(blind.items(), key=lambda kv: -kv[1])
    names = ", ".join(f"{name} ({100 * share:.0f}%)" for name, share in worst[:3]) + (", ..." if len(worst) > 3 else "")
    log.info("wide_compiler.testing: %s: the float32 judgement cannot tell for %d tensor(s): %s; checking again "
             "in float64", what, len(blind), names)
    why, maps = None, (wide_params, wide_buffers)
    try:
        base = getattr(wide, "_orig_mod", wide)
        own = {id(t): name for name, t in (*base.named_parameters(remove_duplicate=False),
                                             *base.named_buffers(remove_duplicate=False))}
        named = [None if m is None else {k: None if t is None else own.get(id(t)) for k, t in m.items()}
                 for m in maps]
        lost = [k for m, n in zip(maps, named) if m is not None for k, t in m.items() if t is not None and n[k] is None]
        if lost:
            why = f"the wide tensors given for {', '.join(lost[:3])} are not the wide model's own"
        else:
            wide64 = copy.deepcopy(base)
            hooks = {name: p._backward_hooks for name, p in base.named_parameters() if p._backward_hooks}
            for name, p in wide64.named_parameters():
                if name in hooks:
                    p._backward_hooks = OrderedDict(hooks[name])
            wide64 = wide64.double()
            models64 = [copy.deepcopy(m).double() for m in models]
            now = {**dict(wide64.named_parameters(remove_duplicate=False)),
                   **dict(wide64.named_buffers(remove_duplicate=False))}
            maps = tuple(None if n is None else {k: None if v is None else now[v] for k, v in n.items()} for n in named)
    except Exception as e:  # noqa: BLE001 -- any reason the copies cannot be made: said in the failure
        why = f"{type(e).__name__}: {e}"
    if why is not None:
        raise AssertionError(
            f"{what}: cannot judge in float32: the members' own float32 error is as large as a defect of "
            f"{100 * worst[0][1]:.0f}% of the values in {names}, and the check could not be made again in "
            f"float64 ({why}). Check the members converted with .double(), or on a sample where they are "
            "better conditioned (BatchNorm over larger batches and planes) (Note [A float32 judgement that "
            "cannot tell] in wide_compiler/_equivalence/reference.py)")
    cast = functools.partial(tree_map, lambda t: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
    try:
        return check_equivalence(wide64, models64, cast(inputs), kwargs=cast(kwargs), shared=shared, grads=grads,
                                 buffers=buffers, seed=seed, training=training, dtype=torch.float64,
                                 wide_params=maps[0], wide_buffers=maps[1], equal_nan=equal_nan, what=what)
    except AssertionError as e:
        raise AssertionError(
            f"checked again in float64 (the members' own float32 error is as large as a defect of "
            f"{100 * worst[0][1]:.0f}% of the values in {names}, so float32 cannot tell; the wide model and the "
            f"members cast with .double()): {e}") from None


def _at_wide_sizes(wide: nn.Module, models: Sequence[nn.Module]) -> bool:
    """Whether every member's state tensors have the wide model's member shapes (``validate=True``
    of a padded model compares it with its padded members: nothing to place); a torch.compile
    wrapper's names are its model's."""
    wide = getattr(wide, "_orig_mod", wide)
    wide_state = {**dict(wide.named_parameters()), **dict(wide.named_buffers())}
    return all(name not in wide_state or tuple(t.shape) == tuple(wide_state[name].shape[1:])
               for m in models for name, t in (*m.named_parameters(), *m.named_buffers()))


def _compute_dtype(dtype: torch.dtype | None, model: nn.Module, inp: _Inputs) -> torch.dtype | None:
    """The dtype a check's members compute in: ``dtype``, else the first floating parameter's (as
    for the tolerances), buffer's or input's."""
    if dtype is not None:
        return dtype
    tensors = [*model.buffers(), *(a for a in inp.member_leaves[0] if isinstance(a, torch.Tensor))]
    return next((t.dtype for t in tensors if t.is_floating_point()), None)


# --- random ops of a wide model -----------------------------------------------------------------


def random_ops(wide: Any, training: bool = True) -> list[str]:
    """The random ops (dropout, bernoulli, randn ...) of a wide model's train or eval graph,
    inside no-grad/autocast regions and fallbacks included, that really draw (a dropout with
    ``p=0`` does not, nor does SDPA with ``dropout_p=0``, nor an ``nn.LSTM``/``GRU``/``RNN`` with
    ``dropout=0`` or one layer, so those are compared in train mode); [] for anything but a WideModel
    (or its ``torch.compile``): their members draw their own numbers, so they cannot be compared
    value by value."""
    # Looked up, not imported: this package sits below model.py (Note [The harness in two layers]),
    # and a WideModel can only exist once wide_compiler.model is loaded.
    model = sys.modules.get("wide_compiler.model")
    wide = getattr(wide, "_orig_mod", wide)
    if model is None or not isinstance(wide, model.WideModel):
        return []
    return sorted(wide._graph_for(training).random_ops)
