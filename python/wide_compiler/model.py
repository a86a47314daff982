"""WideModel: N members of one architecture as one ``nn.Module``.

The compiler (fx/pipeline.py) makes the graphs and the wide state; the model holds that state as
its parameters and buffers, runs the graph of its train/eval mode on it, answers inspection
(``summary``, ``report``, ``strategies``), exports, and gives the members back. It compiles its
other train/eval mode, or a graph for new input sizes, through one hook: :meth:`WideModel._graph_for`
(the pipeline, then :meth:`WideModel._adopt`).

Here: holding the state and adopting graphs, running, ``unfuse``. Mixed in, each in a module of its
own: the graph of a call and the graphs captured for new inputs (model_calls.py, Note [Dynamic
sizes on demand]), the per-member constants at the call (model_constants.py), inspection
(model_inspection.py), ``export``/``package`` (model_export.py), and the per-member operations
(members.py).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import sys
import threading
import types
import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from .config import WideConfig
from .errors import UnsupportedOperationError, WideCompileError
from .fx.constants import BUFFER_ROOT
from .fx.fold import clear_fold_cache
from .fx.compilation import COMPILE_LOCK, Compilation
from .fx.member_checks import parameter_hook_refusal
from .fx.state import WideState, call_graph, holders, missing_constants, persistent_buffer_names, put_tensor
from .fx.state import get_tensor as _get_tensor
from .layouts import _LAYOUT_ATTR, PackedWideModel, _any_packed, layout_of, tag_layout  # noqa: F401 (old paths)
from .members import MemberOpsMixin
from .model_calls import CallGraphsMixin, traced_here
from .model_constants import MemberConstantsMixin
from .model_deferred import Deferred, DeferredCompileMixin
from .model_export import DeploymentMixin
from .model_inspection import InspectionMixin
from .model_tuning import DeferredTuningMixin, defer_tuning, pending_runs
from .registry import template_tensors
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

if TYPE_CHECKING:
    from .fx.widen import WideGraph

__all__ = ["WideModel"]

log = logging.getLogger(__name__)


class _Stacked(nn.Module):
    """Holds the stacked ``[N, ...]`` tensors of one original submodule, under the same names."""

    def __init__(self, original_type: str) -> None:
        super().__init__()
        self._original_type = original_type

    def extra_repr(self) -> str:
        return f"stacked {self._original_type}"

    def train(self, mode: bool = True) -> _Stacked:
        """Set by the wide model's ``train()``/``eval()`` only: the wide model runs one graph per
        mode for all its modules, so ``wide.bn.eval()`` under ``wide.train()`` (a frozen BatchNorm)
        would change nothing but this flag; it warns and leaves the mode as it is (probe 17 of
        issue 44, P17-3: the flag read False while the train graph updated the statistics)."""
        if mode != self.training and not getattr(_SETTING_MODE, "on", False):
            warnings.warn(
                f"wide_compiler: {'train' if mode else 'eval'}() on a stacked {self._original_type} of a wide "
                f"model changes nothing: the wide model runs one graph per mode, for all its modules "
                f"(wide.train() / wide.eval()). Set a submodule's mode on the members before compiling (a "
                f"member whose {self._original_type} is in another mode than the member is refused where "
                f"its code reads the mode), or use wide.member(i) / unfuse()", UserWarning,
                stacklevel=3 if sys._getframe(1).f_code.co_name == "eval" else 2)  # the user's line
            return self
        return super().train(mode)


_SETTING_MODE = threading.local()  # inside a wide model's own train(): _Stacked.train sets its flag


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


@contextlib.contextmanager
def outside_inference_mode() -> Iterator[None]:
    """Build a wide model's state outside ``torch.inference_mode`` (grad mode kept as it is): the
    stacked parameters, buffers and constants made inside it would be inference tensors, which
    autograd refuses to save, so a model compiled there could never train (probe 5 of issue 44,
    F16: torch's "Inference tensors cannot be saved for backward" at the first train call)."""
    if not torch.is_inference_mode_enabled():
        yield
        return
    grad = torch.is_grad_enabled()  # inference_mode(False) enables gradients: put back as they were
    with torch.inference_mode(False), torch.set_grad_enabled(grad):
        yield


# Note [Global module hooks run on the members, not on the wide model]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch's global module hooks (``torch.nn.modules.module.register_module_forward_hook`` and
# ``_pre_hook``, the backward ones) run on every module call. The capture ran member 0 with them,
# so their effect on the members' modules is in the graph already (and guarded: Note [State a
# forward reads] in fx/state_reads.py). Run again on the WideModel's own call, and on the fx
# graph module it calls inside, they would apply a second time, and to the stacked parameters the
# graph module takes as inputs: an ``o * 2`` hook doubled the outputs again, a pre-hook scaling
# every tensor argument scaled the parameters, one returning ``(args[0] * 1.5,)`` dropped the
# graph's other inputs (probe 5 of issue 44, F6). So the wide model's call runs torch's own
# ``Module._call_impl`` with the global hook tables empty (the same code object over a copy of its
# module's globals, ``_CALL_WITHOUT_GLOBAL_HOOKS``): the hooks a user registered on the wide model
# itself (``wide.register_forward_hook``) still run, as on any module; and the graph module is
# called through its ``forward`` (fx/state.py's ``call_graph``), which runs no hooks. A registered
# module's wide form is the user's own module, and runs them as any module does.
_GLOBAL_CALL_HOOKS = ("_global_backward_pre_hooks", "_global_backward_hooks", "_global_forward_pre_hooks",
                      "_global_forward_hooks", "_global_forward_hooks_always_called",
                      "_global_forward_hooks_with_kwargs")
_CALL_WITHOUT_GLOBAL_HOOKS = types.FunctionType(
    nn.Module._call_impl.__code__,
    {**vars(sys.modules[nn.Module.__module__]), **{name: {} for name in _GLOBAL_CALL_HOOKS}},
    "_call_impl", nn.Module._call_impl.__defaults__, nn.Module._call_impl.__closure__)


def _global_hooks_on(module: types.ModuleType = sys.modules[nn.Module.__module__]) -> bool:
    """Whether any of torch's global forward/backward module hooks is registered (read by name
    at each call: code that clears them may rebind the tables)."""
    for name in _GLOBAL_CALL_HOOKS:
        if getattr(module, name):
            return True
    return False


# Note [A graph runs in the dtype it was captured in]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A capture traces the forward with the parameters' dtype as it was: a branch on ``x.dtype`` or
# on a weight's dtype, a ``torch.zeros(..., dtype=x.dtype)``, an ``x.to(self.fc.weight.dtype)``
# are baked into the graph. So after ``wide.to(dtype)`` / ``.double()`` / ``.half()`` changed the
# parameters' dtype, no graph captured before may run: every graph is dropped and the mode's graph
# captured again (``WideModel._apply``), with our copy of member 0 (the capture template, never the
# user's module) and the compile sample's inputs that were in the parameters' dtype cast to the new
# one; the other mode's graph is captured on the switch to it, as always. A call in another dtype
# than the new graph's then fails its guards and captures for its inputs (Note [Guards]). Found
# by probe 5 of issue 44 (F14): after ``.double()`` a ``1.0 if x.dtype == torch.float64 else 2.0``
# kept the float32 branch (every output 1.0 off), ``zeros(dtype=x.dtype)`` returned float32 where
# each member returned bfloat16, and ``x.to(weight.dtype)`` crashed inside wide::linear.
# A capture that fails in the new dtype (a forward refusing half precision) does not fail the
# conversion: the parameters are already converted and the model has no graph, so raising would
# leave it half-changed. ``.to()`` logs a warning instead, and the next call captures again and
# raises that error where the user runs the model; converting back works as before.


class WideModel(MemberOpsMixin, MemberConstantsMixin, CallGraphsMixin, InspectionMixin, DeploymentMixin,
                DeferredTuningMixin, DeferredCompileMixin,
                nn.Module):
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
        refuse_reserved_names(models)
        from .fx.pipeline import compile_members  # Note [The compiler imported when it compiles]

        self._hold(compile_members(models, sample_args, sample_kwargs, config=config, dynamic_shapes=dynamic_shapes))

    @classmethod
    def _from_compilation(cls, c: Compilation, *, deferred: Deferred | None = None) -> WideModel:
        """The wide model of a first compilation (:func:`~wide_compiler.fx.pipeline.compile_members`,
        run with the members: ``c.state`` holds their stacked tensors; or with ``deferred``,
        :func:`~wide_compiler.fx.compilation.stack_members`: no graph yet)."""
        wide = cls.__new__(cls)
        super(WideModel, wide).__init__()
        wide._hold(c, deferred=deferred)
        return wide

    def _hold(self, c: Compilation, *, deferred: Deferred | None = None) -> None:
        """Take the wide state (installed under the members' names) and the graph of ``c``; with
        ``deferred``, ``c`` has no graph and the members run their own programs until one is
        compiled (Note [Running the members until compiling pays] in model_deferred.py)."""
        template = c.members[0]
        self.n = c.n
        # Hidden from nn.Module registration: a structural copy of member 0 (for unfuse and for
        # capturing the graph of the other train/eval mode), the capture sample, the graphs.
        object.__setattr__(self, "_template", copy.deepcopy(template, _shared_tensors(template, c.model)))
        object.__setattr__(self, "_sample", c.sample)
        self._config = c.config
        self._dynamic_shapes = c.dynamic_shapes
        # Note [Dynamic sizes on demand]: flat input index -> dims captured dynamic beyond the
        # batch, (input, dim) -> the size that made it so, (training, the dims a recapture made
        # dynamic) -> (input, dim) -> why the forward fixes it (Note [A refused size is kept for
        # that capture only] in model_calls.py), id(graph) -> the narrow size ranges export found.
        self._extra_dims: dict[int, frozenset[int]] = {}
        self._grown: dict[tuple[int, int], int] = {}
        self._fixed: dict[tuple[bool, frozenset[tuple[int, int]]], dict[tuple[int, int], str]] = {}
        self._ranges: dict[int, dict[str, tuple[tuple[int, int, int | None], ...]]] = {}
        self._graphs: dict[bool, WideGraph] = {}
        # Note [Guards] (fx/guards.py): per mode, the graphs captured for calls outside the
        # assumptions of the mode's graph (most recently captured last; at most MAX_GRAPHS - 1)
        self._variants: dict[bool, list[WideGraph]] = {}
        # Note [Per-member constants at the call]: id(graph) -> the constant buffers' versions last checked
        self._constants_seen: dict[int, tuple] = {}
        self._timings: dict[tuple[bool, str], dict[str, float] | None] = {}  # (training, node) -> ms
        self._holder_plans: dict[int, list] = {}  # id(graph) -> _holders(graph)
        # Note [Hooks on a member's parameters] (fx/member_checks.py): eval members with gradient
        # hooks on parameters compile (with a warning); a train graph is refused with this message
        hooks = parameter_hook_refusal(c.members)
        self._parameter_hooks: str | None = hooks[0] if hooks is not None else None

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
        if deferred is None:
            self._adopt(c)
        else:
            self._deferred = deferred
        self._note_dtype()
        self.train(template.training)

    def _note_dtype(self) -> None:
        """Keep the parameters' dtype and device, which the inputs that follow them must have (Note
        [Guards]; the device: Note [State a forward reads] in fx/state_reads.py)."""
        ref = next(self.parameters(), None)
        self.__dict__["_param_dtype"] = ref.dtype if ref is not None else None
        ref = ref if ref is not None else next(self.buffers(), None)
        self.__dict__["_param_device"] = ref.device if ref is not None else None

    def to(self, *args: Any, **kwargs: Any) -> WideModel:
        """``nn.Module.to``: a device and a dtype as for any module. A ``memory_format`` is not
        applied to the stacked tensors (N-first: a conv's weight is 5-D, which channels-last does not
        take): each wide conv runs in the layout its strategy names (``summary()``), so it is
        skipped, with a log line (probe 11 of issue 44, P11-6: torch's rank error)."""
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        if memory_format is None:
            return super().to(*args, **kwargs)
        log.info("wide_compiler: .to(memory_format=%s) is not applied to a wide model's stacked tensors: each "
                 "wide conv runs in the layout its strategy names (see summary())", memory_format)
        return super().to(device=device, dtype=dtype, non_blocking=non_blocking)

    def _apply(self, fn: Any, recurse: bool = True) -> WideModel:
        # the per-member constants are the members' Python numbers, held in float64 (the graph casts
        # them to its input's dtype where it reads them): .to(dtype) moves them, but keeps their
        # values (a member's own .float() leaves its attribute 0.3, not 0.30000001)
        root = self._modules.get(BUFFER_ROOT)
        constants = dict(root.named_buffers()) if root is not None else {}
        before = self.__dict__.get("_param_dtype")
        # the eval fold cache holds weak references to the tensors, which torch.utils.swap_tensors
        # (set_swap_module_params_on_conversion) refuses to swap; a converted tensor misses it anyway
        clear_fold_cache(list(self.parameters()))
        self._constants_seen.clear()
        out = super()._apply(fn, recurse)
        deferred = self.__dict__.get("_deferred")
        for m in deferred.members if deferred is not None else ():  # checked at the first compile, as the model is
            m._apply(fn, recurse)
        for name, was in constants.items():
            path, _, attr = name.rpartition(".")
            holder = root.get_submodule(path) if path else root
            now = holder._buffers.get(attr)
            if now is not None and now.dtype != was.dtype:
                holder._buffers[attr] = was.to(device=now.device)
        self._note_dtype()
        after = self.__dict__.get("_param_dtype")
        if "_graphs" in self.__dict__ and before is not None and after is not None and after != before:
            self._recapture_in(before, after)
        return out

    def _recapture_in(self, before: torch.dtype, after: torch.dtype) -> None:
        """Note [A graph runs in the dtype it was captured in]: after the parameters went from
        ``before`` to ``after`` (``.to(dtype)``, ``.double()``), every graph is dropped and the
        mode's graph captured again in ``after``."""
        def cast(x: Any) -> Any:  # an input captured in the parameters' dtype follows it
            return x.to(after) if isinstance(x, torch.Tensor) and x.dtype == before else x

        with COMPILE_LOCK:
            # our copy of member 0 (never the user's: pipeline.py), converted in place through .data as
            # Module.to does by default: under set_swap_module_params_on_conversion(True) its swap_tensors
            # refuses tensors that export's caches hold weak references to
            for t in template_tensors(self._capture_template[0]):
                if t.is_floating_point():
                    t.data = t.data.to(after)
            object.__setattr__(self, "_sample", tree_map(cast, self._sample))
            had_graphs = bool(self._graphs)
            for key in ("_graphs", "_variants", "_ranges", "_holder_plans", "_constants_seen"):
                self.__dict__[key].clear()
            if not had_graphs:  # deferred (Note [Running the members until compiling pays]): nothing to capture again
                return
            mode = "train" if self.training else "eval"
            log.info("wide_compiler: the parameters went from %s to %s: capturing the %s graph again in %s",
                     before, after, mode, after)
            try:
                self._graph_for(self.training)
            except Exception as e:  # noqa: BLE001 (raised again by the next call's capture)
                log.warning("wide_compiler: the parameters are now %s, but the %s graph cannot be captured in "
                            "%s (%s: %s); the next call tries again and raises this error", after, mode, after,
                            type(e).__name__, str(e).splitlines()[0] if str(e) else "")

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
        if training and self.__dict__.get("_parameter_hooks"):  # Note [Hooks on a member's parameters]
            raise UnsupportedOperationError(self._parameter_hooks)
        self._constants_now()  # Note [Constants the members hold now] (model_constants.py)
        c = self._compilation(training)
        from .fx.pipeline import run_cached  # Note [The compiler imported when it compiles]

        c = run_cached(c)  # Note [The compile cache] (fx/compile_cache.py)
        if c.members is not None:
            self._deferred.checked = True
        return c

    def _compilation(self, training: bool) -> Compilation:
        """The compilation of one train/eval mode on this model's state; with the members (checked
        by the pipeline) at the first compile of a deferred model (Note [Running the members until
        compiling pays] in model_deferred.py)."""
        ref = next(self.parameters(), None)
        d = self.__dict__.get("_deferred")
        members = None if d is None or d.checked else [m.train(training) for m in d.members]
        return Compilation(
            self._capture_template[0].train(training), self._sample, self.n, self._config, members=members,
            dynamic_shapes=self._dynamic_shapes, opaque_paths=self._capture_template[1],
            dtype=ref.dtype if ref is not None else None, device=ref.device if ref is not None else None,
            constants=self.__dict__.get("_constants"), earlier_constants=self._earlier_constants(),
            extra_dims=dict(self._extra_dims), state=self._live_state())

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
            self._remember_constants(c.constant_plan)  # Note [Configurations proved before] (fx/constants.py)
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
            from .fx import compile_cache

            compile_cache.store(c, c.cache_key, self._ranges[id(c.wide)])
        # Note [Tuning after the first runs] (tuning.py): measured after its first runs; a graph
        # recaptured for new sizes in place of one still waiting takes over the runs left
        defer_tuning(c.wide, c, pending_runs(old) if old is not None else None)
        self._graphs[c.training] = c.wide
        log.debug("wide_compiler: wide graph:\n%s", c.wide.graph_module.code)
        return c.wide

    def _graph_for(self, training: bool) -> WideGraph:
        """The wide graph of a train/eval mode, compiled on first use (once, whatever the threads:
        a failed compile leaves nothing behind and the next call tries again)."""
        wg = self._graphs.get(training)
        if wg is None:
            with COMPILE_LOCK, outside_inference_mode():
                wg = self._graphs.get(training)
                if wg is None:
                    wg = self._adopt(self._compile(training))
        return wg

    def train(self, mode: bool = True) -> WideModel:
        """Switch to the train (``mode=True``) or eval graph; the graph of a mode is captured and
        widened on the first switch to it, here rather than inside a later forward (so a forward
        under ``torch.compile(fullgraph=True)`` never has to capture)."""
        if "_graphs" in self.__dict__ and self._graphs and "_deferred" not in self.__dict__:
            # constructed (not inside __init__/unpickling), and not deferred (its forward decides)
            self._graph_for(mode)  # raises (with the mode unchanged) if that graph cannot be built
        outer, _SETTING_MODE.on = getattr(_SETTING_MODE, "on", False), True
        try:
            return super().train(mode)
        finally:
            _SETTING_MODE.on = outer

    # -- running ----------------------------------------------------------------------------
    def _call_impl(self, *args: Any, **kwargs: Any) -> Any:
        if _global_hooks_on():  # Note [Global module hooks run on the members, not on the wide model]
            return _CALL_WITHOUT_GLOBAL_HOOKS(self, *args, **kwargs)
        return super()._call_impl(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._constants_now()  # Note [Constants the members hold now] (model_constants.py)
        deferred, out = self._call_deferred(args, kwargs)  # Note [Running the members until compiling pays]
        if deferred:
            return out
        covering = self._graph_covering(self.training, args, kwargs)
        if covering is None:
            return self.packed(*args, **kwargs)  # wide(wc.pack(xs)): WideCompiler 0.x's convention
        wg, flat = covering
        if not torch.compiler.is_dynamo_compiling():
            if wg.constant_table is not None:
                self._sync_constants(wg)
            if not (torch.compiler.is_compiling() and traced_here(args, kwargs)):
                self._count_run(wg)  # Note [Tuning after the first runs] (tuning.py): one lookup, if pending
        return call_graph(wg, self, self._holders(wg), flat)

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

    def clear_caches(self) -> None:
        """Drop what the eval graph derived from this model's parameters and kept (the folded
        conv weights of Note [The fold cache] in fx/fold.py), and which per-member constants the
        last call checked (Note [Per-member constants at the call]): the next call checks them
        again by value. Never needed after writes through autograd's view of a tensor (optimizer
        steps, ``load_state_dict``, ``.to()``, in-place ops under ``no_grad``): those are detected.
        Needed after writes that bypass version counters, such as ``param.data.mul_(2)``, a
        ``_per_member`` buffer's ``.data`` written, or a write through a numpy view of a tensor.

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
        self._constants_seen.clear()

    def extra_repr(self) -> str:
        return f"n={self.n}, model={type(self._template).__name__}"

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


def refuse_reserved_names(members: Sequence[nn.Module]) -> None:
    """A member's top-level ``_per_member``: the name under which the wide model keeps the
    per-member constants' buffers (Note [Per-member constants], fx/constants.py), refused with the
    fix like the other reserved names (probe 9, P9-24: a bare KeyError at the first call)."""
    for i, m in enumerate(members):
        if BUFFER_ROOT in m._modules or BUFFER_ROOT in m._parameters or BUFFER_ROOT in m._buffers \
                or BUFFER_ROOT in vars(m):
            raise WideCompileError(
                f"wide_compiler: member {i}'s top-level attribute {BUFFER_ROOT!r} has the name under "
                f"which the wide model keeps its per-member constants, so its stacked form cannot be "
                f"installed; rename it in the model (e.g. self.{BUFFER_ROOT}_ = ...)")


def _join(a: str, b: str) -> str:
    return f"{a}.{b}" if a else b
