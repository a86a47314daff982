"""WideModel: N members of one architecture as one ``nn.Module``.

The compiler (fx/pipeline.py) makes the graphs and the wide state; the model holds that state as
its parameters and buffers, runs the graph of its train/eval mode on it, answers inspection
(``summary``, ``report``, ``strategies``), exports, and gives the members back. It compiles its
other train/eval mode, or a graph for new input sizes, through one hook: :meth:`WideModel._graph_for`
(the pipeline, then :meth:`WideModel._adopt`).
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.export import ExportedProgram
from torch.fx.experimental.symbolic_shapes import is_concrete_int
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .config import WideConfig
from .errors import WideCompileError
from .measure import Stopwatch
from .fx.capture import module_path
from .fx.constants import BUFFER_ROOT, constant_key
from .fx.fold import clear_fold_cache
from .fx.guards import MAX_GRAPHS
from .fx.padding import PaddedMember
from .fx import compile_cache
from .fx.pipeline import (COMPILE_LOCK, PASSES, Compilation, compile_members, recapture, recapture_cached, run_cached,
                          run_pipeline)
from .fx.state import WideState, call_graph, holders, missing_constants, persistent_buffer_names, put_tensor
from .fx.state import get_tensor as _get_tensor
from .fx.widen import WideGraph
from .layouts import _LAYOUT_ATTR, PackedWideModel, _any_packed, layout_of, tag_layout  # noqa: F401 (old paths)
from .members import MemberOpsMixin
from .model_inputs import (  # noqa: F401 (the old import paths of the input checks)
    _describe_value,
    _fill,
    _in_order_of,
    _member_accepts,
    _member_dims,
    _narrow_ranges,
    _NewSize,
    _size_range,
    _structure_difference,
    _structure_error,
    _user_placeholders,
)

__all__ = ["WideModel"]

log = logging.getLogger(__name__)


class _Stacked(nn.Module):
    """Holds the stacked ``[N, ...]`` tensors of one original submodule, under the same names."""

    def __init__(self, original_type: str) -> None:
        super().__init__()
        self._original_type = original_type

    def extra_repr(self) -> str:
        return f"stacked {self._original_type}"


def _shared_tensors(template: nn.Module, capture_model: nn.Module) -> dict[int, torch.Tensor]:
    """A ``copy.deepcopy`` memo that gives the copy of ``template`` the capture model's tensors
    of the same names (the capture model is itself a copy of ``template``): the wide model keeps
    one copy of member 0's values, not two (GPT-2 small: 0.5 GB less). Neither copy's values are
    ever written; where a name's tensor differs (a capture form rebuilt it), it is copied."""
    memo: dict[int, torch.Tensor] = {}
    theirs = {**dict(capture_model.named_parameters(remove_duplicate=False)),
              **dict(capture_model.named_buffers(remove_duplicate=False))}
    for named in (template.named_parameters, template.named_buffers):
        for name, t in named(remove_duplicate=False):
            other = theirs.get(name)
            if (other is not None and type(other) is type(t) and other.shape == t.shape
                    and other.dtype == t.dtype and other.device == t.device):
                memo[id(t)] = other
    return memo


class WideModel(MemberOpsMixin, nn.Module):
    """N models of one architecture fused into one: member ``i`` of every input and output is
    model ``i``'s. Built by :func:`wide_compiler.compile`.

    Inputs and outputs are N-first ``[N, B, ...]``; a shared input is ``x.expand(N, *x.shape)``.
    Parameters and buffers keep their original names with a leading member dim: ``fc1.weight``
    of shape ``[N, out, in]``; ``state_dict``, ``load_state_dict``, ``.to()`` and optimizers work as
    for any module. ``train()``/``eval()`` switch between a train graph and an eval graph (export
    bakes the mode in), each captured and widened on first use. The batch is dynamic; a call with
    a new size in another dim (a sequence length, an image size) captures the graph again with
    that dim dynamic, once (Note [Dynamic sizes on demand]); ``summary()`` lists the dynamic dims.

    Example:
        >>> import torch, wide_compiler as wc
        >>> models = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU()) for _ in range(4)]
        >>> wide = wc.compile(models, torch.randn(2, 8), config=wc.WideConfig.fast())
        >>> x = torch.randn(4, 5, 8)
        >>> y = wide(x)
        >>> y.shape
        torch.Size([4, 5, 16])
        >>> torch.allclose(y[2], models[2](x[2]), atol=1e-6)
        True
        >>> wide.state_dict()["0.weight"].shape
        torch.Size([4, 16, 8])
    """

    def __init__(self, models: Sequence[nn.Module], sample_args: tuple, sample_kwargs: dict | None = None,
                 *, config: WideConfig, dynamic_shapes: Any = None) -> None:
        """Compile ``models`` (:func:`~wide_compiler.fx.pipeline.compile_members`) and hold the
        result, as :func:`wide_compiler.compile` does after checking its arguments."""
        super().__init__()
        self._hold(compile_members(models, sample_args, sample_kwargs, config=config, dynamic_shapes=dynamic_shapes))

    @classmethod
    def _from_compilation(cls, c: Compilation) -> WideModel:
        """The wide model of a first compilation (:func:`~wide_compiler.fx.pipeline.compile_members`,
        run with the members: ``c.state`` holds their stacked tensors)."""
        wide = cls.__new__(cls)
        super(WideModel, wide).__init__()
        wide._hold(c)
        return wide

    def _hold(self, c: Compilation) -> None:
        """Take the wide state (installed under the members' names) and the graph of ``c``."""
        template = c.members[0]
        self.n = c.n
        # Hidden from nn.Module registration: a structural copy of member 0 (for unfuse and for
        # capturing the graph of the other train/eval mode), the capture sample, the graphs.
        object.__setattr__(self, "_template", copy.deepcopy(template, _shared_tensors(template, c.model)))
        object.__setattr__(self, "_sample", c.sample)
        self._config = c.config
        self._dynamic_shapes = c.dynamic_shapes
        # Note [Dynamic sizes on demand]: flat input index -> dims captured dynamic beyond the
        # batch, (input, dim) -> the size that made it so, (training, input, dim) -> why the
        # forward fixes it, id(graph) -> the narrow size ranges export found for its inputs.
        self._extra_dims: dict[int, frozenset[int]] = {}
        self._grown: dict[tuple[int, int], int] = {}
        self._fixed: dict[tuple[bool, int, int], str] = {}
        self._ranges: dict[int, dict[str, tuple[tuple[int, int, int | None], ...]]] = {}
        self._graphs: dict[bool, WideGraph] = {}
        # Note [Guards] (fx/guards.py): per mode, the graphs captured for calls outside the
        # assumptions of the mode's graph (most recently captured last; at most MAX_GRAPHS - 1)
        self._variants: dict[bool, list[WideGraph]] = {}
        # Note [Per-member constants at the call]: id(graph) -> the constant buffers' versions last checked
        self._constants_seen: dict[int, tuple] = {}
        self._timings: dict[tuple[bool, str], dict[str, float] | None] = {}  # (training, node) -> ms
        self._holder_plans: dict[int, list] = {}  # id(graph) -> _holders(graph)

        # Modules with a user-registered wide form are kept whole: their wide module replaces them.
        # The capture template (registered modules opaque) captures the other mode later.
        self._registered = list(c.opaque_paths.values())
        object.__setattr__(self, "_capture_template", (c.model, c.opaque_paths))
        # Submodules in the member's order, so parameters()/state_dict() list them in its order.
        for path, mod in template.named_modules():
            if path in c.state.modules:
                parent, _, attr = path.rpartition(".")
                self._container(parent).add_module(attr, c.state.modules[path])
            elif path and self._owns(path) and (mod._parameters or mod._buffers):
                self._container(path)
        # A tensor tied inside a member is ONE stacked tensor under every name it has (WideState).
        for name, p in c.state.parameters.items():
            self._install(name, p)
        for name, b in c.state.buffers.items():
            self._install(name, b, persistent=name not in c.state.non_persistent)
        self._adopt(c)
        self._note_dtype()
        self.train(template.training)

    def _note_dtype(self) -> None:
        """Keep the parameters' dtype and device, which the inputs that follow them must have (Note
        [Guards]; the device: Note [State a forward reads] in fx/guards.py)."""
        ref = next(self.parameters(), None)
        self.__dict__["_param_dtype"] = ref.dtype if ref is not None else None
        ref = ref if ref is not None else next(self.buffers(), None)
        self.__dict__["_param_device"] = ref.device if ref is not None else None

    def _apply(self, fn: Any, recurse: bool = True) -> WideModel:
        # the per-member constants are the members' Python numbers, held in float64 (the graph casts
        # them to its input's dtype where it reads them): .to(dtype) moves them, but keeps their
        # values (a member's own .float() leaves its attribute 0.3, not 0.30000001)
        root = self._modules.get(BUFFER_ROOT)
        constants = dict(root.named_buffers()) if root is not None else {}
        out = super()._apply(fn, recurse)
        for name, was in constants.items():
            path, _, attr = name.rpartition(".")
            holder = root.get_submodule(path) if path else root
            now = holder._buffers.get(attr)
            if now is not None and now.dtype != was.dtype:
                holder._buffers[attr] = was.to(device=now.device)
        self._note_dtype()
        return out

    # -- copying and pickling: the graphs hold no parameters (those are graph inputs) ----------
    def __deepcopy__(self, memo: dict) -> WideModel:
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            if key in ("_holder_plans", "_constants_seen"):  # of this instance's tensors; the copy builds its own
                new.__dict__[key] = {}
                continue
            if key == "_graphs":
                new.__dict__[key] = dict(value)
            elif key == "_variants":
                new.__dict__[key] = {mode: list(graphs) for mode, graphs in value.items()}
            else:
                new.__dict__[key] = copy.deepcopy(value, memo)
        return new

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_graphs"] = {}  # captured and widened again on first use after unpickling
        state["_variants"] = {}
        state["_constants_seen"] = {}
        state["_holder_plans"] = {}
        state["_ranges"] = {}  # keyed by graph: computed again with the graphs
        return state

    # -- construction -----------------------------------------------------------------------
    def _container(self, path: str) -> nn.Module:
        mod: nn.Module = self
        here = ""  # the path of ``mod``'s child ``part`` (not searched for: 0.4 s of BERT-base's warm compile)
        for part in filter(None, path.split(".")):
            here = _join(here, part)
            if part not in mod._modules:
                original = self._template.get_submodule(here)
                self._check_free(mod, part, "submodule")
                mod.add_module(part, _Stacked(type(original).__name__))
            mod = mod._modules[part]
        return mod

    def _check_free(self, mod: nn.Module, name: str, what: str) -> None:
        """A member's top-level name that WideModel itself uses (``n``, ``summary``, ...) cannot
        be installed under it: refused with the fix, not PyTorch's bare KeyError."""
        if mod is self and (hasattr(type(self), name) or name in self.__dict__):
            raise WideCompileError(
                f"wide_compiler: the members' top-level {what} {name!r} has the name of a WideModel "
                f"attribute ({type(self).__name__}.{name}), under which its stacked form cannot be "
                f"installed; rename it in the model (e.g. self.{name}_ = ...)")

    def _install(self, name: str, t: torch.Tensor, *, persistent: bool = True) -> None:
        path, _, attr = name.rpartition(".")
        mod = self._container(path)
        self._check_free(mod, attr, "parameter" if isinstance(t, nn.Parameter) else "buffer")
        if isinstance(t, nn.Parameter):
            mod.register_parameter(attr, t)
        else:
            mod.register_buffer(attr, t, persistent=persistent)

    @property
    def per_member_constants(self) -> dict[str, list[float]]:
        """The module attributes that differ between members and are per member in the graph
        (Note [Per-member constants] in fx/constants.py): ``{attribute path: every member's
        value}``, read from the ``_per_member.<path>`` buffers (which the graph reads: set a member's
        values to a configuration the model was compiled for and that member changes; other values
        are refused, Note [Per-member constants at the call]). Empty when the members agree on every
        constant.

        >>> import torch, wide_compiler as wc
        >>> models = [torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(p)) for p in (0.1, 0.2)]
        >>> wide = wc.compile(models, torch.randn(3, 4), config=wc.WideConfig.fast())
        >>> wide.per_member_constants, wide.member(1)[1].p
        ({'1.p': [0.1, 0.2]}, 0.2)
        """
        out = {}
        for path in self.__dict__.get("_constants") or {}:
            out[path] = [float(v) for v in _get_tensor(self, f"_per_member.{path}").tolist()]
        return out

    def _set_member_constants(self, m: nn.Module, i: int) -> nn.Module:
        """Member ``i``'s own per-member constants on ``m`` (a copy of the template): the original
        Python value while the buffer still holds it, else the buffer's value as a float."""
        for path, values in (self.__dict__.get("_constants") or {}).items():
            value = float(_get_tensor(self, f"_per_member.{path}")[i])
            original = values[i]
            mod_path, _, key = path.rpartition(".")
            setattr(m.get_submodule(mod_path) if mod_path else m, key, original if float(original) == value else value)
        return m

    def _owns(self, name: str) -> bool:
        """Whether this model stacks ``name`` itself (not a registered module's wide form)."""
        return not any(name.startswith(p + ".") for p in self._registered)

    def _live_state(self) -> WideState:
        """This model's stacked tensors and registered wide forms (the same objects): the state a
        compilation of its other train/eval mode runs its model-level tuning check on."""
        persistent = persistent_buffer_names(self)
        buffers = {name: b for name, b in self.named_buffers(remove_duplicate=False) if self._owns(name)}
        return WideState({name: p for name, p in self.named_parameters(remove_duplicate=False) if self._owns(name)},
                         buffers, frozenset(name for name in buffers if name not in persistent),
                         {path: self.get_submodule(path) for path in self._registered})

    def _compile(self, training: bool) -> Compilation:
        """Run the compiler pipeline (fx/pipeline.py) for one train/eval mode, on this model's state."""
        ref = next(self.parameters(), None)
        return run_cached(Compilation(  # Note [The compile cache] (fx/compile_cache.py)
            self._capture_template[0].train(training), self._sample, self.n, self._config,
            dynamic_shapes=self._dynamic_shapes, opaque_paths=self._capture_template[1],
            dtype=ref.dtype if ref is not None else None, device=ref.device if ref is not None else None,
            constants=self.__dict__.get("_constants"), extra_dims=dict(self._extra_dims), state=self._live_state()))

    def _own_constant_names(self, c: Compilation) -> None:
        """A lifted constant of ``c``'s graph that has the name of one this model holds for another
        graph with other values (a graph captured for other inputs or state: ``torch.tensor(SCALE)``
        after ``SCALE`` changed, ``torch.tensor(0.1)`` in another default dtype; Note [State a
        forward reads] in fx/guards.py) is kept under a name of its own, which the graph reads."""
        from .fx.state import has_tensor

        # the constants by name: the capture's, or those a compile-cache entry came with
        constants = getattr(c.ep if c.ep is not None else getattr(c, "cached", None), "constants", None)
        for inp in c.wide.inputs if isinstance(constants, dict) else ():
            new = constants.get(inp.name) if inp.kind == "constant" else None
            if not isinstance(new, torch.Tensor) or not has_tensor(self, inp.name):
                continue
            old = _get_tensor(self, inp.name)
            if old.dtype == new.dtype and old.shape == new.shape and torch.equal(old, new.to(old.device)):
                continue
            k = 1
            while has_tensor(self, f"{inp.name}_{k}") or f"{inp.name}_{k}" in constants:
                k += 1
            name = f"{inp.name}_{k}"
            device = next((p.device for p in self.parameters()), new.device)
            self._install(name, new.detach().clone().to(device), persistent=False)
            constants[name] = new  # what a compile cache stores of this graph holds it under that name too
            inp.name = name

    def _adopt(self, c: Compilation, *, variant: bool = False) -> WideGraph:
        """Keep a compiled graph: its lifted constants become (non-persistent) buffers, and the
        ``_per_member.<path>`` buffers of Note [Per-member constants] (fx/constants.py) go under
        plain container modules. The graph becomes its mode's graph, or with ``variant`` one
        more graph of that mode for the inputs it was captured for (Note [Guards])."""
        self._own_constant_names(c)
        # a graph from the compile cache has no capture: what the model reads of it came with it
        captured = c.ep if c.ep is not None else c.cached
        for name, t, persistent, per_member in missing_constants(captured, c.constant_plan, self):
            if per_member:
                put_tensor(self, name, t, persistent)
            else:
                self._install(name, t, persistent=False)
        if c.constant_plan is not None:
            self.__dict__["_constants"] = c.constant_plan.constants
            self.__dict__["_constant_readers"] = c.constant_plan.readers
        c.wide.constant_table = c.constant_plan.table() if c.constant_plan is not None else None
        if variant:
            self._ranges[id(c.wide)] = _narrow_ranges(c.ep)
            self._variants.setdefault(c.training, []).append(c.wide)
            return c.wide
        self._timings.update({(c.training, node): t for node, t in c.timings.items()})
        old = self._graphs.get(c.training)
        if old is not None:
            self._ranges.pop(id(old), None)
        self._ranges[id(c.wide)] = _narrow_ranges(c.ep) if c.ep is not None else dict(c.cached.ranges)
        if c.cache_key is not None and c.ep is not None:  # a compile the cache missed: stored for the next
            compile_cache.store(c, c.cache_key, self._ranges[id(c.wide)])
        self._graphs[c.training] = c.wide
        log.debug("wide_compiler: wide graph:\n%s", c.wide.graph_module.code)
        return c.wide

    def _graph_for(self, training: bool) -> WideGraph:
        """The wide graph of a train/eval mode, compiled on first use (once, whatever the threads:
        a failed compile leaves nothing behind and the next call tries again)."""
        wg = self._graphs.get(training)
        if wg is None:
            with COMPILE_LOCK:
                wg = self._graphs.get(training)
                if wg is None:
                    wg = self._adopt(self._compile(training))
        return wg

    def train(self, mode: bool = True) -> WideModel:
        """Switch to the train (``mode=True``) or eval graph; the graph of a mode is captured and
        widened on the first switch to it, here rather than inside a later forward (so a forward
        under ``torch.compile(fullgraph=True)`` never has to capture)."""
        if "_graphs" in self.__dict__ and self._graphs:  # constructed (not inside __init__/unpickling)
            self._graph_for(mode)  # raises (with the mode unchanged) if that graph cannot be built
        return super().train(mode)

    # -- running ----------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling() and _any_packed(args, kwargs):
            return self.packed(*args, **kwargs)  # wide(wc.pack(xs)): WideCompiler 0.x's convention
        wg, flat = self._graph_covering(self.training, args, kwargs)
        if wg.constant_table is not None and not torch.compiler.is_dynamo_compiling():
            self._sync_constants(wg)
        return call_graph(wg, self, self._holders(wg), flat)

    # Note [Per-member constants at the call]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # The ``_per_member.<path>`` buffers are the members' constants as the graph reads them: writing
    # one (by hand, ``load_state_dict``, ``copy_member_weights``) changes that member. But an argument
    # computed from constants (``1 - p``, ``round(s, 2)``, a tensor made from one) reads a derived
    # buffer whose values came from each configuration's own trace at compile time, and only the
    # configurations traced are proved to follow the fused program (fx/constants.py). So before a
    # graph runs, when a constant buffer changed since the last call (its version counter), every
    # member's constants must be a configuration the graph was compiled for (else the call is
    # refused, naming the member and its values), and the derived buffers are set to that
    # configuration's values. A call with unchanged buffers costs one version check per attribute.
    def _sync_constants(self, wg: WideGraph) -> None:
        paths, by_key = wg.constant_table
        bufs = [_get_tensor(self, f"_per_member.{p}") for p in paths]
        seen = tuple((id(b), b._version) for b in bufs)
        if self._constants_seen.get(id(wg)) == seen:
            return
        rows = [b.detach().double().cpu().tolist() for b in bufs]
        derived: dict[str, list[float]] = {}
        for i in range(self.n):
            values = by_key.get(tuple(constant_key(float(r[i])) for r in rows))
            if values is None:
                raise ValueError(_unproved(i, paths, rows, by_key, "Set a compiled configuration"))
            for name, v in values.items():
                derived.setdefault(name, []).append(v)
        with torch.no_grad():
            for name, vals in derived.items():
                t = _get_tensor(self, name)
                new = torch.tensor(vals, dtype=t.dtype, device=t.device).view(t.shape)
                if not torch.equal(t, new):
                    t.copy_(new)
        self._constants_seen[id(wg)] = seen

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """``nn.Module.load_state_dict``, checked first (Note [Per-member constants at the call]): a
        state dict whose per-member constants give some member a configuration a graph of this
        model was not compiled for is refused before anything is loaded; so is, with ``strict``, a
        state dict whose keys are not this model's (``nn.Module`` loads every tensor it can first:
        here new weights with the old constants)."""
        if strict:
            own, given = set(self.state_dict()), set(state_dict)
            if own != given:
                raise RuntimeError(
                    f"Error(s) in loading state_dict for {type(self).__name__}: nothing was loaded: "
                    f"missing key(s): {sorted(own - given)}, unexpected key(s): {sorted(given - own)}")
        for wg in [*self._graphs.values(), *(v for vs in self._variants.values() for v in vs)]:
            if wg.constant_table is None:
                continue
            paths, by_key = wg.constant_table
            given = [state_dict.get(f"_per_member.{p}") for p in paths]
            if any(not isinstance(t, torch.Tensor) or t.shape != (self.n,) for t in given):
                continue  # not this model's constants: nn.Module's own checks say what is wrong
            rows = [t.detach().double().cpu().tolist() for t in given]
            for i in range(self.n):
                if tuple(constant_key(float(r[i])) for r in rows) not in by_key:
                    raise ValueError(_unproved(i, paths, rows, by_key, "Nothing was loaded. Load a state dict of "
                                               "compiled configurations"))
        return super().load_state_dict(state_dict, strict, assign)

    def _outside(self, wg: WideGraph, args: tuple, kwargs: dict) -> tuple[Any, _NewSize | str | None]:
        """``(flat inputs, why)``: ``why`` is None when the call is within the assumptions of
        ``wg`` (Note [Guards]), a :class:`_NewSize` when a size fixed at capture differs, else the
        guard the inputs fail. Raises ValueError for inputs no capture can take (structure, rank,
        the member count, a size outside a range the forward tests)."""
        flat = self._user_inputs(wg, args, kwargs)
        pdt, pdev = self.__dict__.get("_param_dtype"), self.__dict__.get("_param_device")
        if wg.guards is not None and wg.guards.holds(flat, pdt, pdev):  # the common case: one generated check
            return flat, None
        ranges = self._ranges.get(id(wg))
        users = (inp for inp in wg.inputs if inp.kind == "user")
        try:
            for inp, x in zip(users, flat):
                self._check_input(x, inp, ranges)
        except _NewSize as e:
            return flat, e
        return flat, wg.guards.failed(flat, pdt, pdev) if wg.guards is not None else None

    def _graph_covering(self, training: bool, args: tuple, kwargs: dict) -> tuple[WideGraph, Any]:
        """The graph of a mode whose assumptions hold for this call, and the call's flat inputs
        (Note [Guards]): the mode's graph; after a new size in a dim captured fixed, that graph
        captured again with the dim dynamic (Note [Dynamic sizes on demand]); a graph captured
        earlier for such inputs; else one captured now for them (:meth:`_capture_for`)."""
        wg = self._graph_for(training)
        flat, why = self._outside(wg, args, kwargs)
        if why is None:
            return wg, flat
        if isinstance(why, _NewSize):
            wg = self._resized(training, args, kwargs)
            flat, why = self._outside(wg, args, kwargs)
            if why is None:
                return wg, flat
        for other in reversed(self._variants.get(training, ())):
            flat, other_why = self._outside(other, args, kwargs)
            if other_why is None:
                return other, flat
        return self._capture_for(training, args, kwargs, why)

    def _capture_for(self, training: bool, args: tuple, kwargs: dict, why: Any) -> tuple[WideGraph, Any]:
        """Note [Guards]: capture this mode's graph again with member 0's slice of this call as
        the sample: the dims captured dynamic before stay dynamic (but a size 0 or 1 is captured as
        the fixed size it is), dtypes are the call's. Kept beside the mode's graph (at most
        ``MAX_GRAPHS`` per mode); strategies are the mode's graph's (nothing is measured)."""
        mode = "train" if training else "eval"
        with COMPILE_LOCK:
            for other in reversed(self._variants.get(training, ())):  # another thread captured it
                flat, other_why = self._outside(other, args, kwargs)
                if other_why is None:
                    return other, flat
            wg = self._graph_for(training)
            flat = self._user_inputs(wg, args, kwargs)
            kept = 1 + len(self._variants.get(training, ()))
            reason = str(why).removeprefix("wide_compiler: ")
            if torch.compiler.is_dynamo_compiling():
                raise ValueError(
                    f"wide_compiler: this call is outside what the {mode} graph was captured for ({reason}), "
                    "and a graph cannot be captured inside torch.compile: call the wide model (or its "
                    "check_inputs) once with such inputs before compiling")
            if kept >= MAX_GRAPHS:
                raise ValueError(
                    f"wide_compiler: this call is outside what each of the {kept} {mode} graphs of this model "
                    f"was captured for (the {mode} graph: {reason}); wide_compiler keeps at most {MAX_GRAPHS} "
                    f"graphs per mode. Call with inputs like earlier calls', or compile again with a sample "
                    f"like these inputs")
            users = [inp for inp in wg.inputs if inp.kind == "user"]
            exact = {}
            for k, (inp, x) in enumerate(zip(users, flat)):
                if isinstance(x, torch.Tensor) and inp.member_shape is not None:
                    exact[k] = frozenset(d for d, m in enumerate(inp.member_shape)
                                         if m is None and int(x.shape[d + 1]) >= 2)
            first = [x[0].detach() if isinstance(x, torch.Tensor) and x.dim() else x for x in flat]
            sample = tree_unflatten(first, wg.in_spec)
            watch = Stopwatch()
            ref = next(self.parameters(), None)
            c = Compilation(self._capture_template[0].train(training), (tuple(sample[0]), dict(sample[1])), self.n,
                            self._config.replace(tune=False), opaque_paths=self._capture_template[1],
                            exact_dims=exact, grad_enabled=torch.is_grad_enabled(),
                            dtype=ref.dtype if ref is not None else None,
                            device=ref.device if ref is not None else None,
                            constants=self.__dict__.get("_constants"), member_tile=wg.member_tile)
            try:
                recapture(c, wg)
            except Exception as e:
                raise ValueError(
                    f"wide_compiler: this call is outside what the {mode} graph was captured for ({reason}), "
                    f"and capturing the {mode} graph for these inputs failed: {type(e).__name__}: {e}") from e
            new = self._adopt(c, variant=True)
            log.warning("wide_compiler: a call outside what the %s graph was captured for (%s): captured the "
                        "%s graph for these inputs in %.1f s (%d of at most %d graphs of that mode)",
                        mode, reason, mode, watch.seconds, kept + 1, MAX_GRAPHS)
            flat, still = self._outside(new, args, kwargs)
            if still is not None:  # the capture's own guards refuse its sample: never run it
                raise ValueError(f"wide_compiler: the {mode} graph captured for this call does not hold for "
                                 f"it ({still}); please report this with the model")
            return new, flat

    def _resized(self, training: bool, args: tuple, kwargs: dict) -> WideGraph:
        """Note [Dynamic sizes on demand]: the first capture keeps only the batch dynamic (cheap,
        and what nearly every model varies). A call whose tensor differs from the captured sizes
        in another dim (a sequence length, an image size) captures this mode's graph again with
        those dims ``Dim.AUTO`` (as torch.compile's automatic dynamic does: once per dim, logged),
        and later sizes reuse it; the other mode's graph takes the dims at its next capture. When
        export still fixes such a dim, the forward fixes it (a Linear over it, a view with a
        constant): the error names the size, and where export found it when it can. Strategies
        are not measured again: ops keep the current graph's choices (by node and op), new ones
        their defaults. Under the compile lock, so two threads never build a graph twice."""
        with COMPILE_LOCK:
            wg = self._graph_for(training)
            users = [inp for inp in wg.inputs if inp.kind == "user"]
            new: dict[tuple[int, int], tuple[int, int]] = {}  # (input, dim) -> (call's size, captured)
            shapes: dict[int, list[int]] = {}
            for k, (inp, x) in enumerate(zip(users, self._user_inputs(wg, args, kwargs))):
                member = inp.member_shape
                shapes[k] = list(x.shape) if isinstance(x, torch.Tensor) else []
                if isinstance(x, torch.Tensor) and member is not None and x.dim() == len(member) + 1 \
                        and x.shape[0] == self.n:
                    new.update({(k, d): (int(x.shape[d + 1]), m) for d, m in enumerate(member)
                                if m is not None and m != x.shape[d + 1]})
            if not new:
                return wg  # another thread captured it already (or another error: the call raises it)
            for k, d in new:
                if (training, k, d) in self._fixed:
                    raise ValueError(_fill(self._fixed[(training, k, d)], shapes[k], new[(k, d)][0]))
            mode = "train" if training else "eval"
            for (k, d), (size, was) in new.items():
                log.info("wide_compiler: input '%s' dim %d is %d in this call, %d when the %s graph was "
                         "captured: capturing the %s graph again with that dim dynamic (once: later sizes "
                         "reuse it)", users[k].name, d + 1, size, was, mode, mode)
            extra = dict(self._extra_dims)
            for k, d in new:
                extra[k] = extra.get(k, frozenset()) | {d}
            ref = next(self.parameters(), None)
            watch = Stopwatch()
            c = Compilation(self._capture_template[0].train(training), self._sample, self.n,
                            self._config.replace(tune=False), dynamic_shapes=self._dynamic_shapes,
                            opaque_paths=self._capture_template[1], extra_dims=extra,
                            dtype=ref.dtype if ref is not None else None,
                            device=ref.device if ref is not None else None,
                            constants=self.__dict__.get("_constants"), member_tile=wg.member_tile)
            key, hit = recapture_cached(c, wg, self._live_state())  # Note [The compile cache]
            if hit is not None:  # stored only where every new dim came out dynamic
                c, new_items = hit, {}
            else:
                run_pipeline(c, [p for p in PASSES if p.name == "capture"])
                new_items = new
            placeholders = _user_placeholders(c.ep) if c.ep is not None else []
            fixed = {}
            for (k, d), (size, was) in new_items.items():
                val = placeholders[k].meta.get("val") if k < len(placeholders) and placeholders[k] is not None \
                    else None
                if not isinstance(val, torch.Tensor) or is_concrete_int(val.shape[d]):  # export fixed it
                    where = c.specialised.where(users[k].name, d, was) if c.specialised else ""
                    dims = _member_dims(users[k].member_shape)
                    what = (f"wide_compiler: input '{users[k].name}' has shape <<shape>>; expected N-first "
                            f"[{self.n}, {dims}]: its dim {d + 1} (dim {d} of one member's input) is "
                            f"<<size>>, but the {mode} graph of {type(self._template).__name__} has it fixed at "
                            f"capture to {was}{' (' + where + ')' if where else ''}: ")
                    if isinstance(self._template, PaddedMember):
                        what += (f"a padded model (pad=True) runs one program at the members' largest sizes, "
                                 f"made at the sample's sizes, so every size but the batch is fixed to the "
                                 f"sample's. Compile with a sample of the size you call with (a wide model "
                                 f"per size), or pad the inputs to {was}.")
                    elif _member_accepts(self._template, training, args, kwargs):
                        what += (f"each member alone accepts <<size>>, but torch.export fixes that size "
                                 f"(the shape function of an op there needs a concrete size). Compile with "
                                 f"a sample of the size you call with, or pad the inputs to {was}.")
                    else:
                        what += (f"each member takes only {was} there too (a Linear or a weight over "
                                 f"that dim, a view with a constant size...). Pass inputs with {was} there, "
                                 f"as you would to each member.")
                    what += (f" (Inputs are N-first: stack per-member inputs with wide_compiler.stack(xs), "
                             f"or share one input x with x.expand({self.n}, *x.shape).)")
                    self._fixed[(training, k, d)] = what
                    fixed[(k, d)] = _fill(what, shapes[k], size)
            if len(fixed) == len(new):
                raise ValueError(next(iter(fixed.values())))
            if hit is None:
                recapture(c, wg, captured=True)  # the old graph's strategies and tile
                if not fixed:
                    c.cache_key = key  # stored by _adopt
            for (k, d), (size, _) in new.items():
                if (k, d) not in fixed:
                    self._extra_dims[k] = self._extra_dims.get(k, frozenset()) | {d}
                    self._grown.setdefault((k, d), size)
            wg = self._adopt(c)
            log.warning("wide_compiler: recaptured the %s graph with %s dynamic in %.1f s", mode, ", ".join(
                f"input '{users[k].name}' dim {d + 1} (this call: {size}, captured: {was})"
                for (k, d), (size, was) in new.items() if (k, d) not in fixed), watch.seconds)
            if fixed:
                raise ValueError(next(iter(fixed.values())))
            return wg

    @property
    def packed(self) -> PackedWideModel:
        """This model with the channel-packed calling convention of WideCompiler 0.x: every tensor
        input ``[B, N*C, ...]`` (``pack`` of the members' inputs), every output packed the same
        way (member rank 1: ``[N*C]``; rank 0: ``[N]``). A view: it shares this model's
        parameters and mode. Calling the model itself with a tensor made by
        :func:`~wide_compiler.pack` takes this path too (outside ``torch.compile``), so 0.x code
        ``unpack(wide(pack(xs)), n)`` runs unchanged.

        >>> import torch, wide_compiler as wc
        >>> models = [torch.nn.Linear(4, 3) for _ in range(2)]
        >>> wide = wc.compile(models, torch.randn(5, 4), config=wc.WideConfig.fast())
        >>> xs = [torch.randn(5, 4) for _ in models]
        >>> outs = wc.unpack(wide.packed(wc.pack(xs)), n=2)
        >>> all(torch.allclose(o, m(x), atol=1e-6) for o, m, x in zip(outs, models, xs))
        True
        """
        return PackedWideModel(self)

    def _holders(self, wg: WideGraph) -> list:
        """Per graph input: the (module, attribute) holding its stacked tensor, or None for user
        inputs (fx/state.py's :func:`~wide_compiler.fx.state.holders`). Cached per model
        instance (copies get their own)."""
        plan = self._holder_plans.get(id(wg))
        if plan is None:
            plan = self._holder_plans[id(wg)] = holders(self, wg)
        return plan

    def _user_inputs(self, wg: WideGraph, args: tuple, kwargs: dict) -> Any:
        """The flat user inputs of a call, checked against the sample's structure."""
        if not kwargs and len(args) == wg.positional_arity and all(isinstance(a, torch.Tensor) for a in args):
            return args  # the common case: positional tensors, no pytree walk
        flat, spec = tree_flatten((args, kwargs))
        if spec != wg.in_spec:
            # keywords (and dicts inside inputs) given in another order than the sample's
            flat, spec = tree_flatten(_in_order_of(self._sample, (tuple(args), dict(kwargs))))
        if spec != wg.in_spec:
            raise ValueError(_structure_error(self._sample, (tuple(args), dict(kwargs)), self.n))
        return flat

    def check_inputs(self, *args: Any, **kwargs: Any) -> None:
        """Raise the error a call with these inputs would raise for their structure and shapes,
        without running anything (``compile(..., compile_model=True)`` runs it before the compiled
        call, so a wrong input is reported as such and not as a torch.compile failure)."""
        self._graph_covering(self.training, args, kwargs)  # captures here, in eager Python, what a call needs

    def _check_input(self, x: Any, inp, ranges: dict | None = None) -> None:
        if not isinstance(x, torch.Tensor):
            if x != inp.sample_value:
                raise ValueError(
                    f"wide_compiler: input '{inp.name}' is {x!r}, but the wide model was "
                    f"compiled with {inp.sample_value!r}: non-tensor inputs are baked into "
                    "the graph at compile time; compile again for another value")
            return
        member = inp.member_shape
        if member is None:
            return
        ok = x.dim() == len(member) + 1 and x.shape[0] == self.n and all(
            m is None or m == s for m, s in zip(member, x.shape[1:]))
        if ok and ranges and inp.name in ranges:
            for d, lo, hi in ranges[inp.name]:
                size = x.shape[d + 1]
                if size < lo or (hi is not None and size > hi):
                    raise ValueError(
                        f"wide_compiler: input '{inp.name}' dim {d + 1} is {size}, but the captured "
                        f"graph holds for sizes {_size_range(lo, hi)} there only (the forward tests "
                        f"that size: an `if` on x.shape, a table of that many rows such as a position "
                        f"embedding); each member fails or runs another branch for {size}, so the wide "
                        f"model refuses it rather than run the wrong one")
        if not ok:
            dims = _member_dims(member)
            if (self._dynamic_shapes is None and x.dim() == len(member) + 1 and x.shape[0] == self.n
                    and not torch.compiler.is_dynamo_compiling()):
                raise _NewSize(f"wide_compiler: input '{inp.name}' has shape {list(x.shape)}; "
                               f"captured as [{self.n}, {dims}]")
            hint = ""
            if x.dim() == len(member) and member and member[0] is None and x.shape[0] == self.n:
                hint = (" If the compile sample had the member dim too, compile with ONE member's "
                        "input (the sample without N).")
            raise ValueError(
                f"wide_compiler: input '{inp.name}' has shape {list(x.shape)}; expected N-first "
                f"[{self.n}, {dims}] (one member's input is [{dims}] and there are {self.n} "
                f"members; sizes given as numbers were fixed at capture by the forward's ops, "
                f"B and * are free). Stack per-member inputs with wide_compiler.stack(xs), or "
                f"share one input x with x.expand({self.n}, *x.shape).{hint}")

    def clear_caches(self) -> None:
        """Drop what the eval graph derived from this model's parameters and kept (the folded
        conv weights of Note [The fold cache] in fx/fold.py). Never needed after writes through
        autograd's view of a tensor (optimizer steps, ``load_state_dict``, ``.to()``, in-place ops
        under ``no_grad``): those are detected. Needed after writes that bypass version counters,
        such as ``param.data.mul_(2)``.

        >>> import torch, wide_compiler as wc
        >>> models = [torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)).eval() for _ in range(2)]
        >>> wide = wc.compile(models, torch.randn(1, 3, 8, 8), config=wc.WideConfig.fast())
        >>> x = torch.randn(2, 1, 3, 8, 8)
        >>> with torch.no_grad():
        ...     _ = wide(x)
        ...     _ = wide.get_parameter("0.weight").data.mul_(2)  # invisible to version counters
        ...     wide.clear_caches()
        ...     torch.allclose(wide(x)[1], wide.unfuse()[1](x[1]), atol=1e-5)
        True
        """
        clear_fold_cache(list(self.parameters()))

    # -- inspection -------------------------------------------------------------------------
    @property
    def strategies(self) -> dict[str, str]:
        """Graph node name -> strategy of every wide op (current train/eval graph)."""
        wg = self._graph_for(self.training)
        return {n.name: n.kwargs["strategy"] for n in wg.graph_module.graph.nodes if "strategy" in n.kwargs}

    def summary(self) -> str:
        """A table of the wide ops of the current graph: node, module, op, strategy, member shapes,
        measured times and why each strategy was chosen (heuristic default, measured against the
        default and the margin, cached, budget exhausted, the model-level check's verdict), under
        a line on the tuning of this graph (time spent, budget, the check's outcome)."""
        wg = self._graph_for(self.training)
        rows = [("node", "module", "wide op", "strategy", "member input", "weight", "tuned (ms)", "why")]
        for node in wg.graph_module.graph.nodes:
            if "wide_op" not in node.meta:
                continue
            shapes = node.meta.get("wide_shapes", {})
            t = self._timings.get((self.training, node.name))
            rows.append((node.name, module_path(node) or "-", node.meta["wide_op"],
                         node.kwargs.get("strategy", "-"), str(shapes.get("input", "-")),
                         str(shapes.get("weight", "-")),
                         ", ".join(f"{k} {v:.3f}" for k, v in t.items()) if t else "-",
                         node.meta.get("wide_strategy_reason")
                         or ("only strategy" if "strategy" in node.kwargs else "-")))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        n_params = sum(p.numel() for p in self.parameters())
        head = (f"WideModel: {self.n} members of {type(self._template).__name__}, "
                f"{n_params // self.n:,} parameters per member, "
                f"{'train' if self.training else 'eval'} graph, "
                f"{len(rows) - 1} wide ops, "
                f"{sum(1 for n in wg.graph_module.graph.nodes if n.meta.get('wide_layout_conversion'))} "
                f"layout conversions (see report())")
        inputs = ", ".join(f"{i.name} [{_member_dims(i.member_shape)}]" for i in wg.inputs
                           if i.kind == "user" and i.member_shape is not None)
        head += f"\ninputs (one member's; B and * are dynamic, numbers fixed): {inputs or '-'}"
        head += f"\n{self._dynamic_dims(wg)}"
        constants = self.per_member_constants
        if constants:
            readers = self.__dict__.get("_constant_readers") or {}
            head += "\nper-member constants: " + "; ".join(
                f"{p} {v} ({', '.join(readers.get(p, [])) or 'read by no op'})" for p, v in constants.items())
        budget = wg.graph_module.meta.get("wide_tuning")
        if budget is not None:
            head += f"\n{budget.describe()}"
        if wg.member_tile and (budget is None or budget.tiles is None):
            head += f"\nmember tiles: chunks of {wg.member_tile} members (Note [Member tiles])"
        return "\n".join([head, *lines])

    def _dynamic_dims(self, wg: WideGraph) -> str:
        """The summary's line naming every dynamic dim of the graph's inputs and why it is."""
        from .fx.capture import _sequence_first

        parts, batch = [], (0, 1) if _sequence_first(self._template) else (0,)
        users = [i for i in wg.inputs if i.kind == "user"]
        ranges = self._ranges.get(id(wg)) or {}
        for k, inp in enumerate(users):
            for d, m in enumerate(inp.member_shape or ()):
                if m is not None:
                    continue
                why = ("since a call with size " + str(self._grown[(k, d)])) if (k, d) in self._grown else \
                    "batch" if d in batch else "dynamic at capture"
                lim = next(((lo, hi) for dd, lo, hi in ranges.get(inp.name, ()) if dd == d), None)
                if lim is not None:
                    why += f"; sizes {_size_range(*lim)}"
                parts.append(f"{inp.name} dim {d} ({why})")
        more = ("; a new size in another dim captures the graph again with that dim dynamic, once"
                if self._dynamic_shapes is None else "; set by compile(dynamic_shapes=...)")
        return f"dynamic dims (one member's): {', '.join(parts) or 'none'}{more}"

    @property
    def fallbacks(self) -> list[dict[str, str]]:
        """Ops of the current graph that run through the per-member fallback (op, node, source,
        how: "vmap" or "loop", reason)."""
        return list(self._graph_for(self.training).fallbacks)

    def report(self) -> str:
        """What the compiler did: each wide op's strategy, every fallback with its source line, and
        the layout conversions the plan keeps."""
        wg = self._graph_for(self.training)
        lines = [self.summary(), ""]
        conversions = [n for n in wg.graph_module.graph.nodes if n.meta.get("wide_layout_conversion")]
        lines.append(f"layout conversions: {len(conversions)}")
        lines.extend(f"  {n.name}: {n.meta['wide_layout_conversion']}" for n in conversions)
        lines.append(f"fallbacks: {len(wg.fallbacks)}" + ("" if wg.fallbacks else " (every op has a wide form)"))
        for fb in wg.fallbacks:
            lines.append(f"  {fb['op']} at node '{fb['node']}' ({fb['how']}): {fb['reason']}; {fb['source']}")
        return "\n".join(lines)

    def extra_repr(self) -> str:
        return f"n={self.n}, model={type(self._template).__name__}"

    # -- deployment ---------------------------------------------------------------------------
    def export(self, path: str | os.PathLike | None = None, *args: Any, **kwargs: Any) -> ExportedProgram:
        """The eval graph of this model as a ``torch.export`` program (written to ``path`` with
        ``torch.export.save`` when given): ATen ops and the ``torch.ops.wide`` ops, the parameters
        and buffers as they are now, the batch dynamic as at compile time. The file is written
        atomically (a temporary file of an unpredictable name beside it, then renamed over
        ``path``; a symlink at ``path`` is replaced, not followed); a ``path`` that is a directory,
        or whose directory is missing or cannot be written, raises an ``OSError`` naming it.

        ``args``/``kwargs``: N-first example inputs (default: the compile sample, one copy per
        member). Traced under ``no_grad`` in eval mode (this model's mode is restored). Load it
        with ``torch.export.load(path).module()`` in a process that imported ``wide_compiler``
        (which registers the ``wide`` ops); its outputs are this model's. The program takes its
        inputs positionally: keyword inputs follow the positional ones in the sample's order
        (``torch.export`` cannot give a ``**kwargs`` forward dynamic shapes).

        >>> import torch, tempfile, os, wide_compiler as wc
        >>> models = [torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU()) for _ in range(3)]
        >>> wide = wc.compile(models, torch.randn(2, 4), config=wc.WideConfig.fast())
        >>> path = os.path.join(tempfile.mkdtemp(), "wide.pt2")
        >>> _ = wide.export(path)
        >>> x = torch.randn(3, 5, 4)                                    # another batch size
        >>> torch.allclose(torch.export.load(path).module()(x), wide.eval()(x))
        True
        """
        if not args and not kwargs:
            args, kwargs = tree_map(lambda a: a.unsqueeze(0).expand(self.n, *a.shape).clone()
                                    if isinstance(a, torch.Tensor) else a, self._sample)
        wg = self._graph_for(False)
        dims = iter([i.member_shape for i in wg.inputs if i.kind == "user"])

        def spec(a: Any) -> Any:
            member = next(dims, None) if isinstance(a, torch.Tensor) else None
            if member is None:
                return None
            return {d + 1: torch.export.Dim.AUTO for d, m in enumerate(member) if m is None} or None

        inputs = (*args, *kwargs.values())  # keywords become trailing positional inputs (see above)
        dynamic = (tuple(tree_map(spec, a) for a in inputs),)
        training = self.training
        try:
            self.eval()
            with torch.no_grad():
                ep = torch.export.export(_PositionalCall(self, list(kwargs)), inputs, dynamic_shapes=dynamic,
                                         strict=False)
        finally:
            self.train(training)
        if path is not None:  # atomically, via an unpredictable temporary name beside it
            from ._files import atomic_write

            atomic_write(path, lambda f: torch.export.save(ep, f), "wide_compiler.WideModel.export")
        return ep

    def package(self, path: str | os.PathLike, *args: Any, **kwargs: Any) -> str:
        """Compile the eval graph ahead of time with AOTInductor into a ``.pt2`` package at
        ``path`` (returned): native code for this model's device, the weights inside, the batch
        dynamic. ``args``/``kwargs`` as :meth:`export`. A C++ program runs it with
        ``torch::inductor::AOTIModelPackageLoader`` linking LibTorch and ``WideCompiler::wide``
        (the ``wide`` ops; README: "The C++ API"); Python loads it with
        ``torch._inductor.aoti_load_package``. Needs a C++ compiler (it compiles), and takes
        seconds to minutes. Wide forms registered with ``wc.register`` are traced into the
        program like every other module.

        >>> import torch, tempfile, os, wide_compiler as wc
        >>> models = [torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU()) for _ in range(3)]
        >>> wide = wc.compile(models, torch.randn(2, 4), config=wc.WideConfig.fast())
        >>> path = wide.package(os.path.join(tempfile.mkdtemp(), "wide.pt2"))  # doctest: +SKIP
        >>> loaded = torch._inductor.aoti_load_package(path)                    # doctest: +SKIP
        >>> x = torch.randn(3, 5, 4)
        >>> torch.allclose(loaded(x), wide.eval()(x))                           # doctest: +SKIP
        True
        """
        ep = self.export(None, *args, **kwargs)
        import torch._inductor  # deferred: importing inductor costs seconds

        return torch._inductor.aoti_compile_and_package(ep, package_path=os.fspath(path))

    # -- back to N models ---------------------------------------------------------------------
    def unfuse(self) -> list[nn.Module]:
        """N ordinary modules (the original class) holding copies of the members' weights and
        buffers, in this model's train/eval mode, dtype and device."""
        out = []
        registered = {p: self.get_submodule(p).unfuse() for p in self._registered}
        with torch.no_grad():
            for i in range(self.n):
                m = copy.deepcopy(self._template)
                for path, members in registered.items():
                    m.set_submodule(path, members[i])
                copies: dict[int, torch.Tensor] = {}  # ties inside the member stay tied
                for kind, named in (("_parameters", m.named_parameters), ("_buffers", m.named_buffers)):
                    for name, t in list(named(remove_duplicate=False)):
                        if not self._owns(name):
                            continue
                        if id(t) not in copies:
                            value = _get_tensor(self, name)[i].detach().clone()
                            copies[id(t)] = (nn.Parameter(value, requires_grad=t.requires_grad)
                                             if kind == "_parameters" else value)
                        path, _, attr = name.rpartition(".")
                        getattr(m.get_submodule(path), kind)[attr] = copies[id(t)]
                self._set_member_constants(m, i)
                out.append(m.train(self.training))
        return out


def _unproved(i: int, paths: list[str], rows: list[list[float]], by_key: dict, what_to_do: str) -> str:
    """The refusal of member ``i``'s constants (``rows[k][i]`` of ``paths[k]``), no configuration of
    ``by_key`` (Note [Per-member constants at the call])."""
    have = "; ".join(", ".join(f"{p} = {v[1]}" for p, v in zip(paths, key)) for key in list(by_key)[:4])
    return (f"wide_compiler: member {i}'s per-member constants ({', '.join(f'{p} = {r[i]!r}' for p, r in zip(paths, rows))}) "
            f"are not a configuration this graph was compiled for ({have}{'; ...' if len(by_key) > 4 else ''}): "
            "each configuration is traced at compile time to prove the fused program is that member's (Note "
            f"[Per-member constants]). {what_to_do}, or compile again from members with these values")


def _join(a: str, b: str) -> str:
    return f"{a}.{b}" if a else b


class _PositionalCall(nn.Module):
    """``wide(*args, **dict(zip(names, trailing)))`` with every input positional (for export)."""

    def __init__(self, wide: WideModel, names: list[str]) -> None:
        super().__init__()
        self.wide, self.names = wide, names

    def forward(self, *inputs: Any) -> Any:
        k = len(inputs) - len(self.names)
        return self.wide(*inputs[:k], **dict(zip(self.names, inputs[k:])))
