"""Tensors a tower shares: stacking a group's parameters and buffers copies them, so a tensor a
grouped tower shares with anything else in the router would be silently untied. Such a group is
refused (and its towers run one by one)."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from .core import WideRouter

__all__: list[str] = []

# -- tensors a tower shares ------------------------------------------------------------------
_MODULE_KEYS = frozenset(nn.Module().__dict__) | {"_compiled_call_impl", "_tower_label"}


def _tensors(mod: nn.Module) -> dict[int, tuple[torch.Tensor, str, bool]]:
    """Every tensor ``mod`` reaches: ``id -> (tensor, where, registered)`` for its parameters and
    buffers and for tensors held as plain attributes (directly, in a list/tuple/dict, or behind a
    weak reference) of any of its submodules."""
    out: dict[int, tuple[torch.Tensor, str, bool]] = {}

    def add(t: Any, where: str, registered: bool) -> None:
        if isinstance(t, weakref.ref):
            t = t()
        if isinstance(t, torch.Tensor) and (registered or id(t) not in out):
            out[id(t)] = (t, where, registered)

    for path, m in mod.named_modules(remove_duplicate=False):
        pre = f"{path}." if path else ""
        for k, t in m._parameters.items():
            add(t, pre + k, True)
        for k, t in m._buffers.items():
            add(t, pre + k, True)
        for k, v in m.__dict__.items():
            if k in _MODULE_KEYS:
                continue
            if isinstance(v, (list, tuple)):
                for j, t in enumerate(v):
                    add(t, f"{pre}{k}[{j}]", False)
            elif isinstance(v, dict):
                for j, t in v.items():
                    add(t, f"{pre}{k}[{j!r}]", False)
            else:
                add(v, pre + k, False)
    return out


def _tied(t: torch.Tensor, registered: bool) -> bool:
    """Whether a tensor reached from two places must stay one object: a parameter, anything
    trained, or anything registered (a buffer can be updated in place); a plain constant tensor
    read by both is only read."""
    return registered or isinstance(t, nn.Parameter) or t.requires_grad


def _describe_tensor(t: torch.Tensor) -> str:
    kind = "Parameter" if isinstance(t, nn.Parameter) else "tensor"
    return f"{kind} {list(t.shape)} {t.dtype}"


def _check_not_shared(router: WideRouter, names: list[str]) -> None:
    """Stacking copies a group's tensors: a parameter or buffer a grouped tower shares with
    anything else in the router (another tower of the group or outside it, a head, a tensor
    registered on the router itself), held registered or as a plain attribute, would be
    silently untied. Raise naming the first one."""
    inside: dict[int, tuple[str, str, bool]] = {}  # id -> (tower, where, tied on its side)
    for n in names:
        for i, (t, where, registered) in _tensors(router._modules[n]).items():
            if i in inside and inside[i][0] != n and _tied(t, registered):
                n0, w0, _ = inside[i]
                raise ValueError(f"tower {n!r} ({where!r}) and tower {n0!r} ({w0!r}) of the group share "
                                 f"one {_describe_tensor(t)}: fusing would give each member its own copy "
                                 "and untie them")
            inside.setdefault(i, (n, where, _tied(t, registered)))
    outside = [(o, m) for o, m in [*router._modules.items(), *router._originals.items()]
               if o not in names and o != "groups"]
    own = {id(t): (t, k, True) for k, t in [*router._parameters.items(), *router._buffers.items()] if t is not None}
    for k, v in router.__dict__.items():
        if isinstance(v, torch.Tensor) and id(v) not in own:
            own[id(v)] = (v, k, False)
    for other, found in [("the router itself", own), *((repr(o), _tensors(m)) for o, m in outside)]:
        for i, (t, where, registered) in found.items():
            if i in inside and (_tied(t, registered) or inside[i][2]):
                n, w, _ = inside[i]
                raise ValueError(f"tower {n!r} shares its tensor {w!r} ({_describe_tensor(t)}) with {other} "
                                 f"({where!r}), outside the group: fusing would copy it into the group's "
                                 "stacked parameters and untie them")
