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
from torch.utils._pytree import (
    keystr,
    tree_flatten,
    tree_flatten_with_path,
    tree_map,
    tree_unflatten,
)

__all__ = [
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
        tol = _tol_for(ref, dtype, kind)
        if rtol is not None:
            tol["rtol"] = rtol
        if atol is not None:
            tol["atol"] = atol
        if got.device != ref.device:
            raise AssertionError(f"{what}: member {i}: device {got.device} != expected {ref.device}")

        def message(m: str, i: int = i, got: torch.Tensor = got, ref: torch.Tensor = ref,
                    tol: dict = tol) -> str:
            return (f"{what}: member {i} differs from its own model (member {i} of {n}; max abs "
                    f"error {_abs_err(got, ref):.3g}, rtol={tol['rtol']:g}, atol={tol['atol']:g})\n{m}")

        torch.testing.assert_close(got.detach(), ref.detach(), **tol, equal_nan=equal_nan,
                                   msg=message)


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
    wide_paths, wide_spec = _leaves_with_labels(wide_out)
    flats = [tree_flatten(o) for o in member_outs]
    for i, (_, spec) in enumerate(flats):
        if spec != wide_spec:
            raise AssertionError(f"{what}: member {i}: output structure {spec} != wide {wide_spec}")
    for k, (path, leaf) in enumerate(wide_paths):
        label = f"{what}{path}"
        refs = [leaves[k] for leaves, _ in flats]
        if all(isinstance(r, torch.Tensor) for r in refs):
            assert_members_close(leaf, refs, dtype, kind=kind, what=label, rtol=rtol, atol=atol,
                                 equal_nan=equal_nan)
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


class EquivalenceReport(dict):
    """What :func:`check_equivalence` compared: the max abs error per kind -- ``"output"``,
    ``"input_grad"``, ``"param_grad"``, ``"buffer"`` (None where nothing of that kind was compared)
    -- and ``"members"``. Attributes (not keys): ``wide_output``, the wide model's output;
    ``per_member``, each member's largest error over its outputs, gradients and buffers (a shared
    input's gradient, a sum over members, is not in it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.wide_output: Any = None
        self.per_member: list[float] = [0.0] * int(self.get("members") or 0)

    def _note(self, kind: str, errs: Sequence[float]) -> None:
        e = max(errs, default=0.0)
        self[kind] = e if self.get(kind) is None else max(self[kind], e)
        self.per_member = [max(a, b) for a, b in zip(self.per_member, errs)]

    def max_error(self) -> float:
        """The largest error over every kind compared."""
        errs = [v for k, v in self.items() if k in ("output", "input_grad", "param_grad", "buffer")
                and v is not None]
        return max(errs, default=0.0)

    def __str__(self) -> str:
        parts = [f"{k.replace('_', ' ')} {v:.1e}" for k, v in self.items()
                 if k != "members" and v is not None]
        return f"{self.get('members', '?')} members, max abs err: " + ", ".join(parts)


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


@dataclasses.dataclass(frozen=True)
class _Tolerance:
    """How one check compares: the compute dtype for :func:`tolerance`, the caller's overrides."""

    dtype: torch.dtype | None
    rtol: float | None
    atol: float | None
    equal_nan: bool

    def members(self, wide: torch.Tensor, refs: Sequence[torch.Tensor], *, kind: str, what: str) -> None:
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


def _run_members(models: Sequence[nn.Module], inp: _Inputs, *, grads: bool, training: bool | None,
                 seed: int) -> _References:
    """Phase 2: every member alone, on a deep copy (the caller's models are never modified), its
    gradients taken under a random cotangent per output leaf (seeded by ``seed``)."""
    gen = torch.Generator().manual_seed(seed)
    refs = _References()
    for i, original in enumerate(models):
        try:
            m = copy.deepcopy(original)
        except Exception as e:
            raise TypeError(f"check_equivalence runs every member on a deep copy (your models are never "
                            f"modified), but copy.deepcopy(member {i}) failed: {type(e).__name__}: {e}") from e
        if training is not None:
            m.train(training)
        leaves = [a.detach().clone().requires_grad_(grads and _float_leaf(a)) if isinstance(a, torch.Tensor)
                  else a for a in inp.member_leaves[i]]
        args, kw = tree_unflatten(leaves, inp.spec)
        with torch.set_grad_enabled(grads):
            out = m(*args, **kw)
        out_leaves = tree_flatten(out)[0]
        cot = [torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.dtype).to(t.device)
               if _float_leaf(t) and t.requires_grad else None for t in out_leaves]
        in_grads: list = [None] * len(leaves)
        pgrads: dict[str, torch.Tensor | None] = {}
        if grads:
            params = [(name, p) for name, p in m.named_parameters() if p.requires_grad]
            targets = [(k, a) for k, a in enumerate(leaves) if isinstance(a, torch.Tensor) and a.requires_grad]
            outs_g = [(t, g) for t, g in zip(out_leaves, cot) if g is not None]
            wrt = [a for _, a in targets] + [p for _, p in params]
            if outs_g and wrt:
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
        del m
    return refs


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


def _compare_outputs(report: EquivalenceReport, wide_out: Any, refs: _References, tol: _Tolerance,
                     what: str) -> None:
    """The wide output vs the members' (any pytree; noted in ``report``)."""
    assert_trees_members_close(wide_out, refs.outputs, tol.dtype, what=what, rtol=tol.rtol, atol=tol.atol,
                               equal_nan=tol.equal_nan)
    report._note("output", _member_errors(wide_out, refs.outputs))


def _compare_buffers(report: EquivalenceReport, buffers_map: Mapping[str, torch.Tensor], refs: _References,
                     tol: _Tolerance) -> None:
    """The wide buffers after the call vs the members' (noted in ``report``)."""
    for name, b in buffers_map.items():  # after the call
        ref = [rb[name] for rb in refs.buffers]
        tol.members(b.detach(), ref, kind="buffer", what=f"buffer {name}")
        report._note("buffer", _member_errors(b, ref))


def _compare_grads(report: EquivalenceReport, wide_grads: Mapping[str, torch.Tensor | None],
                   refs: Sequence[Mapping[str, Any]], like: Mapping[str, torch.Tensor],
                   tol: _Tolerance, label: str) -> None:
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
        tol.members(g, ref, kind="grad", what=f"{label} {name}")
        report._note("param_grad", _member_errors(g, ref))


def _compare_input_grad(report: EquivalenceReport, j: int, base: torch.Tensor, g: torch.Tensor | None,
                        refs: _References, tol: _Tolerance, *, shared: bool) -> None:
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
    if shared:
        want = torch.stack(ref).sum(0)
        assert_close(g, want, tol.dtype, kind="grad", rtol=tol.rtol, atol=tol.atol,
                     equal_nan=tol.equal_nan, msg=f"{label} (shared input: the sum over members)")
        e = _abs_err(g, want)
        report["input_grad"] = e if report["input_grad"] is None else max(report["input_grad"], e)
    else:
        tol.members(g, ref, kind="grad", what=label)
        report._note("input_grad", _member_errors(g, ref))


def _compare_grads_of_wide(report: EquivalenceReport, wide_out: Any, inp: _Inputs, refs: _References,
                           params_map: Mapping[str, torch.Tensor], tol: _Tolerance, *, shared: bool,
                           what: str) -> None:
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
        _compare_input_grad(report, j, base, g, refs, tol, shared=shared)
    pg = dict(zip([name for name, _ in p_targets], got[len(in_targets):]))
    _compare_grads(report, pg, refs.param_grads, params_map, tol, "grad of")
    for name, p in params_map.items():
        if not p.requires_grad and any(r.get(name) is not None for r in refs.param_grads):
            raise AssertionError(f"grad of {name}: the wide parameter does not require grad, "
                                 "the members' does")


def _run_wide(wide: Any, inp: _Inputs, refs: _References, params_map: Mapping[str, torch.Tensor],
              buffers_map: Mapping[str, torch.Tensor], tol: _Tolerance, *, n: int, shared: bool,
              grads: bool, training: bool | None, what: str) -> EquivalenceReport:
    """Phase 4: the wide model once, then its outputs, buffers and gradients vs the references."""
    report = EquivalenceReport(output=None, input_grad=None, param_grad=None, buffer=None, members=n)
    with _wide_state_kept(wide, buffers_map):
        if training is not None and isinstance(wide, nn.Module):
            wide.train(training)
        with torch.set_grad_enabled(grads):
            wide_out = wide(*inp.wide_args, **inp.wide_kwargs)
        report.wide_output = wide_out
        _compare_outputs(report, wide_out, refs, tol, what)
        _compare_buffers(report, buffers_map, refs, tol)
        if grads:
            _compare_grads_of_wide(report, wide_out, inp, refs, params_map, tol, shared=shared, what=what)
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
        dtype: the compute dtype for the tolerances (default: the members' first floating
            parameter's dtype).
        wide_params, wide_buffers: member name -> stacked ``[N, ...]`` tensor of ``wide`` (entries
            that are None are skipped). Default: ``wide``'s own named parameters / buffers, whose
            names must be the member's (a torch.compile ``_orig_mod.`` prefix is ignored; buffers
            the members do not have, such as lifted constants, are skipped).
        rtol, atol: override :func:`tolerance` for every comparison.
        equal_nan: NaN in the same place on both sides counts as equal.
        what: label of the outputs in failure messages.

    Returns:
        An :class:`EquivalenceReport`: the max abs error per kind (``output``, ``input_grad``,
        ``param_grad``, ``buffer``; None where nothing was compared); ``.wide_output`` is the
        wide output.

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
        >>> testing.check_equivalence(wide, layers[::-1], torch.randn(4, 5, 3))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        AssertionError: output: member 0 differs from its own model (member 0 of 4; ...
        ...
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
    params_map, buffers_map = _wide_tensors(wide, models[0], wide_params, wide_buffers, buffers=buffers)
    report = _run_wide(wide, inp, refs, params_map, buffers_map, tol, n=n, shared=shared, grads=grads,
                       training=training, what=what)
    log.debug("wide_compiler.testing: %s", report)
    return report


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
