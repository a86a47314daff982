"""The assumptions a captured graph makes of its inputs, kept with the graph and checked at every call.

Note [Guards]
~~~~~~~~~~~~~
``torch.export`` traces member 0 on one sample. The graph it returns is right only for inputs
like that sample in every way the member's Python looked at: the sizes export kept dynamic within
the ranges and relations it derived (a branch ``if T % 2 == 0`` holds for even ``T`` only; two
inputs whose lengths were compared stay equal), sizes it fixed equal to the sample's, dtypes equal
to the sample's (a branch on ``mask.dtype`` leaves no trace in the graph), and no dynamic size 0 or
1: export assumes a dynamic size is at least 2 and records no guard for a test such as ``T == 1``
or for a ``squeeze`` that did not squeeze it (its "0/1 specialisation"), so a graph captured with
``T = 5`` runs the ``T != 1`` branch for ``T = 1``.

:func:`guards_of` turns those facts into one :class:`Guards` object per graph, checked at every
call before the graph runs (:meth:`Guards.holds`: one generated Python function over the inputs'
member shapes, each input's shape read once; ``tools/bench_guards.py``, 5 inputs, 14 guards, one
core of a busy 2-core machine: 9 µs, from 27 µs when it read ``x.shape`` for every guard;
:meth:`Guards.failed` names the one a call fails):

* export's own guards (``ExportedProgram._guards_code``: divisibility, parity, relations between
  sizes, tests of a size against a constant) with its names of the inputs (``L['x'].size()[1]``)
  mapped to the flat user inputs;
* for every dim export kept dynamic: its range (``range_constraints``), at least 2, and equal to
  every other dim export found equal to it (the same symbol); a dim given as an expression of a
  symbol (``2*s0 + 1``) is checked against that expression;
* every tensor input's dtype as captured;
* the grad mode, where the forward read it (``torch.is_grad_enabled()``: Note [What export does not
  capture] in fx/export_watch.py); a graph for the other mode is captured under that mode.

A call outside them is never run on the graph: :class:`~wide_compiler.WideModel` looks for a
graph of that mode captured for such inputs, or captures one with the call itself as the sample
(member 0's slice of it; a size 0 or 1 is then captured as the fixed size it is), keeping at most
:data:`MAX_GRAPHS` graphs per mode as ``torch.compile`` bounds its recompiles, and refuses past
that with the failed guard named. Sizes fixed at capture and the structure of the inputs are
checked with their own messages first (``WideModel._check_input``).

A guard of export's that names an input this module cannot map (a stride, an input path it does
not know) is not dropped: the graph then holds only for inputs of exactly the captured sizes.

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
  ``self.child.scale_it(h)``, ``super().helper(x)``); the functions the module holds; and the
  functions they load as globals, transitively. An attribute read anywhere there (``mod.K`` in a
  helper handed the module) is guarded as a class attribute of every module class of the tree
  (the user's own, not an installed package's) that defines it: over-guarding a class attribute
  that never changes costs an ``is`` per call, missing one would run a stale graph. Bounded:
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
* **requires_grad**: where the code reads an attribute ``requires_grad`` (``2 if x.requires_grad
  else 3``), every tensor input's ``requires_grad`` as captured (a graph for the other is captured
  with the call's inputs as they are).

The contents of a mutable global or class attribute the code reads (a dict, a list, a
``SimpleNamespace`` or a plain object: ``CFG["act"]``, ``cfg.scale``) are guarded by value
(:class:`Contents`: at most ``MAX_CONTENTS`` plain values, compared at each call, a few
microseconds); one whose contents are not plain values is named in a warning at capture: a change
to it after compiling is not seen.

Not guarded (documented limits): mutable objects whose contents are not plain values (above),
values reached through an attribute of another module
(``helpers.SCALE``; a module global that is a module is not followed), functions called through
such attributes or through objects other than the modules of the tree, the values in closure
cells (the functions in them are read), ``globals()["NAME"]``, names the members' code
writes itself (a call counter: ``global CALLS; CALLS += 1``; guarding it would capture again at
every call), instance attributes (per-member constants cover those: Note [Per-member
constants]), ``torch.backends.*`` flags (capture runs with cuDNN off, on purpose), and state read
in torch's or wide_compiler's own code. ``torch.compiler.is_compiling()`` needs no guard: the
user's code gets False at capture, as each member alone does (Note [What export does not
capture] in fx/export_watch.py); ``torch.jit.is_scripting()`` and ``torch.jit.is_tracing()`` are False
both in export and in a member's eager call.

A :class:`Guards` pickles as plain data (a compile cache keeps it on disk): the live dicts and
classes of the watched globals are found again by module name and class qualified name when it is
loaded (``_owner_of``; one not found, such as a class defined inside a function, fails its guard, so
the graph is captured again rather than run unchecked), and the device and flag readers by name.
"""

from __future__ import annotations

import dataclasses
import dis
import enum
import inspect
import logging
import math
import re
import sys
import types
from collections.abc import Sequence
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.utils._pytree import MappingKey, SequenceKey, keystr, tree_flatten, tree_flatten_with_path

__all__ = ["FLAG_READERS", "MAX_GRAPHS", "Guards", "finite_bound", "globals_read", "guards_of", "layout_of",
           "member_layout", "same_value"]

log = logging.getLogger(__name__)

MAX_GRAPHS = 8  # graphs kept per train/eval mode (the first capture and those for other inputs)
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


def layout_of(shape: Sequence[int], stride: Sequence[int]) -> tuple:
    """A tensor's memory layout as Python can observe it, for a guard: ``("dense", order)`` for a
    dense non-overlapping tensor (its dims of size > 1 from the largest stride; with the sizes this
    determines every stride, hence every answer of ``is_contiguous`` in any memory format), else
    ``("strided", strides)``.

    >>> layout_of((2, 3), (3, 1)), layout_of((2, 3), (1, 2)), layout_of((2, 3), (0, 1))
    (('dense', (0, 1)), ('dense', (1, 0)), ('strided', (0, 1)))
    """
    dims = [d for d, size in enumerate(shape) if size != 1]
    order = tuple(sorted(dims, key=lambda d: (-stride[d], -d)))
    expected = 1
    for d in reversed(order):
        if stride[d] != expected:
            return ("strided", tuple(stride))
        expected *= shape[d]
    return ("dense", order)


def member_layout(x: torch.Tensor) -> tuple:
    """:func:`layout_of` one member's slice ``x[i]`` of an N-first input (every member's is the same).

    >>> member_layout(torch.zeros(3, 4, 5)), member_layout(torch.zeros(3, 4, 5).transpose(1, 2))
    (('dense', (0, 1)), ('dense', (1, 0)))
    """
    return layout_of(x.shape[1:], x.stride()[1:])


def _hint(v: Any) -> int:
    return int(v.node.hint) if isinstance(v, torch.SymInt) else int(v)


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
    ``kind`` (``dict``, ``list`` or ``object``: a namespace or plain object's attributes) and
    its items, plain values or functions (as :class:`FunctionRef`: a registry); guarded by value."""

    kind: str
    items: tuple

    def __repr__(self) -> str:
        if self.kind == "list":
            return repr(list(self.items))
        shown = repr(dict(self.items))
        return shown if self.kind == "dict" else f"an object with attributes {shown}"

    @staticmethod
    def of(v: Any) -> Contents | None:
        """The contents of ``v``; None when it is not a dict, list, namespace or plain object of
        at most ``MAX_CONTENTS`` plain values or functions."""
        if type(v) is dict:
            kind, items = "dict", tuple(v.items())
        elif type(v) is list:
            kind, items = "list", tuple(v)
        elif _plain_instance(v):
            kind, items = "object", tuple(vars(v).items())
        else:
            return None
        if len(items) > MAX_CONTENTS:
            return None
        if kind == "list":
            items = tuple(_plain_or_ref(x) for x in items)
        else:
            items = tuple((k, _plain_or_ref(x)) for k, x in items)
        if not all(_plain(x) or isinstance(x, FunctionRef) for x in (items if kind == "list" else sum(items, ()))):
            return None
        return Contents(kind, items)


def _values(c: Contents) -> list[Any]:
    """The values of a :class:`Contents` (a dict's or an object's without their keys)."""
    return list(c.items) if c.kind == "list" else [x for _, x in c.items]


def _plain_or_ref(v: Any) -> Any:
    """``v`` as a guard keeps it inside :class:`Contents`: a function as its :class:`FunctionRef`."""
    return FunctionRef(v) if isinstance(v, _FUNCTIONS) else v


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
    import hashlib
    import marshal

    code = getattr(fn, "__code__", None)
    digest: str | None = type(fn).__name__
    if code is not None:
        defaults = (getattr(fn, "__defaults__", None) or (), tuple(sorted((getattr(fn, "__kwdefaults__", None) or {}).items())))
        if getattr(fn, "__closure__", None) or not _plain(defaults):
            digest = None  # values the digest would not see
        else:
            try:
                digest = hashlib.sha256(marshal.dumps(code) + repr(defaults).encode()).hexdigest()[:16]
            except ValueError:
                digest = None
    return (str(getattr(fn, "__module__", None)), str(getattr(fn, "__qualname__", getattr(fn, "__name__", "?"))), digest)


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
        """Whether ``t`` is this tensor unchanged, or a tensor of its dtype, shape, device and values."""
        if not isinstance(t, torch.Tensor):
            return False
        if t is self.tensor and t._version == self.version:
            return True
        v = self.values
        return (v is not None and t.dtype == v.dtype and t.shape == v.shape and t.device == v.device
                and t.layout == v.layout and bool(torch.equal(t.detach(), v)))

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
            v, (types.ModuleType, type, types.FunctionType, types.MethodType, torch.nn.Module, torch.Tensor)))


def _users_mutable(v: Any, filename: str) -> bool:
    """A mutable object that code in ``filename`` reads, to be named in a warning when a guard
    cannot read into it: the user's own code (not an installed package's: their registries and
    loggers are theirs) reading a container or an instance of the user's own class."""
    from .source import is_user_file

    if "site-packages" in filename or "dist-packages" in filename:
        return False
    if isinstance(v, (dict, list, set, types.SimpleNamespace)):
        return True
    home = getattr(sys.modules.get(type(v).__module__), "__file__", None) or ""
    return _plain_instance(v) and bool(home) and is_user_file(home, skip_stdlib=True) and "-packages" not in home


_MUTATORS = frozenset({"append", "extend", "insert", "remove", "pop", "clear", "update", "setdefault", "popitem",
                       "add", "discard", "sort", "reverse", "__setitem__", "__delitem__"})


def _written_into(instructions: list[Any]) -> set[str]:
    """The globals the code changes in place, on the line that loads them (``STATS["calls"] += 1``,
    ``CACHE.append(x)``, ``cfg.seen = True``): state the forward keeps, as a name it assigns is
    (guarding its contents would capture again at every call). A line that also writes into
    another object counts too: that global's contents are then left unguarded."""
    out: set[str] = set()
    line: list[Any] = []
    for ins in [*instructions, None]:
        if ins is None or (ins.starts_line and line):
            loaded = [i for i, x in enumerate(line) if x.opname == "LOAD_GLOBAL" and isinstance(x.argval, str)]
            writes = any(x.opname in ("STORE_SUBSCR", "DELETE_SUBSCR", "STORE_ATTR") for x in line)
            for i in loaded:
                after = line[i + 1] if i + 1 < len(line) else None
                mutator = after is not None and after.opname in ("LOAD_ATTR", "LOAD_METHOD") and after.argval in _MUTATORS
                if writes or mutator:
                    out.add(line[i].argval)
            line = []
        if ins is not None:
            line.append(ins)
    return out


def _read(owner: Any, qualname: str, name: str, value: Any) -> Any:
    """The watched entry's value now, as kept (:class:`Contents` for a mutable one)."""
    now = getattr(owner, name) if qualname else owner[name]
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


def _owner_of(module: str, qualname: str) -> Any:
    """The dict of module ``module`` (``qualname`` empty) or its class ``qualname``; None when
    neither is found (the guard then fails: the graph is captured again)."""
    mod = sys.modules.get(module)
    if mod is None:
        return None
    if not qualname:
        return vars(mod)
    owner: Any = mod
    for part in qualname.split("."):
        owner = getattr(owner, part, None)
        if owner is None:
            return None
    return owner


def globals_read(model: torch.nn.Module) -> tuple[list[tuple[str, str, str, Any]], list[Any], list[str]]:
    """Note [State a forward reads]: the module globals and class attributes that the code of
    ``model``'s module classes reads, with values a guard can keep: ``(entries, owners, readers)``,
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
    functions the module holds, and the functions they load as globals or find in a registry (a
    dict of functions), transitively (at most ``MAX_CODES`` code objects, ``MAX_WATCHED`` values).
    A name loaded as an attribute (``self.SCALE``, ``mod.K`` in a helper handed the module) counts
    as a class attribute of the module's class when the instance has no attribute of that name,
    and of any other module class of the tree (the user's own) that defines it: over-guarding a
    class attribute that never changes costs an ``is`` per call. A name the code writes
    (``STORE_GLOBAL``, ``STORE_ATTR``) is left out: it is state the forward keeps, not a setting.

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
        fn = v.fget if isinstance(v, property) else getattr(v, "__func__", v)
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
    for m in model.modules():
        classes.setdefault(type(m), m)
        for v in vars(m).values():  # functions held by the instance (self.act = fn)
            if isinstance(v, types.FunctionType):
                follow(v, None)
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
        elif _users_mutable(v, code.co_filename):
            unguarded.setdefault((id(cls), name), f"{cls.__qualname__}.{name}")

    def on_classes(name: str, code: types.CodeType) -> None:
        """``name`` read as an attribute: on every module class of the tree (the user's) defining it."""
        for cls, rep in classes.items():
            definers = [k for k in cls.__mro__ if name in vars(k)]
            if not definers or not user_class(definers[0]):
                continue
            attribute(cls, name, vars(definers[0])[name], code, rep)
            for k in definers[1:]:  # super().name: a base class's method
                v = vars(k)[name]
                if user_class(k) and isinstance(v, (types.FunctionType, staticmethod, classmethod, property)):
                    follow(v, rep)

    seen: set[tuple[Any, Any]] = set()  # (code, the module's class): instances of a class read the same names
    done: set[tuple[Any, type]] = set()  # (function, reading class) read already
    names_seen: set[str] = set()  # attribute names looked up on every module class already
    codes = 0
    while work:
        fn, m = work.pop()
        if (fn, type(m)) in done:
            continue
        done.add((fn, type(m)))
        stack = [fn.__code__]
        work.extend((c, m) for c in cells(fn) if user_fn(c))  # a decorator's wrapper: the function it calls
        while stack:
            code = stack.pop()
            if (code, type(m)) in seen:
                continue
            seen.add((code, type(m)))
            codes += 1
            if codes > MAX_CODES:
                log.debug("wide_compiler: more than %d code objects in the members' classes: the globals the "
                          "rest read are not guarded", MAX_CODES)
                work.clear()
                break
            stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
            g = fn.__globals__
            instructions = list(dis.get_instructions(code))
            mutated.update(_written_into(instructions))
            for ins in instructions:
                name = ins.argval
                if not isinstance(name, str):
                    continue
                if ins.opname in ("STORE_GLOBAL", "STORE_ATTR", "DELETE_GLOBAL", "DELETE_ATTR"):
                    stored.add(name)
                elif ins.opname == "LOAD_GLOBAL" and name in g:
                    v = g[name]
                    if id(v) in reader_names:
                        if reader_names[id(v)] not in readers:
                            readers.append(reader_names[id(v)])
                        continue
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
                    elif _users_mutable(v, code.co_filename):
                        unguarded.setdefault((id(g), name), f"{g.get('__name__')}.{name}")
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
    found = [(e, o) for (_, name), (e, o) in entries.items()
             if name not in stored and not (isinstance(e[3], Contents) and name in mutated)]
    missed = [where for (_, name), where in unguarded.items() if name not in stored and name not in mutated]
    if missed:
        log.warning("wide_compiler: the members' code reads %s, mutable and holding more than %d values or values "
                    "that are not plain (numbers, strings, tuples of them, functions): a change to %s after "
                    "compiling is not seen by the compiled graphs (Note [State a forward reads]); compile again "
                    "after changing it", ", ".join(missed), MAX_CONTENTS, "it" if len(missed) == 1 else "them")
    if len(found) > MAX_WATCHED:
        log.warning("wide_compiler: the members' code reads %d module globals and class attributes; the first %d "
                    "are guarded (Note [State a forward reads])", len(found), MAX_WATCHED)
        found = found[:MAX_WATCHED]
    if reads_grad:
        readers.append("requires_grad")
    return [e for e, _ in found], [o for _, o in found], readers


@dataclasses.dataclass
class Guards:
    """What a graph assumes of its flat user inputs (Note [Guards]). ``failed(flat)`` is None
    for inputs within them, else the first guard they fail, as text."""

    n: int  # members: every tensor input's dim 0
    dtypes: tuple[torch.dtype | None, ...]  # per flat user input: its dtype as captured (None: no tensor)
    # per flat user input: (rank, {dim: size} of the dims captured fixed) of one member's tensor, or the value
    fixed: tuple[Any, ...]
    names: tuple[str, ...]  # per flat user input: its placeholder name (for messages)
    code: tuple[str, ...]  # the shape guards as Python over ``s`` (``s[k]``: input k's member shape or value)
    shown: tuple[str, ...]  # the same guards over the inputs' names, for messages
    # the grad mode the capture ran under, where the forward read it (torch.is_grad_enabled()); else None
    grad_mode: bool | None = None
    # per flat user input: a floating input captured in the parameters' dtype, which follows the
    # model's dtype after .to()/.double() (checked against the parameters' dtype at the call)
    follows: tuple[bool, ...] = ()
    # Note [State a forward reads]: ((reader, args), value) of every FLAG_READERS flag the forward read
    flags: tuple[tuple[tuple[str, tuple], Any], ...] = ()
    # per flat user input: one member's memory layout as captured (layout_of; None: not a tensor),
    # where the forward read a layout (Tensor.is_contiguous, Tensor.stride); else ()
    layout: tuple[Any, ...] = ()
    # per flat user input: "" for a tensor on the parameters' device at capture (it must be on their
    # device at the call), else the device it was captured on (str); None: not a tensor
    devices: tuple[str | None, ...] = ()
    # the parameters' device at capture (str), where the forward read a tensor's device; else None
    device: str | None = None
    # (module, class qualname or "", name, value): a module global or class attribute the members'
    # code reads, with its value as captured (a plain immutable value, Contents, FunctionRef, TensorRef)
    watched: tuple[tuple[str, str, str, Any], ...] = ()
    # per flat user input: its requires_grad as captured (None: not a tensor), where the forward
    # reads an attribute ``requires_grad`` (Note [State a forward reads]); else ()
    grads: tuple[bool | None, ...] = ()
    _fn: Any = dataclasses.field(default=None, repr=False, compare=False)
    _each: Any = dataclasses.field(default=None, repr=False, compare=False)
    # the live dict or class of each ``watched`` entry (found again by name after unpickling)
    _owners: Any = dataclasses.field(default=None, repr=False, compare=False)
    _ns: Any = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

        # over the N-first inputs f: s[k][d] (one member's dim d) is f[k].shape[d + 1], read once into
        # _S{k} by the structure check before it (the conjunction evaluates left to right)
        def wide(c: str) -> str:
            c = re.sub(r"s\[(\d+)\]\[(\d+)\]", lambda m: f"_S{m[1]}[{int(m[2]) + 1}]", c)
            return re.sub(r"s\[(\d+)\]", r"f[\1]", c)

        if self._owners is None:
            self._owners = tuple(_owner_of(module, qualname) for module, qualname, _, _ in self.watched)
        # the fast path (Guards.holds): the structure and fixed-size checks of the call, then the guards
        head = []
        for k, (dtype, fixed) in enumerate(zip(self.dtypes, self.fixed)):
            if dtype is None:
                head.append(f"f[{k}] == _v{k}")
                continue
            rank, sizes = fixed
            dt = "pdt" if k < len(self.follows) and self.follows[k] else f"_dt{k}"
            head.append(f"(_X{k} := f[{k}]).dtype is {dt} and len(_S{k} := _X{k}.shape) == {rank + 1} "
                        f"and _S{k}[0] == {self.n}")
            head.extend(f"_S{k}[{d + 1}] == {v}" for d, v in sizes.items())
            if k < len(self.devices):  # Note [State a forward reads]: the device
                head.append(f"_X{k}.device == pdev" if self.devices[k] == "" else f"_X{k}.device == _dev{k}")
            if k < len(self.layout):
                head.append(f"member_layout(_X{k}) == _lay{k}")
            if k < len(self.grads):
                head.append(f"_X{k}.requires_grad is {self.grads[k]}")
        namespace = {**SYMPY_INTERP, "math": math, "member_layout": member_layout,
                     **{f"_dt{k}": d for k, d in enumerate(self.dtypes)},
                     **{f"_v{k}": v for k, v in enumerate(self.fixed) if self.dtypes[k] is None},
                     **{f"_dev{k}": torch.device(d) for k, d in enumerate(self.devices) if d},
                     **{f"_lay{k}": v for k, v in enumerate(self.layout)}}
        if self.device is not None:
            head.append("pdev == _pdev")
            namespace["_pdev"] = torch.device(self.device)
        for j, ((reader, args), value) in enumerate(self.flags):
            head.append(f"_fr{j}(*_fa{j}) == _fv{j}")
            namespace.update({f"_fr{j}": FLAG_READERS[reader], f"_fa{j}": args, f"_fv{j}": value})
        for j, ((_, qualname, name, value), owner) in enumerate(zip(self.watched, self._owners)):
            read = f"_o{j}.{name}" if qualname else f"_o{j}[{name!r}]"
            # a mutable value's contents, compared at each call; a tensor by identity and version (its
            # in-place changes); else the value itself (a function: the one captured), by identity
            if isinstance(value, Contents):
                head.append(f"_same(_contents({read}), _w{j})")
            elif isinstance(value, TensorRef):
                head.append(f"(_t{j} := {read}) is _w{j}.tensor and _t{j}._version == _w{j}.version")
            else:
                head.append(f"{read} is _w{j}")
            try:  # an equal object there now (after unpickling): the fast path checks that one
                now = _read(owner, qualname, name, value)
                if isinstance(value, TensorRef):
                    if value.tensor is None and value.matches(now):
                        value.adopt(now)
                elif isinstance(value, FunctionRef):
                    value = now if value.matches(now) else value.fn if value.fn is not None else object()
                else:
                    value = now if same_value(now, value) else value
            except (AttributeError, KeyError, TypeError):
                value = object() if isinstance(value, FunctionRef) and value.fn is None else value
            if isinstance(value, FunctionRef):
                value = value.fn if value.fn is not None else object()
            namespace.update({f"_o{j}": owner, f"_w{j}": value, "_same": same_value, "_contents": Contents.of})
        body = " and ".join([*head, *(f"({wide(c)})" for c in self.code)]) or "True"
        each = ", ".join(f"lambda s: {c}" for c in self.code)
        # our own generated code: the conjunction (each call), and each guard alone (to name the failed one)
        exec(f"def _holds(f, pdt, pdev):\n    return {body}\n_each = ({each}{',' if self.code else ''})\n",  # noqa: S102
             namespace)
        self._fn = namespace["_holds"]
        self._each = namespace["_each"]
        self._ns = namespace

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_fn", "_each", "_owners", "_ns")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update({"_owners": None, "grads": (), **state})
        self.__post_init__()

    def holds(self, flat: Any, pdt: torch.dtype | None = None, pdev: torch.device | None = None) -> bool:
        """Whether ``flat`` (the N-first user inputs, flat as the graph takes them) is nested, sized
        and typed as captured and within every guard: the one check of a call in the common case
        (the call's own checks give the reason where it is False). ``pdt`` and ``pdev``: the model's
        parameters' dtype and device now (what the inputs that follow them must have)."""
        if self.grad_mode is not None and torch.is_grad_enabled() != self.grad_mode:
            return False
        try:
            return bool(self._fn(flat, pdt, pdev))
        except Exception:  # noqa: BLE001 -- anything unexpected (a rank, a type): the slow checks say what
            return False

    def failed(self, flat: Any, pdt: torch.dtype | None = None, pdev: torch.device | None = None) -> str | None:
        """None when ``flat`` (the N-first user inputs, flat as the graph takes them) is within
        these guards, else a description of the first one it fails. Raises ValueError for an input
        on another device than the parameters' (no capture can take it: Note [State a forward
        reads])."""
        if self.grad_mode is not None and torch.is_grad_enabled() != self.grad_mode:
            return (f"the forward reads the grad mode, captured with gradients "
                    f"{'enabled' if self.grad_mode else 'disabled'}")
        s = []
        for k, (x, dtype, name) in enumerate(zip(flat, self.dtypes, self.names)):
            if dtype is None:
                s.append(x)
                continue
            if k < len(self.follows) and self.follows[k]:
                dtype = pdt
            if not isinstance(x, torch.Tensor) or x.dtype != dtype:
                return f"input '{name}' is {getattr(x, 'dtype', type(x).__name__)}, captured as {dtype}"
            want = (pdev if self.devices[k] == "" else torch.device(self.devices[k])) if k < len(self.devices) else None
            if want is not None and x.device != want:
                where = "the model's parameters are" if self.devices[k] == "" else "it was captured"
                raise ValueError(f"wide_compiler: input '{name}' is on {x.device}, but {where} on {want}: the "
                                 f"wide model runs on one device, as each member does; move the input there "
                                 f"({name}.to('{want}')) or the model to its device")
            if k < len(self.layout) and member_layout(x) != self.layout[k]:
                return (f"input '{name}' has another memory layout than captured (one member's strides "
                        f"{list(x.stride()[1:])}: {member_layout(x)[0]}, captured {self.layout[k][0]}), and the "
                        f"forward reads a layout (Tensor.is_contiguous or Tensor.stride)")
            if k < len(self.grads) and x.requires_grad is not self.grads[k]:
                return (f"input '{name}' has requires_grad={x.requires_grad}, captured with "
                        f"requires_grad={self.grads[k]}, and the forward reads an attribute requires_grad")
            s.append(x.shape[1:])
        if self.device is not None and pdev is not None and pdev != torch.device(self.device):
            return (f"the forward reads a tensor's device, captured with the parameters on {self.device}; "
                    f"they are on {pdev} now")
        for (reader, args), value in self.flags:
            now = FLAG_READERS[reader](*args)
            if now != value:
                return (f"the forward reads torch.{reader}({', '.join(map(repr, args))}), {value!r} at "
                        f"capture and {now!r} now")
        for j, ((module, qualname, name, value), owner) in enumerate(zip(self.watched, self._owners)):
            where = f"{module}.{qualname + '.' if qualname else ''}{name}"
            try:
                now = _read(owner, qualname, name, value)
            except (AttributeError, KeyError, TypeError):
                return f"{where}, which the members' code reads, is no longer found (captured as {value!r})"
            if not _matches(now, value):
                return f"{where}, which the members' code reads, is {_shown(now)} now, captured as {value!r}"
            if isinstance(value, TensorRef):
                value.adopt(now)  # the same values: the fast path checks this tensor and version from now on
            else:
                self._ns[f"_w{j}"] = now  # an equal object: the fast path checks that one from now on
        for holds, shown in zip(self._each, self.shown):
            try:
                if holds(s):
                    continue
            except (IndexError, TypeError, ZeroDivisionError):
                pass
            return shown
        return None

    def describe(self) -> str:
        """The guards, one per line, over one member's inputs (``x.size()[1]`` is dim 1 of one
        member's ``x``: dim 2 of the N-first input)."""
        dtypes = [f"{n}.dtype == {d}" for n, d in zip(self.names, self.dtypes) if d is not None]
        state = [f"layout_of({n}) == {v}" for n, v in zip(self.names, self.layout) if v is not None]
        state += [f"torch.{r}({', '.join(map(repr, a))}) == {v!r}" for (r, a), v in self.flags]
        state += [f"parameters' device == {self.device}"] if self.device is not None else []
        state += [f"{m}.{q + '.' if q else ''}{name} == {v!r}" for m, q, name, v in self.watched]
        state += [f"{n}.requires_grad is {g}" for n, g in zip(self.names, self.grads) if g is not None]
        return "\n".join([*dtypes, *self.shown, *state])


def _input_paths(model: torch.nn.Module, sample: tuple[tuple, dict], signature: inspect.Signature | None
                 ) -> list[list[str]]:
    """Per flat user input (in the order of ``tree_flatten(sample)``): the names export's guards
    may give it (``L['x']``, ``L['args'][0]`` and ``L['args_0']`` for a ``*args`` forward)."""
    args, kwargs = sample
    try:
        sig = signature or inspect.signature(model.forward)
        params = list(sig.parameters.values())
    except (TypeError, ValueError):
        params = []
    P = inspect.Parameter
    positional = [p for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    var = next((p.name for p in params if p.kind is P.VAR_POSITIONAL), None)
    out = []
    for path, _ in tree_flatten_with_path((tuple(args), dict(kwargs)))[0]:
        where, key, rest = path[0], path[1], path[2:]
        names = []
        if isinstance(where, SequenceKey) and where.idx == 1 and isinstance(key, MappingKey):
            names.append(f"L{keystr((MappingKey(key.key), *rest))}")
        elif isinstance(key, SequenceKey):
            j = key.idx
            if j < len(positional):
                names.append(f"L{keystr((MappingKey(positional[j].name), *rest))}")
            elif var is not None:
                k = j - len(positional)
                names.append(f"L{keystr((MappingKey(var), SequenceKey(k), *rest))}")
                names.append(f"L{keystr((MappingKey(f'{var}_{k}'), *rest))}")
            names.append(f"L{keystr((MappingKey(f'args_{j}'), *rest))}")
        out.append(names)
    return out


def finite_bound(v: Any) -> int | None:
    """A range bound as an int; None for an infinite one."""
    try:
        return int(v) if bool(v.is_finite) else None
    except (TypeError, ValueError, OverflowError, AttributeError):
        return None


def _user_vals(ep: ExportedProgram) -> list[tuple[str, Any]]:
    from torch.export.graph_signature import InputKind

    nodes = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    out = []
    for spec in ep.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            name = getattr(spec.arg, "name", None)
            node = nodes.get(name) if name else None
            out.append((name or "input", node.meta.get("val") if node is not None else getattr(spec.arg, "value", None)))
    return out


def guards_of(ep: ExportedProgram, model: torch.nn.Module, sample: tuple[tuple, dict], n: int,
              signature: inspect.Signature | None = None) -> Guards:
    # (a floating input in the dtype of the model's parameters follows them: ``Guards.follows``)
    """The :class:`Guards` of ``ep``, the capture of ``model`` on ``sample`` (the args and kwargs
    export was given, ``signature`` the forward's as shown to export) for ``n`` members (Note
    [Guards])."""
    import sympy

    from torch.utils._sympy.printers import PythonPrinter

    vals = _user_vals(ep)
    names = tuple(n for n, _ in vals)
    dtypes = tuple(v.dtype if isinstance(v, torch.Tensor) else None for _, v in vals)
    fixed = tuple((v.dim(), {d: int(size) for d, size in enumerate(v.shape) if isinstance(size, int)})
                  if isinstance(v, torch.Tensor) else v for _, v in vals)
    code: list[str] = []
    shown: list[str] = []

    def add(c: str, s: str) -> None:
        code.append(c)
        shown.append(s)

    source: dict[Any, tuple[str, str]] = {}  # symbol -> (code, shown) of the size it was first read from
    deferred = []
    ranges = ep.range_constraints

    def bounds(sym: Any) -> tuple[int, int | None]:
        vr = ranges.get(sym)
        return max(finite_bound(vr.lower) or 0, 2) if vr is not None else 2, finite_bound(vr.upper) if vr is not None else None

    def check_range(c: str, s: str, sym: Any) -> None:
        lo, hi = bounds(sym)
        add(f"{c} >= {lo}", f"{s} >= {lo}")
        if hi is not None:
            add(f"{c} <= {hi}", f"{s} <= {hi}")

    for k, (name, val) in enumerate(vals):
        if not isinstance(val, torch.Tensor):
            continue
        for d, size in enumerate(val.shape):
            expr = getattr(getattr(size, "node", None), "expr", None)
            if expr is None or isinstance(size, int):
                continue  # a fixed size: checked by the structure and size check, with its own message
            c, s = f"s[{k}][{d}]", f"{name}.size()[{d}]"
            if isinstance(expr, sympy.Symbol):
                if expr in source:
                    add(f"{c} == {source[expr][0]}", f"{s} == {source[expr][1]}")
                else:
                    source[expr] = (c, s)
                    check_range(c, s, expr)
            else:
                deferred.append((c, s, expr, size))
    printer = PythonPrinter()
    for c, s, expr, size in deferred:
        free = list(expr.free_symbols)
        if len(free) == 1 and free[0] not in source:
            sym = free[0]
            try:  # a size a*sym + b read first here: sym from it, if it divides
                a, b = (int(v) for v in sympy.Poly(expr, sym).all_coeffs())
            except (sympy.PolynomialError, ValueError, TypeError):
                a = 0
            if a > 0 and sympy.Poly(expr, sym).degree() == 1:
                add(f"({c} - {b}) % {a} == 0", f"({s} - {b}) % {a} == 0")
                source[sym] = (f"(({c} - {b}) // {a})", f"(({s} - {b}) // {a})")
                check_range(*source[sym], sym)
                continue
        if all(f in source for f in free):
            sub_c = {f: sympy.Symbol(source[f][0]) for f in free}
            sub_s = {f: sympy.Symbol(source[f][1]) for f in free}
            add(f"{c} == {printer.doprint(expr.xreplace(sub_c))}", f"{s} == {printer.doprint(expr.xreplace(sub_s))}")
        else:  # not solvable here: the size as captured
            add(f"{c} == {int(size.node.hint)}", f"{s} == {int(size.node.hint)}")
    exact = False
    paths = _input_paths(model, sample, signature)
    for g in getattr(ep, "_guards_code", None) or ():
        c, s = g, g
        for k, alts in sorted(enumerate(paths), key=lambda kv: -max((len(a) for a in kv[1]), default=0)):
            for alt in alts:
                is_tensor = k < len(dtypes) and dtypes[k] is not None
                if is_tensor:
                    c = c.replace(f"{alt}.size()[", f"s[{k}][")
                    s = s.replace(f"{alt}.size()[", f"{names[k]}.size()[")
                else:
                    c = re.sub(re.escape(alt) + r"(?![\[.])", f"s[{k}]", c)
                    s = re.sub(re.escape(alt) + r"(?![\[.])", names[k], s)
        if "L[" in c:
            exact = True
            log.debug("wide_compiler: guard %r names an input it cannot map: the graph holds for the "
                      "captured sizes only", g)
            continue
        add(c, s)
    if exact:
        for k, (name, val) in enumerate(vals):
            if isinstance(val, torch.Tensor):
                for d, size in enumerate(val.shape):
                    if not isinstance(size, int):
                        hint = int(size.node.hint)
                        add(f"s[{k}][{d}] == {hint}", f"{name}.size()[{d}] == {hint} (as captured)")
    ref = next(model.parameters(), None)
    follows = tuple(d is not None and ref is not None and d.is_floating_point and d == ref.dtype for d in dtypes)
    # Note [State a forward reads]
    reads = getattr(ep, "wide_reads", None) or {}
    # the device the capture ran on: the capture model's where an input is there too, else the inputs'
    # (the capture model stays where it was compiled; a capture after .to() has the call's inputs)
    ref = ref if ref is not None else next(model.buffers(), None)
    on = [v.device for _, v in vals if isinstance(v, torch.Tensor)]
    ran = ref.device if ref is not None and (ref.device in on or not on) else on[0] if on else None
    devices = tuple(None if not isinstance(v, torch.Tensor)
                    else "" if ref is not None and v.device == ran else str(v.device) for _, v in vals)
    layout = tuple(layout_of([_hint(d) for d in v.shape], [_hint(d) for d in v.stride()])
                   if isinstance(v, torch.Tensor) else None for _, v in vals) if reads.get("layout") else ()
    watched, owners, readers = reads.get("globals") or globals_read(model)
    flags = dict(reads.get("flags", ()))
    for name in readers:  # a reader imported by name: its calls were not seen, so every variant
        for args in _BOUND_ARGS.get(name, ((),)) if name in FLAG_READERS else ():
            flags.setdefault((name, args), FLAG_READERS[name](*args))
    # a floating tensor the forward made without a dtype (torch.tensor(0.1)) is lifted in the default
    # dtype of capture time; each member alone makes it in the default dtype of its call
    default = torch.get_default_dtype()
    if any(isinstance(t, torch.Tensor) and t.dtype == default for t in (getattr(ep, "constants", None) or {}).values()):
        flags.setdefault(("get_default_dtype", ()), default)
    device = str(ran) if reads.get("device") and ran is not None else None
    # a forward that reads ``requires_grad`` (of an input, say): every tensor input's, as captured
    grads = tuple(bool(v.requires_grad) if isinstance(v, torch.Tensor) else None
                  for v in tree_flatten(sample)[0]) if "requires_grad" in readers else ()
    return Guards(n, dtypes, fixed, names, tuple(code), tuple(shown), reads.get("grad_mode"), follows,
                  tuple(flags.items()), layout, devices, device, tuple(watched), grads, _owners=tuple(owners))
