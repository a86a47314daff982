"""Fixed random draws, so that a train graph with random ops can be compared with its members.

Each member of a wide model draws its own random numbers (dropout masks, stochastic depth), so
its train outputs cannot be compared value by value with a member run alone -- unless both draw
the same numbers. :func:`fixed_draws` makes every draw of the process's default generator a
fixed value while it is active (Note [Fixed draws in the trust check]); the check's own draws,
which take an explicit ``generator=``, are left alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Note [Fixed draws in the trust check]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A dropout member and its wide model draw different masks, so ``check_compile`` used to skip
# train mode for any graph with a random op: a defect in train mode only (BatchNorm's batch
# statistics, a gradient) then passed unseen on every model with a Dropout. Instead, while the
# wide model and the members run, every draw from the default generator is replaced by one fixed
# value, the same on both sides, chosen so that the ops agree with each other: a uniform draw is
# its low end (``rand`` 0, ``uniform_(a, b)`` a, ``randint``/``random_`` their low bound,
# ``exponential_`` 0), a
# normal draw its mean, ``randperm`` the identity, and a Bernoulli draw of probability p is
# 1 where p > 0 and 0 where p == 0 -- which is what ``rand < p`` gives when rand is 0, so a rule
# that draws a member's Bernoulli mask as ``rand_like(x) < q`` (per-member dropout) and ATen's
# ``bernoulli_(q)`` agree. Dropout keeps every element (scaled by 1/(1 - p); p == 1 drops all),
# stochastic depth keeps every branch, and the train graph is compared in full: forward values,
# gradients, buffers. What varies per member is each mask's own draw, tested elsewhere by rates.
# A random op with no fixed value here (``multinomial``, ``exponential_``, a kernel that draws
# inside, such as SDPA's dropout) runs as it is and is recorded: the check then says it was
# skipped, naming the op, rather than compare values that cannot match.


def _bound(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    names = [a.name for a in func._schema.arguments]
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound


def _native_dropout(func: Any, bound: dict, args: tuple, kwargs: dict) -> Any:
    if not bound.get("train"):  # no draw in eval (train None or False)
        return func(*args, **kwargs)
    x, keep = bound["input"], 1.0 - bound["p"]
    mask = torch.full_like(x, keep > 0, dtype=torch.bool)
    return x * mask * (1.0 / keep if keep > 0 else 0.0), mask


def _bernoulli_(func: Any, bound: dict, args: tuple, kwargs: dict) -> Any:
    self, p = bound["self"], bound.get("p", 0.5)
    if isinstance(p, torch.Tensor):
        return self.copy_((p > 0).to(self.dtype).expand_as(self))
    return self.fill_(float(p > 0))


def _bernoulli(func: Any, bound: dict, args: tuple, kwargs: dict) -> Any:
    x = bound["self"]
    if "p" in bound:  # bernoulli.p: a scalar probability for every element
        return torch.full_like(x, float(bound["p"] > 0))
    return (x > 0).to(x.dtype)  # bernoulli.default: x holds the probabilities


def _fill(value: Any) -> Any:
    """A handler that runs the op (for its shape, dtype and device) then fills the result."""
    def handler(func: Any, bound: dict, args: tuple, kwargs: dict) -> Any:
        out = func(*args, **kwargs)
        v = value(bound)
        if isinstance(v, torch.Tensor):
            return out.copy_(v.expand_as(out))
        return out.fill_(v)
    return handler


def _randperm(func: Any, bound: dict, args: tuple, kwargs: dict) -> Any:
    out = func(*args, **kwargs)
    return out.copy_(torch.arange(out.numel(), dtype=out.dtype, device=out.device))


_ZERO = _fill(lambda b: 0)
# handlers by op name (every overload of it): what its draw is fixed at
_HANDLERS = {
    "native_dropout": _native_dropout,
    "bernoulli_": _bernoulli_,
    "bernoulli": _bernoulli,
    "rand": _ZERO, "rand_like": _ZERO, "randn": _ZERO, "randn_like": _ZERO,
    "uniform_": _fill(lambda b: b.get("from", 0.0)),
    "normal_": _fill(lambda b: b.get("mean", 0.0)),
    "normal": _fill(lambda b: b["mean"]),
    "randint": _fill(lambda b: b.get("low", 0)), "randint_like": _fill(lambda b: b.get("low", 0)),
    "random_": _fill(lambda b: b.get("from", 0)),
    "randperm": _randperm,
    "exponential_": _ZERO,
}


def _draws(bound: dict) -> bool:
    """Whether an op tagged random really draws: not with a dropout probability of 0 (SDPA's
    ``dropout_p``, an RNN's ``dropout``) or out of training."""
    if bound.get("train") is False:
        return False
    return not any(bound.get(k) == 0 for k in ("p", "dropout_p", "dropout") if isinstance(bound.get(k), (int, float)))


class _FixedDraws(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.unfixed: set[str] = set()  # random ops met that have no fixed value here

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return func(*args, **kwargs)
        bound = _bound(func, args, kwargs)
        if bound.get("generator") is not None:  # the check's own draws (an explicit generator)
            return func(*args, **kwargs)
        handler = _HANDLERS.get(func.overloadpacket.__name__)
        if handler is not None:
            return handler(func, bound, args, kwargs)
        if _draws(bound):
            self.unfixed.add(str(func))
        return func(*args, **kwargs)


@contextlib.contextmanager
def fixed_draws(active: bool = True) -> Iterator[set[str]]:
    """Within the block, every draw from the default generator is a fixed value (Note [Fixed
    draws in the trust check]); yields the set of random ops met that could not be fixed (their
    names), which the caller reads after the block. ``active=False``: draws as usual (a graph
    without random ops), the set stays empty.

    Example:
        >>> import torch
        >>> from wide_compiler._equivalence.draws import fixed_draws
        >>> with fixed_draws() as unfixed:
        ...     y = torch.nn.functional.dropout(torch.ones(4), p=0.5, training=True)
        >>> y, unfixed
        (tensor([2., 2., 2., 2.]), set())
    """
    if not active:
        yield set()
        return
    mode = _FixedDraws()
    with mode:
        yield mode.unfixed
