"""Phase 2 of :func:`~wide_compiler.testing.check_equivalence` (Note [check_equivalence in
phases]): every member alone on a deep copy, the references the wide model is compared with --
in float32, in float64 and, on demand, nudged (Note [The float64 reference])."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .compare import _float_leaf, _widest
from .inputs import _Inputs
from .reference import _Rerounded

__all__: list[str] = []


log = logging.getLogger("wide_compiler.testing")  # the public harness's logger, as before the split


@dataclasses.dataclass
class _References:
    """What the members computed alone, one entry per member: the output (detached), the input
    gradients (per input leaf, None where none), the parameter gradients by name, the buffers
    after the call, and the cotangent drawn for each output leaf (None where a leaf takes none)."""

    outputs: list[Any] = dataclasses.field(default_factory=list)
    input_grads: list[list[torch.Tensor | None]] = dataclasses.field(default_factory=list)
    param_grads: list[dict[str, torch.Tensor | None]] = dataclasses.field(default_factory=list)
    buffers: list[dict[str, torch.Tensor]] = dataclasses.field(default_factory=list)
    cotangents: list[list[torch.Tensor | None]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Float64Run(_References):
    """The members' float64 run (Note [The float64 reference]) and, on demand, ``nudged(i, k)``:
    member ``i``'s ``k``-th nudged float32 run (_Rerounded; one member's references, cached)."""

    nudged: Callable[[int, int], _References | None] | None = None



def _member_leaf(a: Any, *, grads: bool, double: bool) -> Any:
    """A member's own copy of an input leaf (float64 for the float64 run), a leaf of autograd."""
    if not isinstance(a, torch.Tensor):
        return a
    t = a.detach().clone()
    if double and _float_leaf(t):
        t = _widest(t)
    return t.requires_grad_(grads and _float_leaf(t))


def _run_members(models: Sequence[nn.Module], inp: _Inputs, *, grads: bool, training: bool | None,
                 seed: int) -> _References:
    """Phase 2: every member alone, on a deep copy (the caller's models are never modified), its
    gradients taken under a random cotangent per output leaf (seeded by ``seed``)."""
    gen = torch.Generator().manual_seed(seed)
    refs = _References()
    for i, original in enumerate(models):
        _run_member(refs, i, original, inp, grads=grads, training=training, gen=gen)
    return refs


def _run_members_float64(models: Sequence[nn.Module], inp: _Inputs, refs: _References, *, grads: bool,
                         training: bool | None) -> tuple[_References | None, str | None]:
    """Phase 2b, Note [The float64 reference]: every member again, from its state before the
    check, in float64, under phase 2's cotangents; the random stream is left as phase 2 left it.
    ``(references, None)``, or ``(None, why)`` where a member cannot run in float64."""
    cuda = sorted({t.device.index or 0 for m in models for t in m.parameters() if t.device.type == "cuda"})
    refs64 = _Float64Run(nudged=_nudger(models, inp, refs, grads=grads, training=training))
    for i, original in enumerate(models):
        try:
            with torch.random.fork_rng(devices=cuda):
                _run_member(refs64, i, original, inp, grads=grads, training=training,
                            cotangents=refs.cotangents[i], double=True)
        except Exception as e:  # noqa: BLE001 -- whatever stops the float64 run, the check goes on without it
            first = (str(e).strip().splitlines() or [""])[0][:200]
            return None, f"member {i} cannot run in float64 ({type(e).__name__}: {first})"
    why = _reference_mismatch(refs, refs64)
    return (None, why) if why else (refs64, None)


def _own_rounding(models: Sequence[nn.Module], inp: _Inputs, refs: _References, *, grads: bool,
                  training: bool | None) -> _Float64Run:
    """Note [Rounding in a float64 model]: the members' own results as the reference, with their
    nudged runs (in the members' own dtype) on demand."""
    own = _Float64Run(nudged=_nudger(models, inp, refs, grads=grads, training=training))
    for f in dataclasses.fields(_References):
        setattr(own, f.name, getattr(refs, f.name))
    return own


def _nudger(models: Sequence[nn.Module], inp: _Inputs, refs: _References, *, grads: bool,
            training: bool | None) -> Callable[[int, int], _References | None]:
    """``nudged(i, k)``: member ``i``'s ``k``-th nudged run (_Rerounded), cached."""
    cuda = sorted({t.device.index or 0 for m in models for t in m.parameters() if t.device.type == "cuda"})
    nudged_runs: dict[tuple[int, int], _References] = {}

    def nudged(i: int, k: int) -> _References | None:
        if (i, k) not in nudged_runs:
            run: _References | None = _References()
            try:
                with torch.random.fork_rng(devices=cuda):
                    _run_member(run, i, models[i], inp, grads=grads, training=training,
                                cotangents=refs.cotangents[i], nudge=torch.Generator().manual_seed(k))
            except Exception as e:  # noqa: BLE001 -- no nudged run: the failure stands as it is
                log.warning("wide_compiler.testing: member %d cannot run nudged (%s: %s); its "
                            "differences are judged without nudged runs", i, type(e).__name__, e)
                run = None
            nudged_runs[i, k] = run
        return nudged_runs[i, k]

    return nudged


def _run_member(refs: _References, i: int, original: nn.Module, inp: _Inputs, *, grads: bool,
                training: bool | None, gen: torch.Generator | None = None,
                cotangents: Sequence[torch.Tensor | None] | None = None, double: bool = False,
                nudge: torch.Generator | None = None) -> None:
    """Member ``i`` alone on a deep copy, its results appended to ``refs``, under cotangents drawn
    from ``gen`` or given (phase 2's, cast to the outputs' dtypes). ``double``: the float64 run --
    the copy cast with ``.double()``, its floating inputs cast to float64 (complex to complex128).
    ``nudge``: a nudged run, every op's result re-rounded at random from ``nudge`` (:class:`_Rerounded`)."""
    try:
        m = copy.deepcopy(original)
    except Exception as e:
        raise TypeError(f"check_equivalence runs every member on a deep copy (your models are never "
                        f"modified), but copy.deepcopy(member {i}) failed: {type(e).__name__}: {e}") from e
    if double:
        m = m.double()
    if training is not None:
        m.train(training)
    leaves = [_member_leaf(a, grads=grads, double=double) for a in inp.member_leaves[i]]
    args, kw = tree_unflatten(leaves, inp.spec)
    rerounded = _Rerounded(nudge) if nudge is not None else contextlib.nullcontext()
    if nudge is not None:  # the leaves too: a GEMM's operands, and so its inner sums, move as well
        with torch.no_grad():
            for t in [*m.parameters(), *m.buffers()]:
                t.copy_(rerounded._nudge(t))
        leaves = [rerounded._nudge(a.detach()).requires_grad_(a.requires_grad)
                  if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in leaves]
        args, kw = tree_unflatten(leaves, inp.spec)
    with rerounded, torch.set_grad_enabled(grads):
        out = m(*args, **kw)
    out_leaves = tree_flatten(out)[0]
    if cotangents is None:
        cot = [torch.randn(t.shape, generator=gen, device=gen.device, dtype=torch.float64).to(t.dtype).to(t.device)
               if _float_leaf(t) and t.requires_grad else None for t in out_leaves]
    elif len(cotangents) != len(out_leaves):
        raise ValueError(f"{len(out_leaves)} output leaves in this run, {len(cotangents)} in the first")
    else:
        cot = [None if c is None else c.to(t.dtype) for c, t in zip(cotangents, out_leaves)]
    in_grads: list = [None] * len(leaves)
    pgrads: dict[str, torch.Tensor | None] = {}
    if grads:
        params = [(name, p) for name, p in m.named_parameters() if p.requires_grad]
        targets = [(k, a) for k, a in enumerate(leaves) if isinstance(a, torch.Tensor) and a.requires_grad]
        outs_g = [(t, g) for t, g in zip(out_leaves, cot) if g is not None]
        wrt = [a for _, a in targets] + [p for _, p in params]
        if outs_g and wrt:
            with rerounded:
                got = torch.autograd.grad([t for t, _ in outs_g], wrt, [g for _, g in outs_g],
                                          allow_unused=True)
            for (k, _), g in zip(targets, got[:len(targets)]):
                in_grads[k] = g
            pgrads = {name: g for (name, _), g in zip(params, got[len(targets):])}
    refs.cotangents.append(cot)
    refs.outputs.append(tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out))
    refs.input_grads.append(in_grads)
    refs.param_grads.append(pgrads)
    refs.buffers.append({name: b.detach() for name, b in m.named_buffers()})



def _reference_mismatch(refs: _References, refs64: _References) -> str | None:
    """Why the float64 run cannot serve as the reference (it returned another structure, shape or
    kind of value than the float32 run), or None."""
    def differs(a: Any, b: Any) -> bool:
        if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
            return True
        return isinstance(a, torch.Tensor) and (a.shape != b.shape or _float_leaf(a) != _float_leaf(b))

    for i, (a, b) in enumerate(zip(refs.outputs, refs64.outputs)):
        (la, sa), (lb, sb) = tree_flatten(a), tree_flatten(b)
        if sa != sb or any(differs(x, y) for x, y in zip(la, lb)):
            return f"member {i}'s float64 output is not like its float32 output"
    for i, (a, b) in enumerate(zip(refs.input_grads, refs64.input_grads)):
        if any((x is None) != (y is None) or (x is not None and differs(x, y)) for x, y in zip(a, b)):
            return f"member {i}'s float64 input gradients are not like its float32 ones"
    for i, (a, b) in enumerate(zip(refs.param_grads, refs64.param_grads)):
        if a.keys() != b.keys() or any((a[k] is None) != (b[k] is None)
                                       or (a[k] is not None and differs(a[k], b[k])) for k in a):
            return f"member {i}'s float64 parameter gradients are not like its float32 ones"
    for i, (a, b) in enumerate(zip(refs.buffers, refs64.buffers)):
        if a.keys() != b.keys() or any(differs(a[k], b[k]) for k in a):
            return f"member {i}'s float64 buffers are not like its float32 ones"
    return None
