"""Capture one member with ``torch.export``, with a dynamic batch dimension.

See DESIGN §2: non-strict export runs the model's real Python on fake tensors and yields ATen ops
with schemas; the batch dim (dim 0 of every tensor input) is marked ``Dim.AUTO`` so one wide model
serves any batch size. :func:`check_sample` runs member 0 on the sample first, so a sample it
cannot take fails with PyTorch's own error.

Whether all members are the same program is checked in fx/member_checks.py; where a node comes
from in the user's code is read in fx/source.py.

Note [Capture special cases]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Most of a model reaches the widen pass as plain ATen ops, one rule each. Three kinds of code do
not; which mechanism applies depends on what the module's forward does:

* Its forward cannot be exported (data-dependent Python such as ``if self.s > 0.5``, a value read
  with ``float(tensor)``, a call into a C extension), or a hand-written wide form beats what the
  rules make of it: a **registered wide form**, ``@wc.register(ModuleType)`` (registry.py; the
  only one of the three a user writes). The capture copy holds an ``_OpaqueCall`` in its place:
  export sees one custom op, ``wide_compiler::opaque_module``, whose fake kernel runs member 0's
  module on zeros of the traced sizes to learn the output shapes; the widen rule
  fx/rules/registered.py turns that op into a call of ``WideCls.from_modules(members)``, which the
  wide model holds (``unfuse()`` gives the members back). Costs: the user writes and maintains
  ``from_modules``/``forward``/``unfuse``; the compiler sees nothing inside (no strategy tuning,
  no layout plan, its inputs and outputs are N-first); positional tensor inputs only; no
  per-member constants inside (fx/constants.py); the ``run_members`` check is skipped for the
  model (the module's Python may branch per member). The library uses it too, for BatchNorm with
  ``momentum=None`` (``registry._builtin_wide_form``).
* Its forward exports, but into ops that widen badly (layout steps that each become a copy of the
  wide activation: ``nn.MultiheadAttention``'s sequence-first reshapes): a **capture form**
  (fx/forms.py), a subclass computing the same math in ops that widen well, swapped in by
  ``__class__`` on the capture copy only (``apply_capture_forms``; fx/member_checks.py applies it
  to the members it traces too) and falling through to the original forward for every call it
  does not cover. Costs: nothing at run time; it must be exact (from then on it IS the member's
  program, checked like any capture by ``validate``); one class per module type, in the library.
* Its forward opens ``torch.no_grad()``/``set_grad_enabled``/``torch.autocast`` blocks: export
  makes them **higher-order regions** (``wrap_with_set_grad_enabled``, ``wrap_with_autocast``)
  with a body graph, and the widen rule fx/rules/regions.py widens the body like any graph and
  calls it under the same grad mode or autocast state (``Region``). Nothing to choose: it is
  automatic. Costs: one more Python call per region; the passes after widen (layout plan, eval
  rewrites, strategy choice) walk the outer graph only, so the ops inside a region run N-first
  and keep ``strategy="auto"`` (the C++ op's own choice per call; nothing is measured).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
import os
import re
import sys
import threading
import traceback
import types
from typing import Any

import torch
from torch import nn
from torch.export import Dim, ExportedProgram
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..errors import WideCompileError
from .guards import globals_read
from .source import is_user_file, location, user_frame_and_module
from .source import module_path, source_line  # noqa: F401 -- their old import path (model.py, analyze.py)

__all__ = ["SpecialisationLog", "batch_of_two", "capture", "check_sample", "flat_signature", "register_output_type"]

log = logging.getLogger(__name__)

def _batched(args: Any) -> bool:
    """Whether the sample has a real batch: some tensor input of 2+ dims is larger than 1 in dim
    0. Then inputs of size 1 there are broadcast over the batch (Flux's RoPE table ``pe [1, ...]``)
    and stay static; otherwise the sample is a batch of 1, captured as a batch of 2."""
    leaves = [a for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor) and a.dim() >= 2]
    return any(a.shape[0] > 1 for a in leaves)


def _sequence_first(model: nn.Module) -> bool:
    """Whether the model holds a module whose inputs are sequence-first by convention
    (``batch_first=False`` attention and RNNs; transformer layers hold such an attention): their
    batch is dim 1."""
    return any(isinstance(m, (nn.MultiheadAttention, nn.RNNBase)) and not m.batch_first for m in model.modules())


def _batch_spec(a: Any, dims: tuple[int, ...], batched: bool, batches: set[int]) -> Any:
    """``Dim.AUTO`` on ``dims`` of a tensor of 2+ dims, but not on a size-1 dim of a batched
    sample (broadcast over the batch: export would specialise it anyway, with a warning); a
    batch-of-1 sample's dim 0 is repeated to 2 (:func:`batch_of_two`), so it stays marked. A 1-D
    input whose size is the batch of the others (per-sample labels, timesteps, a mask ``[B]``)
    is marked too."""
    if not isinstance(a, torch.Tensor) or a.dim() == 0:
        return None
    if a.dim() == 1:
        return {0: Dim.AUTO} if a.shape[0] > 1 and a.shape[0] in batches else None
    return {d: Dim.AUTO for d in dims if a.shape[d] > 1 or (d == 0 and not batched)} or None


def _default_dynamic_shapes(model: nn.Module, args: tuple, kwargs: dict,
                            signature: inspect.Signature | None = None,
                            extra_dims: dict[int, frozenset[int]] | None = None,
                            exact_dims: dict[int, frozenset[int]] | None = None) -> Any:
    """``Dim.AUTO`` on the batch dim of every tensor input of 2+ dims: dim 0, and dim 1 too in a
    model with sequence-first modules (see :func:`_sequence_first`), and on a 1-D input as long as
    that batch. Export keeps dynamic what the program lets vary and specialises the rest (a
    size-1 dim broadcast over the batch stays 1). Only the likely batch dims are marked: a free
    feature dim could tie the batch to it. Keyed by the parameters of ``signature`` (default:
    the forward's) when there are keyword inputs, else one entry per positional input.

    ``extra_dims``: flat input index (as ``tree_flatten((args, kwargs))`` orders the sample's
    leaves) -> more dims to mark ``Dim.AUTO`` (Note [Dynamic sizes on demand] in model.py).
    ``exact_dims``: the same, but the only dims marked (no batch dims of the inputs' own: a graph
    for the sizes of one call, Note [Guards] in fx/guards.py)."""
    dims, batched = ((0, 1) if _sequence_first(model) else (0,)), _batched((args, kwargs))
    leaves = tree_flatten((args, kwargs))[0]
    batches = {int(a.shape[d]) for a in leaves
               if isinstance(a, torch.Tensor) and a.dim() >= 2 for d in dims}
    extra = {id(leaves[k]): ds for k, ds in (extra_dims or {}).items() if k < len(leaves)}

    exact = {id(leaves[k]): ds for k, ds in (exact_dims or {}).items() if k < len(leaves)}

    def spec(a: Any) -> Any:
        if exact_dims is not None:
            ds = exact.get(id(a)) if isinstance(a, torch.Tensor) else None
            return {d: Dim.AUTO for d in sorted(ds) if d < a.dim()} or None if ds else None
        base = _batch_spec(a, dims, batched, batches)
        more = extra.get(id(a))
        if not more or not isinstance(a, torch.Tensor):
            return base
        return {**(base or {}), **{d: Dim.AUTO for d in sorted(more) if d < a.dim()}}
    if not kwargs and signature is None:
        return tuple(tree_map(spec, a) for a in args)
    bound = (signature or inspect.signature(model.forward)).bind(*args, **kwargs)
    return {name: tree_map(spec, v) for name, v in bound.arguments.items()}


def flat_signature(model: nn.Module, args: tuple, kwargs: dict) -> inspect.Signature | None:
    """For a forward that takes ``*args`` or ``**kwargs``: the signature it has for this sample,
    one named parameter per input (``args_0, args_1, ...`` for what ``*args`` collects, the
    keywords by name), which is what ``torch.export``'s ``dynamic_shapes`` can describe (it
    cannot match a spec to a ``**kwargs`` parameter). None for a forward without them.

    Raises :class:`WideCompileError` when the sample does not fit the forward at all."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):  # no signature to read: inputs as given
        return None
    P = inspect.Parameter
    if not any(p.kind in (P.VAR_POSITIONAL, P.VAR_KEYWORD) for p in sig.parameters.values()):
        return None
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as e:
        raise WideCompileError(
            f"wide_compiler: the sample does not fit {type(model).__name__}.forward{sig}: {e} (got "
            f"{len(args)} positional input(s) and keywords {sorted(kwargs)}).\n"
            "What to do: pass compile(..., sample_input=<a tuple of the positional inputs>, "
            "sample_kwargs=<a dict of the keyword inputs>) as the forward takes them.") from None
    params = []
    for name, value in bound.arguments.items():
        kind = sig.parameters[name].kind
        if kind is P.VAR_POSITIONAL:
            for k in range(len(value)):
                params.append(P(f"{name}_{k}", P.POSITIONAL_ONLY))
        elif kind is P.VAR_KEYWORD:
            params.extend(P(k, P.KEYWORD_ONLY) for k in value)
        else:
            params.append(P(name, P.POSITIONAL_ONLY if name not in kwargs else P.KEYWORD_ONLY))
    # positional parameters first, then keyword-only ones (a valid signature's order)
    params.sort(key=lambda p: p.kind is P.KEYWORD_ONLY)
    return inspect.Signature(params)


class _ForwardSignature:
    """Within the block, ``model.forward`` shows ``signature`` to ``inspect`` (the instance
    attribute is removed afterwards; calls go to the real forward)."""

    def __init__(self, model: nn.Module, signature: inspect.Signature | None) -> None:
        self.model, self.signature = model, signature

    def __enter__(self) -> None:
        if self.signature is None:
            return
        forward = self.model.forward

        def shown(*args: Any, **kwargs: Any) -> Any:
            return forward(*args, **kwargs)

        shown.__signature__ = self.signature
        self.model.__dict__["forward"] = shown

    def __exit__(self, *exc: Any) -> None:
        if self.signature is not None:
            self.model.__dict__.pop("forward", None)


def _batch_of_two(a: Any) -> Any:
    if isinstance(a, torch.Tensor) and a.dim() >= 2 and a.shape[0] == 1:
        return a.repeat(2, *([1] * (a.dim() - 1)))
    return a


def without_cudnn() -> contextlib.AbstractContextManager:
    """cuDNN off while tracing or recording a member (its other settings kept): an RNN member on
    CUDA then skips ``flatten_parameters``, whose storage swap (``aten.set_``) is cuDNN's memory
    layout, not part of the member's program; the wide model runs with the user's settings."""
    c = torch.backends.cudnn
    return c.flags(enabled=False, benchmark=c.benchmark, deterministic=c.deterministic, allow_tf32=c.allow_tf32)


def batch_of_two(args: Any) -> Any:
    """A batch-of-1 sample repeated to a batch of 2 (export would specialise a size of 1); a
    sample with a real batch is returned as it is (its size-1 inputs are broadcast ones)."""
    return args if _batched(args) else tree_map(_batch_of_two, args)


def capture(model: nn.Module, args: tuple, kwargs: dict | None = None, *,
            dynamic_shapes: Any = None, extra_dims: dict[int, frozenset[int]] | None = None,
            exact_dims: dict[int, frozenset[int]] | None = None) -> ExportedProgram:
    """``torch.export`` of one member (non-strict) with a dynamic batch dimension.

    A batch of 1 would be specialised by export (0/1 specialisation); such inputs are captured
    with a batch of 2 made by repeating the sample, so the wide model still takes any batch.
    ``extra_dims`` (flat input index -> dims) marks more dims ``Dim.AUTO`` with the default
    ``dynamic_shapes``: export keeps them dynamic unless the forward fixes them; a size-1 dim
    among them is captured as 2 (repeated), as a batch of 1 is. ``exact_dims`` instead marks only
    the dims it names and captures the sample's sizes as they are (a size of 1 stays 1): the graph
    of one call's inputs (Note [Guards] in fx/guards.py).
    """
    kwargs = dict(kwargs or {})
    signature = None
    if dynamic_shapes is None:
        # a forward(*args, **kwargs) is shown to export with one parameter per input
        signature = flat_signature(model, tuple(args), kwargs)
        dynamic_shapes = _default_dynamic_shapes(model, args, kwargs, signature, extra_dims, exact_dims)
        if exact_dims is None:
            if extra_dims:
                args, kwargs = _repeat_size_one((tuple(args), kwargs), extra_dims)
            args, kwargs = batch_of_two((args, kwargs))
    registered: set[str] = set()
    while True:
        watch = _Watch()
        try:
            with _ForwardSignature(model, signature), without_cudnn(), _RecurrentShapes(), watch:
                ep = torch.export.export(model, tuple(args), kwargs, dynamic_shapes=dynamic_shapes, strict=False)
            watch.check(model)
        except Exception as e:  # export's own errors are many types; keep its reason whole
            found = _UNKNOWN_OUTPUT.search(str(e))
            if found and found[1] not in registered and register_output_type(found[1]):
                registered.add(found[1])  # a known container (a transformers cache): capture again
                continue
            if found:
                raise WideCompileError(
                    f"wide_compiler: {type(model).__name__} returns a {found[1]}, which torch.export "
                    "cannot carry as an output (it is not a registered pytree node).\n"
                    "What to do: turn that output off (for a transformers model: pass "
                    "sample_kwargs={'use_cache': False} or set config.use_cache = False), or register "
                    "the type with torch.utils._pytree.register_pytree_node so its tensors come out "
                    "N-first like any output.") from e
            raise _capture_error(model, e, getattr(watch, "compiling", ())) from e
        _refuse_generators(model, ep)  # our own refusal, not wrapped as export's
        ep.wide_reads = watch.reads()  # Note [State a forward reads] (fx/guards.py)
        try:  # read here, where the grad mode is the capture's
            ep.wide_reads["globals"] = globals_read(model)
        except Exception as e:  # noqa: BLE001 -- code the scan does not understand: said, not a failed compile
            log.warning("wide_compiler: could not read which module globals %s's code reads (%s: %s): changing "
                        "them after compiling is not followed (Note [State a forward reads])",
                        type(model).__name__, type(e).__name__, e)
            ep.wide_reads["globals"] = ([], [], [])
        if ep.wide_reads["grad_mode"] is None and {"is_grad_enabled", "is_inference_mode_enabled"} & set(
                ep.wide_reads["globals"][2]):  # a grad-mode reader imported by name: its calls were not seen
            ep.wide_reads["grad_mode"] = torch.is_grad_enabled()
        if watch.compiling:
            log.info("wide_compiler: the forward asks torch.compiler.is_compiling() (%s): captured with the "
                     "answer False, as each member gets when called alone", "; ".join(dict.fromkeys(watch.compiling)))
        return ep


class _Watch:
    """Note [What export does not capture]: within the block (one export), records what the user's
    forward does that the exported graph cannot carry:

    * a custom ``torch.autograd.Function``: export traces its forward, its backward is lost (the
      wide model's gradient would be autograd's of the forward: a straight-through estimator's
      gradient becomes 0, a gradient-reversal layer's the identity). One whose backward computes
      autograd's gradient of its forward (a memory-saving GeLU, as BLOOM's) loses nothing: that is
      checked in float64 at the traced sizes (:func:`_backward_is_autograds`), and only the others
      count;
    * ``Tensor.register_hook`` on an activation: the hook never runs in the wide model's backward;
    * what the forward reads of the state of the process, whose branch is baked in (Note [State a
      forward reads] in fx/guards.py): the grad mode (``torch.is_grad_enabled()``,
      ``torch.is_inference_mode_enabled()``), the global flags of ``guards.FLAG_READERS``
      (determinism, autocast, the default dtype, matmul precision), an input's memory layout
      (``Tensor.is_contiguous``, ``Tensor.stride``) and a tensor's device (``.device``,
      ``.is_cuda``, ``.is_cpu``): each becomes a guard of the graph, checked at every call;
    * ``torch.compiler.is_compiling()`` / ``is_exporting()`` (and ``torch._dynamo.is_compiling``,
      ``torch._utils.is_compiling``, which call it), called from the user's own code (not a
      library's under site-packages, not torch's): export runs the forward with them True, each
      member alone with them False. The user's code gets False here, so the graph takes the branch
      each member takes alone (export fails, and says so, where that branch cannot be captured);
      a library's code keeps export's answer (its export support chose that branch for export).
      The function objects themselves answer (their code is swapped for the block), so a name
      imported with ``from torch.compiler import is_compiling`` answers the same.

    :meth:`check` refuses a train graph with the first two (and a module's backward hooks, which
    export drops too), naming the class or line; an eval graph only warns (its forward values are
    the members'; a backward through it would not be). Only calls from the user's code count (not
    torch's or wide_compiler's own).

    The patches are process-wide (installed by the first block to open, removed by the last to
    close, under a lock) and record only for the thread whose export opened a block: another
    thread's calls get the real functions' answers."""

    def __enter__(self) -> _Watch:
        self.functions: list = []
        self.hooks: list[str] = []
        self.grad_mode: bool | None = None
        self.flags: dict[tuple[str, tuple], Any] = {}
        self.layout: list[str] = []  # where the user's code read a tensor's memory layout
        self.device: list[str] = []  # where it read a tensor's device
        self.compiling: list[str] = []  # where it asked is_compiling()/is_exporting() (answered False)
        with _WATCH_LOCK:
            if not _WATCHES:
                _install_watch_patches()
            _WATCHES.setdefault(threading.get_ident(), []).append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        with _WATCH_LOCK:
            mine = _WATCHES.get(threading.get_ident(), [])
            if self in mine:
                mine.remove(self)
            if not mine:
                _WATCHES.pop(threading.get_ident(), None)
            if not _WATCHES:
                _remove_watch_patches()

    def reads(self) -> dict[str, Any]:
        """What the forward read of the process's state, as plain values (Note [State a forward
        reads] in fx/guards.py): ``grad_mode`` (bool or None), ``flags`` (``((reader, args),
        value)`` pairs), ``layout`` and ``device`` (whether read), ``compiling`` (where)."""
        return {"grad_mode": self.grad_mode, "flags": tuple(self.flags.items()), "layout": bool(self.layout),
                "device": bool(self.device), "compiling": tuple(dict.fromkeys(self.compiling))}

    def check(self, model: nn.Module) -> None:
        hooks = [f"{name or type(model).__name__} ({type(m).__name__}) has a backward hook"
                 for name, m in model.named_modules() if m._backward_hooks or m._backward_pre_hooks]
        unproved = [(cls, where) for cls, specs, where in self.functions
                    if specs is None or not _backward_is_autograds(
                        cls, specs, torch.autograd.function.Function.__dict__["apply"])]
        found = ([f"the custom autograd function {cls.__qualname__} ({where})" for cls, where in unproved]
                 + [f"Tensor.register_hook {h}" for h in self.hooks] + hooks)
        if not found:
            return
        what = "; ".join(dict.fromkeys(found))
        if model.training:
            raise WideCompileError(
                f"wide_compiler: {what}. torch.export captures the forward only: the wide model's backward "
                "would not run it (a custom Function's backward, a hook), so its gradients would not be the "
                "members' (Note [What export does not capture] in fx/capture.py).\n"
                "What to do: give that module a wide form with @wide_compiler.register (its own Python runs "
                "per member), or train the members without it.")
        log.warning("wide_compiler: %s: the eval graph computes the members' outputs, but a backward through "
                    "it would not run that code (Note [What export does not capture])", what)


# -- the patches of _Watch (process-wide while any export runs under one) ----------------------------

_WATCH_LOCK = threading.Lock()
_WATCHES: dict[int, list[_Watch]] = {}  # thread id -> the watches open in that thread (innermost last)
_PATCHED: list[tuple[Any, str, Any]] = []  # (owner, attribute, what was there: _ABSENT if nothing)
_ABSENT = object()
_SITE = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)


def _watching() -> _Watch | None:
    mine = _WATCHES.get(threading.get_ident())
    return mine[-1] if mine else None


def _user_caller(depth: int = 2) -> bool:
    """Whether the caller of the patched function (``depth`` frames up) is the user's code."""
    return is_user_file(sys._getframe(depth).f_code.co_filename)


def _patch(owner: Any, name: str, value: Any) -> None:
    _PATCHED.append((owner, name, owner.__dict__.get(name, _ABSENT)))
    setattr(owner, name, value)


def _install_watch_patches() -> None:
    from .guards import FLAG_READERS

    fn_cls = torch.autograd.function.Function
    apply, register_hook = fn_cls.__dict__["apply"], torch.Tensor.register_hook

    def watched_apply(cls, *args: Any, **kwargs: Any) -> Any:
        watch = _watching()
        if watch is not None:
            try:
                user = is_user_file(inspect.getfile(cls))
            except (TypeError, OSError):  # a class without a source file
                user = False
            if user:
                watch.functions.append((cls, None if kwargs else [_spec(a) for a in args], user_frame_and_module()))
        return apply.__func__(cls, *args, **kwargs)

    def watched_register_hook(t: torch.Tensor, hook: Any) -> Any:
        watch = _watching()
        if watch is not None and _user_caller():
            watch.hooks.append(user_frame_and_module())
        return register_hook(t, hook)

    def grad_read(fn: Any) -> Any:
        def read() -> bool:
            value = fn()
            watch = _watching()
            if watch is not None and _user_caller():
                watch.grad_mode = torch._C.is_grad_enabled()
            return value
        return read

    def flag_read(name: str, fn: Any) -> Any:
        def read(*args: Any) -> Any:
            value = fn(*args)
            watch = _watching()
            if watch is not None and _user_caller():
                watch.flags[(name, tuple(args))] = value
            return value
        read.__name__ = read.__qualname__ = name
        return read

    def layout_read(fn: Any) -> Any:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            watch = _watching()
            if watch is not None and _user_caller():
                watch.layout.append(user_frame_and_module())
            return fn(self, *args, **kwargs)
        return read

    def device_read(getter: Any) -> property:
        def read(self: torch.Tensor) -> Any:
            watch = _watching()
            if watch is not None and _user_caller():
                watch.device.append(user_frame_and_module())
            return getter(self)
        return property(read)

    from torch._subclasses.fake_tensor import FakeTensor

    _patch(fn_cls, "apply", classmethod(watched_apply))
    _patch(torch.Tensor, "register_hook", watched_register_hook)
    _patch(torch, "is_grad_enabled", grad_read(torch.is_grad_enabled))
    _patch(torch, "is_inference_mode_enabled", grad_read(torch.is_inference_mode_enabled))
    for name, fn in FLAG_READERS.items():
        _patch(torch, name, flag_read(name, fn))
    for name in ("is_contiguous", "stride"):
        _patch(torch.Tensor, name, layout_read(getattr(torch._C.TensorBase, name)))
    for owner, name in ((FakeTensor, "device"), (torch.Tensor, "is_cuda"), (torch.Tensor, "is_cpu")):
        _patch(owner, name, device_read(getattr(owner, name).__get__))
    for fn, shim in _COMPILING_SHIMS:
        _PATCHED.append((fn, "__code__", fn.__code__))
        fn.__code__ = shim


def _remove_watch_patches() -> None:
    while _PATCHED:
        owner, name, old = _PATCHED.pop()
        if old is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, old)


def _answer_compiling(frame: Any, which: int) -> bool:
    """The answer of ``torch.compiler.is_compiling`` (``which`` 0) or ``is_exporting`` (1) while
    a :class:`_Watch` is open: False to the user's own code in the watching thread (what a member
    alone sees), recorded; the real answer to anything else."""
    watch = _watching()
    if watch is not None:
        while frame is not None and frame.f_code in _compiling_wrappers():
            frame = frame.f_back
        filename = frame.f_code.co_filename if frame is not None else ""
        if is_user_file(filename) and not any(s in filename for s in _SITE):
            watch.compiling.append(location(filename, frame.f_lineno, frame.f_code.co_name))
            return False
    return _COMPILING_ORIGINALS[which]()


def _is_compiling_shim() -> bool:  # the code torch.compiler.is_compiling runs within a _Watch
    import sys
    return sys.modules["wide_compiler.fx.capture"]._answer_compiling(sys._getframe(1), 0)


def _is_exporting_shim() -> bool:  # the code torch.compiler.is_exporting runs within a _Watch
    import sys
    return sys.modules["wide_compiler.fx.capture"]._answer_compiling(sys._getframe(1), 1)


_COMPILING_FNS = (torch.compiler.is_compiling, torch.compiler.is_exporting)
_COMPILING_ORIGINALS = tuple(types.FunctionType(f.__code__, f.__globals__, f.__name__) for f in _COMPILING_FNS)
_COMPILING_SHIMS = tuple(zip(_COMPILING_FNS, (_is_compiling_shim.__code__, _is_exporting_shim.__code__)))


@functools.cache
def _compiling_wrappers() -> frozenset:
    """torch's own functions that only pass is_compiling() on: the frame that asks is their
    caller's. Looked up at the first capture: importing torch._dynamo costs seconds, and a
    capture (torch.export) has imported it by then."""
    import torch._dynamo.external_utils as external_utils

    return frozenset(f.__code__ for f in (external_utils.is_compiling, torch._utils.is_compiling)
                     if isinstance(f, types.FunctionType))


def _refuse_generators(model: nn.Module, ep: ExportedProgram) -> None:
    """Refuse a capture whose random ops draw from an explicit ``generator=`` (export lifts the
    generator to a graph input the widen pass cannot take): each member alone advances its own
    generator, the wide model would have one (Note [Random ops per member] in fx/rules/randomness.py)."""
    from torch.export.graph_signature import InputKind

    lifted = {spec.arg.name for spec in ep.graph_signature.input_specs
              if spec.kind == InputKind.CUSTOM_OBJ and isinstance(ep.constants.get(spec.target), torch.Generator)}
    for node in ep.graph.nodes:
        if node.op != "placeholder" or node.name not in lifted:
            continue
        uses = "; ".join(dict.fromkeys(f"{u.target} at {source_line(u)}" for u in node.users)) or "no op"
        raise WideCompileError(
            f"wide_compiler: member 0 ({type(model).__name__}) draws random numbers with an explicit generator= "
            f"({uses}): each member alone advances its own generator, and the wide model, which draws for every "
            "member at once, would have one, so its draws could not be any member's.\n"
            "What to do: draw from the default generator (seed it with torch.manual_seed), or keep the module "
            "whole with @wide_compiler.register(ModuleType).")


def _spec(a: Any) -> Any:
    """An argument of a custom Function's call during export: a tensor as (shape by its size hints,
    dtype), anything else as it is."""
    if isinstance(a, torch.Tensor):
        shape = [int(d.node.hint) if isinstance(d, torch.SymInt) else int(d) for d in a.shape]
        return ("tensor", shape, a.dtype)
    return ("value", a)


def _backward_is_autograds(cls: type, specs: list, apply: Any) -> bool:
    """Whether ``cls``'s backward gives autograd's gradient of its own forward (float64, random
    inputs and cotangents of the traced sizes, 1e-6): then the traced forward's gradient is the
    member's. Anything that fails to run counts as not."""
    def inputs() -> list:  # the same values at each call
        gen = torch.Generator().manual_seed(0)
        return [torch.randn(sp[1], dtype=torch.float64, generator=gen).requires_grad_()
                if sp[0] == "tensor" and sp[2].is_floating_point else
                torch.zeros(sp[1], dtype=sp[2]) if sp[0] == "tensor" else sp[1] for sp in specs]

    class _Ctx:  # what an old-style forward(ctx, ...) writes to
        needs_input_grad = tuple(sp[0] == "tensor" for sp in specs)

        def save_for_backward(self, *t: Any) -> None:
            self.saved_tensors = t

        def __getattr__(self, name: str) -> Any:
            return lambda *a, **k: None  # mark_dirty, mark_non_differentiable, set_materialize_grads

    try:
        with torch.enable_grad():
            xs = inputs()
            leaves = [x for x in xs if isinstance(x, torch.Tensor) and x.requires_grad]
            out = apply.__func__(cls, *xs)
            ys = inputs()
            ref_leaves = [y for y in ys if isinstance(y, torch.Tensor) and y.requires_grad]
            if "ctx" in inspect.signature(cls.forward).parameters:
                ref = cls.forward(_Ctx(), *ys)
            else:
                ref = cls.forward(*ys)
            outs, refs = (out, ref) if isinstance(out, tuple) else ((out,), (ref,))
            pairs = [(o, r) for o, r in zip(outs, refs) if isinstance(o, torch.Tensor) and o.is_floating_point()]
            gen = torch.Generator().manual_seed(1)
            cots = [torch.randn(o.shape, dtype=o.dtype, generator=gen) for o, _ in pairs]
            got = torch.autograd.grad([o for o, _ in pairs], leaves, cots, allow_unused=True)
            want = torch.autograd.grad([r for _, r in pairs], ref_leaves, cots, allow_unused=True)
        return all((g is None and w is None) or (g is not None and w is not None and g.shape == w.shape
                                                 and torch.allclose(g, w, rtol=1e-6, atol=1e-9))
                   for g, w in zip(got, want))
    except Exception:  # noqa: BLE001 -- not provable here: the Function counts as one whose backward differs
        return False


class _RecurrentShapes:
    """Note [Recurrent layers with a dynamic length]: export computes the output of
    ``aten.gru``/``lstm``/``rnn_tanh``/``rnn_relu`` (kept whole in its graph) by running torch's
    Python decomposition on fake tensors, which loops over the time steps (``input.unbind``)
    and so fixes the sequence length. Within the block those ops' Python kernels give the outputs
    by shape instead (the same shapes, made from every input so gradients flow as through the
    op); the graph still holds the one whole op, which the wide form runs on real tensors for
    whatever length it gets. Every capture uses them: the decomposition also gets shapes wrong
    (torch 2.11's LSTM on CUDA gave final states [L, 1, B, H] for [L, B, H], which the rank check
    then refused), and it unrolls every step on fake tensors for nothing. Restored afterwards (the
    kernels are process-wide)."""

    _KEYS = (torch._C.DispatchKey.CompositeImplicitAutograd, torch._C.DispatchKey.Autograd)

    def __enter__(self) -> None:
        aten = torch.ops.aten
        self._saved = []
        for op, fn in ((aten.gru.input, _rnn_shape), (aten.rnn_tanh.input, _rnn_shape),
                       (aten.rnn_relu.input, _rnn_shape), (aten.lstm.input, _lstm_shape)):
            for key in self._KEYS:
                if key in op.py_kernels:
                    self._saved.append((op, key, op.py_kernels[key]))
                    op.py_kernels[key] = fn
            op._dispatch_cache.clear()

    def __exit__(self, *exc: Any) -> None:
        for op, key, fn in self._saved:
            op.py_kernels[key] = fn
            op._dispatch_cache.clear()


def _recurrent_out(input: torch.Tensor, hidden: int, bidirectional: bool, batch_first: bool,
                   tensors: list) -> torch.Tensor:
    # [B, T, D*H] / [T, B, D*H] keep dims 0 and 1 of the input whatever batch_first; unbatched [T, D*H]
    shape = [*input.shape[:-1], (2 if bidirectional else 1) * hidden]
    tie = sum(x.sum() for x in tensors) * 0  # every input feeds the result (autograd, as the op's)
    return input.new_zeros(shape) + tie


def _rnn_shape(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    out = _recurrent_out(input, hx.shape[-1], bidirectional, batch_first, [input, hx, *params])
    return out, hx.new_zeros(hx.shape) + out.sum() * 0


def _lstm_shape(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    h, c = hx
    out = _recurrent_out(input, h.shape[-1], bidirectional, batch_first, [input, h, c, *params])
    tie = out.sum() * 0
    return out, h.new_zeros(h.shape) + tie, c.new_zeros(c.shape) + tie


def _repeat_size_one(sample: tuple[tuple, dict], extra_dims: dict[int, frozenset[int]]) -> tuple[tuple, dict]:
    """The sample with every size-1 dim of ``extra_dims`` repeated to 2 (export would fix a 1)."""
    leaves, spec = tree_flatten(sample)
    for k, dims in extra_dims.items():
        a = leaves[k] if k < len(leaves) else None
        if isinstance(a, torch.Tensor):
            for d in dims:
                if d < a.dim() and a.shape[d] == 1:
                    a = a.repeat(*[2 if j == d else 1 for j in range(a.dim())])
            leaves[k] = a
    return tree_unflatten(leaves, spec)


class SpecialisationLog:
    """Within the block, where export fixed a dynamic size: ``fixed[(source, value)]`` is the
    user's source line (and the innermost module) of the guard that made a symbol a constant,
    read from the symbolic-shapes log (``create_symbol``/``guard added``/``set_replacement``)
    while it runs; ``source`` is export's name of the size (``L['x'].size()[1]``). Best effort:
    a torch whose log says it otherwise yields nothing, never an error."""

    _LOGGER = "torch.fx.experimental.symbolic_shapes"
    _CREATE = re.compile(r"create_symbol (\w+) = (-?\d+) for (\S+)")
    _GUARD = re.compile(r"eval (.+?) \[guard added\]")
    _REPLACE = re.compile(r"set_replacement (\w+) = (-?\d+)")

    def __init__(self) -> None:
        self.fixed: dict[tuple[str, int], str] = {}
        self._symbols: dict[str, str] = {}
        self._last_guard: dict[str, str] = {}

    def __enter__(self) -> SpecialisationLog:
        self._log = logging.getLogger(self._LOGGER)
        self._saved = (self._log.level, self._log.handlers[:], self._log.propagate)
        handler = logging.Handler()
        handler.emit = self._emit  # type: ignore[method-assign]
        if not self._log.isEnabledFor(logging.INFO):  # quiet unless the user asked for these logs
            self._log.handlers, self._log.propagate = [], False
            self._log.setLevel(logging.INFO)
        self._log.addHandler(handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        level, handlers, propagate = self._saved
        self._log.handlers, self._log.propagate = handlers, propagate
        self._log.setLevel(level)

    def _emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage()
            if (m := self._CREATE.match(msg)) is not None:
                self._symbols[m[1]] = m[3]
            elif (m := self._GUARD.match(msg)) is not None:
                where = user_frame_and_module()
                for sym in re.findall(r"\b(s\d+)\b", m[1]):
                    self._last_guard[sym] = where
            elif (m := self._REPLACE.match(msg)) is not None and m[1] in self._symbols:
                self.fixed[(self._symbols[m[1]], int(m[2]))] = self._last_guard.get(m[1], "")
        except Exception:  # noqa: BLE001 -- a diagnostic never breaks a capture
            pass

    def where(self, input_name: str, dim: int, value: int) -> str:
        """Where ``input_name`` (a graph placeholder name: ``x``, ``pair_0``, ``args_1``) dim
        ``dim`` was fixed to ``value``, or ''."""
        for (source, v), where in self.fixed.items():
            head, _, tail = source.partition(".size()")
            if v == value and tail == f"[{dim}]" and _placeholder_name(head) == input_name:
                return where
        return ""


def _placeholder_name(source: str) -> str:
    """``L['pair'][0]`` -> ``pair_0`` (export's placeholder name of an input)."""
    source = source[1:] if source.startswith("L") else source
    return "_".join(re.findall(r"\[['\"]?([^\]'\"]+)['\"]?\]", source))


def check_sample(model: nn.Module, args: tuple, kwargs: dict, n: int) -> None:
    """Run member 0 eagerly on the sample before capture, so a sample it cannot take gets
    PyTorch's own error with real sizes (export's would come with its log and symbolic sizes
    such as ``s77``) and a hint about what the sample is. Nothing of the user's changes: the
    member runs as a deep copy (or on clones of its tensors), with the random number generators
    restored, in the caller's grad mode (a forward may take gradients inside)."""
    try:
        inspect.signature(model.forward).bind(*args, **kwargs)
    except TypeError:
        return  # the capture names how the sample does not fit the forward's parameters
    except ValueError:
        pass  # no signature to read
    devices = sorted({t.device.index for t in (*model.parameters(), *model.buffers()) if t.is_cuda} - {None})
    try:
        with torch.random.fork_rng(devices=devices):
            try:
                member = copy.deepcopy(model)
            except Exception:  # noqa: BLE001 -- objects that refuse to be copied
                _run_on_clones(model, args, kwargs, contextlib.nullcontext())
            else:
                member(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 -- the member's own error, whatever its type
        shapes = ", ".join(_describe_input(a) for a in tree_flatten((args, kwargs))[0]) or "no tensors"
        leading = {a.shape[0] for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor) and a.dim()}
        hint = (f" Its dim 0 is {n}, the number of members: if that is the member dim, pass one member's "
                "input (sample[0]) instead." if leading == {n} else "")
        raise WideCompileError(
            f"wide_compiler: member 0 ({type(model).__name__}) fails on the sample ({shapes}): "
            f"{type(e).__name__}: {e}\n"
            "The sample is ONE member's input, without the member dim N: what you would pass to "
            f"members[0](...), e.g. a batch [B, features] for an MLP.{hint}") from e


@contextlib.contextmanager
def attributes_kept(model: nn.Module) -> Any:
    """Put back every module's own Python attributes when the block ends (raised or not): rebound
    values (a call counter) get their old object back, attributes the block added are removed,
    and lists, dicts and sets changed in place get their old contents back."""
    saved = []
    for m in model.modules():
        attrs = dict(m.__dict__)
        contents = {}
        for k, v in attrs.items():
            if isinstance(v, (list, dict, set)) and k not in ("_parameters", "_buffers", "_modules"):
                try:
                    contents[k] = copy.copy(v)
                except Exception:  # noqa: BLE001 -- kept as it is: a rebinding is still undone
                    pass
        saved.append((m, attrs, contents))
    try:
        yield
    finally:
        for m, attrs, contents in saved:
            for k in [k for k in m.__dict__ if k not in attrs]:
                del m.__dict__[k]
            m.__dict__.update(attrs)
            for k, old in contents.items():
                v = attrs[k]
                if isinstance(v, list):
                    v[:] = old
                else:
                    v.clear()
                    v.update(old)


def _run_on_clones(model: nn.Module, args: tuple, kwargs: dict, rec: Any) -> None:
    """Run ``model`` with clones of its parameters and buffers (``functional_call``), inside the
    context ``rec`` (the member checks' op recorder, or a null context), its Python attributes
    kept (:func:`attributes_kept`)."""
    tensors = {k: v.detach().clone() for k, v in (*model.named_parameters(remove_duplicate=False),
                                                   *model.named_buffers(remove_duplicate=False))}
    with attributes_kept(model), torch.no_grad(), rec:
        torch.func.functional_call(model, tensors, args, kwargs, strict=False)


def _describe_input(a: Any) -> str:
    if isinstance(a, torch.Tensor):
        return f"a {a.dtype} tensor {list(a.shape)}".replace("torch.", "")
    return repr(a)


# export's message for an output type it cannot flatten
_UNKNOWN_OUTPUT = re.compile(r"Found <class '([^']+)'> in output")


def register_output_type(qualname: str) -> bool:
    """Register a known non-tensor output container as a pytree node, so a model that returns it
    (transformers' decoders return a ``DynamicCache`` with ``use_cache=True``, the default, and
    encoder-decoders an ``EncoderDecoderCache`` of two) is captured as it comes and the cache
    comes out N-first. True when ``qualname`` is known.

    ``DynamicCache`` gets transformers' own registration (the one its ``torch.export`` support
    uses); ``EncoderDecoderCache`` is the pair of its two caches. Registrations are process-wide,
    as any pytree registration is."""
    if qualname not in _KNOWN_OUTPUTS:
        return False
    from torch.utils import _pytree as pytree
    from transformers.cache_utils import EncoderDecoderCache
    from transformers.integrations.executorch import register_dynamic_cache_export_support

    log.info("wide_compiler: registering %s as a pytree node so the cache comes out N-first", qualname)
    register_dynamic_cache_export_support()  # EncoderDecoderCache holds two of them
    if qualname.endswith("EncoderDecoderCache") and EncoderDecoderCache not in pytree.SUPPORTED_NODES:
        fields = ("self_attention_cache", "cross_attention_cache")
        pytree.register_pytree_node(
            EncoderDecoderCache, lambda c: ([getattr(c, f) for f in fields], None),
            lambda caches, _: EncoderDecoderCache(*caches), serialized_type_name=qualname,
            flatten_with_keys_fn=lambda c: ([(pytree.GetAttrKey(f), getattr(c, f)) for f in fields], None))
    return True


_KNOWN_OUTPUTS = ("transformers.cache_utils.DynamicCache", "transformers.cache_utils.EncoderDecoderCache")


def _capture_error(model: nn.Module, e: Exception, compiling: Any = ()) -> WideCompileError:
    packed = _packed_sequence_use(model, e)
    if packed is not None:
        return packed
    what = f"wide_compiler: torch.export could not capture {type(model).__name__}: {type(e).__name__}: {e}\n"
    if compiling:
        what += (f"The forward asks torch.compiler.is_compiling() ({'; '.join(dict.fromkeys(compiling))}): the "
                 "capture follows the branch each member takes when called alone (the answer False, Note [What "
                 "export does not capture] in fx/capture.py), and that branch is what failed above.\n")
    if "dynamic_shapes" in str(e) or "tree_name" in str(e):
        return WideCompileError(
            what + "What to do: the dynamic_shapes given to torch.export do not match the forward's "
            "inputs. Pass compile(..., dynamic_shapes=...) nested exactly as the forward's parameters "
            "(one entry per parameter; for a forward(*args) a tuple under the parameter's name), or leave "
            "it out: compile() then marks dim 0 of every input dynamic itself, for *args and **kwargs "
            "forwards too.")
    return WideCompileError(
        what + "What to do: make the forward exportable (no data-dependent Python control flow on "
        "tensor values: use torch.cond, or restructure), register a wide form for the "
        "offending module with @wide_compiler.register(ModuleType) so it is kept whole, or "
        "pass dynamic_shapes= to compile() if the batch is not dim 0 of every input.")


def _packed_sequence_use(model: nn.Module, e: BaseException) -> WideCompileError | None:
    """The error for a forward that made a ``PackedSequence`` (``pack_padded_sequence``,
    ``pack_sequence``) when capture failed on it (export's own error names neither), or None: the
    frames of the failure are searched for one holding a PackedSequence."""
    from torch.nn.utils.rnn import PackedSequence

    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        frames = list(traceback.walk_tb(e.__traceback__))
        for k in reversed(range(len(frames))):  # the innermost frame that holds one
            frame = frames[k][0]
            if not any(isinstance(v, PackedSequence) for v in frame.f_locals.values()):
                continue
            user = [(f, line) for f, line in frames[:k + 1] if is_user_file(f.f_code.co_filename)]
            where = "<no source line recorded>"
            if user:
                f, line = user[-1]
                where = location(f.f_code.co_filename, line, f.f_code.co_name)
            owner = frame.f_locals.get("self")
            path = next((name for name, m in model.named_modules() if m is owner), None) \
                if isinstance(owner, nn.Module) else None
            module = f" (module {path or 'the model'!r}, {type(owner).__name__})" if path is not None else ""
            return WideCompileError(
                f"wide_compiler: cannot capture {type(model).__name__}: its forward uses a "
                f"torch.nn.utils.rnn.PackedSequence (from pack_padded_sequence / pack_sequence) at "
                f"{where}{module}.\n"
                "Why: a PackedSequence's layout (batch_sizes, sorted indices) is computed from the values "
                "of the lengths, which torch.export cannot trace (it runs the forward on fake tensors, "
                "and every member must run the same program whatever its lengths).\n"
                "What to do: run the recurrent layer on the padded batch and mask the padding instead: "
                "out, _ = self.rnn(x); take each sequence's last valid step with "
                "out[torch.arange(x.shape[0]), lengths - 1] (batch_first, one direction), or multiply "
                "out by a mask (torch.arange(T) < lengths[:, None]); or keep the module whole with "
                "@wide_compiler.register(ModuleType).")
        e = e.__cause__ or e.__context__
    return None
