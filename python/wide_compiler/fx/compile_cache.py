"""The persistent compile cache: a compiled graph of each train/eval mode kept on disk, so that a
second compile of the same model, in this process or a new one, skips capture and widening.

Note [The compile cache]
~~~~~~~~~~~~~~~~~~~~~~~~
What is stored. The result of the pipeline (fx/pipeline.py) for one mode, everything
:class:`~wide_compiler.WideModel` keeps per graph: the wide graph with its chosen strategies
(``strategy`` kwargs), its layout conversions and eval rewrites as they are in the graph, its
member tile (the tiled graph module too), its :class:`~wide_compiler.fx.guards.Guards`, the
per-member constant plan (Note [Per-member constants] in fx/constants.py, whose table the model
checks at each call), the lifted constants of the capture, the narrow size ranges export found
(``WideModel._ranges``), the measured timings, the layout counts and the folds, and the stacked
shape every parameter and buffer input must have. The members' tensors are NOT stored: the
stacked state is built from the members at every compile (``stack_state``), as without the cache.

How a graph is stored. An ``fx.GraphModule`` pickles by regenerating its code, which loses node
metadata, and its nodes are a linked list that plain pickling walks recursively. So each graph is
written as a table of nodes (op, name, target, arguments with nodes named, metadata) and rebuilt
node by node (names kept, so ``strategies``, ``summary()`` and ``keep_strategies`` see what a fresh
compile gives), recursively for the bodies of higher-order regions (``wrap_with_set_grad_enabled``,
``wrap_with_autocast``: fx/rules/regions.py's ``Region``) and the tiled graph. Operators are stored
by name (``torch.ops.<ns>.<op>.<overload>``, ``torch.ops.higher_order.<name>``) and looked up at
load, so the ``wide`` ops of the running extension are the ones called. Metadata kept: every
``wide_*`` key, ``stack_trace`` (the user's source line in error messages and the fallback
report) and ``nn_module_stack`` (module paths; the classes as their names); the fake values
(``val``, ``tensor_meta``) are dropped: nothing reads them after compiling. A tuning spec's
``make`` (a closure measuring the op) is replaced by a stub that refuses to run: a cached graph
is never measured again (its picks are final; a recapture measures nothing either). A graph whose
pickling fails (an object that does not pickle: a lambda in a registered form...) is simply not
cached (logged at DEBUG).

The key (:func:`key_parts`) holds everything the compiled program depends on:
- ``code``: the code of every module class in the captured tree that is not torch's (its
  methods' code objects, constants and names, recursively; the closures and defaults; the values
  of module-level globals those functions read, following functions and classes they call, a few
  levels deep; an attribute read from a global module or object, ``cfg.SCALE``, by its value;
  objects held by globals otherwise by their class; the standard library, torch and
  wide_compiler by their versions), and every hook on those modules;
- ``model``: the module tree (paths, classes, training flags, every other attribute's value, as
  the member check compares them), parameter and buffer names, shapes, dtypes, devices and
  ``requires_grad``; the wide state's dtype and device;
- ``inputs``: the sample's structure, tensor shapes, dtypes, devices, ``requires_grad`` and
  contiguity, its non-tensor values (baked in); ``dynamic_shapes``, the dims made dynamic by
  earlier calls, the grad mode of the capture;
- ``n``, the train/eval mode, the registered wide forms (their classes' code), the
  :class:`~wide_compiler.WideConfig` fields the program depends on (all but ``cache``,
  ``cache_dir``, ``compile_cache``, ``validate``, ``rtol``, ``atol``);
- ``constants``: every member's per-member constants (``constant_key`` of each value);
- ``versions``: Python, torch, wide_compiler's version AND a digest of its Python sources (an
  editable install changes without a version bump), the built extension (path, size, mtime), this
  file's format number;
- ``machine``: the processor (:func:`wide_compiler.measure.hardware`: CPU model and the
  instruction set torch uses, or the GPU), torch's thread count (strategies are measured with
  it), the default dtype.
Values computed at run time outside the module tree and read indirectly by the forward (an
attribute of an imported module set after import, a file read in ``forward``) are not in the
key; ``WideConfig(compile_cache=False)`` or ``WIDE_COMPILE_CACHE=0`` compiles afresh.

``members``: the same digest of every other member (attributes with their values, closures,
hooks, parameter structure), at the first compile. It is why a hit skips the ``run_members``
check (each member run once, its ATen ops compared with member 0's, the slowest step of a hit:
7 s of ResNet-18's 8 s, 4 members, busy machine): what it compares is a function of what this
digest holds. The members' classes are one (``check_members``), so their code and globals are
member 0's; a member's forward can only differ through its own attributes (closures, callables,
objects held), all digested here; and a branch on tensor values, the one other way, fails the
capture of member 0 (export refuses data-dependent control flow). So members of these digests
ran the check when the entry was made (it is stored only after every pass succeeded, with
``run_members`` in the config part), with the outcome it would have now.

What a hit still does (pipeline.run_cached): ``check_members`` (which compares the members' module
trees and finds the per-member constants the key holds), the stacked state, and a check that the
loaded graph fits it: every parameter and buffer input is in the state with the stacked shape, dtype and
``requires_grad`` the graph was compiled for, the sample flattens as the graph's inputs, and the
per-member constants are those of the plan. A failure there is a stale entry: it is ignored
(logged once) and the model compiled afresh. ``trace_members=True`` bypasses the cache (it asks
for every member to be exported). A graph whose ops the tuning budget left unmeasured is not
stored: a later compile measures them (the ones measured are in the strategy cache, so each
compile gets further), then stores it. (A model-level check or member-tile trial cut short by
the budget keeps the defaults: that graph is stored as it is.)

Files. ``<cache_dir>/compiled/<key>.widecc`` (the strategy cache's directory,
``WideConfig.cache_dir`` / ``$WIDE_COMPILER_CACHE_DIR``), written atomically (_files.py). A file
is a magic line, a JSON header (format, versions, key, length and SHA-256 of the body) and the
pickled body. A file that is truncated, corrupt (digest), of another format or version, or whose
body does not load is ignored with one WARNING and replaced by the next store. The body is a
pickle: keep the cache directory as private as torch's own caches (``~/.cache``); never point
it at files others can write.
"""

from __future__ import annotations

import dataclasses
import dis
import functools
import hashlib
import io
import json
import logging
import os
import pickle
import sys
import types
import warnings
import weakref
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten

from .._files import atomic_write, ensure_directory
from .._version import __version__
from ..config import WideConfig
from ..measure import hardware
from .context import TuneSpec
from .guards import Guards
from .widen import GraphInput, WideGraph

__all__ = ["ENV", "CachedCapture", "enabled", "entry_path", "key_of", "key_parts", "load", "store"]

log = logging.getLogger(__name__)

ENV = "WIDE_COMPILE_CACHE"  # "0" turns the compile cache off
FORMAT = 1  # raised when what an entry holds changes: older entries are then foreign
_MAGIC = b"wide_compiler compile cache\n"
_SUBDIR = "compiled"
_SUFFIX = ".widecc"
# WideConfig fields that do not change the compiled program
_CONFIG_IGNORED = frozenset({"cache", "cache_dir", "compile_cache", "validate", "rtol", "atol"})
_DEPTH = 3  # how deep the code digest follows functions and classes a forward reads


def enabled(config: WideConfig) -> bool:
    """Whether compiles with ``config`` use the compile cache: ``config.compile_cache`` and
    ``config.cache`` on, ``$WIDE_COMPILE_CACHE`` not ``0``, and not ``trace_members``.

    >>> from wide_compiler import WideConfig
    >>> enabled(WideConfig(compile_cache=False)), enabled(WideConfig.debug())
    (False, False)
    """
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return bool(getattr(config, "compile_cache", True) and config.cache and not config.trace_members)


@dataclasses.dataclass
class CachedCapture:
    """What the model reads of a capture when the graph came from the cache (the capture itself,
    an ``ExportedProgram``, is not stored): ``constants`` as ``ExportedProgram.constants`` (the
    lifted constant tensors by name), ``ranges`` as ``model_inputs._narrow_ranges`` gives them."""

    constants: dict[str, torch.Tensor]
    ranges: dict[str, tuple]
    path: str = ""


# --- the key -----------------------------------------------------------------------------------


class _Digest:
    """The SHA-256 of a sequence of tokens (their reprs), with a memo against cycles."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.seen: dict[int, int] = {}

    def add(self, *tokens: Any) -> None:
        self.parts.extend(map(repr, tokens))

    def hexdigest(self) -> str:
        return hashlib.sha256("\x1f".join(self.parts).encode()).hexdigest()


def _torch_owned(obj: Any) -> bool:
    """Objects of torch and the standard library: their code is keyed by the versions."""
    mod = getattr(obj, "__module__", None) or ""
    parts = mod.split(".")
    if parts[0] == "wide_compiler":  # the compiler's own code is in the source digest; the zoo's is not
        return len(parts) > 1 and parts[1] not in _ABOVE_THE_COMPILER
    top = parts[0]
    return top in ("torch", "builtins", "typing", "collections", "functools", "abc", "enum", "math",
                   "operator", "itertools", "dataclasses", "numbers", "contextlib", "copy", "warnings",
                   "inspect", "re", "types") and _lives_in(obj, mod)


def _lives_in(obj: Any, module: str) -> bool:
    """Whether ``obj`` is what its module holds under its qualified name: a class made by ``exec``
    in a namespace without ``__name__`` says it is ``builtins``' (generated code, the model
    fuzzer's programs), and its code is the user's, to be keyed."""
    target = sys.modules.get(module)
    for part in (getattr(obj, "__qualname__", None) or "").split("."):
        if target is None or part == "<locals>":
            return False
        target = getattr(target, part, None)
    return target is obj


@functools.lru_cache(maxsize=8192)
def _code_text(code: types.CodeType) -> str:
    """The digest of a code object and the code objects nested in it (its bytecode, constants,
    names), and the globals they read."""
    d = _Digest()
    d.add("code", code.co_name, code.co_code, code.co_names, code.co_argcount, code.co_kwonlyargcount,
          code.co_flags)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            d.add(_code_text(c))
        else:
            d.add(type(c).__name__, _constant(c))
    return d.hexdigest()


def _constant(c: Any) -> Any:
    """A code constant as a token that is the same in every process: a frozenset (``x in {"a",
    "b"}``) repr's in the order of its strings' hashes, which differ by process (PYTHONHASHSEED)."""
    if isinstance(c, frozenset):
        return ("frozenset", sorted(repr(_constant(x)) for x in c))
    if isinstance(c, tuple):
        return tuple(_constant(x) for x in c)
    return c


def _nested_globals(code: types.CodeType) -> list[tuple[str, str | None]]:
    out = list(_globals_read(code))
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            out.extend(_nested_globals(c))
    return out


def _code(d: _Digest, code: types.CodeType, globs: dict | None, depth: int) -> None:
    d.add(_code_text(code))
    if globs is None:
        return
    for name, attr in dict.fromkeys(_nested_globals(code)):  # the module-level values the code reads
        if name not in globs:
            continue
        value = globs[name]
        d.add("global", name)
        if attr is not None and (isinstance(value, types.ModuleType) and not _library_module(value)
                                 or _plain_object(value)):
            d.add("attr", attr)  # ``cfg.SCALE`` of a user's module or object: the attribute's value
            value = getattr(value, attr, None)
        _value(d, value, depth - 1, code_only=True)


def _plain_object(v: Any) -> bool:
    """An instance of an ordinary class (not a module, function, class, container or scalar)."""
    return hasattr(v, "__dict__") and not isinstance(
        v, (types.ModuleType, type, types.FunctionType, types.MethodType, functools.partial, nn.Module))


def _library_module(module: types.ModuleType) -> bool:
    """The standard library's modules, torch's and wide_compiler's: their attributes are keyed by
    the versions (``sys.modules`` read through ``sys`` is no part of a program)."""
    top = module.__name__.split(".")[0]
    return top in sys.stdlib_module_names or top in ("torch", "wide_compiler", "builtins", "numpy")


@functools.lru_cache(maxsize=4096)
def _globals_read(code: types.CodeType) -> tuple[tuple[str, str | None], ...]:
    """(global name, the attribute read right after it or None) of every global load in ``code``
    (not its nested code objects: those are read on their own). Read from the raw bytecode
    (:func:`_globals_read_fast`) where this Python's layout is known, else through ``dis``."""
    fast = _globals_read_fast(code) if _FAST_SCAN else None
    return fast if fast is not None else _globals_read_dis(code)


def _globals_read_dis(code: types.CodeType) -> tuple[tuple[str, str | None], ...]:
    """:func:`_globals_read` through ``dis.get_instructions`` (an Instruction object per
    instruction, and the jump labels: 1.2 ms per function, most of a warm key's time)."""
    out: list[tuple[str, str | None]] = []
    instructions = list(dis.get_instructions(code))
    for i, ins in enumerate(instructions):
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            nxt = instructions[i + 1] if i + 1 < len(instructions) else None
            attr = nxt.argval if nxt is not None and nxt.opname in ("LOAD_ATTR", "LOAD_METHOD") else None
            out.append((ins.argval, attr if isinstance(attr, str) else None))
    return tuple(dict.fromkeys(out))


# How a name's index sits in the oparg (Python 3.11 put a flag in LOAD_GLOBAL's low bit, 3.12 in
# LOAD_ATTR's); opcodes this Python lacks are absent.
_NAME_SHIFT = {op: shift for op, shift in (
    ("LOAD_GLOBAL", 1 if sys.version_info >= (3, 11) else 0), ("LOAD_NAME", 0),
    ("LOAD_ATTR", 1 if sys.version_info >= (3, 12) else 0), ("LOAD_METHOD", 0)) if op in dis.opmap}
_LOADS = {dis.opmap[op] for op in ("LOAD_GLOBAL", "LOAD_NAME") if op in dis.opmap}
_ATTRS = {dis.opmap[op] for op in ("LOAD_ATTR", "LOAD_METHOD") if op in dis.opmap}
_SHIFT = {dis.opmap[op]: shift for op, shift in _NAME_SHIFT.items()}
_FAST_SCAN = hasattr(dis, "_unpack_opargs") and (3, 10) <= sys.version_info < (3, 13)  # 3.13 yields 4-tuples


def _globals_read_fast(code: types.CodeType) -> tuple[tuple[str, str | None], ...] | None:
    """:func:`_globals_read_dis`'s answer from ``dis._unpack_opargs`` (the (offset, opcode, oparg)
    walk ``dis`` itself makes, without building instructions): the same pairs, the next
    instruction being the next one ``dis`` lists (EXTENDED_ARG included, inline caches not); a
    test compares the two on every function of torch's and the zoo's modules. None when the
    walk does not fit (the caller then uses ``dis``)."""
    try:
        ops = [(op, arg) for _, op, arg in dis._unpack_opargs(code.co_code)]
        names = code.co_names
        out: list[tuple[str, str | None]] = []
        for i, (op, arg) in enumerate(ops):
            if op in _LOADS:
                name = names[arg >> _SHIFT[op]]
                attr = None
                if i + 1 < len(ops) and ops[i + 1][0] in _ATTRS:
                    nop, narg = ops[i + 1]
                    attr = names[narg >> _SHIFT[nop]]
                out.append((name, attr))
        return tuple(dict.fromkeys(out))
    except (IndexError, TypeError, ValueError, KeyError):
        return None


def _function(d: _Digest, f: Any, depth: int) -> None:
    f = getattr(f, "__func__", f)
    code = getattr(f, "__code__", None)
    if not isinstance(code, types.CodeType):
        d.add("callable", getattr(f, "__module__", None), getattr(f, "__qualname__", type(f).__qualname__))
        return
    d.add("function", getattr(f, "__module__", None), getattr(f, "__qualname__", None))
    if _torch_owned(f) or depth <= 0:
        return
    if id(f) in d.seen:
        d.add("seen", d.seen[id(f)])
        return
    d.seen[id(f)] = len(d.seen)
    _code(d, code, getattr(f, "__globals__", None), depth)
    cells = []
    for cell in f.__closure__ or ():
        try:
            cells.append(cell.cell_contents)
        except ValueError:
            cells.append(None)
    _value(d, cells, depth - 1)
    _value(d, f.__defaults__, depth - 1)
    _value(d, f.__kwdefaults__, depth - 1)
    _value(d, getattr(f, "__wrapped__", None), depth - 1)


def _class(d: _Digest, cls: type, depth: int) -> None:
    """The code of ``cls`` and of its bases that are not torch's."""
    d.add("class", cls.__module__, cls.__qualname__)
    if depth <= 0:
        return
    for klass in cls.__mro__:
        if _torch_owned(klass) or klass is object:
            continue
        if id(klass) in d.seen:
            d.add("seen", d.seen[id(klass)])
            continue
        d.seen[id(klass)] = len(d.seen)
        d.add("base", klass.__module__, klass.__qualname__)
        for name, v in sorted(vars(klass).items(), key=lambda kv: kv[0]):
            if name in ("__dict__", "__weakref__", "__doc__", "__module__", "__qualname__", "__annotations__"):
                continue
            d.add("attr", name)
            if isinstance(v, property):
                for f in (v.fget, v.fset, v.fdel):
                    if f is not None:
                        _function(d, f, depth)
            elif isinstance(v, (staticmethod, classmethod)):
                _function(d, v.__func__, depth)
            elif isinstance(v, types.FunctionType):
                _function(d, v, depth)
            else:
                _value(d, v, depth - 1, code_only=True)


def _tensor(d: _Digest, t: torch.Tensor, values: bool) -> None:
    d.add("tensor", type(t).__name__, tuple(t.shape), t.dtype, t.device, t.requires_grad)
    if values and not isinstance(t, nn.Parameter) and t.device.type != "meta":
        try:
            d.add(hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest())
        except (RuntimeError, TypeError):
            d.add(t.detach().cpu().tolist())


def _value(d: _Digest, v: Any, depth: int, code_only: bool = False) -> None:
    """A value's identity for the key: what the program could read of it. ``code_only``: a global
    or class attribute (a tensor there counts by value, a module by its class)."""
    if v is None or isinstance(v, (bool, int, float, complex, str, bytes, torch.dtype, torch.device,
                                   torch.layout, torch.memory_format)):
        d.add(type(v).__name__, v)
        return
    if depth < 0:
        d.add("deep", type(v).__qualname__)
        return
    if isinstance(v, weakref.ref):
        _value(d, v(), depth, code_only)
    elif isinstance(v, torch.Tensor):
        _tensor(d, v, values=True)
    elif isinstance(v, fx.GraphModule):  # a program held as an attribute (a padded member's)
        _program(d, v)
    elif isinstance(v, nn.Module):
        d.add("module", type(v).__module__, type(v).__qualname__)  # its own structure is keyed by its path
    elif isinstance(v, types.ModuleType):
        d.add("pymodule", v.__name__)
    elif isinstance(v, type):
        if issubclass(v, nn.Module) or not _torch_owned(v):
            _class(d, v, depth)
        else:
            d.add("type", v.__module__, v.__qualname__)
    elif isinstance(v, (types.FunctionType, types.MethodType, functools.partial, functools.partialmethod)) \
            or hasattr(v, "__code__"):
        if isinstance(v, (functools.partial, functools.partialmethod)):  # a class's forward may be a partialmethod
            d.add(type(v).__name__)
            _function(d, v.func, depth)
            _value(d, (v.args, v.keywords), depth - 1)
        else:
            _function(d, v, depth)
            if isinstance(v, types.MethodType) and not isinstance(v.__self__, nn.Module):
                _value(d, v.__self__, depth - 1)
    elif isinstance(v, (list, tuple, set, frozenset)):
        items = sorted(v, key=repr) if isinstance(v, (set, frozenset)) else v
        d.add(type(v).__name__, len(items))
        for x in items:
            _value(d, x, depth - 1, code_only)
    elif isinstance(v, dict):
        d.add("dict", len(v))
        for k in v:
            d.add(repr(k))
            _value(d, v[k], depth - 1, code_only)
    elif callable(v) and not hasattr(v, "__dict__"):  # builtins, ufuncs
        d.add("callable", getattr(v, "__module__", None), getattr(v, "__qualname__", repr(type(v))))
    else:
        d.add("object", type(v).__module__, type(v).__qualname__)
        if code_only:  # a global object (a logger, a registry): what the code reads of it is keyed by _code
            return
        if not _torch_owned(type(v)):
            _class(d, type(v), depth)
        state = getattr(v, "__dict__", None)
        if state is not None and id(v) not in d.seen:
            d.seen[id(v)] = len(d.seen)
            _value(d, state, depth - 1, code_only)
        elif state is None:
            d.add(repr(v))


def _program(d: _Digest, gm: fx.GraphModule) -> None:
    """A graph module held as a value (not a submodule: its path keys nothing): its generated code
    (the program; its class is generated, the same for every graph), its parameters and persistent
    buffers by structure (the holder passes its own) and any other tensor by value (a lifted
    constant, which the code names but does not hold)."""
    if id(gm) in d.seen:
        d.add("seen", d.seen[id(gm)])
        return
    d.seen[id(gm)] = len(d.seen)
    for path, mod in gm.named_modules():
        d.add("graph", path, mod.code if isinstance(mod, fx.GraphModule) else type(mod).__qualname__)
        for name in sorted(vars(mod)):
            t = vars(mod)[name]
            if isinstance(t, torch.Tensor):
                d.add("tensor", name)
                _tensor(d, t, values=True)
        for name in sorted(mod._buffers):
            d.add("buffer", name)
            if mod._buffers[name] is not None:
                _tensor(d, mod._buffers[name], values=name in mod._non_persistent_buffers_set)
        for name in sorted(mod._parameters):
            d.add("param", name)
            if mod._parameters[name] is not None:
                _tensor(d, mod._parameters[name], values=False)


_INTERNALS = frozenset(nn.Module().__dict__) | {"_compiled_call_impl"}
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
          "_state_dict_hooks", "_load_state_dict_pre_hooks", "_forward_hooks_with_kwargs",
          "_forward_pre_hooks_with_kwargs")


def _module_tree(model: nn.Module, code: bool = True) -> tuple[str, str]:
    """(code, model) digests of the captured module tree (Note [The compile cache]); ``code``
    False: the classes' code is not read (the code digest is then empty)."""
    with_code = code
    code, tree = _Digest(), _Digest()
    classes: set[type] = set()
    for path, mod in model.named_modules(remove_duplicate=False):
        cls = type(mod)
        tree.add("module", path, cls.__module__, cls.__qualname__, mod.training)
        if with_code and cls not in classes:
            classes.add(cls)
            _class(code, cls, _DEPTH)
        for name, p in mod._parameters.items():
            tree.add("param", name)
            if p is not None:
                _tensor(tree, p, values=False)
        for name, b in mod._buffers.items():
            tree.add("buffer", name, name in mod._non_persistent_buffers_set)
            if b is not None:
                _tensor(tree, b, values=False)
        for name in sorted(k for k in vars(mod) if k not in _INTERNALS):
            tree.add("attr", name)
            _value(tree, vars(mod)[name], _DEPTH)
        for hooks in _HOOKS:  # the module's own: with its attributes
            for h in (getattr(mod, hooks, None) or {}).values():
                tree.add("hook", path, hooks)
                _value(tree, h, _DEPTH)
    for hooks in (nn.modules.module._global_forward_hooks, nn.modules.module._global_forward_pre_hooks):
        for h in hooks.values():
            code.add("global hook")
            _value(code, h, _DEPTH)
    return code.hexdigest(), tree.hexdigest()


# The modules of wide_compiler above the compiler (.importlinter: fx imports none of them), whose
# code cannot change a compiled graph: edits there keep the cache's entries
_ABOVE_THE_COMPILER = frozenset({"model", "api", "router", "integrations", "bench", "cli", "__main__", "population",
                                 "padded", "analyze", "zoo", "fuzz", "testing", "_equivalence", "distributed",
                                 "__init__"})


@functools.lru_cache(maxsize=1)
def _project_versions() -> tuple:
    """wide_compiler's version, a digest of its Python sources, and the built extension's
    identity (once per process)."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0].removesuffix(".py") in _ABOVE_THE_COMPILER:
            continue
        try:
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
        except OSError:
            continue
    ext = []
    try:  # the extension and the libraries beside it (libwide: the operators)
        ext_module = sys.modules["wide_compiler._C"]  # loaded by the package (it registers the ops)
        folder = Path(ext_module.__file__).resolve().parent
        for lib in sorted(folder.glob("*.so*")):
            st = lib.stat()
            ext.append((str(lib), st.st_size, st.st_mtime_ns))
    except (KeyError, OSError, AttributeError, TypeError):
        pass
    return __version__, h.hexdigest(), ext


def _versions() -> dict[str, Any]:
    wide, sources, ext = _project_versions()
    return {"format": FORMAT, "python": list(sys.version_info[:2]), "torch": torch.__version__, "wide": wide,
            "sources": sources, "extension": ext}


def _inputs(c: Any) -> str:
    d = _Digest()
    leaves, spec = tree_flatten(c.sample)
    d.add("spec", str(spec))
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            d.add("tensor", tuple(leaf.shape), leaf.dtype, leaf.device, leaf.requires_grad, leaf.layout,
                  leaf.is_contiguous(), leaf.is_contiguous(memory_format=torch.channels_last)
                  if leaf.dim() == 4 else None)
        else:
            _value(d, leaf, _DEPTH)
    shapes = repr(c.dynamic_shapes)
    if " at 0x" in shapes:
        raise _Uncacheable(f"dynamic_shapes has no stable description ({shapes[:80]})")
    d.add("dynamic", shapes, sorted((k, sorted(v)) for k, v in c.extra_dims.items()),
          None if c.exact_dims is None else sorted((k, sorted(v)) for k, v in c.exact_dims.items()),
          c.grad_enabled)
    return d.hexdigest()


class _Uncacheable(Exception):
    """This compilation cannot be cached (and is compiled as without the cache)."""


def key_parts(c: Any) -> dict[str, Any]:
    """The parts of the compile cache key of the compilation ``c`` (a
    :class:`~wide_compiler.fx.pipeline.Compilation` after ``check_members``), by name (Note [The
    compile cache]); raises ``_Uncacheable`` when a part has no stable description."""
    from .constants import constant_key

    code, model = _module_tree(c.model)
    ref = next(c.model.parameters(), None)
    dtype = c.dtype or (ref.dtype if ref is not None else None)
    device = c.device or (ref.device if ref is not None else torch.device("cpu"))
    registered = _Digest()
    for key, path in sorted(c.opaque_paths.items()):
        registered.add(key, path)
    config = {f.name: getattr(c.config, f.name) for f in dataclasses.fields(c.config) if f.name not in _CONFIG_IGNORED}
    constants = {path: [constant_key(v) for v in values] for path, values in sorted((c.constants or {}).items())}
    others = _Digest()
    for m in (c.members or [])[1:]:
        others.add(_module_tree(m, code=False)[1])
    return {
        "code": code,
        "model": model,
        "members": others.hexdigest(),
        "state": [str(dtype), str(device)],
        "inputs": _inputs(c),
        "n": c.n,
        "training": c.training,
        "member_tile": c.member_tile,
        "registered": registered.hexdigest(),
        "config": {k: repr(v) for k, v in config.items()},
        "constants": repr(constants),
        "versions": _versions(),
        "machine": [hardware(str(device)), torch.get_num_threads(), str(torch.get_default_dtype())],
    }


def key_of(c: Any, extra: dict[str, Any] | None = None) -> str | None:
    """The compile cache key of ``c`` (a hex digest), or None when ``c`` cannot be cached;
    ``extra``: more parts (a recapture's: what it takes from the graph it replaces)."""
    try:
        parts = {**key_parts(c), **(extra or {})}
    except _Uncacheable as e:
        log.debug("wide_compiler: compile cache not used: %s", e)
        return None
    key = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()
    if log.isEnabledFor(logging.DEBUG):
        log.debug("wide_compiler: compile cache key %s: %s", key, json.dumps(parts, sort_keys=True, default=str))
    return key


def entry_path(config: WideConfig, key: str) -> Path:
    """Where the entry of ``key`` lives."""
    return Path(config.resolved_cache_dir()) / _SUBDIR / f"{key}{_SUFFIX}"


# --- graphs as node tables ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _NodeRef:
    name: str


def _op_overload(namespace: str, name: str, overload: str) -> Any:
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def _op_packet(namespace: str, name: str) -> Any:
    return getattr(getattr(torch.ops, namespace), name)


def _higher_order(name: str) -> Any:
    return getattr(torch.ops.higher_order, name)


def _not_measured(n: int, options: dict) -> dict:
    raise RuntimeError("wide_compiler: this graph came from the compile cache: its strategies are final and "
                       "are not measured again (Note [The compile cache])")


def _plain(v: Any) -> Any:
    """fx's immutable containers as plain ones (they pickle as their base types' copies)."""
    if isinstance(v, (list, tuple)):
        items = [_plain(x) for x in v]
        return items if isinstance(v, list) else (type(v)(*items) if hasattr(v, "_fields") else tuple(items))
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, slice):
        return slice(_plain(v.start), _plain(v.stop), _plain(v.step))
    return v


def _meta(meta: dict) -> dict:
    out = {}
    for k, v in meta.items():
        if k.startswith("wide_") or k == "stack_trace":
            out[k] = v
        elif k == "nn_module_stack" and isinstance(v, dict):
            out[k] = {key: (entry[0], entry[1] if isinstance(entry[1], str) else
                            f"{getattr(entry[1], '__module__', '')}.{getattr(entry[1], '__qualname__', entry[1])}")
                      if isinstance(entry, tuple) and len(entry) == 2 else entry for key, entry in v.items()}
    tune = out.get("wide_tune")
    if isinstance(tune, TuneSpec):
        out["wide_tune"] = dataclasses.replace(tune, make=_not_measured)
    return out


def _graph_module_table(gm: fx.GraphModule) -> tuple:
    nodes = []
    attrs: dict[str, Any] = {}
    for node in gm.graph.nodes:
        if node.op in ("get_attr", "call_module"):
            attrs[node.target] = gm.get_submodule(node.target) if node.op == "call_module" else \
                _get_attr(gm, node.target)
        nodes.append((node.op, node.name, node.target, _plain(node.args), _plain(node.kwargs), _meta(node.meta)))
    codegen = gm.graph._codegen
    return (type(gm).__name__, nodes, attrs, codegen if type(codegen) is not fx.graph.CodeGen else None,
            dict(gm.meta))


def _get_attr(gm: nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _rebuild_graph_module(class_name: str, nodes: list, attrs: dict, codegen: Any, meta: dict) -> fx.GraphModule:
    graph = fx.Graph()
    if codegen is not None:
        graph._codegen = codegen
    env: dict[str, fx.Node] = {}

    def resolve(a: Any) -> Any:
        return fx.node.map_aggregate(a, lambda x: env[x.name] if isinstance(x, _NodeRef) else x)

    for op, name, target, args, kwargs, node_meta in nodes:
        node = graph.create_node(op, target, resolve(args), resolve(kwargs), name=name)
        if node.name != name:
            raise ValueError(f"node {name!r} came back as {node.name!r}")
        node.meta.update(node_meta)
        env[name] = node
    root = nn.Module()
    for target, value in attrs.items():
        *parents, last = target.split(".")
        holder = root
        for part in parents:
            if not hasattr(holder, part):
                holder.add_module(part, nn.Module())
            holder = getattr(holder, part)
        if isinstance(value, nn.Module):
            holder.add_module(last, value)
        elif isinstance(value, torch.Tensor):
            holder.register_buffer(last, value)
        else:
            setattr(holder, last, value)
    gm = fx.GraphModule(root, graph, class_name=class_name)
    gm.meta.update(meta)
    return gm


class _Pickler(pickle.Pickler):
    """Operators by name, graph modules as node tables, nodes by name (Note [The compile cache])."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch._ops.OpOverload):
            ns, name = obj._schema.name.split("::")
            return _op_overload, (ns, name, obj._overloadname)
        if isinstance(obj, torch._ops.OpOverloadPacket):
            ns, name = obj._qualified_op_name.split("::")
            return _op_packet, (ns, name)
        if isinstance(obj, torch._ops.HigherOrderOperator):
            return _higher_order, (obj.name(),)
        if isinstance(obj, fx.GraphModule):
            return _rebuild_graph_module, _graph_module_table(obj)
        if isinstance(obj, fx.Node):
            return _NodeRef, (obj.name,)
        if isinstance(obj, (torch.SymInt, torch.SymFloat, torch.SymBool)) or type(obj).__name__ == "FakeTensor":
            raise pickle.PicklingError(f"a symbolic or fake value ({type(obj).__name__}) in the graph")
        if isinstance(obj, (types.LambdaType, types.FunctionType)) and (
                "<lambda>" in obj.__qualname__ or "<locals>" in obj.__qualname__):
            raise pickle.PicklingError(f"a local function {obj.__qualname__}")
        return NotImplemented


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


# --- entries ------------------------------------------------------------------------------------


def _wide_graph_state(wg: WideGraph) -> dict:
    fields = {f.name: getattr(wg, f.name) for f in dataclasses.fields(wg)}
    fields["inputs"] = [(i.kind, i.name, i.node.name, i.member_shape, i.sample_value) for i in wg.inputs]
    fields["constant_table"] = None  # the model makes it from the plan
    return fields


def _wide_graph(fields: dict) -> WideGraph:
    gm = fields["graph_module"]
    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    fields = dict(fields, inputs=[GraphInput(kind, name, placeholders[node], shape, value)
                                  for kind, name, node, shape, value in fields["inputs"]])
    return WideGraph(**fields)


def _expected_state(c: Any) -> dict[str, tuple]:
    """Per parameter/buffer input of the graph: (kind, stacked shape, dtype, requires_grad) in the state."""
    out = {}
    for inp in c.wide.inputs:
        if inp.kind in ("parameter", "buffer"):
            t = (c.state.parameters if inp.kind == "parameter" else c.state.buffers).get(inp.name)
            if t is not None:
                out[inp.name] = (inp.kind, tuple(t.shape), str(t.dtype), bool(t.requires_grad))
    return out


def _tuning_complete(c: Any) -> bool:
    """Whether every op of this graph was measured or read from the strategy cache (a budget cut
    leaves ops for a later compile to measure). A model-level check or tile trial the budget cut
    short kept the defaults, a final choice: the graph is complete."""
    budget = c.wide.graph_module.meta.get("wide_tuning")
    return budget is None or getattr(budget, "gave_up_at", None) is None


def store(c: Any, key: str, ranges: dict) -> Path | None:
    """Write the entry of the compiled ``c`` under ``key`` (atomically); ``ranges``: the narrow size
    ranges of its capture. Returns the path, or None when it is not stored (logged: DEBUG when the
    graph cannot be pickled or the tuning budget left ops unmeasured, WARNING when the file cannot
    be written)."""
    if c.wide is None or c.ep is None:
        return None
    if not _tuning_complete(c):
        log.debug("wide_compiler: compile cache: not storing the %s graph: the tuning budget left ops "
                  "unmeasured (a later compile measures them)", "train" if c.training else "eval")
        return None
    body = {
        "wide": _wide_graph_state(c.wide),
        "guards": c.guards,
        "constant_plan": c.constant_plan,
        "constants": {name: t.detach().cpu().clone() for name, t in c.ep.constants.items()
                      if isinstance(t, torch.Tensor)},
        "opaque_constants": [name for name, t in c.ep.constants.items() if not isinstance(t, torch.Tensor)],
        "ranges": ranges,
        "layout": c.layout,
        "folded": c.folded,
        "timings": c.timings,
        "state": _expected_state(c) if c.state is not None else None,
        "training": c.training,
    }
    if body["opaque_constants"]:
        log.debug("wide_compiler: compile cache: not storing a graph with script-object constants")
        return None
    try:
        data = _dumps(body)
    except Exception as e:  # noqa: BLE001 -- anything that does not pickle: not cached, compiled as before
        log.debug("wide_compiler: compile cache: the %s graph cannot be stored (%s: %s)",
                  "train" if c.training else "eval", type(e).__name__, e)
        return None
    header = {"format": FORMAT, "key": key, "versions": _versions(), "length": len(data),
              "sha256": hashlib.sha256(data).hexdigest()}
    path = entry_path(c.config, key)
    try:
        ensure_directory(path.parent, "wide_compiler compile cache")
        atomic_write(path, lambda f: f.write(_MAGIC + json.dumps(header).encode() + b"\n" + data),
                     "wide_compiler compile cache")
    except OSError as e:
        log.warning("wide_compiler: cannot write the compile cache entry %s: %s", path, e)
        return None
    log.debug("wide_compiler: compile cache: stored %s (%d bytes)", path, len(data))
    _prune(path.parent)
    return path


MAX_ENTRIES = 512  # entries kept in the cache directory; the least recently written go first


def _prune(folder: Path, keep: int | None = None) -> None:
    """Delete the oldest entries of ``folder`` past ``keep`` (each edit of a model's code, each new
    version makes new keys: the cache would otherwise only grow)."""
    keep = MAX_ENTRIES if keep is None else keep
    try:
        entries = [(e.stat().st_mtime_ns, e) for e in folder.iterdir() if e.name.endswith(_SUFFIX)]
    except OSError:
        return
    if len(entries) <= keep:
        return
    for _, old in sorted(entries, key=lambda te: te[0])[: len(entries) - keep]:
        try:
            old.unlink()
        except OSError:
            pass


def _ignore(path: Path, why: str) -> None:
    log.warning("wide_compiler: ignoring the compile cache entry %s (%s); compiling afresh", path, why)


def load(c: Any, key: str) -> dict | None:
    """The body of the entry of ``key`` (None: no entry, or one that is ignored with one WARNING:
    truncated, corrupt, of another format or version, or not loadable)."""
    path = entry_path(c.config, key)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        _ignore(path, f"cannot read it: {e}")
        return None
    if not raw.startswith(_MAGIC):
        _ignore(path, "not a compile cache file")
        return None
    head, sep, data = raw[len(_MAGIC):].partition(b"\n")
    try:
        header = json.loads(head) if sep else None
    except ValueError:
        header = None
    if not isinstance(header, dict):
        _ignore(path, "truncated or corrupt header")
        return None
    if header.get("format") != FORMAT or header.get("versions") != json.loads(json.dumps(_versions())):
        _ignore(path, f"written by another version (format {header.get('format')}, "
                      f"wide_compiler {(header.get('versions') or {}).get('wide')}, "
                      f"torch {(header.get('versions') or {}).get('torch')})")
        return None
    if header.get("key") != key:
        _ignore(path, "its key differs from its file name")
        return None
    if header.get("length") != len(data) or header.get("sha256") != hashlib.sha256(data).hexdigest():
        _ignore(path, f"truncated or corrupt: {len(data)} bytes, expected {header.get('length')}")
        return None
    try:
        with warnings.catch_warnings():  # torch's own deprecation notes about the specs it unpickles
            warnings.simplefilter("ignore", FutureWarning)
            body = pickle.loads(data)  # noqa: S301 -- our own file, its digest checked (Note [The compile cache])
        body["wide"] = _wide_graph(body["wide"])
        for gm in (body["wide"].graph_module, body["wide"].tiled):
            if gm is not None:
                gm.graph.lint()
                budget = gm.meta.get("wide_tuning")
                if budget is not None:  # summary(): measured then, not now
                    budget.from_cache = str(path)
        if body["guards"] is not None and not isinstance(body["guards"], Guards):
            raise TypeError(f"guards of type {type(body['guards']).__name__}")
    except Exception as e:  # noqa: BLE001 -- whatever fails to load: compile afresh
        _ignore(path, f"its body does not load: {type(e).__name__}: {e}")
        return None
    body["path"] = str(path)
    return body


def check_loaded(c: Any, body: dict) -> str | None:
    """Why the loaded ``body`` does not fit ``c`` (None when it does): the stacked state has every
    parameter and buffer the graph reads, with the shape, dtype and ``requires_grad`` it was compiled
    for; the sample flattens as the graph's inputs; the per-member constants are the plan's."""
    wg: WideGraph = body["wide"]
    if tree_flatten(c.sample)[1] != wg.in_spec:
        return "the sample is not nested as the graph's inputs"
    users = [i for i in wg.inputs if i.kind == "user"]
    if len(users) != len(tree_flatten(c.sample)[0]):
        return "the sample has another number of inputs"
    expected = body.get("state") or {}
    plan = body.get("constant_plan")
    made = set(plan.buffers if plan is not None else ()) | set(body.get("constants") or ())  # by the model
    if c.state is not None:
        for inp in wg.inputs:
            if inp.kind not in ("parameter", "buffer") or inp.name in made:
                continue
            t = (c.state.parameters if inp.kind == "parameter" else c.state.buffers).get(inp.name)
            if t is None:
                return f"no stacked {inp.kind} {inp.name!r}"
            want = expected.get(inp.name)
            if want is not None and want[1:] != (tuple(t.shape), str(t.dtype), bool(t.requires_grad)):
                return f"{inp.kind} {inp.name!r} is {list(t.shape)} {t.dtype}, the graph was compiled for {want}"
            if inp.member_shape is not None and tuple(t.shape[1:]) != tuple(inp.member_shape):
                return f"{inp.kind} {inp.name!r} is {list(t.shape)}, one member's is {list(inp.member_shape)}"
    have = {p: tuple(v) for p, v in (c.constants or {}).items()}
    want = {p: tuple(v) for p, v in (plan.constants if plan is not None else {}).items()}
    if have.keys() != want.keys() or any(
            [repr(x) for x in have[p]] != [repr(x) for x in want[p]] for p in have):
        return "the per-member constants differ from the plan's"
    return None
