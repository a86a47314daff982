"""What the members' code reads besides its inputs -- module globals, class attributes, functions,
tensors, global flags -- found by reading the code a forward reaches, and how each is kept so that
the guards of fx/guards.py (Note [Guards]) can compare it at every call.

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
* **module globals and class attributes** (:func:`globals_read`): the plain immutable values
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
  ``MAX_CODES``, ``MAX_WATCHED``; 50-80 ms for a small GPT-2 or Llama on a busy machine (their
  decorated forwards are read, and the masking functions they call). Checked by identity (an
  ``is`` per value: tens of nanoseconds), then by type and value (:func:`same_value`: ``2`` is
  not ``2.0``), so ``mod.SCALE = 3.0`` after compiling captures a graph with 3.0, and setting it
  back reuses the first graph.
* **functions** read as globals or class attributes (``act(h)`` with ``act`` a module global):
  their identity (:class:`FunctionRef`), besides the globals their code reads, so ``act =
  torch.sin`` after compiling captures a graph with ``sin``. A dict or list of functions (a
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
"""

from __future__ import annotations

import dataclasses
import dis
import enum
import functools
import hashlib
import importlib.util
import inspect
import logging
import os
import sys
import types
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["FLAG_READERS", "Contents", "FunctionRef", "TensorRef", "globals_read", "same_value"]

log = logging.getLogger(__name__)

MAX_WATCHED = 128  # module globals and class attributes guarded per graph (Note [State a forward reads])
MAX_CODES = 512  # code objects the scan for them reads per capture

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
    function, a digest of its code; one loaded from a pickle matches the function of that name and
    code (one with a closure or defaults, whose values the digest does not see, matches nothing: its
    graph is captured again).

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

    def __repr__(self) -> str:
        return f"<function {self.key[0]}.{self.key[1]}>"


def _function_key(fn: Any) -> tuple:
    """(module, qualified name, digest of the code or None where the code does not say it all)."""
    from .code_digest import code_text

    code = getattr(fn, "__code__", None)
    digest: str | None = type(fn).__name__
    if code is not None:
        defaults = (getattr(fn, "__defaults__", None) or (), tuple(sorted((getattr(fn, "__kwdefaults__", None) or {}).items())))
        if getattr(fn, "__closure__", None) or not _plain(defaults):
            digest = None  # values the digest would not see
        else:
            digest = hashlib.sha256((code_text(code) + repr(defaults)).encode()).hexdigest()[:16]
    return (str(getattr(fn, "__module__", None)), str(getattr(fn, "__qualname__", getattr(fn, "__name__", "?"))), digest)


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
        torch._assert_async((t.detach() == self.values).all(),
                            f"wide_compiler: {where}, a tensor the members' code reads, holds other values than the "
                            f"graph torch.compile traced was captured with (changed in place or rebound since): the "
                            f"compiled call would run with the old values; call the wide model outside "
                            f"torch.compile once (it captures a graph for them), then torch._dynamo.reset() and "
                            f"compile again (Note [A global tensor inside torch.compile])")
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


def _owner_of(module: str, qualname: str, name: str = "") -> Any:
    """The dict of module ``module`` (``qualname`` empty), its class ``qualname``, or the cell of
    the closure variable ``name`` of its function ``qualname`` + ``_CELL`` (a function found by its
    qualified name: a decorated method, not one a factory made); None when not found (the guard
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
            return None
    if qualname.endswith(_CELL):
        code, closure = getattr(owner, "__code__", None), getattr(owner, "__closure__", None)
        if code is None or closure is None or name not in code.co_freevars:
            return None
        return closure[code.co_freevars.index(name)]
    return owner


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
    forward keeps, not a setting.

    >>> EPS = 1e-3
    >>> class Shifted(torch.nn.Module):
    ...     def forward(self, x):
    ...         return x + EPS
    >>> [entry[2:] for entry in globals_read(Shifted())[0]]
    [('EPS', 0.001)]
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

    def attribute(cls: type, name: str, v: Any, code: types.CodeType, m: Any) -> None:
        """A class attribute ``v`` of ``cls`` the code reads: guarded, named as unguarded, or followed."""
        if isinstance(v, (types.FunctionType, staticmethod, classmethod, property)):
            follow(v, m)  # a method or property that the code calls
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
                if not isinstance(name, str):
                    continue
                if ins.opname in ("STORE_GLOBAL", "STORE_ATTR", "DELETE_GLOBAL", "DELETE_ATTR"):
                    stored.add(name)
                elif ins.opname in ("STORE_DEREF", "DELETE_DEREF") and name in code.co_freevars:
                    stored.add(name)  # ``nonlocal calls; calls += 1``: state the code keeps
                elif ins.opname == "IMPORT_NAME" and "-packages" not in code.co_filename:
                    read_import(g, code, instructions, i, aliases)  # ``import cfgmod as c``, ``from cfgmod import X``
                elif ins.opname in ("LOAD_FAST", "LOAD_NAME") and isinstance(aliases.get(name), types.ModuleType):
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


