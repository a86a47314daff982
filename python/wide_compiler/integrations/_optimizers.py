"""N ``torch.optim`` optimizers, one per member, fused into ONE :mod:`wide_compiler.optim`
optimizer over the wide parameters: what the Lightning and transformers integrations both do with
the optimizers their members (or their ``TrainingArguments``) ask for."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .. import optim as wc_optim

__all__ = ["SUPPORTED", "fuse_optimizers"]

# torch.optim class -> the wc.optim class, from a param group (Adam/AdamW: by decoupled_weight_decay).
_CLASSES: dict[type, Callable[[dict], type]] = {
    torch.optim.SGD: lambda g: wc_optim.SGD,
    torch.optim.Adam: lambda g: wc_optim.AdamW if g.get("decoupled_weight_decay") else wc_optim.Adam,
    torch.optim.AdamW: lambda g: wc_optim.AdamW if g.get("decoupled_weight_decay", True) else wc_optim.Adam,
    torch.optim.RMSprop: lambda g: wc_optim.RMSprop,
    torch.optim.Adagrad: lambda g: wc_optim.Adagrad,
}
SUPPORTED = tuple(_CLASSES)
"""The ``torch.optim`` classes :func:`fuse_optimizers` takes."""

# torch.optim param-group keys with no wc.optim counterpart (implementation choices that do not
# change the maths), and the values that are harmless.
_IGNORED_GROUP_KEYS = {"foreach": (None, False), "fused": (None, False), "capturable": (False,),
                       "differentiable": (False,)}


def fuse_optimizers(optimizers: Sequence[torch.optim.Optimizer], members: Sequence[nn.Module],
                    wide_parameter: Callable[[str], torch.Tensor], *, owner: str,
                    alternative: str = "") -> wc_optim.WideOptimizer:
    """One :mod:`wide_compiler.optim` optimizer doing what ``optimizers[i]`` does to member ``i``,
    for every member, in one fused step.

    ``optimizers[i]`` is a ``torch.optim`` optimizer (SGD, Adam, AdamW, RMSprop, Adagrad) over
    parameters of ``members[i]``; ``wide_parameter(name)`` is the stacked ``[N, ...]`` parameter of
    the members' parameter ``name``. The optimizers must be of one class, group the parameters
    alike and agree on the flags (``amsgrad``, ``nesterov``, ...); every hyperparameter
    (``lr``, ``betas``, ``weight_decay``, ...) becomes N values, param group by param group. An
    ``lr`` is the group's ``initial_lr`` when a scheduler already set one. Errors start with
    ``owner`` and name the member and the key; ``alternative`` ends the error for an optimizer class
    that has no fused form.

    Example:
        >>> import torch, wide_compiler as wc
        >>> members = [torch.nn.Linear(3, 1) for _ in range(2)]
        >>> wide = wc.compile(members, torch.randn(2, 3), config=wc.WideConfig.fast())
        >>> opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9) for m, lr in zip(members, (0.1, 0.2))]
        >>> fused = fuse_optimizers(opts, members, wide.get_parameter, owner="example")
        >>> type(fused).__name__, fused.param_groups[0]["lr"].tolist()
        ('SGD', [0.1, 0.2])
    """
    n = len(optimizers)
    if n != len(members) or not n:
        raise ValueError(f"{owner}: {n} optimizers for {len(members)} members; expected one per member")
    opt0 = optimizers[0]
    cls0 = type(opt0)
    groups = [_parameter_groups(opt, members[i], i, owner) for i, opt in enumerate(optimizers)]
    for i, opt in enumerate(optimizers):
        if type(opt) is not cls0:
            raise ValueError(f"{owner}: member {i}'s optimizer is {type(opt).__name__}, member 0's "
                             f"{cls0.__name__}; one optimizer class per fused run")
        if cls0 not in _CLASSES:
            raise TypeError(f"{owner}: member {i}'s optimizer {cls0.__name__} has no fused per-member form; "
                            f"supported: {', '.join(c.__name__ for c in SUPPORTED)}"
                            + (f" ({alternative})" if alternative else ""))
        if len(groups[i]) != len(groups[0]):
            raise ValueError(f"{owner}: member {i}'s optimizer has {len(groups[i])} param groups, "
                             f"member 0's {len(groups[0])}")
        if groups[i] != groups[0]:
            raise ValueError(f"{owner}: member {i}'s optimizer groups the parameters differently from "
                             f"member 0's ({groups[i]} vs {groups[0]})")
    wc_cls = _CLASSES[cls0](opt0.param_groups[0])
    for i, opt in enumerate(optimizers):
        if _CLASSES[cls0](opt.param_groups[0]) is not wc_cls:
            raise ValueError(f"{owner}: member {i}'s {cls0.__name__} has decoupled_weight_decay="
                             f"{opt.param_groups[0].get('decoupled_weight_decay')}, member 0's differs; a "
                             "flag shared by the fused run")
    param_groups = []
    for gi, names in enumerate(groups[0]):
        group: dict[str, Any] = {"params": [wide_parameter(name) for name in names]}
        group.update(_group_hyperparameters([opt.param_groups[gi] for opt in optimizers], gi, cls0, wc_cls,
                                            owner))
        param_groups.append(group)
    return wc_cls(param_groups, n=n)


def _parameter_groups(opt: torch.optim.Optimizer, member: nn.Module, i: int, owner: str) -> list[list[str]]:
    """The names (in ``member``) of the parameters of each of ``opt``'s param groups."""
    names = {id(p): name for name, p in member.named_parameters()}
    out = []
    for gi, g in enumerate(opt.param_groups):
        try:
            out.append([names[id(p)] for p in g["params"]])
        except KeyError:
            raise ValueError(f"{owner}: member {i}'s optimizer (param group {gi}) holds a tensor that is "
                             "not one of the member's parameters") from None
    return out


def _group_hyperparameters(member_groups: list[dict], gi: int, cls0: type, wc_cls: type,
                           owner: str) -> dict[str, Any]:
    """One param group's hyperparameters from the members' (one dict per member): N values per
    hyperparameter, one shared value per flag."""
    out: dict[str, Any] = {}
    for key in member_groups[0]:
        if key in ("params", "initial_lr", "decoupled_weight_decay"):
            continue
        vals = [g.get(key) for g in member_groups]
        if key == "lr":
            vals = [g.get("initial_lr", g["lr"]) for g in member_groups]
        if key in wc_cls._hparams:
            out[key] = [float(v) for v in vals]
        elif key in wc_cls._pairs:
            out[key] = tuple([float(v[k]) for v in vals] for k in range(2))
        elif key in wc_cls._flags:
            for i, v in enumerate(vals):
                if v != vals[0]:
                    raise ValueError(f"{owner}: member {i}'s {cls0.__name__} has {key}={v!r}, member 0 has "
                                     f"{vals[0]!r}; {key} is one flag for the whole fused run")
            out[key] = bool(vals[0])
        elif key in _IGNORED_GROUP_KEYS:
            for i, v in enumerate(vals):
                if v not in _IGNORED_GROUP_KEYS[key]:
                    raise ValueError(f"{owner}: member {i}'s {cls0.__name__} has {key}={v!r}; the fused "
                                     f"optimizer has its own kernel (use the default "
                                     f"{key}={_IGNORED_GROUP_KEYS[key][0]!r})")
        else:
            raise ValueError(f"{owner}: member 0's {cls0.__name__} param group {gi} has {key!r}, which "
                             f"{wc_cls.__name__} does not take per member")
    return out
