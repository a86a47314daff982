"""The compiler pipeline: N members -> one wide graph, as named passes run from an explicit list.

    check_members -> capture -> check_programs -> widen -> [eval graphs: fold_linear_batch_norms]
        -> layout -> [eval graphs: fold_batch_norms -> channels_last -> pool_before_relu
            -> fuse_residual_norms -> relu_in_place -> attention_kernel] -> strategies
        -> [with the members: stack_state] -> [with a state: check_tuning]
        -> [with a state, or a tile asked for: tile_members]

Each pass is an ordinary function of a :class:`Compilation` (what the passes read and write) with
a check before (what it needs is there) and after (its result is well formed), in the style of
torch.fx's pass infrastructure; a pass with a ``when`` predicate runs only where it holds (the
eval rewrites: fx/fold.py and fx/eval_rewrites.py; the wide state: fx/state.py, stacked from
the members; the model-level tuning check: fx/model_check.py, which runs the graph on that
state; member tiles: fx/tiling.py, which widens the capture again for chunks of members). :func:`wide_compiler.compile` runs the pipeline on the members
(:func:`compile_members`) and builds the :class:`~wide_compiler.WideModel` from the result; the
model runs the pipeline again, lazily, for its other train/eval mode (giving its live tensors as
the state). Both go through :func:`run_cached`, the persistent compile cache (Note [The compile
cache] in fx/compile_cache.py: a hit runs ``check_members`` and ``stack_state`` on a stored graph
instead of the other passes). The model only holds the state, runs the graph and answers inspection. Runs are
serialised by one lock: export is not thread-safe, and a failed run leaves nothing behind (the
model builds a new :class:`Compilation` per run).

Example:
    >>> import torch
    >>> from wide_compiler import WideConfig
    >>> from wide_compiler.fx.pipeline import Compilation, run_pipeline
    >>> models = [torch.nn.Linear(4, 2) for _ in range(3)]
    >>> c = run_pipeline(Compilation(models[0], ((torch.randn(5, 4),), {}), n=3,
    ...                              config=WideConfig.fast(), members=models))
    >>> [name for name, _ in c.log]  # a training graph: the eval rewrites do not run
    ['check_members', 'capture', 'check_programs', 'widen', 'layout', 'strategies', 'stack_state', 'check_tuning', 'tile_members']
    >>> c.wide.graph_module.graph.find_nodes(op="call_function", target=torch.ops.wide.linear.default)[0].kwargs
    {'strategy': 'bmm'}
    >>> c.state.parameters["weight"].shape  # the members' weights, stacked
    torch.Size([3, 2, 4])
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.export import ExportedProgram

from ..config import WideConfig
from ..measure import Stopwatch
from ..tuning import choose_strategies
from . import compile_cache
from .capture import SpecialisationLog, capture, check_sample, flat_signature
from .compilation import (CHECK_MEMBERS, COMPILE_LOCK, PROGRESS_AFTER_S, Compilation, Pass, _bad, aliases,
                          run_passes, stack_members)
from .constants import conjoin_guards, plan_constants
from .eval_rewrites import (attention_kernel, fuse_residual_norms, pool_before_relu, relu_in_place,
                            rewrite_channels_last)
from .fold import fold_batch_norms
from .guards import Guards, guards_of
from .fast_paths import warn_nested_tensor_fast_path
from .global_modules import check_global_modules
from .layout import plan_layout
from .member_runs import check_run_members, check_traced_members
from .model_check import check_tuning
from .state import WideState, check_state, stack_state
from .tiling import tile_members
from .widen import WideGraph, check_ranks, widen

# Compilation, run_pipeline and stack_members live in fx/compilation.py (a deferred model needs
# only them); they are this module's too, where the pipeline has always been imported from
__all__ = ["COMPILE_LOCK", "PASSES", "PROGRESS_AFTER_S", "Compilation", "Pass", "aliases", "compile_members",
           "keep_strategies", "recapture", "run_cached", "run_pipeline", "stack_members"]

log = logging.getLogger(__name__)
# capture template -> its member's forward time (check_programs), for the budget of the other
# mode's graph (Note [Tuning that pays for itself] in tuning.py)
_MEMBER_SECONDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _capture(c: Compilation) -> None:
    """Member 0 runs eagerly on the sample first (at the first compile, when the members are
    there), so a wrong sample gets PyTorch's own error; then export. With ``extra_dims`` the
    capture records where export fixed a size (``c.specialised``) for the error that names it."""
    args, kwargs = c.sample
    check_global_modules(c.model)  # Note [A module held as a global]
    warn_nested_tensor_fast_path(c.model)  # Note [TransformerEncoder's nested-tensor fast path]
    if c.members is not None:
        check_sample(c.members[0], args, kwargs, c.n)
    with torch.set_grad_enabled(c.grad_enabled):
        if c.exact_dims is not None:
            c.ep = capture(c.model, args, kwargs, exact_dims=c.exact_dims)
        elif not c.extra_dims or c.dynamic_shapes is not None:
            c.ep = capture(c.model, args, kwargs, dynamic_shapes=c.dynamic_shapes)
        else:
            with SpecialisationLog() as c.specialised:
                c.ep = capture(c.model, args, kwargs, extra_dims=c.extra_dims)
    c.guards = guards_of(c.ep, c.model, c.sample, c.n, flat_signature(c.model, tuple(args), dict(kwargs)))


def _check_programs(c: Compilation) -> None:
    """After a successful capture (so the forward has no data-dependent branches): run every
    member (``run_members``; registered modules run their own per-member Python, which may
    branch, so not then) and/or export every member (``trace_members``) and compare programs.
    Per-member constants are traced with each member's values (fx/constants.py)."""
    if c.constants:
        def trace(model: nn.Module) -> ExportedProgram:
            args, kwargs = c.sample
            with torch.set_grad_enabled(c.grad_enabled):
                if c.exact_dims is not None:
                    return capture(model, args, kwargs, exact_dims=c.exact_dims)
                if not c.extra_dims or c.dynamic_shapes is not None:
                    return capture(model, args, kwargs, dynamic_shapes=c.dynamic_shapes)
                return capture(model, args, kwargs, extra_dims=c.extra_dims)

        def guards(probe: ExportedProgram) -> Guards:  # as _capture makes member 0's
            args, kwargs = c.sample
            return guards_of(probe, c.model, c.sample, c.n, flat_signature(c.model, tuple(args), dict(kwargs)))

        c.constant_plan = plan_constants(c.model, c.ep, trace, c.constants, c.opaque_paths, guards_of=guards,
                                         earlier=c.earlier_constants)
        # Note [Every configuration's guards] (fx/constants.py): the graph holds only where every
        # configuration's capture does
        c.guards = conjoin_guards(c.guards, c.constant_plan.probe_guards)
    if c.members is None or len(c.members) < 2:
        return
    if c.config.run_members and not c.opaque_paths:
        c.member_seconds = check_run_members(c.members, *c.sample, constants=c.constants)
        if c.member_seconds is not None:
            _MEMBER_SECONDS[c.model] = c.member_seconds
    if c.config.trace_members:
        check_traced_members(c.members, *c.sample, c.dynamic_shapes, ref=c.ep, constants=c.constants)


def _widen(c: Compilation) -> None:
    c.wide = widen(c.ep, c.n, strict=c.config.strict, opaque_paths=c.opaque_paths,
                   per_member_args=c.constant_plan.args if c.constant_plan is not None else None)
    c.wide.guards = c.guards
    c.wide.no_backward = getattr(c.ep, "wide_no_backward", None)  # Note [An eval graph whose backward is not ...]


def _dtype_device(c: Compilation) -> tuple[torch.dtype, torch.device]:
    """What the wide graph runs in: the compilation's dtype and device, else the model's."""
    ref = next(c.model.parameters(), None)
    return (c.dtype or (ref.dtype if ref is not None else torch.get_default_dtype()),
            c.device or (ref.device if ref is not None else torch.device("cpu")))


def _layout(c: Compilation) -> None:
    c.layout = plan_layout(c.wide.graph_module.graph, c.n, c.ep.graph, training=c.training,
                           device=_dtype_device(c)[1].type)


def _fold_batch_norms(c: Compilation) -> None:  # Note [Folding BatchNorm into the conv]
    c.folded += fold_batch_norms(c.wide.graph_module)


def _fold_linear_batch_norms(c: Compilation) -> None:  # before the layout plan packs them
    c.folded += fold_batch_norms(c.wide.graph_module, into=torch.ops.wide.linear.default)


def _eval_only(c: Compilation) -> bool:
    """The eval rewrites hold without gradients, or for eval-mode operators only."""
    return not c.training


def _eval_rewrite(name: str, rewrite: Callable[[torch.fx.GraphModule], int]) -> Pass:
    """An eval-graph rewrite of fx/eval_rewrites.py as a pass."""
    return Pass(name, lambda c: rewrite(c.wide.graph_module), ("wide",), check=_lint, when=_eval_only)


def _strategies(c: Compilation) -> None:
    dtype, device = _dtype_device(c)
    member = c.member_seconds if c.member_seconds is not None else _MEMBER_SECONDS.get(c.model)
    run = None if member is None else member * c.n * (3 if c.training else 1)  # a train graph: + backward
    c.timings = choose_strategies(c.wide.graph_module.graph, c.n, c.config, training=c.training,
                                  dtype=dtype, device=device, run_seconds=run, defer=c.defer_tuning)


def _lint(c: Compilation) -> None:
    c.wide.graph_module.graph.lint()


def _lint_and_check_ranks(c: Compilation) -> None:
    _lint(c)
    check_ranks(c.wide, c.n, member=c.ep)


def _all_chosen(c: Compilation) -> None:
    for node in c.wide.graph_module.graph.nodes:
        if "wide_tune" in node.meta and node.kwargs.get("strategy") in (None, "auto"):
            raise AssertionError(f"wide_compiler: strategy pass left node '{node.name}' without a strategy")
    c.wide.graph_module.recompile()


PASSES: tuple[Pass, ...] = (
    CHECK_MEMBERS,
    Pass("capture", _capture, ("model", "sample"),
         check=lambda c: isinstance(c.ep, ExportedProgram) or _bad("capture", "no ExportedProgram")),
    Pass("check_programs", _check_programs, ("ep",)),
    Pass("widen", _widen, ("ep",), check=_lint_and_check_ranks),
    Pass("fold_linear_batch_norms", _fold_linear_batch_norms, ("wide",), check=_lint, when=_eval_only),
    Pass("layout", _layout, ("ep", "wide"), check=_lint),
    Pass("fold_batch_norms", _fold_batch_norms, ("wide",), check=_lint, when=_eval_only),
    _eval_rewrite("channels_last", rewrite_channels_last),  # Note [Channels-last max pooling]
    _eval_rewrite("pool_before_relu", pool_before_relu),  # Note [Max pool before ReLU]
    _eval_rewrite("fuse_residual_norms", fuse_residual_norms),
    _eval_rewrite("relu_in_place", relu_in_place),
    _eval_rewrite("attention_kernel", attention_kernel),
    Pass("strategies", _strategies, ("wide",), check=_all_chosen),
    Pass("stack_state", stack_state, ("wide",), check=check_state,
         when=lambda c: c.members is not None and c.state is None),
    Pass("check_tuning", check_tuning, ("wide", "state"), when=lambda c: c.state is not None),
    Pass("tile_members", lambda c: tile_members(c, lambda k: _chunk_graph(c, k)), ("ep", "wide"),
         when=lambda c: c.n > 1 and (c.state is not None or (c.member_tile or c.config.member_tile or 0) > 0)),
)
# the passes that make a graph of the members from the capture (what a chunk of members runs)
_CHUNK_PASSES = tuple(p for p in PASSES if p.name not in (
    "check_members", "capture", "check_programs", "stack_state", "check_tuning", "tile_members"))


def _chunk_graph(c: Compilation, k: int) -> WideGraph:
    """The graph of ``k`` of ``c``'s members (Note [Member tiles]): widened from ``c``'s capture,
    with ``c``'s strategies."""
    sub = dataclasses.replace(c, n=k, config=c.config.replace(tune=False), members=None, state=None,
                              wide=None, layout=None, folded=0, timings={}, log=[], member_tile=0)
    run_pipeline(sub, _CHUNK_PASSES)
    keep_strategies(c.wide, sub.wide)
    return sub.wide


def keep_strategies(old: WideGraph, new: WideGraph) -> None:
    """Give the ops of ``new`` the strategies of ``old``'s ops of the same node name and wide op
    (the choices measured and checked at compile time); others keep what the strategy pass chose."""
    before = {n.name: n for n in old.graph_module.graph.nodes if "wide_tune" in n.meta}
    changed = False
    for node in new.graph_module.graph.nodes:
        prev = before.get(node.name)
        if prev is None or prev.meta.get("wide_op") != node.meta.get("wide_op") or "wide_tune" not in node.meta:
            continue
        name = prev.kwargs.get("strategy")
        if name in node.meta["wide_tune"].names and name != node.kwargs.get("strategy"):
            node.update_kwarg("strategy", name)
            if "wide_strategy_reason" in prev.meta:
                node.meta["wide_strategy_reason"] = prev.meta["wide_strategy_reason"]
            changed = True
    if changed:
        new.graph_module.recompile()


def recapture(c: Compilation, like: WideGraph, *, captured: bool = False) -> Compilation:
    """A graph of one mode made again for other inputs (Note [Dynamic sizes on demand] in
    model_calls.py, Note [Guards] in fx/guards.py): ``c`` (no members, no state) captured (unless
    ``captured``), widened and planned, its ops given the strategies of ``like``, the graph it
    replaces or sits beside (nothing is measured), then tiled as ``like`` is."""
    skip = ("check_members", "tile_members") + (("capture",) if captured else ())
    run_pipeline(c, [p for p in PASSES if p.name not in skip])
    keep_strategies(like, c.wide)
    return run_pipeline(c, [p for p in PASSES if p.name == "tile_members"])


def _taken_from(like: WideGraph) -> dict[str, Any]:
    """What :func:`recapture` takes from the graph it replaces (its ops' strategies by node and
    op, its member tile): the part of a recapture's compile cache key that says so."""
    return {"recapture_of": sorted((n.name, str(n.meta.get("wide_op")), str(n.kwargs.get("strategy")))
                                   for n in like.graph_module.graph.nodes if "wide_tune" in n.meta),
            "recapture_tile": like.member_tile}


def recapture_cached(c: Compilation, like: WideGraph, state: WideState) -> tuple[str | None, Compilation | None]:
    """A recapture (:func:`recapture` of ``c``, which has no members) through the compile cache
    (Note [The compile cache] in fx/compile_cache.py): its key is ``c``'s (which holds the dims
    made dynamic, ``extra_dims``) and what it takes from ``like``. Returns ``(key, hit)``: ``hit``
    the loaded compilation when the entry is there and fits ``state`` (the model's live state),
    else None; the caller recaptures and, when every new dim came out dynamic, sets
    ``c.cache_key = key`` for the model to store the result (a dim export fixes raises at the
    call: such a graph is not stored, so a hit never hides that error)."""
    if not compile_cache.enabled(c.config):
        return None, None
    with COMPILE_LOCK:
        watch = Stopwatch()
        key = compile_cache.key_of(c, extra=_taken_from(like))
        body = compile_cache.load(c, key) if key is not None else None
        if body is None:
            return key, None
        hit = dataclasses.replace(c, log=list(c.log), state=state)
        _from_cache(hit, body)
        why = compile_cache.check_loaded(hit, body)
        if why is not None:
            log.warning("wide_compiler: ignoring the compile cache entry %s (%s); compiling afresh",
                        body["path"], why)
            return key, None
        hit.state = None  # the model's own, as a recapture's
        hit.log.append(("compile_cache", watch.seconds))
        log.info("wide_compiler: recaptured %s graph loaded from the compile cache %s in %.2f s",
                 "train" if c.training else "eval", body["path"], watch.seconds)
        return key, hit


def run_pipeline(c: Compilation, passes: Sequence[Pass] = PASSES) -> Compilation:
    """Run ``passes`` (default: the whole pipeline) in order on ``c``; returns ``c``
    (:func:`~wide_compiler.fx.compilation.run_passes`: under the compile lock, with grad mode on,
    the random number generators restored afterwards)."""
    return run_passes(c, passes)


def _from_cache(c: Compilation, body: dict) -> None:
    c.wide, c.guards, c.constant_plan = body["wide"], body["guards"], body["constant_plan"]
    c.layout, c.folded, c.timings = body["layout"], body["folded"], body["timings"]
    c.member_tile = c.wide.member_tile
    c.cached = compile_cache.CachedCapture(body["constants"], body["ranges"], body["path"])


def run_cached(c: Compilation) -> Compilation:
    """The whole pipeline on ``c`` through the compile cache (Note [The compile cache] in
    fx/compile_cache.py): ``check_members`` first (it finds the per-member constants the key
    holds), then, on a hit, the loaded graph with the members' stacked state, checked to fit it
    (a misfit is ignored with one warning and compiled afresh); on a miss every other pass, and
    ``c.cache_key`` set for the model to store the result under. With the cache off (or ``c``
    not cacheable), :func:`run_pipeline` as it is."""
    if not compile_cache.enabled(c.config):
        return run_pipeline(c)
    with COMPILE_LOCK:
        run_pipeline(c, [p for p in PASSES if p.name == "check_members"])
        watch = Stopwatch()
        key = compile_cache.key_of(c)
        body = compile_cache.load(c, key) if key is not None else None
        if body is not None:
            hit = dataclasses.replace(c, log=list(c.log))
            _from_cache(hit, body)
            # check_programs is the entry's: every member's digest is in the key (why the members
            # need not run again: Note [The compile cache])
            run_pipeline(hit, [p for p in PASSES if p.name == "stack_state"])
            why = compile_cache.check_loaded(hit, body)
            if why is None:
                hit.log.append(("compile_cache", watch.seconds))
                log.info("wide_compiler: %s graph loaded from the compile cache %s in %.2f s",
                         "train" if c.training else "eval", body["path"], watch.seconds)
                return hit
            log.warning("wide_compiler: ignoring the compile cache entry %s (%s); compiling afresh",
                        body["path"], why)
        c.cache_key = key
        return run_pipeline(c, [p for p in PASSES if p.name != "check_members"])


def compile_members(members: Sequence[nn.Module], sample_args: tuple, sample_kwargs: dict | None = None,
                    *, config: WideConfig, dynamic_shapes: Any = None) -> Compilation:
    """The whole pipeline on N members (:meth:`Compilation.of_members`): the members checked,
    member 0 captured and widened, its strategies chosen, the members' state stacked and the
    strategies checked on it (the model-level tuning check); through the compile cache
    (:func:`run_cached`: a hit skips all but the member checks and the stacking).
    :meth:`wide_compiler.WideModel._from_compilation` builds the model from the result."""
    return run_cached(Compilation.of_members(members, sample_args, sample_kwargs, config=config,
                                             dynamic_shapes=dynamic_shapes))
