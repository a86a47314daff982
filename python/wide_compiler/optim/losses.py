"""Per-member losses: turn a criterion into N losses whose sum trains every member exactly as
it would be trained alone."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..layouts import PADDED_OUTPUT, member_part, unmarked_padded_source

__all__ = ["member_losses"]

log = logging.getLogger(__name__)

# Element-wise criteria: reduction="none" on [N, ...] then a per-member mean/sum is exact.
_ELEMENTWISE: dict[Callable, tuple[str, ...]] = {
    F.mse_loss: (),
    F.l1_loss: (),
    F.smooth_l1_loss: ("beta",),
    F.huber_loss: ("delta",),
    F.binary_cross_entropy: ("weight",),
    F.binary_cross_entropy_with_logits: ("weight", "pos_weight"),
}
_CLASSIFICATION = (F.cross_entropy, F.nll_loss)

# nn.Module criteria -> (functional, attributes passed as keyword arguments)
_MODULES: dict[type, tuple[Callable, tuple[str, ...]]] = {
    nn.MSELoss: (F.mse_loss, ()),
    nn.L1Loss: (F.l1_loss, ()),
    nn.SmoothL1Loss: (F.smooth_l1_loss, ("beta",)),
    nn.HuberLoss: (F.huber_loss, ("delta",)),
    nn.BCELoss: (F.binary_cross_entropy, ("weight",)),
    nn.BCEWithLogitsLoss: (F.binary_cross_entropy_with_logits, ("weight", "pos_weight")),
    nn.CrossEntropyLoss: (F.cross_entropy, ("weight", "ignore_index", "label_smoothing")),
    nn.NLLLoss: (F.nll_loss, ("weight", "ignore_index")),
}


def _check_not_padded(input: torch.Tensor) -> None:
    """Note [A padded output after an op] (layouts.py): refuse a loss input computed by an op from a
    padded model's output that still has its shape; warn where that cannot be told."""
    source, made_from = unmarked_padded_source(input)
    if source is None:
        return
    how = ("Pass the output itself (put the op inside the criterion: member_losses(lambda o, t: "
           "F.cross_entropy(o * 2, t), out, y)), or take each member's own part first with "
           "wide.member_outputs(out)")
    if made_from:
        raise ValueError(
            "wide_compiler.optim.member_losses: the input was computed by an op from the output of a padded "
            f"model (pad=True) and has its shape {list(input.shape)}; an op drops the mark that says where each "
            "member's own values end, so each narrower member's loss would count the padding (padded classes, "
            f"features) as its own. {how}")
    warnings.warn(
        "wide_compiler.optim.member_losses: the input has the shape of a padded model's output "
        f"{list(input.shape)} but not its mark (made from it by an op under torch.no_grad or after detach()?): "
        "if so, each narrower member's loss counts the padding as its own. " + how, UserWarning, stacklevel=3)


def member_losses(criterion: Callable[..., torch.Tensor], input: torch.Tensor,
                  target: torch.Tensor, *, shared_target: bool | None = None,
                  **kwargs: Any) -> torch.Tensor:
    """Per-member losses ``[N]``: entry ``i`` is ``criterion(input[i], target[i], **kwargs)``.

    ``losses.sum().backward()`` therefore gives every member exactly the gradient it would get
    trained alone (the mean over ITS OWN batch), unlike ``criterion(input, target)`` on the wide
    tensors, whose mean over all N batches scales every gradient by 1/N (and, for cross-entropy
    on [N, B, C], even treats dim 1 as the class dim).

    Args:
        criterion: a loss function (``F.cross_entropy``, ``F.mse_loss``, ...) or a loss module
            (``nn.CrossEntropyLoss(label_smoothing=0.1)``, ...) with reduction ``"mean"`` or
            ``"sum"``. Cross-entropy, NLL, MSE, L1, smooth-L1, Huber, BCE and BCE-with-logits take
            a fast path (one call on all members); any other criterion is vmapped over members.
        input: the wide output ``[N, ...]``.
        target: per-member targets ``[N, ...]``, or ONE target shared by all members (the
            member's target shape; pass ``shared_target=True``, or ``t.expand(N, *t.shape)``).
        shared_target: force shared (True) or per-member (False) targets; default: shared when
            ``target`` has stride 0 on dim 0 (an expanded tensor).
        **kwargs: keyword arguments for a functional criterion (``label_smoothing=0.1``, ...).

    Example:
        >>> import torch, torch.nn.functional as F, wide_compiler as wc
        >>> logits = torch.randn(4, 8, 10, requires_grad=True)   # 4 members, batch 8, 10 classes
        >>> labels = torch.randint(0, 10, (4, 8))
        >>> losses = wc.optim.member_losses(F.cross_entropy, logits, labels)
        >>> torch.allclose(losses[2], F.cross_entropy(logits[2], labels[2]))
        True
        >>> shared = torch.randint(0, 10, (8,))                  # one target for all members
        >>> wc.optim.member_losses(torch.nn.CrossEntropyLoss(), logits, shared, shared_target=True).shape
        torch.Size([4])
    """
    if not isinstance(input, torch.Tensor) or input.dim() == 0:
        raise ValueError("wide_compiler.optim.member_losses: expected a wide input [N, ...], got "
                         f"{type(input).__name__} of shape {getattr(input, 'shape', None)}")
    n = input.shape[0]
    if shared_target is None:
        shared_target = (n > 1 and target.dim() >= 1 and target.shape[0] == n
                         and target.stride(0) == 0)
        if shared_target:
            target = target[0]
    if shared_target:
        wide_target = target.expand(n, *target.shape)
    else:
        if target.dim() == 0 or target.shape[0] != n:
            raise ValueError(
                f"wide_compiler.optim.member_losses: target has shape {list(target.shape)}; "
                f"expected per-member targets [N={n}, ...], or pass shared_target=True for one "
                f"target shared by all members")
        wide_target = target
    layouts = getattr(input, PADDED_OUTPUT, None)
    if layouts is not None:
        return _padded_losses(criterion, input, wide_target, layouts, kwargs)
    _check_not_padded(input)

    fn, kw, reduction = _resolve(criterion, kwargs)
    if reduction == "none" or (fn is not None and reduction not in ("mean", "sum")):
        raise ValueError(f"wide_compiler.optim.member_losses: the criterion's reduction must be "
                         f"'mean' or 'sum' (one loss per member), got {reduction!r}")
    if fn in _ELEMENTWISE:
        # weight / pos_weight are shaped for ONE member's tensors and broadcast from the right,
        # which stays correct on [N, ...].
        per = fn(input, wide_target, reduction="none", **kw)
        per = per.reshape(n, -1)
        return per.mean(1) if reduction == "mean" else per.sum(1)
    if fn in _CLASSIFICATION and input.dim() >= 3:
        fast = _classification(fn, input, wide_target, kw, reduction, n)
        if fast is not None:
            return fast
    return _vmapped(criterion if fn is None else fn, kw if fn is not None else kwargs,
                    reduction if fn is not None else None, input, target, shared_target)


def _padded_losses(criterion, input, target, layouts, kwargs):
    """Per-member losses of a padded model's output whose members' sizes differ (a class or
    vocabulary sweep): each member's loss on its own part (``member_part``), and its target
    ``target[i]`` (N-first; cut the same way where it has the output's padded shape), one call per
    member. The zero padding entered the softmax as extra classes before (probe 13 of issue 44,
    P13-6)."""
    losses = []
    for i in range(input.shape[0]):
        t = target[i]
        if t.shape == input.shape[1:]:
            t = member_part(t, layouts, i)
        loss = criterion(member_part(input[i], layouts, i), t, **kwargs)
        if loss.dim() != 0:
            raise ValueError("wide_compiler.optim.member_losses: the criterion's reduction must be 'mean' or "
                             f"'sum' (one loss per member), got a loss of shape {list(loss.shape)}")
        losses.append(loss)
    return torch.stack(losses)


def _resolve(criterion, kwargs):
    """(functional or None, kwargs, reduction) for a criterion."""
    if isinstance(criterion, nn.Module):
        entry = _MODULES.get(type(criterion))
        reduction = getattr(criterion, "reduction", "mean")
        if entry is None:
            return None, {}, reduction
        fn, attrs = entry
        kw = {a: getattr(criterion, a) for a in attrs if getattr(criterion, a, None) is not None}
        return fn, kw, reduction
    kw = dict(kwargs)
    reduction = kw.pop("reduction", "mean")
    for legacy in ("size_average", "reduce"):
        if legacy in kw:
            raise ValueError(f"wide_compiler.optim.member_losses: {legacy!r} is deprecated; pass "
                             f"reduction='mean' or 'sum'")
    if criterion in _ELEMENTWISE or criterion in _CLASSIFICATION:
        return criterion, kw, reduction
    return None, kw, reduction


def _classification(fn, input, target, kw, reduction, n):
    weight = kw.get("weight")
    smoothing = kw.get("label_smoothing", 0.0)
    if weight is not None and smoothing:
        return None  # torch's weighted + smoothed mean has its own normaliser: vmap it
    flat_in = input.reshape(-1, *input.shape[2:])
    if target.is_floating_point():  # class probabilities [N, B, C, ...]
        if fn is not F.cross_entropy:
            return None
        per = fn(flat_in, target.reshape(-1, *target.shape[2:]), reduction="none", **kw)
        per = per.reshape(n, -1)
        return per.mean(1) if reduction == "mean" else per.sum(1)
    if target.dim() != input.dim() - 1:
        return None
    flat_t = target.reshape(-1, *target.shape[2:])
    per = fn(flat_in, flat_t, reduction="none", **kw).reshape(n, -1)
    if reduction == "sum":
        return per.sum(1)
    ignore = kw.get("ignore_index", -100)
    valid = (target != ignore).reshape(n, -1)
    if weight is None:
        denom = valid.sum(1).to(per.dtype)
    else:
        w = weight.to(per.dtype)[target.clamp(min=0, max=weight.numel() - 1).reshape(n, -1)]
        denom = (w * valid).sum(1)
    return per.sum(1) / denom


def _vmapped(fn, kw, reduction, input, target, shared):
    if reduction is not None:
        kw = {**kw, "reduction": reduction}

    def one(x, t):
        return fn(x, t, **kw)
    try:
        return torch.vmap(one, in_dims=(0, None if shared else 0))(input, target)
    except Exception as exc:  # noqa: BLE001 (a criterion vmap cannot batch: loop instead)
        log.debug("member_losses: vmap of %s failed (%s); looping over members", fn, exc)
        return torch.stack([one(input[i], target if shared else target[i])
                            for i in range(input.shape[0])])
