"""The rule table: the single source of truth for how each ATen op is widened.

Note [Adding a widen rule]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Every op of a captured member graph is looked up here (:func:`find_rule`). A row says which rule
function widens the op and what the other passes need to know about it: its family (the rules
file it lives in), its layout behaviour for the layout plan (fx/layout.py), the strategies its
wide op offers (checked by ``WideConfig.strategy``) and whether it must run even when no argument
is per member. There are three ways to add an op, cheapest first:

1. **Nothing.** An op tagged ``torch.Tag.pointwise`` in ATen needs no row: the pointwise rule
   (rules/pointwise.py) serves it, and the layout plan treats it as elementwise.
2. **One row in an existing family.** If the op fits a family's generic rule (a pointwise op that
   is not tagged, a dim-taking op whose dims just shift, a per-channel spatial op folded into the
   batch, ...), add its name to that family's list, e.g. ``"hardshrink"`` in ``_UNARY`` of
   rules/pointwise.py. Names are resolved by :func:`aten_op`, which raises on a typo.
3. **A rule function.** For an op that needs its own rewrite, write
   ``@rule(aten.my_op.default, ...)`` on a function ``(ctx, node) -> value`` in the family's
   file (or a new file in fx/rules/: files are discovered, no import list to edit). An op that
   reads per-member parameters emits its ``torch.ops.wide.*`` op (declared in
   csrc/wide/registration.cpp, described in wide_compiler/ops.py) with
   ``WidenContext.emit_wide`` (Note [Node metadata] in fx/context.py), passing a
   :class:`TuneSpec` if that op has strategies, and declares ``strategies=`` on the row (the
   op's ``WIDE_OPS[...].strategies``). A channel-packed op declares ``layout="packed",
   packed=torch.ops.wide.my_op.default``: the layout plan reads it from the table.

Registering an op twice raises, so two families can never silently disagree. Every row must be
reached by a case of tests/python/test_rule_coverage.py, which fails when a row has none.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..ops import WIDE_OPS, of_target

__all__ = ["LAYOUTS", "RULES", "RuleEntry", "aten_op", "find_rule", "packed_ops", "rule", "rows",
           "strategy_names"]

aten = torch.ops.aten

# How a rule's output relates to the channel-packed layout (fx/layout.py):
#   "nfirst":      nothing to say; the layout plan leaves the op N-first (always correct)
#   "elementwise": same member values on packed and N-first tensors of one member shape
#   "fold":        per-channel op run with the member dim folded into the batch
#   "pad":         constant padding of trailing (spatial) dims
#   "packed":      emits a channel-packed wide op (``packed=`` names it)
LAYOUTS = ("nfirst", "elementwise", "fold", "pad", "packed")


@dataclasses.dataclass(frozen=True)
class RuleEntry:
    """One row of the rule table."""

    op: Any  # an OpOverload (or another call target, e.g. operator.getitem)
    fn: Callable  # (WidenContext, fx.Node) -> the node's wide value
    family: str  # the rules file that registered it
    layout: str = "nfirst"
    packed: tuple = ()  # the torch.ops.wide overloads a "packed" rule emits
    strategies: tuple[str, ...] = ()  # strategy names of the wide op it emits
    always: bool = False  # run even when no argument is per member (reads per-member state itself)


RULES: dict[Any, RuleEntry] = {}
# The rule for ops tagged torch.Tag.pointwise that have no row of their own.
_TAGGED_POINTWISE: list[RuleEntry] = []


def aten_op(spec: str) -> torch._ops.OpOverload:
    """``"add.Tensor"`` -> ``torch.ops.aten.add.Tensor`` (``"relu"`` -> ``.default``).

    Raises ``ValueError`` for a name this torch does not have: a typo must not silently drop an
    op to the fallback.
    """
    name, _, overload = spec.partition(".")
    packet = getattr(aten, name, None)
    op = getattr(packet, overload or "default", None) if packet is not None else None
    if not isinstance(op, torch._ops.OpOverload):
        raise ValueError(f"wide_compiler: no ATen op {spec!r} in torch {torch.__version__}")
    return op


def _caller_family(depth: int) -> str:
    """The rules file registering a row (a template from ``rules/_*.py`` belongs to the family
    that registers it)."""
    return sys._getframe(depth + 1).f_globals.get("__name__", "?").rpartition(".")[2]


def rule(*ops: Any, layout: str = "nfirst", packed: Any = None, strategies: Iterable[str] = (),
         always: bool = False, tagged_pointwise: bool = False, family: str | None = None) -> Callable:
    """Decorator: register ``fn`` as the widen rule of ``ops`` (overloads or names for
    :func:`aten_op`). ``tagged_pointwise=True`` also makes it the rule of every op tagged
    ``torch.Tag.pointwise`` that has no row. ``family`` defaults to the calling rules file."""
    family = family or _caller_family(1)
    strategies = tuple(strategies)
    if layout not in LAYOUTS:
        raise ValueError(f"wide_compiler: unknown rule layout {layout!r}; expected one of {LAYOUTS}")
    packed = tuple(packed) if isinstance(packed, (tuple, list)) else (() if packed is None else (packed,))
    if (layout == "packed") != bool(packed):
        raise ValueError("wide_compiler: a 'packed' rule names its wide ops with packed=, and only it")
    for op in packed:
        info = of_target(op)
        if info is None or not info.packed_input:
            raise ValueError(f"wide_compiler: packed={op} is not an op of the packed family "
                             "(wide_compiler/ops.py: packed_input)")
    offered = {name for info in WIDE_OPS.values() for name in info.strategies}
    if not set(strategies) <= offered:
        raise ValueError(f"wide_compiler: strategies {tuple(strategies)} name some no wide op offers "
                         f"(wide_compiler/ops.py: {sorted(offered)})")

    def deco(fn: Callable) -> Callable:
        make = lambda op: RuleEntry(op, fn, family, layout, packed, tuple(strategies), always)  # noqa: E731
        for spec in ops:
            op = aten_op(spec) if isinstance(spec, str) else spec
            if op in RULES:
                old = RULES[op]
                raise ValueError(f"wide_compiler: {op} already has a widen rule ({old.family}.{old.fn.__name__}); "
                                 f"cannot register {family}.{fn.__name__} for it too")
            RULES[op] = make(op)
        if tagged_pointwise:
            if _TAGGED_POINTWISE:
                raise ValueError("wide_compiler: the rule for tagged pointwise ops is registered twice")
            _TAGGED_POINTWISE.append(make("pointwise"))
        return fn

    return deco


def rows(fn: Callable, specs: Iterable[Any], **options: Any) -> None:
    """Register ``fn`` for every op of ``specs``: a family's table of one-line rows."""
    rule(*specs, **{"family": _caller_family(1), **options})(fn)


def find_rule(target: Any) -> RuleEntry | None:
    """The row of an op: its own, else the pointwise rule for ops tagged pointwise, else None."""
    entry = RULES.get(target)
    if entry is None and _TAGGED_POINTWISE and torch.Tag.pointwise in getattr(target, "tags", ()):
        entry = _TAGGED_POINTWISE[0]
    return entry


def packed_ops() -> frozenset:
    """The channel-packed wide ops (what the layout plan chains without conversions)."""
    return frozenset(op for e in RULES.values() for op in e.packed)


def strategy_names() -> frozenset[str]:
    """Every strategy name some wide op offers (``WideConfig.strategy`` checks against these)."""
    return frozenset({"loop"}.union(*(e.strategies for e in RULES.values())))
