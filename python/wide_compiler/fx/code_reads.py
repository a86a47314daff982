"""The scan of the code a forward reaches (Note [State a forward reads] in fx/state_reads.py): the
bytecode (``dis``) of the members' forwards, their base classes', decorators', helpers', hooks' and
torch's global module hooks', read for the module globals, class attributes, closure variables,
environment variables and flag readers the code reads (:func:`globals_read`), the state it writes
itself (``_written_into``: left unguarded), and the warning naming what no guard can follow
(:func:`warn_unguarded`). What is found is kept as fx/state_reads.py keeps it.
"""

from __future__ import annotations

import dis
import functools
import importlib.util
import inspect
import logging
import os
import sys
import types
from collections.abc import Sequence
from typing import Any

import torch

from .state_reads import (_CELL, _ENVIRON, _FUNCTIONS, _GRAD_READERS, FLAG_READERS, MAX_CONTENTS, Contents, FunctionRef,
                          _kept, _plain, _plain_instance, _values, _where, global_hooks)

__all__ = ["MAX_CODES", "MAX_WATCHED", "globals_read", "warn_unguarded"]

log = logging.getLogger(__name__)

MAX_WATCHED = 128  # module globals and class attributes guarded per graph (Note [State a forward reads])
MAX_CODES = 512  # code objects the scan for them reads per capture


def _users_mutable(v: Any, filename: str) -> bool:
    """A mutable object that code in ``filename`` reads, to be named in a warning when a guard
    cannot read into it: the user's own code (not an installed package's: their registries and
    loggers are theirs) reading a container or an instance of the user's own class."""
    from .source import is_user_file

    if "site-packages" in filename or "dist-packages" in filename:
        return False
    if isinstance(v, (dict, list, set, types.SimpleNamespace)):
        return True
    if type(v).__module__ == "numpy" and type(v).__name__ == "ndarray":  # changed in place, no version to guard
        return True
    if type(v) is tuple:  # one a guard could not keep: holding a tensor or another container
        return not all(_plain(x) or isinstance(x, (type, *_FUNCTIONS)) for x in v)
    home = getattr(sys.modules.get(type(v).__module__), "__file__", None) or ""
    return _plain_instance(v) and bool(home) and is_user_file(home, skip_stdlib=True) and "-packages" not in home


_MUTATORS = frozenset({"append", "extend", "insert", "remove", "pop", "clear", "update", "setdefault", "popitem",
                       "add", "discard", "sort", "reverse", "__setitem__", "__delitem__"})


def _written_into(instructions: list[Any]) -> set[str]:
    """The globals and closure variables the code changes in place, on the line that loads them
    (``STATS["calls"] += 1``, ``CACHE.append(x)``, ``cfg.seen = True``, ``cfgmod.SEEN.append(x)``):
    state the forward keeps, as a name it assigns is (guarding its contents would capture again
    at every call). A line that also writes into another object counts too: that global's
    contents are then left unguarded.

    >>> def forward(x):
    ...     STATS["calls"] += 1
    ...     cfgmod.SEEN.append(x)
    ...     return x * CFG["scale"]
    >>> sorted(_written_into(list(dis.get_instructions(forward))))
    ['SEEN', 'STATS', 'cfgmod']
    """
    out: set[str] = set()
    line: list[Any] = []
    for ins in [*instructions, None]:
        if ins is None or (ins.starts_line and line):
            loaded = [i for i, x in enumerate(line) if x.opname in ("LOAD_GLOBAL", "LOAD_DEREF")
                      and isinstance(x.argval, str)]
            writes = any(x.opname in ("STORE_SUBSCR", "DELETE_SUBSCR", "STORE_ATTR") for x in line)
            for i in loaded:
                names = [line[i].argval]  # the global, and the attributes read of it (``cfgmod.SEEN``)
                j, mutator = i + 1, False
                while j < len(line) and line[j].opname in ("LOAD_ATTR", "LOAD_METHOD"):
                    if line[j].argval in _MUTATORS:
                        mutator = True
                        break
                    names.append(line[j].argval)
                    j += 1
                if writes or mutator:
                    out.update(names)
            line = []
        if ins is not None:
            line.append(ins)
    return out


def globals_read(model: torch.nn.Module) -> tuple[list[tuple[str, str, str, Any]], list[Any], list[str], tuple[str, ...]]:
    """Note [State a forward reads]: the module globals and class attributes that the code of
    ``model``'s module classes reads, with values a guard can keep: ``(entries, owners, readers,
    unguarded)`` (``unguarded``: what it reads that no guard follows, named in a warning),
    ``entries`` as ``Guards.watched``, ``owners`` the live dicts and classes, ``readers`` the
    FLAG_READERS names (and ``is_grad_enabled``, ``is_inference_mode_enabled``) the code holds as
    globals (``from torch import get_default_dtype``), and ``"requires_grad"`` where the code reads
    an attribute of that name (a branch on an input's ``requires_grad``).

    Read statically (``dis``): the ``forward`` of every module in the tree and of each of its base
    classes (``super().forward(x)``, ``Base.forward(self, x)``), the function a decorated forward
    wraps (``__wrapped__``, and the user's functions in a wrapper's closure), the code objects nested
    in it (comprehensions, inner functions), the methods and properties it names (``self.helper(x)``,
    ``self.child.scale_it(h)``, ``super().helper(x)``: a name is looked up on the module's class
    and on every module class of the tree, each of its base classes that defines it), the
    functions the module holds, its hooks and torch's global module hooks, and the functions they
    load as globals (or as attributes of another module of the user's) or find in a registry (a
    dict of functions), transitively (at most ``MAX_CODES`` code objects, ``MAX_WATCHED`` values).
    A name loaded as an attribute (``self.SCALE``, ``mod.K`` in a helper handed the module) counts
    as a class attribute of the module's class when the instance has no attribute of that name,
    and of any other module class of the tree or plain class the code reads (the user's own) that
    defines it: over-guarding a class attribute that never changes costs an ``is`` per call. A
    closure variable the code reads is an entry of its cell (``qualname`` ending ``_CELL``). A name
    the code writes (``STORE_GLOBAL``, ``STORE_ATTR``, ``STORE_DEREF``) is left out: it is state the
    forward keeps, not a setting. The ``forward`` of every module class of the tree and the user's
    methods the code looks up on a class are entries too, by identity (Note [A method patched on
    its class] in fx/state_reads.py).

    >>> EPS = 1e-3
    >>> class Shifted(torch.nn.Module):
    ...     def forward(self, x):
    ...         return x + EPS
    >>> [entry[2:] for entry in globals_read(Shifted())[0]]
    [('forward', <function wide_compiler.fx.code_reads.Shifted.forward>), ('EPS', 0.001)]
    """
    from .source import is_user_file

    entries: dict[tuple[int, str], tuple[tuple[str, str, str, Any], Any]] = {}
    unguarded: dict[tuple[int, str], str] = {}  # mutable values whose contents cannot be guarded
    torch_fns: set[tuple[int, str]] = set()  # entries of torch's functions the user's code reads (``F.gelu``)
    mutated: set[str] = set()  # globals the code changes in place: their contents are state, not settings
    readers: list[str] = []
    stored: set[str] = set()
    reads_grad = False  # the code reads an attribute ``requires_grad`` (of an input, say)
    reader_names = {id(fn): name for name, fn in (*FLAG_READERS.items(), *_GRAD_READERS.items())}
    work: list[tuple[Any, Any]] = []  # (function, the module whose class holds it, or None)

    def user_fn(fn: Any) -> bool:
        return isinstance(fn, types.FunctionType) and is_user_file(fn.__code__.co_filename)

    def cells(fn: Any) -> list[Any]:
        out = []
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                out.append(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
        return out

    def follow(v: Any, m: Any) -> None:
        if isinstance(v, functools.partial):
            v = v.func
        fn = v.fget if isinstance(v, property) else getattr(v, "__func__", v)
        if not isinstance(fn, types.FunctionType) and not isinstance(fn, type) and user_class(type(fn)) \
                and isinstance(getattr(type(fn), "__call__", None), types.FunctionType):
            fn = type(fn).__call__  # a callable object of the user's class (a hook)
        for _ in range(8):  # a decorated function: the wrapper, then each function it wraps
            if user_fn(fn):
                work.append((fn, m))
            elif isinstance(fn, types.FunctionType):  # a library's wrapper (torch.no_grad()): the user's in it
                work.extend((c, m) for c in cells(fn) if user_fn(c))
            fn = vars(fn).get("__wrapped__") if hasattr(fn, "__dict__") else None
            if fn is None:
                break

    user_classes: dict[type, bool] = {}

    def user_class(klass: type) -> bool:
        if klass not in user_classes:
            home = getattr(sys.modules.get(klass.__module__), "__file__", None)
            user_classes[klass] = (is_user_file(home, skip_stdlib=True) and "-packages" not in home) if home else \
                not klass.__module__.startswith(("torch", "wide_compiler", "builtins"))
        return user_classes[klass]

    classes: dict[type, Any] = {}  # one instance of each module class in the tree
    held: list[type] = []  # the classes of the user's plain objects the modules hold
    for hooks in global_hooks():  # torch's global module hooks: code each module's call runs
        for v in list(hooks.values()):
            follow(v, None)
    for m in model.modules():
        classes.setdefault(type(m), m)
        for v in vars(m).values():  # functions held by the instance (self.act = fn)
            if isinstance(v, types.FunctionType):
                follow(v, None)
            elif _plain_instance(v) and not isinstance(v, types.SimpleNamespace):
                held.append(type(v))  # an object of the user's it holds: its class's attributes and methods
        for hooks in (m._forward_pre_hooks, m._forward_hooks, m._backward_pre_hooks, m._backward_hooks):
            for v in list(hooks.values()):  # its hooks: code its call runs, read like a helper (``mod.K``:
                follow(v, None)  # looked up on the tree's module classes, as every attribute name is)
        for klass in type(m).__mro__:  # its forward and its base classes' (super().forward(x))
            if "forward" in vars(klass):
                follow(vars(klass)["forward"], m)
    work.reverse()  # the outermost module's forward first

    def method(cls: type, name: str) -> None:
        """Note [A method patched on its class]: the function ``cls.name`` is now, guarded by identity
        (a plain function or a static method's; a class method or property is followed, not guarded)."""
        try:
            fn = getattr(cls, name)
            again = getattr(cls, name)
        except AttributeError:  # a descriptor that raises on the class
            return
        if isinstance(fn, types.FunctionType) and fn is again:  # not made anew per lookup (a partialmethod)
            entries.setdefault((id(cls), name), ((cls.__module__, cls.__qualname__, name, FunctionRef(fn)), cls))

    def attribute(cls: type, name: str, v: Any, code: types.CodeType, m: Any) -> None:
        """A class attribute ``v`` of ``cls`` the code reads: guarded, named as unguarded, or followed."""
        if isinstance(v, (types.FunctionType, staticmethod, classmethod, property)):
            follow(v, m)  # a method or property that the code calls
            definer = next((k for k in cls.__mro__ if name in vars(k)), None)
            if definer is not None and user_class(definer) and isinstance(v, (types.FunctionType, staticmethod)):
                method(cls, name)  # the user's method: its identity (Note [A method patched on its class])
            return
        kept = _kept(v)
        if kept is not None:
            entries.setdefault((id(cls), name), ((cls.__module__, cls.__qualname__, name, kept), cls))
            for x in _values(kept) if isinstance(kept, Contents) else ():  # a registry of functions: their code
                if isinstance(x, FunctionRef):
                    follow(x.fn, None)
        elif _users_mutable(v, code.co_filename if code is not None else ""):
            unguarded.setdefault((id(cls), name), f"{cls.__qualname__}.{name}")

    def on_class(cls: type, rep: Any, name: str, code: types.CodeType) -> None:
        """``name`` read as an attribute, looked up on ``cls`` (the user's) and its base classes."""
        definers = [k for k in cls.__mro__ if name in vars(k)]
        if not definers or not user_class(definers[0]):
            return
        attribute(cls, name, vars(definers[0])[name], code, rep)
        for k in definers[1:]:  # super().name: a base class's method
            v = vars(k)[name]
            if user_class(k) and isinstance(v, (types.FunctionType, staticmethod, classmethod, property)):
                follow(v, rep)
                if isinstance(v, (types.FunctionType, staticmethod)):
                    method(k, name)  # Note [A method patched on its class]

    def on_classes(name: str, code: types.CodeType) -> None:
        """``name`` read as an attribute: on every module class of the tree and every plain class
        the code reads (the user's) defining it."""
        for cls, rep in [*classes.items(), *plain_classes.items()]:
            on_class(cls, rep, name, code)

    plain_classes: dict[type, None] = {}  # the user's plain (non-module) classes the code reads: namespaces

    def plain_class(cls: type, code: types.CodeType | None) -> None:
        """A user's plain class the code reads (``Cfg.K``, ``Helper.scale(h)``): its attributes of
        every name read as an attribute anywhere are guarded (or followed) like a module class's."""
        if cls in plain_classes or cls in classes or not user_class(cls):
            return
        plain_classes[cls] = None
        for name in list(names_seen):
            on_class(cls, None, name, code)

    def read_environ(v: Any, code: types.CodeType, instructions: list[Any], i: int, start: int | None = None) -> None:
        """Instruction ``i`` loads ``os.environ`` or ``os.getenv`` (``v``): the key the code reads of it
        (``os.environ["K"]``, ``os.environ.get("K")``, ``"K" in os.environ``, ``os.getenv("K")``) is
        guarded by its value (None where unset); any other read of it is named as unguarded."""
        if "-packages" in code.co_filename:
            return
        nxt = instructions[i + 1: i + 4]
        ops = [x.opname for x in nxt]
        key: Any = None
        if v is os.getenv and ops[:1] == ["LOAD_CONST"]:
            key = nxt[0].argval
        elif v is os.environ and ops[:2] == ["LOAD_CONST", "BINARY_SUBSCR"]:
            key = nxt[0].argval
        elif v is os.environ and ops[:1] in (["LOAD_ATTR"], ["LOAD_METHOD"]) and nxt[0].argval == "get" \
                and ops[1:2] == ["LOAD_CONST"]:
            key = nxt[1].argval
        elif v is os.environ and ops[:1] == ["CONTAINS_OP"] and (start := i if start is None else start) \
                and instructions[start - 1].opname == "LOAD_CONST":  # before the load of os (or environ)
            key = instructions[start - 1].argval
        if isinstance(key, str):
            entries.setdefault((id(os.environ), key), (("os", _ENVIRON, key, os.environ.get(key)), os.environ))
        else:  # handed on, iterated, a key computed at run time: not read statically
            line = instructions[i].positions.lineno if instructions[i].positions else "?"
            unguarded.setdefault((id(code), "environ"), f"os.environ other than by a constant key in "
                                 f"{code.co_qualname} ({code.co_filename}:{line})")

    def read_module_attr(g: dict, name: str, v: Any, code: types.CodeType, instructions: list[Any], i: int) -> None:
        """Instruction ``i`` loads the module ``v`` (bound to ``name``): an attribute read of it at
        once is a global of that module (the user's); ``os.environ`` and ``sys.modules["m"]`` are
        followed; a module of the user's handed on is named as unguarded."""
        after = instructions[i + 1] if i + 1 < len(instructions) else None
        attr = after.argval if after is not None and after.opname in ("LOAD_ATTR", "LOAD_METHOD") else None
        if v is os and attr in ("environ", "getenv"):  # Note [State a forward reads]: an environment variable
            read_environ(getattr(os, attr), code, instructions, i + 1, i)
            return
        if v is sys and attr == "modules" and [x.opname for x in instructions[i + 2: i + 4]] == \
                ["LOAD_CONST", "BINARY_SUBSCR"] and isinstance(instructions[i + 2].argval, str):
            held = sys.modules.get(instructions[i + 2].argval)  # sys.modules["cfgmod"].X: cfgmod's global
            if isinstance(held, types.ModuleType):
                read_module_attr(g, f"sys.modules[{instructions[i + 2].argval!r}]", held, code, instructions, i + 3)
            return
        if (v.__name__ == "torch" or v.__name__.startswith("torch.")) and attr is not None \
                and "-packages" not in code.co_filename and isinstance(vars(v).get(attr), _FUNCTIONS) \
                and attr not in FLAG_READERS and attr not in _GRAD_READERS:
            # ``F.gelu(h)`` in the user's code: torch's function as it is now (one rebound, a patch of
            # the user's, fails the guard); after the user's own reads when MAX_WATCHED cuts
            entries.setdefault((id(vars(v)), attr), ((v.__name__, "", attr, FunctionRef(vars(v)[attr])), vars(v)))
            torch_fns.add((id(vars(v)), attr))
            return
        home = getattr(v, "__file__", None) or ""
        if not home or not is_user_file(home, skip_stdlib=True) or "-packages" in home \
                or "-packages" in code.co_filename:
            return
        if attr is not None and attr in vars(v):
            read_global(vars(v), attr, vars(v)[attr], code, instructions, i + 1)
        else:  # handed on, or an attribute it lacks now: what is read of it is not seen
            unguarded.setdefault((id(g), name), f"{g.get('__name__')}.{name} (a module: other than as "
                                 f"{name}.NAME)")

    def read_import(g: dict, code: types.CodeType, instructions: list[Any], i: int, aliases: dict) -> None:
        """``import m as c`` or ``from m import X`` inside the code (IMPORT_NAME at ``i``): ``X`` is
        read as ``m``'s global; a name bound to a module is remembered (``aliases``), so ``c.X`` is."""
        level = instructions[i - 2].argval if i >= 2 and instructions[i - 2].opname == "LOAD_CONST" else 0
        full = instructions[i].argval
        try:
            full = importlib.util.resolve_name("." * level + full, g.get("__package__")) if level else full
        except (ImportError, ValueError):
            return
        mod = sys.modules.get(full)
        if not isinstance(mod, types.ModuleType):
            return
        j = i + 1
        if j < len(instructions) and instructions[j].opname in ("STORE_FAST", "STORE_NAME"):
            aliases[instructions[j].argval] = sys.modules.get(full.partition(".")[0])  # ``import a.b`` binds a
        while j < len(instructions) and instructions[j].opname == "IMPORT_FROM":
            attr = instructions[j].argval
            v = vars(mod).get(attr, sys.modules.get(f"{full}.{attr}"))
            target = instructions[j + 1] if j + 1 < len(instructions) else None
            if isinstance(v, types.ModuleType):
                if target is not None and target.opname in ("STORE_FAST", "STORE_NAME"):
                    aliases[target.argval] = v
            elif attr in vars(mod):
                home = getattr(mod, "__file__", None) or ""
                if home and is_user_file(home, skip_stdlib=True) and "-packages" not in home:
                    read_global(vars(mod), attr, v, code, instructions, j)
            j += 2

    def read_global(g: dict, name: str, v: Any, code: types.CodeType, instructions: list[Any], i: int) -> None:
        """The value ``v`` of global ``name`` of the namespace ``g`` that instruction ``i`` loads."""
        if v is os.environ or v is os.getenv:  # ``from os import environ``
            read_environ(v, code, instructions, i)
            return
        if isinstance(v, types.ModuleType):  # a module of the user's: the attributes the code reads of it
            read_module_attr(g, name, v, code, instructions, i)
            return
        if isinstance(v, type):
            if issubclass(v, torch.autograd.Function) and user_class(v):  # ``F.apply(h)``: its forward runs
                for part in ("forward", "setup_context"):
                    if part in vars(v):
                        follow(vars(v)[part], None)
            if not issubclass(v, (torch.nn.Module, torch.Tensor, BaseException)):
                plain_class(v, code)
            return
        if _plain_instance(v) and not isinstance(v, types.SimpleNamespace):
            plain_class(type(v), code)  # its class attributes (``OBJ.K`` where OBJ has no K of its own)
        kept = _kept(v)
        if isinstance(kept, Contents) and "-packages" in code.co_filename and any(
                isinstance(x, FunctionRef) for x in _values(kept)):
            kept = None  # an installed package's registry of functions (its loss functions): its own
        if kept is not None:
            entries.setdefault((id(g), name), ((str(g.get("__name__")), "", name, kept), g))
            if isinstance(kept, FunctionRef):  # a global function: its identity and its code
                follow(v, None)
            elif isinstance(kept, Contents):  # a registry of functions: their code
                for x in _values(kept):
                    if isinstance(x, FunctionRef):
                        follow(x.fn, None)
        elif isinstance(v, functools.partial):
            follow(v, None)  # not guarded itself (named in the warning), but the code it runs is read
            unguarded.setdefault((id(g), name), f"{g.get('__name__')}.{name}")
        elif _users_mutable(v, code.co_filename):
            unguarded.setdefault((id(g), name), f"{g.get('__name__')}.{name}")

    def read_cell(fn: Any, name: str, code: types.CodeType) -> None:
        """The closure variable ``name`` of ``fn`` (a value of the function that made it): guarded
        by its cell's contents; a function there is followed (a decorator's wrapped function)."""
        freevars = fn.__code__.co_freevars
        if name not in freevars or fn.__closure__ is None:
            return
        cell = fn.__closure__[freevars.index(name)]
        try:
            v = cell.cell_contents
        except ValueError:  # an empty cell
            return
        if isinstance(v, _FUNCTIONS) or isinstance(v, (torch.nn.Module, type)):
            return  # a function: followed (cells()); a module or class: not a value the code branches on
        kept = _kept(v)
        where = (str(fn.__module__), fn.__qualname__ + _CELL, name)
        if kept is not None:
            entries.setdefault((id(cell), name), ((*where, kept), cell))
        elif _users_mutable(v, code.co_filename):
            unguarded.setdefault((id(cell), name), _where(*where))

    for cls, rep in classes.items():  # every module class's forward, torch's too (Note [A method patched on
        # its class]), but a container's (nn.ModuleList: Module.forward) and one the instance overrides
        if "forward" not in vars(rep) and getattr(cls, "forward", None) is not torch.nn.Module.forward:
            method(cls, "forward")
    seen: set[tuple[Any, Any]] = set()  # (code, the module's class): instances of a class read the same names
    done: set[tuple[Any, type]] = set()  # (function, reading class) read already
    names_seen: set[str] = set()  # attribute names looked up on every module class already
    for cls in held:
        plain_class(cls, None)
    codes = 0
    while work:
        fn, m = work.pop()
        if (fn, type(m)) in done:
            continue
        done.add((fn, type(m)))
        stack: list[tuple[types.CodeType, frozenset]] = [(fn.__code__, frozenset())]
        work.extend((c, m) for c in cells(fn) if user_fn(c))  # a decorator's wrapper: the function it calls
        while stack:
            # with the names local to the code between fn's and this one (not fn's closure variables)
            code, shadowed = stack.pop()
            if (code, type(m)) in seen:
                continue
            seen.add((code, type(m)))
            codes += 1
            if codes > MAX_CODES:
                log.debug("wide_compiler: more than %d code objects in the members' classes: the globals the "
                          "rest read are not guarded", MAX_CODES)
                work.clear()
                break
            inner = shadowed | set(code.co_cellvars) | set(code.co_varnames)
            stack.extend((c, inner) for c in code.co_consts if isinstance(c, types.CodeType))
            g = fn.__globals__
            instructions = list(dis.get_instructions(code))
            aliases: dict[str, Any] = {}  # local names an import in the code binds to a module
            mutated.update(_written_into(instructions))
            for i, ins in enumerate(instructions):
                name = ins.argval
                if ins.opname == "LOAD_FAST_LOAD_FAST":  # 3.13: two locals at once, the second on top
                    first, second = name
                    if isinstance(aliases.get(first), types.ModuleType):  # handed on, not read from
                        read_global(g, first, aliases[first], code, [ins, ins], 0)
                    if isinstance(aliases.get(second), types.ModuleType):
                        read_global(g, second, aliases[second], code, instructions, i)
                    continue
                if not isinstance(name, str):
                    continue
                if ins.opname in ("STORE_GLOBAL", "STORE_ATTR", "DELETE_GLOBAL", "DELETE_ATTR"):
                    stored.add(name)
                elif ins.opname in ("STORE_DEREF", "DELETE_DEREF") and name in code.co_freevars:
                    stored.add(name)  # ``nonlocal calls; calls += 1``: state the code keeps
                elif ins.opname == "IMPORT_NAME" and "-packages" not in code.co_filename:
                    read_import(g, code, instructions, i, aliases)  # ``import cfgmod as c``, ``from cfgmod import X``
                elif ins.opname in ("LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_NAME") \
                        and isinstance(aliases.get(name), types.ModuleType):
                    read_global(g, name, aliases[name], code, instructions, i)
                elif ins.opname == "LOAD_DEREF" and name in code.co_freevars and name not in shadowed:
                    read_cell(fn, name, code)
                elif ins.opname == "LOAD_GLOBAL" and name in ("globals", "vars") and name not in g \
                        and "-packages" not in code.co_filename:  # globals()["NAME"]: not read statically
                    unguarded.setdefault((id(code), name), f"{name}() in {code.co_qualname} "
                                         f"({code.co_filename}:{ins.positions.lineno if ins.positions else '?'})")
                elif ins.opname == "LOAD_GLOBAL" and name in g:
                    v = g[name]
                    if id(v) in reader_names:
                        if reader_names[id(v)] not in readers:
                            readers.append(reader_names[id(v)])
                        continue
                    read_global(g, name, v, code, instructions, i)
                elif ins.opname in ("LOAD_ATTR", "LOAD_METHOD"):
                    reads_grad = reads_grad or name == "requires_grad"
                    if m is not None and name not in m.__dict__ and name not in m._parameters \
                            and name not in m._buffers and name not in m._modules:
                        try:
                            attribute(type(m), name, inspect.getattr_static(type(m), name), code, m)
                        except AttributeError:
                            pass
                        for k in type(m).__mro__[1:]:  # super().name: a base class's method
                            v = vars(k).get(name)
                            if isinstance(v, (types.FunctionType, staticmethod, classmethod, property)):
                                follow(v, m)
                                if isinstance(v, (types.FunctionType, staticmethod)) and user_class(k):
                                    method(k, name)  # Note [A method patched on its class]
                    if name not in names_seen:
                        names_seen.add(name)
                        on_classes(name, code)
    # a name the code itself writes (``global CALLS; CALLS += 1``, ``type(self).seen = True``) is state
    # the forward keeps, not a setting: guarding it would capture again at every call
    found = [(e, o) for key, (e, o) in sorted(entries.items(), key=lambda kv: kv[0] in torch_fns)
             if key[1] not in stored and not (isinstance(e[3], Contents) and key[1] in mutated)]
    missed = [where for (_, name), where in unguarded.items() if name not in stored and name not in mutated]
    warn_unguarded(missed)
    if len(found) > MAX_WATCHED:
        log.warning("wide_compiler: the members' code reads %d module globals and class attributes; the first %d "
                    "are guarded (Note [State a forward reads])", len(found), MAX_WATCHED)
        found = found[:MAX_WATCHED]
    if reads_grad:
        readers.append("requires_grad")
    return [e for e, _ in found], [o for _, o in found], readers, tuple(missed)


def warn_unguarded(missed: Sequence[str], cached: str = "") -> None:
    """The warning at capture naming what the members' code reads that no guard follows (Note
    [State a forward reads]); given again for a graph loaded from the compile cache (``cached``: its
    entry), whose guards keep the names (``Guards.unguarded``)."""
    if missed:
        log.warning("wide_compiler: the members' code reads %s, mutable and holding more than %d values or values "
                    "that are not plain (numbers, strings, tuples of them, functions): a change to %s after "
                    "compiling is not seen by the compiled graphs (Note [State a forward reads]); compile again "
                    "after changing it%s", ", ".join(missed), MAX_CONTENTS, "it" if len(missed) == 1 else "them",
                    f" (a graph loaded from the compile cache {cached})" if cached else "")
