"""What the integrations share: the optional-dependency checks (whether a library is installed,
without importing it; importing it with an ``ImportError`` that names the ``pip install``), and
the check that the members handed to an integration are instances of one class."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Sequence
from types import ModuleType
from typing import Any

__all__ = ["check_one_class", "installed", "require"]


def installed(*modules: str) -> bool:
    """Whether every one of ``modules`` (top-level package names) is installed, checked without
    importing them."""
    return all(importlib.util.find_spec(m) is not None for m in modules)


def require(module: str, install_hint: str, *also: str) -> ModuleType:
    """Import and return ``module`` (after importing each of ``also``, which it needs at run
    time); raise ``ImportError(install_hint)`` when any of them is missing."""
    try:
        for name in also:
            importlib.import_module(name)
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(install_hint) from e


def check_one_class(members: Sequence[Any], base: type, owner: str, expected: str,
                    mismatch: type[Exception] = TypeError) -> None:
    """Refuse (naming ``owner``) an empty list of members, a member that is not a ``base``
    (``expected`` says what one is), and members of more than one class (a ``mismatch``)."""
    if not members:
        raise ValueError(f"{owner}: expected at least one member, got an empty list")
    for i, m in enumerate(members):
        if not isinstance(m, base):
            raise TypeError(f"{owner}: member {i} is a {type(m).__name__}; expected {expected}")
        if type(m) is not type(members[0]):
            raise mismatch(f"{owner}: member {i} is a {type(m).__name__} but member 0 is a "
                           f"{type(members[0]).__name__}; one fused run holds one model class")
