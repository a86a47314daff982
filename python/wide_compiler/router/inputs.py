"""A router call's inputs: which tower gets which ``(args, kwargs)``, what a group's compiled
program fixes about them, and how one group's inputs become one wide call's (a shared input
expanded, per-tower inputs stacked)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_map, tree_unflatten

from ..fx.guards import same_input

__all__: list[str] = []


class _Value:
    """A non-tensor input as a compiled program fixes it: equal to another only when
    :func:`~wide_compiler.fx.guards.same_input` says so (``1`` is not ``1.0`` nor ``True``,
    ``-0.0`` is not ``0.0``, a NaN is a NaN), where ``==`` would merge them and give one tower
    the program captured with another tower's value.

    >>> _Value(1) == _Value(1), _Value(1) == _Value(1.0), _Value(0.0) == _Value(-0.0), ("v", 2) == ("v", _Value(2))
    (True, False, False, True)
    """

    __slots__ = ("v",)

    def __init__(self, v: Any) -> None:
        self.v = v

    def __eq__(self, other: object) -> bool:  # another _Value, or a plain value (a reflected ==)
        return same_input(self.v, other.v if isinstance(other, _Value) else other)

    __hash__ = None  # type: ignore[assignment]  # compared, never hashed

    def __repr__(self) -> str:
        return repr(self.v)


def _signature(args: tuple, kwargs: dict) -> Any:
    """The input structure of a call, tensors by shape/dtype/device, other values by value:
    towers given different signatures cannot share one wide program."""
    flat, spec = tree_flatten((args, kwargs))
    return spec, [("tensor", tuple(a.shape), a.dtype, a.device) if isinstance(a, torch.Tensor) else ("value", _Value(a))
                  for a in flat]


def _plain(args: tuple, kwargs: dict) -> bool:
    """Whether a call is positional tensors only (the common call: no pytree walk needed)."""
    return not kwargs and all(isinstance(a, torch.Tensor) for a in args)


def _structure(args: tuple, kwargs: dict) -> Any:
    """What a compiled program fixes about its inputs: the nesting and the non-tensor values."""
    if _plain(args, kwargs):
        return len(args)
    flat, spec = tree_flatten((args, kwargs))
    return spec, [None if isinstance(a, torch.Tensor) else ("value", _Value(a)) for a in flat]


def _expand(tree: Any, n: int) -> Any:
    """One input shared by n members: every tensor as a stride-0 view ``x.expand(n, *x.shape)``."""
    if _plain(*tree):
        return tuple(a.expand(n, *a.shape) for a in tree[0]), {}
    return tree_map(lambda a: a.expand(n, *a.shape) if isinstance(a, torch.Tensor) else a, tree)


def _input_name(path: tuple) -> str:
    """A leaf of ``(args, kwargs)`` as the user wrote it: ``args[0]``, ``mask=``, ``args[1]['k']``."""
    if not path:
        return "the input"
    head, rest = path[0], keystr(path[1:])
    if getattr(head, "idx", None) == 1 and rest.startswith("['"):
        key, _, more = rest[2:].partition("']")
        return f"keyword {key}{more}"
    return f"args{rest}"


def _stack(trees: list, names: list[str]) -> Any:
    """Per-member inputs of one structure -> one N-first input (non-tensor values must agree;
    tensors must have one shape, dtype and device: they are stacked)."""
    flats = [tree_flatten_with_path(t) for t in trees]
    spec = flats[0][1]
    for (_, s), name in zip(flats, names):
        if s != spec:
            raise ValueError(f"WideRouter: tower {name!r} got inputs structured as {s}, tower "
                             f"{names[0]!r} of its group got {spec}")
    leaves = []
    for k, (path, first) in enumerate(flats[0][0]):
        column = [f[0][k][1] for f in flats]
        if isinstance(first, torch.Tensor):
            kinds = [(tuple(c.shape), c.dtype, c.device) if isinstance(c, torch.Tensor) else None for c in column]
            if any(kd != kinds[0] for kd in kinds):
                got = ", ".join(f"{n!r}: " + (f"{list(kd[0])} {kd[1]} {kd[2]}" if kd else type(c).__name__)
                                for n, kd, c in zip(names, kinds, column))
                raise ValueError(
                    f"WideRouter: towers {names} are one group, run as one wide call that stacks their "
                    f"per-tower inputs, but their {_input_name(path)} differ ({got}). Give the towers of a "
                    "group inputs of one shape, dtype and device (e.g. pad or crop to one batch size), or "
                    "run them in separate wide_forward calls with tower_names=[...]")
            leaves.append(torch.stack(column))
        else:
            if not all(same_input(c, first) for c in column):  # 1 vs 1.0, 0.0 vs -0.0: not one program
                raise ValueError(f"WideRouter: the towers of group {names} got different non-tensor inputs "
                                 f"{column!r} (types {[type(c).__name__ for c in column]}) at "
                                 f"{_input_name(path)}; they are baked into the group's program")
            leaves.append(first)
    return tree_unflatten(leaves, spec)


def _tower_inputs(towers: list[str], args: tuple, kwargs: dict, tower_names: Iterable[str] | None,
                  all_towers: bool = False) -> tuple[list[str], dict[str, tuple]]:
    """(selected towers, name -> (args, kwargs) of that tower) for a call of a router whose towers
    are ``towers``."""
    per_tower = args[0] if args and isinstance(args[0], Mapping) else None
    if tower_names is not None and not all_towers:
        names = list(tower_names)
    elif per_tower is not None and not all_towers:
        names = [n for n in towers if n in per_tower]
    else:
        names = list(towers)
    for n in names:
        if n not in towers:
            raise KeyError(f"WideRouter: {n!r} is not a tower; towers: {towers}")
    if per_tower is None:  # one shared (args, kwargs) object, for every tower
        shared = (tuple(args), dict(kwargs))
        return names, {n: shared for n in towers}
    unknown = set(per_tower) - set(towers)
    if unknown:
        raise KeyError(f"WideRouter: inputs given for {sorted(unknown)}, which are not towers")
    inputs = {}
    for n in names:
        if n not in per_tower:
            raise KeyError(f"WideRouter: no input for tower {n!r} in the per-tower input dict")
        own = per_tower[n]
        own = tuple(own) if isinstance(own, (tuple, list)) else (own,)
        inputs[n] = (own + tuple(args[1:]), dict(kwargs))
    return names, inputs
