"""``router[name]`` of a tower fused into a wide group: a live view that runs the tower alone on
its rows of the group's wide parameters and buffers."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .running import _run_member

if TYPE_CHECKING:
    from .core import WideRouter

__all__: list[str] = []


class _FusedTowerView(nn.Module):
    """``router[name]`` for a tower fused into a wide group: calling it runs that tower alone on
    its rows of the group's wide parameters and buffers (reads them live, and gradients reach
    them, so an optimizer over ``router.parameters()`` trains it). The view follows the tower by
    name: after the router ungroups, it calls the live tower module.

    It owns no parameters: ``parameters()`` raises (the trainable tensors are the router's), and
    ``state_dict()``/``load_state_dict()`` read and write the tower's rows. For a standalone copy
    of the tower use ``router.unfuse()[name]``."""

    def __init__(self, router: WideRouter, name: str) -> None:
        super().__init__()
        self.__dict__["_router"] = router  # not a submodule: the router owns the view, not the reverse
        self.__dict__["_tower_name"] = name

    def _where(self) -> tuple[str | None, int | nn.Module]:
        """(group key, member index) while fused, else (None, the live tower module)."""
        router, name = self.__dict__["_router"], self.__dict__["_tower_name"]
        for key, members in router._members.items():
            if name in members:
                return key, members.index(name)
        if name in router._modules and name in router._tower_names:
            return None, router._modules[name]
        raise KeyError(f"router[{name!r}]: {name!r} is no longer a tower of this router; towers: "
                       f"{router._tower_names}")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        key, where = self._where()
        if key is None:
            return where(*args, **kwargs)
        return _run_member(self.__dict__["_router"], key, where, args, kwargs)

    def _refuse(self, what: str) -> None:
        name = self.__dict__["_tower_name"]
        raise RuntimeError(
            f"router[{name!r}].{what}: tower {name!r} is fused into a wide group, so its parameters are rows "
            "of the router's wide parameters and have no tensors of their own: train it with an optimizer "
            f"over router.parameters(); read its values with router[{name!r}].state_dict(); for a standalone "
            f"module use router.unfuse()[{name!r}] (a copy)")

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        self._refuse("parameters()")

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        self._refuse("named_parameters()")

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """The tower's ``state_dict``: copies of its rows of the wide parameters and buffers."""
        key, where = self._where()
        if key is None:
            return where.state_dict(*args, **kwargs)
        return self.__dict__["_router"].groups[key].member_state_dict(where)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Write an ordinary tower ``state_dict`` into the tower's rows (strict: the tower's own
        keys and shapes, all checked before anything is written)."""
        key, where = self._where()
        if key is None:
            return where.load_state_dict(state_dict, strict=strict, assign=assign)
        if not strict or assign:
            raise ValueError("router[name].load_state_dict of a fused tower is strict and copies into the wide "
                             "parameters: strict=False and assign=True are not supported")
        self.__dict__["_router"].groups[key].load_member_state_dict(where, state_dict)
        return None

    def __getattr__(self, attr: str) -> Any:
        try:
            return super().__getattr__(attr)
        except AttributeError:
            name = self.__dict__.get("_tower_name")
            if name is None:  # half-built (unpickling, copying)
                raise
            raise AttributeError(
                f"router[{name!r}] is a live view of tower {name!r}, fused into a wide group: it can be called "
                f"and has state_dict()/load_state_dict(), but no attribute {attr!r} (the fused tower has no "
                f"module of its own). Use router.unfuse()[{name!r}] for a copy of the module, or "
                "router.write_back() to update the original one") from None

    def extra_repr(self) -> str:
        try:
            key, where = self._where()
        except KeyError:
            return f"tower={self.__dict__['_tower_name']!r} (detached)"
        return (f"tower={self.__dict__['_tower_name']!r}, "
                + ("not fused" if key is None else f"fused: member {where} of router.groups[{key!r}]"))
