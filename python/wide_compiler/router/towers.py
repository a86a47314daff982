"""Towers and their names: :class:`Tower`, the base class of a router tower, and the label it
carries (a name that labels a tower without being part of what it computes)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from torch import nn

__all__ = ["Tower"]

# -- tower names ------------------------------------------------------------------------------
# Reads of Tower.name while a router groups towers (the forwards the member check and the capture
# run): a forward that reads its tower's name computes something that depends on the name.
_name_watch = threading.local()


@contextlib.contextmanager


def _watch_names() -> Iterator[list]:
    """Record every :attr:`Tower.name` read in this thread inside the block."""
    outer = getattr(_name_watch, "reads", None)
    _name_watch.reads = reads = []
    try:
        yield reads
    finally:
        _name_watch.reads = outer
        if outer is not None:
            outer.extend(reads)


class _TowerLabel:
    """A tower's name, held so that the member check (which compares every non-tensor attribute
    of the members) treats towers of different names as one program: the name labels a tower, it
    is not part of what the tower computes. A forward that does read ``self.name`` is caught while
    grouping and never shares a program with towers of other names."""

    __slots__ = ("value",)

    def __init__(self, value: str | None) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _TowerLabel)

    def __hash__(self) -> int:
        return hash(_TowerLabel)

    def __repr__(self) -> str:
        return repr(self.value)

    def __reduce__(self) -> tuple:
        return (_TowerLabel, (self.value,))


def _check_label(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"Tower: name must be a string or None, got {type(value).__name__} {value!r}")
    return value


class Tower(nn.Module):
    """Base class of a router tower: an attached module of this type is registered by
    :meth:`WideRouter.discover_towers`, and by :meth:`WideRouter.attach` itself on a router made
    with ``auto_discover=True``. Any module can be made a tower with
    :meth:`WideRouter.register_tower`.

    Args:
        name: an optional label (the router guide builds towers as ``MyTower('tower_0', dim)``).
            The router knows a tower by the name it is attached under. Towers that differ only in
            their labels share one wide program, unless their forward reads ``self.name`` (then
            each runs alone: one program cannot hold several names).

    Example:
        >>> import torch
        >>> from wide_compiler.router import Tower
        >>> class MyTower(Tower):
        ...     def __init__(self, name, dim):
        ...         super().__init__(name)
        ...         self.fc = torch.nn.Linear(dim, dim)
        ...     def forward(self, x):
        ...         return self.fc(x)
        >>> MyTower("tower_0", 4).name
        'tower_0'
        >>> MyTower("tower_0", 4)
        MyTower(
          name='tower_0'
          (fc): Linear(in_features=4, out_features=4, bias=True)
        )
    """

    def __init__(self, name: str | None = None) -> None:
        label = self.__dict__.get("_tower_label")  # a name set before super().__init__() is kept
        super().__init__()
        self.__dict__["_tower_label"] = _TowerLabel(_check_label(name)) if name is not None or label is None else label

    @property
    def name(self) -> str | None:
        """The tower's label (``None`` when it was built without one)."""
        reads = getattr(_name_watch, "reads", None)
        if reads is not None:
            reads.append(self)
        label = self.__dict__.get("_tower_label")
        return None if label is None else label.value

    @name.setter
    def name(self, value: str | None) -> None:
        self.__dict__["_tower_label"] = _TowerLabel(_check_label(value))

    def extra_repr(self) -> str:
        label = self.__dict__.get("_tower_label")
        return "" if label is None or label.value is None else f"name={label.value!r}"


def _labels(mod: nn.Module) -> list[str | None]:
    """The labels of every Tower inside ``mod`` (itself included), in module order."""
    return [m.__dict__["_tower_label"].value for m in mod.modules()
            if isinstance(m, Tower) and "_tower_label" in m.__dict__]

