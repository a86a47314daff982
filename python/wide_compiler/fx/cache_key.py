"""The compile cache's key: a digest of everything a compiled program depends on (the code of the
model's classes and the globals they read, the module tree, the sample, the config, the per-member
constants, the versions and the machine), so that an entry is found again exactly when the program it
holds is the one a fresh compile would make (Note [The compile cache] in fx/compile_cache.py).

Note [The compile cache key]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The key (:func:`key_parts`) holds everything the compiled program depends on:
- ``code``: the code of every module class in the captured tree that is not torch's (its
  methods' code objects, constants and names, recursively; the closures and defaults; the values
  of module-level globals those functions read, following functions and classes they call, a few
  levels deep; an attribute read from a global module or object, ``cfg.SCALE``, by its value;
  objects held by globals otherwise by their class; the standard library, torch and
  wide_compiler by their versions), and every hook on those modules;
- ``model``: the module tree (paths, classes, training flags, every other attribute's value, as
  the member check compares them), parameter and buffer names, shapes, strides, dtypes, devices and
  ``requires_grad``, and which modules, parameters and buffers are one and the same (a tied
  weight, a shared submodule: another program than untied ones of the same shapes); the wide
  state's dtype and device;
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
"""

from __future__ import annotations

import dataclasses
import dis
import functools
import hashlib
import json
import logging
import sys
import types
import weakref
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten

from .._version import __version__
from ..measure import hardware
from .code_digest import Digest as _Digest
from .code_digest import code_text as _code_text
from .member_checks import _ties

__all__ = ["FORMAT", "key_of", "key_parts"]

log = logging.getLogger("wide_compiler.fx.compile_cache")  # the compile cache's records under one name

FORMAT = 1  # raised when what an entry holds changes: older entries are then foreign
# WideConfig fields that do not change the compiled program
_CONFIG_IGNORED = frozenset({"cache", "cache_dir", "compile_cache", "validate", "rtol", "atol", "defer"})
_DEPTH = 3  # how deep the code digest follows functions and classes a forward reads


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
    if t.layout == torch.strided:  # the run-members check depends on it (Note [Members stored in another memory layout])
        d.add("strides", t.stride())
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
    """(code, model) digests of the captured module tree (Note [The compile cache key]); ``code``
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
    # which modules and tensors are one and the same (tied weights, a shared submodule): another
    # program than untied ones of the same shapes (probe 9 of issue 44, P9-6; Note [Members tied alike])
    tree.add("ties", sorted(_ties(model).items()))
    for hooks in (nn.modules.module._global_forward_hooks, nn.modules.module._global_forward_pre_hooks):
        for h in hooks.values():
            code.add("global hook")
            _value(code, h, _DEPTH)
    return code.hexdigest(), tree.hexdigest()


# The modules of wide_compiler above the compiler (.importlinter: fx imports none of them), whose
# code cannot change a compiled graph: edits there keep the cache's entries
_ABOVE_THE_COMPILER = frozenset({"model", "model_calls", "model_constants", "model_export", "model_inspection",
                                 "api", "router", "integrations", "bench", "cli", "__main__", "population",
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
    :class:`~wide_compiler.fx.compilation.Compilation` after ``check_members``), by name (Note [The
    compile cache key]); raises ``_Uncacheable`` when a part has no stable description."""
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
        "earlier_constants": repr([sorted((p, constant_key(v)) for p, v in cfg.items())
                                   for cfg in c.earlier_constants]),
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
