"""What the members' code reads besides its inputs -- module globals, class attributes, functions,
tensors, global flags -- and how each is kept (:class:`Contents`, :class:`FunctionRef`,
:class:`TensorRef`), found again (``_owner_of``) and compared (:func:`same_value`) so that the
guards of fx/guards.py (Note [Guards]) can check it at every call. The scan of the code a forward
reaches, which finds what it reads, is fx/code_reads.py.

Note [State a forward reads]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Besides its inputs' shapes, a forward's Python may read the state of the process, and export bakes
the branch it took into the graph without a guard. What is guarded, each checked by the same
generated function at every call (a call outside captures a graph for it, as for a new size):

* **global flags** (``FLAG_READERS``: ``torch.are_deterministic_algorithms_enabled()``,
  ``torch.is_autocast_enabled(device)``, ``torch.get_autocast_dtype(device)``,
  ``torch.get_default_dtype()``, ``torch.get_float32_matmul_precision()`` and their kin): the calls
  the user's code made during capture, with their arguments and answers (fx/export_watch.py's
  ``_Watch``); a reader the code holds as a global (``from torch import get_default_dtype``) is
  not seen when called, so every variant of it is guarded;
* **memory layout**: where the user's code read ``Tensor.is_contiguous`` or ``Tensor.stride``
  during capture (of any tensor: an intermediate's layout follows the inputs'), every tensor
  input's member layout (:func:`layout_of`: the stride order of a dense tensor, else its strides)
  must be the captured one. Export specialises on the sample's strides silently (a transposed
  input would run the contiguous branch); the call's own layout is captured instead;
* **device**: every tensor input must be on the device of the model's parameters (buffers for a
  model without parameters) now, or, for one captured elsewhere (a CPU index tensor beside CUDA
  parameters), on its captured device: a call that is not is refused naming the input (no capture
  could take it; the members would fail too). Where the user's code read a tensor's device
  (``.device``, ``.is_cuda``, ``.is_cpu``), the parameters' device at capture is guarded too, so
  the graphs follow ``.to(device)`` (captured again on the new device);
* **module globals and class attributes** (fx/code_reads.py's :func:`globals_read`): the plain immutable values
  (numbers, strings, None, enum members, dtypes, devices, tuples and frozensets of them) that the
  members' code loads as globals or reads as class attributes (``self.SCALE`` where the instance
  has no ``SCALE``), found by reading the bytecode (``dis``) of the code a forward reaches: every
  module's ``forward`` and its base classes' (``super().forward(x)``, ``Base.forward(self, x)``);
  through a decorator, the function it wraps (``__wrapped__``, and the user's functions in a
  wrapper's closure: ``functools.wraps``, ``@torch.no_grad()``); the methods and properties the
  code names, looked up on the module's class and on every module class of the tree that defines
  the name, with the base classes' methods of that name (``self.helper(x)``,
  ``self.child.scale_it(h)``, ``super().helper(x)``); the functions the module holds; the hooks
  of every module of the tree (forward pre-hooks, forward hooks, backward hooks: code its call
  runs) and torch's global module hooks; and the functions they load as globals, transitively,
  a function of another module of the user's reading that module's globals. An attribute read
  anywhere there (``mod.K`` in a helper handed the module) is guarded as a class attribute of
  every module class of the tree (the user's own, not an installed package's) that defines it,
  and of every plain class of the user's the code reads (``Cfg.K`` with ``Cfg`` a global class
  used as a namespace, ``cls.K2`` in its classmethod, the class of a plain object a global or a
  module holds): over-guarding a class attribute that never changes costs an ``is`` per call,
  missing one would run a stale graph. An attribute of another module of the user's
  (``cfgmod.X``, ``cfgmod.f(h)``, ``pkg.sub.X``: the module loaded as a global and its attribute
  read at once) is guarded as that module's global (a function of torch's read so in the user's
  code, ``F.gelu(h)`` with ``F`` torch.nn.functional, by identity: a patch of it is seen; not
  through a longer chain, ``torch.nn.functional.gelu``), and so is one reached through an import in
  the code (``import cfgmod as c; c.X``, ``from cfgmod import X`` inside forward: ``IMPORT_NAME``
  and ``IMPORT_FROM``) or ``sys.modules["cfgmod"].X``. A custom ``torch.autograd.Function`` the
  code names (``F.apply(h)``) is read like a helper: its ``forward`` and ``setup_context``. A closure variable the code reads
  (``LOAD_DEREF``: a value a factory closed over, a dict in a closure) is guarded by its cell's
  contents like a global (a function there is read, not guarded: a decorator's wrapped function).
  Bounded:
  ``MAX_CODES``, ``MAX_WATCHED`` (fx/code_reads.py); 50-80 ms for a small GPT-2 or Llama on a busy machine (their
  decorated forwards are read, and the masking functions they call). Checked by identity (an
  ``is`` per value: tens of nanoseconds), then by type and value (:func:`same_value`: ``2`` is
  not ``2.0``), so ``mod.SCALE = 3.0`` after compiling captures a graph with 3.0, and setting it
  back reuses the first graph.
* **functions** read as globals or class attributes (``act(h)`` with ``act`` a module global):
  their identity (:class:`FunctionRef`), besides the globals their code reads, so ``act =
  torch.sin`` after compiling captures a graph with ``sin``; so are the methods the capture ran
  (Note [A method patched on its class]). A dict or list of functions (a
  registry: ``ACTS[self.act](h)``) in the user's code is guarded by its contents (each entry's
  identity) and each function's code is read; an installed package's registry (transformers'
  loss functions) is left to it.
* **tensors** read as globals or class attributes (``self.fc(x) * MASK``: export bakes them into
  the graph as constants): their identity and ``_version`` (:class:`TensorRef`: an in-place change,
  ``MASK.mul_(2)``, bumps the version), then their values where the tensor is small
  (``MAX_TENSOR_VALUES``; a copy kept with the guard), so values changed back, or found again
  after unpickling, reuse the graph. A larger one's graph is captured again in a new process.
  Inside a call torch.compile traces: Note [A global tensor inside torch.compile].
* **environment variables**: a key the user's code reads of ``os.environ`` by a constant
  (``os.environ["K"]``, ``os.environ.get("K", d)``, ``"K" in os.environ``, ``os.getenv("K")``,
  also with ``environ`` or ``getenv`` imported by name): its value, None where unset, compared by
  ``==`` at every call (a read of ``os.environ`` makes a new string). Any other read of it (a
  computed key, iterating it, handing it on) is named in the warning at capture.
* **requires_grad**: where the code reads an attribute ``requires_grad`` (``2 if x.requires_grad
  else 3``), every tensor input's ``requires_grad`` as captured (a graph for the other is captured
  with the call's inputs as they are).

* **torch's global module hooks** (``torch.nn.modules.module.register_module_forward_pre_hook``
  and its kin: ``_GLOBAL_HOOKS``): the handles of each kind at capture (:attr:`Guards.hooks`),
  checked at every call (``not d`` per kind where there were none: four times tens of
  nanoseconds), so a global hook registered or removed after compiling captures a graph with the
  hooks as they are. A hook added to or removed from a module of the tree of the original members
  after compiling is not the wide model's: it is built from copies of the members (their weights
  and hooks as at compiling).

The contents of a mutable global, class attribute or closure variable the code reads (a dict, a
list, a tuple holding one, a ``SimpleNamespace`` or a plain object: ``CFG["act"]``,
``cfg.scale``, ``TUP[1][0]``, ``{"a": {"k": 1.0}}``) are guarded by value (:class:`Contents`: at
most ``MAX_CONTENTS`` plain values or functions per container, two levels of containers in it,
compared at each call, a few microseconds); one whose contents are not plain values (a tensor in a
dict, deeper nesting) is named in a warning at capture: a change to it after compiling is not seen.

Not guarded (documented limits), each named in the warning at capture where the code reads it:
mutable objects whose contents are not plain values (above), a numpy array (changed in place
without a version to guard), a ``functools.partial`` held as a global (its code is read; its
arguments and rebinding are not guarded), a module of the user's
handed on or read other than as ``module.NAME``, ``globals()`` and ``vars()`` (``globals()["NAME"]``:
the name is not known statically). Not guarded and not warned, by design: names the members'
code writes itself (a call counter: ``global CALLS; CALLS += 1``, ``nonlocal n; n += 1``;
guarding it would capture again at every call), instance attributes, and objects the modules hold
(``self.cfg.scale``: the wide model keeps copies of the members as at compiling, per-member
constants cover what differs: Note [Per-member constants]), ``torch.backends.*`` flags (capture
runs with cuDNN off, on purpose), and state read in torch's, an installed package's or
wide_compiler's own code. ``torch.compiler.is_compiling()`` needs no guard: the
user's code gets False at capture, as each member alone does (Note [What export does not
capture] in fx/export_watch.py); ``torch.jit.is_scripting()`` and ``torch.jit.is_tracing()`` are False
both in export and in a member's eager call.

A :class:`Guards` pickles as plain data (a compile cache keeps it on disk): the live dicts and
classes of the watched globals are found again by module name and class qualified name when it is
loaded (``_owner_of``; a closure variable by its function's qualified name, so a decorated method's
is found and a factory's function's is not; one not found, such as a class defined inside a
function, fails its guard, so the graph is captured again rather than run unchecked), and the
device and flag readers by name. Global hooks are kept by handle id, which names a hook in its
own process only: an unpickled guard that had any fails while hooks of that kind exist.

Note [A global tensor inside torch.compile]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
When torch.compile traces a call of the wide model, the guards' check is traced with it. A
tensor's ``_version`` is no value Dynamo knows at trace time: it becomes a symbol read at run time
(``u0``), and a Python branch on it (``_version == 3``) fails the trace ("Could not guard on
data-dependent expression"). Dynamo guards neither a tensor's version nor its values, so checking
identity alone would let an in-place change after the trace (``MASK.mul_(2)``) run the graph's
old copy silently (the wide graph holds a copy of the tensor as a constant, where a member alone
under torch.compile reads the live tensor). So inside a trace (``torch.compiler.is_compiling()``)
a watched tensor is checked by dtype, shape and device at trace time (Dynamo guards those; a
rebound global is re-traced) and by its values at run time: ``torch._assert_async`` of the
elementwise comparison with the kept copy (:meth:`TensorRef.traced`; an op in the compiled graph,
kept by every backend, a compare of at most ``MAX_TENSOR_VALUES`` values per call). A change after
the trace raises that assertion naming the tensor instead of running stale values: a graph cannot
be captured inside torch.compile anyway. Limits: the first graph whose other guards hold is taken
(where the tensor was changed in place and a second graph captured for the new values eagerly, a
traced call may take the first and raise); a tensor over ``MAX_TENSOR_VALUES`` (no copy kept)
fails its guard inside torch.compile, so the call is refused naming it.

Note [A method patched on its class]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A method is a class attribute too: ``M.act = lambda self, h: torch.sigmoid(h)`` after compiling,
``M.forward = new_forward``, or a LoRA-style ``nn.Linear.forward = lora_forward`` changes what each
member computes, and export baked the old code into the graph. Guarded by identity, as a global
function is (:class:`FunctionRef`, ``getattr(cls, name) is fn``: an attribute lookup and an ``is``
per method, tens of nanoseconds at the call):

* the ``forward`` of every module class of the tree (torch's too: ``nn.Linear.forward``) that the
  instance does not override itself, looked up on the class (a forward patched on a base class is
  seen through the subclass); a container's (``nn.ModuleList``: ``Module.forward`` itself) is not;
* every plain method or static method of the user's that the code looks up on a module class or a
  plain class of the user's (``self.act(h)``, ``Helper.scale(h)``), and, for ``super().helper(x)``,
  on each base class of the user's that defines it, wherever fx/code_reads.py's scan follows it;
  a method torch defines (``self.parameters()``) is not.

A call whose method is another function than at capture captures a graph with it (the wide model's
copies of the members are instances of the patched class), and setting it back reuses the first.
Not guarded: class methods and properties (their code is read, their rebinding is not followed), a
method made anew at each lookup (a ``functools.partialmethod``: no identity to keep), a method set
on an instance (the wide model keeps copies of the members), and methods that torch's or
an installed package's code looks up. After unpickling (the compile cache) a method matches by its
name and the digest of its code and closure (``_function_key``: a decorated method, ``super()``).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import os
import sys
import types
import weakref
from typing import Any

import torch

from .source import assert_message

__all__ = ["FLAG_READERS", "Contents", "FunctionRef", "TensorRef", "global_hooks", "remember_owners", "same_value"]


# Note [State a forward reads]: the global flags whose reads (from the user's code, during capture)
# become guards; fx/export_watch.py's _Watch records the calls ``torch.<name>(*args)``
FLAG_READERS: dict[str, Any] = {name: getattr(torch, name) for name in (
    "are_deterministic_algorithms_enabled", "is_deterministic_algorithms_warn_only_enabled",
    "get_deterministic_debug_mode", "is_autocast_enabled", "get_autocast_dtype", "is_autocast_cpu_enabled",
    "get_autocast_cpu_dtype", "get_autocast_gpu_dtype", "is_autocast_cache_enabled", "get_default_dtype",
    "get_float32_matmul_precision") if hasattr(torch, name)}
# the grad-mode readers (Guards.grad_mode); a forward that holds one as a global reads the mode
_GRAD_READERS = {"is_grad_enabled": torch.is_grad_enabled, "is_inference_mode_enabled": torch.is_inference_mode_enabled}
# the arguments a reader imported by name is guarded with (its calls are not seen: every variant)
_BOUND_ARGS = {"is_autocast_enabled": ((), ("cpu",), ("cuda",)), "get_autocast_dtype": (("cpu",), ("cuda",))}
# the readers a read of a tensor's dtype counts as (Note [A dtype the forward reads] in fx/export_watch.py)
_AUTOCAST_READERS = ("is_autocast_enabled", "get_autocast_dtype")


def same_value(a: Any, b: Any) -> bool:
    """Whether two plain values are the same for a program that reads them: the same type and
    value (``2`` is not ``2.0``, ``-0.0`` is not ``0.0``, a NaN is a NaN).

    >>> same_value(2, 2), same_value(2, 2.0), same_value(float("nan"), float("nan")), same_value((1, "a"), (1, "a"))
    (True, False, True, True)
    """
    if type(a) is not type(b):
        return False
    if isinstance(a, Contents):
        return a.kind == b.kind and same_value(a.items, b.items)
    if isinstance(a, (tuple, frozenset)):
        if isinstance(a, frozenset):
            return a == b
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if a is b:  # after the containers: torch.compile traces this check, and cannot trace `is` on tuples
        return True
    if isinstance(a, (float, complex)):
        return repr(a) == repr(b)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 -- a value that cannot be compared is not the same
        return False


_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.memory_format,
          torch.layout, enum.Enum)


def _plain(v: Any, depth: int = 0) -> bool:
    """A value a guard can keep and compare: immutable scalars, strings, dtypes, and tuples or
    frozensets of them."""
    if isinstance(v, _PLAIN):
        return True
    if type(v) in (tuple, frozenset) and depth < 2 and len(v) <= 16:
        return all(_plain(x, depth + 1) for x in v)
    return False


MAX_CONTENTS = 64  # the values of a mutable global guarded by value (Note [State a forward reads])


@dataclasses.dataclass(frozen=True)
class Contents:
    """The contents of a mutable global the members' code reads (Note [State a forward reads]):
    ``kind`` (``dict``, ``list``, ``tuple`` or ``object``: a namespace or plain object's
    attributes) and its items, plain values, functions (as :class:`FunctionRef`: a registry) or
    the contents of containers in it (``{"a": {"k": 1.0}}``, ``(1.0, [1.0])``: two levels);
    guarded by value.

    >>> Contents.of((1.0, [2.0])), Contents.of({"a": {"k": 1.0}}), Contents.of([torch.ones(1)])
    ((1.0, [2.0]), {'a': {'k': 1.0}}, None)
    """

    kind: str
    items: tuple

    def __repr__(self) -> str:
        if self.kind in ("list", "tuple"):
            return repr(list(self.items) if self.kind == "list" else self.items)
        shown = repr(dict(self.items))
        return shown if self.kind == "dict" else f"an object with attributes {shown}"

    @staticmethod
    def of(v: Any, depth: int = 0) -> Contents | None:
        """The contents of ``v``; None when it is not a dict, list, tuple, namespace or plain object
        of at most ``MAX_CONTENTS`` plain values, functions or (two levels deep) such containers."""
        if type(v) is dict:
            kind, items = "dict", tuple(v.items())
        elif type(v) is list:
            kind, items = "list", tuple(v)
        elif type(v) is tuple and depth < 3:  # a tuple of plain values is plain itself (_plain)
            kind, items = "tuple", v
        elif _plain_instance(v):
            kind, items = "object", tuple(vars(v).items())
        else:
            return None
        if len(items) > MAX_CONTENTS or depth > 2:
            return None
        keyed = kind in ("dict", "object")
        out = []
        for item in items:
            x = item[1] if keyed else item
            x = FunctionRef(x) if isinstance(x, _FUNCTIONS) else x if _plain(x) else Contents.of(x, depth + 1)
            if x is None:
                return None
            out.append((item[0], x) if keyed else x)
        return Contents(kind, tuple(out))


def _values(c: Contents) -> list[Any]:
    """The values of a :class:`Contents` (a dict's or an object's without their keys), and those
    of the containers in it."""
    out = list(c.items) if c.kind in ("list", "tuple") else [x for _, x in c.items]
    return [*out, *(y for x in out if isinstance(x, Contents) for y in _values(x))]


_FUNCTIONS = (types.FunctionType, types.BuiltinFunctionType)


class FunctionRef:
    """A function the members' code reads as a global, a class attribute or an entry of a registry
    (Note [State a forward reads]), guarded by identity: a global rebound to another function
    (``act = torch.sin``) fails the guard. Pickles as its module, qualified name and, for a Python
    function, a digest of its code and of what its closure holds (plain values, classes, functions:
    a decorated method, ``super()``'s ``__class__``); one loaded from a pickle matches the function
    of that name and digest (one whose closure or defaults hold values the digest does not see
    matches nothing: its graph is captured again).

    >>> FunctionRef(torch.sin) == FunctionRef(torch.sin), FunctionRef(torch.sin) == FunctionRef(torch.cos)
    (True, False)
    """

    __slots__ = ("fn", "_key")

    def __init__(self, fn: Any) -> None:
        self.fn, self._key = fn, None

    @property
    def key(self) -> tuple:
        """(module, qualified name, code digest), computed when first asked (a pickle, a message)."""
        if self._key is None:
            self._key = _function_key(self.fn)
        return self._key

    def __getstate__(self) -> tuple:
        return self.key

    def __setstate__(self, key: tuple) -> None:
        self.fn, self._key = None, key

    def matches(self, fn: Any) -> bool:
        """Whether ``fn`` is this function (after unpickling: one of its name and code)."""
        if self.fn is not None:
            return fn is self.fn
        return isinstance(fn, _FUNCTIONS) and self.key[-1] is not None and _function_key(fn) == self.key

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FunctionRef):
            return NotImplemented
        return other.matches(self.fn) if self.fn is not None else self.key[-1] is not None and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key[:2])  # equal refs have equal names

    def __repr__(self) -> str:  # its names only: no digest (torch.compile traces a message's repr)
        module, name = _function_names(self.fn) if self._key is None else self.key[:2]
        return f"<function {module}.{name}>"


def _function_names(fn: Any) -> tuple[str, str]:
    """(module, qualified name) of a function, for its key and messages."""
    return str(getattr(fn, "__module__", None)), str(getattr(fn, "__qualname__", getattr(fn, "__name__", "?")))


def _closure_text(fn: Any, depth: int) -> str | None:
    """What ``fn``'s closure holds, for its digest: each cell's plain value, class (by module and
    qualified name: ``super()``'s ``__class__`` cell) or function (by its own key: a decorator's
    wrapped function), two levels deep; None where a cell holds anything else (its values would go
    unseen) or is empty."""
    parts = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            v = cell.cell_contents
        except ValueError:  # an empty cell
            return None
        if _plain(v):
            parts.append(repr(v))
        elif isinstance(v, type):
            parts.append(f"class {v.__module__}.{v.__qualname__}")
        elif isinstance(v, _FUNCTIONS) and depth < 2:
            key = _function_key(v, depth + 1)
            if key[-1] is None:
                return None
            parts.append(repr(key))
        else:
            return None
    return ";".join(parts)


def _function_key(fn: Any, depth: int = 0) -> tuple:
    """(module, qualified name, digest of the code or None where the code does not say it all: a
    closure holding other than plain values, classes and such functions, or defaults not plain).

    >>> def deco(f):
    ...     def wrapper(*a): return f(*a)
    ...     return wrapper
    >>> def scaled_by(box):
    ...     return lambda h: h * box[0]
    >>> _function_key(deco(torch.sin))[-1] is not None, _function_key(deco(scaled_by([2.0])))[-1] is None
    (True, True)
    """
    from .code_digest import code_text

    code = getattr(fn, "__code__", None)
    digest: str | None = type(fn).__name__
    if code is not None:
        defaults = (getattr(fn, "__defaults__", None) or (), tuple(sorted((getattr(fn, "__kwdefaults__", None) or {}).items())))
        closure = _closure_text(fn, depth)
        if closure is None or not _plain(defaults):
            digest = None  # values the digest would not see
        else:
            digest = hashlib.sha256((code_text(code) + repr(defaults) + closure).encode()).hexdigest()[:16]
    return (*_function_names(fn), digest)


# torch's global module hooks (nn.modules.module.register_module_forward_pre_hook and its kin): code
# every module's call runs, read like a forward; the guards keep their handles (Guards.hooks)
_GLOBAL_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                 "_global_backward_hooks")


def global_hooks() -> tuple[dict, ...]:
    """torch's dicts of global module hooks (``_GLOBAL_HOOKS``), by handle id.

    >>> [len(d) for d in global_hooks()]
    [0, 0, 0, 0]
    """
    from torch.nn.modules import module

    return tuple(getattr(module, name) for name in _GLOBAL_HOOKS)


MAX_TENSOR_VALUES = 4096  # a global tensor up to this size is kept by value too (found again after unpickling)


class TensorRef:
    """A tensor the members' code reads as a module global or class attribute (Note [State a forward
    reads]): export bakes its values into the graph as a constant. Guarded by identity and version
    (``Tensor._version`` counts its in-place changes: ``MASK.mul_(2)`` fails the guard); a copy
    of a small one's values (at most ``MAX_TENSOR_VALUES``) lets a tensor of the same values match
    (the values changed back, or found again after unpickling).

    >>> t = torch.ones(3); ref = TensorRef(t)
    >>> ref.matches(t), ref.matches(t.clone()), ref.matches(t.mul_(2))
    (True, True, False)
    """

    __slots__ = ("tensor", "version", "values")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor, self.version = t, t._version
        self.values = t.detach().clone() if t.numel() <= MAX_TENSOR_VALUES and t.layout is torch.strided else None

    def __getstate__(self) -> tuple:
        return (self.values,)

    def __setstate__(self, state: tuple) -> None:
        self.tensor, self.version, self.values = None, -1, state[0]

    def matches(self, t: Any) -> bool:
        """Whether ``t`` is this tensor unchanged, or a tensor of its dtype, shape, device and values.
        Traced by torch.compile (Note [A global tensor inside torch.compile]): of its dtype, shape and
        device, the values asserted at run time (:meth:`traced`)."""
        if not isinstance(t, torch.Tensor):
            return False
        if torch.compiler.is_compiling():
            v = self.values
            return v is not None and t.dtype == v.dtype and t.shape == v.shape and t.device == v.device
        if t is self.tensor and t._version == self.version:
            return True
        v = self.values
        return (v is not None and t.dtype == v.dtype and t.shape == v.shape and t.device == v.device
                and t.layout == v.layout and bool(torch.equal(t.detach(), v)))

    def traced(self, t: Any, where: str) -> bool:
        """The check of ``t`` in a call torch.compile traces (Note [A global tensor inside
        torch.compile]): False where it is not a tensor of the kept dtype, shape and device (or no
        values are kept), else True, with the values compared at run time by an assertion in the
        compiled graph that names ``where``."""
        if not self.matches(t):
            return False
        torch._assert_async((t.detach() == self.values).all(), assert_message(
            f"wide_compiler: {where}, a tensor the members' code reads, changed since torch.compile traced this "
            f"graph: call the wide model once outside torch.compile, then torch._dynamo.reset() (Note [A global "
            f"tensor inside torch.compile])"))
        return True

    def adopt(self, t: torch.Tensor) -> None:
        """From now on the fast check (identity and version) is of ``t`` (which :meth:`matches`)."""
        self.tensor, self.version = t, t._version

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TensorRef) and self.matches(other.tensor)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        t = self.tensor if self.tensor is not None else self.values
        return "a tensor" if t is None else f"a tensor {t.dtype} {list(t.shape)}"


def _kept(v: Any) -> Any:
    """What a guard keeps of a value the members' code reads (Note [State a forward reads]): a plain
    value itself, a function as a :class:`FunctionRef`, a tensor as a :class:`TensorRef`, a mutable
    container's :class:`Contents`; None when it cannot be guarded."""
    if _plain(v):
        return v
    if isinstance(v, _FUNCTIONS):
        return FunctionRef(v)
    if isinstance(v, torch.Tensor):
        return TensorRef(v)
    return Contents.of(v)


def _plain_instance(v: Any) -> bool:
    """A ``SimpleNamespace`` or an instance of a user's plain class (not a module, function, class,
    nn.Module or tensor)."""
    return isinstance(v, types.SimpleNamespace) or (
        hasattr(v, "__dict__") and type(v).__module__ not in ("builtins", "torch") and not isinstance(
            v, (types.ModuleType, type, types.FunctionType, types.MethodType, torch.nn.Module, torch.Tensor,
                functools.partial)))


_CELL = ".<cell>"  # the qualname of a watched closure variable: its function's, then this
_ENVIRON = "<environ>"  # the qualname of a watched environment variable (module "os", name the key)


def _access(owner: str, qualname: str, name: str) -> str:
    """The expression that reads a watched entry of ``owner`` (a name in generated code): a module
    global (``qualname`` empty) by key, a closure variable as its cell's contents, else an attribute.

    >>> _access("o", "", "K"), _access("o", "Cfg", "K"), _access("o", "make.<locals>.f.<cell>", "v")
    ("o['K']", 'o.K', 'o.cell_contents')
    """
    if not qualname:
        return f"{owner}[{name!r}]"
    if qualname == _ENVIRON:
        return f"{owner}.get({name!r})"
    return f"{owner}.cell_contents" if qualname.endswith(_CELL) else f"{owner}.{name}"


def _where(module: str, qualname: str, name: str) -> str:
    """A watched entry for a message: ``module.Class.name``, or the closure variable it is."""
    if qualname.endswith(_CELL):
        return f"the closure variable {name!r} of {module}.{qualname.removesuffix(_CELL)}"
    if qualname == _ENVIRON:
        return f"os.environ[{name!r}]"
    return f"{module}.{qualname + '.' if qualname else ''}{name}"


def _read(owner: Any, qualname: str, name: str, value: Any) -> Any:
    """The watched entry's value now, as kept (:class:`Contents` for a mutable one)."""
    if not qualname:
        now = owner[name]
    elif qualname == _ENVIRON:
        now = owner.get(name)  # None where unset
    else:
        now = owner.cell_contents if qualname.endswith(_CELL) else getattr(owner, name)
    return Contents.of(now) if isinstance(value, Contents) else now


def _matches(now: Any, value: Any) -> bool:
    """Whether ``now`` (as :func:`_read` gives it) is the watched ``value`` for the program."""
    if isinstance(value, (FunctionRef, TensorRef)):
        return value.matches(now)
    return same_value(now, value)


def _shown(now: Any) -> str:
    """A value read now, for a message (a tensor by its kind, not its values)."""
    if isinstance(now, torch.Tensor):
        return f"a tensor {now.dtype} {list(now.shape)} (another one, or changed in place)"
    return repr(FunctionRef(now)) if isinstance(now, _FUNCTIONS) else repr(now)


# classes defined inside a function (``make.<locals>.Block``) that a guard of this process watched,
# by (module, qualified name): such a class cannot be found by its name, so a guard read back from
# the compile cache in the process that compiled it finds it here (the latest of that name)
_LOCAL_CLASSES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def remember_owners(owners: Any) -> None:
    """Keep the classes among a guard's live ``owners`` that :func:`_owner_of` cannot find by name."""
    for owner in owners:
        if isinstance(owner, type) and "<locals>" in owner.__qualname__:
            _LOCAL_CLASSES[(owner.__module__, owner.__qualname__)] = owner


def _owner_of(module: str, qualname: str, name: str = "") -> Any:
    """The dict of module ``module`` (``qualname`` empty), its class ``qualname``, or the cell of
    the closure variable ``name`` of its function ``qualname`` + ``_CELL`` (a function found by its
    qualified name: a decorated method, not one a factory made); a class defined inside a function
    that a guard of this process watched (``remember_owners``); None when not found (the guard
    then fails: the graph is captured again)."""
    if qualname == _ENVIRON:
        return os.environ
    mod = sys.modules.get(module)
    if mod is None:
        return None
    if not qualname:
        return vars(mod)
    owner: Any = mod
    for part in qualname.removesuffix(_CELL).split("."):
        owner = getattr(owner, part, None)
        if owner is None:
            return None if qualname.endswith(_CELL) else _LOCAL_CLASSES.get((module, qualname))
    if qualname.endswith(_CELL):
        code, closure = getattr(owner, "__code__", None), getattr(owner, "__closure__", None)
        if code is None or closure is None or name not in code.co_freevars:
            return None
        return closure[code.co_freevars.index(name)]
    return owner
