"""Comparing a wide result with its members' results: tensors (N-first, row ``i`` against member
``i``) and pytrees of them, within :func:`~wide_compiler.testing.tolerance`, with failures that
name the member and the leaf."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path

from .tolerances import _tol_for

__all__ = ["assert_close", "assert_members_close", "assert_trees_members_close", "max_member_error"]


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
    """``torch.testing.assert_close`` within :func:`tolerance` (dtype and shape must match).

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


def _float_leaf(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def _widest(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.to(torch.complex128) if t.is_complex() else t.to(torch.float64)
