"""Helpers shared by the hand-built wide modules: member checks and stacking."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..errors import ArchitectureMismatchError


def check_members(modules: Sequence[nn.Module], cls: type | tuple, attrs: Sequence[str], owner: str) -> list:
    """Every module is a ``cls`` with the same ``attrs`` (and parameter dtypes/devices) as member 0."""
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
            va, vb = getattr(m, a, None), getattr(first, a, None)
            if isinstance(va, torch.Tensor) or isinstance(vb, torch.Tensor):
                same = (va is None) == (vb is None) and (va is None or (va.shape == vb.shape and va.dtype == vb.dtype
                                                                       and va.device == vb.device))
            else:
                same = va == vb
            if not same:
                raise ArchitectureMismatchError(f"member {i}: {a} is {va!r}, member 0 has {vb!r}")
    return modules


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


def copy_member(dst: nn.Module, src: nn.Module, i: int, names: Sequence[str]) -> None:
    """dst.<name> = src.<name>[i] (copies) for each parameter/buffer name present."""
    with torch.no_grad():
        for name in names:
            s = getattr(src, name, None)
            if s is not None:
                getattr(dst, name).copy_(s[i])
