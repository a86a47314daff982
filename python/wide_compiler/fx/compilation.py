"""What the compiler's passes share (:class:`Compilation`), how they run (:func:`run_passes`) and
the compilation a deferred model starts from (:func:`stack_members`), without the passes
themselves (fx/pipeline.py): a model built with ``WideConfig(defer=True)`` runs its members
until compiling pays (Note [Running the members until compiling pays] in model_deferred.py), and
imports the capture, the rules and the compile cache only then (issue 45: the import of the
compiler was a third of a short Lightning fit)."""
from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..config import WideConfig
from ..errors import UnsupportedOperationError
from ..measure import Progress, Stopwatch
from ..registry import opaque_template, registered_paths
from .forms import apply_capture_forms
from .member_checks import check_members
from .state import stack_state

if TYPE_CHECKING:
    from torch.export import ExportedProgram

    from .capture import SpecialisationLog
    from .compile_cache import CachedCapture
    from .constants import ConstantPlan
    from .guards import Guards
    from .state import WideState
    from .widen import WideGraph

__all__ = ["CHECK_MEMBERS", "COMPILE_LOCK", "Compilation", "Pass", "aliases", "run_passes", "stack_members"]

log = logging.getLogger("wide_compiler.fx.pipeline")  # the passes' records under one name


# Note [The compiler imported when it compiles]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A short Lightning fit of three small members (10 steps, 0.12 s run one after the other) spent
# about 55 ms importing wide_compiler, 26 of them in the capture, the rules, padding and the
# compile cache, which its deferred model never runs (Note [Running the members until compiling pays] in
# model_deferred.py). So the model and the API import this module (the compilation the passes
# share, the lock, and the member checks and stacking a deferred model starts from), and import
# fx/pipeline.py, fx/compile_cache.py, fx/padding.py and the trust check's harness inside the
# functions that compile, pad, store or validate (``import wide_compiler.api``: 43 ms to 17 ms).
# A graph only exists once one of those has run, so a call that uses one imports nothing new.

COMPILE_LOCK = threading.RLock()  # export is not thread-safe: one compile at a time
PROGRESS_AFTER_S = 2.0  # Note [No silent pauses] (measure/progress.py): a run this long says what it does


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
    cached: CachedCapture | None = None
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


CHECK_MEMBERS = Pass("check_members", _check_members)  # the first pass of every compilation


def _bad(name: str, why: str) -> None:
    raise AssertionError(f"wide_compiler: pass {name!r}: {why}")


def run_passes(c: Compilation, passes: Sequence[Pass]) -> Compilation:
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
    run_passes(c, [CHECK_MEMBERS])
    if c.constants:
        return None
    stack_state(c)
    return c
