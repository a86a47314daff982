"""Widen rules: convolutions -> torch.ops.wide.conv / wide.conv_transpose (channel-packed).

Every conv becomes ``wide.to_nfirst(wide.conv(x, W, b, ..., packed_input=False), N)``; the layout
plan (fx/layout.py) then chains consecutive packed ops without conversions. ``padding='same'`` /
``'valid'`` (the ``.padding`` overloads) become explicit padding; an even kernel's asymmetric
'same' padding is passed as (left, right) pairs. Non-zero padding modes arrive as an ``aten.pad``
before the conv (spatial rules). Unbatched member inputs ``[C, *]`` get a batch dim of 1.
"""

from __future__ import annotations

import math

import torch
from torch import fx

from ...functional import conv_padding, spatial_list
from ...ops import WIDE_OPS
from ..table import rule
from ..context import TuneSpec, Wide, WidenContext, concrete_shape, member_rank
from ._autocast import LOWER
from ._packed import packed_result

aten = torch.ops.aten
wide = torch.ops.wide
_STRATEGIES = WIDE_OPS["conv"].strategies  # grouped_cl: 2-d only (wide::conv_transpose offers the same)
_PACKED = {"layout": "packed", "strategies": _STRATEGIES}
# Under torch.autocast (Note [wide autocast]): cast as ATen casts aten::conv*d / conv_transpose*d.
AUTOCAST = {"conv": LOWER, "conv_transpose": LOWER}
# A member weight of this many elements or more defaults to the loop (Note [wide::conv strategies]
# in csrc/wide/ops/conv.cpp: oneDNN's grouped kernel falls far behind N ordinary convs there).
_LOOP_WEIGHT_ELEMENTS = 1 << 19
_FEW_CHANNELS = 8  # kFewChannels in conv.cpp
# A pointwise conv of this many multiply-adds per member or more defaults to the loop (Note
# [Pointwise conv default]).
_LOOP_POINTWISE_MACS = 1 << 23

__all__ = ["conv_candidates", "conv_strategies", "default_conv_strategy", "device_conv_defaults", "is_pointwise",
           "pointwise_macs"]


def conv_strategies(shapes: dict) -> tuple[str, ...]:
    """The strategies of one conv: grouped_cl for 2-d convs only; for 2-d convs with fewer than 8
    input channels per group, only the layout whose weight gradient keeps the members' accuracy
    (Note [wide::conv strategies] in csrc/wide/ops/conv.cpp): channels-last for a dense member
    conv (groups 1: an RGB stem), channels-first for a grouped or depthwise one, unless
    ``shapes["inference"]`` (an eval graph: no weight gradient, so every layout is exact)."""
    weight = shapes["weight"]
    if len(weight) != 4:
        return ("grouped", "loop")
    if weight[1] >= _FEW_CHANNELS or shapes.get("transposed"):
        return _STRATEGIES
    if _member_groups(shapes) == 1:
        return ("grouped_cl", "loop")
    return _STRATEGIES if shapes.get("inference") else ("grouped", "loop")


def is_pointwise(shapes: dict) -> bool:
    """A 2-d 1x1 conv with groups 1 (not transposed)."""
    return (len(shapes["weight"]) == 4 and list(shapes["weight"][2:]) == [1, 1] and not shapes.get("transposed")
            and _member_groups(shapes) == 1)


def _member_groups(shapes: dict) -> int:
    """The member conv's groups (the last of the op's (stride, padding, dilation, groups) args)."""
    args = shapes.get("args") or ()
    return args[3] if len(args) > 3 and isinstance(args[3], int) else 1


def pointwise_macs(shapes: dict) -> int:
    """A member's multiply-adds in a pointwise conv (``is_pointwise``): batch x output plane x
    C_in x C_out. A 1x1 kernel's padding is one value per dim (its 'same' padding is 0, never
    the (left, right) pairs of an even kernel).

    >>> pointwise_macs({"input": [4, 256, 16, 16], "weight": [512, 256, 1, 1], "args": [[2, 2], [0, 0], [1, 1], 1]})
    33554432
    """
    batch, _, *plane = shapes["input"]
    stride, padding = shapes["args"][0], shapes["args"][1]
    out = math.prod((h + 2 * p - 1) // s + 1 for h, s, p in zip(plane, stride, padding))
    return batch * out * math.prod(shapes["weight"][:2])


def default_conv_strategy(shapes: dict, *, channels_last: bool = False, pooled: bool = False) -> str:
    """The heuristic strategy when nothing is measured: the loop for large member weights and
    for large pointwise convs (Note [Pointwise conv default]), else grouped, channels-last when
    ``channels_last`` is asked for and the conv is 2-d. A train graph's few-channel stem, which
    may not run channels-first grouped (accuracy), runs channels-last when a max pool follows
    it (``pooled``), else the per-member loop (Note [Stem layout])."""
    if math.prod(shapes["weight"]) >= _LOOP_WEIGHT_ELEMENTS:
        return "loop"
    names = conv_strategies(shapes)
    if channels_last and "grouped_cl" in names:
        return "grouped_cl"
    if is_pointwise(shapes) and pointwise_macs(shapes) >= _LOOP_POINTWISE_MACS:
        return "loop"
    if "grouped" in names:
        return "grouped"
    return "grouped_cl" if pooled and "grouped_cl" in names else "loop"


# Note [Pointwise conv default]
# -----------------------------
# A pointwise conv (1x1, groups 1) is one GEMM per member; oneDNN's grouped kernel runs the N of
# them far slower than N ordinary convs once each is large, forward and backward. Training step
# (forward and backward, input gradient too), AVX2 CPU, ms, grouped / grouped_cl / loop:
#    N=4, B=4 (ResNet-50):  64->256 16x16  20.8 / 13.8 / 13.8    512->128 8x8  12.8 / 12.2 / 10.4
#                           1024->256 4x4  22.7 / 22.1 / 13.9    256->1024 4x4 17.3 / 15.3 /  8.9
#    N=4, B=4:              64->256 32x32  68.7 / 55.2 / 34.6    256->64 32x32 57.6 / 73.1 / 32.5
#    N=16, B=8 (small):     32->64 8x8      6.5 /  4.9 / 12.3    128->256 4x4  18.7 / 14.3 / 16.9
#                           64->128 8x8    15.7 / 12.8 / 14.2    16->32 16x16  13.3 / 10.2 / 14.3
# The loop wins or ties from 8M multiply-adds per member (batch x output plane x C_in x C_out:
# every ResNet-50 pointwise conv at batch 4, 16.8M) and loses at 4M and below (the small nets'
# rows; ResNet-18's stride-2 1x1 shortcuts at batch 8 are 4.2M too), where N calls cost more
# than the grouped kernel's inefficiency. So such a conv defaults to the loop wherever no
# channels-last default applies (a train graph; an eval graph's lone conv): channels-first like
# the convs around it, so no layout conversions. With it ResNet-50's training step, untuned
# (`WideConfig(tune=False)`, N=4, batch 4, 64x64, interleaved medians of one run), went from
# 1.11x to 1.24x the members' loop (`benchmark real --preset full --case "hf_resnet50 N=4"`,
# whose `compile:fast` is the untuned compile: 1.20x). An eval graph's pointwise convs on small
# planes default to the loop whatever their size (Note [Pointwise convs in eval graphs] in
# fx/eval_rewrites.py). The tuner still measures all three.

# Note [Stem layout]
# ------------------
# A 2-d conv with fewer than 8 input channels (an RGB stem) cannot run channels-first grouped in
# a train graph (its weight gradient loses accuracy, Note [wide::conv strategies]); it runs
# channels-last grouped or the per-member loop (channels-first, the members' own kernel). Which
# one is faster depends on what follows, not on the conv (measured, ResNet-style nets, N=16,
# B=8, 32x32, training step):
#  * a max pool after its norm and activation (ResNet, ResNet-18): channels-last, whose max pool
#    runs far faster than channels-first and hands on a 4x smaller tensor, converted once for
#    the channels-first convs after it (the net with its max pool: 22.0 ms with a channels-last
#    stem, 25.8 ms with the loop);
#  * no pool: the channels-last activation (16 channels at 32x32) meets channels-first ones in
#    the first residual add and its backward, and a pointwise op with one input of each layout
#    runs 10-15x slower than with one layout (threshold_backward of 2M floats 4.5 ms against
#    0.3 ms), besides a conversion per consumer: the loop runs the whole graph channels-first
#    (the net without its pool: 53-54 ms against 56-64 ms).
# So the default follows the conv's output through the ops that keep its layout (norms,
# activations) and is channels-last only if they end in a max pool, whose result the layout plan
# converts to channels-first once for all its readers, its gradient back to channels-last (step 5
# of fx/layout.py; measured, training step at N=16, B=8: ResNet-18 at 64x64 676 against 699 ms,
# the ResNet-style net 19.9 against 24.5 ms). The tuner still measures both on the conv alone,
# and the model-level check the whole graph.
LAYOUT_KEEPING_ACTIVATIONS = frozenset({
    aten.relu.default, aten.relu_.default, aten.silu.default, aten.silu_.default, aten.hardtanh.default,
    aten.hardtanh_.default, aten.gelu.default, aten.leaky_relu.default, aten.leaky_relu_.default})

# Note [Layout-keeping ops]
# -------------------------
# Every channel-packed row (the table's layout="packed") states whether a channels-last value is
# followed through it: True where its wide op returns a channels-last result for a channels-last
# packed input, so the stem default above and step 5 of fx/layout.py (whose _KEEPS_LAYOUT holds
# these rows' wide ops) walk through it. A conv sets its result's layout by its own strategy (False:
# a chain ends there); PReLU keeps the layout too but is not followed (no measurement has asked for
# it). tests/python/test_rule_coverage.py fails for a packed row not named here, and checks each
# True against the wide op and fx/layout.py's set.
KEEPS_CHANNELS_LAST = {
    aten.batch_norm.default: True, aten.instance_norm.default: True, aten.group_norm.default: True,
    aten.prelu.default: False,
    **dict.fromkeys((aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, aten.conv1d.padding,
                     aten.conv2d.padding, aten.conv3d.padding, aten.conv_transpose1d.default,
                     aten.conv_transpose2d.input, aten.conv_transpose3d.input, aten.convolution.default), False)}
_LAYOUT_KEEPING = {*(op for op, keeps in KEEPS_CHANNELS_LAST.items() if keeps), *LAYOUT_KEEPING_ACTIVATIONS}
_MAX_POOLS = {aten.max_pool2d.default, aten.max_pool2d_with_indices.default}


def _feeds_max_pool(node: fx.Node) -> bool:
    """Whether ``node``'s only consumer chain through norms and activations ends in a 2-d max
    pool (Note [Stem layout])."""
    while len(node.users) == 1:
        (node,) = node.users
        if node.target in _MAX_POOLS:
            return True
        if node.target not in _LAYOUT_KEEPING:
            return False
    return False


def device_conv_defaults(names: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """The conv defaults of other devices: on CUDA, cuDNN's grouped conv, channels-last where
    offered, whatever the weight's size. The CPU heuristic's per-member loop for large weights
    lost there: ResNet-18 at N=16 on an H100 ran 8.6 ms with the CPU defaults and 4.4 ms tuned,
    where the tuner picked grouped_cl for 16 of the 20 convs and grouped for the other 4.

    >>> device_conv_defaults(("grouped", "grouped_cl", "loop")), device_conv_defaults(("grouped", "loop"))
    ((('cuda', 'grouped_cl'),), (('cuda', 'grouped'),))
    """
    return (("cuda", "grouped_cl" if "grouped_cl" in names else "grouped" if "grouped" in names else names[0]),)


def conv_candidates(op, n: int, shapes: dict, opts: dict) -> dict:
    """Zero-argument callables running each strategy on random tensors of the sample shapes.
    A packed input (the layout plan chained this conv to a packed op) is given to each strategy
    in the memory layout it runs in, as the op before it would leave it in a run of convs of that
    strategy; an N-first input is packed by every strategy alike."""
    x = torch.randn(n, *shapes["input"], **opts)
    packed = bool(shapes.get("packed_input"))
    inputs = {s: x for s in conv_strategies(shapes)}
    if packed:
        x = wide.to_packed(x).contiguous()
        inputs = {s: x.contiguous(memory_format=torch.channels_last) if s == "grouped_cl" else x for s in inputs}
    w = torch.randn(n, *shapes["weight"], **opts)
    b = torch.randn(n, shapes["bias_features"], **opts) if shapes["bias_features"] else None
    args = shapes["args"]
    return {s: (lambda s=s, x=x: op(x, w, b, *args, packed_input=packed, strategy=s)) for s, x in inputs.items()}


def _conv(ctx: WidenContext, node: fx.Node, transposed: bool) -> Wide:
    a = ctx.schema_args(node)
    x_old, w_old = node.args[0], node.args[1]
    d = member_rank(w_old) - 2
    rank = member_rank(x_old)
    if rank not in (d + 1, d + 2):
        raise ctx.fail(node, f"expected a member input of {d + 1} or {d + 2} dims for a {d}-d conv, got {rank}")
    if not isinstance(a["weight"], Wide):
        raise ctx.fail(node, "a convolution whose weight is not a per-member parameter")
    if ctx.is_wide([a[k] for k in a if k not in ("input", "weight", "bias")]):
        raise ctx.fail(node, "a per-member stride/padding/dilation/groups")
    x = ctx.as_wide(a["input"], rank, node)
    unbatched = rank == d + 1
    xn = ctx.emit(aten.unsqueeze.default, (x.node, 1), like=node) if unbatched else x.node
    bias = ctx.as_wide(a["bias"], 1, node).node if a["bias"] is not None else None
    stride, dilation = spatial_list(a["stride"], d), spatial_list(a["dilation"], d)
    kernel = concrete_shape(w_old)[2:]
    if transposed:
        padding = spatial_list(a["padding"], d)
        args = (stride, padding, spatial_list(a["output_padding"], d), a["groups"], dilation)
        op = wide.conv_transpose.default
    else:
        try:
            padding = conv_padding(a["padding"], kernel, dilation, stride)
        except ValueError as e:
            raise ctx.fail(node, str(e)) from None
        args = (stride, padding, dilation, a["groups"])
        op = wide.conv.default
    in_shape = concrete_shape(x_old)
    shapes = {
        "input": [1, *in_shape] if unbatched else in_shape, "weight": concrete_shape(w_old),
        "bias_features": concrete_shape(node.args[2])[0] if a["bias"] is not None else 0,
        "args": [list(v) if isinstance(v, (list, tuple)) else v for v in args], "packed_input": False,
        "transposed": transposed}
    names = conv_strategies(shapes)
    tune = TuneSpec(default=default_conv_strategy(shapes, pooled=_feeds_max_pool(node)), strategies=names,
                    make=lambda n, opts, s=shapes, op=op: conv_candidates(op, n, s, opts),
                    device_defaults=device_conv_defaults(names))
    packed = ctx.emit_wide(op, (xn, a["weight"].node, bias, *args), {"packed_input": False, "strategy": "auto"},
                           like=node, shapes=shapes, tune=tune)
    return packed_result(ctx, node, packed, unbatched)


@rule(aten.conv1d.default, aten.conv2d.default, aten.conv3d.default,
      aten.conv1d.padding, aten.conv2d.padding, aten.conv3d.padding, packed=wide.conv.default, **_PACKED)
def _conv_rule(ctx: WidenContext, node: fx.Node) -> Wide:
    return _conv(ctx, node, transposed=False)


@rule(aten.conv_transpose1d.default, aten.conv_transpose2d.input, aten.conv_transpose3d.input,
      packed=wide.conv_transpose.default, **_PACKED)
def _conv_transpose_rule(ctx: WidenContext, node: fx.Node) -> Wide:
    return _conv(ctx, node, transposed=True)


@rule(aten.convolution.default, packed=(wide.conv.default, wide.conv_transpose.default), **_PACKED)
def _convolution_rule(ctx: WidenContext, node: fx.Node) -> Wide:
    transposed = node.args[6] if len(node.args) > 6 else node.kwargs["transposed"]
    if not transposed and any(int(p) for p in (node.args[7] if len(node.args) > 7 else [])):
        raise ctx.fail(node, "output_padding on a non-transposed convolution")
    return _conv(ctx, node, transposed=bool(transposed))
