"""Running a router's towers: every group whose towers are all selected as one wide call, a
selected part of a group member by member on the wide parameters, the other towers as
themselves."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_map

from ..model import WideModel
from ..padded import PaddedWideModel
from .grouping import _group_lazily
from .inputs import _expand, _stack, _structure, _tower_inputs

if TYPE_CHECKING:
    from .core import WideRouter

__all__: list[str] = []


def _wide_forward(router: WideRouter, args: tuple, kwargs: dict,
                  tower_names: Iterable[str] | None) -> dict[str, Any]:
    """:meth:`WideRouter.wide_forward`: ``{name: output}`` of the selected towers."""
    names, inputs = _tower_inputs(router._tower_names, args, kwargs, tower_names)
    if not router._grouped:
        _group_lazily(router, args, kwargs)
    selected = set(names)
    out: dict[str, Any] = {}
    structures: dict[int, Any] = {}  # id of a distinct input -> its structure (a shared input: once a call)
    for key, members in router._members.items():
        chosen = [i for i, n in enumerate(members) if n in selected]
        if not chosen:
            continue
        wide: WideModel = router.groups[key]
        if len(chosen) < len(members) and torch.is_grad_enabled():
            _warn_uncalled(router, key, members, chosen, wide)
        distinct = {id(inputs[members[i]]): inputs[members[i]] for i in chosen}  # shared input: one
        for k, a in distinct.items():
            if k not in structures:
                structures[k] = _structure(*a)
        same = all(structures[k] == router._structures[key] for k in distinct)
        seen = (key, str(structures[id(inputs[members[chosen[0]]])]))
        if not same and seen not in router._warned_structures:
            router._warned_structures.add(seen)
            warnings.warn(f"WideRouter: group {members} was compiled for other inputs (another nesting, "
                          "other keywords or non-tensor values); these inputs run member by member on "
                          "the wide parameters (correct, slower): call prepare_for_compile(...) with "
                          "them for one wide call", stacklevel=3)  # the caller of wide_forward
        if same and (len(chosen) == len(members) or wide._registered):
            result = _run_group(router, wide, members, inputs, [members[i] for i in chosen])
        else:
            result = {members[i]: _run_member(router, key, i, *inputs[members[i]]) for i in chosen}
        out.update(result)
    for n in names:
        if n not in out:
            a, k = inputs[n]
            out[n] = router._modules[n](*a, **k)
    return {n: out[n] for n in names}


def _warn_uncalled(router: WideRouter, key: Any, members: list[str], chosen: list[int], wide: WideModel) -> None:
    """A call of part of a group with gradients on: the other towers' slices of the stacked
    parameters get zero gradients, not the None a tower that did not run has, and an optimizer
    with state or decay still moves them (probe 15 of issue 44, P15-1: 0.28 off after one
    momentum step). Warned once per group, naming the towers."""
    warned = router.__dict__.setdefault("_warned_subsets", set())
    if key in warned or not any(p.requires_grad for p in wide.parameters()):
        return
    warned.add(key)
    left_out = [n for i, n in enumerate(members) if i not in chosen]
    warnings.warn(
        f"WideRouter: towers {left_out} of the group {members} were not called with gradients on: their slices "
        "of the group's stacked parameters get zero gradients where a tower that did not run has none, so an "
        "optimizer with momentum, weight decay or per-parameter state (Adam) still moves them at its next step "
        "(plain SGD without them does not). To train towers as themselves, call every tower of a group between "
        "optimizer steps, or give the towers that sit out an optimizer step of their own later", stacklevel=3)


def _run_group(router: WideRouter, wide: WideModel, members: list[str], inputs: dict[str, tuple],
               chosen: list[str]) -> dict[str, Any]:
    """One wide call of a group: ``{tower: output}`` of the ``chosen`` towers."""
    first = inputs[chosen[0]]
    if all(inputs.get(n) is first for n in members):
        args, kwargs = _expand(first, len(members))  # one input for all: stride-0 views
    elif all(n in inputs for n in members):
        args, kwargs = _stack([inputs[n] for n in members], members)
    else:
        raise ValueError(f"WideRouter: group {members} runs as one wide model (its towers have registered "
                         f"wide forms), so every tower of it needs an input; got inputs for {chosen}")
    y = router._compiled.get(members[0], wide)(*args, **kwargs)
    if isinstance(wide, PaddedWideModel):  # each tower's own sizes
        return {n: o for n, o in zip(members, wide.member_outputs(y)) if n in chosen}
    if isinstance(y, torch.Tensor):  # the common case: one unbind, no pytree walk per tower
        return {n: t for n, t in zip(members, y.unbind(0)) if n in chosen}

    def row(i: int) -> Any:
        return tree_map(lambda t: t[i] if isinstance(t, torch.Tensor) else t, y)

    return {n: row(i) for i, n in enumerate(members) if n in chosen}


def _run_member(router: WideRouter, key: str, i: int, args: tuple, kwargs: dict) -> Any:
    """Member i of a group alone, on row i of the wide parameters and buffers (gradients reach
    the wide parameters; running statistics are updated in place in the wide buffers)."""
    wide = router.groups[key]
    if isinstance(wide, PaddedWideModel):  # the tower's own module, on views of its own sizes
        template = router._templates.get(f"{key}/{i}")
        if template is None:
            template = router._templates[f"{key}/{i}"] = copy.deepcopy(wide._originals[i])
        tensors = wide.member_tensors(i)
    else:
        template = router._templates[key]
        params, buffers = wide._member_names()
        tensors = {name: wide._stacked(name)[i] for name in (*params, *buffers)}
    return torch.func.functional_call(template.train(wide.training), tensors, args, kwargs, strict=False)
