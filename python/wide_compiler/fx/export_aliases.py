"""What torch.export gets wrong about aliases, put right around one capture (fx/capture.py): a
buffer registered as None (Note [A buffer registered as None]) and a conversion that changes
nothing (Note [A conversion that changes nothing])."""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

import torch
from torch import fx, nn
from torch.export import ExportedProgram

__all__ = ["NoneBuffersAsAttributes", "NoOpConversionsCopied", "copies_are_safe"]


# Note [A buffer registered as None]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``register_buffer(name, None)`` (an optional buffer left unset; BatchNorm with
# ``track_running_stats=False`` registers its statistics so) keeps ``name`` in the module's
# ``_buffers`` with no tensor. torch.export (2.13, non-strict) counts it when it writes a mutated
# buffer back, so a buffer updated in place (``self.cnt += 1``) registered after it is written back
# into the next graph input: the graph ends in ``copy_(x, cnt + 1)``, x the user's input (bare
# export's own module does it too). The wide model then wrote into the caller's input and, with a
# second such buffer, computed from wrong values (probe 9 of issue 44, P9-2: the input 3.3 off,
# outputs 1.6). During the capture every None buffer is a plain attribute of value None instead
# (what reading it gives is the same), and is put back afterwards, in its place in ``_buffers``.
class NoneBuffersAsAttributes:
    """Note [A buffer registered as None]: around one export of ``model``."""

    def __init__(self, model: nn.Module) -> None:
        self.moved = [(m, dict(m._buffers)) for m in model.modules() if any(v is None for v in m._buffers.values())]

    def __enter__(self) -> None:
        for m, buffers in self.moved:
            for name, v in buffers.items():
                if v is None:
                    del m._buffers[name]
                    m.__dict__[name] = None

    def __exit__(self, *exc: Any) -> None:
        for m, buffers in self.moved:
            now = dict(m._buffers)  # the other buffers as they are now, in their order with the None ones
            for name, v in buffers.items():
                if v is None:
                    m.__dict__.pop(name, None)
            m._buffers.clear()
            m._buffers.update({name: None if v is None else now.pop(name, v) for name, v in buffers.items()})
            m._buffers.update(now)


# Note [A conversion that changes nothing]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``f = h.float()`` where ``h`` is already float32 returns ``h`` itself, and export's tracer then
# takes every later use of ``h`` for a use of ``f``: the graph's ``to`` node feeds ``h * 3.14`` too.
# In float32 that is the same program. Under autocast it is not: the wide model's ``h`` comes out
# of its linear in bfloat16, the ``to`` node is then a real cast, and every later use of ``h`` ran
# in float32 where the member's stays bfloat16 (probe 9 of issue 44, P9-14: other outputs in
# another dtype, 2e-3 off). So during the capture a dtype conversion that would return its tensor
# itself (``to(torch.float32)`` or ``float()`` of a float32 tensor...: a dtype named in the code,
# not ``type_as(x)`` or ``to(x)``, whose dtype follows ``x`` at run time) asks for a copy
# (``copy=True``): ``f`` is a node of its own and the later uses of ``h`` stay ``h``'s;
# under autocast the copy converts and ``h`` keeps its dtype, as in the member. A copy differs from
# the member's alias only where something writes into one of them (or into a tensor they view)
# afterwards; :func:`copies_are_safe` looks for such a write in the graph, and where there is one
# the capture is made again without the copies (the graph as before, its aliasing the member's).
# Where there is none, the copies are made conversions again (``copy=False``): nodes of their own,
# so the later uses of ``h`` stay ``h``'s, that cost nothing where the dtype does not change.
_CONVERSIONS = ("to", "float", "double", "half", "bfloat16")  # to a dtype named in the code (not type_as(x), to(x):
# their dtype is x's at run time, which a copy to a fixed dtype would lose)


class NoOpConversionsCopied:
    """Note [A conversion that changes nothing]: around one export; ``count`` is how many
    conversions were made copies."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.count = 0
        self._saved: list[tuple[str, Any]] = []

    def _wrap(self, name: str, original: Any) -> Any:
        watcher, to = self, torch.Tensor.to  # the unpatched to (patched after this is read)

        @functools.wraps(original)
        def conversion(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            # decided before converting: a conversion that returns its tensor has already made the
            # tracer take the tensor for its result
            if isinstance(t, torch.Tensor) and _no_op_dtype(name, t, args, kwargs) \
                    and not sys._getframe(1).f_code.co_filename.startswith(_BELOW_THE_TRACER):
                watcher.count += 1
                return to(t, dtype=t.dtype, copy=True)
            return original(t, *args, **kwargs)

        return conversion

    def __enter__(self) -> NoOpConversionsCopied:
        if self.enabled:
            for name in _CONVERSIONS:
                original = getattr(torch.Tensor, name)
                self._saved.append((name, torch.Tensor.__dict__.get(name, _MISSING)))
                setattr(torch.Tensor, name, self._wrap(name, original))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, old in reversed(self._saved):
            if old is _MISSING:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, old)
        self._saved.clear()


_MISSING = object()
_BELOW_THE_TRACER = tuple(os.path.join(os.path.dirname(torch.__file__), d) for d in (
    "_decomp", "_refs", "_prims", "_subclasses", "_meta_registrations.py", "_functorch", "_higher_order_ops"))
_FIXED = {"float": torch.float32, "double": torch.float64, "half": torch.float16, "bfloat16": torch.bfloat16}


def _no_op_dtype(name: str, t: torch.Tensor, args: tuple, kwargs: dict) -> bool:
    """Whether ``t.<name>(*args, **kwargs)`` names a dtype and would return ``t`` itself (the same
    dtype and device, no copy, no memory format asked)."""
    if kwargs.get("copy") or kwargs.get("memory_format") not in (None, torch.preserve_format):
        return False
    if name in _FIXED:
        return not args and _FIXED[name] == t.dtype
    dtype, device = kwargs.get("dtype"), kwargs.get("device")
    for a in args:
        if isinstance(a, torch.Tensor):
            return False  # to(x): x's dtype at run time
        if isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, (str, torch.device, int)) and not isinstance(a, bool):
            device = a
        elif a is not None and not isinstance(a, bool):  # non_blocking / copy given positionally, or unknown
            return False
    if len(args) > 2 and args[-1] is True:  # to(dtype, non_blocking, copy=True) positionally
        return False
    return dtype == t.dtype and (device is None or torch.device(device) == t.device)


def _is_copy(node: fx.Node) -> bool:
    """A conversion node that copied a tensor into its own dtype (and device)."""
    if node.op != "call_function" or node.target not in (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype,
                                                           torch.ops.aten.to.dtype_layout):
        return False
    src, out = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None, node.meta.get("val")
    return (isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor) and src.dtype == out.dtype
            and src.device == out.device)


def _aliases(node: fx.Node) -> bool:
    """Whether ``node``'s result may share memory with its first argument (a view, or an op that
    returns its input)."""
    schema = getattr(node.target, "_schema", None)
    return schema is not None and bool(schema.returns) and schema.returns[0].alias_info is not None


def copies_are_safe(ep: ExportedProgram) -> bool:
    """Note [A conversion that changes nothing]: whether no op writes into the copies the capture
    made, their sources, or a tensor sharing memory with them (views either way), so that the
    copies compute what the members' aliases do; if so, the copies are made conversions again."""
    copies = [n for n in ep.graph.nodes if _is_copy(n)]
    if not copies:
        return True
    group: dict[fx.Node, fx.Node] = {}  # union-find over "shares memory with" (views, in-place results)

    def root(n: fx.Node) -> fx.Node:
        while group.get(n, n) is not n:
            n = group[n]
        return n

    for n in ep.graph.nodes:
        if n.op == "call_function" and _aliases(n) and isinstance(n.args[0], fx.Node):
            group[root(n)] = root(n.args[0])
    watched = {root(c) for c in copies} | {root(c.args[0]) for c in copies}
    for n in ep.graph.nodes:
        schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
        if schema is None or not schema.is_mutable:
            continue
        for arg, a in zip(n.args, schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write and isinstance(arg, fx.Node) and root(arg) in watched:
                return False
    for c in copies:  # conversions again: no copy where the dtype does not change
        if c.target is torch.ops.aten.to.dtype and len(c.args) == 4 and c.args[3] is True:
            c.args = (*c.args[:3], False)
    return True
