"""The checks of a wide model's call inputs and the messages they raise: the structure of a call
against the compile sample, the sizes export found the graph valid for, and what a member itself
accepts. :class:`~wide_compiler.WideModel` calls them; nothing here runs a graph."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.export import ExportedProgram
from torch.utils._pytree import tree_map

from .fx.guards import finite_bound

__all__: list[str] = []  # helpers of wide_compiler.model


def _in_order_of(sample: Any, given: Any) -> Any:
    """``given`` with every dict's keys in the order of the matching dict of ``sample`` (where the
    key sets agree), so a call's keywords need not come in the sample's order."""
    if isinstance(sample, dict) and isinstance(given, dict):
        if set(sample) != set(given):
            return given
        return {k: _in_order_of(sample[k], given[k]) for k in sample}
    if isinstance(sample, (tuple, list)) and type(given) is type(sample) and len(given) == len(sample):
        items = [_in_order_of(a, b) for a, b in zip(sample, given)]
        # a namedtuple takes its fields as arguments (probe 14 of issue 44, P14-3: a TypeError)
        return type(given)(*items) if hasattr(given, "_fields") else type(given)(items)
    return given


def _describe_value(v: Any) -> str:
    """A value as the input-structure messages show it: ``a tensor [2, 3]``, ``a tuple of 2
    (a tensor [..], a tensor [..])``, ``a dict with keys ['a']``, ``None``, ``the int 3``."""
    if isinstance(v, torch.Tensor):
        return f"a tensor {list(v.shape)}"
    if isinstance(v, (tuple, list)):
        inner = ", ".join(_describe_value(x) for x in v[:4]) + (", ..." if len(v) > 4 else "")
        return f"a {type(v).__name__} of {len(v)} ({inner})"
    if isinstance(v, dict):
        return f"a dict with keys {list(v)}"
    if v is None:
        return "None"
    if _array_like(v):  # a numpy array: its shape and dtype, never its whole contents
        return f"a {type(v).__module__.split('.')[0]}.{type(v).__name__} of shape {list(v.shape)} ({v.dtype})"
    text = repr(v)
    return f"the {type(v).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _array_like(v: Any) -> bool:
    """An array of another library (numpy, ...): it has a shape and a dtype, and is no tensor."""
    return not isinstance(v, torch.Tensor) and hasattr(v, "shape") and hasattr(v, "dtype")


def _numbers(v: Any) -> bool:
    """A (nested) list or tuple of Python numbers."""
    if isinstance(v, (list, tuple)):
        return bool(v) and all(_numbers(x) for x in v)
    return isinstance(v, (bool, int, float, complex))


def _tensor_expected(name: str, got: Any, member: tuple, n: int) -> str:
    """The message for a call with a non-tensor where the compile sample had a tensor (probe 9,
    P9-12: it said the model "was compiled with None" and to compile again for another value)."""
    dims = _member_dims(member)
    layout = (f"a leading member dim of {n}, then one member's input as compiled, [{dims}]" if dims
              else "one value per member: one member's input is a 0-dim tensor")
    what = (f"wide_compiler: input '{name}' must be a tensor [{n}{', ' + dims if dims else ''}] (N-first: "
            f"{layout}), as in the compile sample, got "
            f"{_describe_value(got)}")
    if _array_like(got) or _numbers(got):
        return what + (". Convert it with torch.as_tensor(x) (with the dtype and device of the model), "
                       "stacking per-member inputs with wide_compiler.stack(xs)")
    return what + (". Pass a tensor there: stack per-member inputs with wide_compiler.stack(xs), or share one "
                   f"input x with x.expand({n}, *x.shape)")


def _outside_range(name: str, d: int, size: int, lo: int, hi: int | None) -> str:
    """The message for a size outside the range export found the captured graph valid for (a
    test of that size in the forward: Note [Guards] in fx/guards.py). Probe 9, P9-10: it said each
    member "fails or runs another branch", where members run fine at that size."""
    side = f"under {lo}" if size < lo else f"over {hi}"  # the call's side of the range
    return (f"wide_compiler: input '{name}' dim {d + 1} is {size}, but the captured graph holds for sizes "
            f"{_size_range(lo, hi)} there only: the forward tests that size (dim {d} of one member's input: "
            f"an `if` on x.shape[{d}] in the member, a table of that many rows such as a position "
            f"embedding), and torch.export recorded the test as this range of the dim, so at {size} a member "
            f"may take another branch than the one captured (or index past the table); the wide model refuses "
            f"it rather than run the captured branch there. What to do: for sizes {side}, compile a separate "
            f"wide model with a sample whose dim {d} is {side} (wide_compiler.compile(members, sample) with "
            f"such a sample: its graph then holds on that side), and call each wide model with the sizes of "
            f"its side; or keep calls to sizes {_size_range(lo, hi)}")


def _structure_difference(want: Any, got: Any, where: str) -> str | None:
    """The first place where ``got`` is not nested like ``want`` (one member's sample): what is
    there and what the sample has, or None when they are nested alike."""
    def differ(why: str = "") -> str:
        return f"{where} is {_describe_value(got)}, but in the sample it is {_describe_value(want)}{why}"

    if isinstance(want, torch.Tensor):
        if isinstance(got, torch.Tensor):
            return None
        why = ""
        if isinstance(got, (list, tuple)) and got and all(isinstance(t, torch.Tensor) for t in got):
            why = (" (a list of per-member tensors? pass one N-first tensor: wide_compiler.stack(xs), "
                   "or x.expand(N, *x.shape) to share one)")
        elif _array_like(got) or _numbers(got):
            why = " (convert it to an N-first tensor with torch.as_tensor(x))"
        return differ(why)
    if isinstance(want, (tuple, list)):
        if not isinstance(got, (tuple, list)) or len(got) != len(want) or (
                type(got) is not type(want) and not (isinstance(got, tuple) and isinstance(want, tuple))):
            return differ()
        for k, (w, g) in enumerate(zip(want, got)):
            found = _structure_difference(w, g, f"{where}[{k}]")
            if found:
                return found
        return None
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return differ()
        for k in want:
            found = _structure_difference(want[k], got[k], f"{where}[{k!r}]")
            if found:
                return found
        return None
    if (want is None) != (got is None) or isinstance(got, (torch.Tensor, tuple, list, dict)):
        return differ()
    return None  # plain values: compared (against the baked-in value) input by input


def _structure_error(sample: tuple[tuple, dict], given: tuple[tuple, dict], n: int) -> str:
    """The message for a call whose inputs are not nested as the compile sample's."""
    (want_args, want_kwargs), (args, kwargs) = sample, given
    found = None
    if len(args) != len(want_args):
        found = (f"{len(args)} positional input(s) were given, the sample has {len(want_args)}: "
                 f"({', '.join(_describe_value(a) for a in want_args)})")
    elif set(kwargs) != set(want_kwargs):
        found = f"keywords {sorted(kwargs)} were given, the sample has {sorted(want_kwargs)}"
    else:
        for k, (w, g) in enumerate(zip(want_args, args)):
            found = found or _structure_difference(w, g, f"positional input {k}")
        for key in want_kwargs:
            found = found or _structure_difference(want_kwargs[key], kwargs[key], f"keyword input {key!r}")
    return (f"wide_compiler: the wide model takes the inputs of one member's sample, nested as in the "
            f"sample, with every tensor N-first (a leading member dim of {n}; the shapes shown for the "
            f"sample are one member's); here {found or 'the nesting differs from the sample'}")


def _member_dims(member: tuple) -> str:
    """One member's input shape as captured: ``B`` for a dynamic dim 0, ``*`` for another
    dynamic dim (a sequence-first batch, a length), numbers for sizes export fixed."""
    return ", ".join(str(m) if m is not None else "B" if k == 0 else "*" for k, m in enumerate(member))


class _NewSize(ValueError):
    """A call's tensor differs from the captured sizes in a fixed dim (rank and N as captured):
    :meth:`WideModel._resized` captures the graph again (Note [Dynamic sizes on demand])."""


def _user_placeholders(ep: ExportedProgram) -> list:
    """The placeholders of the user inputs of ``ep``, in the flat order of its inputs (None for
    an input with no placeholder)."""
    from torch.export.graph_signature import InputKind

    names = [spec.arg.name for spec in ep.graph_signature.input_specs if spec.kind == InputKind.USER_INPUT]
    nodes = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    return [nodes.get(name) for name in names]


def _narrow_ranges(ep: ExportedProgram) -> dict[str, tuple[tuple[int, int, int | None], ...]]:
    """Per user input (placeholder name): ``(dim, low, high)`` of every dynamic dim that export
    found the program valid for only in part (a branch on the size): a lower bound above 2 or an
    upper bound (high None: unbounded). Dims of the default range ``[2, inf)`` are not listed
    (a size 0 or 1 there fails the graph's guards instead, and gets a graph of its own: Note
    [Guards] in fx/guards.py)."""
    import sympy

    out = {}
    for node in _user_placeholders(ep):
        val = node.meta.get("val") if node is not None else None
        if not isinstance(val, torch.Tensor):
            continue
        checks = []
        for d, size in enumerate(val.shape):
            expr = getattr(getattr(size, "node", None), "expr", None)
            if not isinstance(expr, sympy.Symbol) or expr not in ep.range_constraints:
                continue
            vr = ep.range_constraints[expr]
            lo, hi = finite_bound(vr.lower) or 0, finite_bound(vr.upper)
            lo = lo if lo > 2 else 0  # export's own floor (it avoids 0 and 1 as samples only)
            if lo > 2 or hi is not None:
                checks.append((d, lo, hi))
        if checks:
            out[node.name] = tuple(checks)
    return out


def _size_range(lo: int, hi: int | None) -> str:
    return f"up to {hi}" if not lo and hi is not None else f"{lo} or more" if hi is None else f"{lo} to {hi}"


def _fill(message: str, shape: list[int], size: int) -> str:
    """A cached fixed-size message for this call's shape and size."""
    return message.replace("<<shape>>", str(shape)).replace("<<size>>", str(size))


def _member_accepts(template: nn.Module, training: bool, args: tuple, kwargs: dict) -> bool:
    """Whether a copy of member 0's module runs on member 0's slice of a call's inputs."""
    first = tree_map(lambda a: a[0] if isinstance(a, torch.Tensor) and a.dim() else a, (tuple(args), dict(kwargs)))
    try:
        with torch.random.fork_rng(), torch.no_grad():
            copy.deepcopy(template).train(training)(*first[0], **first[1])
        return True
    except Exception:  # noqa: BLE001 -- any failure: the member does not take it
        return False
