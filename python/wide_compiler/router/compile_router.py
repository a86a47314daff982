"""``torch.compile`` of a module that holds routers: :class:`CompileRouter`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .core import WideRouter

__all__ = ["CompileRouter"]


class CompileRouter:
    """``torch.compile`` of a module that holds :class:`WideRouter` s, as the router guide's
    Compilation (Option 3) and "Integration with CompileRouter" sections use it::

        model.collective.prepare_for_compile()
        compiler = CompileRouter.from_module(model)
        compiler.compile_towers()                      # optional: each router's groups compiled
        model = compiler.compile(mode="reduce-overhead")

    It holds the module and changes nothing until called: :meth:`compile_towers` makes every
    router inside compile its groups' wide models (``fullgraph=True``) once they are grouped,
    :meth:`compile` returns ``torch.compile(module, **options)``. Grouping never runs inside a
    ``torch.compile`` trace, so routers grouped before or at the first call both work.

    Example:
        >>> import torch, wide_compiler as wc
        >>> from wide_compiler.router import CompileRouter
        >>> router = wc.WideRouter("collective", config=wc.WideConfig.fast())
        >>> for i in range(2):
        ...     router.register_tower(f"t{i}", torch.nn.Linear(3, 2))
        >>> model = torch.nn.ModuleDict({"collective": router})
        >>> model["collective"].prepare_for_compile(torch.randn(4, 3))
        >>> compiler = CompileRouter.from_module(model)
        >>> compiler.routers() == [router]
        True
        >>> compiled = compiler.compile(backend="eager")
        >>> compiled._orig_mod is model
        True
    """

    def __init__(self, module: nn.Module) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"CompileRouter: expected an nn.Module, got {type(module).__name__}")
        self.module = module

    @classmethod
    def from_module(cls, module: nn.Module) -> CompileRouter:
        """The compiler of ``module`` (the guide's spelling of the constructor)."""
        return cls(module)

    def routers(self) -> list[WideRouter]:
        """Every :class:`WideRouter` inside the module, itself included, in module order."""
        return [m for m in self.module.modules() if isinstance(m, WideRouter)]

    def compile_towers(self, **options: Any) -> None:
        """Every router compiles its groups' wide models (``WideRouter.compile`` without a
        sample: now where the router is grouped, else at its first call)."""
        routers = self.routers()
        if not routers:
            raise ValueError(f"CompileRouter: {type(self.module).__name__} holds no WideRouter")
        for r in routers:
            r.compile(options=options)

    def compile(self, **options: Any) -> nn.Module:
        """``torch.compile(module, **options)``."""
        return torch.compile(self.module, **options)

