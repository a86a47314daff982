"""What padding makes (Note [Padded members] in fx/padding.py): the padded members, each holding
its own tensors at the largest sizes and running the padded program shared by all; what padding
did (:class:`PadInfo`: layouts, true and padded shapes, tied names, the state read at capture);
and what a padded program assumes of its inputs (:class:`Assumptions`), checked before each call.
"""
from __future__ import annotations

import copy
import dataclasses
import inspect
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.fx._pytree import tree_flatten_spec
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from ..errors import UnsupportedOperationError
from ..layouts import member_part
from .padding_layouts import layout_mask, scatter

__all__ = ["Assumptions", "OutsidePaddedProgram", "PadInfo", "PaddedMember"]


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
        return member_part(t, layouts, i)

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


_GUARD_NAMES = {"__builtins__": {"int": int, "float": float, "abs": abs, "min": min, "max": max, "round": round},
                "torch": torch, "math": math}


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
        arguments = dict(self.signature.bind(*args, **kwargs).arguments)
        for p in self.signature.parameters.values():  # export names a forward(*x)'s inputs x_0, x_1, ...
            if p.kind is inspect.Parameter.VAR_POSITIONAL and p.name in arguments:
                arguments.update({f"{p.name}_{k}": v for k, v in enumerate(arguments[p.name])})
            elif p.kind is inspect.Parameter.VAR_KEYWORD and p.name in arguments:
                for k, v in arguments[p.name].items():
                    arguments.setdefault(k, v)
        for code in self.guards:
            # export's own guard code: sizes, numbers and torch's symbolic helpers (torch.sym_float of a
            # size times a float: the fuzzer's generate(17, fourth=True) was refused with a NameError)
            if not eval(code, _GUARD_NAMES, {"L": arguments}):  # noqa: S307
                self._refuse(mode, f"{code}, with L the forward's arguments")

    @staticmethod
    def _refuse(mode: str, what: str) -> None:
        raise OutsidePaddedProgram(
            f"wide_compiler: pad=True: the padded {mode} program is the members' programs captured at the "
            f"sample's sizes and holds only where {what}. Compile with a sample of the sizes you call with "
            "(a wide model per size), or pad the inputs to the sample's sizes.")
