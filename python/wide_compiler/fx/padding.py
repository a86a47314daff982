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
stacks them like any buffer. The rule of each op is in fx/padding_rules.py; this module aligns
the members' programs, runs the rules and builds the padded members.
"""
from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.fx._pytree import tree_flatten_spec
from torch.fx.experimental.symbolic_shapes import is_concrete_int
from torch.utils._pytree import tree_flatten

from ..errors import ArchitectureMismatchError, UnsupportedOperationError, WideCompileError
from .capture import capture
from .export_watch import refuse_writing_hooks
from .member_checks import check_modes
from .padding_layouts import FREE, Prefer, flat_layout, layout_mask, prefix, same_layout, scatter
from .padding_rules import INT_ARGS_OK, MASK_UNARY, REFUSED, RULES, ZERO_UNARY, mask_unary, zero_unary
from .padding_rules_shapes import size_arith
from .source import source_line

__all__ = ["PadInfo", "PaddedMember", "pad_members"]

log = logging.getLogger(__name__)
aten = torch.ops.aten


@dataclasses.dataclass
class PadInfo:
    """What padding did (Note [Padded members]): for every state tensor and every flat output, the
    layout of each padded dim (``{dim: bool [N, max]}``); the members' true and padded shapes."""

    n: int
    state_layouts: dict[str, dict[int, torch.Tensor]]
    true_shapes: dict[str, list[tuple[int, ...]]]
    padded_shapes: dict[str, tuple[int, ...]]
    output_layouts: dict[bool, list[dict[int, torch.Tensor]]]  # training -> per flat output
    # embedding tables whose vocabulary is padded: (state name, each member's rows, padded rows)
    # (Note [Padded vocabularies] in fx/padding_rules_math.py)
    index_bounds: list[tuple[str, list[int], int]] = dataclasses.field(default_factory=list)
    # tied tensors (Note [Tied tensors when padding]): each other name -> the name that holds it
    aliases: dict[str, str] = dataclasses.field(default_factory=dict)
    # training -> the state the members' code read at capture (Guards without inputs: Note [The
    # state a padded program was captured with])
    state_guards: dict[bool, Any] = dataclasses.field(default_factory=dict)

    def check_state(self, training: bool) -> None:
        """Raise ValueError, naming what changed, when state the members' code read at capture
        (module globals, flags, torch's global hooks, the grad mode where read) is not as it was
        (Note [The state a padded program was captured with])."""
        guards = self.state_guards.get(training)
        if guards is None or guards.holds(()):
            return
        why = guards.failed(())
        if why is None:
            return
        raise ValueError(
            f"wide_compiler: pad=True: {why}. A padded model runs the members' programs as captured at "
            "compile, with the state their code read then, and it does not capture them again. What to do: "
            "compile again after such a change (wc.compile(..., pad=True)), or set the state back; members "
            "of one size (no padding) make a wide model that captures again by itself (Note [The state a "
            "padded program was captured with] in fx/padding.py)")

    def member_slice(self, t: torch.Tensor, layouts: dict[int, torch.Tensor], i: int) -> torch.Tensor:
        """Member ``i``'s own values of ``t`` (one member's padded tensor, no member dim)."""
        for d, lay in sorted(layouts.items()):
            t = t.index_select(d, lay[i].nonzero().flatten().to(t.device))
        return t

    def member_padded(self, t: torch.Tensor, name: str, i: int) -> torch.Tensor:
        """Member ``i``'s own tensor ``t`` of state ``name`` placed in its padded shape (zeros
        outside its layout)."""
        lay = self.state_layouts.get(name, {})
        return scatter(t, lay, i, self.padded_shapes[name]) if lay else t

    def mask(self, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """``[N, *padded shape]`` 0/1 values of state ``name``: 1 where a member's own values are
        (None: not padded)."""
        lay = self.state_layouts.get(name)
        if not lay:
            return None
        shape = self.padded_shapes[name]
        return layout_mask(lay, len(shape), self.n, dtype, device).expand(self.n, *shape).contiguous()

    def overhead(self) -> dict[str, float]:
        """Parameter elements: the members' own, the padded program's, and the extra fraction."""
        aliases = getattr(self, "aliases", {})
        own = sum(math.prod(s) for name, shapes in self.true_shapes.items() if name not in aliases for s in shapes)
        padded = self.n * sum(math.prod(s) for name, s in self.padded_shapes.items() if name not in aliases)
        return {"own": own, "padded": padded, "extra": padded / own - 1 if own else 0.0}


class PaddedMember(nn.Module):
    """Member ``i`` at the population's largest sizes: its own tensors, zero-padded, run through
    the padded program of its train/eval mode, shared by all members (Note [Padded members])."""

    def __init__(self, programs: dict[bool, fx.GraphModule], tensors: dict[str, torch.Tensor],
                 parameters: set[str], persistent: set[str], assumptions: dict[bool, Assumptions],
                 aliases: dict[str, str] | None = None) -> None:
        super().__init__()
        object.__setattr__(self, "_programs", programs)  # shared, not submodules
        self._assumptions = assumptions
        for name, t in tensors.items():
            *path, leaf = name.split(".")
            owner: nn.Module = self
            for part in path:
                if part not in owner._modules:
                    owner.add_module(part, nn.Module())
                owner = owner._modules[part]
            if name in parameters:
                owner.register_parameter(leaf, nn.Parameter(t, requires_grad=t.requires_grad))
            else:
                owner.register_buffer(leaf, t, persistent=name in persistent)
        for name, held in (aliases or {}).items():  # tied: the same tensor under both names (as the member)
            *path, leaf = name.split(".")
            owner = self
            for part in path:
                if part not in owner._modules:
                    owner.add_module(part, nn.Module())
                owner = owner._modules[part]
            t = self.get_parameter(held) if held in parameters else self.get_buffer(held)
            if held in parameters:
                owner.register_parameter(leaf, t)
            else:
                owner.register_buffer(leaf, t, persistent=name in persistent)

    def __getstate__(self) -> dict:
        # Note [Pickling padded members]: a GraphModule pickles as its code and is traced again when
        # loaded, which loses the in-place update of a buffer (BatchNorm's num_batches_tracked) and
        # fails on some programs (an LSTM's zeros of a symbolic size); the PaddedWideModel holding
        # this member makes the programs again from its members when it is loaded
        state = self.__dict__.copy()
        state["_programs"] = None
        return state

    def __deepcopy__(self, memo: dict) -> PaddedMember:
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():  # the programs stay shared (not pickled: above)
            new.__dict__[key] = value if key == "_programs" else copy.deepcopy(value, memo)
        return new

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._assumptions[self.training].check(args, kwargs, "train" if self.training else "eval")
        state = {**dict(self.named_parameters()), **dict(self.named_buffers())}
        return torch.func.functional_call(self._programs[self.training], state, args, kwargs)


# Note [A padded program's assumptions]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The padded program is the members' programs as export captured them from the sample: every
# input size but the batch fixed to the sample's, and the batch under the guards export derived
# (its range, and what the forward's Python asked of it: ``B % 2 == 0``). export's own check of
# those (the program's ``_guards_fn``) cannot be kept in the program (it is not picklable, and
# the padding pass rewrites the graph), so each padded member checks them before the program
# runs. Checked in Python on the sizes, they become guards of the wide graph when the wide
# compiler captures the padded members: a call outside them captures again, and that capture
# (or a plain call) fails here with what the program assumed, never running the sample's branch
# at other sizes.
class OutsidePaddedProgram(ValueError):
    """Inputs outside a padded program's assumptions; ``small``: a size 0 or 1 in a dim the
    program keeps dynamic (Note [A padded program and a size of 1])."""

    def __init__(self, message: str, small: bool = False) -> None:
        super().__init__(message)
        self.small = small


# Note [A padded program and a size of 1]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A padded program keeps the batch dynamic, and export captures a dynamic size for 2 and more only
# (0/1 specialisation): a sample with a batch of 1 is captured at a batch of 2 (fx/capture.py's
# batch_of_two), so the program's range is [2, inf]. An unpadded wide model captures another graph
# for a call of batch 1 (Note [Guards]); a padded model runs programs made once, from the members,
# and cannot. Such a call, and a batch-1 sample (which the program would not hold for), are refused
# saying so: the message before told the user to "compile with a sample of the sizes you call
# with", which is what they had done (probe 6 of issue 44, F2).


@dataclasses.dataclass
class Assumptions:
    """What a padded program assumes of its inputs (Note [A padded program's assumptions]):
    per flat input, the dims fixed at capture and the ranges of the dynamic ones; export's
    guards over the forward's arguments (``L['x'].size()[0] % 2 == 0``)."""

    in_spec: Any
    fixed: list[list[tuple[int, int]]]
    ranges: list[list[tuple[int, int, int | None]]]
    guards: list[str]
    signature: inspect.Signature

    @classmethod
    def of(cls, gm: fx.GraphModule, eps: Sequence[Any], forward: Any) -> Assumptions:
        fixed, ranges = [], []
        for node in (n for n in gm.graph.nodes if n.op == "placeholder"):
            val = node.meta.get("val")
            shape = val.shape if isinstance(val, torch.Tensor) else ()
            fixed.append([(d, int(s)) for d, s in enumerate(shape) if is_concrete_int(s)])
            ranges.append([])
            for d, s in enumerate(shape):
                vr = None if is_concrete_int(s) else eps[0].range_constraints.get(s.node.expr)
                if vr is not None:
                    lo, hi = (int(b) if b.is_Integer else None for b in (vr.lower, vr.upper))
                    ranges[-1].append((d, lo or 0, hi))
        guards: list[str] = []
        for ep in eps:
            code = getattr(ep, "_guards_code", None)
            if code is None:
                raise UnsupportedOperationError("wide_compiler: pad=True: this torch's export keeps no guard "
                                                "code, so the padded program's assumptions cannot be checked")
            guards += [c for c in code if c not in guards]
        return cls(gm._in_spec, fixed, ranges, guards, inspect.signature(forward))

    def check(self, args: tuple, kwargs: dict, mode: str) -> None:
        """Raise ValueError, naming the assumption, when the inputs are outside them."""
        try:
            flat = tree_flatten_spec((args, kwargs), self.in_spec)
        except Exception:  # noqa: BLE001 -- another structure: the program's own call says what
            return
        for k, x in enumerate(flat):
            if not isinstance(x, torch.Tensor):
                continue
            for d, size in self.fixed[k]:
                if x.dim() <= d or x.shape[d] != size:
                    self._refuse(mode, f"dim {d} of input {k} is {size} (this call: {list(x.shape)})")
            for d, lo, hi in self.ranges[k]:
                if x.dim() > d and x.shape[d] < 2 <= lo:  # Note [A padded program and a size of 1]
                    raise OutsidePaddedProgram(
                        f"wide_compiler: pad=True: dim {d} of input {k} is {int(x.shape[d])} (this call: "
                        f"{list(x.shape)}), but the padded {mode} program holds only where it is 2 or more: it "
                        f"keeps that dim dynamic, which torch.export captures for sizes of 2 and more only (a forward's test of a size 1 leaves no trace), "
                        f"and a padded model cannot capture another program for a size of 1 as an unpadded one "
                        f"does. Call it with a size of 2 or more there (compile with such a sample: the padded "
                        f"model then takes every size from 2 up); for a size of 1, compile the members without "
                        f"pad=True (their sizes must then be equal)", small=True)
                if x.dim() > d and not (x.shape[d] >= lo and (hi is None or x.shape[d] <= hi)):
                    self._refuse(mode, f"dim {d} of input {k} is in [{lo}, {hi if hi is not None else 'inf'}] "
                                       f"(this call: {list(x.shape)})")
        bound = self.signature.bind(*args, **kwargs)
        for code in self.guards:
            if not eval(code, {"__builtins__": {}}, {"L": bound.arguments}):  # noqa: S307 -- export's own guard code
                self._refuse(mode, f"{code}, with L the forward's arguments")

    @staticmethod
    def _refuse(mode: str, what: str) -> None:
        raise OutsidePaddedProgram(
            f"wide_compiler: pad=True: the padded {mode} program is the members' programs captured at the "
            f"sample's sizes and holds only where {what}. Compile with a sample of the sizes you call with "
            "(a wide model per size), or pad the inputs to the sample's sizes.")


def _hint(d: Any) -> int:
    if isinstance(d, int):
        return d
    hint = getattr(getattr(d, "node", None), "hint", None)
    if hint is None:
        raise UnsupportedOperationError(f"wide_compiler: pad=True: a size ({d}) has no value to compare")
    return int(hint)


def _shape(v: Any) -> tuple[int, ...] | None:
    return tuple(_hint(d) for d in v.shape) if isinstance(v, torch.Tensor) else None


def _size_arith(node: fx.Node) -> bool:
    """Whether ``node`` computes a size in Python (``batch * heads``: an ``operator`` call on
    symbolic sizes), which export shares between equal sizes."""
    return node.op == "call_function" and getattr(node.target, "__module__", None) in ("_operator", "operator") \
        and isinstance(node.meta.get("val"), (int, torch.SymInt))


# Note [Aligning sizes computed in Python]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Export records a size computed in Python (attention's ``batch * heads``, ``length * batch``)
# as an ``operator`` node, and shares one node between products of equal value: a member whose
# number of heads equals the sample's sequence length has ONE ``5 * batch`` where the others
# have ``2 * batch`` and ``5 * batch``. So the programs are aligned on their ATen ops (and
# placeholders, attributes, outputs), and every size node is matched through the place its
# first user reads it: member 0's size nodes are first made one per user (_unshare_sizes), so
# several of them may match one shared node of another member, and the padded program computes
# each with the largest factor (``size_arith``). Every argument is then compared as before; a
# member that reads a size where member 0 reads a product (a product by 1 left out: one head)
# is refused.


def _unshare_sizes(g: fx.Graph) -> None:
    """One copy of each size node per user (Note [Aligning sizes computed in Python])."""
    for node in [n for n in reversed(g.nodes) if _size_arith(n)]:  # a copy's arguments get a user: later
        for user in list(node.users)[1:]:
            with g.inserting_after(node):
                twin = g.call_function(node.target, node.args, node.kwargs)
            twin.meta = dict(node.meta)
            user.replace_input_with(node, twin)


def _same_place(u: fx.Node, b: fx.Node, a: fx.Node) -> Any:
    """What ``b`` (another member's node of ``u``'s op) reads where ``u`` first reads ``a``."""
    x, y = (u.args, u.kwargs), (b.args, b.kwargs)
    if len(u.args) != len(b.args):
        x, y = _full_args(u), _full_args(b)
    xs, ys = torch.utils._pytree.tree_leaves(x), torch.utils._pytree.tree_leaves(y)
    if len(xs) != len(ys):
        return None
    return next((v for w, v in zip(xs, ys) if w is a), None)


def _full_args(node: fx.Node) -> tuple[tuple, dict]:
    """An ATen call's arguments with the positional defaults its schema fills in spelled out
    (export leaves out trailing defaults: ``conv1d(x, w, b)`` for padding 0, ``conv1d(x, w, b,
    [1], [1])`` for padding 1)."""
    args, kwargs = list(node.args), dict(node.kwargs)
    if isinstance(node.target, torch._ops.OpOverload):
        for arg in node.target._schema.arguments[len(args):]:
            if arg.kwarg_only:
                break
            if arg.name in kwargs:
                args.append(kwargs.pop(arg.name))
            elif arg.has_default_value():
                args.append(arg.default_value)
            else:
                break
    return tuple(args), kwargs


# Note [Tied tensors when padding]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A tensor held under two names (an LM head tied to its embedding: ``fc.weight = e.weight``) is
# one parameter: ``named_parameters`` lists it once, under its first name, and export's program
# may read it under the other (``get_attr fc.weight``). The padding pass renames every read to
# the name that holds it, so the tensor has ONE layout that every op reading it must agree on
# (each op's rule binds or checks it, as for any parameter read twice); the padded members
# hold it under both names as the same tensor, as the member does, so the wide compiler ties it
# as for any tied model, and the state dicts carry both keys. The members must tie the same
# names (checked), else their programs differ in more than sizes.
def _tied(gms: Sequence[fx.GraphModule]) -> dict[str, str]:
    """Each member program's tied names -> the name that holds the tensor, the same for every
    member; every ``get_attr`` of such a name renamed to the holder (Note [Tied tensors when padding])."""
    found = []
    for gm in gms:
        held: dict[int, str] = {}
        aliases: dict[str, str] = {}
        for kind in (gm.named_parameters, gm.named_buffers):
            for name, t in kind(remove_duplicate=False):
                if id(t) in held and held[id(t)] != name:
                    aliases[name] = held[id(t)]
                else:
                    held.setdefault(id(t), name)
        found.append(aliases)
    for i, aliases in enumerate(found[1:], start=1):
        if aliases != found[0]:
            raise ArchitectureMismatchError(
                f"pad=True: member {i} ties {sorted(aliases.items()) or 'no tensors'} where member 0 ties "
                f"{sorted(found[0].items()) or 'no tensors'} (name, the name holding it): its program differs "
                "in more than sizes")
    for gm in gms:
        for node in gm.graph.nodes:
            if node.op == "get_attr" and node.target in found[0]:
                node.target = found[0][node.target]
    return found[0]


class _SymbolicMask(Exception):  # noqa: N818 -- raised by mask_of, turned into a refusal naming the node
    pass


class _Padder:
    """One pass over member 0's captured graph, aligned node by node with the others'."""

    def __init__(self, eps: Sequence[Any], persistent: set[str], tag: str,
                 prefs: dict[tuple[str, int], torch.Tensor]) -> None:
        self.n, self.tag, self.prefs = len(eps), tag, prefs
        # id(layout) -> (parameter, dim, f): the layout comes from that parameter dim's default
        # (a prefix), and f maps a layout wanted here to the one the parameter dim needs for it
        self.origin: dict[int, tuple[str, int, Callable[[torch.Tensor], torch.Tensor]]] = {}
        self.gms = [ep.module() for ep in eps]
        self.gm = self.gms[0]
        self.g = self.gm.graph
        self.aliases = _tied(self.gms)
        _unshare_sizes(self.g)
        # nodes[i][k]: member i's node that is member 0's k-th (Note [Aligning sizes computed in Python])
        self.nodes = [list(gm.graph.nodes) for gm in self.gms]
        self.pos = {node: k for k, node in enumerate(self.nodes[0])}
        self.state = [{**dict(gm.named_parameters()), **dict(gm.named_buffers())} for gm in self.gms]
        self.device = next(iter(self.state[0].values())).device if self.state[0] else torch.device("cpu")
        self.parameters = {name for name, _ in self.gm.named_parameters()}
        self.persistent = persistent
        self.lay: dict[fx.Node, Any] = {}
        self.state_lay: dict[str, list[Any]] = {}
        self.buffers: dict[str, torch.Tensor] = {}  # new per-member buffers: name -> [N, ...]
        self.int_diffs: dict[fx.Node, set[int]] = {}
        self.symbolic: set[int] = set()  # id(layout) of dims merged with a dynamic size
        self.index_bounds: list[tuple[str, list[int], int]] = []  # PadInfo.index_bounds
        self._check_programs()

    # ---------------------------------------------------------------- the programs agree
    def _check_programs(self) -> None:
        n0 = self.nodes[0]
        core0 = [a for a in n0 if not _size_arith(a)]
        for i, nodes in enumerate(self.nodes[1:], start=1):
            core = [b for b in nodes if not _size_arith(b)]
            if len(core) != len(core0):
                raise ArchitectureMismatchError(
                    f"pad=True: member {i} runs {len(core)} graph nodes, member 0 runs {len(core0)}: "
                    "its program differs in more than sizes")
            for a, b in zip(core0, core):
                if a.op != b.op or a.target != b.target:
                    raise ArchitectureMismatchError(
                        f"pad=True: member {i} runs {b.op} {b.target} where member 0 runs {a.op} {a.target} "
                        f"at {source_line(a)}: its program differs in more than sizes")
            aligned = dict(zip(core0, core))
            for a in reversed(n0):  # a size's users come after it: aligned already
                if not _size_arith(a):
                    continue
                user = min((u for u in a.users if u in aligned), key=self.pos.__getitem__, default=None)
                y = None if user is None else _same_place(user, aligned[user], a)
                if not (isinstance(y, fx.Node) and _size_arith(y)):
                    raise self._size_mismatch(i, a)
                aligned[a] = y
            self.nodes[i] = [aligned[a] for a in n0]
        for i, nodes in enumerate(self.nodes[1:], start=1):
            for a, b in zip(n0, nodes):
                diffs: set[int] = set()
                x, y = (a.args, a.kwargs), (b.args, b.kwargs)
                if len(a.args) != len(b.args):  # one member's call spells out a default the other's leaves out
                    x, y = _full_args(a), _full_args(b)
                self._compare(a, x, y, i, diffs, [0])
                if diffs:
                    self.int_diffs.setdefault(a, set()).update(diffs)

    def _size_mismatch(self, i: int, node: fx.Node) -> UnsupportedOperationError:
        return UnsupportedOperationError(
            f"wide_compiler: pad=True: {node.target} at {source_line(node)}: member {i} runs the same ops as "
            f"member 0 but reads a size there that it does not compute as member 0 does (one of them leaves "
            "out a product by 1: a member with one attention head has no batch * heads), so padding cannot "
            "follow it. Sweep 2 or more heads, or compile the members in groups of one size (the router "
            "does)")

    def _compare(self, node: fx.Node, x: Any, y: Any, i: int, diffs: set[int], counter: list[int]) -> None:
        if isinstance(x, fx.Node) or isinstance(y, fx.Node):
            if not (isinstance(x, fx.Node) and isinstance(y, fx.Node)) or self.nodes[i][self.pos[x]] is not y:
                if any(isinstance(v, fx.Node) and _size_arith(v) for v in (x, y)):
                    raise self._size_mismatch(i, node)
                raise ArchitectureMismatchError(
                    f"pad=True: member {i}: {node.target} at {source_line(node)} reads other values than member 0's")
            return
        if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)) and len(x) == len(y):
            for u, v in zip(x, y):
                self._compare(node, u, v, i, diffs, counter)
            return
        if isinstance(x, dict) and isinstance(y, dict) and x.keys() == y.keys():
            for k in x:
                self._compare(node, x[k], y[k], i, diffs, counter)
            return
        k = counter[0]
        counter[0] += 1
        if type(x) is int and type(y) is int:
            if x != y:
                diffs.add(k)
            return
        if type(x) is not type(y) or x != y:
            raise ArchitectureMismatchError(
                f"pad=True: member {i}: {node.target} at {source_line(node)} is called with {y!r} where "
                f"member 0 has {x!r}: only sizes may differ between padded members")

    # ---------------------------------------------------------------- shapes and layouts
    def shapes(self, node: fx.Node) -> list[tuple[int, ...]]:
        k = self.pos[node]
        return [_shape(nodes[k].meta.get("val")) for nodes in self.nodes]

    def val(self, node: fx.Node) -> Any:
        """Member 0's traced value of ``node`` (its ``meta["val"]``); a node a rule inserted in
        place of another (a norm's decomposition, a mask after) has the value of the node it
        replaces."""
        val = node.meta.get("val")
        return val if val is not None else self.nodes[0][self.pos[node]].meta.get("val")

    def max_shape(self, node: fx.Node) -> tuple[int, ...]:
        shapes = self.shapes(node)
        return tuple(max(s[d] for s in shapes) for d in range(len(shapes[0])))

    def refuse(self, node: fx.Node, why: str) -> None:
        shapes = self.shapes(node) if isinstance(node.meta.get("val"), torch.Tensor) else None
        sizes = f" (member shapes {', '.join(str(list(s)) for s in shapes)})" if shapes else ""
        raise UnsupportedOperationError(
            f"wide_compiler: pad=True: {node.target} at {source_line(node)}{sizes}: {why}. Members that "
            "differ in size are fused only where padding is exact; compile them in groups of one size "
            "(the router does), or make this size the same for all members")

    def layout(self, node: Any) -> list[Any]:
        """The node's layout, free parameter dims as their prefix (fixed from now on)."""
        if not isinstance(node, fx.Node):
            return []
        lay = self.lay.get(node)
        if lay is None:
            return [None] * len(self.max_shape(node)) if isinstance(node.meta.get("val"), torch.Tensor) else []
        if node.op == "get_attr":
            for d, v in enumerate(lay):
                if isinstance(v, str):
                    default = self.prefs.get((node.target, d))
                    if default is None:
                        default = prefix([s[d] for s in self.shapes(node)], self.max_shape(node)[d])
                    self.origin[id(default)] = (node.target, d, lambda want: want)
                    self.bind(node, d, default)
            lay = self.lay[node]
        return list(lay)

    def bind(self, node: Any, d: int, layout: torch.Tensor | None) -> None:
        """Give a parameter's free dim ``d`` the layout a consumer needs; check it otherwise."""
        if not isinstance(node, fx.Node) or node not in self.lay:
            if layout is not None:
                self.refuse(node, "a value that is the same in every member is read where a padded one is")
            return
        cur = self.lay[node][d]
        if isinstance(cur, str):
            if layout is None or layout.shape[1] != self.max_shape(node)[d] or \
                    layout.sum(1).tolist() != [s[d] for s in self.shapes(node)]:
                self.refuse(node, f"its dim {d} is read with a padding that does not fit its sizes")
            self.lay[node][d] = layout
            self.state_lay[node.target][d] = layout
        elif not same_layout(cur, layout):
            self.refuse(node, f"dim {d} is read with two different paddings")

    # ---------------------------------------------------------------- graph edits
    def buffer(self, values: torch.Tensor, near: fx.Node, *, after: bool = False) -> fx.Node:
        """A new per-member buffer (``values`` [N, ...]) read just before (or after) ``near``."""
        name = f"_wc_pad_{self.tag}{len(self.buffers)}"
        values = values.to(self.device)
        self.buffers[name] = values
        self.gm.register_buffer(name, values[0].clone(), persistent=False)
        with self.g.inserting_after(near) if after else self.g.inserting_before(near):
            return self.g.get_attr(name)

    def mask_of(self, lay: list[Any], dtype: torch.dtype) -> torch.Tensor | None:
        """[N, *shape] 0/1 values of a layout, broadcasting over unpadded dims (None: unpadded)."""
        if all(v is None for v in lay):
            return None
        if any(id(v) in self.symbolic for v in lay):
            raise _SymbolicMask
        return layout_mask({d: v for d, v in enumerate(lay) if v is not None}, len(lay), self.n, dtype)

    def call(self, target: Any, *args: Any, after: fx.Node | None = None, before: fx.Node | None = None) -> fx.Node:
        ctx = self.g.inserting_after(after) if after is not None else self.g.inserting_before(before)
        with ctx:
            return self.g.call_function(target, args)

    def mask_after(self, node: fx.Node, lay: list[Any], *, nan_safe: bool = False) -> None:
        """Zero ``node``'s result outside its layout (every later use reads the masked value): a
        multiply by the mask, or with ``nan_safe`` (a result that may be infinite there) a
        ``where`` on it."""
        val = self.val(node)
        mask = self.mask_of(lay, val.dtype if isinstance(val, torch.Tensor) else torch.float32)
        if mask is None:
            return
        users = list(node.users)
        if nan_safe:
            m = self.buffer(mask > 0, node, after=True)
            out = self.call(aten.where.ScalarOther, m, node, 0.0, after=m)
        else:
            m = self.buffer(mask, node, after=True)
            out = self.call(aten.mul.Tensor, node, m, after=m)
        for u in users:
            u.replace_input_with(node, out)
        self.lay[out], self.pos[out] = lay, self.pos[node]

    # ---------------------------------------------------------------- the pass
    def run(self) -> tuple[PadInfo, list[dict[int, torch.Tensor]]]:
        """Rewrite the program (Note [Padded members]); returns what padding did and the
        layouts of the flat outputs."""
        for node in [n for n in self.g.nodes if n.op == "call_module" and n.target == "_guards_fn"]:
            self.g.erase_node(node)  # export's input guards of member 0's sizes (and not picklable)
            self.gm.delete_submodule("_guards_fn")
        for node in list(self.g.nodes):
            if node.op == "get_attr":
                self._get_attr(node)
            elif node.op == "placeholder":
                lay = self._dims_that_differ(node)
                if any(v is not None for v in lay):
                    self.refuse(node, "the members' inputs differ in size")
                self.lay[node] = lay
            elif node.op == "call_function":
                self._call(node)
            elif node.op == "output":
                outs = []
                for leaf in torch.utils._pytree.tree_leaves(node.args[0]):
                    lay = self.layout(leaf) if isinstance(leaf, fx.Node) else []
                    outs.append({d: v for d, v in enumerate(lay) if v is not None})
                self.outputs = outs
            elif node.op == "call_module":
                self.refuse(node, "a submodule call inside the captured program")
        self.g.lint()
        self.gm.recompile()
        # pickled GraphModules are traced again on load: with the plain tracer (export's needs
        # arguments a pickle does not carry)
        self.gm._tracer_cls = self.g._tracer_cls = None
        return self._info(), self.outputs

    def _dims_that_differ(self, node: fx.Node) -> list[Any]:
        shapes = self.shapes(node)
        if shapes[0] is None:
            return []
        return [None if len({s[d] for s in shapes}) == 1 else FREE for d in range(len(shapes[0]))]

    def _get_attr(self, node: fx.Node) -> None:
        name = node.target
        if name not in self.state[0]:  # a region export captured as a graph of its own: its user's rule decides
            self.lay[node] = []
            return
        shapes = [tuple(st[name].shape) for st in self.state]
        if len({len(s) for s in shapes}) != 1:
            self.refuse(node, "the members' tensors have different numbers of dims")
        lay = [None if len({s[d] for s in shapes}) == 1 else FREE for d in range(len(shapes[0]))]
        self.lay[node] = lay
        self.state_lay[name] = lay

    def _info(self) -> PadInfo:
        state_layouts = {}
        for name in self.state[0]:
            lay = self.state_lay.get(name)
            if lay is None:  # not read by the program: prefix
                shapes = [tuple(st[name].shape) for st in self.state]
                lay = [None if len({s[d] for s in shapes}) == 1 else prefix([s[d] for s in shapes],
                       max(s[d] for s in shapes)) for d in range(len(shapes[0]))]
            for d, v in enumerate(lay):
                if isinstance(v, str):
                    shapes = [tuple(st[name].shape) for st in self.state]
                    lay[d] = prefix([s[d] for s in shapes], max(s[d] for s in shapes))
            state_layouts[name] = {d: v for d, v in enumerate(lay) if v is not None}
        true_shapes = {name: [tuple(st[name].shape) for st in self.state] for name in self.state[0]}
        padded = {name: tuple(max(s[d] for s in shapes) for d in range(len(shapes[0])))
                  for name, shapes in true_shapes.items()}
        for alias, held in self.aliases.items():  # Note [Tied tensors when padding]
            state_layouts[alias], true_shapes[alias], padded[alias] = \
                state_layouts[held], true_shapes[held], padded[held]
        return PadInfo(self.n, state_layouts, true_shapes, padded, {}, aliases=dict(self.aliases))

    # ---------------------------------------------------------------- op rules
    def _call(self, node: fx.Node) -> None:
        target = node.target
        name = target.overloadpacket.__name__ if isinstance(target, torch._ops.OpOverload) else getattr(
            target, "__name__", str(target))
        # padded inputs, without fixing a parameter's free dims (the op's rule binds them)
        in_padded = any(v is not None for a in node.all_input_nodes for v in flat_layout(self.lay.get(a)))
        out_shapes = self.shapes(node) if isinstance(node.meta.get("val"), torch.Tensor) else None
        out_padded = out_shapes is not None and len({s for s in out_shapes}) > 1
        if target is operator.getitem:
            src, k = node.args
            lay = self.lay.get(src)
            self.lay[node] = list(lay[k]) if isinstance(lay, list) and lay and isinstance(lay[0], list) \
                else self._unpadded(node)
            return
        if not in_padded and not out_padded and node not in self.int_diffs:
            self.lay[node] = self._unpadded(node)
            return
        rule = RULES.get(name)
        if not isinstance(target, torch._ops.OpOverload) and node in self.int_diffs:
            rule = size_arith
        if rule is None:
            if name in ZERO_UNARY:
                rule = zero_unary
            elif name in MASK_UNARY:
                rule = mask_unary
            else:
                self.refuse(node, REFUSED.get(name, "no padding rule for this op (its result on zero padding is not "
                                                    "known to be exact)"))
        if node in self.int_diffs and rule not in INT_ARGS_OK:
            self.refuse(node, "its integer arguments differ between members, and this op's rule pads only sizes "
                              "that follow the members' tensor sizes: an integer that is no such size (a "
                              "multiplier, a count) must be the same for every member")
        try:
            rule(self, node)
        except _SymbolicMask:
            self.refuse(node, "its padding would need a mask over a dim merged with a dynamic size (the "
                              "batch: attention folds batch * heads into one dim, and its averaged "
                              "attention weights over padded heads are such a value)")
        self._check_layout(node)

    def _unpadded(self, node: fx.Node) -> Any:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return [None] * val.dim()
        if isinstance(val, (tuple, list)):
            return [[None] * v.dim() if isinstance(v, torch.Tensor) else [] for v in val]
        return []

    def _check_layout(self, node: fx.Node) -> None:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return
        lay = self.lay[node]
        shapes = self.shapes(node)
        for d in range(len(shapes[0])):
            sizes = [s[d] for s in shapes]
            v = lay[d] if d < len(lay) else None
            if v is None:
                if len(set(sizes)) != 1:
                    self.refuse(node, f"internal: dim {d} differs between members but has no padding")
            elif v.sum(1).tolist() != sizes or v.shape[1] != max(sizes):
                self.refuse(node, f"internal: the padding of dim {d} does not match the sizes {sizes}")

    def operand_layouts(self, node: fx.Node, operands: Sequence[Any]) -> list[Any]:
        """Broadcast layouts of elementwise operands (parameters bound to the others'); None dims
        of operands that are padded elsewhere make the result dirty there (see _binary)."""
        out_rank = len(self.max_shape(node))
        result: list[Any] = [None] * out_rank
        for a in operands:  # activations first: they fix the parameters' free dims
            if not isinstance(a, fx.Node) or a.op == "get_attr":
                continue
            lay = self.layout(a)
            for d, v in enumerate(lay):
                od = out_rank - len(lay) + d
                if v is not None:
                    result[od] = v
        for a in operands:
            if isinstance(a, fx.Node) and a.op == "get_attr":
                lay = self.lay[a]
                for d, v in enumerate(lay):
                    od = out_rank - len(lay) + d
                    if isinstance(v, str):
                        if result[od] is not None:
                            self.bind(a, d, result[od])
                        else:
                            self.layout(a)
                for d, v in enumerate(self.layout(a)):
                    od = out_rank - len(self.layout(a)) + d
                    if v is not None and result[od] is None:
                        result[od] = v
        return result


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
    # program allows, and its guards say where it does not (Note [A padded program's assumptions])
    leaves = tree_flatten((args, kwargs))[0]
    batch = {k: frozenset({0}) for k, a in enumerate(leaves) if isinstance(a, torch.Tensor) and a.dim() >= 1}
    for training in (True, False):
        eps = [_capture_member(i, m, training, args, kwargs, batch) for i, m in enumerate(models)]
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
            padders[training] = _Padder(eps, persistent, "train" if training else "eval", prefs)
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
