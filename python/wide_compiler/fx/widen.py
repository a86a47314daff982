"""The widen pass: every node of a member's captured graph gets its wide form.

A value of the wide graph is either *wide* (a tensor whose dim 0 is the member dim; member i's
value is ``t[i]``, and its member-level rank is tracked) or *shared* (identical for every member:
Python scalars, lifted constants, anything computed from shared values only).

Rules are one table keyed by ATen overload, grouped by family as functorch's batching rules are
(``fx/rules/<family>.py``): a new pointwise op is one row, and ops tagged ``pointwise`` need no row
at all. Ops that read only shared values are copied unchanged (every member would compute the same
thing), except random ops, whose draws must be independent per member. An op with no rule runs
through a correct per-op fallback (``torch.vmap`` of that op over the member dim, or a loop over
members where vmap cannot), with one warning naming the op and the user's source line;
``strict=True`` raises :class:`UnsupportedOperationError` instead. Nothing is ever run with one
member's weights for all.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx.experimental.symbolic_shapes import is_concrete_int
from torch.utils._pytree import tree_flatten, tree_map

from ..errors import UnsupportedOperationError
# The pass's vocabulary lives in fx/context.py (shared with the rules and the fallback, which this
# module imports); its names are re-exported here, their home before.
from .context import TuneSpec, Wide, WidenContext, concrete_shape, member_rank, op_name, written_args  # noqa: F401
from .source import source_line
from .table import RuleEntry, find_rule

__all__ = ["TuneSpec", "Wide", "WideGraph", "WidenContext", "widen"]

log = logging.getLogger(__name__)
aten = torch.ops.aten


@dataclasses.dataclass
class GraphInput:
    """One placeholder of the wide graph: a stacked parameter/buffer/constant, or a user input."""

    kind: str  # "parameter" | "buffer" | "constant" | "user" | "root" (the WideModel itself)
    name: str  # state-dict name for parameters/buffers/constants, placeholder name for users
    node: fx.Node  # the placeholder in the wide graph (its meta["val"] is one member's value)
    # one member's shape (None for the dynamic batch size) for tensors; the traced value otherwise
    member_shape: tuple | None = None
    sample_value: Any = None


@dataclasses.dataclass
class WideGraph:
    """The result of :func:`widen`."""

    graph_module: fx.GraphModule
    inputs: list[GraphInput]
    # buffer name per mutated-buffer output, in output order before the user outputs
    mutated_buffers: list[str]
    in_spec: Any
    out_spec: Any
    fallbacks: list[dict[str, str]]  # nodes run through a fallback: op, node, source, how
    # k when the inputs are exactly k positional tensors (the forward's fast path), else None
    positional_arity: int | None = None
    # the rule-table rows this graph went through (tests/python/test_rule_coverage.py)
    rules_used: set = dataclasses.field(default_factory=set)
    # the random ops of the member graph ("aten.dropout.default" ...): members draw their own numbers
    random_ops: set = dataclasses.field(default_factory=set)
    # Note [Member tiles] (fx/tiling.py): what runs instead of graph_module when the members run
    # in chunks of member_tile (0: untiled)
    tiled: fx.GraphModule | None = None
    member_tile: int = 0
    # Note [Guards] (fx/guards.py): what the capture assumes of the user inputs, checked at each call
    guards: Any = None
    # Note [Per-member constants at the call] (model_constants.py): ConstantPlan.table() of the graph's capture
    constant_table: Any = None
    # the names of the user inputs the forward writes in place (a call may not pass them with stride 0)
    inputs_written: frozenset = frozenset()
    # what an eval graph's backward would not follow (a custom Function...): Note [An eval graph whose
    # backward is not the members'] (fx/state.py)
    no_backward: str | None = None




# --- the pass --------------------------------------------------------------------------------


def _is_random(node: fx.Node) -> bool:
    tags = getattr(node.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


_BERNOULLI_P = (torch.ops.aten.bernoulli_.float, torch.ops.aten.bernoulli.p)  # a scalar p


def _draws(ctx: WidenContext, node: fx.Node) -> bool:
    """A random op that really draws: not a dropout with ``p == 0`` / ``train=False`` (or SDPA
    with ``dropout_p == 0``), nor a ``bernoulli`` with a scalar ``p`` of 0 or 1, nor a recurrent layer (``aten.lstm``/``gru``/``rnn_*``) whose
    ``dropout`` is 0 or that has one layer (its dropout applies between layers only, in ATen
    and in ``wide.rnn`` alike), whose outputs are deterministic and can be compared per member."""
    if not _is_random(node):
        return False
    values = ctx.schema_args(node) if hasattr(node.target, "_schema") else {}
    if node.name in ctx.per_member_args:  # a per-member p: some member may draw
        return values.get("train", True) is not False
    if any(isinstance(values.get(p), (int, float)) and values[p] == 0 for p in ("p", "dropout_p", "dropout")):
        return False
    if node.target in _BERNOULLI_P and isinstance(values.get("p"), (int, float)) and values["p"] == 1:
        return False  # every draw is 1, as every draw with p == 0 is 0
    if isinstance(values.get("num_layers"), int) and values["num_layers"] <= 1 and "dropout" in values:
        return False
    return values.get("train", True) is not False


def widen(ep: ExportedProgram, n: int, *, strict: bool = False,
          opaque_paths: dict[str, str] | None = None,
          per_member_args: dict[str, dict[str, str]] | None = None) -> WideGraph:
    """Turn the graph of one member into the graph of ``n`` members.

    Parameters and buffers become placeholders fed with stacked ``[n, ...]`` tensors; user inputs
    become N-first placeholders; every call node is rewritten by :data:`RULES`.
    ``per_member_args`` (node name -> {argument: buffer name}, from fx/constants.py) names the
    scalar arguments that are per-member constants: each buffer becomes a placeholder fed with
    its ``[n]`` tensor, and those nodes are widened by their per-member form.
    """
    sig = ep.graph_signature
    ctx = WidenContext(n, strict, opaque_paths, per_member_args)
    inputs: list[GraphInput] = []
    if any((e := find_rule(node.target)) is not None and e.always for node in ep.graph.nodes):
        ctx.root = ctx.graph.placeholder("wide_model")
        inputs.append(GraphInput("root", "", ctx.root))
    kinds = {InputKind.PARAMETER: "parameter", InputKind.BUFFER: "buffer",
             InputKind.CONSTANT_TENSOR: "constant", InputKind.USER_INPUT: "user"}
    spec_by_name = {s.arg.name: s for s in sig.input_specs if hasattr(s.arg, "name")}

    for node in ep.graph.nodes:
        if node.op == "placeholder":
            spec = spec_by_name.get(node.name)
            kind = kinds.get(spec.kind) if spec is not None else None
            if kind is None:
                raise UnsupportedOperationError(
                    f"wide_compiler: cannot widen input '{node.name}' of kind {spec and spec.kind}")
            new = ctx.graph.placeholder(node.name)
            new.meta.update({k: v for k, v in node.meta.items() if k in ("val", "tensor_meta")})
            val = node.meta.get("val")
            shape = (tuple(int(s) if is_concrete_int(s) else None for s in val.shape)
                     if isinstance(val, torch.Tensor) else None)
            inputs.append(GraphInput(kind, spec.target if kind != "user" else node.name, new, shape,
                                     None if isinstance(val, torch.Tensor) else val))
            if kind in ("parameter", "buffer") or (kind == "user" and isinstance(val, torch.Tensor)):
                ctx.env[node] = Wide(new, val.dim())
            else:  # lifted constants and non-tensor user inputs are shared by all members
                ctx.env[node] = new
        elif node.op == "call_function":
            if ctx.per_member_args and not ctx.per_member_inputs:
                _per_member_placeholders(ctx, inputs)
            if _copies_into_itself(node):  # Note [A buffer written back into itself]
                ctx.env[node] = ctx.value(node.args[0])
                continue
            ctx.env[node] = _widen_node(ctx, node)
            _expect_ranks(ctx.env[node], node)
        elif node.op == "get_attr":  # the body of a higher-order region (rules/regions.py)
            ctx.env[node] = getattr(ep.graph_module, node.target)
        elif node.op == "output":
            outs = node.args[0]
            mutated = []
            new_outs = []
            for spec, o in zip(sig.output_specs, outs):
                v = ctx.value(o)
                if spec.kind == OutputKind.BUFFER_MUTATION:
                    mutated.append(spec.target)
                elif spec.kind != OutputKind.USER_OUTPUT:
                    raise UnsupportedOperationError(
                        f"wide_compiler: cannot widen an output of kind {spec.kind}")
                if isinstance(v, fx.Node) and isinstance(o.meta.get("val"), torch.Tensor):
                    v = ctx.as_wide(v, member_rank(o), o)  # a shared output: every member's copy
                new_outs.append(ctx.unwrap(v))
            ctx.graph.output(tuple(new_outs))
        else:
            raise UnsupportedOperationError(f"wide_compiler: unexpected graph node {node.op} {node.target}")

    ctx.graph.lint()
    gm = fx.GraphModule(torch.nn.Module(), ctx.graph, class_name="WideGraph")
    users = [i for i in inputs if i.kind == "user"]
    arity = len(users) if all(i.member_shape is not None for i in users) and \
        tree_flatten((tuple(range(len(users))), {}))[1] == ep.call_spec.in_spec else None
    users = {i.node.name for i in inputs if i.kind == "user"}
    written = frozenset(arg.name for node in ep.graph.nodes if node.op == "call_function"
                        and getattr(getattr(node.target, "_schema", None), "is_mutable", False)
                        for arg, a in zip(node.args, node.target._schema.arguments)
                        if a.alias_info is not None and a.alias_info.is_write and isinstance(arg, fx.Node)
                        and arg.name in users)
    return WideGraph(gm, inputs, mutated, ep.call_spec.in_spec, ep.call_spec.out_spec, ctx.fallbacks, arity,
                     ctx.rules_used, ctx.random_ops, inputs_written=written)


def _per_member_placeholders(ctx: WidenContext, inputs: list[GraphInput]) -> None:
    """One placeholder per per-member constant buffer read by the graph (after the member's own
    placeholders), fed with the WideModel's ``[n]`` buffer of that name."""
    for name in sorted({b for names in ctx.per_member_args.values() for b in names.values()}):
        new = ctx.graph.placeholder("per_member_" + "".join(c if c.isalnum() else "_" for c in name))
        new.meta["val"] = torch.empty((), dtype=torch.float64)
        inputs.append(GraphInput("buffer", name, new, ()))
        ctx.per_member_inputs[name] = Wide(new, 0)


def _expect_ranks(value: Any, node: fx.Node) -> None:
    """Record on the new node(s) standing for ``node`` the rank its value must have: the member's
    rank + 1 for a wide value, the member's for a shared one (checked by :func:`check_ranks`)."""
    val = node.meta.get("val")
    vals, values = (list(val), list(value)) if isinstance(val, (tuple, list)) and isinstance(
        value, (tuple, list)) else ([val], [value])
    for v, m in zip(values, vals):
        if not isinstance(m, torch.Tensor):
            continue
        if isinstance(v, Wide):
            v.node.meta.setdefault("wide_expect", (m.dim() + 1, op_name(node), node.name))
        elif isinstance(v, fx.Node):
            v.meta.setdefault("wide_expect", (m.dim(), op_name(node), node.name))


def _fake_feed(i: GraphInput, n: int) -> Any:
    """A fake wide input for placeholder ``i`` at the sizes the member was captured with."""
    v = i.node.meta.get("val")
    if not isinstance(v, torch.Tensor):
        return v
    shape = [s.node.hint if isinstance(s, torch.SymInt) else int(s) for s in v.shape]
    return torch.empty(shape if i.kind == "constant" else (n, *shape), dtype=v.dtype, device=v.device)


def _cannot_fake(e: BaseException) -> bool:
    """Whether a failure of the fake run says only that fake tensors cannot run an op (a
    data-dependent output size or value, an op with no fake kernel), not that the graph is wrong."""
    from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException,
                                               UnsupportedFakeTensorException, UnsupportedOperatorException)
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, PendingUnbackedSymbolNotFound

    return isinstance(e, (DataDependentOutputException, DynamicOutputShapeException, UnsupportedFakeTensorException,
                          UnsupportedOperatorException, GuardOnDataDependentSymNode, PendingUnbackedSymbolNotFound,
                          NotImplementedError))


def _fake_run(gm: fx.GraphModule, feeds_of: Callable[[Any], list], current: list) -> None:
    """Run ``gm`` on fake tensors (``feeds_of(mode)`` makes its inputs), recording the node being
    run in ``current``; the nodes' ``meta["val"]`` are left as they were."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    class _Prop(FakeTensorProp):
        def run_node(self, node: fx.Node) -> Any:
            current[:] = [node]
            return super().run_node(node)

    mode = FakeTensorMode(allow_non_fake_inputs=True)  # concrete sizes: the sample's
    with mode:
        feeds = feeds_of(mode)
    _Prop(gm, mode).propagate_dont_convert_inputs(*feeds)


def _member_fails_too(member: ExportedProgram | None) -> bool:
    """Whether the member's own captured program fails on inputs of the sample's sizes and
    dtypes: on fake tensors, or (fake kernels check less than real ones, e.g. dtypes) for real on
    member 0's captured parameters with zeros as inputs (valid indices, too) and no gradients;
    the lifted program is functional, so nothing is written. Then a failure of the wide graph
    there is the sample's, not the widening's (members of another dtype than the sample)."""
    if member is None:
        return False
    gm = member.graph_module
    before = {node: node.meta.get("val") for node in gm.graph.nodes}
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    targets = {s.arg.name: s.target for s in member.graph_signature.input_specs if hasattr(s.arg, "name")}

    def sample_of(v: Any, make) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        shape = [s.node.hint if isinstance(s, torch.SymInt) else int(s) for s in v.shape]
        return make(shape, dtype=v.dtype, device=v.device)

    def real(node: fx.Node) -> Any:
        target = targets.get(node.name)
        state = member.state_dict.get(target, member.constants.get(target)) if target is not None else None
        return state if state is not None else sample_of(before[node], torch.zeros)

    try:
        _fake_run(gm, lambda mode: [sample_of(before[p], torch.empty) for p in placeholders], [])
        with torch.no_grad():
            gm(*[real(p) for p in placeholders])
        return False
    except Exception:  # noqa: BLE001 -- any failure: the member cannot run the sample either
        return True
    finally:
        _restore_vals(before)


def _restore_vals(before: dict[fx.Node, Any]) -> None:
    """Put back each node's ``meta["val"]`` as it was before a fake run (absent stays absent)."""
    for node, v in before.items():
        if v is None:
            node.meta.pop("val", None)
        else:
            node.meta["val"] = v


def _meta_ranks(gm: fx.GraphModule, inputs: Sequence[GraphInput], n: int) -> dict[fx.Node, int] | None:
    """Note [Rank check on meta tensors]: the rank of every tensor value of ``gm`` run on meta
    tensors at the sample's sizes, or None when that run does not go to its end.

    The rank check's fake run (:func:`_fake_run`) pays FakeTensorMode's Python dispatch at every
    ATen op of every wide op's decomposition: 0.6 s for ResNet-18's train graph at N=4 and 2.7 s
    for DenseNet-121's (CPU time), a fifth of torch.export's own time. Meta tensors reach the
    same shape functions (fake tensors run the meta kernels) from C++. So the meta run comes
    first, and a graph whose every value has the rank its rule claims is accepted on it; where
    it does not run to its end (an op without a meta kernel, a data-dependent size, a device it
    cannot mix) or a rank differs, the fake run decides, as before, with its errors."""
    ranks: dict[fx.Node, int] = {}

    meta = torch.device("meta")
    home = {i.node.meta["val"].device for i in inputs if isinstance(i.node.meta.get("val"), torch.Tensor)}
    to_meta = lambda a: a.to(meta) if isinstance(a, torch.Tensor) and a.device in home else a  # noqa: E731

    class _Run(fx.Interpreter):
        # the inputs' device becomes meta everywhere: a constant of the graph, a creation op's
        # device (ranks do not depend on it); another device stays, and mixing it stops the run
        def run_node(self, node: fx.Node) -> Any:
            out = super().run_node(node)
            if isinstance(out, torch.Tensor):
                ranks[node] = out.dim()
            return out

        def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
            return tree_map(to_meta, super().get_attr(target, args, kwargs))

        def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
            if isinstance(kwargs.get("device"), (torch.device, str)) and torch.device(kwargs["device"]) in home:
                kwargs = {**kwargs, "device": meta}
            # a device given positionally (BERT's attention_mask.to(device, torch.bool) is
            # aten.to.device(mask, cpu, bool)): the inputs' device becomes meta there too
            args = tuple(meta if isinstance(a, torch.device) and a in home else a for a in args)
            return super().call_function(target, tree_map(to_meta, args), tree_map(to_meta, kwargs))

    def feed(i: GraphInput) -> Any:
        v = i.node.meta.get("val")
        if not isinstance(v, torch.Tensor):
            return v
        shape = [s.node.hint if isinstance(s, torch.SymInt) else int(s) for s in v.shape]
        return torch.empty(shape if i.kind == "constant" else (n, *shape), dtype=v.dtype, device="meta")

    try:
        _Run(gm).run(*[feed(i) for i in inputs])
    except Exception as e:  # noqa: BLE001 -- any failure: the fake run decides
        log.debug("wide_compiler: rank check on meta tensors stopped (%s: %s); running it on fake tensors",
                  type(e).__name__, e)
        return None
    return ranks


def check_ranks(wg: WideGraph, n: int, member: ExportedProgram | None = None) -> None:
    """Run the wide graph on fake tensors at the sample's sizes and check that every value a rule
    produced has the rank it claims: N-first values one more than the member's, shared ones the
    member's. A value labelled per member that is really shared (or the reverse) would otherwise
    broadcast into silently wrong members whenever a size happens to equal N. Raises on a
    mismatch, naming the member node and its source line; also raises when an op of the wide
    graph fails on the sample's sizes (say a per-member index given to an op that takes a list of
    positions), which the first call with inputs of the sample's structure would hit. A fake run
    that stops at an op fake tensors cannot run (a data-dependent size, an op with no fake kernel),
    or where ``member`` (the member's captured program) fails too (the sample itself cannot run,
    e.g. its dtype is not the members'), leaves the rest to the first call (logged at debug level)."""
    if any(i.kind == "root" for i in wg.inputs):
        return  # registered modules run the WideModel itself: no fake stand-in for it
    gm = wg.graph_module
    ranks = _meta_ranks(gm, wg.inputs, n)  # Note [Rank check on meta tensors]
    if ranks is not None and all(node.meta["wide_expect"][0] == ranks[node] for node in gm.graph.nodes
                                 if node.meta.get("wide_expect") is not None and node in ranks):
        return
    before = {node: node.meta.get("val") for node in gm.graph.nodes}
    current: list[fx.Node] = []
    failed: tuple[fx.Node, Exception] | None = None
    try:
        _fake_run(gm, lambda mode: [_fake_feed(i, n) for i in wg.inputs], current)
        bad = []
        for node in gm.graph.nodes:
            expect = node.meta.get("wide_expect")
            got = node.meta.get("val")
            if expect is not None and isinstance(got, torch.Tensor) and got.dim() != expect[0]:
                bad.append((node, expect, got.dim()))
    except Exception as e:  # noqa: BLE001 -- sorted below: a real failure, or one fake cannot run
        cause = e.__cause__ if e.__cause__ is not None and not _cannot_fake(e) else e
        if _cannot_fake(cause) or not current or current[0].op != "call_function":
            log.debug("wide_compiler: rank check stopped early (the fake run cannot go on: %s: %s)",
                      type(e).__name__, e)
            return
        failed = (current[0], cause)
    finally:
        _restore_vals(before)
    if failed is not None and _member_fails_too(member):
        log.debug("wide_compiler: rank check stopped early: the member's own graph cannot run the sample's "
                  "sizes and dtypes either (%s: %s)", type(failed[1]).__name__, failed[1])
        return
    if failed is not None:
        node, e = failed
        member = node.meta.get("wide_source", node.name)
        raise UnsupportedOperationError(
            f"wide_compiler: internal error: the wide graph fails at node '{node.name}' "
            f"({getattr(node.target, '__name__', node.target)}, from member node '{member}'), "
            f"{source_line(node)}, on inputs of the sample's sizes: {type(e).__name__}: "
            f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}\n  Every call would fail there, so "
            f"compile stops. Please report it; @wide_compiler.register on the module works around it.")
    if bad:
        node, (expect, op, name), got = bad[0]
        raise UnsupportedOperationError(
            f"wide_compiler: internal error: {op} at node '{name}', {source_line(node)} was "
            f"widened to a value of rank {got} where rank {expect} was expected (a per-member value "
            f"labelled shared or the reverse); this would mix members, so compile stops. Please report "
            f"it; strict=False does not help, but @wide_compiler.register on the module works around it.")


# Note [A buffer written back into itself]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A forward that updates a buffer in place (``self.count += 1``) is captured as the in-place op
# (``add_(count, 1)``) and, at the end, export's write-back of the buffer: ``copy_(count, add_)``,
# whose source IS the buffer (an in-place op returns its own input). The copy changes no value, but
# it is one more write: autograd counts it, so a value saved for the backward from the buffer in
# between (``self.fc(x) * self.count``) is "modified by an inplace operation" in the wide model's
# backward, where the member alone, which never runs that copy, trains. Such a copy is dropped.
def _copies_into_itself(node: fx.Node) -> bool:
    """Whether ``node`` is ``copy_(dst, src)`` where ``src`` is ``dst`` written in place (through
    any chain of in-place ops: ``dst.add_(1).mul_(2)``)."""
    if node.target is not aten.copy_.default or len(node.args) < 2 or node.kwargs.get("non_blocking"):
        return False
    dst, src = node.args[0], node.args[1]
    while isinstance(src, fx.Node) and src is not dst:
        schema = getattr(src.target, "_schema", None)
        if src.op != "call_function" or schema is None or not schema.arguments or not schema.returns \
                or not src.args:
            return False
        first, ret = schema.arguments[0].alias_info, schema.returns[0].alias_info
        if first is None or not first.is_write or ret is None or ret.before_set != first.before_set:
            return False
        src = src.args[0]
    return src is dst


def _widen_node(ctx: WidenContext, node: fx.Node) -> Any:
    """The wide value of one call node: its rule's, a shared copy, or the fallback's."""
    entry: RuleEntry | None = find_rule(node.target)
    args = [ctx.value(a) for a in node.args] + [ctx.value(a) for a in node.kwargs.values()]
    if _draws(ctx, node):
        ctx.random_ops.add(op_name(node))
    if ctx.is_wide(args) or (entry is not None and _is_random(node)) or node.name in ctx.per_member_args:
        _own_written_tensors(ctx, node)  # per-member data is written
    if node.name in ctx.per_member_args:  # Note [Per-member constants] (fx/constants.py)
        from .rules._constants import widen_per_member

        return widen_per_member(ctx, node)
    if not ctx.is_wide(args) and not (entry is not None and (entry.always or _is_random(node))):
        if _is_random(node):  # members must draw independently: N draws, stacked
            return fallback(ctx, node, reason="a random op with no wide rule")
        # every member would compute the same value: one shared copy
        return ctx.emit(node.target, ctx.value(node.args), ctx.value(node.kwargs), like=node, name=node.name)
    if entry is None:
        return fallback(ctx, node)
    ctx.rules_used.add(entry.op)
    return entry.fn(ctx, node)




def _is_view(node: fx.Node) -> bool:
    """Whether ``node`` returns a view of its first argument (an alias in its schema's return)."""
    schema = getattr(node.target, "_schema", None)
    return (node.op == "call_function" and schema is not None and bool(schema.returns)
            and schema.returns[0].alias_info is not None and not schema.returns[0].alias_info.is_write)


def _own_written_tensors(ctx: WidenContext, node: fx.Node) -> None:
    """Note [Per-member writes into shared tensors]: a tensor made inside forward from shared
    values only (``out = torch.zeros(B, 8)``) is ONE shared tensor in the wide graph. When an op
    writes per-member data into it in place (``out[:, :4] = self.fc(x)``, ``index_add_``), every
    member needs its own copy: the tensor's base becomes ``clone(expand(base, N))`` right here
    (its value so far is the same for every member), and the views of it already taken are
    derived again from the per-member copy, so later reads of the base or of any view see each
    member's own writes."""
    for target in written_args(node):
        if not isinstance(target, fx.Node) or isinstance(ctx.env.get(target), Wide):
            continue
        base = target
        while _is_view(base) and isinstance(base.args[0], fx.Node):
            base = base.args[0]
        val = base.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise ctx.fail(node, "an in-place write of per-member values into a shared value that is not a tensor")
        if base.op == "placeholder":
            raise ctx.fail(node, f"an in-place write of per-member values into the shared input '{base.name}'")
        expanded = ctx.as_wide(ctx.env[base], val.dim(), base)
        ctx.env[base] = Wide(ctx.emit(aten.clone.default, (expanded.node,),
                                      {"memory_format": torch.contiguous_format}, like=base), val.dim())
        aliases = {base}
        for old in list(ctx.env):  # nodes done so far, in graph order
            if old is not base and _is_view(old) and old.args[0] in aliases:
                aliases.add(old)
                ctx.env[old] = _widen_node(ctx, old)


# Rule families register themselves in the table on import (one family per file, DESIGN §8); they
# and the fallback import fx/context.py, never this module, so these imports close no cycle.
from . import rules  # noqa: E402,F401
from .fallback import fallback  # noqa: E402

# Rules that widen a nested graph reach the per-node step through the context (Note [Widening
# nested graphs] in fx/context.py).
WidenContext._node_widener = _widen_node
