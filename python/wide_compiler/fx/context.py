"""The widen pass's vocabulary: :class:`Wide` values, the :class:`WidenContext` a rule writes
into, :class:`TuneSpec`, and helpers on the nodes of a member graph.

The pass (fx/widen.py), its rule families (fx/rules/) and the per-op fallback (fx/fallback.py) all
use these; keeping them here lets each of those import them without importing the others, so the
fx package has no import cycle (the pass imports the rules and the fallback, never the reverse;
.importlinter checks it). fx/widen.py re-exports every name, their home before.

Note [Widening nested graphs]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A rule whose op holds a graph of its own (a no-grad or autocast region, rules/regions.py) widens
that body node by node with the pass's own per-node step, so every rule applies inside it. The
step lives in fx/widen.py, above the rules; a rule reaches it through
:meth:`WidenContext.widen_node`, which calls what fx/widen.py installs as
``WidenContext._node_widener`` when it loads (always before any pass runs: the pass is in that
module).

Note [Node metadata]
~~~~~~~~~~~~~~~~~~~~
The passes hand facts about the nodes of a wide graph to each other in ``node.meta``, under keys
starting with ``wide_``. This is every such key: who writes it, who reads it, what it holds. A
rule writes the first three only through :meth:`WidenContext.emit_wide`, which checks them.

- ``wide_op`` (str): which wide op stands for a member op, as ``WideModel.summary()`` names it:
  ``"wide.<op>"`` (``WideOp.qualname`` of wide_compiler/ops.py, derived from the emitted
  target), ``"registered:<module path>"`` (rules/registered.py) or ``"region:<region>"``
  (rules/regions.py). Written by ``emit_wide``; fx/eval_rewrites.py ``fuse_residual_norms``
  copies the norm's onto the ``add_layer_norm`` it puts in its place. Read by the model's
  ``summary()`` (one row per node that has it) and its carrying of strategies to a recaptured
  graph, by analyze.py, and by tuning.py (the op of the cache key; the heuristic reasons).
- ``wide_shapes`` (dict of JSON values): one member's sample shapes and the hyperparameters that
  decide the op's speed (``"input"`` always, ``"weight"`` where there is one, ...). Written by
  ``emit_wide``; the layout plan (fx/layout.py ``_feed_packed``) sets ``"packed_input"`` in place
  on the same dict, and fx/eval_rewrites.py ``rewrite_channels_last`` replaces it (adding
  ``"inference"``). Read by tuning.py (part of the cache key), by the :class:`TuneSpec`'s ``make``,
  which closes over the same dict object, so the plan's change reaches the candidates, and by the
  summary's member input and weight columns and analyze.py.
- ``wide_tune`` (:class:`TuneSpec`): how to measure the op's strategies; only on ops with
  strategies (``WideOp.strategies``). Written by ``emit_wide``; replaced with the eval graphs'
  conv defaults by fx/eval_rewrites.py ``rewrite_channels_last``. Read by the strategy pass
  (tuning.py ``choose_strategies``), fx/pipeline.py, the model-level tuning check
  (fx/model_check.py) and the carrying of strategies to a recaptured graph.
- ``wide_strategy_reason`` (str) and ``wide_tune_key`` (str): why the op runs its strategy, and
  its tuning cache key. Written by the strategy pass (tuning.py); the reason is amended by the
  model-level check and carried with the strategy to a recaptured graph. Read by ``summary()``
  (the reason) and the model-level check (the key, to cache its verdict).
- ``wide_source`` (str): the name of the member-graph node a new node was emitted for. Written by
  :meth:`WidenContext.emit` (every node given ``like=``), copied by fx/layout.py onto the
  ``to_nfirst`` it moves and set by fx/fold.py on the folded conv parameters. Read by
  fx/layout.py (the member shape of that node) and fx/widen.py ``check_ranks`` (error messages).
- ``wide_member_shape`` (tuple of str; symbolic sizes by name): one member's shape of a
  ``to_nfirst`` value. Written by rules/_packed.py ``packed_result`` and fx/layout.py. Read by
  the layout plan (elementwise ops of equal member shapes, constant padding) only.
- ``wide_member_shape_hint`` (tuple of str): one member's shape of each fold-into-batch result
  (rules/_fold.py: the member node's own value may be a tuple of several outputs). Read by
  fx/layout.py, before the member node's value.
- ``wide_expect`` ((rank, op name, member node name)): the rank a value must have, the member's
  + 1 when per member. Written by fx/widen.py ``_expect_ranks``; read by its ``check_ranks``.
- ``wide_layout_conversion`` (str): what a layout conversion kept by the plan copies. Written by
  fx/layout.py ``count_conversions``; read by ``summary()``/``report()`` and analyze.py.
- ``wide_folded`` (str): the BatchNorm node folded into a conv (fx/fold.py); for people reading
  the graph, no code reads it.

On the graph module, ``gm.meta["wide_tuning"]`` holds the strategy pass's ``Budget`` (tuning.py),
read by ``summary()`` and the model-level check. Other keys a new node carries are torch's:
``stack_trace`` and ``nn_module_stack`` (copied by ``emit`` from ``like``) and ``val``.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import fx

from ..errors import UnsupportedOperationError
from ..ops import WideOp, of_target
from .source import module_path, source_line

__all__ = ["TuneSpec", "Wide", "WidenContext", "concrete_shape", "member_rank", "op_name", "written_args"]

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class Wide:
    """A wide value of the new graph: ``node`` is N-first, each member's value has ``rank`` dims."""

    node: fx.Node
    rank: int


@dataclasses.dataclass(frozen=True)
class TuneSpec:
    """How to measure a wide op's strategies (attached by its rule as ``node.meta["wide_tune"]``).

    ``make(n, {"dtype": ..., "device": ..., "requires_grad": ...})`` returns ``{strategy:
    zero-argument callable}`` that runs the op on random tensors of the sample shapes (made with
    those options) and returns its output; the tuner times the forward for an eval graph and
    forward + backward for a train graph. ``default`` is used when nothing is measured. The chosen strategy is written into the node's ``strategy`` kwarg. The cache key is
    the op, ``node.meta["wide_shapes"]``, N, dtype and device (see tuning.py).
    """

    default: str
    make: Callable[[int, dict], dict[str, Callable[[], Any]]]
    strategies: tuple[str, ...] = ()  # the candidates' names (default: the default and "loop")
    # (device type, default) pairs: the default on that device where it differs (the strategy
    # pass applies it: a heuristic measured on one device can lose on another)
    device_defaults: tuple[tuple[str, str], ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return self.strategies or (self.default, "loop")


class WidenContext:
    """State of one widen pass: the new graph and the mapping old node -> new value."""

    # The widen pass's per-node step, installed by fx/widen.py (Note [Widening nested graphs]).
    _node_widener: ClassVar[Callable[[WidenContext, fx.Node], Any] | None] = None

    def __init__(self, n: int, strict: bool = False, opaque_paths: dict[str, str] | None = None,
                 per_member_args: dict[str, dict[str, str]] | None = None) -> None:
        self.n = n
        # Note [Per-member constants] (fx/constants.py): node name -> {argument: buffer name}, and
        # the buffer name -> its placeholder (a Wide of member rank 0)
        self.per_member_args = per_member_args or {}
        self.per_member_inputs: dict[str, Wide] = {}
        self.strict = strict
        self.opaque_paths = opaque_paths or {}  # registered modules: opaque key -> module path
        self.root: fx.Node | None = None  # placeholder fed with the WideModel (registered modules)
        self.graph = fx.Graph()
        self.env: dict[fx.Node, Any] = {}
        self.fallbacks: list[dict[str, str]] = []  # one entry per node run through a fallback
        self.rules_used: set = set()  # ops whose table row ran
        self.random_ops: set = set()  # random ops met (op names)

    def widen_node(self, node: fx.Node) -> Any:
        """The wide value of one call node, as the widen pass gives it (its rule's, a shared copy,
        or the fallback's); for rules that widen a nested graph (Note [Widening nested graphs])."""
        widener = WidenContext._node_widener
        if widener is None:
            raise RuntimeError("wide_compiler: the widen pass (wide_compiler.fx.widen) is not loaded")
        return widener(self, node)

    # -- values -------------------------------------------------------------------------------
    def value(self, arg: Any) -> Any:
        """The new-graph value of an argument of an old node (Wide, or a shared node/constant)."""
        return fx.node.map_arg(arg, lambda n: self.env[n])

    @staticmethod
    def is_wide(v: Any) -> bool:
        if isinstance(v, Wide):
            return True
        if isinstance(v, (list, tuple)):
            return any(WidenContext.is_wide(x) for x in v)
        return False

    def emit(self, target, args: tuple, kwargs: dict | None = None, like: fx.Node | None = None,
             name: str | None = None) -> fx.Node:
        """A new call node; ``like`` (an old node) lends its stack trace and module path."""
        node = self.graph.create_node("call_function", target, args, kwargs or {}, name=name)
        if like is not None:
            for key in ("stack_trace", "nn_module_stack"):
                if key in like.meta:
                    node.meta[key] = like.meta[key]
            node.meta["wide_source"] = like.name
        return node

    def emit_wide(self, target, args: tuple, kwargs: dict | None = None, *, like: fx.Node,
                  name: str | None = None, shapes: dict | None = None, tune: TuneSpec | None = None,
                  op: str | None = None) -> fx.Node:
        """Emit the wide op that stands for the member node ``like``, with its metadata (Note
        [Node metadata]): ``wide_op`` derived from ``target`` (a ``torch.ops.wide`` overload of
        kind ``"layer"`` in wide_compiler/ops.py; other targets, a registered module's call or a
        region, pass their label as ``op``), ``wide_shapes`` (``shapes``: required for an op with
        strategies, and then with an ``"input"`` entry) and ``wide_tune`` (``tune``: given exactly
        when the op has strategies, naming only the op's). An op with strategies gets
        ``strategy="auto"`` and a packed-family op ``packed_input=False`` unless ``kwargs`` say
        otherwise. A violation is a rule's bug: ``ValueError``."""
        kwargs = dict(kwargs or {})
        info = of_target(target)
        if info is not None:
            op = self._check_wide_call(info, kwargs, op, shapes, tune)
        elif op is None or tune is not None:
            raise ValueError(f"wide_compiler: internal error: emit_wide({getattr(target, '__name__', target)!r}) "
                             "of a target that is no torch.ops.wide op needs op=, and takes no tune=")
        node = self.emit(target, args, kwargs, like=like, name=name)
        node.meta["wide_op"] = op
        if shapes is not None:
            node.meta["wide_shapes"] = shapes  # the very dict a tune's make closes over
        if tune is not None:
            node.meta["wide_tune"] = tune
        return node

    @staticmethod
    def _check_wide_call(info: WideOp, kwargs: dict, op: str | None, shapes: dict | None,
                         tune: TuneSpec | None) -> str:
        """The checks of :meth:`emit_wide` for a ``torch.ops.wide`` target; fills the default
        ``strategy``/``packed_input`` kwargs in place and returns the ``wide_op`` label."""
        def bad(why: str) -> ValueError:
            return ValueError(f"wide_compiler: internal error: emit_wide of {info.qualname}: {why}")

        if info.kind != "layer":
            raise bad(f"a {info.kind!r} op is not emitted for a member op (wide_compiler/ops.py)")
        if op is not None and op != info.qualname:
            raise bad(f"op={op!r}, but the target names {info.qualname!r}")
        if shapes is not None and not isinstance(shapes, dict):
            raise bad(f"shapes must be a dict, got {type(shapes).__name__}")
        if info.strategies:
            kwargs.setdefault("strategy", "auto")
            if kwargs["strategy"] not in info.choices:
                raise bad(f"strategy {kwargs['strategy']!r} not in {info.choices}")
            if tune is None or shapes is None or "input" not in shapes:
                raise bad("an op with strategies needs tune= and shapes= with an 'input' entry (the tuning key)")
            if tune.default not in tune.names or not set(tune.names) <= set(info.strategies):
                raise bad(f"tune names {tune.names} (default {tune.default!r}); the op offers {info.strategies}")
        elif tune is not None:
            raise bad("tune= for an op with one implementation")
        if info.packed_input:
            kwargs.setdefault("packed_input", False)
        return info.qualname

    def unwrap(self, v: Any) -> Any:
        """A new-graph argument from a value (Wide -> its node)."""
        if isinstance(v, Wide):
            return v.node
        if isinstance(v, (list, tuple)):
            return type(v)(self.unwrap(x) for x in v)
        return v

    def as_wide(self, v: Any, rank: int, like: fx.Node) -> Wide:
        """A wide version of a value: shared tensors are expanded with stride 0 on dim 0 (no copy),
        which is exactly the shared-input fast path of the wide ops."""
        if isinstance(v, Wide):
            return v
        node = self.emit(aten.expand.default, (v, [self.n] + [-1] * rank), like=like)
        return Wide(node, rank)

    def align(self, v: Wide, rank: int, like: fx.Node) -> fx.Node:
        """Member rank ``v.rank`` -> ``rank`` by inserting size-1 dims right after the member dim,
        which is what right-aligned broadcasting does inside each member."""
        node = v.node
        for _ in range(rank - v.rank):
            node = self.emit(aten.unsqueeze.default, (node, 1), like=like)
        return node

    def schema_args(self, node: fx.Node) -> dict[str, Any]:
        """The node's arguments by schema name (defaults filled in), mapped to new-graph values."""
        schema = node.target._schema
        out = {}
        for i, a in enumerate(schema.arguments):
            if i < len(node.args) and not a.kwarg_only:
                raw = node.args[i]
            elif a.name in node.kwargs:
                raw = node.kwargs[a.name]
            elif a.has_default_value():
                raw = a.default_value
            else:
                raise self.fail(node, f"missing argument {a.name!r}")
            out[a.name] = self.value(raw)
        return out

    def emit_schema(self, target, values: dict[str, Any], like: fx.Node, name: str | None = None) -> fx.Node:
        """Emit ``target`` with arguments given by schema name (Wide values unwrapped)."""
        schema = target._schema
        args, kwargs = [], {}
        for a in schema.arguments:
            v = self.unwrap(values[a.name])
            if a.kwarg_only:
                kwargs[a.name] = v
            else:
                args.append(v)
        return self.emit(target, tuple(args), kwargs, like=like, name=name)

    def outputs(self, node: fx.Node, out: fx.Node, ranks: Any = None) -> Any:
        """Wrap the new node ``out`` standing for old ``node``: a Wide, or for multi-output ops a
        tuple/list of Wides (one getitem node each). ``ranks`` defaults to the old node's."""
        val = node.meta.get("val")
        if isinstance(val, (tuple, list)):
            items = []
            for i, v in enumerate(val):
                item = self.emit(operator.getitem, (out, i), like=node)
                items.append(Wide(item, v.dim()) if isinstance(v, torch.Tensor) else item)
            return type(val)(items) if isinstance(val, tuple) else items
        return Wide(out, member_rank(node) if ranks is None else ranks)

    def fail(self, node: fx.Node, why: str) -> UnsupportedOperationError:
        where = module_path(node)
        return UnsupportedOperationError(
            f"wide_compiler: cannot widen {op_name(node)} at node '{node.name}'"
            f"{f' (module {where!r})' if where else ''}, {source_line(node)}\n  {why}")


def op_name(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return f"aten.{t.__name__}" if t.namespace == "aten" else f"{t.namespace}.{t.__name__}"
    return getattr(t, "__name__", str(t))


def concrete_shape(arg: fx.Node) -> list[int]:
    """One member's shape of an old-graph node, symbolic sizes replaced by their traced sizes."""
    return [int(s.node.hint) if isinstance(s, torch.SymInt) else int(s) for s in arg.meta["val"].shape]


def member_rank(arg: Any) -> int:
    """Member-level rank of an old-graph argument (0 for Python scalars)."""
    val = arg.meta.get("val") if isinstance(arg, fx.Node) else None
    return val.dim() if isinstance(val, torch.Tensor) else 0


def written_args(node: fx.Node) -> list[Any]:
    """The arguments an op writes in place (``Tensor(a!)`` in its schema)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    out = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            out.append(node.args[i] if i < len(node.args) and not a.kwarg_only else node.kwargs.get(a.name))
    return out
