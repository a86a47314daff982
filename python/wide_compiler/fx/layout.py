"""The layout plan: keep conv/norm/pool runs channel-packed ``[B, N*C, *]`` end to end.

See DESIGN §3 and Note [wide layouts] (csrc/wide/ops/layout.cpp). The widen rules of the packed
family (``wide.conv``, ``wide.conv_transpose``, ``wide.batch_norm``, ``wide.instance_norm``,
``wide.group_norm``, ``wide.prelu``) emit ``wide.to_nfirst(op(x, packed_input=False), N)``: every
value the other rules see is N-first. This pass (the "layout" pass of fx/pipeline.py):

1. pushes ``to_nfirst`` down through layout-transparent ops, which give the same member values on
   packed and N-first tensors:

   - elementwise ops (the pointwise family, dropout, alpha dropout) whose tensor operands are all
     ``to_nfirst`` of packed values with identical member shapes (so broadcasting can't mix
     members);
   - the per-channel spatial ops widened by folding the member dim into the batch
     (``unflatten(op(flatten(x, 0, 1)), 0, [N, -1])``: pooling, padding, upsampling, channel
     dropout) and constant padding of spatial dims: on a packed input they run as they are;

2. feeds a packed op whose input is ``to_nfirst(p)`` with ``p`` itself (``packed_input=True``);
3. removes the ``to_nfirst`` nodes left without users, and marks the layout conversions that
   remain (``node.meta["wide_layout_conversion"]``, counted by ``WideModel.summary()``/``report()``):
   each packed op fed an N-first value (a copy, or nothing for a shared ``x.expand(N, ...)``
   input of a conv) and each ``to_nfirst`` still read by a non-packed op (a view; the reader, e.g.
   a Linear, pays the copy if it needs N-first memory).

4. runs a GroupNorm fed N-first whose every reader is N-first (a lone norm, or one between Linear
   layers) as ``wide.group_norm_nfirst``, with no layout change at all: its members' groups are
   already contiguous rows of the N-first memory (Note [N-first group norm kernel]). (An
   InstanceNorm without running statistics is such a GroupNorm too, but it keeps its own op:
   under CUDA autocast ATen runs it in the activation's dtype and GroupNorm in float32.)

5. in a CPU train graph, makes the result of a max pool that ends a channels-last run channels-first
   once for all its readers (``wide.to_channels_first``, whose gradient goes back channels-last):
   the run starts at a conv whose default strategy is channels-last (a train graph's RGB stem
   before a max pool, Note [Stem layout]) and goes through norms and activations, and the convs
   after the pool run channels-first. Each reader would otherwise convert on its own and hand
   back a channels-first gradient, which the max pool's backward converts twice (Note
   [Layout-keeping conversion] in csrc/wide/ops/conv_autograd.cpp). Only where a packed op
   reads the pool (a pool read N-first alone is handed on as a view). On a channels-first value
   (the tuner chose another stem strategy) it is free. (On CUDA every conv defaults to
   channels-last: nothing to convert.)

A ResNet thus keeps two conversions: the input into the stem conv, and the pooled features into
the classifier (and in a CPU train graph the stem's pooled features made channels-first). The
pass only rewrites what it proves equivalent; anything else stays N-first, which is always
correct.
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
from torch import fx

from .rules.conv import LAYOUT_KEEPING_ACTIVATIONS
from .table import find_rule, packed_ops

__all__ = ["plan_layout", "count_conversions"]

log = logging.getLogger(__name__)
aten = torch.ops.aten
TO_NFIRST = torch.ops.wide.to_nfirst.default
TO_CHANNELS_FIRST = torch.ops.wide.to_channels_first.default
_CONV = torch.ops.wide.conv.default
_GROUP_NORM = torch.ops.wide.group_norm.default
_GROUP_NORM_NFIRST = torch.ops.wide.group_norm_nfirst.default
# Packed norms and activations: a channels-last input gives a channels-last result.
_KEEPS_LAYOUT = {torch.ops.wide.batch_norm.default, torch.ops.wide.group_norm.default,
                 torch.ops.wide.instance_norm.default, *LAYOUT_KEEPING_ACTIVATIONS}
# Reading sizes of a view is free: such readers do not make a to_nfirst a conversion.
_SIZE_READERS = {aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int,
                 aten.sym_storage_offset.default}


def _layout(node: fx.Node) -> str:
    """The layout behaviour of the rule that emitted ``node`` (the table's ``layout``)."""
    entry = find_rule(node.target)
    return entry.layout if entry is not None else "nfirst"


def _is_to_nfirst(a: Any) -> bool:
    return isinstance(a, fx.Node) and a.op == "call_function" and a.target is TO_NFIRST


def _member_shape(node: fx.Node, old: dict[str, fx.Node]) -> tuple | None:
    """One member's shape (as strings, symbolic sizes by name) of the old node behind ``node``."""
    if node.meta.get("wide_member_shape_hint") is not None:
        return node.meta["wide_member_shape_hint"]
    src = old.get(node.meta.get("wide_source", ""))
    val = src.meta.get("val") if src is not None else None
    if isinstance(val, (tuple, list)):
        return None
    return tuple(str(s) for s in val.shape) if isinstance(val, torch.Tensor) else None


def _wrap(graph: fx.Graph, value: fx.Node, n: int, like: fx.Node, shape: tuple | None) -> fx.Node:
    with graph.inserting_after(value):
        out = graph.call_function(TO_NFIRST, (value, n))
    for key in ("stack_trace", "nn_module_stack", "wide_source"):
        if key in like.meta:
            out.meta[key] = like.meta[key]
    out.meta["wide_member_shape"] = shape
    return out


def _push_elementwise(graph: fx.Graph, node: fx.Node, n: int, old: dict[str, fx.Node]) -> bool:
    if _layout(node) != "elementwise" or not node.users:
        return False
    operands = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node)]
    if not operands or not all(_is_to_nfirst(a) and a.args[1] == n for a in operands):
        return False
    if any(isinstance(a, (list, tuple)) and any(isinstance(x, fx.Node) for x in a)
           for a in (*node.args, *node.kwargs.values())):
        return False
    shapes = {a.meta.get("wide_member_shape") for a in operands}
    out_shape = _member_shape(node, old)
    if len(shapes) != 1 or None in shapes or out_shape not in shapes:
        return False  # broadcasting between different member shapes: keep N-first
    node.args = tuple(a.args[0] if _is_to_nfirst(a) else a for a in node.args)
    node.kwargs = {k: (a.args[0] if _is_to_nfirst(a) else a) for k, a in node.kwargs.items()}
    users = list(node.users)
    wrapped = _wrap(graph, node, n, node, out_shape)
    for u in users:
        u.replace_input_with(node, wrapped)
    return True


def _fold_outputs(node: fx.Node) -> list[tuple[fx.Node, fx.Node]] | None:
    """(value, unflatten) pairs of a folded op: its unflatten users, or getitem -> unflatten."""
    pairs = []
    for u in node.users:
        if u.target is aten.unflatten.int and u.args[1] == 0:
            pairs.append((node, u))
        elif u.target is operator.getitem:
            for uu in u.users:
                if uu.target is aten.unflatten.int and uu.args[1] == 0:
                    pairs.append((u, uu))
                else:
                    return None
        else:
            return None
    return pairs or None


def _push_fold(graph: fx.Graph, node: fx.Node, n: int, old: dict[str, fx.Node]) -> bool:
    if _layout(node) not in ("fold", "pad") or not node.args:
        return False
    flat = node.args[0]
    if not (isinstance(flat, fx.Node) and flat.target is aten.flatten.using_ints
            and tuple(flat.args[1:]) == (0, 1) and len(flat.users) == 1 and _is_to_nfirst(flat.args[0])):
        return False
    if any(isinstance(a, fx.Node) for a in (*node.args[1:], *node.kwargs.values())):
        return False
    pairs = _fold_outputs(node)
    if pairs is None:
        return False
    src = flat.args[0]
    node.update_arg(0, src.args[0])
    graph.erase_node(flat)
    for value, unflat in pairs:
        wrapped = _wrap(graph, value, n, unflat, _member_shape(unflat, old))
        unflat.replace_all_uses_with(wrapped)
        graph.erase_node(unflat)
    return True


def _push_constant_pad(graph: fx.Graph, node: fx.Node, n: int, old: dict[str, fx.Node]) -> bool:
    """Constant padding of spatial dims only (the lead's spatial rule pads N-first directly)."""
    if _layout(node) != "pad" or not _is_to_nfirst(node.args[0]):
        return False
    mode = node.args[2] if len(node.args) > 2 else node.kwargs.get("mode", "constant")
    shape = node.args[0].meta.get("wide_member_shape")
    pad = node.args[1]
    if mode != "constant" or shape is None or not isinstance(pad, (list, tuple)):
        return False
    if len(pad) // 2 > len(shape) - 2:  # touches the channel or batch dim
        return False
    node.update_arg(0, node.args[0].args[0])
    users = list(node.users)
    wrapped = _wrap(graph, node, n, node, _member_shape(node, old))
    for u in users:
        u.replace_input_with(node, wrapped)
    return True


def _feed_packed(node: fx.Node, packed: frozenset) -> bool:
    if node.target not in packed or node.kwargs.get("packed_input") or not _is_to_nfirst(node.args[0]):
        return False
    node.update_arg(0, node.args[0].args[0])
    node.update_kwarg("packed_input", True)
    shapes = node.meta.get("wide_shapes")
    if isinstance(shapes, dict):
        shapes["packed_input"] = True
    return True


def _run_nfirst(graph: fx.Graph, node: fx.Node) -> bool:
    """Step 4 of the module docstring for ``node``: whether it was rewritten."""
    if (node.target is not _GROUP_NORM or node.kwargs.get("packed_input") or not node.users
            or not all(_is_to_nfirst(u) for u in node.users)):
        return False
    x, _n, groups, weight, bias, eps = node.args
    with graph.inserting_before(node):
        new = graph.call_function(_GROUP_NORM_NFIRST, (x, groups, weight, bias, eps))
    new.meta.update(node.meta)
    new.meta["wide_op"] = "wide.group_norm_nfirst"
    for user in list(node.users):
        user.replace_all_uses_with(new)
        graph.erase_node(user)
    graph.erase_node(node)
    return True


def _ends_channels_last_run(node: fx.Node) -> bool:
    """Whether ``node`` is a 2-d max pool fed, through norms and activations read by nothing
    else, by a conv whose default strategy is channels-last (step 5 of the module docstring)."""
    if node.target is not aten.max_pool2d.default:
        return False
    x = node.args[0]
    while isinstance(x, fx.Node) and x.target in _KEEPS_LAYOUT and len(x.users) == 1:
        x = x.args[0]
    spec = x.meta.get("wide_tune") if isinstance(x, fx.Node) and x.target is _CONV else None
    return spec is not None and spec.default == "grouped_cl"


def _to_channels_first(graph: fx.Graph, node: fx.Node, packed: frozenset) -> bool:
    """Step 5 of the module docstring after ``node``: whether it was inserted (only where a
    packed op reads the pool: a pool read N-first alone is handed on as a view)."""
    if not _ends_channels_last_run(node) or not any(u.target in packed for u in node.users):
        return False
    new = _channels_first_of(graph, node)
    node.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)
    return True


def _channels_first_of(graph: fx.Graph, x: fx.Node) -> fx.Node:
    """A ``wide.to_channels_first`` of ``x`` right after it, with its metadata."""
    with graph.inserting_after(x):
        new = graph.call_function(TO_CHANNELS_FIRST, (x,))
    new.meta.update({k: v for k, v in x.meta.items() if k in ("val", "stack_trace", "nn_module_stack",
                                                               "wide_source", "wide_member_shape")})
    return new


def plan_layout(graph: fx.Graph, n: int, old_graph: fx.Graph | None = None, *, training: bool = False,
                device: str = "cpu") -> dict[str, int]:
    """Run the plan on a wide graph in place; returns ``{"conversions": k, "packed_ops": m}``.

    ``old_graph`` is the captured member graph (for member shapes of the values pushed through);
    ``training`` (the graph computes gradients) and ``device`` (the device type it runs on):
    whether step 5 of the module docstring applies.
    """
    old = {nd.name: nd for nd in old_graph.nodes} if old_graph is not None else {}
    packed = packed_ops()
    for _ in range(len(graph.nodes) + 1):  # each round removes at least one N-first boundary
        changed = False
        for node in list(graph.nodes):
            if node.op != "call_function" or node.graph is not graph:
                continue
            changed |= (_feed_packed(node, packed) or _push_fold(graph, node, n, old)
                        or _push_constant_pad(graph, node, n, old) or _push_elementwise(graph, node, n, old))
        for node in list(graph.nodes):
            if _is_to_nfirst(node) and not node.users:
                graph.erase_node(node)
        if not changed:
            break
    channels_first = training and device == "cpu"
    for node in list(graph.nodes):
        if node.op == "call_function" and not _run_nfirst(graph, node) and channels_first:
            _to_channels_first(graph, node, packed)
    if training and device == "cuda":
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target is aten.avg_pool2d.default and _pads(node):
                node.replace_input_with(node.args[0], _channels_first_of(graph, node.args[0]))
    return count_conversions(graph)


# Note [A padded average pool on CUDA]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ATen's CUDA avg_pool2d backward for a channels-last input with padding > 0 returns wrong input
# gradients (pytorch/pytorch#188344: its NHWC kernel forgets the padding offset; torch 2.11 has it).
# A member runs its pool on its conv's channels-first output; the wide model runs it on the packed
# value, channels-last after a grouped_cl conv (the CUDA default): the H200 run of the suite saw a
# gradient 1.05 off (test_pool2d[avg]). In a CUDA train graph such a pool reads its input through
# wide.to_channels_first (a no-op for a channels-first value; its gradient goes back in the input's
# layout), so both the pool and its backward run the channels-first kernels, as each member's do.
def _pads(node: fx.Node) -> bool:
    padding = node.args[3] if len(node.args) > 3 else node.kwargs.get("padding", 0)
    return any(p != 0 for p in (padding if isinstance(padding, (list, tuple)) else [padding]))




def count_conversions(graph: fx.Graph) -> dict[str, int]:
    """Mark and count the layout conversions of a planned graph (see the module docstring)."""
    conversions = packed = 0
    packed_targets = packed_ops()
    for node in graph.nodes:
        node.meta.pop("wide_layout_conversion", None)
        if node.op != "call_function":
            continue
        if node.target in packed_targets:
            packed += 1
            if not node.kwargs.get("packed_input"):
                conversions += 1
                node.meta["wide_layout_conversion"] = (
                    f"N-first -> packed into {node.target._schema.name} (a copy; none for a shared "
                    "input of a conv)")
        elif node.target is TO_CHANNELS_FIRST:
            conversions += 1
            node.meta["wide_layout_conversion"] = "channels-last -> channels-first (a copy, its gradient copied back)"
        elif _is_to_nfirst(node):
            readers = [u for u in node.users if u.target not in _SIZE_READERS]
            if readers:
                conversions += 1
                names = ", ".join(u.name for u in readers[:3]) + (", ..." if len(readers) > 3 else "")
                node.meta["wide_layout_conversion"] = f"packed -> N-first for {names}"
    return {"conversions": conversions, "packed_ops": packed}
