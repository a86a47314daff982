"""A check's inputs: the N members' inputs made from one member's sample (perturbed per member or
shared), their N-first stack, and phase 1 of :func:`check_equivalence` (Note [check_equivalence
in phases]): the per-member inputs checked and the wide call's inputs made from them."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .compare import _float_leaf

__all__ = ["make_members", "member_inputs", "shared_input", "stack_inputs"]


def _same_leaf(a: Any, b: Any) -> bool:
    """Whether two non-tensor inputs are one value for a program that bakes them in: the same type
    and value (``1`` is not ``1.0`` nor ``True``, ``-0.0`` is not ``0.0``, a NaN is a NaN; tuples
    and lists item by item). The rule of the compiler's ``fx.guards.same_input``, which the
    harness may not import (.importlinter: equivalence-below-compiler); ``==`` alone would pass
    members given 1 and 1.0 as one input and compare member 1 with a program captured for 1.

    >>> _same_leaf(1, 1), _same_leaf(1, 1.0), _same_leaf(True, 1), _same_leaf(-0.0, 0.0)
    (True, False, False, False)
    >>> _same_leaf(float("nan"), float("nan")), _same_leaf((1, 2.0), (1, 2)), _same_leaf("mean", "mean")
    (True, False, True)
    """
    if type(a) is not type(b):
        return False
    if isinstance(a, (float, complex)):
        return repr(a) == repr(b)  # repr tells -0.0 from 0.0 and takes NaN as NaN
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same_leaf(x, y) for x, y in zip(a, b))
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 -- a value that cannot be compared is not the same
        return False


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
                if not _same_leaf(f[0][j], leaf):  # by type and value: 1 is not 1.0, -0.0 not 0.0
                    raise ValueError(f"wide_compiler.testing.stack_inputs: non-tensor input {j} is "
                                     f"{f[0][j]!r} ({type(f[0][j]).__name__}) for member {i} but {leaf!r} "
                                     f"({type(leaf).__name__}) for member 0; "
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
        noise = torch.randn(t.shape, generator=gen, device=gen.device, dtype=torch.float32)
        return (t.float() + scale * std * noise.to(t.device)).to(t.dtype)

    per_member = [tree_map(perturb, sample) for _ in range(n)]
    return stack_inputs(per_member), per_member



def _as_args(x: Any) -> tuple:
    return x if isinstance(x, tuple) else (x,)


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
                if not _same_leaf(f[0][j], leaf):  # by type and value: 1 is not 1.0 nor True, -0.0 not 0.0
                    raise ValueError(f"check_equivalence: non-tensor input {j} is {f[0][j]!r} "
                                     f"({type(f[0][j]).__name__}) for member {i} but {leaf!r} "
                                     f"({type(leaf).__name__}) for member 0 (Python values are baked in)")
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

