"""Helpers shared by the hand-built wide modules: member checks, strategies and stacking."""

from __future__ import annotations

from collections.abc import Sequence
from functools import reduce

import torch
from torch import nn

from ..errors import ArchitectureMismatchError


def get_path(obj, name: str):
    """``obj.<name>`` where ``name`` may be dotted (``out_proj.weight``); None if absent."""
    return reduce(lambda o, a: getattr(o, a, None), name.split("."), obj)


def check_members(modules: Sequence[nn.Module], cls: type | tuple, attrs: Sequence[str], owner: str) -> list:
    """Every module is a ``cls`` with the same ``attrs`` (dotted names reach into submodules;
    tensors compare by presence, shape, dtype and device) as member 0."""
    modules = list(modules)
    if not modules:
        raise ValueError(f"{owner}.from_modules: expected at least one module, got none")
    first = modules[0]
    for i, m in enumerate(modules):
        if not isinstance(m, cls):
            raise ArchitectureMismatchError(f"member {i}: expected {getattr(cls, '__name__', cls)}, got {type(m).__name__}")
        if type(m) is not type(first):
            raise ArchitectureMismatchError(f"member {i}: type is {type(m).__name__}, member 0 has {type(first).__name__}")
        for a in attrs:
            va, vb = get_path(m, a), get_path(first, a)
            fmt = repr
            if isinstance(va, torch.Tensor) or isinstance(vb, torch.Tensor):
                va, vb = (None if v is None else f"a {list(v.shape)} {v.dtype} tensor on {v.device}" for v in (va, vb))
                fmt = str
            if va != vb:
                raise ArchitectureMismatchError(f"member {i}: {a} is {fmt(va)}, member 0 has {fmt(vb)}")
    return modules


def check_strategy(owner: type | nn.Module, strategy: str) -> str:
    """``strategy`` if the wide module class ``owner`` offers it (its ``STRATEGIES``: the names its
    ``torch.ops.wide`` op accepts; ``("auto",)`` for an op with one implementation), else a
    ValueError naming the class and the valid strategies. Called at construction, so a bad name
    never waits for the first forward."""
    cls = owner if isinstance(owner, type) else type(owner)
    valid = getattr(cls, "STRATEGIES", ("auto",))
    if not isinstance(strategy, str) or strategy not in valid:
        raise ValueError(f"{cls.__name__}: expected strategy in {valid}, got {strategy!r}")
    return strategy


def stack_param(modules: Sequence[nn.Module], name: str) -> nn.Parameter | None:
    ps = [getattr(m, name) for m in modules]
    if ps[0] is None:
        return None
    return nn.Parameter(torch.stack([p.detach() for p in ps]), requires_grad=ps[0].requires_grad)


def stack_buffer(modules: Sequence[nn.Module], name: str) -> torch.Tensor | None:
    bs = [getattr(m, name, None) for m in modules]
    if bs[0] is None:
        return None
    return torch.stack([b.detach() for b in bs]).clone()


def unstack_member(dst: nn.Module, src: nn.Module, i: int, names: Sequence[str]) -> None:
    """Member ``i`` of the wide module ``src`` into the ordinary module ``dst`` (the inverse of
    :func:`stack_param` for one member, used by ``unfuse``): ``dst.<name> = src.<name>[i]``
    (copies) for each parameter/buffer name present (dotted names such as ``out_proj.weight``
    reach into submodules)."""
    with torch.no_grad():
        for name in names:
            s = get_path(src, name)
            if s is not None:
                get_path(dst, name).copy_(s[i])
