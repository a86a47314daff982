"""The wide state, and calling a wide graph on it.

A wide graph is stateless (DESIGN.md §2): its parameters, buffers and lifted constants enter as
placeholders. The ``stack_state`` pass (:func:`stack_state`) stacks the members' parameters and
buffers by name into ``[N, ...]`` tensors and builds the wide forms of registered modules: a
:class:`WideState`, which :class:`~wide_compiler.WideModel` installs as its own. :func:`call_graph`
is the one way a graph runs on a state: the model's forward and the model-level tuning check
(fx/model_check.py, which runs before the model exists) both call it, each with the module that
holds the tensors (the model, or :func:`state_module`'s stand-in).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_unflatten

from ..allocator import cached
from ..layouts import tag_layout
from ..registry import registered_wide_form

if TYPE_CHECKING:
    from torch.export import ExportedProgram

    from .constants import ConstantPlan
    from .widen import GraphInput, WideGraph

__all__ = ["WideState", "call_graph", "check_state", "get_tensor", "has_tensor", "holders", "missing_constants",
           "persistent_buffer_names", "put_tensor", "stack_state", "state_module"]


@dataclasses.dataclass
class WideState:
    """The tensors and modules a wide model holds, by name.

    ``parameters``/``buffers``: the stacked ``[N, ...]`` tensors under the members' names (a
    parameter keeps its ``requires_grad``); a tensor tied inside a member (an LM head sharing the
    embedding) is ONE stacked tensor under every name it has, so the graph reads it once per
    alias and autograd sums the gradients, as in the member. ``non_persistent``: the buffers
    ``state_dict`` leaves out, as the member's does. ``modules``: registered path -> the wide
    form built by its ``from_modules`` (its tensors are its own, not listed above)."""

    parameters: dict[str, nn.Parameter]
    buffers: dict[str, torch.Tensor]
    non_persistent: frozenset[str] = frozenset()
    modules: dict[str, nn.Module] = dataclasses.field(default_factory=dict)


def persistent_buffer_names(model: nn.Module) -> set[str]:
    """The names of ``model``'s buffers that ``state_dict`` includes."""
    out = set()
    for mod_name, mod in model.named_modules():
        for name, b in mod._buffers.items():
            if b is not None and name not in mod._non_persistent_buffers_set:
                out.add(f"{mod_name}.{name}" if mod_name else name)
    return out


def _owned(name: str, registered: Sequence[str]) -> bool:
    """Whether ``name`` is stacked (not a tensor of a registered module's wide form)."""
    return not any(name.startswith(p + ".") for p in registered)


def stack_state(c: Any) -> None:
    """The ``stack_state`` pass: ``c.state`` from ``c.members`` (checked to be one program by
    the passes before). Registered modules (``c.opaque_paths``) get their wide form; every other
    parameter and buffer of member 0 is stacked over the members, under its name."""
    template, members = c.members[0], c.members
    registered = list(c.opaque_paths.values())
    modules = {path: registered_wide_form(template.get_submodule(path)).from_modules(
        [m.get_submodule(path) for m in members]) for path in registered}
    params: dict[str, nn.Parameter] = {}
    buffers: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        stacked_by_id: dict[int, torch.Tensor] = {}
        for name, p in template.named_parameters(remove_duplicate=False):
            if _owned(name, registered):
                if id(p) not in stacked_by_id:
                    stacked = torch.stack([m.get_parameter(name).detach() for m in members])
                    stacked_by_id[id(p)] = nn.Parameter(stacked, requires_grad=p.requires_grad)
                params[name] = stacked_by_id[id(p)]
        persistent = persistent_buffer_names(template)
        for name, b in template.named_buffers(remove_duplicate=False):
            if _owned(name, registered):
                if id(b) not in stacked_by_id:
                    stacked_by_id[id(b)] = torch.stack([m.get_buffer(name).detach() for m in members])
                buffers[name] = stacked_by_id[id(b)]
    c.state = WideState(params, buffers, frozenset(n for n in buffers if n not in persistent), modules)


def check_state(c: Any) -> None:
    """After ``stack_state``: every parameter the graph reads is in the state."""
    missing = [i.name for i in c.wide.inputs if i.kind == "parameter" and i.name not in c.state.parameters]
    if missing:
        raise AssertionError(f"wide_compiler: pass 'stack_state': no stacked tensor for {missing}")


def missing_constants(ep: ExportedProgram, plan: ConstantPlan | None,
                      root: nn.Module) -> Iterator[tuple[str, torch.Tensor, bool, bool]]:
    """The constants a graph of ``ep`` reads that ``root`` does not hold yet, as
    ``(name, tensor, persistent, per_member)``: the lifted constants of ``ep`` (non-persistent
    buffers on the device of ``root``'s parameters) and the ``_per_member.<path>`` buffers of
    Note [Per-member constants] (fx/constants.py)."""
    for name, value in ep.constants.items():
        if not has_tensor(root, name):
            device = next((p.device for p in root.parameters()), value.device)
            yield name, value.detach().clone().to(device), False, False
    if plan is not None:
        for name, (values, persistent) in plan.buffers.items():
            if not has_tensor(root, name):
                device = next((p.device for p in root.parameters()), torch.device("cpu"))
                yield name, torch.tensor(values, dtype=torch.float64, device=device), persistent, True


def put_tensor(root: nn.Module, name: str, t: torch.Tensor, persistent: bool = True) -> None:
    """Register ``t`` at ``name`` under ``root``, making plain container modules on the way."""
    mod = root
    *parts, attr = name.split(".")
    for part in parts:
        if part not in mod._modules:
            mod.add_module(part, nn.Module())
        mod = mod._modules[part]
    if isinstance(t, nn.Parameter):
        mod.register_parameter(attr, t)
    else:
        mod.register_buffer(attr, t, persistent=persistent)


def state_module(state: WideState) -> nn.Module:
    """A plain module holding ``state``'s tensors and modules under their names (the same
    objects): what a graph runs on before its :class:`~wide_compiler.WideModel` exists."""
    root = nn.Module()
    for path, module in state.modules.items():
        parent, _, attr = path.rpartition(".")
        container = root
        for part in filter(None, parent.split(".")):
            if part not in container._modules:
                container.add_module(part, nn.Module())
            container = container._modules[part]
        container.add_module(attr, module)
    for name, p in state.parameters.items():
        put_tensor(root, name, p)
    for name, b in state.buffers.items():
        put_tensor(root, name, b, persistent=name not in state.non_persistent)
    return root


def get_tensor(root: nn.Module, name: str) -> torch.Tensor:
    """The parameter or buffer at ``name`` under ``root``."""
    path, _, attr = name.rpartition(".")
    mod = root.get_submodule(path) if path else root
    t = mod._parameters.get(attr)
    return t if t is not None else mod._buffers[attr]


def has_tensor(root: nn.Module, name: str) -> bool:
    try:
        get_tensor(root, name)
        return True
    except (AttributeError, KeyError):
        return False


def holders(root: nn.Module, wg: WideGraph) -> list:
    """Per graph input: the (module, attribute) under ``root`` holding its stacked tensor, or
    None for user inputs and the root input."""
    plan = []
    for inp in wg.inputs:
        if inp.kind in ("parameter", "buffer", "constant"):
            path, _, attr = inp.name.rpartition(".")
            plan.append((root.get_submodule(path) if path else root, attr))
        else:
            plan.append(None)
    return plan


def call_graph(wg: WideGraph, root: nn.Module, plan: Sequence, user_inputs: Sequence,
               check: Callable[[Any, GraphInput, Any], None] | None = None, ranges: Any = None) -> Any:
    """Run ``wg`` on the state under ``root`` and the flat ``user_inputs``: each state input is
    read live from its holder in ``plan`` (:func:`holders`), the root input is ``root`` (which
    holds the registered modules' wide forms), ``check(x, input, ranges)`` (if given) vets each
    user input first. Mutated buffers are written back under ``root``; outputs come back
    contiguous (as the members' would be: wide ops may return strided views), tagged N-first, in
    the member's output structure."""
    feeds, user = [], iter(user_inputs)
    for inp, holder in zip(wg.inputs, plan):
        if holder is not None:  # a stacked parameter/buffer/constant: read it live
            mod, attr = holder
            t = mod._parameters.get(attr)
            feeds.append(t if t is not None else mod._buffers[attr])
        elif inp.kind == "root":
            feeds.append(root)
        else:
            x = next(user)
            if check is not None:
                check(x, inp, ranges)
            if (isinstance(x, torch.Tensor) and inp.node.name in wg.inputs_written
                    and any(st == 0 and n > 1 for n, st in zip(x.shape, x.stride()))):
                raise ValueError(
                    f"wide_compiler: the forward writes in place into its input {inp.node.name!r}, which this call "
                    f"passes with stride 0 (an input shared by all members, x.expand(N, ...): strides "
                    f"{list(x.stride())}), so the members' writes would land on one memory. Pass each member its own "
                    "input (x.expand(N, ...).clone(), or torch.stack of per-member tensors)")
            feeds.append(x)
    gm = wg.graph_module if wg.tiled is None else wg.tiled  # Note [Member tiles] (fx/tiling.py)
    # its forward: no module hooks (Note [Global module hooks run on the members, not on the wide model])
    outs = _call_cached(gm.forward, *feeds)  # Note [The wide caching allocator] (csrc/wide/memory)
    k = len(wg.mutated_buffers)
    if k:
        with torch.no_grad():
            for name, new in zip(wg.mutated_buffers, outs[:k]):
                get_tensor(root, name).copy_(new)
    outs = [o.contiguous() if isinstance(o, torch.Tensor) else o for o in outs[k:]]
    if wg.no_backward is not None and torch.is_grad_enabled():  # Note [An eval graph whose backward is not ...]
        outs = [_NoBackward.apply(o, wg.no_backward) if isinstance(o, torch.Tensor) and o.requires_grad else o
                for o in outs]
    outs = [tag_layout(o, "nfirst") if isinstance(o, torch.Tensor) else o for o in outs]
    return tree_unflatten(outs, wg.out_spec)


# Note [An eval graph whose backward is not the members']
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# An eval graph is captured where the member's forward runs something torch.export does not keep
# for the backward (a custom autograd Function such as a straight-through estimator, a tensor
# hook, a module backward hook, reentrant checkpointing...: fx/export_watch.py): its outputs are the
# members', but autograd's gradient of the traced forward is not what the member's backward
# computes (a rounding STE: zero where the member passes the gradient through). A backward through
# such a graph (saliency maps, adversarial inputs) would be silently wrong, so the outputs carry a
# node whose backward raises, naming what and why; the forward stays exact (probe 10 of issue 44,
# P10-2: input gradients 0 where the members' were up to 26).
class _NoBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, why: str) -> torch.Tensor:
        ctx.why = why
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        raise RuntimeError(
            f"wide_compiler: a backward through this wide model's eval graph is refused: {ctx.why}, in the members' "
            "forward, which torch.export does not capture for the backward, so its gradients would be autograd's "
            "of the traced forward, not the members' (Note [An eval graph whose backward is not the members'] in "
            "fx/state.py). Take gradients through the members themselves (wide.member(i)), or through a train "
            "graph where that code is written with differentiable torch ops")


# a call and its backward pass in the wide caching allocator (not under torch.compile: compiled code allocates itself)
_call_cached = cached(lambda fn, *args: fn(*args))
