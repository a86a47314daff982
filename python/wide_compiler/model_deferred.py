"""A wide model that has not compiled yet (``WideConfig(defer=True)``, mixed into
:class:`~wide_compiler.WideModel`): each member runs its own program on its slices of the stacked
tensors until compiling pays (Note [Running the members until compiling pays])."""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .errors import UnsupportedOperationError
from .fx.guards import same_input
from .fx.state import get_tensor
from .layouts import tag_layout
from .model_inputs import _in_order_of, _structure_error

__all__ = ["DeferredCompileMixin", "Deferred"]

log = logging.getLogger("wide_compiler.model")

# Note [Running the members until compiling pays]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A capture costs about half a second for the smallest model and seconds for a transformer; a
# short run never earns it back (issue 45: a 3-member, 10-step Lightning fit took 6x the three fits
# one after the other, all of it the two captures). With ``WideConfig(defer=True)`` the wide model
# is built without capturing: the members are checked (check_members: one architecture, no
# per-member constants) and their tensors stacked as a compile stacks them, and a call of a mode
# that has no graph yet runs each member's own module (our copy, never the user's) with its
# parameter and buffer slots swapped to member i's slices of the stacked tensors (``t[i]``: views,
# so gradients reach the stacked parameters' ``.grad`` and in-place buffer updates such as
# BatchNorm's running statistics reach the stacked buffers; a buffer the forward assigns anew is
# copied into its slice), then restored, and stacks the outputs. That is member i's program by
# construction, at any size, dtype or mode: nothing is assumed, so nothing needs a guard.
# Optimizers, state dicts and every member operation work on the stacked tensors and do not see
# the difference; the graph, once compiled, runs on the same tensors, so the switch moves nothing.
# (The slots are swapped by hand, once per module object: torch.func.functional_call restored a
# module held under two names, ``self.head = self.out``, with the slice left in it.)
#
# When to compile: a run that says how many more calls it will make in each mode
# (``WideModel.expect_calls``; the Lightning and transformers integrations do, from their
# trainers' step counts) compiles a mode's graph at the first call where
#     calls left x (measured seconds of a call, x3 for forward and backward) x (1 - 1/N)
#         > the compile's expected seconds,
# the saving taken as what a fused call of small members comes close to (the cost of one member's
# call: their ops are bound by per-op overhead; for large members the estimate is generous, and
# they compile sooner than they would need to). The expected compile: WARM_SECONDS when the compile
# cache holds the graph, else COLD_SECONDS + COLD_SECONDS_PER_MODULE per module of a member (cold
# captures on a 2-core machine: 0.5-0.7 s for an MLP step, 2-4 s for a 2-layer BERT). Two calls
# are measured before the first decision (the first pays one-off costs), the fastest kept. Without
# an expectation the first call compiles, as without ``defer``; so does every use that needs the
# graph (``summary``, ``tune``, ``export``, ``check_inputs``). A compile that pays but fails (an op
# the compiler refuses) leaves the members running their own programs, exact, with one warning
# naming the refusal, rather than ending a run that ran until then.
#
# Not deferred (compiled at once, as without ``defer``): one member; members with per-member
# constants (the graph reads them from ``_per_member`` buffers that a capture's constant plan
# makes, so the state dict would gain keys at the switch); registered wide forms (their state is a
# module of their own, not stacked tensors to slice); ``pad=True``, ``validate`` and
# ``compile_model`` (which run the graph at once). Under torch.compile, a mode without a graph is
# refused with what to do (modules whose slots are swapped per member are not a graph to trace).

# Note [Recurrent modules' flat weights]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# nn.RNNBase keeps its weights twice: as parameters, and in _flat_weights with weak references to
# them (_flat_weight_refs), which its forward checks and rebuilds when a parameter changed. A call
# with the slots swapped rebuilt them on the slices, and once the slots were put back the copy kept
# references to those dead slices, which the member checks of the first compile then compared
# between members (probe 14 of issue 44, P14-1: the switch refused GRU members as different
# architectures). After each call the flat weights are rebuilt on the copy's own parameters, as
# RNNBase.__setattr__ does when a weight is assigned.

def member_slice(t: torch.Tensor, i: int, *, param: bool) -> torch.Tensor:
    """``t[i]``, a view; off the CPU a parameter's slice that does not start on a 16-byte
    boundary is a (differentiable) copy, as a member's own parameter is an allocation of its own:
    CUDA's linear hands its bias to cuBLASLt unchecked (Note [A member's bias slice on the GPU] in
    csrc/wide/ops/linear.cpp).
    Buffers stay views: the forward's in-place updates must reach the stacked buffer.

    >>> t = torch.zeros(3, 27, device="meta")  # 27 float32 values: member 1 starts 108 bytes in
    >>> member_slice(t, 1, param=True).storage_offset(), member_slice(t, 1, param=False).storage_offset()
    (0, 27)
    """
    v = t[i]
    if param and t.device.type != "cpu" and (v.storage_offset() * v.element_size()) % 16:
        return v.clone()
    return v


MEASURED_CALLS = 2
WARM_SECONDS = 0.3
COLD_SECONDS = 0.4
COLD_SECONDS_PER_MODULE = 0.04


class Deferred:
    """What a deferred wide model keeps until its graphs are compiled: our copies of the members
    (each runs its own program), the calls each mode still expects, the fastest measured call of
    each mode, and whether the compile cache holds its graph."""

    def __init__(self, members: Sequence[nn.Module]) -> None:
        self.members = list(members)
        self.slots: list | None = None  # per member, where it holds its tensors (_slots), found at the first call
        self.rnns: list = []  # per member, its recurrent modules (Note [Recurrent modules' flat weights])
        self.checked = False  # whether a compile has run the member checks
        self.calls_left: dict[bool, int | None] = {True: None, False: None}
        self.seconds: dict[bool, float] = {}  # the fastest call measured
        self.calls: dict[bool, int] = {}  # calls run
        self.warm: dict[bool, bool] = {}  # whether the compile cache holds the mode's graph
        self.failed: dict[bool, str] = {}  # why a mode's compile, when it paid, failed (never tried again)
        self.lock = threading.Lock()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        del state["lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.lock = threading.Lock()


def deferred_members(members: Sequence[nn.Module], memo_of: Any) -> Deferred:
    """The :class:`Deferred` of ``members``: a copy of each (``memo_of(member)``: the deepcopy memo
    that gives the copy new tensor objects on the member's storage, never written: every call swaps
    in the stacked tensors' slices)."""
    return Deferred([copy.deepcopy(m, memo_of(m)) for m in members])


def _slots(member: nn.Module) -> list[tuple[dict, str, str]]:
    """Where ``member`` holds its parameters and buffers: ``(its module's _parameters or _buffers,
    attribute, name)``, once per module object (a module held under two names, ``self.head =
    self.out``, once) and attribute; ``name`` is one the wide model holds the stacked tensor under."""
    out = []
    for path, mod in member.named_modules():
        for table in (mod._parameters, mod._buffers):
            for attr, t in table.items():
                if t is not None:
                    out.append((table, attr, f"{path}.{attr}" if path else attr))
    return out


class DeferredCompileMixin:
    """Calls of a wide model without a graph yet (Note [Running the members until compiling
    pays]). The host class has ``n``, ``training``, ``_graphs`` and, while deferred, ``_deferred``."""

    n: int
    training: bool

    def expect_calls(self, *, train_calls: int | None = None, eval_calls: int | None = None) -> None:
        """Say how many more calls the run will make in train and in eval mode (None: unknown). A
        model compiled with ``WideConfig(defer=True)`` then compiles a mode's graph only at the
        first call where the calls left earn the compile back; until then each member runs its own
        program on its slices of the stacked weights (exact by construction; Note [Running the
        members until compiling pays] in model_deferred.py). Without it, the first call compiles.
        No effect on a model compiled without ``defer``, or on a mode whose graph is compiled.

        >>> import torch, wide_compiler as wc
        >>> models = [torch.nn.Linear(4, 2) for _ in range(3)]
        >>> wide = wc.compile(models, torch.randn(5, 4), config=wc.WideConfig.fast().replace(defer=True))
        >>> wide.expect_calls(train_calls=10, eval_calls=2)   # a short run: never worth a compile
        >>> x = torch.randn(3, 5, 4)
        >>> y = wide(x)
        >>> wide.compiled_modes(), torch.allclose(y[1], models[1](x[1]))
        ([], True)
        """
        for mode, calls in ((True, train_calls), (False, eval_calls)):
            if calls is not None and (isinstance(calls, bool) or not isinstance(calls, int) or calls < 0):
                raise ValueError(f"WideModel.expect_calls: expected a number of calls >= 0 or None, got {calls!r}")
        d = self.__dict__.get("_deferred")
        if d is not None:
            d.calls_left = {True: train_calls, False: eval_calls}

    def compiled_modes(self) -> list[str]:
        """The modes (``"train"``, ``"eval"``) whose graph is compiled; a mode missing runs each
        member's own program (``WideConfig(defer=True)``) or compiles at its next call."""
        return [("train" if mode else "eval") for mode in (True, False) if mode in self._graphs]

    # -- the call -------------------------------------------------------------------------------
    def _call_deferred(self, args: tuple, kwargs: dict) -> tuple[bool, Any]:
        """``(True, the members' outputs)`` when this call runs the members' own programs; ``(False,
        None)`` when the mode's graph runs it (compiled, or to be compiled now: it pays, or nothing
        says it does not)."""
        d = self.__dict__.get("_deferred")
        training = self.training
        if d is None or training in self._graphs:
            return False, None
        if torch.compiler.is_compiling():
            raise ValueError(
                f"wide_compiler: this wide model (WideConfig(defer=True)) has no {'train' if training else 'eval'} "
                "graph yet, and a graph cannot be captured inside torch.compile. Call it once outside "
                "torch.compile in this mode first, without expect_calls (or with expect_calls(train_calls=None, "
                "eval_calls=None)): that call compiles it")
        if self._compile_pays(d, training):
            if d.calls_left[training] is None:
                return False, None  # compiled by the graph's call, as without defer: its errors raise
            try:
                self._graph_for(training)  # type: ignore[attr-defined]
                return False, None
            except Exception as e:  # noqa: BLE001 (any refusal: the members' own programs are exact)
                d.failed[training] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                log.warning("wide_compiler: the %s graph cannot be compiled (%s); the members go on running their "
                            "own programs (exact, not fused)", "train" if training else "eval", d.failed[training])
        start = time.perf_counter()
        out = self._run_members(d, args, kwargs)
        seconds = time.perf_counter() - start
        d.seconds[training] = min(seconds, d.seconds.get(training, seconds))
        d.calls[training] = d.calls.get(training, 0) + 1
        left = d.calls_left[training]
        if left is not None:
            d.calls_left[training] = max(left - 1, 0)
        return True, out

    def _compile_pays(self, d: Deferred, training: bool) -> bool:
        left = d.calls_left[training]
        if left is None:
            return True
        if training in d.failed or d.calls.get(training, 0) < MEASURED_CALLS:
            return False  # measured first (the first call pays one-off costs)
        factor = 3.0 if training and torch.is_grad_enabled() else 1.0
        saving = left * factor * d.seconds[training] * (1 - 1 / self.n)
        if saving <= WARM_SECONDS:
            return False  # the common case of a short run: not even a compile-cache hit pays
        cold = COLD_SECONDS + COLD_SECONDS_PER_MODULE * sum(1 for _ in self._template.modules())  # type: ignore[attr-defined]
        if saving <= cold and training not in d.warm:  # whether the compile cache holds it (looked up once)
            d.warm[training] = self._in_compile_cache(training)
        expected = WARM_SECONDS if d.warm.get(training) else cold
        if saving <= expected:
            return False
        log.info("wide_compiler: compiling the %s graph: %d calls left save about %.2f s running the members one by "
                 "one, more than the compile's expected %.2f s", "train" if training else "eval", left, saving, expected)
        return True

    def _in_compile_cache(self, training: bool) -> bool:
        """Whether the compile cache holds the mode's graph (a compile then costs WARM_SECONDS)."""
        from .fx import compile_cache  # Note [The compiler imported when it compiles] (fx/compilation.py)
        from .fx.cache_key import key_of

        c = self._compilation(training)  # type: ignore[attr-defined]
        if not compile_cache.enabled(c.config):
            return False
        key = key_of(c)
        return key is not None and compile_cache.entry_path(c.config, key).exists()

    def _run_members(self, d: Deferred, args: tuple, kwargs: dict) -> Any:
        """Each member's own module on its slices of the stacked tensors and its slice of every
        input; the outputs stacked (N-first, as a graph returns them)."""
        leaves, spec = self._checked_inputs(args, kwargs)
        training = self.training
        outs = []
        with d.lock:
            if d.slots is None:
                d.slots = [_slots(m) for m in d.members]
                d.rnns = [[m for m in member.modules() if isinstance(m, nn.RNNBase)] for member in d.members]
            stacked = {name: get_tensor(self, name) for _, _, name in d.slots[0]}
            for i, member in enumerate(d.members):
                if member.training != training:
                    member.train(training)
                views: dict[int, torch.Tensor] = {}  # a tensor tied inside the member: one slice
                swapped = []
                try:
                    for table, attr, name in d.slots[i]:
                        t = stacked[name]
                        v = views.get(id(t))
                        if v is None:
                            v = views[id(t)] = member_slice(t, i, param=isinstance(table[attr], nn.Parameter))
                        swapped.append((table, attr, table[attr], v, name))
                        table[attr] = v
                    a, kw = tree_unflatten([_member_input(x, i) for x in leaves], spec)
                    outs.append(member(*a, **kw))
                    for table, attr, original, v, name in swapped:
                        if table[attr] is not v:
                            _take_assigned(table[attr], isinstance(original, nn.Parameter), v, name, i)
                finally:
                    for table, attr, original, _, _ in swapped:
                        table[attr] = original
                    for rnn in d.rnns[i]:  # its flat weights back on its own (Note [Recurrent modules' flat weights])
                        rnn._init_flat_weights()
        return _stacked_outputs(outs)


    def _checked_inputs(self, args: tuple, kwargs: dict) -> tuple[list, Any]:
        """The call's flat inputs and their structure, checked as a graph's call checks them, so a
        call that runs now runs after the switch too: nested as the sample, tensors where it has
        tensors (N-first), the same non-tensor values (a graph bakes them in)."""
        sample_leaves, sample_spec = tree_flatten(self._sample)  # type: ignore[attr-defined]
        leaves, spec = tree_flatten((tuple(args), dict(kwargs)))
        if spec != sample_spec:  # keywords in another order than the sample's
            leaves, spec = tree_flatten(_in_order_of(self._sample, (tuple(args), dict(kwargs))))  # type: ignore[attr-defined]
        if spec != sample_spec:
            raise ValueError(_structure_error(self._sample, (tuple(args), dict(kwargs)), self.n))  # type: ignore[attr-defined]
        for k, (x, want) in enumerate(zip(leaves, sample_leaves)):
            if isinstance(want, torch.Tensor):
                if not isinstance(x, torch.Tensor) or x.dim() != want.dim() + 1 or x.shape[0] != self.n:
                    got = f"shape {list(x.shape)}" if isinstance(x, torch.Tensor) else f"a {type(x).__name__}"
                    raise ValueError(
                        f"wide_compiler: input {k} has {got}; the sample has a tensor there, of one member's shape "
                        f"{list(want.shape)}, which a wide model of N={self.n} members takes N-first, "
                        f"[{self.n}, {', '.join(map(str, want.shape))}] (a shared input: x.expand({self.n}, *x.shape))")
            elif not same_input(x, want):
                raise ValueError(
                    f"wide_compiler: input {k} is {x!r} ({type(x).__name__}), the sample has {want!r} "
                    f"({type(want).__name__}): a non-tensor input is baked into the graph a compile makes of the "
                    "sample; compile again for another value")
        return leaves, spec


def _member_input(x: Any, i: int) -> Any:
    """Member ``i``'s slice of an input; of a shared one (stride 0 on the member dim, ``x.expand(N,
    ...)``) a copy, so that a forward writing into its input (``x.mul_(2)``) writes into its own and
    the next member still gets x, as each member alone does (probe 15 of issue 44, P15-3: members
    1 and 2 computed on member 0's writes, 3.1 and 10.1 off). Gradients reach x through the copy."""
    if not isinstance(x, torch.Tensor):
        return x
    return x[i].clone() if x.stride(0) == 0 and x.shape[0] > 1 else x[i]


def _take_assigned(new: Any, parameter: bool, view: torch.Tensor, name: str, i: int) -> None:
    """A buffer the member's forward assigned anew (``self.count = self.count + 1``): its value
    into member ``i``'s slice of the stacked buffer, as the member alone keeps it; refused for a
    parameter, or another shape or dtype."""
    if not isinstance(new, torch.Tensor) or parameter or new.shape != view.shape \
            or new.dtype != view.dtype or new.device != view.device:
        raise UnsupportedOperationError(
            f"wide_compiler: member {i}'s forward assigned {name!r} anew "
            f"({type(new).__name__ if not isinstance(new, torch.Tensor) else f'{list(new.shape)} {new.dtype}'}, "
            f"held as {list(view.shape)} {view.dtype}): a wide model keeps one stacked tensor per name; "
            "update it in place (copy_, add_) or keep its shape and dtype")
    with torch.no_grad():
        view.copy_(new)


def _stacked_outputs(outs: list[Any]) -> Any:
    """The members' outputs as one: tensors stacked N-first, other values the members' own (which
    must agree: a wide model returns one)."""
    flat = [tree_flatten(o) for o in outs]
    leaves0, spec0 = flat[0]
    for i, (leaves, spec) in enumerate(flat[1:], 1):
        if spec != spec0:
            raise ValueError(f"wide_compiler: member {i}'s output has another structure than member 0's ({spec} "
                             f"vs {spec0}); a wide model's members return one structure")
    merged = []
    for k, first in enumerate(leaves0):
        column = [leaves[k] for leaves, _ in flat]
        if isinstance(first, torch.Tensor):
            for i, t in enumerate(column):
                if not isinstance(t, torch.Tensor) or t.shape != first.shape:
                    raise ValueError(
                        f"wide_compiler: member {i}'s output {k} is "
                        f"{list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__} where member 0's is "
                        f"{list(first.shape)}; a wide model stacks its members' outputs, which need one shape")
            merged.append(tag_layout(torch.stack(column), "nfirst"))
        else:
            for i, v in enumerate(column):
                if not (v is first or v == first):
                    raise ValueError(f"wide_compiler: member {i}'s output {k} is {v!r} where member 0's is "
                                     f"{first!r}; a wide model returns one value for a non-tensor output")
            merged.append(first)
    return tree_unflatten(merged, spec0)
