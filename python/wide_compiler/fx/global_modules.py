"""Modules and parameters the members' code reads as module globals (probe 5 F21), refused before
export runs.

Note [A module held as a global]
    ``PROJ = nn.Linear(4, 4)`` at module level with ``return PROJ(self.fc(x))`` in the members'
    forward: every member calls the same module, whose parameters are no member's state. torch.export
    lifts them as constants of the graph, so the wide model bakes them in: they get no gradient from
    it (each member alone gives them one) and a later change (an optimizer step on them) is not
    seen. A trainable ``nn.Parameter`` held as a global (``self.fc(x) * W``) is guarded by its
    values but gets no gradient either. Both are refused at compile, naming the global, the code
    that reads it and what to do: make it a submodule (a parameter) of each member, or pass it in
    as an input. A global module without parameters or buffers (``ACT = nn.GELU()``) holds no
    state to train and is accepted, named in a warning: its attributes (``approximate``, a
    Dropout's ``p``) are read as they are at capture and a change after compiling is not seen; a
    global tensor that is not a trainable parameter is guarded as before (Note [State a forward reads]).

    The code read is the ``forward`` of every module class of the user's in the tree (and its base
    classes'), the methods of those classes it names (``self.helper(x)``), the user's functions it
    reads as globals, transitively, and the code objects nested in each; a global read as
    ``cfgmod.PROJ`` (a module of the user's) counts too. Read statically from the bytecode, like
    the guards' reads (fx/state_reads.py).
"""

from __future__ import annotations

import dis
import logging
import types
from typing import Any

import torch
from torch import nn

from ..errors import UnsupportedOperationError
from .cache_key import _globals_read
from .source import is_user_file

__all__ = ["check_global_modules"]

log = logging.getLogger("wide_compiler")

_MAX_CODES = 2000


def _stateful(v: Any) -> str | None:
    """What makes ``v`` state no member holds: a module with parameters or buffers, or a trainable
    parameter; None otherwise."""
    if isinstance(v, nn.Module):
        n_params = sum(1 for _ in v.parameters())
        n_bufs = sum(1 for _ in v.buffers())
        if n_params or n_bufs:
            return f"a {type(v).__name__} module with {n_params} parameter(s) and {n_bufs} buffer(s)"
        return None
    if isinstance(v, nn.Parameter) and v.requires_grad:
        return f"an nn.Parameter of shape {tuple(v.shape)}"
    return None


def _line(code: types.CodeType, name: str) -> int | None:
    """The source line of the first load of global ``name`` in ``code``."""
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME") and ins.argval == name:
            return ins.positions.lineno if ins.positions else None
    return None


def _user_function(v: Any) -> bool:
    return isinstance(v, types.FunctionType) and is_user_file(v.__code__.co_filename, skip_stdlib=True) \
        and "-packages" not in v.__code__.co_filename


def check_global_modules(model: nn.Module) -> None:
    """Refuse a module with parameters or buffers, or a trainable ``nn.Parameter``, that the code
    of ``model``'s module classes reads as a module global (Note [A module held as a global]).

    >>> class Ok(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.fc = nn.Linear(2, 2)
    ...     def forward(self, x):
    ...         return self.fc(x)
    >>> check_global_modules(Ok())
    """
    classes = [k for m in model.modules() for k in type(m).__mro__
               if k not in (nn.Module, object) and getattr(k, "__module__", "") and not k.__module__.startswith("torch")]
    classes = list(dict.fromkeys(classes))
    work: list[types.FunctionType] = []
    for klass in classes:
        fn = vars(klass).get("forward")
        if _user_function(fn):
            work.append(fn)
    methods: dict[str, list[types.FunctionType]] = {}
    for klass in classes:
        for name, v in vars(klass).items():
            fn = v.fget if isinstance(v, property) else getattr(v, "__func__", v)
            if _user_function(fn):
                methods.setdefault(name, []).append(fn)
    done: set[Any] = set()
    stateless: dict[str, None] = {}  # global modules without state: named in a warning
    codes = 0
    while work and codes < _MAX_CODES:
        fn = work.pop()
        if fn in done:
            continue
        done.add(fn)
        stack = [fn.__code__]
        while stack and codes < _MAX_CODES:
            code = stack.pop()
            codes += 1
            stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
            for name in code.co_names:  # a method of the tree's classes it may call (self.helper(x))
                work.extend(methods.get(name, ()))
            g = fn.__globals__
            for name, attr in _globals_read(code):
                if name not in g:
                    continue
                v, shown = g[name], name
                if isinstance(v, types.ModuleType) and attr is not None:  # cfgmod.PROJ
                    home = getattr(v, "__file__", None) or ""
                    if not home or not is_user_file(home, skip_stdlib=True) or "-packages" in home:
                        continue
                    v, shown = vars(v).get(attr), f"{name}.{attr}"
                if _user_function(v):
                    work.append(v)
                    continue
                what = _stateful(v)
                if what is None:
                    if isinstance(v, nn.Module):
                        stateless.setdefault(f"{g.get('__name__')}.{shown}", None)
                    continue
                line = _line(code, name)
                raise UnsupportedOperationError(
                    f"wide_compiler: the members' code reads the module global {g.get('__name__')}.{shown}, "
                    f"{what}, in {code.co_qualname} ({code.co_filename}:{line}). Every member would share it, "
                    f"and it is no member's state: the wide model would bake its values into the graph, give "
                    f"it no gradient and not see later changes to it (Note [A module held as a global]). "
                    f"What to do: make it a submodule (or parameter) of each member (self.proj = nn.Linear(...) "
                    f"in __init__), or pass it to forward as an input")
    if stateless:
        log.warning("wide_compiler: the members' code reads the module global(s) %s, nn.Module(s) without "
                    "parameters or buffers: their attributes are read as they are at capture, and a change to "
                    "them after compiling is not seen (Note [A module held as a global])", ", ".join(stateless))
