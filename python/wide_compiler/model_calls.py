"""Which graph runs a call (mixed into :class:`~wide_compiler.WideModel`): a call's inputs checked
against the assumptions of a graph (Note [Guards] in fx/guards.py), the mode's graph captured again
with a dim dynamic after a new size there (Note [Dynamic sizes on demand]), or one more graph of the
mode captured for inputs outside those assumptions."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from torch.fx.experimental.symbolic_shapes import is_concrete_int
from torch.utils._pytree import tree_flatten, tree_unflatten

from .errors import ArchitectureMismatchError
from .fx.capture_errors import outside_padded_program
from .fx.guards import MAX_GRAPHS, same_input
from .fx.padded_members import PaddedMember
from .fx.compilation import COMPILE_LOCK, Compilation
from .layouts import _any_packed
from .measure import Stopwatch
from .model_inputs import (_fill, _in_order_of, _member_accepts, _member_dims, _NewSize, _outside_range,
                           _structure_error, _tensor_expected, _user_placeholders)

if TYPE_CHECKING:
    from .fx.widen import WideGraph

__all__ = ["CallGraphsMixin", "traced_here"]

log = logging.getLogger("wide_compiler.model")  # the model's records under one name (filters, tests select it)

# Note [No capture under torch.compile]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Under torch.compile (a trace of this call, in this thread: ``traced_here``; torch.compiler.is_compiling()
# is process-wide while any thread exports or compiles), Dynamo traces the wide model's forward: the
# check of a call's guards is traced too (Dynamo keeps its own guards on what it reads, so a changed
# global or a new size traces the forward again), but a capture cannot be: torch.export inside a
# Dynamo trace, the compile lock (an RLock Dynamo refuses), the logs and messages formatting the
# call's symbolic sizes. So a traced call picks, among the graphs of its mode, one whose guards
# hold (_covering_compiled), and otherwise raises at once, before anything else runs: which
# assumption the call is outside (worded from what the capture knew, never the traced values), and
# what to do -- call the wide model once outside torch.compile with such inputs (an eager call, or
# check_inputs, captures again as always: Note [Guards], Note [Dynamic sizes on demand]); the
# compiled model then finds that capture. It does not claim a size is fixed where an eager call
# would capture again. Under fullgraph=True Dynamo reports the error as its own
# ("Unsupported: Observed exception", our message in its text); without it, Dynamo breaks the graph
# there and runs the forward eagerly, where the capture happens as in any eager call. (Found by
# probe 4 of issue 44, F1: Dynamo's "Unsupported context manager RLock", and a wrapped "sizes ...
# were fixed at capture" for a size eager accepts.)


# Note [No capture under a torch.func transform]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Inside torch.func.vmap, grad, vjp, jacrev, jacfwd, jvp or functionalize, the inputs a call sees are
# the transform's wrapped tensors (a BatchedTensor, a GradTrackingTensor): a capture for inputs
# outside the captured graphs (Note [Guards]) takes member 0's slice of them as its sample, and
# torch.export cannot trace those ("Expected FakeTensor, got Tensor"). Such a failure was reported
# as a forward torch.export cannot capture, with advice to restructure it (probe 9, P9-3: the
# per-sample-gradient recipe, batch 1 per member under vmap(grad(...))). It is said as it is, in
# the words of Note [No capture under torch.compile]: call the wide model once outside the
# transform with inputs of these sizes, then run the transform, which finds that capture (checked:
# the per-sample gradients are the members'). A recapture from the compile sample (a new size in a
# fixed dim, Note [Dynamic sizes on demand]) captures under a transform as anywhere: its sample is
# the compile sample's plain tensors.

_TRANSFORMS = {"Vmap": "torch.func.vmap", "Grad": "torch.func.grad (or vjp, jacrev)",
               "Jvp": "torch.func.jvp (or jacfwd)", "Functionalize": "torch.func.functionalize"}


def _functorch_transform() -> str | None:
    """The innermost torch.func transform this call runs under (Note [No capture under a
    torch.func transform]), or None."""
    try:
        interpreter = torch._C._functorch.peek_interpreter_stack()
    except Exception:  # noqa: BLE001 -- a torch without it: no transform is known
        return None
    if interpreter is None:
        return None
    key = getattr(interpreter.key(), "name", str(interpreter.key()))
    return _TRANSFORMS.get(key, f"a torch.func transform ({key})")


def _no_capture_under_transform(transform: str, mode: str, reason: str, users: list, flat: Any) -> str:
    shapes = ", ".join(f"input '{inp.name}': {list(x.shape)}" for inp, x in zip(users, flat)
                       if isinstance(x, torch.Tensor))
    return (f"wide_compiler: this call needs a new capture of the {mode} graph, for inputs outside what it was "
            f"captured for ({reason}); no graph can be captured under a torch.func transform (here "
            f"{transform}; vmap, grad, vjp, jacrev, jacfwd, jvp and functionalize alike): torch.export cannot "
            f"trace the transform's wrapped tensors. Call the wide model once outside the transform with "
            f"inputs of these sizes ({shapes}, as the forward sees them inside the transform), in {mode} "
            f"mode, then run the transform: it reuses that capture (Note [No capture under a torch.func "
            f"transform] in model_calls.py)")


def traced_here(args: Any, kwargs: Any) -> bool:
    """Whether this thread traces the call (Note [No capture under torch.compile]), asked where
    ``torch.compiler.is_compiling()`` is True outside a Dynamo trace: torch.export or make_fx in
    this thread (a fake or dispatch mode of this thread's, or fake inputs). The flag alone will not
    do: torch sets it for the whole process while any thread exports or compiles, so an eager call
    in another thread was taken for a traced one and refused (probe 5 of issue 44, F4); such a call
    runs eagerly and captures (waiting for the compile lock) as any eager call. Callers test
    ``torch.compiler.is_dynamo_compiling() or (torch.compiler.is_compiling() and traced_here(...))``
    in their own frame (a frame Dynamo compiles on its own answers for a trace: a helper asking
    is_dynamo_compiling() would be compiled to a constant True and run so in eager code)."""
    global _traced_here
    if _traced_here is None:  # torch._dynamo is imported by now (something compiles); never traced itself
        _traced_here = torch.compiler.disable(_this_thread_traces)
    return _traced_here(args, kwargs)


def _this_thread_traces(args: Any, kwargs: Any) -> bool:
    from torch._guards import detect_fake_mode  # the TracingContext and the dispatch modes are per thread

    return bool(torch._C._len_torch_dispatch_stack()) or detect_fake_mode((args, kwargs)) is not None


_traced_here: Any = None


class CallGraphsMixin:
    """Methods choosing (and capturing) the graph of a call. The host class has ``n``, the graphs
    (``_graphs``, ``_variants``, ``_ranges``), the dims made dynamic (``_extra_dims``, ``_grown``,
    ``_fixed``: Note [A refused size is kept for that capture only]), the compile sample and
    template, and compiles and adopts graphs (``_graph_for``, ``_adopt``, ``_live_state``)."""

    n: int

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

    def _graph_covering(self, training: bool, args: tuple, kwargs: dict) -> tuple[WideGraph, Any] | None:
        """The graph of a mode whose assumptions hold for this call, and the call's flat inputs
        (Note [Guards]): the mode's graph; after a new size in a dim captured fixed, that graph
        captured again with the dim dynamic (Note [Dynamic sizes on demand]); a graph captured
        earlier for such inputs; else one captured now for them (:meth:`_capture_for`). None for
        inputs made by :func:`~wide_compiler.pack` (a packed tensor has the member's rank, so it
        never passes the guards: the check costs nothing on the common path)."""
        wg = self._graph_for(training)
        if torch.compiler.is_dynamo_compiling() or (  # Note [No capture under torch.compile]
                torch.compiler.is_compiling() and traced_here(args, kwargs)):
            return self._covering_compiled(wg, training, args, kwargs)
        flat = self._user_inputs(wg, args, kwargs)
        if wg.guards is not None and wg.guards.holds(flat, self.__dict__.get("_param_dtype"),
                                                     self.__dict__.get("_param_device")):
            return wg, flat  # the common case: one generated check
        if _any_packed(args, kwargs):
            return None
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

    def _covering_compiled(self, wg: WideGraph, training: bool, args: tuple, kwargs: dict) -> tuple[WideGraph, Any]:
        """Note [No capture under torch.compile]: the graph of the mode (or one captured earlier for
        such inputs) whose guards hold for this call, traced by torch.compile; else a ValueError
        saying which capture the call needs, before anything else runs."""
        flat = self._user_inputs(wg, args, kwargs)
        pdt, pdev = self.__dict__.get("_param_dtype"), self.__dict__.get("_param_device")
        for g in (wg, *reversed(self._variants.get(training, ()))):
            if g.guards is not None and g.guards.holds(flat, pdt, pdev):
                return g, flat
        if wg.guards is None:  # no guards kept (nothing to trace but the inputs' own checks)
            flat, why = self._outside(wg, args, kwargs)
            if why is None:
                return wg, flat
        mode = "train" if training else "eval"
        users = (inp for inp in wg.inputs if inp.kind == "user")
        for inp, x in zip(users, flat):  # refused in eager too: no capture takes another value
            if not isinstance(x, torch.Tensor) and not same_input(x, inp.sample_value):
                if inp.member_shape is not None:  # the sample had a tensor there
                    raise ValueError(_tensor_expected(inp.name, x, inp.member_shape, self.n))
                raise ValueError(
                    f"wide_compiler: input '{inp.name}' is another value or type than the "
                    f"{inp.sample_value!r} ({type(inp.sample_value).__name__}) the wide model was compiled with: "
                    f"non-tensor inputs are baked into the graph at compile time, and a forward may read their "
                    f"type and sign; compile again for another value")
        raise ValueError(
            f"wide_compiler: this call needs a new capture of the {mode} graph, for {self._why_compiled(wg, flat)}; "
            f"a graph cannot be captured inside torch.compile. Call the wide model once outside torch.compile "
            f"with these inputs (or its check_inputs(...)), in {mode} mode, then call the compiled model: it "
            f"reuses that capture (Note [No capture under torch.compile] in model_calls.py)")

    def _why_compiled(self, wg: WideGraph, flat: Any) -> str:
        """Which assumption of ``wg``'s capture this call (traced by torch.compile) is outside, in
        words made of what the capture knew (torch.compile cannot format the call's symbolic sizes
        and values)."""
        guards = wg.guards
        users = [inp for inp in wg.inputs if inp.kind == "user"]
        for k, (inp, x) in enumerate(zip(users, flat)):
            if not isinstance(x, torch.Tensor):
                continue  # checked by the caller
            if guards is not None and k < len(guards.dtypes) and guards.dtypes[k] is not None \
                    and not (k < len(guards.follows) and guards.follows[k]) and x.dtype != guards.dtypes[k]:
                return f"input '{inp.name}', another dtype than the {guards.dtypes[k]} it was captured with"
            member = inp.member_shape
            if member is None:
                continue
            if x.dim() != len(member) + 1:
                return f"input '{inp.name}', another rank than the {len(member) + 1} it was captured with"
            for d, m in enumerate(member):
                if m is not None and x.shape[d + 1] != m:
                    return (f"input '{inp.name}', another size in dim {d + 1} than the {m} it was captured with "
                            f"(eager calls capture again with that dim dynamic)")
        # not guards.failed(): it formats the call's values, and updates what the fast path compares
        # with, which traced by torch.compile is replayed after the graph (it once let a changed global
        # through): only what the capture knew is read here
        shown = "; ".join(guards.describe().splitlines()) if guards is not None else ""
        return ("inputs or Python state outside the guards of its capture (a size relation the forward tests, "
                "a global, flag, layout or grad mode it reads, a dtype)" + (f": {shown}" if shown else ""))

    def _capture_for(self, training: bool, args: tuple, kwargs: dict, why: Any) -> tuple[WideGraph, Any]:
        """Note [Guards]: capture this mode's graph again with member 0's slice of this call as
        the sample: the dims captured dynamic before stay dynamic (but a size 0 or 1 is captured as
        the fixed size it is), dtypes are the call's. Kept beside the mode's graph (at most
        ``MAX_GRAPHS`` per mode); strategies are the mode's graph's (nothing is measured)."""
        from .fx.pipeline import recapture  # Note [The compiler imported when it compiles]

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
            if wg.guards is not None and wg.guards.grads:  # the forward reads requires_grad: the call's
                first = [t.requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) and x.dim() else t
                         for t, x in zip(first, flat)]
            sample = tree_unflatten(first, wg.in_spec)
            watch = Stopwatch()
            ref = next(self.parameters(), None)
            c = Compilation(self._capture_template[0].train(training), (tuple(sample[0]), dict(sample[1])), self.n,
                            self._config.replace(tune=False), opaque_paths=self._capture_template[1],
                            exact_dims=exact, grad_enabled=torch.is_grad_enabled(),
                            dtype=ref.dtype if ref is not None else None,
                            device=ref.device if ref is not None else None,
                            constants=self.__dict__.get("_constants"), earlier_constants=self._earlier_constants(),
                            member_tile=wg.member_tile)
            try:
                recapture(c, wg)
            except Exception as e:
                padded = outside_padded_program(e)
                if padded is not None:  # the padded program's own explanation, on its own (P9-4)
                    raise ValueError(str(padded)) from e
                transform = _functorch_transform()
                if transform is not None:  # Note [No capture under a torch.func transform]
                    raise ValueError(_no_capture_under_transform(transform, mode, reason, users, flat)) from e
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

    # Note [Per-member constants a size meets]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # A capture with a dim made dynamic runs at the compile sample's size, and a sample size of 1 as 2
    # (export specialises 1). Per-member constants that a size meets (``T >= self.min_len``, 3.0 and
    # 2.0) are proved for every member at that size: at T = 2 the members take different branches,
    # so that capture is refused (ArchitectureMismatchError), though at the call's T = 10 every member
    # takes the same one (probe 15 of issue 44, P15-2: the call was refused). Then the call's own
    # sizes are captured (:meth:`_capture_for`, as for inputs outside the guards): proved at T = 10,
    # kept beside the mode's graph, its size fixed; a call where the members do differ is refused
    # there, naming the constant. ``_unproved`` keeps the set of dims tried, so later new sizes go
    # straight to their own capture. The same holds where the dynamic capture cannot be proved at
    # all: a size and a constant in one Python number (``h * (T / self.c)``: a division of a
    # symbolic size has no per-member form) ran at the sample's T only (probe 12, P12-6); each T
    # now gets a capture of its own (at most ``MAX_GRAPHS`` per mode).

    # Note [A refused size is kept for that capture only]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # Whether export fixes a dim depends on which other dims are dynamic with it: in
    # ``lin(x) + y``, y's dim 1 made dynamic alone is fixed by the add (x's is the sample's 4), but
    # x's and y's together come out dynamic and equal. So a refusal found by one recapture is kept
    # (``_fixed``) under the whole set of dims that capture made dynamic, and refuses again at once
    # only a call that would try that same capture (captures are deterministic for a sample and a
    # set of dims); a call needing another set captures again. Keyed by the dim alone, a refused
    # call made every later call that grew that dim fail with "fixed at capture", valid ones too
    # (probe 6 of issue 44, F8: a refused y of [B, 1, 4] refused x and y of [B, 5, 4] after it).

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
        from .fx.pipeline import PASSES, recapture, recapture_cached, run_pipeline  # Note [The compiler imported ...]

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
            extra = dict(self._extra_dims)
            for k, d in new:
                extra[k] = extra.get(k, frozenset()) | {d}
            # Note [A refused size is kept for that capture only]
            tried = (training, frozenset((k, d) for k, ds in extra.items() for d in ds))
            if tried in self.__dict__.get("_unproved", ()):
                return wg  # Note [Per-member constants a size meets]: the caller captures the call's sizes
            for (k, d), what in self._fixed.get(tried, {}).items():
                if (k, d) in new:
                    raise ValueError(_fill(what, shapes[k], new[(k, d)][0]))
            mode = "train" if training else "eval"
            for (k, d), (size, was) in new.items():
                log.info("wide_compiler: input '%s' dim %d is %d in this call, %d when the %s graph was "
                         "captured: capturing the %s graph again with that dim dynamic (once: later sizes "
                         "reuse it)", users[k].name, d + 1, size, was, mode, mode)
            ref = next(self.parameters(), None)
            watch = Stopwatch()
            c = Compilation(self._capture_template[0].train(training), self._sample, self.n,
                            self._config.replace(tune=False), dynamic_shapes=self._dynamic_shapes,
                            opaque_paths=self._capture_template[1], extra_dims=extra,
                            dtype=ref.dtype if ref is not None else None,
                            device=ref.device if ref is not None else None,
                            constants=self.__dict__.get("_constants"), earlier_constants=self._earlier_constants(),
                            member_tile=wg.member_tile)
            key, hit = recapture_cached(c, wg, self._live_state())  # Note [The compile cache]
            if hit is not None:  # stored only where every new dim came out dynamic
                c, new_items = hit, {}
            else:
                try:
                    run_pipeline(c, [p for p in PASSES if p.name == "capture"])
                except Exception as e:  # nothing is kept: a later call tries again (Note [A refused size ...])
                    k, d = next(iter(new))
                    size, was = new[(k, d)]
                    why = (str(e).strip().splitlines() or [""])[0].removeprefix("wide_compiler: ")
                    raise ValueError(
                        f"wide_compiler: input '{users[k].name}' has shape {shapes[k]}: its dim {d + 1} is {size}, "
                        f"{was} when the {mode} graph of {type(self._template).__name__} was captured, and capturing "
                        f"the {mode} graph again with that dim dynamic (from the compile sample) failed: {why}. "
                        f"Compile with a sample of the sizes you call with") from e
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
                    self._fixed.setdefault(tried, {})[(k, d)] = what
                    fixed[(k, d)] = _fill(what, shapes[k], size)
            if len(fixed) == len(new):
                raise ValueError(next(iter(fixed.values())))
            if hit is None:
                try:
                    recapture(c, wg, captured=True)  # the old graph's strategies and tile
                except ArchitectureMismatchError:
                    if not c.constants:
                        raise
                    # Note [Per-member constants a size meets]
                    self.__dict__.setdefault("_unproved", set()).add(tried)
                    log.info("wide_compiler: the %s graph with %s dynamic is not one program for every member's "
                             "constants at the compile sample's sizes; capturing it for this call's sizes instead",
                             mode, ", ".join(f"input '{users[k].name}' dim {d + 1}" for k, d in new))
                    return wg
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
            if inp.member_shape is not None:  # the sample had a tensor there (probe 9, P9-12)
                raise ValueError(_tensor_expected(inp.name, x, inp.member_shape, self.n))
            if not same_input(x, inp.sample_value):  # by type and value: 1 is not 1.0, -0.0 not 0.0
                was = inp.sample_value
                other = ""
                if type(x) is not type(was):
                    other = f" (another type: {type(x).__name__}, compiled {type(was).__name__})"
                elif isinstance(x, float) and x == was:
                    other = " (another sign)"
                raise ValueError(
                    f"wide_compiler: input '{inp.name}' is {x!r}, but the wide model was "
                    f"compiled with {was!r}{other}: non-tensor inputs are baked into the graph at "
                    "compile time, and a forward may read their type and sign (isinstance, "
                    "math.copysign); compile again for another value")
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
                    raise ValueError(_outside_range(inp.name, d, size, lo, hi))
        if not ok:
            dims = _member_dims(member)
            resized = x.dim() == len(member) + 1 and x.shape[0] == self.n  # only sizes differ
            if resized and self._dynamic_shapes is None:  # eager captures again (Note [Dynamic sizes on demand])
                if torch.compiler.is_dynamo_compiling():  # Note [No capture under torch.compile]
                    raise ValueError(
                        f"wide_compiler: this call needs a new capture, for input '{inp.name}', another size "
                        f"than the [{self.n}, {dims}] it was captured with; a graph cannot be captured inside "
                        f"torch.compile. Call the wide model once outside torch.compile with these inputs, "
                        f"then call the compiled model")
                raise _NewSize(f"wide_compiler: input '{inp.name}' has shape {list(x.shape)}; "
                               f"captured as [{self.n}, {dims}]")
            fixed = ("the dims compile's dynamic_shapes left static are fixed to the sample's sizes" if resized
                     else "sizes given as numbers are the capture's")
            hint = ""
            if x.dim() == len(member) and member and member[0] is None and x.shape[0] == self.n:
                hint = (" If the compile sample had the member dim too, compile with ONE member's "
                        "input (the sample without N).")
            raise ValueError(
                f"wide_compiler: input '{inp.name}' has shape {list(x.shape)}; expected N-first "
                f"[{self.n}, {dims}] (one member's input is [{dims}] and there are {self.n} "
                f"members; {fixed}, B and * are free). Stack per-member inputs with wide_compiler.stack(xs), or "
                f"share one input x with x.expand({self.n}, *x.shape).{hint}")
