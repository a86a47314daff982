"""The per-op fallback: ops with no widen rule run correctly, just not fused.

The op is run with ``torch.vmap`` over the member dim (functorch has batching rules for nearly every
ATen op; ``randomness="different"`` gives each member its own random draws), or, where vmap cannot
run it (data-dependent output shapes, ops vmap refuses), and under autocast, as a loop over the
N members whose results are stacked. Each fallback warns once, naming the op and the user's source line;
``strict=True`` raises :class:`~wide_compiler.UnsupportedOperationError` instead. Fallbacks are
listed by ``WideModel.report()``.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
from torch import fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from .source import source_line
from .context import Wide, WidenContext, op_name, written_args

__all__ = ["fallback", "MemberFallback"]

log = logging.getLogger(__name__)


def _autocast_on(leaves: tuple) -> bool:
    """Whether autocast is on for the device of the tensor arguments. Then the loop runs each
    member's op as the member does: vmap's batching rules decompose an op into others that
    autocast casts otherwise (Note [Autocast parity of widened ops] in fx/rules/matmul.py).
    Meta tensors (the rank check's run, Note [Rank check on meta tensors] in fx/widen.py) have no
    autocast (``torch.is_autocast_enabled("meta")`` raises): off."""
    device = next((leaf.device.type for leaf in leaves if isinstance(leaf, torch.Tensor)), None)
    return device is not None and device != "meta" and torch.is_autocast_enabled(device)


class MemberFallback:
    """The callable a fallback node runs: ``op`` applied per member to the flattened arguments
    ``leaves`` (``in_dims[k]`` is 0 for N-first tensors, None for shared values)."""

    def __init__(self, op, spec, in_dims: tuple, n: int, label: str, where: str = "") -> None:
        self.op, self.spec, self.in_dims, self.n, self.where = op, spec, in_dims, n, where
        self.mode = "vmap" if any(d == 0 for d in in_dims) else "loop"
        self.__name__ = self.__qualname__ = f"wide_fallback_{label}"
        self.__module__ = __name__

    def _call(self, *leaves: Any) -> Any:
        args, kwargs = tree_unflatten(list(leaves), self.spec)
        return self.op(*args, **kwargs)

    def __call__(self, *leaves: Any) -> Any:
        if self.mode == "vmap" and not _autocast_on(leaves):
            try:
                return torch.vmap(self._call, in_dims=self.in_dims, randomness="different")(*leaves)
            except Exception as e:  # vmap could not batch it: fall back to a loop from now on
                log.warning("wide_compiler: torch.vmap cannot run %s (%s); looping over members",
                            self.__name__, e)
                self.mode = "loop"
        outs = [self._call(*(leaf[i] if d == 0 else leaf for leaf, d in zip(leaves, self.in_dims)))
                for i in range(self.n)]
        many = isinstance(outs[0], (tuple, list))
        for k in range(len(outs[0]) if many else 1):
            shapes = [tuple((o[k] if many else o).shape) for o in outs]
            if len(set(shapes)) > 1:  # an output size that depends on the values (torch.unique, nonzero)
                raise RuntimeError(
                    f"wide_compiler: {self.op} ({self.where or 'a fallback op'}) gives the members results of "
                    f"different sizes on this call ({', '.join(f'member {i}: {list(sh)}' for i, sh in enumerate(shapes))}): "
                    "an op whose output size depends on the values cannot be stacked over members, so this call "
                    "cannot run wide. Keep the size fixed (a mask instead of torch.unique/nonzero/masked_select), "
                    "or run these members one by one")
        if many:
            return type(outs[0])(torch.stack([o[k] for o in outs]) for k in range(len(outs[0])))
        return torch.stack(outs)

    def __repr__(self) -> str:
        return f"<{self.__name__} ({self.mode})>"


_RESIZES = (torch.ops.aten.resize_, torch.ops.aten.resize_as_, torch.ops.aten.set_)


def fallback(ctx: WidenContext, node: fx.Node, reason: str = "no widen rule for this op") -> Any:
    """Emit a fallback node for ``node`` (or raise in strict mode) and return its wide value."""
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else [val]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        raise ctx.fail(node, f"{reason}, and its output is not a tensor, so it cannot run per member")
    if ctx.strict:
        raise ctx.fail(node, f"{reason} (strict=True forbids the per-member fallback)")
    if getattr(node.target, "overloadpacket", None) in _RESIZES:  # vmap resizes the batched tensor, not each member's
        raise ctx.fail(node, "it resizes a tensor in place (x.new() then resize_as_(h), as torch's CrossMapLRN2d "
                             "does), which cannot run per member: make the tensor at its size instead "
                             "(torch.ones_like(h), h.new_zeros(h.shape))")
    if any(isinstance(t, fx.Node) and not isinstance(ctx.env.get(t), Wide) for t in written_args(node)):
        raise ctx.fail(node, f"{reason}, and it writes in place into a value shared by all members, which "
                             "a per-member fallback would overwrite N times")
    leaves, spec = tree_flatten((ctx.value(node.args), ctx.value(node.kwargs)))
    in_dims = tuple(0 if isinstance(leaf, Wide) else None for leaf in leaves)
    where = source_line(node)
    fn = MemberFallback(node.target, spec, in_dims, ctx.n, node.name, where)
    out = ctx.emit(fn, tuple(ctx.unwrap(leaf) for leaf in leaves), like=node, name=node.name)
    ctx.fallbacks.append({"op": op_name(node), "node": node.name, "source": where, "how": fn.mode,
                          "reason": reason})
    warnings.warn(f"wide_compiler: {op_name(node)} at {where} runs through a per-member "
                  f"{'torch.vmap' if fn.mode == 'vmap' else 'loop'} fallback ({reason}): correct, "
                  "but not fused. strict=True makes this an error.", stacklevel=2)
    return ctx.outputs(node, out)
