"""A member's optimizer hyperparameters, as the population's optimizer factory derives them from
its configuration: the factory is asked (on throwaway one-member parameters), so factories that
rename or transform keys are followed, and a change of configuration reaches that member only."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .core import Population

__all__: list[str] = []


def _make_optimizer(pop: Population, configs: list[dict[str, Any]]) -> Any:
    """The population's optimizer: the factory called with one column of values per key."""
    keys = sorted({k for c in configs for k in c})
    columns = {k: [c.get(k) for c in configs] for k in keys}
    opt = pop.make_optimizer(pop.model.parameters(), columns)
    if not callable(getattr(opt, "set_member_hyperparameters", None)):
        raise TypeError(f"wide_compiler.integrations.ray: optimizer returned a "
                        f"{type(opt).__name__}; expected a wide_compiler.optim optimizer "
                        "(per-member hyperparameters), e.g. lambda params, hp: "
                        "wc.optim.Adam(params, lr=hp['lr'])")
    return opt


def _member_hparams(pop: Population, i: int, config: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The optimizer hyperparameters (per param group) that ``config`` gives member ``i``:
    the optimizer factory called with that config alone (each key a 1-element list) on
    throwaway 1-member parameters (meta tensors shaped like the model's), so factories that
    rename or transform keys (``lr=[10 ** x for x in hp["log_lr"]]``) are followed. Raises
    the factory's ``ValueError``/``TypeError`` for invalid values, naming member ``i`` (the
    throwaway optimizer's only member is its member 0)."""
    params = [torch.empty((1, *p.shape[1:]), dtype=p.dtype, device="meta")
              for p in pop.model.parameters()]
    try:
        probe = pop.make_optimizer(params, {k: [v] for k, v in config.items()})
    except (ValueError, TypeError) as e:
        kind = TypeError if isinstance(e, TypeError) else ValueError
        detail = re.sub(r"\bmember 0\b", f"member {i}", str(e))
        raise kind(f"wide_compiler.integrations.ray: member {i}'s configuration {dict(config)!r} "
                   f"is refused by the optimizer factory: {detail}") from e
    if len(probe.param_groups) != len(pop.optimizer.param_groups):
        raise ValueError(f"wide_compiler.integrations.ray: the optimizer factory made "
                         f"{len(probe.param_groups)} param groups for one member but "
                         f"{len(pop.optimizer.param_groups)} for the population; its groups must "
                         "depend on the parameters it is given only")

    def per_member(v: Any) -> bool:
        return isinstance(v, float) or (isinstance(v, tuple) and all(isinstance(x, float) for x in v))

    return [{k: v for k, v in probe.member_hyperparameters(0, g).items() if per_member(v)}
            for g in range(len(probe.param_groups))]


def _push_hparams(pop: Population, i: int, groups: list[dict[str, Any]]) -> None:
    """Set member ``i``'s hyperparameters, per param group, in the population's optimizer."""
    for g, values in enumerate(groups):
        if values:
            pop.optimizer.set_member_hyperparameters(i, group=g, **values)


def _push_change(pop: Population, i: int, old: Mapping[str, Any], new: Mapping[str, Any]) -> None:
    """Push into member ``i``'s optimizer the hyperparameters that changing its configuration
    from ``old`` to ``new`` changes (validated before anything changes)."""
    before, after = _member_hparams(pop, i, old), _member_hparams(pop, i, new)
    _push_hparams(pop, i, [{k: v for k, v in a.items() if b.get(k) != v} for a, b in zip(after, before)])
