"""Members that differ in size: one padded program for all of them, exactly (``compile(pad=True)``).

Note [Padded members]
~~~~~~~~~~~~~~~~~~~~~
A size sweep (hidden widths, channel counts, embedding dims, feed-forward sizes) gives members
whose programs are the same up to the sizes of their tensors. :func:`pad_members` captures every
member, checks that the programs agree node by node except for sizes, and builds ONE padded
program, run by N :class:`PaddedMember` modules that hold each member's own tensors at the
largest sizes; the ordinary compiler then fuses those like any same-shape members.

Layouts. Every tensor dimension whose size differs between members has a *layout*: a bool
``[N, max]`` tensor saying which positions of the padded dimension hold member ``i``'s values
(``None``: the dimension is the same for all). Parameters lay their own sizes out as a prefix
(``[0, size)``), unless a consumer fixes another layout (a Linear after a ``cat`` of two padded
embeddings reads columns ``[0, d1) + [d1max, d1max + d2)``); ops map layouts through (``cat``
concatenates them, a reshape that merges a padded dim with unpadded inner dims repeats it).

Exactness. The invariant is that every value is zero outside its layout (*clean*), in the
forward and the backward:

* parameters and buffers are zero there, and their gradient is masked: the PaddedWideModel
  hooks each padded parameter's gradient (a multiply by its mask in the backward only; the hooks
  are registered again whenever a parameter is replaced: copies, pickles, ``.to()``,
  ``load_state_dict(assign=True)``), so every optimizer leaves the padding, and its state, at
  zero (weight decay included);
* contractions (linear, matmul, conv, embedding) of clean values are clean; a kernel-size sweep
  lays each smaller kernel out centred in the largest, with the padding that makes it the
  member's own convolution (Note [Kernel-size sweeps] in fx/padding_rules_math.py), and an embedding
  over a padded vocabulary bounds each member's indices by its own rows, so an index past them
  raises IndexError as the member's own lookup does (Note [Padded vocabularies]);
* pointwise ops with f(0) = 0 keep it; any other op whose result has a padded dim (sigmoid, a
  bias added by broadcast, a norm's bias over padded rows, ...) is multiplied by its mask after;
* ops that reduce over a padded dim use each member's true count: a norm over it becomes its
  decomposition with a per-member mask and count (layer_norm, rms_norm, group_norm), ``mean``
  is rescaled by max / true count, softmax and max set the padding to -inf first.

Anything else with a padded input or output (a reshape that splits a padded dim into two that
both vary, a division by a padded value, a slice or a cat whose layout cannot be tracked, an op
with no padding rule) is refused with the op, the sizes and the source line, never padded
silently. Sizes computed in Python are matched through the places they are read (Note [Aligning
sizes computed in Python]). The program holds only under what its capture assumed of the
inputs (Note [A padded program's assumptions]). A padded model's ``load_state_dict`` checks the members' sizes and
the zero padding first (Note [Loading a padded state] in padded.py). The masks, counts, bounds
and group matrices are per-member non-persistent buffers (``_wc_pad_<k>``), so the compiler
stacks them like any buffer. The rule of each op is in fx/padding_rules.py, the pass that aligns
the members' programs and runs the rules in fx/padding_pass.py, the padded members and what a
padded program assumes in fx/padded_members.py; this module captures the members and builds them.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.export.graph_signature import InputKind
from torch.utils._pytree import tree_flatten

from ..errors import ArchitectureMismatchError, UnsupportedOperationError, WideCompileError
from ..registry import registered_paths, registered_wide_form
from .capture import _batched, capture
from .constants import _same_tensor
from .hook_writes import refuse_writing_hooks
from .member_checks import check_modes
# a padded model pickled before fx/padded_members.py was split out of this module names these classes
# wide_compiler.fx.padding.<class>: they stay importable from here, so such a pickle loads
# (test_a_padded_model_pickled_before_the_split_into_modules_still_loads)
from .padded_members import Assumptions, OutsidePaddedProgram, PaddedMember, PadInfo
from .padding_layouts import Prefer
from .padding_pass import Padder
from .source import source_line

__all__ = ["pad_members"]

log = logging.getLogger(__name__)


# Note [The state a padded program was captured with]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The padded programs are the members' exported programs, so a module global, a flag, a dict
# entry or a global hook their code read is baked in as it was at ``pad_members``. The wide
# compiler then captures the padded members, whose own forward reads none of it, so its guards
# (Note [Guards] in fx/guards.py) cannot see such a change, and capturing the padded members again
# would run the same baked programs anyway. So each mode keeps member 0's guards on that state
# (``guards_of`` of its capture, without the inputs' part, which the padded members' assumptions
# and the wide graph's guards check), and the PaddedWideModel checks them before each call: a
# change is refused, naming it, rather than run with the old value. (Padding again on a change,
# as the unpadded model captures again, is not done: a padded model refuses instead.)
def _state_guards(ep: Any, model: nn.Module, args: tuple, kwargs: dict, n: int) -> Any:
    """Member 0's guards on the state its code read (Note [The state a padded program was
    captured with]); the inputs' part is left out."""
    from .capture import flat_signature
    from .guards import guards_of

    g = guards_of(ep, model, (tuple(args), dict(kwargs)), n, flat_signature(model, tuple(args), dict(kwargs)))
    return dataclasses.replace(g, dtypes=(), fixed=(), names=(), code=(), shown=(), follows=(), layout=(),
                               devices=(), device=None, grads=())


def _capture_member(i: int, model: nn.Module, training: bool, args: tuple, kwargs: dict,
                    batch: dict[int, frozenset[int]]) -> Any:
    """Member ``i``'s program on the sample, captured from a copy; a member that fails on the
    sample itself (its own input size differs from member 0's) is refused as such."""
    try:
        return capture(copy.deepcopy(model).train(training), args, kwargs, extra_dims=batch)
    except WideCompileError as e:
        if i == 0:  # the sample is member 0's: the capture's own message says what to pass
            raise
        try:
            with torch.no_grad():
                copy.deepcopy(model).train(training)(*args, **kwargs)
        except Exception as own:  # noqa: BLE001 -- the member's own error is the reason
            raise ArchitectureMismatchError(
                f"pad=True: member {i} fails on the sample (one input for all members, as member 0 takes it): "
                f"{type(own).__name__}: {own}. Padded members differ only in their parameters' sizes: they "
                "must take inputs of the same sizes (a sweep of input widths needs a wide model per width)") from e
        raise


def _refuse_differing_constants(eps: Sequence[Any]) -> None:
    """A tensor made in the forward from a number (``torch.tensor(h.shape[-1])``, ``h.new_tensor(d)``)
    is a lifted constant of each member's capture; the padded program holds member 0's, so one that
    differs between members is refused, naming where it is read (probe 12 of issue 44, P12-7: every
    member divided by member 0's head dim, silently)."""
    names = {spec.target: spec.arg.name for spec in eps[0].graph_signature.input_specs
             if spec.kind == InputKind.CONSTANT_TENSOR}
    for target, mine in eps[0].constants.items():
        # (a non-persistent buffer is among export's constants too: padded as state, not refused
        # as a tensor made in the forward, probe 17, P17-1)
        if not isinstance(mine, torch.Tensor) or target not in names:
            continue
        for i, ep in enumerate(eps[1:], start=1):
            theirs = ep.constants.get(target)
            if isinstance(theirs, torch.Tensor) and _same_tensor(theirs, mine):
                continue
            node = next((n for n in eps[0].graph.nodes if n.op == "placeholder" and n.name == names.get(target)), None)
            where = source_line(next(iter(node.users))) if node is not None and node.users else "in the forward"
            raise UnsupportedOperationError(
                f"wide_compiler: pad=True: member {i}: a tensor made in the forward from a number ({where}) holds "
                f"{theirs.tolist() if isinstance(theirs, torch.Tensor) and theirs.numel() < 9 else 'other values'} where "
                f"member 0's holds {mine.tolist() if mine.numel() < 9 else 'its own'} (a size that differs between "
                "members, such as torch.tensor(h.shape[-1])): the padded program would give every member member 0's. "
                "Compute it with Python numbers (math.sqrt(d)) or from the tensor itself, or compile the members in "
                "groups of one size (the router does)")


def _modules_run(ep: Any, paths: Sequence[str]) -> list[str]:
    """Which of ``paths`` (modules with a wide form of their own) the captured program runs: an
    unused one (a spare ``BatchNorm(momentum=None)``) does not stop padding (probe 16, P16-4)."""
    if not paths:
        return []
    ran = {fqn for node in ep.graph.nodes for fqn, _ in (node.meta.get("nn_module_stack") or {}).values()}
    return [p for p in paths if any(f == p or f.startswith(p + ".") for f in ran)]


def _runs_whole(model: nn.Module, path: str) -> UnsupportedOperationError:
    module = model.get_submodule(path)
    return UnsupportedOperationError(
        f"wide_compiler: pad=True: the module {path!r} ({type(module).__name__}) runs whole, through its wide "
        f"form {registered_wide_form(module).__name__} (a module export cannot capture, such as BatchNorm "
        "with momentum=None, or one registered with @wide_compiler.register), and padding follows captured "
        "ops only. Compile the members in groups of one size (the router does), or give that module a "
        "momentum / no registered form")


def pad_members(models: Sequence[nn.Module], args: tuple, kwargs: dict | None = None
                ) -> tuple[list[PaddedMember], PadInfo] | None:
    """The padded members of a population whose sizes differ (Note [Padded members]), and what
    padding did; None when every member already has the same sizes (nothing to pad). The
    members are not modified: each mode's program is captured from copies."""
    kwargs = dict(kwargs or {})
    check_modes(models)  # each mode's program is captured with every module in that mode
    for i, model in enumerate(models):  # before a capture runs them (Note [Hooks that write outside themselves])
        refuse_writing_hooks(model, i)
    shapes = [{k: tuple(v.shape) for k, v in m.state_dict().items()} for m in models]
    if all(s == shapes[0] for s in shapes):
        return None
    whole = list(registered_paths(models[0]))  # modules run whole, by their wide forms (probe 11, P11-1)
    if any(s.keys() != shapes[0].keys() for s in shapes):
        bad = next(i for i, s in enumerate(shapes) if s.keys() != shapes[0].keys())
        raise ArchitectureMismatchError(
            f"pad=True: member {bad}'s parameters and buffers are not member 0's "
            f"(only in member {bad}: {sorted(set(shapes[bad]) - set(shapes[0]))}; only in member 0: "
            f"{sorted(set(shapes[0]) - set(shapes[bad]))})")
    persistent = set(models[0].state_dict())
    padders, infos = {}, {}
    prefs: dict[tuple[str, int], torch.Tensor] = {}  # parameter dims laid out other than as a prefix
    tried: dict[tuple[str, int], list[torch.Tensor]] = {}
    assumptions: dict[bool, Assumptions] = {}
    state_guards: dict[bool, Any] = {}
    # dim 0 of every input may vary (a 1-D index input too): export keeps it dynamic where the
    # program allows, and its guards say where it does not (Note [A padded program's assumptions]).
    # Not a dim 0 of size 1 in a batched sample: it is no batch (a recurrent layer's initial state
    # [layers, B, H] of one layer), and the capture would repeat it to 2 (probe 18 of issue 44, P18-5:
    # a GRU given h0 was refused with export's "Expected hidden size (1, s77, 4), got [s48, 3, 4]").
    leaves = tree_flatten((args, kwargs))[0]
    batched = _batched((args, kwargs))
    batch = {k: frozenset({0}) for k, a in enumerate(leaves)
             if isinstance(a, torch.Tensor) and a.dim() >= 1 and not (batched and a.dim() >= 2 and a.shape[0] == 1)}
    for training in (True, False):
        try:
            eps = [_capture_member(i, m, training, args, kwargs, batch) for i, m in enumerate(models)]
        except Exception as e:
            if whole:  # the capture of a module export cannot capture failed: that module is why
                raise _runs_whole(models[0], whole[0]) from e
            raise
        used = _modules_run(eps[0], whole)
        if used:
            raise _runs_whole(models[0], used[0])
        _refuse_differing_constants(eps)
        assumptions[training] = Assumptions.of(eps[0].module(), eps, models[0].forward)
        state_guards[training] = _state_guards(eps[0], models[0], args, kwargs, len(models))
        try:  # each guard reads only the forward's arguments (L['x'].size()[0] % 2 == 0)
            assumptions[training].check(args, kwargs, "train" if training else "eval")
        except Exception as e:  # noqa: BLE001 -- a guard this check cannot evaluate: nothing runs unchecked
            if isinstance(e, OutsidePaddedProgram) and e.small:  # Note [A padded program and a size of 1]
                raise UnsupportedOperationError(f"{str(e).replace('(this call: ', '(the sample: ')}. Compile with "
                                                f"a sample of 2 or more there") from e
            raise UnsupportedOperationError(
                f"wide_compiler: pad=True: export's guards on the inputs ({assumptions[training].guards}) cannot be "
                f"checked on the sample: {type(e).__name__}: {e}") from e
        while True:
            padders[training] = Padder(eps, persistent, "train" if training else "eval", prefs)
            try:
                infos[training] = padders[training].run()
                break
            except Prefer as want:
                seen = tried.setdefault(want.where, [])
                if any(torch.equal(want.layout, t) for t in seen) or len(seen) > 8:
                    raise UnsupportedOperationError(
                        f"wide_compiler: pad=True: no padding of {want.where[0]} dim {want.where[1]} suits "
                        "every op that reads it") from None
                seen.append(want.layout)
                prefs[want.where] = want.layout
    info = infos[models[0].training][0]
    for name, lay in infos[not models[0].training][0].state_layouts.items():
        other = info.state_layouts[name]
        if lay.keys() != other.keys() or not all(torch.equal(lay[d], other[d]) for d in lay):
            raise UnsupportedOperationError(
                f"wide_compiler: pad=True: {name} is padded differently in the train and eval programs")
    info.output_layouts = {t: outs for t, (_, outs) in infos.items()}
    info.state_guards = state_guards
    info.index_bounds = list({b[0]: b for pd in padders.values() for b in pd.index_bounds}.values())
    members = []
    p0 = padders[True]
    for i in range(len(models)):
        tensors = {}
        for name, t in p0.state[i].items():
            tensors[name] = info.member_padded(t.detach(), name, i).clone().requires_grad_(t.requires_grad)
        for padder in padders.values():
            for name, values in padder.buffers.items():
                tensors[name] = values[i].clone()
        members.append(PaddedMember({t: pd.gm for t, pd in padders.items()}, tensors, p0.parameters,
                                    p0.persistent, assumptions, p0.aliases).train(models[i].training))
    log.info("wide_compiler: pad=True: %d members padded to one program (%.0f%% more parameter elements)",
             len(models), 100 * info.overhead()["extra"])
    return members, info
