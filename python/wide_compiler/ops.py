"""Every ``torch.ops.wide`` operator described once: its strategies and default, and its layouts.

The schemas of csrc/wide/registration.cpp say what each op computes; this table says what the
Python layers need to know about it, in one place (Note [The wide op table]). The widen rules
(fx/rules/), the hand-built wide modules (:mod:`wide_compiler.nn`), the functional ops
(:mod:`wide_compiler.functional`) and the benchmarks read strategy names, defaults and layout
facts from here. It imports only torch, so every layer may import it (.importlinter).

Example:
    >>> from wide_compiler.ops import WIDE_OPS
    >>> WIDE_OPS["linear"].strategies, WIDE_OPS["linear"].default
    (('bmm', 'bmm_t', 'loop'), 'bmm')
    >>> WIDE_OPS["linear"].choices  # what the op's ``strategy`` argument accepts
    ('auto', 'bmm', 'bmm_t', 'loop')
    >>> WIDE_OPS["conv"].packed_input, WIDE_OPS["conv"].result
    (True, 'packed')
    >>> WIDE_OPS["prelu"].choices  # one implementation
    ('auto',)

Note [The wide op table]
~~~~~~~~~~~~~~~~~~~~~~~~
One row (a :class:`WideOp`) per tensor operator of the ``wide`` namespace, keyed by the schema's
name; the non-tensor schemas (build facts, allocator and ISA controls, names starting with ``_``)
have none. A row holds:

- ``kind``: who emits the op. ``"layer"``: a widen rule, for one op of the member graph (a node
  of the wide graph that ``WideModel.summary()`` lists; fx/context.py ``WidenContext.emit_wide``
  accepts only these); ``"layout"``: the conversions between N-first and channel-packed values
  (the layout plan, fx/layout.py); ``"eval"``: what a graph rewrite puts in place of a layer's
  op (the eval-graph rewrites of fx/eval_rewrites.py, the layout plan); ``"kernel"``: a
  hand-written kernel that other ops call; ``"helper"``: an in-place step a rule emits before a
  layer's op; ``"optimizer"``: a fused per-member optimizer step (:mod:`wide_compiler.optim`).
- ``strategies``: the names the op's ``strategy`` argument accepts besides ``"auto"``, in the
  order the modules list them (empty: the op has one implementation and no ``strategy``
  argument). ``"loop"`` (a loop over members) is one of them wherever there is a choice.
- ``default``: the strategy the widen rule starts from when nothing is measured (a rule may
  refine it by shape: the conv rule by weight size and plane, the rnn rule by mode; those
  heuristics live next to their rule).
- ``packed_input``: the op takes ``packed_input=`` and so reads an N-first ``[N, B, C, *]`` or a
  channel-packed ``[B, N*C, *]`` input (the packed family of DESIGN §3); ``result``: the layout
  of its result, ``"nfirst"``, ``"packed"`` or ``"none"`` (the op returns nothing: it writes its
  arguments in place).

tests/python/test_op_db.py checks the table against the schemas (an op has a ``strategy``
argument exactly when it lists strategies, a ``packed_input`` one exactly when the row says so),
calls every listed strategy on a small sample of tests/python/op_db.py, and checks that the table
and the test database name the same ops. A new op adds its row here, its schema and its op_db
entry.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["AUTO", "KINDS", "LOOP", "WIDE_OPS", "WideOp", "of_target"]

AUTO = "auto"  # every op's ``strategy`` default: the op decides (C++), or the tuner does (compile)
LOOP = "loop"  # the loop over members, offered by every op with a choice
KINDS = ("layer", "layout", "eval", "kernel", "helper", "optimizer")
_RESULTS = ("nfirst", "packed", "none")


@dataclasses.dataclass(frozen=True)
class WideOp:
    """One ``torch.ops.wide`` operator (Note [The wide op table])."""

    name: str
    kind: str
    strategies: tuple[str, ...] = ()
    default: str | None = None
    packed_input: bool = False
    result: str = "nfirst"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"wide_compiler: WideOp {self.name!r}: kind {self.kind!r} not in {KINDS}")
        if self.result not in _RESULTS:
            raise ValueError(f"wide_compiler: WideOp {self.name!r}: result {self.result!r} not in {_RESULTS}")
        if bool(self.strategies) != (self.default is not None) or (
                self.strategies and (self.default not in self.strategies or LOOP not in self.strategies)):
            raise ValueError(f"wide_compiler: WideOp {self.name!r}: expected a default among its strategies "
                             f"(loop included), got default {self.default!r} of {self.strategies}")

    @property
    def choices(self) -> tuple[str, ...]:
        """What the op's ``strategy`` argument accepts: ``"auto"`` and :attr:`strategies`
        (``("auto",)`` alone for an op with one implementation, as the wide modules list it)."""
        return (AUTO, *self.strategies)

    @property
    def qualname(self) -> str:
        """``"wide.<name>"``: how summaries, the tuning cache and ``node.meta["wide_op"]`` name it."""
        return f"wide.{self.name}"

    @property
    def overload(self) -> torch._ops.OpOverload:
        """``torch.ops.wide.<name>.default`` (the library must be loaded: import wide_compiler)."""
        return getattr(torch.ops.wide, self.name).default


def _table(*rows: WideOp) -> dict[str, WideOp]:
    return {row.name: row for row in rows}


_PACKED = {"packed_input": True, "result": "packed"}
_STEP = {"kind": "optimizer", "result": "none"}

WIDE_OPS: dict[str, WideOp] = _table(
    # bmm: one batched GEMM; bmm_t: against the transposed weights; loop: one GEMM per member
    WideOp("linear", "layer", ("bmm", "bmm_t", "loop"), "bmm"),
    WideOp("to_packed", "layout", result="packed"),
    WideOp("to_nfirst", "layout"),  # reads a packed input (its only argument is one)
    WideOp("to_channels_first", "layout", result="packed"),  # a packed input made channels-first
    # grouped: one grouped conv; grouped_cl: the same channels-last (2-d); loop: one conv per member
    WideOp("conv", "layer", ("grouped", "grouped_cl", "loop"), "grouped", **_PACKED),
    WideOp("conv_transpose", "layer", ("grouped", "grouped_cl", "loop"), "grouped", **_PACKED),
    WideOp("batch_norm", "layer", **_PACKED),
    WideOp("instance_norm", "layer", **_PACKED),
    WideOp("group_norm", "layer", **_PACKED),
    WideOp("group_norm_nfirst", "eval"),  # the layout plan's GroupNorm between N-first ops
    WideOp("fused_group_norm", "kernel"),
    # fused: one norm over all members, the affine in one addcmul; loop: one ATen norm per member
    WideOp("layer_norm", "layer", ("fused", "loop"), "fused"),
    WideOp("rms_norm", "layer"),
    WideOp("add_layer_norm", "eval"),
    WideOp("fused_norm", "kernel"),
    WideOp("fused_norm_backward", "kernel"),
    WideOp("fused_batch_norm", "kernel", result="packed"),  # batch_norm's training kernel, per packed channel
    WideOp("fused_batch_norm_backward", "kernel", result="packed"),
    WideOp("attention", "eval"),
    WideOp("small_attention", "kernel"),
    WideOp("prelu", "layer", **_PACKED),
    WideOp("embedding", "layer"),
    WideOp("embedding_renorm_", "helper"),  # renormalises rows of the [N, V, D] tables in place
    WideOp("embedding_bag", "layer"),
    # fused: one time loop for all members; loop: ATen's recurrent op per member (the rnn rule
    # defaults LSTMs to it: fx/rules/rnn.py)
    WideOp("rnn", "layer", ("fused", "loop"), "fused"),
    WideOp("rnn_cell", "layer"),
    WideOp("sgd_step", **_STEP),
    WideOp("adam_step", **_STEP),
    WideOp("rmsprop_step", **_STEP),
    WideOp("adagrad_step", **_STEP),
)


def of_target(target: object) -> WideOp | None:
    """The row of a call target: a ``torch.ops.wide`` overload (or packet) -> its row; anything
    else (an ATen op, a Python function) -> None.

    >>> import torch, wide_compiler
    >>> from wide_compiler.ops import of_target
    >>> of_target(torch.ops.wide.conv.default).name
    'conv'
    >>> of_target(torch.ops.aten.relu.default) is None
    True
    """
    schema = getattr(target, "_schema", None)
    if schema is None and isinstance(target, torch._ops.OpOverloadPacket):
        schema = target.default._schema
    name = getattr(schema, "name", "")
    namespace, _, op = name.partition("::")
    return WIDE_OPS.get(op) if namespace == "wide" else None
