"""The equivalence harness below the compiler API: comparisons, tolerances, sample inputs and
:func:`check_equivalence`. Everything here is public through :mod:`wide_compiler.testing` (import
it from there; its docstring justifies the tolerances), which adds :func:`check_compile` on top.

Note [The harness in two layers]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``compile(..., validate=True)`` (api.py) compares the wide model with its members through
:func:`check_equivalence`, and :func:`wide_compiler.testing.check_compile` compiles through
``api.compile``: one module holding both imported api while api imported it. The comparisons
therefore live here, below api, and wide_compiler/testing.py, above api, re-exports them next to
``check_compile``: imports go one way (.importlinter checks that the package has no import cycle).
This module imports nothing of wide_compiler, so any layer may compare members with it (the
measuring code below model.py included).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import (
    keystr,
    tree_flatten,
    tree_flatten_with_path,
    tree_map,
    tree_unflatten,
)

__all__ = [
    "NOISE_FACTOR",
    "NOISE_FLOOR_EPS",
    "NUDGE_EPS",
    "RESAMPLES",
    "TOLERANCES",
    "EquivalenceReport",
    "assert_close",
    "assert_members_close",
    "assert_trees_members_close",
    "check_equivalence",
    "max_member_error",
    "make_members",
    "member_inputs",
    "random_ops",
    "shared_input",
    "stack_inputs",
    "tolerance",
]

log = logging.getLogger("wide_compiler.testing")  # the public harness's logger, as before the split

KINDS = ("output", "grad", "buffer")


def _by_kind(output: float, grad_rtol: float, grad_atol: float) -> dict[str, dict[str, float]]:
    """One dtype's row of TOLERANCES: outputs and buffers within rtol = atol = ``output``,
    gradients within their own rtol/atol."""
    return {"output": {"rtol": output, "atol": output},
            "grad": {"rtol": grad_rtol, "atol": grad_atol},
            "buffer": {"rtol": output, "atol": output}}


# dtype -> kind -> rtol/atol. The justification is wide_compiler.testing's docstring ("Tolerances").
TOLERANCES: dict[torch.dtype, dict[str, dict[str, float]]] = {
    torch.float32: _by_kind(1e-5, grad_rtol=1e-5, grad_atol=1e-4),
    torch.float64: _by_kind(1e-10, grad_rtol=1e-10, grad_atol=1e-10),
    torch.bfloat16: _by_kind(1.6e-2, grad_rtol=3.2e-2, grad_atol=3.2e-2),
    torch.float16: _by_kind(2e-3, grad_rtol=4e-3, grad_atol=4e-3),
}

# Note [The float64 reference]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A float32 model is not held to fixed tolerances by default. A fixed bound is too tight for a
# deep model whose own float32 rounding is amplified -- a stock ResNet-18 in train mode on 32x32
# images in batches of 2 normalises its last stage's 1x1 planes over two values, and a member's own
# float32 logits sit 3e-3 from the exact ones (its gradients far more) -- and too loose for a
# small-scale tensor (atol=1e-4 hides anything in a gradient of size 1e-6). So, when the
# compute dtype is float32 and no rtol/atol is given, every member runs a second time in float64:
# a deep copy of the member as it was before the check (same weights, same buffers) cast with
# .double(), on the same inputs and under the same cotangents cast to float64. Its rounding is 2^-29
# of float32's, so it stands for the exact result. Then, per compared tensor (each output leaf, each
# input gradient, each parameter gradient, each buffer after the call) and per member i:
#
#   wide_i = max |wide[i] - ref64_i|               the wide model's error
#   own    = max over members j of max |member_j - ref64_j|   the members' own float32 error
#   floor  = NOISE_FLOOR_EPS * eps32 * max |ref64_i|
#   pass iff wide_i <= NOISE_FACTOR * max(own, floor)
#
# The wide op and the member's op round the same exact computation, in another order (a batched
# GEMM, a grouped convolution): the wide error is another draw of the member's, not the same value.
# NOISE_FACTOR = 4: the largest of a tensor's rounding errors in two such draws are within 2x of
# each other nearly always, and 4 leaves room for a summation order that is legitimately somewhat
# less accurate than ATen's (a blocked sum where ATen sums pairwise); a defect -- a member reading
# another's weights, a wrong dim, a 1e-3 relative perturbation -- lands orders of magnitude above.
# ``own`` is the largest over the members: they share the architecture and so the conditioning, and
# a tensor of a few elements can come out exact in one member by chance. The floor: a tensor the
# members compute exactly (a copy, a max-pool, a mask) has own error 0, while the wide program may
# still round once or twice more per op; 8 float32 eps (1e-6) of the tensor's largest value allows
# that and nothing of a real defect's size.
#
# What the largest error alone does not allow for is a flip: a value whose exact result sits
# closer to a kink (ReLU at 0, a max-pool between near-equal values, BatchNorm over two values)
# than float32's rounding. Its float32 side is a coin toss, and where the wide program lands on the
# other side than the member and the float64 run, every gradient upstream of it moves by a whole
# term. The wide program rounds differently, by design (in eval mode it folds BatchNorm into the
# conv weights), so it can flip where the member does not: in a ResNet-18 in eval mode about once in
# ten checks, moving an input gradient by 4.5e-5 where the member's own error is 1.2e-8 (the value
# was -7.8e-7). A flip is rounding; a defect is not, and they differ in what another rounding of
# the member does: so where a tensor of member i is outside the bound, member i runs again in
# float32, up to RESAMPLES (6) times, with its weights, buffers and inputs and the result of every
# op, forward and backward, moved by up to NUDGE_EPS (16) float32 eps at random (_Rerounded: another
# float32 program, rounding differently at each op and inside each sum, as the wide one does), and
# each such run's error against the float64 run
# joins the members' own error. A flip shows up in a good share of these runs; a defect in none,
# since rounding-sized changes do not make a member read another's weights. The runs cost nothing
# when the check passes the first time; they widen the bound of a failing tensor to about 16 times
# the rounding, still far below a defect's error.
#
# Integer and bool results are compared with the float32 member, exactly; so are the positions of
# NaN and inf (finite positions only enter the errors). float64 models keep the direct comparison
# (their reference would be themselves), as do bfloat16/float16 models and any call with rtol/atol
# (the fixed table). A member that cannot run in float64 (an op with no float64 kernel, a forward
# that builds float32 tensors of its own, MPS) falls back to the fixed table, with a warning in the
# log and the reason in the report.
NOISE_FACTOR = 4.0
NOISE_FLOOR_EPS = 8.0
RESAMPLES = 6
NUDGE_EPS = 16.0

_EXACT = {"rtol": 0.0, "atol": 0.0}
_REAL_OF_COMPLEX = {torch.complex64: torch.float32, torch.complex128: torch.float64,
                    torch.complex32: torch.float16}


def tolerance(dtype: torch.dtype, kind: str = "output") -> dict[str, float]:
    """``dict(rtol=, atol=)`` for comparing a wide result with its members in ``dtype``.

    ``kind``: ``"output"`` (forward outputs), ``"grad"`` (input and parameter gradients) or
    ``"buffer"`` (buffers after a call: running statistics). Integer and bool dtypes are exact;
    complex dtypes use their real dtype's tolerance; other floating dtypes (float8) use
    bfloat16's.

    >>> import torch
    >>> from wide_compiler.testing import tolerance
    >>> tolerance(torch.float32)
    {'rtol': 1e-05, 'atol': 1e-05}
    >>> tolerance(torch.float32, "grad")
    {'rtol': 1e-05, 'atol': 0.0001}
    >>> tolerance(torch.int64)
    {'rtol': 0.0, 'atol': 0.0}
    """
    if kind not in KINDS:
        raise ValueError(f"wide_compiler.testing.tolerance: kind must be one of {KINDS}, got {kind!r}")
    dtype = _REAL_OF_COMPLEX.get(dtype, dtype)
    if not dtype.is_floating_point:
        return dict(_EXACT)
    return dict(TOLERANCES.get(dtype, TOLERANCES[torch.bfloat16])[kind])


def _tol_for(t: torch.Tensor, dtype: torch.dtype | None, kind: str) -> dict[str, float]:
    """The looser of the tolerances of the compute dtype ``dtype`` and of ``t``'s own dtype (a
    float32 model may return a float64 sum of float32 values: float32 rounding applies)."""
    own = tolerance(t.dtype, kind)
    if dtype is None or not (t.is_floating_point() or t.is_complex()):
        return own
    other = tolerance(dtype, kind)
    return {k: max(own[k], other[k]) for k in own}


def _abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference (float64); positions where both are NaN count as equal."""
    if a.numel() == 0:
        return 0.0
    a, b = a.detach(), b.detach()
    if a.is_complex() or b.is_complex():
        d = (a.to(torch.complex128) - b.to(torch.complex128)).abs()
    else:
        a, b = a.double(), b.double()
        d = (a - b).abs()
        both_nan = a.isnan() & b.isnan()
        same_inf = (a == b) & a.isinf()
        d = d.masked_fill(both_nan | same_inf, 0.0)
    return d.max().item()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, *,
                 kind: str = "output", msg: str = "", rtol: float | None = None,
                 atol: float | None = None, equal_nan: bool = False) -> None:
    """``torch.testing.assert_close`` with this module's tolerances (dtype and shape must match).

    >>> import torch
    >>> from wide_compiler.testing import assert_close
    >>> assert_close(torch.ones(3), torch.ones(3) + 1e-7)
    """
    tol = _tol_for(expected, dtype, kind)
    if rtol is not None:
        tol["rtol"] = rtol
    if atol is not None:
        tol["atol"] = atol
    torch.testing.assert_close(actual, expected, **tol, equal_nan=equal_nan,
                               msg=(lambda m: f"{msg}\n{m}") if msg else None)


def assert_members_close(wide_out: torch.Tensor, member_outs: Sequence[torch.Tensor],
                         dtype: torch.dtype | None = None, *, kind: str = "output",
                         what: str = "output", rtol: float | None = None, atol: float | None = None,
                         equal_nan: bool = False) -> None:
    """Assert ``wide_out[i]`` equals ``member_outs[i]`` for every member ``i``.

    ``wide_out`` is N-first (``[N, ...]``), ``member_outs`` N tensors of shape ``[...]``. Shapes
    and dtypes must match exactly; floating values up to :func:`tolerance` of ``kind`` (the looser
    of ``dtype``'s and the tensor's own), integer and bool values exactly. ``rtol``/``atol``
    override the table. A failure names the first member that differs and by how much.

    >>> import torch
    >>> from wide_compiler.testing import assert_members_close
    >>> refs = [torch.zeros(2), torch.ones(2)]
    >>> assert_members_close(torch.stack(refs), refs)
    >>> assert_members_close(torch.stack(refs[::-1]), refs)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    AssertionError: output: member 0 differs from its own model (member 0 of 2; max abs error 1, rtol=1e-05, atol=1e-05)
    ...
    """
    n = len(member_outs)
    _check_member_layout(wide_out, member_outs, what)
    for i, ref in enumerate(member_outs):
        got = wide_out[i]
        tol = _tol_for(ref, dtype, kind)
        if rtol is not None:
            tol["rtol"] = rtol
        if atol is not None:
            tol["atol"] = atol

        def message(m: str, i: int = i, got: torch.Tensor = got, ref: torch.Tensor = ref,
                    tol: dict = tol) -> str:
            return (f"{what}: member {i} differs from its own model (member {i} of {n}; max abs "
                    f"error {_abs_err(got, ref):.3g}, rtol={tol['rtol']:g}, atol={tol['atol']:g})\n{m}")

        torch.testing.assert_close(got.detach(), ref.detach(), **tol, equal_nan=equal_nan,
                                   msg=message)


def _check_member_layout(wide_out: Any, member_outs: Sequence[Any], what: str) -> None:
    """``wide_out`` is an N-first tensor whose row ``i`` has member ``i``'s shape, dtype and device."""
    n = len(member_outs)
    if not isinstance(wide_out, torch.Tensor):
        raise AssertionError(f"{what}: expected a Tensor, got {type(wide_out).__name__}")  # noqa: TRY004
    if wide_out.dim() < 1 or wide_out.shape[0] != n:
        raise AssertionError(f"{what}: expected an N-first tensor with N={n} members, got shape "
                             f"{tuple(wide_out.shape)}")
    for i, ref in enumerate(member_outs):
        if not isinstance(ref, torch.Tensor):
            raise AssertionError(f"{what}: member {i}'s reference is a {type(ref).__name__}, not a Tensor")  # noqa: TRY004
        got = wide_out[i]
        if got.shape != ref.shape:
            raise AssertionError(f"{what}: member {i}: shape {tuple(got.shape)} != expected "
                                 f"{tuple(ref.shape)}")
        if got.dtype != ref.dtype:
            raise AssertionError(f"{what}: member {i}: dtype {got.dtype} != expected {ref.dtype}")
        if got.device != ref.device:
            raise AssertionError(f"{what}: member {i}: device {got.device} != expected {ref.device}")


def assert_trees_members_close(wide_out: Any, member_outs: Sequence[Any],
                               dtype: torch.dtype | None = None, *, kind: str = "output",
                               what: str = "output", rtol: float | None = None,
                               atol: float | None = None, equal_nan: bool = False) -> None:
    """:func:`assert_members_close` over pytrees (tuple/list/dict outputs, nested).

    Every member's output must have the wide output's structure; tensor leaves are compared member
    by member (integer/bool ones exactly), other leaves (Python numbers) must be equal. A failure
    names the leaf (``output[1]['h']``) and the member.

    >>> import torch
    >>> from wide_compiler.testing import assert_trees_members_close
    >>> refs = [{"y": torch.zeros(2), "i": torch.tensor(0)}, {"y": torch.ones(2), "i": torch.tensor(1)}]
    >>> assert_trees_members_close({"y": torch.stack([r["y"] for r in refs]), "i": torch.tensor([0, 1])}, refs)
    """
    def tensors(label: str, leaf: Any, refs: list[torch.Tensor], k: int) -> None:
        assert_members_close(leaf, refs, dtype, kind=kind, what=label, rtol=rtol, atol=atol,
                             equal_nan=equal_nan)

    _walk_members(wide_out, member_outs, what, tensors)


def _walk_members(wide_out: Any, member_outs: Sequence[Any], what: str,
                  tensors: Callable[[str, Any, list[torch.Tensor], int], None]) -> None:
    """The leaves of the wide output beside the members': the structures must agree; a leaf that
    is a tensor in every member goes to ``tensors(label, wide_leaf, member_leaves, k)`` (``k``:
    its flat position), any other must equal the members' values."""
    wide_paths, wide_spec = _leaves_with_labels(wide_out)
    flats = [tree_flatten(o) for o in member_outs]
    for i, (_, spec) in enumerate(flats):
        if spec != wide_spec:
            raise AssertionError(f"{what}: member {i}: output structure {spec} != wide {wide_spec}")
    for k, (path, leaf) in enumerate(wide_paths):
        label = f"{what}{path}"
        refs = [leaves[k] for leaves, _ in flats]
        if all(isinstance(r, torch.Tensor) for r in refs):
            tensors(label, leaf, refs, k)
        else:
            for i, r in enumerate(refs):
                got = leaf[i] if isinstance(leaf, torch.Tensor) and not isinstance(r, torch.Tensor) else leaf
                if isinstance(got, torch.Tensor):
                    got = got.item() if got.numel() == 1 else got.tolist()
                if got != r:
                    raise AssertionError(f"{label}: member {i} differs from its own model: {got!r} != {r!r}")


def _leaves_with_labels(tree: Any) -> tuple[list[tuple[str, Any]], Any]:
    """``[(label, leaf)]`` and the spec: key paths (``[1]['h']``) where every node type has them
    (a pytree node registered without ``flatten_with_keys_fn``, as diffusers' outputs are, has
    not: then the leaf's flat position, ``<leaf 3>``)."""
    try:
        paths, spec = tree_flatten_with_path(tree)
        return [(keystr(p), leaf) for p, leaf in paths], spec
    except ValueError:
        leaves, spec = tree_flatten(tree)
        return [(f"<leaf {k}>", leaf) for k, leaf in enumerate(leaves)], spec


def max_member_error(wide_out: Any, member_outs: Sequence[Any]) -> float:
    """The largest absolute difference between ``wide_out[i]`` and ``member_outs[i]`` over all
    members and all tensor leaves (pytrees allowed), in float64; 0.0 when nothing is compared,
    NaN where only one side is NaN.

    >>> import torch
    >>> from wide_compiler.testing import max_member_error
    >>> max_member_error(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.5])])
    0.5
    """
    errs = _member_errors(wide_out, member_outs)
    return math.nan if any(math.isnan(e) for e in errs) else max(errs, default=0.0)


def _member_errors(wide_out: Any, member_outs: Sequence[Any]) -> list[float]:
    """Per member: the max abs error over the tensor leaves (see :func:`max_member_error`)."""
    wide_leaves, _ = tree_flatten(wide_out)
    flats = [tree_flatten(o)[0] for o in member_outs]
    errs = [0.0] * len(flats)
    for k, leaf in enumerate(wide_leaves):
        if not isinstance(leaf, torch.Tensor):
            continue
        for i, leaves in enumerate(flats):
            ref = leaves[k]
            if isinstance(ref, torch.Tensor):
                e = _abs_err(leaf[i], ref)
                errs[i] = e if math.isnan(e) else max(errs[i], e)
    return errs


# --- against a float64 run (Note [The float64 reference]) ---------------------------------------


def _eps(dtype: torch.dtype) -> float:
    """The rounding unit of a float32 computation whose result has ``dtype``: float32's eps, or the
    result's own where coarser (a bfloat16 result under autocast)."""
    dtype = _REAL_OF_COMPLEX.get(dtype, dtype)
    own = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    return max(own, torch.finfo(torch.float32).eps)


def _widest(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.to(torch.complex128) if t.is_complex() else t.to(torch.float64)


def _errors_against(got: torch.Tensor, mem: torch.Tensor, ref: torch.Tensor, *, what: str,
                    equal_nan: bool) -> tuple[float, float, float]:
    """``(wide error, member's own error, scale)`` of one tensor against its float64 run: the max
    abs differences of ``got`` (the wide model's) and ``mem`` (the float32 member's) from ``ref``,
    and max abs ``ref``, over the positions where all three are finite. ``got`` must have NaN and
    inf exactly where ``mem`` has them (NaN at all only with ``equal_nan``)."""
    g, m, r = _widest(got), _widest(mem), _widest(ref)
    if g.numel() == 0:
        return 0.0, 0.0, 0.0
    errs = ((g - r).abs_().max().item(), (m - r).abs_().max().item(), r.abs().max().item())
    if all(math.isfinite(e) for e in errs):  # all finite (NaN or inf anywhere reaches a max)
        return errs
    g_bad, m_bad = ~torch.isfinite(g), ~torch.isfinite(m)
    if not equal_nan and (g.isnan().any() or m.isnan().any()):
        raise AssertionError(f"{what}: NaN in the {'wide model' if g.isnan().any() else 'member'}'s "
                             "result (pass equal_nan=True to accept NaN in the same places)")
    if g_bad.any() or m_bad.any():
        gn, mn = g[g_bad], m[m_bad]
        if not (torch.equal(g_bad, m_bad) and torch.equal(gn.isnan(), mn.isnan())
                and torch.equal(gn[~gn.isnan()], mn[~mn.isnan()])):
            raise AssertionError(f"{what}: NaN/inf in {int(g_bad.sum())} places where its own model "
                                 f"has them in {int(m_bad.sum())} (not the same places or values)")
    finite = ~g_bad & torch.isfinite(r)
    if not finite.any():
        return 0.0, 0.0, 0.0
    return ((g - r).abs()[finite].max().item(), (m - r).abs()[finite].max().item(),
            r.abs()[finite].max().item())


def _assert_near_reference(wide_out: torch.Tensor, member_outs: Sequence[torch.Tensor],
                           ref_outs: Sequence[torch.Tensor], *, what: str, equal_nan: bool,
                           summed: bool = False,
                           resample: Callable[[int, int], torch.Tensor | None] | None = None,
                           ) -> tuple[list[float], list[float]]:
    """Note [The float64 reference] for one floating tensor: ``wide_out[i]``'s error against
    ``ref_outs[i]`` (member ``i`` in float64) within NOISE_FACTOR times the members' own float32
    error (``member_outs[i]`` against ``ref_outs[i]``), or the floor. Where it is not,
    ``resample(i, k)`` (member ``i``'s tensor in its ``k``-th nudged float32 run, _Rerounded) adds
    own errors, up to RESAMPLES of them, until one covers the wide error. Returns the
    wide errors and the members' own errors, per member. ``summed``: one tensor, the sum over
    members of a shared input's gradient (``wide_out`` is then ``[1, ...]``)."""
    _check_member_layout(wide_out, member_outs, what)
    n = len(member_outs)
    rows = [_errors_against(wide_out[i], mem, ref, what=what if summed else f"{what}: member {i}",
                            equal_nan=equal_nan)
            for i, (mem, ref) in enumerate(zip(member_outs, ref_outs))]
    own = max((o for _, o, _ in rows), default=0.0)
    owns = [o for _, o, _ in rows]
    eps = _eps(wide_out.dtype)
    for i, (w, o, scale) in enumerate(rows):
        floor = NOISE_FLOOR_EPS * eps * scale
        bound = NOISE_FACTOR * max(own, floor)
        for k in range(RESAMPLES if resample is not None else 0):
            if w <= bound:
                break
            nudged = resample(i, k)
            if nudged is None:  # the member cannot run nudged (logged)
                break
            _, o_k, _ = _errors_against(nudged, nudged, ref_outs[i], what=what, equal_nan=True)
            owns[i] = o = max(o, o_k)
            bound = NOISE_FACTOR * max(own, o, floor)
        if w <= bound:
            continue
        who = ("the wide gradient differs from the sum of the members' gradients" if summed else
               f"member {i} differs from its own model (member {i} of {n})")
        runs = f" and {RESAMPLES} nudged runs" if resample is not None else ""
        raise AssertionError(
            f"{what}: {who}: against a float64 run of the member{'s' if summed else ''}, the wide "
            f"model's max abs error is {w:.3g}, the members' own float32 error {max(own, o):.3g} "
            f"(largest over the {n} members{runs}); allowed {NOISE_FACTOR:g} x max(own error, floor "
            f"{floor:.3g} = {NOISE_FLOOR_EPS:g} float32 eps x max |value| {scale:.3g}) = {bound:.3g}; "
            f"max abs difference from the float32 member{'s' if summed else ''}: "
            f"{_abs_err(wide_out[i], member_outs[i]):.3g}. An error this far above the model's own "
            "float32 rounding is not rounding (Note [The float64 reference] in "
            "wide_compiler/_equivalence.py)")
    return [w for w, _, _ in rows], owns


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


# --- inputs -----------------------------------------------------------------------------------


def shared_input(sample: Any, n: int) -> Any:
    """One input for all ``n`` members: every tensor of ``sample`` (a tensor or a pytree of inputs)
    as ``x.expand(n, *x.shape)`` -- a stride-0 view, which the wide model recognises and never
    copies N times.

    >>> import torch
    >>> from wide_compiler.testing import shared_input
    >>> x = shared_input(torch.randn(5, 3), 4)
    >>> x.shape, x.stride()
    (torch.Size([4, 5, 3]), (0, 3, 1))
    """
    return tree_map(lambda t: t.expand(n, *t.shape) if isinstance(t, torch.Tensor) else t, sample)


def stack_inputs(per_member: Sequence[Any]) -> Any:
    """N per-member inputs (tensors or equal pytrees of them) -> the N-first wide input: every
    tensor leaf stacked on a new dim 0; non-tensor leaves (Python values, baked into the graph)
    must be the same for every member.

    >>> import torch
    >>> from wide_compiler.testing import stack_inputs
    >>> a, m = stack_inputs([(torch.zeros(2, 3), "mean"), (torch.ones(2, 3), "mean")])
    >>> a.shape, m
    (torch.Size([2, 2, 3]), 'mean')
    """
    flats = [tree_flatten(p) for p in per_member]
    if not flats:
        raise ValueError("wide_compiler.testing.stack_inputs: expected at least one member input")
    spec = flats[0][1]
    leaves = []
    for i, (_, s) in enumerate(flats):
        if s != spec:
            raise ValueError(f"wide_compiler.testing.stack_inputs: member {i}'s input structure {s} "
                             f"differs from member 0's {spec}")
    for j, leaf in enumerate(flats[0][0]):
        if isinstance(leaf, torch.Tensor):
            leaves.append(torch.stack([f[0][j] for f in flats]))
        else:
            for i, f in enumerate(flats):
                if f[0][j] != leaf:
                    raise ValueError(f"wide_compiler.testing.stack_inputs: non-tensor input {j} is "
                                     f"{f[0][j]!r} for member {i} but {leaf!r} for member 0; "
                                     "Python values are baked into the graph and must agree")
            leaves.append(leaf)
    return tree_unflatten(leaves, spec)


def make_members(factory: Callable[[], nn.Module], n: int = 3, seed: int = 0) -> list[nn.Module]:
    """``n`` members from ``factory()``, each with its own weights, reproducibly (the global RNG
    is seeded with ``seed`` first, as a user's experiment would be).

    >>> import torch
    >>> from wide_compiler.testing import make_members
    >>> a, b = make_members(lambda: torch.nn.Linear(2, 2), 2)
    >>> torch.equal(a.weight, b.weight)
    False
    """
    torch.manual_seed(seed)
    return [factory() for _ in range(n)]


def member_inputs(sample: Any, n: int, *, seed: int = 0, shared: bool = False,
                  scale: float = 0.1) -> tuple[Any, list[Any]]:
    """Inputs for ``n`` members from ONE member's ``sample``: ``(wide_inputs, per_member)``.

    ``sample`` is a tensor or a tuple of positional inputs (possibly nested lists/tuples/dicts, with
    Python values). Member ``i`` gets its own copy in which every floating tensor is perturbed
    independently (``x + scale * std(x) * noise``, noise from a generator seeded with ``seed``, so
    members see different inputs and the global RNG is untouched); integer and bool tensors
    (indices, masks) stay identical, since random values may not be valid indices. ``wide_inputs``
    is the N-first stack of the per-member inputs (:func:`stack_inputs`). With ``shared=True``
    every member gets ``sample`` itself and ``wide_inputs`` is :func:`shared_input`.

    >>> import torch
    >>> from wide_compiler.testing import member_inputs
    >>> wide_x, xs = member_inputs(torch.randn(5, 3), 4)
    >>> wide_x.shape, len(xs), torch.equal(wide_x[2], xs[2]), torch.equal(xs[0], xs[1])
    (torch.Size([4, 5, 3]), 4, True, False)
    >>> (wide_idx, wide_w), per = member_inputs((torch.tensor([1, 2]), torch.ones(2)), 3)
    >>> wide_idx.tolist()                           # integer inputs are the same for every member
    [[1, 2], [1, 2], [1, 2]]
    """
    if n < 1:
        raise ValueError(f"wide_compiler.testing.member_inputs: expected n >= 1, got {n}")
    if shared:
        return shared_input(sample, n), [sample] * n
    gen = torch.Generator().manual_seed(seed)

    def perturb(t: Any) -> Any:
        if not (isinstance(t, torch.Tensor) and t.is_floating_point()):
            return t
        t = t.detach()
        std = t.float().std().item() if t.numel() > 1 else float("nan")
        if not math.isfinite(std) or std == 0.0:
            std = 1.0
        noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
        return (t.float() + scale * std * noise.to(t.device)).to(t.dtype)

    per_member = [tree_map(perturb, sample) for _ in range(n)]
    return stack_inputs(per_member), per_member


# --- the equivalence check --------------------------------------------------------------------


_REPORT_KINDS = ("output", "input_grad", "param_grad", "buffer")


class EquivalenceReport(dict):
    """What :func:`check_equivalence` compared: the max abs difference between the wide model and
    its members per kind -- ``"output"``, ``"input_grad"``, ``"param_grad"``, ``"buffer"`` (None
    where nothing of that kind was compared) -- and ``"members"``.

    Attributes (not keys): ``wide_output``, the wide model's output; ``per_member``, each member's
    largest difference over its outputs, gradients and buffers (a shared input's gradient, a sum
    over members, is not in it); ``reference``, ``"float64"`` where the floating results were judged
    against a float64 run of the members (Note [The float64 reference]: a float32 model without
    rtol/atol) or ``"fixed"`` where against the members with fixed tolerances; ``fallback``, why a
    float32 model was compared with fixed tolerances after all (its members cannot run in float64),
    else None; with ``reference == "float64"``, ``wide_error`` and ``own_error``, per kind, the
    largest error against the float64 run of the wide model and of the members themselves."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.wide_output: Any = None
        self.per_member: list[float] = [0.0] * int(self.get("members") or 0)
        self.reference: str = "fixed"
        self.fallback: str | None = None
        self.wide_error: dict[str, float | None] = dict.fromkeys(_REPORT_KINDS)
        self.own_error: dict[str, float | None] = dict.fromkeys(_REPORT_KINDS)

    def _note(self, kind: str, errs: Sequence[float]) -> None:
        e = max(errs, default=0.0)
        self[kind] = e if self.get(kind) is None else max(self[kind], e)
        self.per_member = [max(a, b) for a, b in zip(self.per_member, errs)]

    def _note_reference(self, kind: str, wide_errs: Sequence[float], own_errs: Sequence[float]) -> None:
        for table, errs in ((self.wide_error, wide_errs), (self.own_error, own_errs)):
            e = max(errs, default=0.0)
            table[kind] = e if table[kind] is None else max(table[kind], e)

    def max_error(self) -> float:
        """The largest difference from the members over every kind compared."""
        errs = [v for k, v in self.items() if k in _REPORT_KINDS and v is not None]
        return max(errs, default=0.0)

    def __str__(self) -> str:
        members = self.get("members", "?")
        if self.reference == "float64":
            parts = [f"{k.replace('_', ' ')} {self.wide_error[k]:.1e} / {self.own_error[k]:.1e}"
                     for k in _REPORT_KINDS if self.wide_error[k] is not None]
            return (f"{members} members, max abs err against a float64 run (wide / members' own "
                    "float32): " + ", ".join(parts))
        parts = [f"{k.replace('_', ' ')} {v:.1e}" for k, v in self.items()
                 if k != "members" and v is not None]
        text = f"{members} members, max abs err: " + ", ".join(parts)
        return text if self.fallback is None else f"{text} (fixed tolerances: {self.fallback})"


def _as_args(x: Any) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def _strip(name: str) -> str:
    return name.removeprefix("_orig_mod.")  # a torch.compile'd wide model


def _default_wide_tensors(wide: Any, params: bool) -> dict[str, torch.Tensor]:
    if not isinstance(wide, nn.Module):
        raise TypeError(f"wide_compiler.testing.check_equivalence: the wide callable is a "
                        f"{type(wide).__name__}, not an nn.Module; pass wide_params= (and "
                        "wide_buffers=) mappings from member parameter names to stacked tensors")
    items = wide.named_parameters() if params else wide.named_buffers()
    return {_strip(name): t for name, t in items}


def _float_leaf(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


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


@dataclasses.dataclass
class _Inputs:
    """One check's inputs: each member's flattened ``(args, kwargs)`` leaves and their structure,
    the wide call's ``args``/``kwargs``, and per leaf the wide tensor whose gradient is the wide
    input gradient (None where none is taken)."""

    member_leaves: list[list[Any]]
    spec: Any
    wide_args: tuple
    wide_kwargs: dict[str, Any]
    bases: list[torch.Tensor | None]


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


@dataclasses.dataclass(frozen=True)
class _Tolerance:
    """How one check compares: the compute dtype for :func:`tolerance`, the caller's overrides."""

    dtype: torch.dtype | None
    rtol: float | None
    atol: float | None
    equal_nan: bool

    def members(self, wide: torch.Tensor, refs: Sequence[torch.Tensor], *, kind: str, what: str,
                report: EquivalenceReport | None = None, report_kind: str = "",
                refs64: Sequence[torch.Tensor] | None = None,
                resample: Callable[[int, int], torch.Tensor | None] | None = None) -> None:
        """``wide[i]`` vs ``refs[i]`` for every member: against ``refs64`` (the float64 run, noted
        in ``report`` under ``report_kind``; ``resample`` as for _assert_near_reference) for a
        floating tensor when given, else by the table."""
        if refs64 is not None and _float_leaf(wide):
            errs = _assert_near_reference(wide, refs, refs64, what=what, equal_nan=self.equal_nan,
                                          resample=resample)
            if report is not None:
                report._note_reference(report_kind, *errs)
            return
        assert_members_close(wide, refs, self.dtype, kind=kind, what=what, rtol=self.rtol,
                             atol=self.atol, equal_nan=self.equal_nan)


def _prepare_inputs(n: int, inputs: Any, kwargs: Any, *, shared: bool, grads: bool) -> _Inputs:
    """Phase 1 (Note [check_equivalence in phases]): check the per-member inputs and make the
    wide inputs from them."""
    given_wide = None
    if shared:
        per_member = [(_as_args(inputs), dict(kwargs or {}))] * n
    else:
        if isinstance(inputs, torch.Tensor):
            if inputs.dim() < 1 or inputs.shape[0] != n:
                raise ValueError(f"check_equivalence: an N-first input tensor with N={n} expected, got "
                                 f"shape {tuple(inputs.shape)}")
            given_wide = inputs
            inputs = list(inputs.unbind(0))
        inputs = list(inputs)
        if len(inputs) != n:
            raise ValueError(f"check_equivalence: {n} models but {len(inputs)} per-member inputs")
        kws = [{}] * n if kwargs is None else list(kwargs)
        if len(kws) != n or not all(isinstance(k, Mapping) for k in kws):
            raise ValueError("check_equivalence: kwargs must be a list of N dicts (one dict with shared=True)")
        per_member = [(_as_args(a), dict(k)) for a, k in zip(inputs, kws)]
    flats = [tree_flatten(p) for p in per_member]
    spec = flats[0][1]
    for i, (_, s) in enumerate(flats):
        if s != spec:
            raise ValueError(f"check_equivalence: member {i}'s input structure {s} differs from member 0's {spec}")

    wide_leaves, bases = [], []  # bases: the tensors whose gradient is the wide input gradient
    for j, leaf in enumerate(flats[0][0]):
        if not isinstance(leaf, torch.Tensor):
            for i, f in enumerate(flats):
                if f[0][j] != leaf:
                    raise ValueError(f"check_equivalence: non-tensor input {j} is {f[0][j]!r} for member "
                                     f"{i} but {leaf!r} for member 0 (Python values are baked in)")
            wide_leaves.append(leaf)
            bases.append(None)
            continue
        if shared:
            base = leaf.detach().clone()
        elif given_wide is not None:
            base = given_wide.detach()  # the caller's layout (non-contiguous, permuted ...) kept
        else:
            base = torch.stack([f[0][j].detach() for f in flats])
        base.requires_grad_(grads and _float_leaf(base))
        wide_leaves.append(base.expand(n, *base.shape) if shared else base)
        bases.append(base if base.requires_grad else None)
    wide_args, wide_kwargs = tree_unflatten(wide_leaves, spec)
    return _Inputs([leaves for leaves, _ in flats], spec, wide_args, wide_kwargs, bases)


class _Rerounded(TorchDispatchMode):
    """A nudged run (Note [The float64 reference]): every floating result of every functional op,
    forward and backward, moved by ``NUDGE_EPS * eps * u`` relative, ``u`` uniform in [-1, 1]
    from ``gen`` -- another float32 program, rounding differently at each op (_run_member nudges
    the weights, buffers and inputs alike). Views and in-place ops are left alone (their results
    alias other tensors), as are factories (no floating input)."""

    def __init__(self, gen: torch.Generator) -> None:
        super().__init__()
        self.gen = gen

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.is_view or func._schema.is_mutable or not any(
                isinstance(a, torch.Tensor) and a.is_floating_point() for a in tree_flatten((args, kwargs))[0]):
            return out
        return tree_map(self._nudge, out)

    def _nudge(self, t: Any) -> Any:
        if not (isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()):
            return t
        u = torch.rand(t.shape, generator=self.gen, dtype=torch.float32).to(device=t.device, dtype=t.dtype)
        return t + t * (u * 2 - 1) * (NUDGE_EPS * torch.finfo(t.dtype).eps)


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

    refs64 = _Float64Run(nudged=nudged)
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
        cot = [torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.dtype).to(t.device)
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


def _wide_tensors(wide: Any, member: nn.Module, wide_params: Mapping[str, torch.Tensor | None] | None,
                  wide_buffers: Mapping[str, torch.Tensor | None] | None, *,
                  buffers: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Phase 3: the wide parameters and (with ``buffers``) buffers compared with the members',
    by the member's names: the caller's mappings, else ``wide``'s own tensors."""
    member_params = [name for name, _ in member.named_parameters()]
    member_buffers = [name for name, _ in member.named_buffers()]
    params_map = dict(wide_params) if wide_params is not None else _default_wide_tensors(wide, True)
    if wide_params is None and list(params_map) != member_params:
        raise AssertionError(f"the wide model's parameters {list(params_map)} are not the member's "
                             f"{member_params} (same names, same order)")
    params_map = {k: v for k, v in params_map.items() if v is not None}
    for name in params_map:
        if name not in member_params:
            raise AssertionError(f"wide parameter {name!r}: the members have no parameter of that name")
    if not buffers:
        return params_map, {}
    if wide_buffers is not None:
        buffers_map = {k: v for k, v in wide_buffers.items() if v is not None}
        for name in buffers_map:
            if name not in member_buffers:
                raise AssertionError(f"wide buffer {name!r}: the members have no buffer of that name")
        return params_map, buffers_map
    all_buffers = _default_wide_tensors(wide, False)
    missing = [name for name in member_buffers if name not in all_buffers]
    if missing:
        raise AssertionError(f"the wide model has no buffers {missing} (the member's names)")
    return params_map, {name: all_buffers[name] for name in member_buffers}


@contextlib.contextmanager
def _wide_state_kept(wide: Any, buffers_map: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Restore, on the way out, the buffers of ``wide`` (an ``nn.Module``), the tensors of
    ``buffers_map`` and the module's train/eval mode: the check leaves the wide model as it was."""
    saved = ({name: b.detach().clone() for name, b in wide.named_buffers()}
             if isinstance(wide, nn.Module) else {})
    saved.update({f"\0{name}": b.detach().clone() for name, b in buffers_map.items()})
    was_training = wide.training if isinstance(wide, nn.Module) else None
    try:
        yield
    finally:
        if isinstance(wide, nn.Module):
            with torch.no_grad():
                for name, b in wide.named_buffers():
                    if name in saved:
                        b.copy_(saved[name])
                for name, b in buffers_map.items():
                    b.copy_(saved[f"\0{name}"])
            if was_training is not None and wide.training != was_training:
                wide.train(was_training)


def _resampler(refs64: _Float64Run | None, get: Callable[[_References], torch.Tensor],
               ) -> Callable[[int, int], torch.Tensor | None] | None:
    """``(i, k) -> get(member i's k-th nudged run)`` (None where it cannot run), for
    _assert_near_reference."""
    if refs64 is None or refs64.nudged is None:
        return None
    nudged = refs64.nudged

    def resample(i: int, k: int) -> torch.Tensor | None:
        run = nudged(i, k)
        return None if run is None else get(run)

    return resample


def _or(t: torch.Tensor | None, zero: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(zero) if t is None else t


def _compare_outputs(report: EquivalenceReport, wide_out: Any, refs: _References,
                     refs64: _Float64Run | None, tol: _Tolerance, what: str) -> None:
    """The wide output vs the members' (any pytree; noted in ``report``)."""
    flat64 = None if refs64 is None else [tree_flatten(o)[0] for o in refs64.outputs]

    def tensors(label: str, leaf: Any, member_leaves: list[torch.Tensor], k: int) -> None:
        tol.members(leaf, member_leaves, kind="output", what=label, report=report, report_kind="output",
                    refs64=None if flat64 is None else [leaves[k] for leaves in flat64],
                    resample=_resampler(refs64, lambda run: tree_flatten(run.outputs[0])[0][k]))

    _walk_members(wide_out, refs.outputs, what, tensors)
    report._note("output", _member_errors(wide_out, refs.outputs))


def _compare_buffers(report: EquivalenceReport, buffers_map: Mapping[str, torch.Tensor], refs: _References,
                     refs64: _Float64Run | None, tol: _Tolerance) -> None:
    """The wide buffers after the call vs the members' (noted in ``report``)."""
    for name, b in buffers_map.items():  # after the call
        ref = [rb[name] for rb in refs.buffers]
        tol.members(b.detach(), ref, kind="buffer", what=f"buffer {name}", report=report,
                    report_kind="buffer", refs64=None if refs64 is None else [rb[name] for rb in refs64.buffers],
                    resample=_resampler(refs64, lambda run, name=name: run.buffers[0][name]))
        report._note("buffer", _member_errors(b, ref))


def _compare_grads(report: EquivalenceReport, wide_grads: Mapping[str, torch.Tensor | None],
                   refs: Sequence[Mapping[str, Any]], refs64: _Float64Run | None,
                   like: Mapping[str, torch.Tensor], tol: _Tolerance, label: str) -> None:
    """Gradients of N-first wide tensors vs each member's, by name (noted in ``report``)."""
    for name, g in wide_grads.items():
        ref = [r.get(name) for r in refs]
        if all(r is None for r in ref):
            if g is not None and g.any():
                raise AssertionError(f"{label} {name}: the members get no gradient, the wide model "
                                     f"gets a nonzero one")
            continue
        if g is None:
            raise AssertionError(f"{label} {name}: no gradient reached the wide tensor, the members "
                                 "get one")
        ref = [torch.zeros_like(like[name][0]) if r is None else r for r in ref]
        zero = torch.zeros_like(like[name][0])
        ref64 = None if refs64 is None else [_widest(zero) if r.get(name) is None else r[name]
                                             for r in refs64.param_grads]
        tol.members(g, ref, kind="grad", what=f"{label} {name}", report=report, report_kind="param_grad",
                    refs64=ref64, resample=_resampler(
                        refs64, lambda run, name=name, zero=zero: _or(run.param_grads[0].get(name), zero)))
        report._note("param_grad", _member_errors(g, ref))


def _compare_input_grad(report: EquivalenceReport, j: int, base: torch.Tensor, g: torch.Tensor | None,
                        refs: _References, refs64: _Float64Run | None, tol: _Tolerance, *,
                        shared: bool) -> None:
    """The gradient of wide input leaf ``j`` vs the members' (for a shared input: their sum)."""
    ref = [r[j] for r in refs.input_grads]
    label = f"grad of input {j}"
    if all(r is None for r in ref):
        if g is not None and g.any():
            raise AssertionError(f"{label}: the members get no gradient, the wide model "
                                 "gets a nonzero one")
        return
    if g is None:
        raise AssertionError(f"{label}: no gradient reached the wide model's input")
    like = base if shared else base[0]
    ref = [torch.zeros_like(like) if r is None else r for r in ref]
    ref64 = None if refs64 is None else [_widest(torch.zeros_like(like)) if r[j] is None else r[j]
                                         for r in refs64.input_grads]
    if shared:
        want = torch.stack(ref).sum(0)
        what = f"{label} (shared input: the sum over members)"
        if ref64 is not None and _float_leaf(g):
            n = len(ref)
            each = _resampler(refs64, lambda run: _or(run.input_grads[0][j], like))

            def summed(_: int, k: int) -> torch.Tensor | None:
                runs = [each(i, k) for i in range(n)] if each is not None else [None]
                return None if any(r is None for r in runs) else torch.stack(runs).sum(0)

            errs = _assert_near_reference(
                g.unsqueeze(0), [want], [torch.stack(ref64).sum(0)], what=what, equal_nan=tol.equal_nan,
                summed=True, resample=summed)
            report._note_reference("input_grad", *errs)
        else:
            assert_close(g, want, tol.dtype, kind="grad", rtol=tol.rtol, atol=tol.atol,
                         equal_nan=tol.equal_nan, msg=what)
        e = _abs_err(g, want)
        report["input_grad"] = e if report["input_grad"] is None else max(report["input_grad"], e)
    else:
        tol.members(g, ref, kind="grad", what=label, report=report, report_kind="input_grad", refs64=ref64,
                    resample=_resampler(refs64, lambda run: _or(run.input_grads[0][j], like)))
        report._note("input_grad", _member_errors(g, ref))


def _compare_grads_of_wide(report: EquivalenceReport, wide_out: Any, inp: _Inputs, refs: _References,
                           refs64: _Float64Run | None, params_map: Mapping[str, torch.Tensor],
                           tol: _Tolerance, *, shared: bool, what: str) -> None:
    """The wide model's input and parameter gradients under the members' cotangents, stacked."""
    out_leaves = tree_flatten(wide_out)[0]
    terms = []
    for k, t in enumerate(out_leaves):
        if refs.cotangents[0][k] is None:
            continue
        if not (isinstance(t, torch.Tensor) and t.requires_grad):
            raise AssertionError(f"{what} leaf {k}: the wide output lost its autograd graph "
                                 "(the members' output requires grad)")
        terms.append((t, torch.stack([c[k] for c in refs.cotangents])))
    in_targets = [(j, b) for j, b in enumerate(inp.bases) if b is not None]
    p_targets = [(name, p) for name, p in params_map.items() if p.requires_grad]
    wrt = [b for _, b in in_targets] + [p for _, p in p_targets]
    got: Sequence[torch.Tensor | None] = [None] * len(wrt)
    if terms and wrt:
        got = torch.autograd.grad([t for t, _ in terms], wrt, [g for _, g in terms], allow_unused=True)
    for (j, base), g in zip(in_targets, got[:len(in_targets)]):
        _compare_input_grad(report, j, base, g, refs, refs64, tol, shared=shared)
    pg = dict(zip([name for name, _ in p_targets], got[len(in_targets):]))
    _compare_grads(report, pg, refs.param_grads, refs64, params_map, tol, "grad of")
    for name, p in params_map.items():
        if not p.requires_grad and any(r.get(name) is not None for r in refs.param_grads):
            raise AssertionError(f"grad of {name}: the wide parameter does not require grad, "
                                 "the members' does")


def _run_wide(wide: Any, inp: _Inputs, refs: _References, refs64: _Float64Run | None,
              params_map: Mapping[str, torch.Tensor], buffers_map: Mapping[str, torch.Tensor],
              tol: _Tolerance, *, n: int, shared: bool, grads: bool, training: bool | None,
              what: str) -> EquivalenceReport:
    """Phase 4: the wide model once, then its outputs, buffers and gradients vs the references
    (against the float64 run ``refs64`` where there is one, Note [The float64 reference])."""
    report = EquivalenceReport(output=None, input_grad=None, param_grad=None, buffer=None, members=n)
    if refs64 is not None:
        report.reference = "float64"
    with _wide_state_kept(wide, buffers_map):
        if training is not None and isinstance(wide, nn.Module):
            wide.train(training)
        with torch.set_grad_enabled(grads):
            wide_out = wide(*inp.wide_args, **inp.wide_kwargs)
        report.wide_output = wide_out
        _compare_outputs(report, wide_out, refs, refs64, tol, what)
        _compare_buffers(report, buffers_map, refs, refs64, tol)
        if grads:
            _compare_grads_of_wide(report, wide_out, inp, refs, refs64, params_map, tol, shared=shared,
                                   what=what)
    return report


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
    if rtol is None and atol is None and _compute_dtype(dtype, models[0], inp) == torch.float32:
        refs64, fallback = _run_members_float64(models, inp, refs, grads=grads, training=training)
        if fallback is not None:
            log.warning("wide_compiler.testing: %s: %s, so the members are compared with fixed float32 "
                        "tolerances instead of against a float64 run (Note [The float64 reference])",
                        what, fallback)
    params_map, buffers_map = _wide_tensors(wide, models[0], wide_params, wide_buffers, buffers=buffers)
    try:
        report = _run_wide(wide, inp, refs, refs64, params_map, buffers_map, tol, n=n, shared=shared,
                           grads=grads, training=training, what=what)
    except AssertionError as e:
        if fallback is None:
            raise
        raise AssertionError(f"{e}\n(compared with fixed float32 tolerances: {fallback})") from None
    report.fallback = fallback
    log.debug("wide_compiler.testing: %s", report)
    return report


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
    # Looked up, not imported: this module sits below model.py (Note [The harness in two layers]),
    # and a WideModel can only exist once wide_compiler.model is loaded.
    model = sys.modules.get("wide_compiler.model")
    wide = getattr(wide, "_orig_mod", wide)
    if model is None or not isinstance(wide, model.WideModel):
        return []
    return sorted(wide._graph_for(training).random_ops)
