"""Stochastic weight averaging for a wide model: :func:`update_bn`.

``torch.optim.swa_utils.AveragedModel`` works on a :class:`~wide_compiler.WideModel` as it is
(it averages the stacked parameters, each member's on its own). ``torch.optim.swa_utils.update_bn``
does not: it looks for ``nn.BatchNorm`` modules, and a wide model holds its norms as stacked
buffers of one graph, so torch's finds none and returns without a change. This module's
:func:`update_bn` recomputes every member's BatchNorm statistics as torch's would for that member
alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

__all__ = ["update_bn"]


@torch.no_grad()
def update_bn(loader: Iterable[Any], model: nn.Module, device: torch.device | str | None = None) -> None:
    """``torch.optim.swa_utils.update_bn`` for a wide model: every member's BatchNorm running
    statistics recomputed over ``loader``, as torch's ``update_bn`` computes them for that member
    alone (statistics reset, a cumulative average over all batches in train mode, momentum put
    back). Each batch is what the wide model takes (N-first tensors: member ``i`` sees ``[i]``
    of each); a batch that is a list or tuple gives its first element, as torch's does.

    Args:
        loader: the batches (a ``DataLoader``, or any iterable).
        model: a :class:`~wide_compiler.WideModel`, or a ``torch.optim.swa_utils.AveragedModel``
            of one (its ``module`` is updated).
        device: where each batch is moved before the forward (torch's ``device``).

    Each member runs as an ordinary module (:meth:`~wide_compiler.WideModel.member`), then its
    buffers are loaded back: N passes over ``loader``, an occasional cost (once per SWA run).

    Example:
        >>> import torch, wide_compiler as wc
        >>> make = lambda: torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
        >>> wide = wc.compile([make() for _ in range(3)], torch.randn(6, 4), config=wc.WideConfig.fast())
        >>> swa = torch.optim.swa_utils.AveragedModel(wide)
        >>> loader = [torch.randn(3, 16, 4) for _ in range(4)]
        >>> wc.optim.swa_utils.update_bn(loader, swa)
        >>> swa.module.member(0)[1].num_batches_tracked
        tensor(4)
    """
    wide = getattr(model, "module", model) if isinstance(model, torch.optim.swa_utils.AveragedModel) else model
    if not hasattr(wide, "member") or not hasattr(wide, "load_member_state_dict"):
        raise TypeError(f"wide_compiler.optim.swa_utils.update_bn: expected a WideModel (or an AveragedModel of "
                        f"one), got {type(wide).__name__}; for an ordinary module use torch.optim.swa_utils.update_bn")
    batches = list(loader)
    for i in range(wide.n):
        member = wide.member(i)
        if not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in member.modules()):
            return  # no BatchNorm in the members: nothing to update (as torch's)
        own = [b[0] if isinstance(b, (list, tuple)) else b for b in batches]
        own = [tree_map(lambda t: t[i] if isinstance(t, torch.Tensor) else t, b) for b in own]
        torch.optim.swa_utils.update_bn(own, member, device=device)
        wide.load_member_state_dict(i, member.state_dict())
