"""Per-member gradient clipping: one norm per member, not one over all N members."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ._base import HParam, first_member, per_member

__all__ = ["clip_grad_norm_", "clip_grad_value_", "member_grad_norms"]


def _grads(parameters: torch.Tensor | Iterable[torch.Tensor], n: int | None, fn: str):
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    if n is None:
        if not grads:
            return [], 0
        n = int(grads[0].shape[0]) if grads[0].dim() else 0
    for k, g in enumerate(grads):
        if g.dim() == 0 or g.shape[0] != n:
            raise ValueError(f"wide_compiler.optim.{fn}: gradient {k} has shape {list(g.shape)}; "
                             f"expected [N, ...] with N={n} members on dim 0")
    return grads, n


def member_grad_norms(parameters: torch.Tensor | Iterable[torch.Tensor], norm_type: float = 2.0,
                      *, n: int | None = None) -> torch.Tensor:
    """The total gradient norm of each member over all ``parameters``: a tensor ``[N]`` whose
    entry ``i`` is what ``torch.nn.utils.get_total_norm`` gives for member ``i``'s gradients.

    Example:
        >>> import torch, wide_compiler as wc
        >>> w = torch.nn.Parameter(torch.zeros(2, 3)); w.grad = torch.tensor([[3., 4., 0.], [1., 0., 0.]])
        >>> wc.optim.member_grad_norms([w])
        tensor([5., 1.])
    """
    grads, n = _grads(parameters, n, "member_grad_norms")
    return _total_norm(grads, n, norm_type)


def _total_norm(grads: list[torch.Tensor], n: int, norm_type: float) -> torch.Tensor:
    if not grads:
        return torch.zeros(n)
    norm_type = float(norm_type)
    device = grads[0].device
    norms = [torch.linalg.vector_norm(g.reshape(n, -1), norm_type, dim=1).to(device) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms, dim=1), norm_type, dim=1)


def clip_grad_norm_(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: HParam,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False, *,
                    n: int | None = None) -> torch.Tensor:
    """Clip each member's gradients to its own total norm: member ``i``'s gradients are scaled
    by ``min(1, max_norm[i] / (norm_i + 1e-6))`` where ``norm_i`` is the norm over member ``i``'s
    slices of all gradients, exactly as ``torch.nn.utils.clip_grad_norm_`` on that member alone.
    ``max_norm`` is a float or N values. Returns the per-member norms ``[N]`` (before clipping).

    Example:
        >>> import torch, wide_compiler as wc
        >>> w = torch.nn.Parameter(torch.zeros(2, 2)); w.grad = torch.tensor([[3., 4.], [0.3, 0.4]])
        >>> wc.optim.clip_grad_norm_([w], max_norm=1.0)
        tensor([5.0000, 0.5000])
        >>> w.grad      # member 0 clipped to norm 1, member 1 (norm 0.5) untouched
        tensor([[0.6000, 0.8000],
                [0.3000, 0.4000]])
    """
    grads, n = _grads(parameters, n, "clip_grad_norm_")
    max_norm_t = per_member(max_norm, n, what="wide_compiler.optim.clip_grad_norm_: max_norm") \
        if n else torch.zeros(0, dtype=torch.float64)
    if not grads:
        return torch.zeros(n)
    total = _total_norm(grads, n, norm_type)
    if error_if_nonfinite:
        i = first_member(~torch.isfinite(total))
        if i is not None:
            raise RuntimeError(
                f"wide_compiler.optim.clip_grad_norm_: the total norm of order {norm_type} of "
                f"member {i}'s gradients is non-finite ({total[i].item()}), so it cannot be "
                f"clipped; set error_if_nonfinite=False to clip anyway")
    coef = torch.clamp(max_norm_t.to(total.device, total.dtype) / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for g in grads:
            g.mul_(coef.to(g.device, g.dtype).view(n, *([1] * (g.dim() - 1))))
    return total


def clip_grad_value_(parameters: torch.Tensor | Iterable[torch.Tensor], clip_value: HParam, *,
                     n: int | None = None) -> None:
    """Clamp member ``i``'s gradients to ``[-clip_value[i], clip_value[i]]`` in place
    (``clip_value`` a float or N values), as ``torch.nn.utils.clip_grad_value_`` per member.

    Example:
        >>> import torch, wide_compiler as wc
        >>> w = torch.nn.Parameter(torch.zeros(2, 2)); w.grad = torch.tensor([[3., -4.], [3., -4.]])
        >>> wc.optim.clip_grad_value_([w], clip_value=[1.0, 3.5])
        >>> w.grad
        tensor([[ 1.0000, -1.0000],
                [ 3.0000, -3.5000]])
    """
    grads, n = _grads(parameters, n, "clip_grad_value_")
    if not grads:
        return
    c = per_member(clip_value, n, what="wide_compiler.optim.clip_grad_value_: clip_value")
    with torch.no_grad():
        for g in grads:
            cv = c.to(g.device, g.dtype).view(n, *([1] * (g.dim() - 1)))
            g.clamp_(min=-cv, max=cv)
