"""Eval-graph rewrites other than the BatchNorm fold (fx/fold.py): each is one pipeline pass
(fx/pipeline.py), run on eval graphs only, and keeps every member's values (up to float rounding
where an operator order changes):

- :func:`rewrite_channels_last`: 2-d max pools and large-plane convs run channels-last;
- :func:`pool_before_relu`: ``max_pool(relu(x))`` becomes ``relu(max_pool(x))``;
- :func:`fuse_residual_norms`: a LayerNorm of a residual sum reads the two addends itself (one
  pass, Note [wide::fused_norm] in csrc/wide/ops/fused_norm.cpp);
- :func:`relu_in_place`: a ReLU on a wide Linear's fresh output runs in place;
- :func:`attention_kernel`: attention without mask or dropout may take the small-sequence kernel
  (Note [wide::attention] in csrc/wide/ops/attention.cpp).

Each returns how many nodes it changed.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import fx

from .fold import finish_rewrite
from .rules.conv import conv_candidates, conv_strategies, default_conv_strategy, device_conv_defaults, is_pointwise

__all__ = ["attention_kernel", "channels_last_max_pool2d", "fuse_residual_norms", "pool_before_relu",
           "relu_in_place", "rewrite_channels_last"]

wide = torch.ops.wide
aten = torch.ops.aten


# Note [Channels-last max pooling]
#     ATen's CPU max_pool2d is vectorised over channels for channels-last input and over a plane
#     for contiguous input; a wide activation has N times a member's channels, so on this
#     machine the channels-last kernel is 2-9x faster in inference for 8 or more channels
#     ([8, 256, 32, 32], 3x3 stride 2: 7.3 ms contiguous, 0.34 ms channels-last, 2.6 ms with the
#     conversion). Its backward is not faster (0.5-1.7x), so a contiguous input is converted only
#     when no gradient is wanted, decided per call. To spare the conversion, an eval graph's
#     convs on large planes default to the channels-last grouped strategy (the stem conv packs
#     its N-first input straight into that layout); oneDNN's convs keep the layout of their
#     input, so the activations stay channels-last to the pool. The values are the same; the
#     model's outputs are made contiguous.
#
# Note [Pointwise convs in eval graphs]
#     On planes under 16x16 the convs keep their channels-first defaults, except pointwise ones
#     (1x1, groups 1), which default to the per-member loop: channels-first grouped was the
#     slowest candidate at every 1x1 shape of ResNet-50 (N=4, batch 4, 64x64 input, inference,
#     AVX2 CPU, alone): 128->512 at 8x8 grouped 4.1 ms, loop 3.1, channels-last grouped 1.9;
#     1024->256 at 4x4 8.2, 3.9, 5.6; 512->1024 at 4x4 16.9, 7.4, 11.9. The loop, not the faster
#     channels-last kernel at 8x8: it keeps the activations channels-first for the 3x3 convs
#     around it and its weight gradients are the members' own (an eval graph runs with grad
#     enabled too; oneDNN's channels-last weight gradients are several times less accurate, Note
#     [wide::conv strategies]). The tuner still measures all three. With these defaults and no
#     tuning, ResNet-50 went from 0.97x to 1.15x the members' loop (`WideConfig(tune=False)`).
_MIN_CHANNELS = 8
_CL_MIN_PLANE = 16 * 16


def channels_last_max_pool2d(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """``aten.max_pool2d`` on a channels-last copy of a batched ``x`` with 8+ channels when no
    gradient is wanted; as it is otherwise (see the note)."""
    if (x.dim() == 4 and x.device.type == "cpu" and x.shape[1] >= _MIN_CHANNELS
            and not (torch.is_grad_enabled() and x.requires_grad)):
        x = x.contiguous(memory_format=torch.channels_last)
    return aten.max_pool2d.default(x, *args, **kwargs)


def rewrite_channels_last(gm: fx.GraphModule) -> int:
    """Eval graphs on CPU: 2-d max pools run channels-last (see the note), a 2-d conv on planes
    of 16x16 or more defaults to the channels-last grouped strategy and a pointwise conv on
    smaller planes to the per-member loop (Note [Pointwise convs in eval graphs]; Note
    [wide::conv strategies] in csrc/wide/ops/conv.cpp; the tuner still measures every candidate). Returns how
    many nodes changed. A graph with a single conv keeps it channels-first: nothing downstream
    gains from the layout, and turning a channels-last result back into the N-first output is a
    transposing copy (measured: a lone 16-member 3x3 conv, 32x32, took 12 ms channels-last
    against 6-7 ms)."""
    convs = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is wide.conv.default]
    count = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is aten.max_pool2d.default:
            node.target = channels_last_max_pool2d
            count += 1
    for node in convs if len(convs) > 1 else ():
        spec, shapes = node.meta.get("wide_tune"), node.meta.get("wide_shapes")
        if spec is None or len(shapes["input"]) != 4:
            continue
        small = math.prod(shapes["input"][2:]) < _CL_MIN_PLANE
        if small and not is_pointwise(shapes):
            continue
        # an eval graph is for inference: every layout is offered (conv_strategies), though a
        # call with grad enabled gets that layout's weight gradients (see the note above)
        shapes = node.meta["wide_shapes"] = {**shapes, "inference": True}
        default = "loop" if small else default_conv_strategy(shapes, channels_last=True)
        names = conv_strategies(shapes)
        if default != spec.default or names != spec.names:
            node.meta["wide_tune"] = dataclasses.replace(
                spec, default=default, strategies=names, device_defaults=device_conv_defaults(names),
                make=lambda n, opts, s=shapes, op=node.target: conv_candidates(op, n, s, opts))
            count += 1
    return finish_rewrite(gm, count)


def fuse_residual_norms(gm: fx.GraphModule) -> int:
    """``wide.layer_norm(a + b)`` where the norm is the sum's only reader becomes
    ``wide.add_layer_norm(a, b)`` (a post-norm residual block): with no gradient wanted it is one
    pass over memory instead of three; otherwise it computes the same composite. Returns how many."""
    graph, fused = gm.graph, 0
    for ln in list(graph.nodes):
        if ln.op != "call_function" or ln.target is not wide.layer_norm.default:
            continue
        add = ln.args[0]
        if (not isinstance(add, fx.Node) or add.target is not aten.add.Tensor or len(add.users) != 1
                or add.kwargs or len(add.args) != 2 or not all(isinstance(a, fx.Node) for a in add.args)):
            continue
        _, shape, weight, bias, eps = ln.args  # as the layer_norm rule emits it (rules/norm.py)
        with graph.inserting_before(ln):
            node = graph.call_function(wide.add_layer_norm.default, (*add.args, shape, weight, bias, eps))
        # Where it came from, for reports and errors; not the norm's strategy-tuning entries
        # (add_layer_norm has no strategies).
        node.meta.update({k: v for k, v in ln.meta.items() if k not in ("wide_tune", "wide_shapes")})
        ln.replace_all_uses_with(node)
        graph.erase_node(ln)
        graph.erase_node(add)
        fused += 1
    return finish_rewrite(gm, fused, erased=True)


def relu_in_place(gm: fx.GraphModule) -> int:
    """``relu(wide.linear(...))`` where the ReLU is the linear's only reader runs in place on the
    linear's fresh output: no second wide activation to allocate and fault in (ReLU's backward
    reads its output, so autograd is unaffected). Returns how many."""
    count = 0
    for node in gm.graph.nodes:
        src = node.args[0] if node.op == "call_function" and node.args else None
        if (node.target is aten.relu.default and isinstance(src, fx.Node)
                and src.target is wide.linear.default and len(src.users) == 1):
            node.target = aten.relu_.default
            count += 1
    return finish_rewrite(gm, count)


def attention_kernel(gm: fx.GraphModule) -> int:
    """``aten.scaled_dot_product_attention`` without a mask or dropout becomes ``wide.attention``
    (the same schema and arguments): with no gradient wanted it runs the small-sequence CPU kernel
    where that is faster, and SDPA itself otherwise. Returns how many."""
    count = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not aten.scaled_dot_product_attention.default:
            continue
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        dropout_p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
        if mask is None and dropout_p == 0:
            node.target = wide.attention.default
            count += 1
    return finish_rewrite(gm, count)


_MAX_POOLS = (aten.max_pool1d.default, aten.max_pool2d.default, aten.max_pool3d.default, channels_last_max_pool2d)


def pool_before_relu(gm: fx.GraphModule) -> int:
    """``max_pool(relu(x))`` where the pool is the ReLU's only reader becomes
    ``relu(max_pool(x))``: the same values (ReLU is monotone; NaN propagates through both), the
    ReLU on the pooled, smaller activation. Returns how many.

    Note [Max pool before ReLU]: besides the smaller ReLU in eager, inductor generates a very slow
    CPU loop for a max pool fed by a ReLU it fuses in: ``max_pool1d(relu(x))`` on [8, 512, 512],
    k=2, compiled took 4.1 ms against 0.29 ms for ``relu(max_pool1d(x))`` (eager: 0.28 ms), and
    the compiled audio model ran 2.3x slower than eager because of it. (The gradients agree too,
    ties included, but only eval graphs are rewritten.)"""
    graph, count = gm.graph, 0
    for pool in list(graph.nodes):
        if pool.op != "call_function" or pool.target not in _MAX_POOLS or not pool.args:
            continue
        relu = pool.args[0]
        if (not isinstance(relu, fx.Node) or relu.target is not aten.relu.default or len(relu.users) != 1
                or len(relu.args) != 1 or relu.kwargs):
            continue
        pool.args = (relu.args[0], *pool.args[1:])
        with graph.inserting_after(pool):
            after = graph.call_function(aten.relu.default, (pool,))
        after.meta.update(relu.meta)
        pool.replace_all_uses_with(after, delete_user_cb=lambda user: user is not after)
        graph.erase_node(relu)
        count += 1
    return finish_rewrite(gm, count, erased=True)
