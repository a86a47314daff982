"""``benchmark dropout``: N ``Linear -> Dropout(p=0.1)`` members in training mode (dropout
drawing), float32 eager, ``inference`` (members in ``eval()``: dropout is the identity) and
``train`` (members in ``train()``: forward, sum of the outputs, gradients of the Linear), against
N separate modules in a Python loop and ``torch.func`` ensembling (``vmap`` with
``randomness="different"``: every member draws its own mask).

Wide contenders (the record's ``strategy``): ``compile:auto`` (``wc.compile`` of the member) and
``module`` (``nn.Sequential(wc.nn.WideLinear, wc.nn.WideDropout)`` built with ``from_modules``).

How a result is checked (``max_abs_err``, and ``baseline_max_abs_err`` for the loop and vmap):
every contender draws its own masks, so no result can equal the loop's. The dropout is the
member's last op, so its mask is read back from the result (an element is kept iff it is not 0)
and the member is replayed with that mask: member ``i``'s ``Linear`` on ``x[i]``, times
``mask / (1 - p)``, and in train mode the gradients of its parameters through that product.
``max_abs_err`` is the largest difference of outputs and gradients against that replay; it is
raised to at least the gap ``|drop rate - p|`` when the drop rate of all members is more than 6
standard deviations from ``p``, and to 1.0 when two neighbouring members drew the same mask
(members must draw independently). Records as :mod:`.vision` (same fields).

Example::

    >>> from wide_compiler import bench
    >>> sorted(bench.TARGETS["dropout"].presets)
    ['ci', 'full', 'quick']
    >>> recs = bench.run("dropout", "ci")                     # doctest: +SKIP
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import measure
from ..measure import Contender
from .vision import Case, Inputs, _randn, _vision_target

__all__ = ["P", "dropout_cases", "replay_check"]

#: The dropout probability of every member.
P = 0.1
#: (features D, tokens T, batch B) per size.
_SIZES = {"tiny": (16, 4, 2), "small": (256, 64, 8)}


def _module(models: list[nn.Module], strategy: str) -> nn.Module:
    import wide_compiler as wc

    return nn.Sequential(wc.nn.WideLinear.from_modules([m[0] for m in models]),
                         wc.nn.WideDropout.from_modules([m[1] for m in models]))


def replay_check(models: list[nn.Module], xs: Inputs, mode: str
                 ) -> Callable[[Contender, Any], float]:
    """The ``check`` of :func:`.engine.run_case` for members ``Sequential(Linear, Dropout)``:
    the largest difference of a result against each member replayed with the mask it drew (see
    the module docstring)."""
    (x,) = xs
    n = len(models)

    def check(contender: Contender, result: Any) -> float:
        out, grads = result if mode == "train" else (result, ())
        ys = [leaves[0].detach() for leaves in measure.contenders.member_outputs(contender, out, n)]
        member_grads = measure.contenders.member_grads(contender, grads, n) if mode == "train" else []
        err, kept, total, masks = 0.0, 0, 0, []
        for i, m in enumerate(models):
            linear, drop = m[0], m[1]
            with torch.enable_grad():
                ref = linear(x[i])
                if drop.training and drop.p > 0:
                    keep = ys[i] != 0
                    masks.append(keep)
                    kept, total = kept + int(keep.sum()), total + keep.numel()
                    ref = ref * keep / (1 - drop.p)
                err = max(err, measure.contenders.diff(ref.detach(), ys[i], f"member {i} of {contender.name}"))
                if mode == "train":
                    ref_grads = torch.autograd.grad(ref.sum(), list(linear.parameters()))
                    for j, g in enumerate(ref_grads):
                        err = max(err, measure.contenders.diff(g, member_grads[j][i],
                                                    f"gradient {j} of member {i} of {contender.name}"))
        if total:
            p = models[0][1].p
            rate = 1 - kept / total
            if abs(rate - p) > 6 * math.sqrt(p * (1 - p) / total):
                err = max(err, abs(rate - p))
            if any(torch.equal(a, b) for a, b in zip(masks, masks[1:])):
                err = max(err, 1.0)
        return err

    return check


@_vision_target("dropout", "Linear -> Dropout(0.1) drawing per member: wc.compile and WideDropout "
                "vs loop / vmap (randomness='different')")
def dropout_cases(size: str) -> list[Case]:
    """One case: ``Linear(D, D) -> Dropout(0.1)`` on ``[B, T, D]`` tokens (tiny: D=16, T=4, B=2;
    small: D=256, T=64, B=8)."""
    d, t, b = _SIZES["tiny" if size == "tiny" else "small"]
    return [Case("dropout", "linear+dropout", f"D={d} T={t} p={P}",
                 lambda: nn.Sequential(nn.Linear(d, d), nn.Dropout(P)), _randn(t, d), b, _module,
                 check=replay_check)]
