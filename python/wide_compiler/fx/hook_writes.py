"""The user's forward hooks that write outside themselves (Note [Hooks that write outside
themselves]): a hook's code read for writes into globals, closure variables, the object it is bound
to and its arguments, refused before anything runs the member (:func:`refuse_writing_hooks`), and
the backstop after a capture (:func:`_refuse_fake_leaks`). Used by the capture's watch
(fx/export_watch.py), the member checks and padding.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import sys
import types
from typing import Any

import torch
from torch import nn

from ..errors import WideCompileError
from .source import is_user_file

__all__ = ["refuse_writing_hooks"]

log = logging.getLogger("wide_compiler.fx.capture")  # the capture's records under one name

_SITE = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)

# Note [Hooks that write outside themselves]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A forward hook (or pre-hook) is part of the program export captures: what it returns is in the
# graph. What it does besides, to state outside itself (``feats[i].append(out)``, a counter in a
# closure, ``ACTS[name] = out``), is not: the capture runs the hook once, on placeholder tensors
# (it would leave a FakeTensor in the user's list), and the wide model never runs it again. So
# such a hook is refused before anything runs the member: a hook, on a member's module or one of
# torch's global module hooks, whose code changes a global or closure variable in place or assigns
# one (``code_reads._written_into``, and a subscripted one: ``feats[i].append(o)``; an in-place
# tensor method ``BUF.copy_(o)`` counts as a change). A hook that only reads state and returns a
# new output is captured as usual. An installed library's hook (its code under site-packages) is
# not refused: its writes are the library's design for export (transformers' output-capturing
# hooks collect into a per-call context that forward itself returns, so export captures them as
# graph outputs); the user's own hooks are what this guards against.
#
# A hook may keep its state on the object it is bound to instead: a callable object recording
# activations (``Recorder.__call__``: ``self.items.append(out)``), a bound method counting its
# calls (``self.n += 1; return out * self.n``), a ``functools.partial`` handing a list or an object
# to a function. The capture runs it once on a copy, the wide model never: the recorder stays
# empty and the counter stays at the capture's value, baked into the graph (probe 8 of issue 44,
# P8-5: 0.18-0.33 off from the second call). So the code is also read for writes into what it is
# bound to (``_bound_writes``: the value stack of its code is followed, and a value read from the
# bound object, ``self``, or a partial's argument, through attributes and items, that an attribute
# or item is assigned into or deleted from, or whose mutator or in-place tensor method is called,
# is a write; so are those of the methods of the object's class it calls, ``self.record(out)``,
# two calls deep), and such a hook is refused the same way; so is one that calls a function of the
# user's own (a module global or closure variable) that writes into its arguments, a global or a
# closure variable (``record(self.items, out)``: ``_helper_writes``; probe 8 of issue 44, P8-10, a
# global hook that left two FakeTensors in a recorder's dict that way). A hook that is a method of one of the model's own
# modules is left to the capture's check of module attributes (Note [A forward that writes its
# module's attributes] in fx/attribute_writes.py), which allows state that only feeds itself.


def _hook_code(fn: Any) -> Any:
    """The code object a hook runs (a function, a bound method, a partial, a callable object)."""
    for _ in range(4):
        if isinstance(fn, functools.partial):
            fn = fn.func
            continue
        code = getattr(getattr(fn, "__func__", fn), "__code__", None)
        if code is not None:
            return code
        fn = getattr(type(fn), "__call__", None)
        if fn is None:
            return None
    return None


def _hook_writes(code: Any) -> set[str]:
    """The globals and closure variables a hook's code writes into (Note [Hooks that write
    outside themselves])."""
    import dis

    from .code_reads import _MUTATORS, _written_into

    ins = list(dis.get_instructions(code))
    out = set(_written_into(ins))
    out |= {x.argval for x in ins if x.opname in ("STORE_GLOBAL", "STORE_DEREF", "DELETE_GLOBAL", "DELETE_DEREF")}
    chain = (*_LOAD_LOCAL, "LOAD_FAST_LOAD_FAST", "LOAD_CONST", "BINARY_SUBSCR", "LOAD_ATTR", "LOAD_METHOD",
             "PRECALL", "CALL")
    for k, x in enumerate(ins):  # feats[i].append(o), BUF.copy_(o): a mutator at the end of a chain of reads
        if x.opname not in ("LOAD_GLOBAL", "LOAD_DEREF", "LOAD_CLASSDEREF") or not isinstance(x.argval, str):
            continue
        for y in ins[k + 1:]:
            if y.opname not in chain:
                break
            name = y.argval if y.opname in ("LOAD_ATTR", "LOAD_METHOD") else None
            if isinstance(name, str) and (name in _MUTATORS or (name.endswith("_") and not name.startswith("_"))):
                out.add(x.argval)
                break
            if y.opname in ("PRECALL", "CALL"):
                break
    for c in code.co_consts:  # a nested function or comprehension
        if isinstance(c, types.CodeType):
            out |= _hook_writes(c)
    return out


def _hook_bound(fn: Any) -> tuple[Any, dict[str, Any]]:
    """The code a hook runs and what its parameters are bound to (the object of a bound method or
    a callable object, a partial's arguments), as ``(code, {parameter name: object})``."""
    args: list[Any] = []
    keywords: dict[str, Any] = {}
    for _ in range(4):
        if isinstance(fn, functools.partial):
            args[:0] = fn.args
            keywords = {**fn.keywords, **keywords}
            fn = fn.func
        else:
            break
    if isinstance(fn, types.MethodType):
        args.insert(0, fn.__self__)
        fn = fn.__func__
    elif not isinstance(fn, (types.FunctionType, types.BuiltinFunctionType)) and not hasattr(fn, "__code__"):
        call = getattr(type(fn), "__call__", None)
        if not isinstance(call, types.FunctionType):
            return None, {}
        args.insert(0, fn)
        fn = call
    code = getattr(fn, "__code__", None)
    if not isinstance(code, types.CodeType):
        return None, {}
    names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    bound = dict(zip(names, args))
    bound.update({k: v for k, v in keywords.items() if k in names})
    return code, bound


def _bound_writes(code: Any, bound: dict[str, Any], depth: int = 0) -> set[str]:
    """What ``code`` writes into the objects its parameters are bound to (``bound``: name ->
    object), as ``self.items`` (Note [Hooks that write outside themselves]): the code's value
    stack is followed line by line (:func:`_followed`), and a value read from a bound name
    through attributes and items (``self``, ``self.state``, ``self.d['a']``) that an attribute or
    an item is assigned into or deleted from, or whose mutator (``append``) or in-place tensor
    method (``copy_``) is called, is a write; and, two calls deep, the methods of the object's own
    class the code calls on it (``self.record(out)``). A nested function or comprehension reading a
    bound name from its cell is read the same way.

    >>> class Counted:
    ...     def hook(self, mod, inp, out):
    ...         self.n += 1
    ...         d = {}
    ...         d["k"] = self.scale * out  # a write into a local dict, not into self
    ...         return out * self.n
    >>> c = Counted()
    >>> sorted(_bound_writes(*_hook_bound(c.hook)))
    ['self.n']
    """
    out: set[str] = set()
    for where, name in _followed(code, bound):
        if name is None:
            out.add(where)
            continue
        root = where.split(".")[0].split("[")[0]
        held = _resolve(bound[root], where[len(root):])  # self, or an object it holds (self.sink.write(o))
        method = getattr(type(held), name, None) if held is not _UNRESOLVED else None
        if (depth < 2 and isinstance(method, types.FunctionType)
                and not any(d in method.__code__.co_filename for d in _SITE)):
            inner = _bound_writes(method.__code__, {method.__code__.co_varnames[0]: held}, depth + 1)
            out |= {where + w[len(w.split(".")[0].split("[")[0]):] for w in inner}
    for c in code.co_consts:  # a nested function or comprehension reading a bound name from its cell
        if isinstance(c, types.CodeType):
            out |= _bound_writes(c, {k: v for k, v in bound.items() if k in c.co_freevars}, depth)
    return out


_UNRESOLVED = object()


def _resolve(obj: Any, path: str) -> Any:
    """``obj`` followed through the attributes of ``path`` (``".sink.log"``), or ``_UNRESOLVED``
    where it goes through an item (``[]``) or an attribute it cannot read."""
    if "[" in path:
        return _UNRESOLVED
    for name in filter(None, path.split(".")):
        try:
            obj = inspect.getattr_static(obj, name)
        except AttributeError:
            return _UNRESOLVED
    return obj


#: The ops that push one local (or cell) variable: 3.12's checked and clearing loads too.
_LOAD_LOCAL = frozenset({"LOAD_FAST", "LOAD_DEREF", "LOAD_CLOSURE", "LOAD_FAST_CHECK", "LOAD_FAST_AND_CLEAR"})


def _is_method_load(ins: Any) -> bool:
    """Whether ``ins`` loads a method to call (``obj.append`` of ``obj.append(x)``): 3.11's
    LOAD_METHOD, or from 3.12 on a LOAD_ATTR with the low bit of its argument set (Note [Hooks
    that write outside themselves]: on 3.12 the method calls of a hook were read as attribute
    reads, so ``self.items.append(out)`` was no write, seen on the GPU machine's Python 3.12)."""
    return ins.opname == "LOAD_METHOD" or (ins.opname == "LOAD_ATTR" and sys.version_info >= (3, 12)
                                           and bool(ins.arg & 1))


# (values popped, values pushed) of the ops :func:`_followed` meets most; others by their net effect
_STACK = {"BINARY_OP": (2, 1), "COMPARE_OP": (2, 1), "CONTAINS_OP": (2, 1), "IS_OP": (2, 1), "POP_TOP": (1, 0),
          "STORE_FAST": (1, 0), "STORE_DEREF": (1, 0), "STORE_GLOBAL": (1, 0), "STORE_NAME": (1, 0),
          "RETURN_VALUE": (1, 0), "UNARY_NEGATIVE": (1, 1), "UNARY_NOT": (1, 1), "UNARY_INVERT": (1, 1),
          "UNARY_POSITIVE": (1, 1), "GET_ITER": (1, 1), "FORMAT_VALUE": (1, 1), "PRECALL": (0, 0),
          "KW_NAMES": (0, 0), "NOP": (0, 0), "RESUME": (0, 0), "CACHE": (0, 0), "PUSH_NULL": (0, 1),
          "EXTENDED_ARG": (0, 0), "JUMP_FORWARD": (0, 0), "JUMP_BACKWARD": (0, 0), "MAKE_CELL": (0, 0),
          "COPY_FREE_VARS": (0, 0), "JUMP_BACKWARD_NO_INTERRUPT": (0, 0), "LOAD_CONST": (0, 1),
          "POP_JUMP_FORWARD_IF_FALSE": (1, 0), "POP_JUMP_FORWARD_IF_TRUE": (1, 0),
          "POP_JUMP_BACKWARD_IF_FALSE": (1, 0), "POP_JUMP_BACKWARD_IF_TRUE": (1, 0)}


def _followed(code: Any, bound: dict[str, Any]) -> list[tuple[str, str | None]]:
    """The writes into bound objects ``code`` makes, as ``(where, None)`` (``self.n``,
    ``self.d``), and the methods it calls on a bound name or what it holds, as ``(where,
    method)``: the value stack followed through each line (from empty at each line's start: a
    value from an earlier line is unknown), a value labelled with where it was read from while it
    comes from a bound name through attributes and items."""
    import dis

    from .code_reads import _MUTATORS

    found: list[tuple[str, str | None]] = []
    stack: list[str | None] = []

    def pop(k: int) -> list[str | None]:
        taken = stack[len(stack) - k:] if k else []
        del stack[max(0, len(stack) - k):]
        return [None] * (k - len(taken)) + taken

    for ins in dis.get_instructions(code):
        op, arg = ins.opname, ins.argval
        if ins.starts_line:
            stack.clear()
        if op in _LOAD_LOCAL:
            stack.append(arg if arg in bound else None)
        elif op == "LOAD_FAST_LOAD_FAST":  # 3.13: two locals at once
            stack.extend(a if a in bound else None for a in arg)
        elif op in ("LOAD_ATTR", "LOAD_METHOD"):
            (obj,) = pop(1)
            method = _is_method_load(ins)
            if obj is not None and method:
                mutator = arg in _MUTATORS or (arg.endswith("_") and not arg.startswith("_"))
                found.append((obj, None if mutator else arg))
            stack.append(f"{obj}.{arg}" if obj is not None and not method else None)
            if method:
                stack.append(None)
        elif op == "BINARY_SUBSCR":
            obj, _ = pop(2)  # the container, under the key
            stack.append(f"{obj}[]" if obj is not None else None)
        elif op in ("STORE_ATTR", "DELETE_ATTR"):
            (obj,) = pop(1)
            if op == "STORE_ATTR":
                pop(1)
            if obj is not None:
                found.append((f"{obj}.{arg}", None))
        elif op in ("STORE_SUBSCR", "DELETE_SUBSCR"):
            obj, _ = pop(2)  # the container, under the key
            if op == "STORE_SUBSCR":
                pop(1)
            if obj is not None:
                found.append((obj, None))
        elif op == "COPY":
            stack.append(stack[-arg] if 0 < arg <= len(stack) else None)
        elif op == "SWAP":
            if 0 < arg <= len(stack):
                stack[-1], stack[-arg] = stack[-arg], stack[-1]
        elif op == "CALL":
            pop(arg + 2)
            stack.append(None)
        elif op in _STACK:
            pops, pushes = _STACK[op]
            pop(pops)
            stack.extend([None] * pushes)
        else:  # a load pushes values of its own; any other op uses what it pops and pushes a new value
            try:
                effect = dis.stack_effect(ins.opcode, ins.arg, jump=False)
            except ValueError:
                effect = 0
            if effect > 0:
                stack.extend([None] * effect)
            else:
                pop(1 - effect)
                stack.append(None)
    # ``self.d[]`` (an item read) names its container; the call of a mutator names what it is called on
    return [(where.replace("[]", ""), name) for where, name in found]


def _fake_in(obj: Any, path: str, seen: set[int], budget: list[int], depth: int = 0) -> str | None:
    """Where a FakeTensor sits in what ``obj`` holds (a list, tuple, set or dict, an object's
    attributes, three levels deep, a bounded number of objects), as ``path[...]``, or None."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(obj, FakeTensor):
        return path
    if depth > 3 or id(obj) in seen or budget[0] <= 0 or isinstance(
            obj, (torch.Tensor, nn.Module, type, types.ModuleType, types.FunctionType, str, bytes, int, float)):
        return None
    seen.add(id(obj))
    budget[0] -= 1
    if isinstance(obj, dict):
        items = [(f"{path}[{k!r}]", v) for k, v in list(obj.items())[:200]]
    elif isinstance(obj, (list, tuple, set, frozenset)):
        items = [(f"{path}[{k}]", v) for k, v in enumerate(list(obj)[:200])]
    elif type(obj).__module__ != "builtins" and isinstance(getattr(obj, "__dict__", None), dict):
        items = [(f"{path}.{k}", v) for k, v in list(vars(obj).items())[:200]]
    else:
        return None
    for where, v in items:
        found = _fake_in(v, where, seen, budget, depth + 1)
        if found:
            return found
    return None


def _refuse_fake_leaks(model: nn.Module) -> None:
    """Refuse a capture that left a FakeTensor in what a forward hook or pre-hook of the user's
    holds (on ``model``'s modules or among torch's global module hooks): the object it is bound to,
    a partial's arguments, its closure cells and the module globals its code names. The code read
    of :func:`refuse_writing_hooks` refuses such a hook before the capture runs it; this is the net
    for a write it cannot see (Note [Hooks that write outside themselves])."""
    from torch.nn.modules import module as torch_module

    hooks = [(f"module {path!r} ({type(m).__name__})" if path else f"the model ({type(m).__name__})", h)
             for path, m in model.named_modules() for kind in ("_forward_pre_hooks", "_forward_hooks")
             for h in getattr(m, kind, {}).values()]
    hooks += [(f"torch's global module hooks (torch.nn.modules.module.{kind})", h)
              for kind in ("_global_forward_pre_hooks", "_global_forward_hooks")
              for h in getattr(torch_module, kind, {}).values()]
    seen: set[int] = set()
    budget = [5000]
    for where, hook in hooks:
        fn = _hook_function(hook)
        if fn is None or any(d in fn.__code__.co_filename for d in _SITE):
            continue
        held: list[tuple[str, Any]] = []
        h: Any = hook
        for _ in range(4):
            if isinstance(h, functools.partial):
                held += [("partial argument", a) for a in (*h.args, *h.keywords.values())]
                h = h.func
            elif isinstance(h, types.MethodType):
                held.append(("self", h.__self__))
                h = h.__func__
            else:
                break
        if not isinstance(h, types.FunctionType):
            held.append(("self", h))
        held += [(name, c.cell_contents) for name, c in zip(fn.__code__.co_freevars, fn.__closure__ or ())
                 if _cell_full(c)]
        held += [(name, fn.__globals__[name]) for name in fn.__code__.co_names if name in fn.__globals__]
        for name, obj in held:
            found = _fake_in(obj, name, seen, budget)
            if found:
                raise WideCompileError(
                    f"wide_compiler: {where} hold a hook ({getattr(hook, '__qualname__', type(hook).__name__)} at "
                    f"{fn.__code__.co_filename}:{fn.__code__.co_firstlineno}) that kept a placeholder tensor of the "
                    f"capture in {found}: it writes into state outside it, which the wide model would never "
                    "update (Note [Hooks that write outside themselves] in fx/hook_writes.py). What it recorded "
                    "during the capture is no member's value; remove it.\n"
                    "What to do: remove the hook before compiling and take what it recorded from the wide "
                    "model's outputs (return it from forward), or register it on a member copy (wide.member(i)).")


def _cell_full(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _hook_function(fn: Any) -> types.FunctionType | None:
    """The Python function a hook runs (a function, a bound method's, a partial's, a callable
    object's ``__call__``), whose globals its code reads."""
    for _ in range(4):
        if isinstance(fn, functools.partial):
            fn = fn.func
        elif isinstance(fn, types.MethodType):
            fn = fn.__func__
        elif isinstance(fn, types.FunctionType):
            return fn
        else:
            fn = getattr(type(fn), "__call__", None)
            if not isinstance(fn, types.FunctionType):
                return None
    return None


def _helper_writes(fn: types.FunctionType, depth: int = 0, seen: set | None = None) -> list[str]:
    """The user's own functions a hook's code calls (read as module globals or closure variables,
    two calls deep) that write into their arguments, a global or a closure variable, as
    ``"helper(d)"`` (Note [Hooks that write outside themselves]: ``record(self.items, out)`` with
    ``def record(d, o): d.setdefault("k", []).append(o)`` records as surely as the hook's own
    ``self.items.append(out)``).

    >>> def record(d, o):
    ...     d.append(o)
    >>> def hook(m, i, o):
    ...     record(STORE, o)
    >>> _helper_writes(hook)
    ['record(d)']
    """
    import dis

    seen = set() if seen is None else seen
    out: list[str] = []
    codes = [fn.__code__]
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
    while codes:
        code = codes.pop()
        codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
        for ins in dis.get_instructions(code):
            if ins.opname == "LOAD_GLOBAL":
                f = fn.__globals__.get(ins.argval)
            elif ins.opname == "LOAD_DEREF" and ins.argval in cells:
                try:
                    f = cells[ins.argval].cell_contents
                except ValueError:
                    continue
            else:
                continue
            if (not isinstance(f, types.FunctionType) or f in seen or any(d in f.__code__.co_filename for d in _SITE)
                    or not is_user_file(f.__code__.co_filename, skip_stdlib=True)):
                continue
            seen.add(f)
            inner = f.__code__
            params = inner.co_varnames[:inner.co_argcount + inner.co_kwonlyargcount]
            written = _hook_writes(inner) | _bound_writes(inner, {p: _Placeholder() for p in params})
            if written:
                out.append(f"{f.__qualname__}({', '.join(sorted(written))})")
            elif depth < 1:
                out += _helper_writes(f, depth + 1, seen)
    return out


class _Placeholder:
    """What :func:`_helper_writes` binds a helper's parameters to (a class without methods)."""


def _object_writes(hook: Any, model: nn.Module) -> tuple[set[str], str]:
    """The writes of ``hook`` into what it is bound to (not one of ``model``'s own modules, whose
    attributes the capture checks), and a phrase naming the objects (Note [Hooks that write
    outside themselves])."""
    code, bound = _hook_bound(hook)
    if code is None:
        return set(), ""
    own = {id(m) for m in model.modules()}
    bound = {k: v for k, v in bound.items() if id(v) not in own}
    if not bound:
        return set(), ""
    written = _bound_writes(code, bound)
    kinds = sorted({type(bound[w.split(".")[0]]).__name__ for w in written if w.split(".")[0] in bound})
    return written, (f", state of the {' and '.join(kinds)} object{'s' if len(kinds) > 1 else ''} it is bound to"
                     if kinds else "")


def refuse_writing_hooks(model: nn.Module, member: int | None = 0) -> None:
    """Raise :class:`WideCompileError` before any capture when a forward hook or pre-hook that
    member ``member`` runs (on one of its modules, or one of torch's global module hooks) writes
    into state outside itself (Note [Hooks that write outside themselves])."""
    from torch.nn.modules import module as torch_module

    found = []
    for path, m in model.named_modules():
        for kind in ("_forward_pre_hooks", "_forward_hooks"):
            for hook in getattr(m, kind, {}).values():
                found.append((f"{'member ' + str(member) + chr(39) + 's ' if member is not None else ''}"
                              + (f"module {path!r} ({type(m).__name__})" if path else f"model ({type(m).__name__})")
                              + " has", kind[1:-1].replace("_", " "), hook))
    for kind in ("_global_forward_pre_hooks", "_global_forward_hooks"):
        for hook in getattr(torch_module, kind, {}).values():
            found.append((f"torch's global module hooks (torch.nn.modules.module.{kind}, run by every module) hold",
                          kind[8:-1].replace("_", " "), hook))
    for where, kind, hook in found:
        code = _hook_code(hook)
        if code is None or any(d in code.co_filename for d in _SITE):
            continue  # an installed library's hook (transformers' output capturing): Note [Hooks that write outside themselves]
        try:
            written = _hook_writes(code)
            bound, whose = _object_writes(hook, model)
            fn = _hook_function(hook)
            helpers = set(_helper_writes(fn)) if fn is not None else set()
        except Exception:  # noqa: BLE001 -- code dis cannot read: not a refusal
            continue
        if helpers:
            written |= {f"through {h}" for h in helpers}
        if not written and not bound:
            continue
        raise WideCompileError(
            f"wide_compiler: {where} a {kind} ({getattr(hook, '__qualname__', type(hook).__name__)} at "
            f"{code.co_filename}:{code.co_firstlineno}) that writes into state outside it "
            f"({', '.join(sorted(written | bound))}{whose}). The capture would run it once, on placeholder tensors, and the wide "
            "model never runs it again: what it records would be neither the members' values nor kept up by "
            "wide calls (Note [Hooks that write outside themselves] in fx/hook_writes.py).\n"
            "What to do: remove the hook before compiling and take what it recorded from the wide model's "
            "outputs (return it from forward), or register it on a member copy (wide.member(i)) to inspect one "
            "member; a hook that only returns a changed output compiles.")
