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
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.export import ExportedProgram
from torch.utils._pytree import tree_map

from ..config import WideConfig
from ..errors import UnsupportedOperationError
from ..measure import Progress, Stopwatch
from ..registry import opaque_template, registered_paths
from ..tuning import choose_strategies
from . import compile_cache
from .capture import SpecialisationLog, capture, check_sample, flat_signature
from .constants import ConstantPlan, conjoin_guards, plan_constants
from .eval_rewrites import (attention_kernel, fuse_residual_norms, pool_before_relu, relu_in_place,
                            rewrite_channels_last)
from .fold import fold_batch_norms
from .guards import Guards, guards_of
from .forms import apply_capture_forms
from .fast_paths import warn_nested_tensor_fast_path
from .global_modules import check_global_modules
from .layout import plan_layout
from .member_checks import check_members
from .member_runs import check_run_members, check_traced_members
from .model_check import check_tuning
from .state import WideState, check_state, stack_state
from .tiling import tile_members
from .widen import WideGraph, check_ranks, widen

__all__ = ["COMPILE_LOCK", "PASSES", "Compilation", "Pass", "compile_members", "keep_strategies", "recapture",
           "run_cached", "run_pipeline"]

log = logging.getLogger(__name__)
COMPILE_LOCK = threading.RLock()  # export is not thread-safe: one compile at a time
PROGRESS_AFTER_S = 2.0  # Note [No silent pauses] (measure/progress.py): a run this long says what it does
# capture template -> its member's forward time (check_programs), for the budget of the other
# mode's graph (Note [Tuning that pays for itself] in tuning.py)
_MEMBER_SECONDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclasses.dataclass
class Compilation:
    """The state the passes share: inputs first, then what each pass produces."""

    model: nn.Module  # what is captured: member 0 (registered modules made opaque), in its mode
    sample: tuple[tuple, dict]  # one member's (args, kwargs)
    n: int
    config: WideConfig
    members: Sequence[nn.Module] | None = None  # all members, for the member checks (None: skip)
    dynamic_shapes: Any = None
    # flat input index -> more dims captured dynamic (Note [Dynamic sizes on demand] in model_calls.py)
    extra_dims: dict[int, frozenset[int]] = dataclasses.field(default_factory=dict)
    # flat input index -> the only dims captured dynamic, the sample's sizes kept as they are (a
    # graph for the inputs of one call that the other graphs' guards refuse: Note [Guards])
    exact_dims: dict[int, frozenset[int]] | None = None
    grad_enabled: bool = True  # the grad mode of the capture (Note [Guards]: a forward that reads it)
    opaque_paths: dict[str, str] = dataclasses.field(default_factory=dict)  # opaque key -> path
    # per-member constants {attribute path: N values} (check_members finds them; Note [Per-member
    # constants] in fx/constants.py) and where the graph reads them (check_programs)
    constants: dict[str, tuple] | None = None
    constant_plan: ConstantPlan | None = None
    # configurations of the constants the model's other graphs proved, {attribute path: value} each:
    # proved for this graph too where they can be (Note [Configurations proved before] in fx/constants.py)
    earlier_constants: tuple = ()
    # where the wide parameters live (strategies are measured there); default: the model's
    dtype: torch.dtype | None = None
    device: torch.device | None = None
    # the wide state the graph runs on (fx/state.py): stacked from the members by stack_state at
    # the first compile; the model's live tensors when it compiles its other train/eval mode
    state: WideState | None = None
    # produced by the passes
    ep: ExportedProgram | None = None
    wide: WideGraph | None = None
    layout: dict[str, int] | None = None  # {"conversions": k, "packed_ops": m}
    folded: int = 0  # eval BatchNorms folded into their conv or Linear
    # Note [Member tiles]: the tile of the graph this one replaces (a capture for new sizes keeps
    # it without measuring); None: config.member_tile, else measured
    member_tile: int | None = None
    specialised: SpecialisationLog | None = None  # where export fixed sizes (with extra_dims)
    guards: Guards | None = None  # what the capture assumes of the inputs (Note [Guards] in fx/guards.py)
    timings: dict[str, dict[str, float] | None] = dataclasses.field(default_factory=dict)
    log: list[tuple[str, float]] = dataclasses.field(default_factory=list)  # (pass, seconds) run
    # one member's eager forward on the sample, seconds (check_programs times it): the tuning
    # budget follows the graph's run time (Note [Tuning that pays for itself] in tuning.py)
    member_seconds: float | None = None
    # Note [The compile cache] (fx/compile_cache.py): the key of a compilation run by run_cached
    # that missed (the model stores the result under it), and on a hit what the model reads of
    # the capture, which is then not made (``ep`` stays None)
    cache_key: str | None = None
    cached: compile_cache.CachedCapture | None = None
    # Note [Tuning after the first runs] (tuning.py): the strategy pass leaves the measuring for
    # after the graph's first runs (per config.tune_after_runs); the model's later run sets False
    defer_tuning: bool = True

    @property
    def training(self) -> bool:
        return self.model.training

    @classmethod
    def of_members(cls, members: Sequence[nn.Module], sample_args: tuple, sample_kwargs: dict | None = None,
                   *, config: WideConfig, dynamic_shapes: Any = None) -> Compilation:
        """The first compilation of ``members``, in member 0's train/eval mode: what is captured
        is a copy of member 0 whose modules with a registered wide form are opaque calls (and
        whose modules with a capture form use it, fx/forms.py); the sample is detached."""
        _refuse_derived_tensors(members)
        template = members[0]
        detach = lambda a: a.detach() if isinstance(a, torch.Tensor) else a  # noqa: E731
        sample = tree_map(detach, (tuple(sample_args), dict(sample_kwargs or {})))
        capture_model, opaque_paths = opaque_template(template, registered_paths(template),
                                                      forms=apply_capture_forms, memo=aliases(template))
        return cls(capture_model.train(template.training), sample, len(members), config, members=members,
                   dynamic_shapes=dynamic_shapes, opaque_paths=opaque_paths)


def _refuse_derived_tensors(members: Sequence[nn.Module]) -> None:
    """Note [Tensors a hook computes on a module]: refuse, naming the member, the module and the
    attribute, a module attribute that is a non-leaf tensor (``torch.nn.utils.prune``'s pruned
    weight, the old ``torch.nn.utils.weight_norm``'s weight), before anything copies a member."""
    from torch.nn.utils import prune

    for i, member in enumerate(members):
        for path, mod in member.named_modules(remove_duplicate=False):
            for name, v in vars(mod).items():
                if not isinstance(v, torch.Tensor) or v.is_leaf:
                    continue
                where = f"module '{path}' ({type(mod).__name__})" if path else f"the model ({type(mod).__name__})"
                pruned = any(isinstance(h, prune.BasePruningMethod) for h in mod._forward_pre_hooks.values())
                if pruned:
                    why = (f"its '{name}' is pruned with torch.nn.utils.prune (a forward pre-hook computes it "
                           f"as {name}_orig * {name}_mask). wide_compiler fuses parameters and buffers, not "
                           f"tensors a hook computes: make the pruning permanent on each member first, "
                           f"torch.nn.utils.prune.remove(module, '{name}') (the zeros stay in the weight; "
                           f"training no longer keeps them zero), then compile")
                else:
                    why = (f"its attribute '{name}' is a tensor computed by autograd (not a parameter or "
                           f"buffer), as a forward pre-hook such as the old torch.nn.utils.weight_norm "
                           f"leaves it. wide_compiler fuses parameters and buffers, not tensors a hook "
                           f"computes: remove the hook (torch.nn.utils.remove_weight_norm, or compute "
                           f"the tensor in the forward) before compiling")
                raise UnsupportedOperationError(f"wide_compiler: member {i}'s {where}: {why}")


# Note [Tensors a hook computes on a module]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch.nn.utils.prune (and the old weight_norm) replace a parameter by ``<name>_orig`` (a
# parameter) and ``<name>_mask`` (a buffer) and keep ``<name>`` as a plain attribute that a forward
# pre-hook recomputes from them: a non-leaf tensor. copy.deepcopy refuses it (the capture copy of
# member 0, registry.opaque_template), which crashed compile with torch's "Only Tensors created
# explicitly by the user (graph leaves) support the deepcopy protocol" (probe 6 of issue 44, F10),
# saying nothing of pruning. Such tensors are refused first, by member and module, with what to do.


def aliases(template: nn.Module) -> dict[int, torch.Tensor]:
    """A ``copy.deepcopy`` memo giving the capture copy of member 0 new tensor objects on member
    0's own storage (Note [The capture copy shares member 0's storage]): ``nn.Parameter`` and plain
    buffers; other tensor types (and buffers with attributes of their own, or requiring grad) are
    deep-copied."""
    memo: dict[int, torch.Tensor] = {}
    for named in (template.named_parameters, template.named_buffers):
        for _, t in named(remove_duplicate=False):
            if id(t) in memo:
                continue
            # members made inside torch.inference_mode hold inference tensors, which cannot require
            # grad outside it (the pipeline runs outside: model.py's outside_inference_mode): an
            # ordinary copy of their values (probe 9 of issue 44, P9-7)
            own = t.clone() if t.is_inference() else t.detach()
            if type(t) is nn.Parameter:  # (Parameter.__deepcopy__ keeps the values and requires_grad only)
                memo[id(t)] = nn.Parameter(own, requires_grad=t.requires_grad)
            elif type(t) is torch.Tensor and not t.requires_grad and not getattr(t, "__dict__", None):
                memo[id(t)] = own
    return memo


# Note [The capture copy shares member 0's storage]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The capture model (and the wide model's ``_template``, which shares its tensors: model.py's
# ``_shared_tensors``) is a copy of member 0 whose parameters and buffers are new tensor objects on
# member 0's storage, not clones: cloning them was a quarter of a warm compile of BERT-base (0.5 s
# of 2 s CPU, 440 MB). Nothing reads their values: export lifts parameters and buffers as inputs
# and traces them as fake tensors (a real one is never written: a train-mode BatchNorm's update
# is an output of the graph), the guards read their dtype and device, and ``member``/``unfuse``
# load the stacked values into their copies. Nothing writes them either; the user's own objects
# (the Parameter objects, their ``.data`` rebinding by ``.to()``) stay theirs.


@dataclasses.dataclass(frozen=True)
class Pass:
    """A named pass: ``run`` mutates the :class:`Compilation`; ``requires`` names the fields it
    reads (checked before), ``check`` validates its result (after); ``when`` (if given) says
    whether it applies to this compilation (skipped, and not logged, where it does not)."""

    name: str
    run: Callable[[Compilation], None]
    requires: tuple[str, ...] = ()
    check: Callable[[Compilation], None] | None = None
    when: Callable[[Compilation], bool] | None = None


def _check_members(c: Compilation) -> None:
    if c.members is not None:
        c.constants = check_members(c.members) or c.constants


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
    Pass("check_members", _check_members),
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


def _bad(name: str, why: str) -> None:
    raise AssertionError(f"wide_compiler: pass {name!r}: {why}")


def run_pipeline(c: Compilation, passes: Sequence[Pass] = PASSES) -> Compilation:
    """Run ``passes`` in order on ``c`` (under the compile lock, with grad mode on: a training
    graph's tuning and model-level check run backward, whatever the caller's grad mode); returns
    ``c``. The random number generators (CPU, and every CUDA device once CUDA is initialised) are
    restored afterwards: measuring draws random inputs, and whether a compile measures or reads
    the strategy cache must not change the caller's random stream."""
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    what = (f"compiling the {'train' if c.training else 'eval'} graph of {type(c.model).__name__} (N={c.n})"
            + (" for new input sizes" if c.exact_dims is not None or c.extra_dims else ""))
    with COMPILE_LOCK, torch.enable_grad(), torch.random.fork_rng(devices=cuda), \
            Progress(what, after=PROGRESS_AFTER_S) as progress:  # Note [No silent pauses]
        for p in passes:
            if p.when is not None and not p.when(c):
                continue
            missing = [f for f in p.requires if getattr(c, f) is None]
            if missing:
                _bad(p.name, f"needs {', '.join(missing)}, which no earlier pass produced")
            progress.step(p.name)
            watch = Stopwatch()
            p.run(c)
            if p.check is not None:
                p.check(c)
            c.log.append((p.name, watch.seconds))
            log.debug("wide_compiler: pass %s took %.3f s", p.name, c.log[-1][1])
    return c


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


def stack_members(members: Sequence[nn.Module], sample_args: tuple, sample_kwargs: dict | None = None,
                  *, config: WideConfig, dynamic_shapes: Any = None) -> Compilation | None:
    """The first compilation of ``members`` without a capture (``WideConfig(defer=True)``, Note
    [Running the members until compiling pays] in model_deferred.py): the members checked
    (``check_members``) and their state stacked; no graph. None where they cannot run deferred:
    one member, per-member constants, registered wide forms."""
    if len(members) < 2:
        return None
    c = Compilation.of_members(members, sample_args, sample_kwargs, config=config, dynamic_shapes=dynamic_shapes)
    if c.opaque_paths:
        return None
    run_pipeline(c, [p for p in PASSES if p.name == "check_members"])
    if c.constants:
        return None
    stack_state(c)
    return c
