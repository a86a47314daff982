"""Compiling a router's groups with ``torch.compile``: :meth:`WideRouter.compile`'s options, and
the wrapping of every group's wide model."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from .core import WideRouter

__all__: list[str] = []


def _device_arg(a: Any) -> torch.device | None:
    """``a`` as a device when it is one (``prepare_for_compile(device)`` of the guide), else None."""
    if isinstance(a, torch.device):
        return a
    if isinstance(a, str):
        try:
            return torch.device(a)
        except (RuntimeError, ValueError):
            return None
    return None


def _named_parameter(mod: nn.Module, name: str) -> bool:
    """Whether ``mod.forward`` has a parameter literally called ``name``."""
    try:
        return name in inspect.signature(mod.forward).parameters
    except (TypeError, ValueError):
        return False


_TORCH_COMPILE_KEYS = ("mode", "backend", "fullgraph", "dynamic", "disable")


def _compile_groups(router: WideRouter) -> None:
    """Wrap every group's wide model in ``torch.compile`` with :meth:`WideRouter.compile`'s options."""
    # Every group runs the same code (WideModel.forward) with its own guards: dynamo's
    # per-code-object limit must admit a few entries per group (raised, never lowered).
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = limit + 4 * len(router.groups)  # train/eval, shapes
    router._compiled = {key: torch.compile(wide, **router._compile_opts) for key, wide in router.groups.items()}


def _compile_options(router: WideRouter, options: Mapping[str, Any] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The ``torch.compile`` options of :meth:`WideRouter.compile`: ``options`` and the keywords
    named as torch.compile's, which are popped from ``kwargs`` (the rest are sample inputs)."""
    opts = dict(options or {})
    for k in _TORCH_COMPILE_KEYS:
        if k not in kwargs:
            continue
        takers = [n for n in router._tower_names if _named_parameter(router._tower(n), k)]
        if takers and options is not None:
            continue  # options given explicitly: a keyword the towers take is a sample input
        if takers:
            raise TypeError(f"WideRouter.compile: {k}= is ambiguous: it is a torch.compile option and a "
                            f"parameter of the forward of towers {takers}. Pass torch.compile's options "
                            f"as options={{...}} (then {k}=... is a sample input)")
        if k in opts:
            raise TypeError(f"WideRouter.compile: {k} given twice, as {k}= and in options")
        opts[k] = kwargs.pop(k)
    if "options" in opts and not isinstance(opts["options"], Mapping):
        raise TypeError("WideRouter.compile: options must be a dict of torch.compile keyword arguments")
    return {"fullgraph": True, **opts}
