"""Capture one member with ``torch.export``, with a dynamic batch dimension.

See DESIGN §2: non-strict export runs the model's real Python on fake tensors and yields ATen ops
with schemas; the batch dim (dim 0 of every tensor input) is marked ``Dim.AUTO`` so one wide model
serves any batch size. :func:`check_sample` runs member 0 on the sample first, so a sample it
cannot take fails with PyTorch's own error.

Whether all members are the same program is checked in fx/member_checks.py; where a node comes
from in the user's code is read in fx/source.py; what the forward does during export that the
graph cannot carry is recorded in fx/export_watch.py (Note [What export does not capture]);
:func:`check_sample` lives in fx/sample_check.py.

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
import inspect
import logging
import re
import sys
from typing import Any

import torch
from torch import nn
from torch.export import Dim, ExportedProgram
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..errors import WideCompileError
from .attribute_writes import AttributeWrites
from .code_reads import globals_read
from .capture_errors import capture_error, explicit_generator_error
from .export_aliases import NoneBuffersAsAttributes, NoOpConversionsCopied, copies_are_safe
from .export_watch import _Watch
from .hook_writes import refuse_writing_hooks
from .sample_check import check_sample
from .source import user_frame_and_module
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
    leaves) -> more dims to mark ``Dim.AUTO`` (Note [Dynamic sizes on demand] in model_calls.py).
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
    refuse_writing_hooks(model, None)  # before the capture runs them (Note [Hooks that write outside themselves])
    registered: set[str] = set()
    copies = True  # Note [A conversion that changes nothing] (fx/export_aliases.py)
    while True:
        watch, writes, checkpointed = _Watch(model), AttributeWrites(model), _CheckpointedUpdates(model)
        conversions = NoOpConversionsCopied(copies)
        try:
            with (NoneBuffersAsAttributes(model), _ForwardSignature(model, signature), without_cudnn(),
                  _RecurrentShapes(), _GlobalHooksSkipExportModules(), watch, writes, checkpointed, conversions):
                ep = torch.export.export(model, tuple(args), kwargs, dynamic_shapes=dynamic_shapes, strict=False)
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
            raise capture_error(model, e, getattr(watch, "compiling", ())) from e
        if conversions.count and not copies_are_safe(ep):  # the member's aliasing matters: capture as it is
            copies = False
            continue
        writes.check_buffers(_buffers_written(ep))  # Note [A buffer rebound in forward]
        writes.check(tuple(args), kwargs)  # Note [A forward that writes its module's attributes]
        checkpointed.check()  # Note [State updated inside a checkpoint]
        _refuse_generators(model, ep)  # our own refusal, not wrapped as export's
        # ours too: a custom Function or a backward hook (fx/export_watch.py); an eval graph's refuse a backward
        ep.wide_no_backward = watch.check(model)
        ep.wide_reads = watch.reads()  # Note [State a forward reads] (fx/state_reads.py)
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


def _buffers_written(ep: ExportedProgram) -> set[str]:
    """The buffers (full names) the graph writes: updates export records as outputs, and in-place
    writes into a buffer's placeholder (a root buffer rebound in forward becomes ``copy_``)."""
    sig = ep.graph_signature
    written = set(sig.buffers_to_mutate.values())
    for node in ep.graph.nodes:
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        if schema is not None and schema.is_mutable:
            for arg, a in zip(node.args, schema.arguments):
                if a.alias_info is not None and a.alias_info.is_write and isinstance(arg, torch.fx.Node):
                    written.add(sig.inputs_to_buffers.get(arg.name, ""))
    return written


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
        raise explicit_generator_error(model, uses)


# Note [Global hooks do not run on export's own modules]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch's global module hooks (``register_module_forward_pre_hook`` / ``_forward_hook``) run on
# every module call, and torch.export calls member 0 from inside a wrapper module of its own
# (``torch.export._trace``'s ``Wrapper``): a global pre-hook that scales the tensor arguments of
# every module ran on that wrapper and again on member 0, so the graph held the member's forward
# of 1.5 x where the member alone computes it of x (probe 5 of issue 44: 0.3 off). During the
# capture each such hook is replaced, in place (the tables keep their keys, so the guards on
# their registration still hold), by one that skips modules of torch.export's own classes, and
# put back afterwards; a hook registered or removed meanwhile is left as it is.
class _GlobalHooksSkipExportModules:
    """Note [Global hooks do not run on export's own modules]."""

    _TABLES = ("_global_forward_pre_hooks", "_global_forward_hooks")
    _EXPORT_MODULES = ("torch.export.", "torch._export.")

    def __enter__(self) -> None:
        module = sys.modules[nn.Module.__module__]
        self._saved: list[tuple[dict, Any, Any, Any]] = []
        for name in self._TABLES:
            table = getattr(module, name)
            for key, hook in list(table.items()):
                def skipping(m: nn.Module, *rest: Any, _hook: Any = hook) -> Any:
                    return None if type(m).__module__.startswith(self._EXPORT_MODULES) else _hook(m, *rest)
                table[key] = skipping
                self._saved.append((table, key, hook, skipping))

    def __exit__(self, *exc: Any) -> None:
        for table, key, hook, skipping in self._saved:
            if table.get(key) is skipping:
                table[key] = hook


# Note [State updated inside a checkpoint]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False)`` (torchvision's
# ``DenseNet(memory_efficient=True)``, ``checkpoint_sequential``, transformers' gradient
# checkpointing) saves no activations of ``fn`` and runs ``fn`` again in the backward to recompute
# them. Export captures the forward once, so the values and gradients are the members' (Note
# [Autograd contexts export drops] in fx/export_watch.py), but state ``fn`` updates is updated
# again by the recompute in each member alone: a BatchNorm in training inside it updates its
# running statistics twice per step (``num_batches_tracked`` + 2, momentum applied twice), the
# wide graph once (probe 8 of issue 44, P8-2: running_mean 0.06 off after one step, silently).
# Replaying the recompute's update is not exact in general (the recompute stops once the saved
# tensors are back, so an update after the last of them is not repeated), so the capture refuses:
# while export runs a non-reentrant checkpoint's block with gradients enabled (without them
# nothing is saved and nothing recomputed), :class:`_CheckpointedUpdates` records the buffers of
# the model whose version changes in the block (``num_batches_tracked.add_(1)``, a counter of
# the user's) and the running statistics ``torch.batch_norm``/``torch.instance_norm`` update there
# (their in-place update of a fake tensor bumps no version), and the capture raises naming the
# modules, the buffers and the line of the checkpoint. An eval graph (BatchNorm reads its
# statistics) and a capture under ``torch.no_grad()`` record nothing and are kept.
class _CheckpointedUpdates:
    """Note [State updated inside a checkpoint]: records, during the capture of ``model``, the
    buffers updated inside a non-reentrant checkpoint's block; :meth:`check` refuses the capture
    when there are any. Restores what it patches on exit."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.found: dict[str, str] = {}  # buffer name -> where the checkpoint was called
        self._stack: list[tuple[dict[str, int], str]] = []

    def _buffers(self) -> dict[int, str]:
        return {id(b): name for name, b in self.model.named_buffers()}

    def _enter(self, hook: Any) -> Any:
        if torch.is_grad_enabled():
            versions = {name: b._version for name, b in self.model.named_buffers()}
            self._stack.append((versions, user_frame_and_module()))
            hook._wide_watched = True
        return self._enter_base(hook)

    def _exit(self, hook: Any, *exc: Any) -> Any:
        if hook.__dict__.pop("_wide_watched", False):
            versions, where = self._stack.pop()
            for name, b in self.model.named_buffers():
                if name in versions and b._version != versions[name]:
                    self.found.setdefault(name, where)
        return self._exit_base(hook, *exc)

    def _norm(self, fn: Any, stats_at: int, training_at: int) -> Any:
        def norm(*args: Any, **kwargs: Any) -> Any:
            if self._stack and len(args) > training_at and args[training_at]:
                names = self._buffers()
                for t in args[stats_at: stats_at + 2]:
                    if isinstance(t, torch.Tensor) and id(t) in names:
                        self.found.setdefault(names[id(t)], self._stack[-1][1])
            return fn(*args, **kwargs)
        return norm

    def __enter__(self) -> None:
        from torch.utils import checkpoint

        self._hook_cls = getattr(checkpoint, "_checkpoint_hook", None)
        self._saved: list[tuple[Any, str, Any]] = []
        if self._hook_cls is None:  # another torch: nothing to watch
            return
        base = torch.autograd.graph.saved_tensors_hooks
        self._enter_base = lambda hook: base.__enter__(hook)  # looked up at the call: others may patch it
        self._exit_base = lambda hook, *exc: base.__exit__(hook, *exc)
        watcher = self
        patches = [(self._hook_cls, "__enter__", lambda hook: watcher._enter(hook)),
                   (self._hook_cls, "__exit__", lambda hook, *exc: watcher._exit(hook, *exc)),
                   # (input, weight, bias, running_mean, running_var, training / use_input_stats, ...)
                   (torch, "batch_norm", self._norm(torch.batch_norm, 3, 5)),
                   (torch, "instance_norm", self._norm(torch.instance_norm, 3, 5))]
        for owner, name, fn in patches:
            self._saved.append((owner, name, owner.__dict__.get(name, _MISSING)))
            setattr(owner, name, fn)

    def __exit__(self, *exc: Any) -> None:
        for owner, name, old in reversed(self._saved):
            if old is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)

    def check(self) -> None:
        """Refuse the capture when a buffer was updated inside a checkpoint's block (Note [State
        updated inside a checkpoint])."""
        if not self.found:
            return
        modules = dict(self.model.named_modules())
        grouped: dict[tuple[str, str], list[str]] = {}  # (module path, checkpoint's line) -> buffers
        for name, where in self.found.items():
            path, _, buffer = name.rpartition(".")
            grouped.setdefault((path, where), []).append(buffer)
        parts = [f"module '{path or '(root)'}' ({type(modules[path]).__name__ if path in modules else 'module'}: "
                 f"{', '.join(buffers)}), checkpoint {where}" for (path, where), buffers in grouped.items()]
        raise WideCompileError(
            f"wide_compiler: member 0 ({type(self.model).__name__}) updates buffers inside "
            f"torch.utils.checkpoint (use_reentrant=False) with gradients enabled: {'; '.join(parts)}. Each member "
            "alone runs the checkpointed block again in its backward and updates them a second time (a BatchNorm's "
            "running statistics twice per step); the wide graph runs the block once, so its buffers would differ "
            "from the members' (Note [State updated inside a checkpoint]).\n"
            "What to do: compile the members without activation checkpointing (torchvision: "
            "DenseNet(memory_efficient=False); transformers: gradient_checkpointing_disable()), which computes the "
            "same values and gradients; in eval mode (model.eval()) or under torch.no_grad() the model compiles as "
            "it is.")


_MISSING = object()


class _RecurrentShapes:
    """Note [Recurrent layers with a dynamic length]: export computes the output of
    ``aten.gru``/``lstm``/``rnn_tanh``/``rnn_relu`` (kept whole in its graph) by running torch's
    Python decomposition on fake tensors, which loops over the time steps (``input.unbind``)
    and so fixes the sequence length. Within the block those ops' Python kernels give the outputs
    by shape instead (the same shapes, made from every input so gradients flow as through the
    op); the graph still holds the one whole op, which the wide form runs on real tensors for
    whatever length it gets. Every capture uses them: the decomposition also gets shapes wrong
    (torch 2.11's LSTM on CUDA gave final states [L, 1, B, H] for [L, B, H], which the rank check
    then refused), and it unrolls every step on fake tensors for nothing. ``aten.gru_cell`` (no
    Python kernel of torch's) is given one too: on CUDA its C++ decomposition calls
    ``_thnn_fused_gru_cell``, which has no fake kernel, and export refused every GRUCell member on
    a GPU (torch 2.11 and 2.13). Restored afterwards (the kernels are process-wide)."""

    _KEYS = (torch._C.DispatchKey.CompositeImplicitAutograd, torch._C.DispatchKey.Autograd)

    def __enter__(self) -> None:
        aten = torch.ops.aten
        self._saved = []
        for op, fn in ((aten.gru.input, _rnn_shape), (aten.rnn_tanh.input, _rnn_shape),
                       (aten.rnn_relu.input, _rnn_shape), (aten.lstm.input, _lstm_shape),
                       (aten.gru_cell.default, _gru_cell_shape)):
            for key in self._KEYS:
                if key in op.py_kernels or op is aten.gru_cell.default:
                    self._saved.append((op, key, op.py_kernels.get(key, _MISSING)))
                    op.py_kernels[key] = fn
            op._dispatch_cache.clear()

    def __exit__(self, *exc: Any) -> None:
        for op, key, fn in self._saved:
            if fn is _MISSING:
                del op.py_kernels[key]
            else:
                op.py_kernels[key] = fn
            op._dispatch_cache.clear()


def _recurrent_out(input: torch.Tensor, hidden: int, bidirectional: bool, batch_first: bool,
                   tensors: list) -> torch.Tensor:
    # [B, T, D*H] / [T, B, D*H] keep dims 0 and 1 of the input whatever batch_first; unbatched [T, D*H]
    shape = [*input.shape[:-1], (2 if bidirectional else 1) * hidden]
    tie = sum(x.sum() for x in tensors) * 0  # every input feeds the result (autograd, as the op's)
    if batch_first and input.dim() == 3:  # ATen's: [T, B, D*H] transposed, not contiguous, which a
        # Linear after it reads (Note [A bias added after the product] in fx/rules/linear.py)
        return input.new_zeros([shape[1], shape[0], shape[2]]).transpose(0, 1) + tie
    return input.new_zeros(shape) + tie


def _rnn_shape(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    out = _recurrent_out(input, hx.shape[-1], bidirectional, batch_first, [input, hx, *params])
    return out, hx.new_zeros(hx.shape) + out.sum() * 0


def _lstm_shape(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    h, c = hx
    out = _recurrent_out(input, h.shape[-1], bidirectional, batch_first, [input, h, c, *params])
    tie = out.sum() * 0
    return out, h.new_zeros(h.shape) + tie, c.new_zeros(c.shape) + tie


def _gru_cell_shape(input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    tie = sum(t.sum() for t in (input, hx, w_ih, w_hh, b_ih, b_hh) if t is not None) * 0
    return hx.new_zeros(hx.shape) + tie


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
