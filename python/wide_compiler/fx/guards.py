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

The state a forward reads besides its inputs (globals, class attributes, functions, tensors,
flags) is found by fx/code_reads.py and kept by fx/state_reads.py (Note [State a forward reads]).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.utils._pytree import MappingKey, SequenceKey, keystr, tree_flatten, tree_flatten_with_path

from .code_reads import globals_read
from .state_reads import (_AUTOCAST_READERS, _BOUND_ARGS, _ENVIRON, _GLOBAL_HOOKS, FLAG_READERS, Contents, FunctionRef,
                          TensorRef, _access, _matches, _owner_of, _read, _shown, _where, global_hooks, remember_owners, same_value)

def _autocast_flag(reader: str) -> Any:
    """The autocast reader ``reader`` as a guard calls it: under torch.compile its value at trace
    time is a constant (Dynamo cannot put ``torch.is_autocast_enabled("cpu")`` in a graph, and
    ``fullgraph=True`` failed on every forward that reads a tensor's dtype: Note [A dtype the forward
    reads] in fx/export_watch.py); Dynamo's own guard on the global autocast state traces again
    when it changes."""
    fn = FLAG_READERS[reader]

    @torch.compiler.assume_constant_result
    def read(*args: Any) -> Any:
        return fn(*args)

    return read


_AUTOCAST_FLAGS = {reader: _autocast_flag(reader) for reader in _AUTOCAST_READERS}
#: ``torch.is_autocast_enabled(device)`` for checks that torch.compile traces (a constant there)
autocast_enabled = _AUTOCAST_FLAGS["is_autocast_enabled"]

__all__ = ["FLAG_READERS", "MAX_GRAPHS", "Guards", "finite_bound", "guards_of", "layout_of",
           "member_layout", "same_input", "same_value"]

log = logging.getLogger(__name__)

MAX_GRAPHS = 8  # graphs kept per train/eval mode (the first capture and those for other inputs)


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


def same_input(x: Any, value: Any) -> bool:
    """Whether a non-tensor input ``x`` is the value ``value`` it was captured with: the same
    type and value, as :func:`same_value` says (``1`` is not ``1.0`` nor ``True``, ``-0.0`` is not
    ``0.0``, a NaN is a NaN), with ``type``, ``==`` and ``math.copysign`` only for the scalars, as
    torch.compile traces them (it cannot trace ``repr`` of a float it keeps symbolic).

    >>> same_input(2.0, 2.0), same_input(2, 2.0), same_input(True, 1), same_input(-0.0, 0.0)
    (True, False, False, False)
    >>> same_input(float("nan"), float("nan")), same_input(None, None), same_input((1, 2.0), (1, 2.0))
    (True, True, True)
    """
    if type(x) is not type(value):
        return False
    if type(value) is float:
        if value != value:
            return x != x
        return x == value and (value != 0.0 or math.copysign(1.0, x) == math.copysign(1.0, value))
    if value is None or type(value) in (bool, int, str):
        return x == value
    return same_value(x, value)


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
    # per dict of torch's global module hooks (state_reads._GLOBAL_HOOKS): the hooks' handle ids at
    # capture (code every module's call runs: Note [State a forward reads]); () reads as none
    hooks: tuple[tuple[int, ...], ...] = ((), (), (), ())
    # what the members' code reads that no guard follows (Note [State a forward reads]): named in the
    # warning at capture, and again where a compile cache loads the graph (code_reads.warn_unguarded)
    unguarded: tuple[str, ...] = ()
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
            self._owners = tuple(_owner_of(module, qualname, name) for module, qualname, name, _ in self.watched)
        else:  # live: a class defined inside a function is found again from them after unpickling
            remember_owners(self._owners)
        # the fast path (Guards.holds): the structure and fixed-size checks of the call, then the guards
        head = []
        for k, (dtype, fixed) in enumerate(zip(self.dtypes, self.fixed)):
            if dtype is None:
                head.append(f"_same_in(f[{k}], _v{k})")
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
        namespace = {**SYMPY_INTERP, "math": math, "member_layout": member_layout, "_same_in": same_input,
                     **{f"_dt{k}": d for k, d in enumerate(self.dtypes)},
                     **{f"_v{k}": v for k, v in enumerate(self.fixed) if self.dtypes[k] is None},
                     **{f"_dev{k}": torch.device(d) for k, d in enumerate(self.devices) if d},
                     **{f"_lay{k}": v for k, v in enumerate(self.layout)}}
        if self.device is not None:
            head.append("pdev == _pdev")
            namespace["_pdev"] = torch.device(self.device)
        for j, (hooks, keys) in enumerate(zip(global_hooks(), self.hooks)):  # torch's global module hooks
            head.append(f"tuple(_gh{j}) == _ghk{j}" if keys else f"not _gh{j}")
            namespace.update({f"_gh{j}": hooks, f"_ghk{j}": keys})
        for j, ((reader, args), value) in enumerate(self.flags):
            head.append(f"_fr{j}(*_fa{j}) == _fv{j}")
            namespace.update({f"_fr{j}": _AUTOCAST_FLAGS.get(reader, FLAG_READERS[reader]), f"_fa{j}": args,
                              f"_fv{j}": value})
        for j, ((_, qualname, name, value), owner) in enumerate(zip(self.watched, self._owners)):
            read = _access(f"_o{j}", qualname, name)
            # a mutable value's contents, compared at each call; a tensor by identity and version (its
            # in-place changes); else the value itself (a function: the one captured), by identity
            if isinstance(value, Contents):
                head.append(f"_same(_contents({read}), _w{j})")
            elif isinstance(value, TensorRef):  # traced: Note [A global tensor inside torch.compile]
                head.append(f"(_w{j}.traced({read}, _wh{j}) if _compiling() else (_t{j} := {read}) is _w{j}.tensor "
                            f"and _t{j}._version == _w{j}.version)")
                namespace.update({f"_wh{j}": _where(self.watched[j][0], qualname, name),
                                  "_compiling": torch.compiler.is_compiling})
            elif qualname == _ENVIRON:  # a new str at each read of os.environ: compared by value
                head.append(f"{read} == _w{j}")
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
        # a handle id names a hook in its own process only: hooks kept by another process never match
        self.hooks = tuple(keys and (-1,) for keys in state.get("hooks", ((), (), (), ())))
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
                # a tensor's dtype read counts as a read of the autocast state (Note [A dtype the forward reads])
                dtype = " (or a tensor's dtype, which autocast changes)" if reader in _AUTOCAST_READERS else ""
                return (f"the forward reads torch.{reader}({', '.join(map(repr, args))}){dtype}, {value!r} at "
                        f"capture and {now!r} now")
        for name, hooks, keys in zip(_GLOBAL_HOOKS, global_hooks(), self.hooks):
            if tuple(hooks) != keys:
                return (f"torch's global module hooks (torch.nn.modules.module.{name}), code every module's call "
                        f"runs, changed since capture: {len(keys)} then, {len(hooks)} now")
        for j, ((module, qualname, name, value), owner) in enumerate(zip(self.watched, self._owners)):
            where = _where(module, qualname, name)
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
        state += [f"{_where(m, q, name)} == {v!r}" for m, q, name, v in self.watched]
        state += [f"torch.nn.modules.module.{h} has the hooks {list(k)}" for h, k in zip(_GLOBAL_HOOKS, self.hooks) if k]
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
    found = reads.get("globals") or globals_read(model)
    watched, owners, readers = found[:3]
    unguarded = tuple(found[3]) if len(found) > 3 else ()
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
    hooks = tuple(tuple(d) for d in global_hooks())
    return Guards(n, dtypes, fixed, names, tuple(code), tuple(shown), reads.get("grad_mode"), follows,
                  tuple(flags.items()), layout, devices, device, tuple(watched), grads, hooks, unguarded,
                  _owners=tuple(owners))
