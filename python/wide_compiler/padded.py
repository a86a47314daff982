"""The wide model of members that differ in size: ``wc.compile(models, sample, pad=True)``.

Padding itself is a compiler step (fx/padding.py, Note [Padded members]); this module gives the
result its members back at their own sizes.
"""
from __future__ import annotations

import copy
import math
import re
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .errors import UnsupportedOperationError
from .fx.guards import autocast_enabled
from .fx.padded_members import PaddedMember, PadInfo
from .fx.padding import pad_members
from .fx.padding_layouts import scatter
from .layouts import mark_padded_output
from .model import WideModel

__all__ = ["PaddedWideModel"]


class _GradMask:
    """A parameter's gradient hook: zero outside each member's own values (one mask per device
    and dtype, built on first use)."""

    def __init__(self, info: PadInfo, name: str) -> None:
        self.info, self.name = info, name
        self.masks: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        key = (grad.device, grad.dtype)
        mask = self.masks.get(key)
        if mask is None:
            mask = self.masks[key] = self.info.mask(self.name, grad.dtype, grad.device)
        return grad * mask


class PaddedWideModel(WideModel):
    """A :class:`WideModel` whose members differ in size, run as one program padded to the
    largest sizes (Note [Padded members] in fx/padding.py). Member ``i`` computes exactly what
    model ``i`` computes alone; the padding stays zero in the forward, the backward and every
    optimizer step.

    Outputs whose sizes differ between members come out padded with zeros (``[N, ..., max]``):
    :meth:`member_outputs` cuts each member's own part out. :meth:`unfuse` and
    :meth:`member_state_dict` give each member at its own sizes.

    Example:
        >>> import torch, wide_compiler as wc
        >>> from torch import nn
        >>> sizes = [8, 16, 32]
        >>> models = [nn.Sequential(nn.Linear(4, h), nn.ReLU(), nn.Linear(h, 2)) for h in sizes]
        >>> wide = wc.compile(models, torch.randn(5, 4), pad=True)
        >>> x = torch.randn(3, 5, 4)
        >>> all(torch.allclose(wide(x)[i], m(x[i]), atol=1e-6) for i, m in enumerate(models))
        True
        >>> [m[0].out_features for m in wide.unfuse()]
        [8, 16, 32]
    """

    _pad: PadInfo

    @classmethod
    def _padded(cls, wide: WideModel, info: PadInfo, originals: Sequence[nn.Module]) -> PaddedWideModel:
        wide.__class__ = cls
        wide._pad = info
        object.__setattr__(wide, "_originals", [copy.deepcopy(m) for m in originals])
        wide._mask_gradients()
        return wide

    # -- the padding's gradients are masked (Note [Padded members]) ----------------------------
    def _mask_gradients(self) -> None:
        """Hook every padded parameter's gradient with its mask, once per Parameter object: run
        after anything that may replace parameters (compile, copies, pickles, ``_apply``,
        ``load_state_dict``) and, when :meth:`_hooks_stale`, at a call."""
        hooked = []  # (module holding a padded parameter, its name there, weakref to the hooked one or None)
        masked = self.__dict__.setdefault("_masked", weakref.WeakValueDictionary())  # id -> hooked: never twice
        for name, p in self.named_parameters():
            if self._pad.state_layouts.get(name):
                path, _, attr = name.rpartition(".")
                ref = None
                # not a caller's tensor (Note [Tensors of a functional_call])
                if p.requires_grad and isinstance(p, nn.Parameter):
                    if masked.get(id(p)) is not p:
                        p.register_hook(_GradMask(self._pad, name))
                        masked[id(p)] = p
                    ref = weakref.ref(p)
                hooked.append((name, self.get_submodule(path), attr, ref))
        self.__dict__["_hooked"] = hooked
        self.__dict__["_padded_buffers"] = [  # Note [Writes into the padding]: (name, owner, attribute)
            (name, self.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2])
            for name, _ in self.named_buffers() if self._pad.state_layouts.get(name)]
        # Note [The padding's own constants]: (name, owner, attribute), and their exact values
        exact = self.__dict__.setdefault("_pad_constants_exact", {})
        constants = []
        for name, b in self.named_buffers():
            path, _, attr = name.rpartition(".")
            if attr.startswith("_wc_pad_"):
                constants.append((name, self.get_submodule(path), attr))
                if name not in exact:
                    exact[name] = b.detach().to("cpu", torch.float64 if b.is_floating_point() else b.dtype, copy=True)
        self.__dict__["_pad_constants"] = constants

    def _hooks_stale(self) -> bool:
        """Whether a padded parameter was replaced (by hand) or made trainable since it was hooked:
        one dict lookup per padded parameter, at every eager call."""
        hooked = self.__dict__.get("_hooked")
        if hooked is None:
            return True
        for _, owner, attr, ref in hooked:
            p = owner._parameters.get(attr)
            if (ref() is not p) if ref is not None else (p is not None and p.requires_grad):
                return True
        return False

    # Note [Writes into the padding]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # Gradients are masked, so optimizer steps keep the padding zero; a write by hand does not:
    # population-based training's explore move (``p.add_(0.1 * torch.randn_like(p))`` over the
    # wide parameters) or a re-initialisation (``nn.init.normal_(p)``) fills the padding too, and
    # the wide model then computed what neither ``member(i)`` nor ``unfuse()`` gives (those cut each
    # member's own values out: probe 6 of issue 44, F1, 0.1-1e4 off). Buffers too: a reset of the
    # BatchNorm statistics over ``wide.buffers()`` (``running_mean.fill_(0.3)``) filled their padding,
    # which a LayerNorm or a sum over the channels then counted (probe 16, P16-7: 2.2 off), and made
    # the model's own ``state_dict()`` refused by ``load_state_dict`` (P16-6). The padding holds no
    # member's value, so at each eager call a padded parameter written since the last call (its
    # version counter moved, or its memory: ``p.data = ...``, ``vector_to_parameters``) has its
    # padding set to zero again, in place (under no_grad, as an optimizer writes): what each member
    # holds is untouched, and the wide model computes what its members do. One version read per
    # padded parameter per call; a masked fill after each step. A write through ``p.data``'s own
    # view (``p.data.add_(...)``) moves neither: ``clear_caches()`` then zeroes every padding at
    # the next call (probe 10 of issue 44, P10-6: 0.7-1.4 off after either kind of write). A
    # buffer's version moves at the graph's own updates too (running statistics, which keep the
    # padding zero): each call records its buffers' versions after it runs, so only a write in
    # between counts. ``state_dict()`` and ``export()`` zero written padding first (a state saved,
    # or a program exported, right after such a write: P16-8, P16-9), so the state loads (Note
    # [Loading a padded state]) and the program computes what the model does.
    # Not under torch.compile (a version counter cannot be read in a trace): after such a write,
    # call the model once outside torch.compile before its compiled calls.
    @torch.no_grad()
    def _zero_written_padding(self) -> None:
        """Note [Writes into the padding]."""
        seen = self.__dict__.setdefault("_padding_versions", {})
        for name, owner, attr, _ in self.__dict__["_hooked"]:
            p = owner._parameters.get(attr)
            if p is None or not isinstance(p, nn.Parameter) or seen.get(name) == (id(p), p._version, p.data_ptr()):
                continue  # (a caller's tensor: Note [Tensors of a functional_call])
            outside = self._pad.mask(name, torch.bool, p.device).logical_not_()
            p.masked_fill_(outside, 0)
            seen[name] = (id(p), p._version, p.data_ptr())
        for name, owner, attr in self.__dict__.get("_padded_buffers", ()):
            b = owner._buffers.get(attr)
            if b is None or seen.get(name) == (id(b), b._version, b.data_ptr()):
                continue
            b.masked_fill_(self._pad.mask(name, torch.bool, b.device).logical_not_(), 0)
            seen[name] = (id(b), b._version, b.data_ptr())

    def _note_buffer_versions(self) -> None:
        """Note [Writes into the padding]: the padded buffers as the call left them (its own updates
        keep their padding zero)."""
        seen = self.__dict__.setdefault("_padding_versions", {})
        for name, owner, attr in self.__dict__.get("_padded_buffers", ()):
            b = owner._buffers.get(attr)
            if b is not None:
                seen[name] = (id(b), b._version, b.data_ptr())

    def _padding_kept(self) -> None:
        """Before the padded state is read: gradient hooks on every padded parameter, padding
        written by hand zeroed (Note [Writes into the padding]) and the padding's own constants
        exact (Note [The padding's own constants])."""
        if self._hooks_stale():
            self._mask_gradients()
        self._zero_written_padding()
        self._restore_pad_constants()

    # Note [The padding's own constants]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # A padded program reads constants the padding made (Note [Padded members] in fx/padding.py):
    # each member's masks, its true counts and sizes over a padded dim, the ratios that rescale a
    # mean, the -inf that keeps the padding out of a softmax. They are buffers of the wide model
    # (``_wc_pad_<k>``, non-persistent, stacked like any buffer), so they are in ``wide.buffers()``,
    # and they followed every write and conversion: a reset of "every buffer" (``b.zero_()`` or
    # ``b.fill_(1.0)`` over ``wide.buffers()``, as for BatchNorm statistics) made every output NaN
    # or let the padding into a LayerNorm (probe 18 of issue 44, P18-1: 0.93 off), and a dtype round
    # trip (``wide.bfloat16().float()``) left the counts rounded for good (P18-4: 257 read as 256,
    # 5.5e-3 off in float32). No checkpoint restores them (they are not state). Their exact values
    # are kept when the model is made (float64, on the CPU), and before each eager call,
    # ``state_dict()`` and ``export()`` a constant that was written (its version counter, memory or
    # dtype moved) is set back to them, in its current dtype and device.
    #
    # Note [A padded reduction runs in float32 or float64]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # Those counts and ratios are floating constants that the decompositions of a norm, mean or
    # softmax over a padded dim compute with: in bfloat16 or float16 they are rounded (257 is 256
    # in bfloat16) and the statistics are computed in that dtype, where each member's own op
    # accumulates in float32 (P18-2: 50x the member's own rounding); under autocast the float32
    # constants promoted the member's bfloat16 values (P18-3: a float32 result where the member
    # returns bfloat16). A padded model with such constants refuses a call in a lower precision or
    # under autocast (before anything runs or changes) rather than return what no member computes;
    # a padded model without them (Linear, Conv, pointwise ops, sums over a padded dim) runs in
    # every dtype and under autocast as any wide model does.
    @torch.no_grad()
    def _restore_pad_constants(self) -> None:
        """Note [The padding's own constants]."""
        exact = self.__dict__.get("_pad_constants_exact", {})
        seen = self.__dict__.setdefault("_pad_constant_versions", {})
        def written(b: torch.Tensor) -> tuple:
            return id(b), b._version, b.data_ptr(), b.dtype, b.device

        for name, owner, attr in self.__dict__.get("_pad_constants", ()):
            b = owner._buffers.get(attr)
            if b is not None and name in exact and seen.get(name) != written(b):
                b.copy_(exact[name])
                seen[name] = written(b)

    def _refuse_low_precision_padding(self) -> None:
        """Note [A padded reduction runs in float32 or float64]."""
        floats = []  # a loop, not a comprehension with :=, which Dynamo cannot trace
        for _, owner, attr in self.__dict__.get("_pad_constants", ()):
            b = owner._buffers.get(attr)
            if b is not None and b.is_floating_point():
                floats.append(b)
        if not floats:
            return
        low = next((b.dtype for b in floats if b.dtype not in (torch.float32, torch.float64)), None)
        device = floats[0].device.type
        if low is None and not autocast_enabled(device):
            return
        where = f"in {low}" if low is not None else f"under {device} autocast"
        raise UnsupportedOperationError(
            f"wide_compiler: this padded model (pad=True) reduces over a padded dim (a norm, mean, softmax or max "
            f"over the members' different sizes), which it computes with each member's count and runs in float32 "
            f"or float64 only: {where} its counts and statistics would be computed in lower precision than each "
            f"member's own op, and it would return what no member computes (Note [A padded reduction runs in "
            f"float32 or float64]). Run the padded model in float32 outside autocast, or compile each width's "
            f"members without pad (one wide model per width).")

    def export(self, path: Any = None, *args: Any, **kwargs: Any) -> Any:
        self._padding_kept()  # export traces the forward, which skips it
        return super().export(path, *args, **kwargs)

    export.__doc__ = WideModel.export.__doc__

    def clear_caches(self) -> None:
        super().clear_caches()
        self.__dict__.pop("_padding_versions", None)  # Note [Writes into the padding]: all zeroed at the next call

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # the refusals under torch.compile too (traced: a changed global is a guard of Dynamo's, which
        # traces again and this raises; it ran the padded program of the old state, silently)
        self._pad.check_state(self.training)  # Note [The state a padded program was captured with]
        self._refuse_low_precision_padding()
        if torch.compiler.is_compiling():  # the hooks are in place already
            return super().forward(*args, **kwargs)
        self._padding_kept()
        swapped = self._mask_callers_tensors()
        try:
            out = super().forward(*args, **kwargs)
            self._note_buffer_versions()
            return self._tag_padded_outputs(out)
        except IndexError as e:
            better = self._index_error(e)
            if better is None:
                raise
            raise better from e
        finally:
            for owner, attr, t in swapped:
                owner._parameters[attr] = t

    def _tag_padded_outputs(self, output: Any) -> Any:
        """Mark each output tensor whose members' sizes differ with its layouts (``PADDED_OUTPUT``:
        wc.optim.member_losses cuts each member's part with them, so a loss over a padded class dim
        counts each member's own classes only; probe 13 of issue 44, P13-6). A Python attribute:
        ops on the tensor drop it."""
        layouts = self._pad.output_layouts[self.training]
        if not any(layouts):  # no output whose members' sizes differ: nothing to mark (no walk per call)
            return output
        leaves, _ = tree_flatten(output)
        for t, lay in zip(leaves, layouts):
            if isinstance(t, torch.Tensor) and lay:
                mark_padded_output(t, lay)
        return output

    # Note [Tensors of a functional_call]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # torch.func.functional_call (an ES population row, MAML's fast weights) puts the caller's
    # plain tensors where the parameters are for one call. Zeroing their padding in place and
    # hooking their gradients (Note [Writes into the padding]) wrote into the caller's tensors and
    # left hooks on them, and hooked the model's own parameters once more at each call after
    # (probe 10 of issue 44, P10-15). A tensor that is not an nn.Parameter is the caller's: for the
    # call it is replaced by a copy with zero padding (out of place, so its gradient in the padding
    # is zero as the hook's would be) and put back after; a Parameter is hooked once, ever.
    def _mask_callers_tensors(self) -> list[tuple[nn.Module, str, torch.Tensor]]:
        swapped = []
        for name, owner, attr, _ in self.__dict__["_hooked"]:
            t = owner._parameters.get(attr)
            if t is None or isinstance(t, nn.Parameter):
                continue
            inside = self._pad.mask(name, torch.bool, t.device)
            owner._parameters[attr] = t.where(inside, torch.zeros((), dtype=t.dtype, device=t.device))
            swapped.append((owner, attr, t))
        return swapped

    def _index_error(self, e: IndexError) -> IndexError | None:
        """The wide lookup's IndexError said in the member's terms: its own table and index
        (Note [Padded vocabularies] in fx/padding_rules_math.py); None when ``e`` is another error."""
        bounds = getattr(self._pad, "index_bounds", [])
        hit = re.search(r"index (-?\d+) of member (\d+) is not in the valid range \[0, (\d+)\)", str(e))
        if not bounds or hit is None:
            return None
        x, i, rows = (int(g) for g in hit.groups())
        tables = [(name, sizes) for name, sizes, most in bounds if most == rows]
        if not tables:
            return None
        own = x - rows if x >= rows and len(tables) == 1 else x
        names = " or ".join(f"{name!r} ({sizes[i]} rows)" for name, sizes in tables)
        return IndexError(
            f"wide_compiler: pad=True: member {i}: index {own} is out of range for its own embedding table "
            f"{names} (index out of range in self): model {i} alone raises IndexError here too; the padded "
            f"table has {rows} rows, and an index past the member's own rows is refused, not read as a zero "
            "row")

    def _apply(self, fn: Any, recurse: bool = True) -> PaddedWideModel:
        for m in self.__dict__.get("_originals", ()):  # our copies: member(i) and the padded programs follow
            m._apply(fn, recurse)
        out = super()._apply(fn, recurse)
        self._mask_gradients()
        return out

    def _recapture_in(self, before: torch.dtype, after: torch.dtype) -> None:
        """Note [A graph runs in the dtype it was captured in], for padded members: the padded
        programs the capture template runs are captures of the members too, in the old dtype (a
        zero state a recurrent layer makes holds it: every call then failed inside the graph, probe
        14 of issue 44, P14-2), so they are made again from the (converted) members first."""
        def cast(x: Any) -> Any:
            return x.to(after) if isinstance(x, torch.Tensor) and x.dtype == before else x

        args, kwargs = tree_map(cast, self._sample)
        members, info = pad_members(self._originals, tuple(args), dict(kwargs))
        self._pad.state_guards = info.state_guards
        for t in (self._template, self._capture_template[0]):
            if isinstance(t, PaddedMember):
                object.__setattr__(t, "_programs", members[0]._programs)
                t._assumptions = members[0]._assumptions
        super()._recapture_in(before, after)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """``nn.Module.load_state_dict``, checked first (Note [Loading a padded state]): a state
        dict of other member sizes, or one whose padding is not zero, is refused before anything
        changes."""
        out = super().load_state_dict(state_dict, strict=strict, assign=assign)
        self._mask_gradients()
        return out

    # Note [Loading a padded state]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # A padded model's ``state_dict`` holds each member's tensors at the largest sizes, zero
    # outside the member's own values. Loaded as it is, a state dict of a population of other
    # member sizes (even one with the same padded shapes: sizes (3, 6) and (6, 3)) or one with
    # non-zero padding would make the wide model compute what neither ``member(i)`` nor
    # ``unfuse()`` does (those cut each member's own values out). So ``state_dict`` records the
    # members' own shapes in the state dict's metadata (``_metadata[prefix]``, kept by
    # ``torch.save``), and loading checks, before anything is written: those shapes when
    # recorded, the padded shapes, and that every padded tensor is zero outside each member's
    # own values. ``_load_from_state_dict`` runs for this module before its submodules load, so
    # the check also guards a padded model loaded as a submodule of a larger one.
    _SIZES = "wide_compiler.pad.member_shapes"

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        if "_hooked" in self.__dict__:
            self._zero_written_padding()  # Note [Writes into the padding]: the state as the next call sees it
        super()._save_to_state_dict(destination, prefix, keep_vars)
        meta = getattr(destination, "_metadata", None)
        if meta is not None:
            meta.setdefault(prefix[:-1], {})[self._SIZES] = {
                name: [list(s) for s in shapes] for name, shapes in self._pad.true_shapes.items()}

    def _load_from_state_dict(self, state_dict: Mapping[str, Any], prefix: str, local_metadata: dict,
                              strict: bool, missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
        self._check_padded_state(state_dict, prefix, local_metadata)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    @torch.no_grad()
    def _check_padded_state(self, state_dict: Mapping[str, Any], prefix: str, metadata: dict) -> None:
        """Note [Loading a padded state]: raise ValueError naming the tensor and the member when
        ``state_dict`` is not a state of this model's member sizes with zero padding."""
        what = "wide_compiler: PaddedWideModel.load_state_dict" + (f" (at {prefix[:-1]!r})" if prefix else "")
        how = ("load each member at its own size instead (load_member_state_dict(i, sd), "
               "wide_compiler.distributed.load_members), or compile a model of the same member sizes")
        info = self._pad
        saved = metadata.get(self._SIZES) if isinstance(metadata, Mapping) else None
        if isinstance(saved, Mapping):
            for name, shapes in info.true_shapes.items():
                theirs = saved.get(name)
                if theirs is None or prefix + name not in state_dict:
                    continue
                ours = [list(s) for s in shapes]
                if len(theirs) != len(ours):
                    raise ValueError(f"{what}: the state dict is of {len(theirs)} members, this model has "
                                     f"{len(ours)}")
                bad = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if list(a) != b), None)
                if bad is not None:
                    raise ValueError(
                        f"{what}: the state dict was saved from a padded model whose member {bad} has "
                        f"{name!r} of shape {list(theirs[bad])}; this model's member {bad} has {ours[bad]}. "
                        f"Its values would land in other positions than member {bad}'s own: {how}")
        for name, lay in info.state_layouts.items():
            key = prefix + name
            v = state_dict.get(key)
            if not lay or not isinstance(v, torch.Tensor) or v.is_meta:
                continue
            want = (self.n, *info.padded_shapes[name])
            if tuple(v.shape) != want:
                raise ValueError(f"{what}: {key!r} has shape {list(v.shape)}, this model's is {list(want)} "
                                 f"(its {self.n} members at the largest sizes): a state of other member sizes; "
                                 f"{how}")
            inside = info.mask(name, torch.float32, v.device) > 0
            outside = v.ne(0) & ~inside
            if bool(outside.any()):
                bad = int(outside.flatten(1).any(1).nonzero()[0])
                raise ValueError(
                    f"{what}: {key!r} is not zero in the padding of member {bad} (outside its own "
                    f"{list(info.true_shapes[name][bad])}): a padded model's state keeps the padding zero, so "
                    "this one is of other member sizes or was changed by hand, and loading it would make "
                    f"the wide model compute what neither member({bad}) nor unfuse() does; {how}")

    def __deepcopy__(self, memo: dict) -> PaddedWideModel:
        new = super().__deepcopy__(memo)
        new.__dict__.pop("_masked", None)  # the copy's parameters have no hooks yet
        new._mask_gradients()
        return new

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.pop("_hooked", None)  # weak references: registered again on load
        state.pop("_masked", None)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._make_programs()
        self._mask_gradients()

    def _make_programs(self) -> None:
        """The padded programs of the member templates, made again from the members (Note
        [Pickling padded members] in fx/padded_members.py): the same capture and padding as at compile."""
        templates = [t for t in (self._template, self._capture_template[0])
                     if isinstance(t, PaddedMember) and t.__dict__.get("_programs") is None]
        if not templates:
            return
        args, kwargs = self._sample
        members, info = pad_members(self._originals, tuple(args), dict(kwargs))
        fresh = members[0]
        self._pad.state_guards = info.state_guards  # the state these programs were captured with
        for t in templates:
            object.__setattr__(t, "_programs", fresh._programs)
            t._assumptions = fresh._assumptions

    def member_state_dict(self, i: int) -> dict[str, torch.Tensor]:
        """Member ``i``'s ``state_dict`` at its own sizes (copies), loadable into model ``i``."""
        i = self._check_member_index(i)
        with torch.no_grad():
            return {name: self._pad.member_slice(self._stacked(name)[i], self._pad.state_layouts.get(name, {}), i).clone()
                    for name in self._originals[i].state_dict()}

    @torch.no_grad()
    def _load_member_state_dict(self, i: int, state_dict: Mapping[str, torch.Tensor], label: str) -> None:
        """Load member ``i`` from a ``state_dict`` of its own model (its own sizes); strict, and
        checked before anything changes; the padding stays zero. (``load_member_state_dict`` and
        checkpoints come here.)"""
        name = "wide_compiler.load_member_state_dict"
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"{name}: {label}: expected a state_dict, got a {type(state_dict).__name__}")
        want = self._originals[i].state_dict()
        missing, extra = sorted(set(want) - set(state_dict)), sorted(set(state_dict) - set(want))
        if missing or extra:
            raise KeyError(f"{name}: {label}: missing keys {missing}, unexpected keys {extra}")
        for k, v in state_dict.items():
            if not isinstance(v, torch.Tensor) or v.shape != want[k].shape:
                raise ValueError(f"{name}: {label}: {k!r} must be a tensor of shape {list(want[k].shape)} "
                                 "(the member's own size)")
            if not torch.can_cast(v.dtype, self._stacked(k).dtype):
                raise TypeError(f"{name}: {label}: {k!r} is {v.dtype}, which does not cast safely to "
                                f"{self._stacked(k).dtype}")
        for k, v in state_dict.items():
            target = self._stacked(k)
            target[i].copy_(self._pad.member_padded(v.to(target.device, target.dtype), k, i))

    def _param_names(self, optimizer: Any) -> list[str]:
        names = {id(p): name for name, p in self.named_parameters()}
        params = [p for g in optimizer.param_groups for p in g["params"]]
        missing = [k for k, p in enumerate(params) if id(p) not in names]
        if missing:
            raise ValueError(f"wide_compiler: the optimizer's parameters {missing} are not this padded "
                             "model's")
        return [names[id(p)] for p in params]

    def _map_optimizer_state(self, optimizer: Any, i: int, osd: dict, to_own: bool) -> dict:
        names = self._param_names(optimizer)
        state = {}
        for pid, st in osd.get("state", {}).items():
            name = names[pid]
            lay = self._pad.state_layouts.get(name, {})
            state[pid] = {key: (self._pad.member_slice(v, lay, i) if to_own else self._pad.member_padded(v, name, i))
                          if isinstance(v, torch.Tensor) and v.dim() and lay else v for key, v in st.items()}
        return {**osd, "state": state}

    def member_optimizer_state_dict(self, optimizer: Any, i: int) -> dict:
        """Member ``i``'s state in ``optimizer`` (a ``wc.optim`` optimizer over this model's
        parameters) at the member's own sizes: the ``state_dict`` of a ``torch.optim`` optimizer
        over model ``i``'s parameters (checkpoints save this)."""
        i = self._check_member_index(i)
        return self._map_optimizer_state(optimizer, i, optimizer.member_state_dict(i), to_own=True)

    def padded_optimizer_state_dict(self, optimizer: Any, i: int, state_dict: dict) -> dict:
        """The inverse of :meth:`member_optimizer_state_dict`: member ``i``'s optimizer state at
        its own sizes, placed in the padded shapes ``optimizer`` holds (zeros in the padding)."""
        i = self._check_member_index(i)
        return self._map_optimizer_state(optimizer, i, state_dict, to_own=False)

    @torch.no_grad()
    def write_back(self, models: Sequence[nn.Module]) -> None:
        """Copy every member's weights and buffers, at its own sizes, into ``models[i]`` IN
        PLACE (the modules keep their identity); everything is checked before anything is written.
        (Padded members share every Python constant: members whose constants differ are refused
        at compile, so there is none to write.)"""
        self._write_back_checked(models)()

    def _write_back_checked(self, models: Sequence[nn.Module]) -> Callable[[], None]:
        """:meth:`write_back` checked (nothing written), the write returned (WideModel's)."""
        models = list(models)
        if len(models) != self.n:
            raise ValueError(f"wide_compiler.write_back: expected {self.n} modules (one per member), got {len(models)}")
        states = [self.member_state_dict(i) for i in range(self.n)]
        for i, (m, sd) in enumerate(zip(models, states)):
            own = m.state_dict(keep_vars=True)
            for k, v in sd.items():
                if k not in own or own[k].shape != v.shape:
                    raise ValueError(f"wide_compiler.write_back: member {i} ({type(m).__name__}) has no {k!r} of "
                                     f"shape {list(v.shape)} (its own size)")
        constants = self._constants_to_write(models, "wide_compiler.write_back")

        @torch.no_grad()
        def write() -> None:
            for m, sd, values in zip(models, states, constants):
                own = m.state_dict(keep_vars=True)
                for k, v in sd.items():
                    own[k].copy_(v)
                for path, value in values.items():
                    mod_path, _, key = path.rpartition(".")
                    setattr(m.get_submodule(mod_path) if mod_path else m, key, value)

        return write

    def member(self, i: int) -> nn.Module:
        """Member ``i`` as an ordinary module of its own class and sizes (a copy)."""
        return self._member_module(self._check_member_index(i))

    def copy_member_weights(self, src: int, dst: int, optimizer: Any = None) -> None:
        """As :meth:`WideModel.copy_member_weights`, for two members of the same sizes (a member
        of another size has other shapes: refused)."""
        s, d = self._check_member_index(src), self._check_member_index(dst)
        for name, shapes in self._pad.true_shapes.items():
            lay = self._pad.state_layouts.get(name, {})
            if shapes[s] != shapes[d] or any(not torch.equal(v[s], v[d]) for v in lay.values()):
                raise ValueError(f"wide_compiler.copy_member_weights: members {s} and {d} differ in size "
                                 f"({name}: {list(shapes[s])} vs {list(shapes[d])})")
        super().copy_member_weights(s, d, optimizer)

    def member_tensors(self, i: int) -> dict[str, torch.Tensor]:
        """Member ``i``'s parameters and buffers at its own sizes as VIEWS of the wide tensors
        (gradients and in-place updates reach the wide model), for running the member alone with
        ``torch.func.functional_call`` on its own module. A tensor whose own values are not one
        run of positions in each dim (a concatenation of padded parts; a kernel centred in the
        largest is one run) comes as a copy; a buffer of that kind in training mode is refused,
        since its in-place updates would be lost."""
        i = self._check_member_index(i)
        params = {name for name, _ in self.named_parameters()}
        out = {}
        for name in (*dict(self._originals[i].named_parameters()), *dict(self._originals[i].named_buffers())):
            t = self._stacked(name)[i]
            lay = self._pad.state_layouts.get(name, {})
            sizes = {d: int(v[i].sum()) for d, v in lay.items()}
            starts = {d: int(v[i].long().argmax()) for d, v in lay.items()}
            if all(bool(v[i][starts[d]: starts[d] + sizes[d]].all()) for d, v in lay.items()):
                for d, k in sizes.items():
                    t = t.narrow(d, starts[d], k)
            elif self.training and name not in params:
                raise ValueError(f"wide_compiler: member {i} alone: buffer {name!r} is padded in pieces, so it "
                                 "cannot be updated in place from a member-only call; run the whole group")
            else:
                t = self._pad.member_slice(t, lay, i)
            out[name] = t
        return out

    def member_outputs(self, output: Any) -> list[Any]:
        """Each member's own output, at its own sizes, from a wide output (``wide(x)``)."""
        leaves, spec = tree_flatten(output)
        layouts = self._pad.output_layouts[self.training]
        if len(layouts) != len(leaves):
            raise ValueError(f"member_outputs: expected the {len(layouts)} outputs of this model's "
                             f"{'train' if self.training else 'eval'} graph, got {len(leaves)}")
        return [tree_unflatten([self._pad.member_slice(t[i], lay, i) if isinstance(t, torch.Tensor) else t
                                for t, lay in zip(leaves, layouts)], spec) for i in range(self.n)]

    def member_padded(self, i: int, t: torch.Tensor, *, state: str | None = None, output: int | None = None,
                      training: bool | None = None) -> torch.Tensor:
        """Member ``i``'s own tensor ``t`` placed in its padded shape, zeros outside its own values:
        a value of state tensor ``state`` (a weight, its gradient, a buffer), or flat output leaf
        ``output`` of the ``training`` graph (default: this model's mode). The inverse of
        :meth:`member_tensors` and :meth:`member_outputs` for one member; ``wc.testing`` compares a
        padded model with its members this way (the padding must come out zero too).

        Example:
            >>> import torch, wide_compiler as wc
            >>> ms = [torch.nn.Linear(4, h) for h in (2, 3)]
            >>> wide = wc.compile(ms, torch.randn(5, 4), pad=True, config=wc.WideConfig.fast())
            >>> wide.member_padded(0, ms[0](torch.ones(5, 4)), output=0).shape
            torch.Size([5, 3])
        """
        i = self._check_member_index(i)
        if (state is None) == (output is None):
            raise ValueError("member_padded: give one of state= (a state tensor's name) or output= (a flat "
                             "output index)")
        if state is not None:
            if state not in self._pad.true_shapes:
                raise KeyError(f"member_padded: this padded model has no state tensor {state!r}")
            return self._pad.member_padded(t, state, i)
        layouts = self._pad.output_layouts[self.training if training is None else training]
        if not 0 <= output < len(layouts):
            raise IndexError(f"member_padded: output {output} of a graph with {len(layouts)} flat outputs")
        lay = layouts[output]
        if not lay:
            return t
        for d, where in lay.items():  # a member's output at other sizes than the sample's (the fuzzer's fourth stream)
            own = int(where[i].sum())
            if d >= t.dim() or t.shape[d] != own:
                raise ValueError(
                    f"wide_compiler: member_padded: member {i}'s output {output} has shape {list(t.shape)}; the "
                    f"padded model's output {output} holds {own} of member {i}'s values in dim {d} (its sizes at the "
                    "compile sample): a padded model runs at the sample's sizes but the batch, so an output of "
                    "other sizes has no place in it")
        return scatter(t, lay, i, tuple(lay[d].shape[1] if d in lay else n for d, n in enumerate(t.shape)))

    def unfuse(self) -> list[nn.Module]:
        """N ordinary modules, each of its own model's class and sizes, holding copies of the
        member's weights and buffers, in this model's train/eval mode, dtype and device."""
        return [self._member_module(i) for i in range(self.n)]

    def _member_module(self, i: int) -> nn.Module:
        m = copy.deepcopy(self._originals[i])
        sd = self.member_state_dict(i)
        ref = next((t for t in sd.values() if t.is_floating_point()), None)
        if ref is not None:
            m.to(device=ref.device, dtype=ref.dtype)
        m.load_state_dict(sd)
        return m.train(self.training)

    def summary(self) -> str:
        """:meth:`WideModel.summary`, then the padding overhead: in all and per padded tensor
        (the extra elements of a weight are the extra multiply-adds of the op that reads it)."""
        info = self._pad
        o = info.overhead()
        lines = [f"padded members: {o['own']:,} parameter and buffer elements of their own, {o['padded']:,} "
                 f"padded (+{100 * o['extra']:.0f}%)"]
        for name, lay in info.state_layouts.items():
            if not lay or name in getattr(info, "aliases", {}):  # a tied tensor: listed under its holder
                continue
            own = sum(math.prod(s) for s in info.true_shapes[name])
            padded = self.n * math.prod(info.padded_shapes[name])
            sizes = sorted({tuple(s) for s in info.true_shapes[name]})
            lines.append(f"  {name} {list(info.padded_shapes[name])} (members {', '.join(map(str, map(list, sizes)))}): "
                         f"+{100 * (padded / own - 1):.0f}% elements and work")
        return "\n".join([super().summary(), *lines])
