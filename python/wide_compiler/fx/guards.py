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
call before the graph runs (:meth:`Guards.failed`, a few microseconds: one generated Python
function over the inputs' member shapes):

* export's own guards (``ExportedProgram._guards_code``: divisibility, parity, relations between
  sizes, tests of a size against a constant) with its names of the inputs (``L['x'].size()[1]``)
  mapped to the flat user inputs;
* for every dim export kept dynamic: its range (``range_constraints``), at least 2, and equal to
  every other dim export found equal to it (the same symbol); a dim given as an expression of a
  symbol (``2*s0 + 1``) is checked against that expression;
* every tensor input's dtype as captured;
* the grad mode, where the forward read it (``torch.is_grad_enabled()``: Note [What export does not
  capture] in fx/capture.py); a graph for the other mode is captured under that mode.

A call outside them is never run on the graph: :class:`~wide_compiler.WideModel` looks for a
graph of that mode captured for such inputs, or captures one with the call itself as the sample
(member 0's slice of it; a size 0 or 1 is then captured as the fixed size it is), keeping at most
:data:`MAX_GRAPHS` graphs per mode as ``torch.compile`` bounds its recompiles, and refuses past
that with the failed guard named. Sizes fixed at capture and the structure of the inputs are
checked with their own messages first (``WideModel._check_input``).

A guard of export's that names an input this module cannot map (a stride, an input path it does
not know) is not dropped: the graph then holds only for inputs of exactly the captured sizes.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import re
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.utils._pytree import MappingKey, SequenceKey, keystr, tree_flatten_with_path

__all__ = ["MAX_GRAPHS", "Guards", "finite_bound", "guards_of"]

log = logging.getLogger(__name__)

MAX_GRAPHS = 8  # graphs kept per train/eval mode (the first capture and those for other inputs)


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
    _fn: Any = dataclasses.field(default=None, repr=False, compare=False)
    _each: Any = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

        # over the N-first inputs f: s[k][d] (one member's dim d) is f[k].shape[d + 1]
        def wide(c: str) -> str:
            c = re.sub(r"s\[(\d+)\]\[(\d+)\]", lambda m: f"f[{m[1]}].shape[{int(m[2]) + 1}]", c)
            return re.sub(r"s\[(\d+)\]", r"f[\1]", c)

        # the fast path (Guards.holds): the structure and fixed-size checks of the call, then the guards
        head = []
        for k, (dtype, fixed) in enumerate(zip(self.dtypes, self.fixed)):
            if dtype is None:
                head.append(f"f[{k}] == _v{k}")
                continue
            rank, sizes = fixed
            dt = "pdt" if k < len(self.follows) and self.follows[k] else f"_dt{k}"
            head.append(f"f[{k}].dtype is {dt} and len(f[{k}].shape) == {rank + 1} and f[{k}].shape[0] == {self.n}")
            head.extend(f"f[{k}].shape[{d + 1}] == {v}" for d, v in sizes.items())
        body = " and ".join([*head, *(f"({wide(c)})" for c in self.code)]) or "True"
        each = ", ".join(f"lambda s: {c}" for c in self.code)
        namespace = {**SYMPY_INTERP, "math": math, **{f"_dt{k}": d for k, d in enumerate(self.dtypes)},
                     **{f"_v{k}": v for k, v in enumerate(self.fixed) if self.dtypes[k] is None}}
        # our own generated code: the conjunction (each call), and each guard alone (to name the failed one)
        exec(f"def _holds(f, pdt):\n    return {body}\n_each = ({each}{',' if self.code else ''})\n", namespace)  # noqa: S102
        self._fn = namespace["_holds"]
        self._each = namespace["_each"]

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_fn", "_each")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.__post_init__()

    def holds(self, flat: Any, pdt: torch.dtype | None = None) -> bool:
        """Whether ``flat`` (the N-first user inputs, flat as the graph takes them) is nested, sized
        and typed as captured and within every guard: the one check of a call in the common case
        (the call's own checks give the reason where it is False). ``pdt``: the model's parameters'
        dtype now (what the inputs that follow it must have)."""
        if self.grad_mode is not None and torch.is_grad_enabled() != self.grad_mode:
            return False
        try:
            return bool(self._fn(flat, pdt))
        except Exception:  # noqa: BLE001 -- anything unexpected (a rank, a type): the slow checks say what
            return False

    def failed(self, flat: Any, pdt: torch.dtype | None = None) -> str | None:
        """None when ``flat`` (the N-first user inputs, flat as the graph takes them) is within
        these guards, else a description of the first one it fails."""
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
            s.append(x.shape[1:])
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
        return "\n".join([*dtypes, *self.shown])


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
    return Guards(n, dtypes, fixed, names, tuple(code), tuple(shown), getattr(ep, "wide_reads_grad_mode", None),
                  follows)
