"""Eval-graph rewrites: a BatchNorm that uses its running statistics right after a conv becomes
part of the conv's weights, so the wide activation is not read and written a second time; 2-d
max pooling runs channels-last when no gradient is wanted; a LayerNorm of a residual sum reads the
two addends itself (one pass, Note [wide::fused_norm] in csrc/wide/ops/fused_norm.cpp); attention
without mask or dropout may take the small-sequence kernel (Note [wide::attention] in
csrc/wide/ops/attention.cpp).

Note [Folding BatchNorm into the conv]
    In eval mode ``bn(conv(x, W, b)) = conv(x, W * s, (b - mean) * s + beta)`` with
    ``s = gamma / sqrt(var + eps)`` per output channel, for every member separately (all of
    ``W``, ``gamma``, ``mean``, ... are stacked ``[N, ...]``). The folded parameters are computed
    in the graph from the live parameters and buffers, so training, ``load_state_dict`` and
    optimizers see the model as it is; gradients flow to ``W``, ``b``, ``gamma`` and ``beta``
    through the fold. Computing it costs a pass over every conv weight (for a ResNet-18 of 4
    members, 45M floats: 55 ms of a 160 ms call), so :func:`cached_folded_conv_params` keeps the
    result while no gradient is wanted and recomputes it only when an input changed (Note [The
    fold cache]). Only a conv whose output nothing else reads is folded, and only a BatchNorm
    with running statistics in eval mode (``training=False``): in training it normalises by batch
    statistics, which no weight can express. Members alone run conv then BatchNorm; the folded
    form differs by float rounding only (``tests/python/test_pipeline.py``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
import threading
import weakref

import torch
from torch import fx
from torch.utils.weak import WeakIdKeyDictionary

from .rules.conv import conv_candidates, conv_strategies, default_conv_strategy

__all__ = ["attention_kernel", "cached_folded_conv_params", "channels_last_max_pool2d", "clear_fold_cache",
           "fold_batch_norms", "folded_conv_params", "fuse_residual_norms", "pool_before_relu", "relu_in_place",
           "rewrite_channels_last"]

wide = torch.ops.wide
aten = torch.ops.aten


def folded_conv_params(weight: torch.Tensor, bias: torch.Tensor | None, bn_weight: torch.Tensor | None,
                       bn_bias: torch.Tensor | None, mean: torch.Tensor, var: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The conv weight ``[N, C_out, ...]`` and bias ``[N, C_out]`` of conv + eval BatchNorm."""
    scale = torch.rsqrt(var + eps)
    if bn_weight is not None:
        scale = scale * bn_weight
    w = weight * scale.view(*scale.shape, *([1] * (weight.dim() - scale.dim())))
    b = (-mean if bias is None else bias - mean) * scale
    return w, (b if bn_bias is None else b + bn_bias)


# Note [The fold cache]
#     A folded weight is a function of the conv's weight and bias and the BatchNorm's affine
#     parameters and running statistics. It is cached per conv weight tensor (a weak key: the entry
#     dies with the model) and per fold site, under a signature of every input: identity (a weak
#     reference: an id or address alone can be reused by a new tensor), version
#     counter (bumped by every in-place write through autograd's view of the tensor: optimizer
#     steps, ``load_state_dict``, ``copy_``, ``fill_`` under ``no_grad``), storage pointer, dtype,
#     device and shape (``.to()``, ``.data = ...`` and ``share_memory_`` change these), plus eps
#     and whether inference mode is on (an inference tensor may not be saved for backward outside
#     it). The cache is used only when no gradient can flow through the fold (grad mode off, or
#     no input requires grad), outside torch.compile/export tracing and dispatch modes (those
#     trace the computation itself). Writes through ``tensor.data`` bypass version counters, as
#     they bypass autograd; :meth:`WideModel.clear_caches` drops the cache after such writes.
_FOLD_CACHE: WeakIdKeyDictionary = WeakIdKeyDictionary()
_FOLD_LOCK = threading.Lock()
_FOLD_SITES = itertools.count()
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _signature(tensors: tuple, eps: float) -> tuple | None:
    """The cache signature of the fold inputs, or None when the result must not be cached."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return None
    live = [t for t in tensors if t is not None]
    if any(type(t) not in _PLAIN for t in live):
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in live):
        return None
    return (eps, torch.is_inference_mode_enabled(), *(
        None if t is None else (t._version, t.data_ptr(), t.dtype, t.device, tuple(t.shape))
        for t in tensors))


def _same_tensors(refs: tuple, tensors: tuple) -> bool:
    """Whether ``tensors`` are the very objects ``refs`` (weak references, None for None) name:
    an id or an address alone may be reused by a new tensor once the old one is freed."""
    return all((r is None and t is None) or (r is not None and r() is t) for r, t in zip(refs, tensors))


def cached_folded_conv_params(weight: torch.Tensor, bias: torch.Tensor | None, bn_weight: torch.Tensor | None,
                              bn_bias: torch.Tensor | None, mean: torch.Tensor, var: torch.Tensor,
                              eps: float, site: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`folded_conv_params`, computed once and reused while its inputs are unchanged and no
    gradient is wanted (Note [The fold cache]); ``site`` names the fold in its graph."""
    tensors = (weight, bias, bn_weight, bn_bias, mean, var)
    sig = _signature(tensors, eps)
    if sig is None:
        return folded_conv_params(*tensors, eps)
    with _FOLD_LOCK:
        sites = _FOLD_CACHE.get(weight)
        hit = sites.get(site) if sites is not None else None
    if hit is not None and hit[0] == sig and _same_tensors(hit[1], tensors):
        return hit[2]
    result = folded_conv_params(*tensors, eps)
    refs = tuple(None if t is None else weakref.ref(t) for t in tensors)
    with _FOLD_LOCK:
        _FOLD_CACHE.setdefault(weight, {})[site] = (sig, refs, result)
    return result


def clear_fold_cache(weights=None) -> None:
    """Drop the cached folded weights of the conv weight tensors ``weights`` (all when None);
    Note [The fold cache]."""
    with _FOLD_LOCK:
        if weights is None:
            _FOLD_CACHE.clear()
        for w in weights or ():
            _FOLD_CACHE.pop(w, None)


def fold_batch_norms(gm: fx.GraphModule) -> int:
    """Fold every eligible ``wide.batch_norm`` into the ``wide.conv`` before it (see the note);
    returns how many were folded."""
    graph, folded = gm.graph, 0
    for bn in list(graph.nodes):
        if bn.op != "call_function" or bn.target is not wide.batch_norm.default:
            continue
        x, bn_w, bn_b, mean, var, training, _momentum, eps = bn.args[:8]
        conv = x
        if (training is not False or mean is None or var is None or not bn.kwargs.get("packed_input")
                or not isinstance(conv, fx.Node) or conv.target is not wide.conv.default or len(conv.users) != 1):
            continue
        with graph.inserting_before(conv):
            params = graph.call_function(cached_folded_conv_params, (conv.args[1], conv.args[2], bn_w, bn_b, mean,
                                                                     var, eps, next(_FOLD_SITES)))
            params.meta["wide_source"] = bn.meta.get("wide_source", bn.name)
            w = graph.call_function(operator.getitem, (params, 0))
            b = graph.call_function(operator.getitem, (params, 1))
        conv.args = (conv.args[0], w, b, *conv.args[3:])
        conv.meta["wide_folded"] = bn.name
        bn.replace_all_uses_with(conv)
        graph.erase_node(bn)
        folded += 1
    if folded:
        graph.lint()
        gm.recompile()
    return folded


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
    """Eval graphs on CPU: 2-d max pools run channels-last (see the note), and a 2-d conv on
    planes of 16x16 or more defaults to the channels-last grouped strategy (Note [wide::conv
    strategies] in csrc/wide/ops/conv.cpp; the tuner still measures every candidate). Returns how
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
        if spec is None or len(shapes["input"]) != 4 or math.prod(shapes["input"][2:]) < _CL_MIN_PLANE:
            continue
        # an eval graph computes no weight gradient: every layout is exact (conv_strategies)
        shapes = node.meta["wide_shapes"] = {**shapes, "inference": True}
        default = default_conv_strategy(shapes, channels_last=True)
        names = conv_strategies(shapes)
        if default != spec.default or names != spec.names:
            node.meta["wide_tune"] = dataclasses.replace(
                spec, default=default, strategies=names,
                make=lambda n, opts, s=shapes, op=node.target: conv_candidates(op, n, s, opts))
            count += 1
    if count:
        gm.recompile()
    return count


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
    if fused:
        graph.lint()
        gm.recompile()
    return fused


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
    if count:
        gm.recompile()
    return count


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
    if count:
        gm.recompile()
    return count


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
    if count:
        graph.lint()
        gm.recompile()
    return count
