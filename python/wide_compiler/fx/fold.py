"""The eval-graph fold: a BatchNorm that uses its running statistics right after a conv (or a
Linear) becomes part of its weights, so the wide activation is not read and written a second
time (for a Linear, not packed and unpacked either). The
other eval rewrites (layouts, operator order, fused kernels) are in fx/eval_rewrites.py.

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
    form differs by float rounding only (``tests/python/test_pipeline.py``). A BatchNorm1d over
    a Linear's ``[B, C]`` output is the same fold with ``W`` of shape ``[N, C_out, C_in]``; it
    also saves the N-first ⇄ packed copies a BatchNorm between N-first ops pays (an MLP's
    ``Linear -> BatchNorm1d -> ReLU``).
"""

from __future__ import annotations

import itertools
import operator
import threading
import weakref

import torch
from torch import fx
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["cached_folded_conv_params", "clear_fold_cache", "finish_rewrite", "fold_batch_norms", "folded_conv_params"]

wide = torch.ops.wide
aten = torch.ops.aten
TO_NFIRST = torch.ops.wide.to_nfirst.default


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
#     steps, ``load_state_dict``, ``copy_``, ``fill_`` under ``no_grad``, and a train-mode
#     ``wide::batch_norm`` updating the running statistics), storage pointer, dtype,
#     device and shape (``.to()``, ``.data = ...`` and ``share_memory_`` change these), plus eps
#     and whether inference mode is on (an inference tensor may not be saved for backward outside
#     it). The cache is used only when no gradient can flow through the fold (grad mode off, or
#     no input requires grad), outside torch.compile/export tracing and dispatch modes (those
#     trace the computation itself). Writes through ``tensor.data`` (a parameter's or a buffer's)
#     bypass version counters, as they bypass autograd; :meth:`WideModel.clear_caches` drops the
#     cache after such writes.
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


def finish_rewrite(gm: fx.GraphModule, changed: int, *, erased: bool = False) -> int:
    """The end of an eval-graph rewrite pass (this fold and fx/eval_rewrites.py): where the pass
    changed ``changed`` nodes, lint the graph (when it erased nodes) and recompile ``gm``.
    Returns ``changed``."""
    if changed:
        if erased:
            gm.graph.lint()
        gm.recompile()
    return changed


def _foldable_producer(bn: fx.Node, into) -> fx.Node | None:
    """The ``into`` node (``wide.conv`` after the layout plan, fed packed; ``wide.linear`` before
    it, a BatchNorm1d over a 2-d member ``[B, C]`` read through ``to_nfirst`` views only) that
    only ``bn``, an eval BatchNorm with running statistics, reads; None when there is none."""
    x, _w, _b, mean, var, training = bn.args[:6]
    if (training is not False or mean is None or var is None or not isinstance(x, fx.Node)
            or x.target is not into or len(x.users) != 1):
        return None
    if into is wide.conv.default:
        return x if bn.kwargs.get("packed_input") else None
    member = (bn.meta.get("wide_shapes") or {}).get("input")
    if (not bn.kwargs.get("packed_input") and member is not None and len(member) == 2 and bn.users
            and all(u.target is TO_NFIRST for u in bn.users)):
        return x
    return None


def fold_batch_norms(gm: fx.GraphModule, into=wide.conv.default) -> int:
    """Fold every eligible ``wide.batch_norm`` into the ``into`` op before it (see the note):
    ``wide.conv`` after the layout plan, ``wide.linear`` before it (so that the plan never
    packs the BatchNorm1d's activation); returns how many were folded."""
    graph, folded = gm.graph, 0
    for bn in list(graph.nodes):
        if bn.op != "call_function" or bn.target is not wide.batch_norm.default:
            continue
        producer = _foldable_producer(bn, into)
        if producer is None:
            continue
        _x, bn_w, bn_b, mean, var, _training, _momentum, eps = bn.args[:8]
        with graph.inserting_before(producer):
            params = graph.call_function(cached_folded_conv_params, (producer.args[1], producer.args[2], bn_w, bn_b,
                                                                     mean, var, eps, next(_FOLD_SITES)))
            params.meta["wide_source"] = bn.meta.get("wide_source", bn.name)
            w = graph.call_function(operator.getitem, (params, 0))
            b = graph.call_function(operator.getitem, (params, 1))
        producer.args = (producer.args[0], w, b, *producer.args[3:])
        producer.meta["wide_folded"] = bn.name
        if producer.target is wide.linear.default:  # N-first: the to_nfirst readers of the packed BN read it
            for view in list(bn.users):
                view.replace_all_uses_with(producer)
                graph.erase_node(view)
        bn.replace_all_uses_with(producer)
        graph.erase_node(bn)
        folded += 1
    return finish_rewrite(gm, folded, erased=True)
