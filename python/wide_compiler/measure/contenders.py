"""Contenders: the ways to run all N members that a measurement compares, built once here.

A contender runs N same-architecture members on N-first inputs: the wide model (one module for
all N), and the baselines a user would otherwise write: N separate modules in a Python loop
(:func:`loop_contender`, optionally channels-last), ``torch.func`` ensembling
(:func:`vmap_contender`: ``stack_module_state`` + ``functional_call`` + ``vmap``) and
``torch.compile`` of any of them (:func:`compiled`, :func:`compiled_loop_contender`,
:func:`compiled_vmap_contender`).
:func:`make_step` turns one into the timed callable of a mode (``"inference"``: forward under
``no_grad``; ``"train"``: forward, sum of the outputs, ``.backward()`` into the parameters'
``.grad``, cleared first as ``optimizer.zero_grad()`` does) and
:func:`max_abs_err` compares two results member by member.

Inputs: a contender's ``forward(x)`` takes ``x`` as one N-first tensor (member ``i`` gets
``x[i]``), a tuple of N-first positional inputs, or a :class:`CallInputs` of positional and
keyword inputs; a non-tensor input is given to every member as it is (:func:`member_inputs`).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

__all__ = ["MODES", "CallInputs", "Contender", "compiled", "compiled_loop_contender", "compiled_vmap_contender",
           "loop_contender", "make_step", "max_abs_err", "member_inputs", "params_max_abs_err", "stacked_params",
           "stored_grads", "vmap_contender", "wide_contender", "wide_params_in_member_order"]

#: A step's modes: forward under ``no_grad``, or forward + gradients of the parameters.
MODES = ("inference", "train")


class CallInputs(NamedTuple):
    """N-first positional (``args``) and keyword (``kwargs``) inputs of all members."""

    args: tuple
    kwargs: dict


def _nth(a: Any, i: int) -> Any:
    return a[i] if isinstance(a, torch.Tensor) else a


def _wide_call(x: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of one call of the wide (N-first) form on ``x``."""
    if isinstance(x, CallInputs):
        return tuple(x.args), dict(x.kwargs)
    if isinstance(x, (tuple, list)):
        return tuple(x), {}
    return (x,), {}


def member_inputs(x: Any, i: int) -> tuple[tuple, dict]:
    """Member ``i``'s ``(args, kwargs)`` of the N-first inputs ``x`` (a tensor, a tuple of
    positional inputs or a :class:`CallInputs`); non-tensors are every member's.

    >>> args, kwargs = member_inputs(CallInputs((torch.arange(6).view(3, 2), 7), {}), 1)
    >>> args[0].tolist(), args[1], kwargs
    ([2, 3], 7, {})
    """
    args, kwargs = _wide_call(x)
    return tuple(_nth(a, i) for a in args), {k: _nth(v, i) for k, v in kwargs.items()}


@dataclasses.dataclass
class Contender:
    """One way to run all N members.

    ``forward(x)`` takes the N-first input (a tensor ``[N, B, ...]``, a tuple of them or a
    :class:`CallInputs`). ``layout`` says what it returns: ``"wide"``: one N-first output (any
    pytree of ``[N, ...]`` tensors); ``"members"``: a list of N per-member outputs;
    ``"opaque"``: not comparable per member (a roofline), never checked. ``params`` are the
    tensors whose gradients a train step computes: for ``"wide"``, one stacked ``[N, *shape]``
    tensor per member parameter in ``member.parameters()`` order; for ``"members"``,
    member-major (all of member 0's parameters, then member 1's, ...).
    """

    name: str
    forward: Callable[[Any], Any]
    params: Sequence[torch.Tensor]
    layout: str = "wide"

    def __post_init__(self) -> None:
        if self.layout not in ("wide", "members", "opaque"):
            raise ValueError(
                f"Contender {self.name!r}: layout must be 'wide', 'members' or 'opaque', "
                f"got {self.layout!r}")


# ---------------------------------------------------------------------------------- contenders

def loop_contender(models: Sequence[nn.Module], name: str | None = None, *,
                   channels_last: bool = False) -> Contender:
    """N separate modules in a Python loop; member ``i`` gets :func:`member_inputs` ``(x, i)``.

    With ``channels_last`` (name ``loop_cl``), copies of the members run in channels-last memory
    format and every 4-d tensor input is converted on every call (as from a contiguous data
    loader).

    >>> models = [nn.Linear(4, 2) for _ in range(3)]
    >>> [tuple(y.shape) for y in loop_contender(models).forward(torch.randn(3, 5, 4))]
    [(5, 2), (5, 2), (5, 2)]
    """
    models = list(models)
    if channels_last:
        models = [copy.deepcopy(m).to(memory_format=torch.channels_last) for m in models]

    def cl(t: Any) -> Any:
        if channels_last and isinstance(t, torch.Tensor) and t.dim() == 4:
            return t.contiguous(memory_format=torch.channels_last)
        return t

    def forward(x: Any) -> list[Any]:
        out = []
        for i, m in enumerate(models):
            args, kwargs = member_inputs(x, i)
            out.append(m(*(cl(a) for a in args), **{k: cl(v) for k, v in kwargs.items()}))
        return out

    name = name or ("loop_cl" if channels_last else "loop")
    return Contender(name, forward, [p for m in models for p in m.parameters()], "members")


def vmap_contender(models: Sequence[nn.Module], *, shared: bool = False, name: str = "vmap",
                   randomness: str = "error") -> Contender:
    """``torch.func`` ensembling: ``stack_module_state`` + ``functional_call`` + ``vmap`` over
    every tensor input (positional and keyword; other inputs are not mapped).

    With ``shared=True`` the input is not mapped (``in_dims=None``): every member reads member
    0's input, as a user with one batch for all members would write it. ``randomness`` is
    ``vmap``'s (``"different"``: each member draws its own dropout masks).

    >>> models = [nn.Linear(4, 2) for _ in range(3)]
    >>> tuple(vmap_contender(models).forward(torch.randn(3, 5, 4)).shape)
    (3, 5, 2)
    """
    from torch.func import functional_call, stack_module_state, vmap

    params, buffers = stack_module_state(list(models))
    base = copy.deepcopy(models[0]).to("meta")
    mapped: dict[tuple, Callable[..., Any]] = {}  # one vmap per input signature, built once

    def forward(x: Any) -> Any:
        args, kwargs = _wide_call(x)
        names, flat = list(kwargs), [*args, *kwargs.values()]  # vmap maps positional inputs only
        if shared:
            flat = [_nth(a, 0) for a in flat]
        dims = tuple(None if shared or not isinstance(a, torch.Tensor) else 0 for a in flat)
        key = (len(args), tuple(names), dims)
        if key not in mapped:
            n_args = len(args)

            def call(p: dict, b: dict, *values: Any) -> Any:
                return functional_call(base, (p, b), tuple(values[:n_args]),
                                       dict(zip(names, values[n_args:])))

            mapped[key] = vmap(call, in_dims=(0, 0, *dims), randomness=randomness)
        return mapped[key](params, buffers, *flat)

    return Contender(name, forward, list(params.values()), "wide")


def compiled(contender: Contender, name: str, **compile_kwargs: Any) -> Contender:
    """``torch.compile`` of a contender's forward. Compiles lazily: failures surface on first call.

    Resets dynamo first, so that compiling many populations in one process never hits the
    recompile limit (which would silently fall back to eager).
    """
    torch.compiler.reset()
    return Contender(name, torch.compile(contender.forward, **compile_kwargs), contender.params, contender.layout)


def compiled_loop_contender(models: Sequence[nn.Module], name: str = "compile_loop",
                            **compile_kwargs: Any) -> Contender:
    """``torch.compile`` of the Python loop (:func:`compiled` of :func:`loop_contender`)."""
    return compiled(loop_contender(models), name, **compile_kwargs)


def compiled_vmap_contender(models: Sequence[nn.Module], name: str = "compile_vmap", *,
                            randomness: str = "error", **compile_kwargs: Any) -> Contender:
    """``torch.compile`` of the vmapped members (:func:`compiled` of :func:`vmap_contender`)."""
    return compiled(vmap_contender(models, randomness=randomness), name, **compile_kwargs)


def wide_contender(name: str, wide: nn.Module, member: nn.Module) -> Contender:
    """The wide model (e.g. ``wc.compile``'s) as a contender: one call on the N-first inputs;
    its params are its stacked parameters in ``member``'s order
    (:func:`wide_params_in_member_order`)."""
    def forward(x: Any) -> Any:
        args, kwargs = _wide_call(x)
        return wide(*args, **kwargs)

    return Contender(name, forward, wide_params_in_member_order(wide, member), "wide")


def stacked_params(models: Sequence[nn.Module]) -> list[torch.Tensor]:
    """One ``[N, *shape]`` leaf per member parameter (``parameters()`` order), requiring grad."""
    per_member = [list(m.parameters()) for m in models]
    return [torch.stack([ps[j].detach() for ps in per_member]).requires_grad_()
            for j in range(len(per_member[0]))]


def wide_params_in_member_order(wide: nn.Module, member: nn.Module) -> list[torch.Tensor]:
    """The wide model's stacked parameters, in ``member.named_parameters()`` order.

    Relies on the wide model's ``state_dict(keep_vars=True)`` being keyed by the member's
    parameter names with the stacked ``[N, *shape]`` parameters as values.
    """
    sd = wide.state_dict(keep_vars=True)
    out = []
    for name, p in member.named_parameters():
        t = sd.get(name)
        if not isinstance(t, torch.Tensor) or not t.requires_grad or t.shape[1:] != p.shape:
            raise RuntimeError(
                f"wide model's state_dict(keep_vars=True)[{name!r}] is not a stacked parameter "
                f"[N, {', '.join(map(str, p.shape))}] (got "
                f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}); "
                f"cannot compare gradients per member")
        out.append(t)
    return out


# ---------------------------------------------------------------------------------- steps

def _tensors(out: Any) -> list[torch.Tensor]:
    """The tensor leaves of a forward's output: a non-tensor leaf (``{'h': h, 'n': x.shape[0]}``'s
    int) is neither summed into the loss nor compared as a tensor (probe 8 of issue 44, P8-11)."""
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]


def _others(out: Any) -> list[Any]:
    """The non-tensor leaves of a forward's output, compared for equality by :func:`max_abs_err`."""
    return [t for t in tree_leaves(out) if not isinstance(t, torch.Tensor)]


def _loss(out: Any) -> torch.Tensor:
    leaves = _tensors(out)
    if len(leaves) == 1:
        return leaves[0].sum()
    return torch.stack([t.sum() for t in leaves]).sum()


def stored_grads(loss: torch.Tensor, params: Sequence[torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
    """``loss.backward()`` into the ``.grad`` of ``params``, cleared first (as after
    ``optimizer.zero_grad()``), as a training loop stores gradients; returns them and clears ``.grad`` again, so that
    contenders timed in turn keep no gradients alive between their steps.

    Example::

        >>> w = torch.ones(3, requires_grad=True)
        >>> stored_grads((2 * w).sum(), [w]), w.grad
        ((tensor([2., 2., 2.]),), None)
    """
    for p in params:
        p.grad = None
    loss.backward(inputs=list(params))
    grads = tuple(p.grad for p in params)
    for p in params:
        p.grad = None
    return grads


def make_step(contender: Contender, x: Any, mode: str) -> Callable[[], Any]:
    """The timed callable: ``"inference"`` is a forward under ``torch.no_grad``; ``"train"`` is
    what a training loop runs: forward, the sum of every output, and ``.backward()`` into the
    params' cleared ``.grad`` (:func:`stored_grads`); it returns the output and those gradients.
    ``.backward()``, not ``torch.autograd.grad``:
    storing into ``.grad`` copies a gradient that does not come in its parameter's layout, which
    a training step pays (Note [Linear weight gradient layout])."""
    if mode == "inference":
        def step() -> Any:
            with torch.no_grad():
                return contender.forward(x)
    elif mode == "train":
        params = list(contender.params)

        def step() -> Any:
            out = contender.forward(x)
            return out, stored_grads(_loss(out), params)
    else:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return step


def member_outputs(contender: Contender, out: Any, n: int) -> list[list[torch.Tensor]]:
    """Every member's output tensors (pytree leaves) of one forward result of ``contender``."""
    if contender.layout == "members":
        return [_tensors(o) for o in out]
    leaves = _tensors(out)
    return [[t[i] for t in leaves] for i in range(n)]


def member_grads(contender: Contender, grads: Sequence[torch.Tensor], n: int) -> list[list[torch.Tensor]]:
    """A train step's gradients of ``contender``'s params, ``[j][i]`` member ``i``'s gradient of
    parameter ``j``: views, never a stacked copy (GPT-2 at N=4 has 2 GB of gradients)."""
    if contender.layout == "members":
        per = len(grads) // n
        return [[grads[i * per + j] for i in range(n)] for j in range(per)]
    return [list(g.unbind(0)) for g in grads]


def diff(a: torch.Tensor, b: torch.Tensor, what: str) -> float:
    """|a - b| at most, as wide_compiler.testing measures it (float64, NaN == NaN); ``what``
    names the compared tensor in the error when the shapes differ."""
    from .. import _equivalence as testing  # the comparisons alone (no compiler imports)

    if a.shape != b.shape:
        raise ValueError(f"{what}: expected shape {tuple(a.shape)}, got {tuple(b.shape)}")
    return testing.max_member_error(b.unsqueeze(0), [a])


def max_abs_err(reference: Contender, ref_result: Any, other: Contender, result: Any,
                n: int, mode: str) -> float:
    """Largest |difference| of any member's outputs (and, for train, parameter gradients)."""
    if mode == "train":
        ref_out, ref_grads = ref_result
        out, grads = result
    else:
        ref_out, ref_grads, out, grads = ref_result, (), result, ()
    err = 0.0
    ref_others = [_others(o) for o in ref_out] if reference.layout == "members" else [_others(ref_out)] * n
    others = [_others(o) for o in out] if other.layout == "members" else [_others(out)] * n
    for i, (r, o) in enumerate(zip(ref_others, others, strict=True)):
        if r != o:  # a non-tensor output (an int, a string) the two disagree on
            raise ValueError(f"member {i}: {other.name} returned the non-tensor outputs {o!r}, "
                             f"{reference.name} returned {r!r}")
    ref_members = member_outputs(reference, ref_out, n)
    members = member_outputs(other, out, n)
    for i, (r, o) in enumerate(zip(ref_members, members, strict=True)):
        if len(r) != len(o):
            raise ValueError(f"member {i}: {other.name} returned {len(o)} outputs, "
                             f"{reference.name} returned {len(r)}")
        for a, b in zip(r, o):
            err = max(err, diff(a, b, f"member {i} output of {other.name}"))
    if mode == "train":
        # member by member: the float64 comparison of one member's gradient at a time
        rg = member_grads(reference, ref_grads, n)
        og = member_grads(other, grads, n)
        if len(rg) != len(og):
            raise ValueError(f"{other.name} has {len(og)} stacked parameters, "
                             f"{reference.name} has {len(rg)}")
        for j, (ra, ob) in enumerate(zip(rg, og)):
            for i, (a, b) in enumerate(zip(ra, ob, strict=True)):
                err = max(err, diff(a, b, f"member {i} gradient of parameter {j} of {other.name}"))
    return err


def params_max_abs_err(reference: Sequence[Sequence[torch.Tensor]],
                       stacked: Sequence[torch.Tensor]) -> float:
    """Largest |difference| of member ``i``'s tensors ``reference[i]`` against the stacked
    ``[t[i] for t in stacked]`` (e.g. parameters after an optimizer step): :func:`max_abs_err`
    of a ``"members"`` and a ``"wide"`` result.

    >>> a, b = torch.zeros(2, 3), torch.ones(2)
    >>> params_max_abs_err([[a[0], b[0]], [a[1], b[1] + 0.5]], [a, b])
    0.5
    """
    def unused(x: torch.Tensor) -> None:
        raise NotImplementedError

    ref = Contender("reference", unused, [], "members")
    wide = Contender("wide", unused, [], "wide")
    return max_abs_err(ref, [list(r) for r in reference], wide, list(stacked), len(reference),
                       "inference")
