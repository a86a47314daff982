"""Running the members: the checks that run or trace every member on the sample and compare the
programs (the second and third of the member checks in fx/member_checks.py).

- :func:`check_run_members` runs every member once on the sample, with no gradients, and compares
  the ATen ops each runs (:class:`_OpRecorder`); members run in place where nothing would write
  into their own tensors (Note [Members run in place]), and tensors a forward reads from outside
  its member are recorded (Note [Tensors held outside the member]).
- :func:`check_traced_members` captures every member with ``torch.export`` and compares its
  program with member 0's (:func:`graph_fingerprint`).

Errors are :class:`~wide_compiler.errors.ArchitectureMismatchError` (or
:class:`~wide_compiler.errors.UnsupportedOperationError`) naming the member, what differs and,
where known, the user's source line. Nothing of the user's changes.
"""
from __future__ import annotations

import copy
import hashlib
import logging
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.export import ExportedProgram
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from ..errors import ArchitectureMismatchError, UnsupportedOperationError
from ..measure import Stopwatch
from .capture import batch_of_two, capture, without_cudnn
from .forms import apply_capture_forms
from .member_checks import with_constants
from .sample_check import _run_on_clones, attributes_kept
from .source import source_line, user_frame

__all__ = ["check_run_members", "check_traced_members", "graph_fingerprint"]

log = logging.getLogger(__name__)


# Note [Tensors held outside the member]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A forward may read tensors that are none of its member's parameters, buffers or inputs: a
# frozen teacher kept as ``self.teacher = [nn.Linear(4, 4)]`` (to keep it out of ``.parameters()``
# and the optimizer), a module in a tuple or dict, set with ``object.__setattr__``, reached through
# a lambda, a bound method or ``functools.partial``, a plain list of ``nn.Parameter`` (the missing
# ``nn.ParameterList``). torch.export lifts them as constants of member 0's program, so every member
# ran member 0's teacher (probe 8 of issue 44, P8-6: 0.7-4.2 off, no warning). The member check's
# recorder now knows the storages of the member's parameters, buffers (and their clones) and
# inputs, and of every op's outputs; a tensor argument on any other storage is held outside the
# member. Such a tensor that is an ``nn.Parameter`` must be the very one member 0 reads there (a
# module-level frozen parameter every member shares, as before), else it is refused: a member's
# own (its values would be copied from member 0 into the graph, and later updates, an EMA
# teacher's, not seen); another (a mask or table held in a plain attribute, a
# global) must have member 0's values in every member, compared by their bytes, else the members
# are refused as running different programs (a safety net: check_members compares the attributes
# that hold such tensors first, and refuses objects it cannot compare). ``torch.tensor(...)`` made in the forward is not one
# (its values are compared as before: ``_CONSTANT_OPS``).


class _Held:
    """A tensor argument held outside the member (Note [Tensors held outside the member]),
    compared by shape, dtype and the digest of its bytes."""

    __slots__ = ("parameter", "storage", "key")

    def __init__(self, t: torch.Tensor) -> None:
        self.parameter = isinstance(t, nn.Parameter)
        self.storage = _storage(t)
        try:
            data = t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()
            digest = hashlib.blake2b(data, digest_size=16).hexdigest()
        except Exception:  # noqa: BLE001 -- a layout without plain bytes (sparse, quantized): by its shape
            digest = None
        self.key = (tuple(t.shape), t.dtype, digest)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Held) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        return (f"a {str(self.key[1]).removeprefix('torch.')} tensor {list(self.key[0])} that is not a parameter, "
                "buffer or input of the member")


def _storage(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 -- a tensor without storage (sparse, a subclass): not tracked
        return 0


class _OpRecorder(TorchDispatchMode):
    """Records the ATen ops a forward runs: op name, non-tensor arguments, tensor shapes/dtypes,
    the values of constants the forward makes (``torch.tensor(...)``) and, once :meth:`know` has
    been told the member's tensors, the bytes of tensors held outside it (Note [Tensors held
    outside the member]). With ``stop_at`` it keeps the user's source line of that op instead."""

    _CONSTANT_OPS = ("aten.lift_fresh.default", "aten.lift_fresh_copy.default")

    def __init__(self, stop_at: int | None = None, protected: frozenset[int] = frozenset()) -> None:
        super().__init__()
        self.ops: list[tuple[str, Any]] = []
        self.stop_at, self.where = stop_at, None
        self.seconds: float | None = None  # how long the recorded forward took (the copy not counted)
        self.protected = protected  # storages (data pointers) no op may write (Note [Members run in place])
        self.known: set[int] | None = None  # storages of the member's own tensors and of op outputs
        self.held: list[tuple[int, _Held]] = []  # (op index, tensor held outside the member), in order

    def know(self, *tensors: Any) -> None:
        """The storages of the member's tensors and inputs (any nesting)."""
        self.known = self.known if self.known is not None else set()
        for t in tree_flatten(tensors)[0]:
            if isinstance(t, torch.Tensor):
                self.known.add(_storage(t))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if self.protected and func._schema.is_mutable:
            values = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
            for a in func._schema.arguments:
                t = values.get(a.name)
                if (a.alias_info is not None and a.alias_info.is_write and isinstance(t, torch.Tensor)
                        and t.untyped_storage().data_ptr() in self.protected):
                    raise _WouldWrite(name)

        def sig(a: Any) -> Any:
            if isinstance(a, torch.Tensor):
                if name in self._CONSTANT_OPS:
                    return ("constant", tree_map(lambda v: ("nan",) if isinstance(v, float) and math.isnan(v) else v,
                                                 a.tolist() if a.numel() <= 256 else a.sum().item()))
                if self.known is not None and a.numel() and _storage(a) not in self.known:
                    held = _Held(a)  # Note [Tensors held outside the member]
                    self.held.append((len(self.ops), held))
                    return ("held", held)
                return ("tensor", tuple(a.shape), a.dtype)
            if isinstance(a, float) and math.isnan(a):  # nan != nan: two runs with a nan argument agree
                return ("nan",)
            return a

        if self.stop_at is not None and len(self.ops) == self.stop_at:
            self.where = user_frame()
        self.ops.append((name, tree_map(sig, (args, kwargs))))
        out = func(*args, **kwargs)
        if self.known is not None:
            self.know(out)
        return out


class _WouldWrite(Exception):
    """An op of a member run in place was about to write into the member's own tensors."""


def _run_in_place(model: nn.Module, args: tuple, kwargs: dict) -> _OpRecorder:
    """Note [Members run in place]: the member check runs each member once, and a deep copy of
    a member (so that nothing of the user's changes) cost as much as its forward (ResNet-18:
    0.3 s a member on a busy machine). Instead the member itself runs, with clones of its buffers
    (``functional_call``: running statistics and counters change the clones) and its own
    parameters, under the recorder, which refuses (raises :class:`_WouldWrite`, before the op runs)
    any op that would write into the storage of a parameter or buffer: the caller then runs a deep
    copy as before. Its Python attributes are put back afterwards (a rebound value gets its old
    object, lists, dicts and sets their old contents), and so is a parameter's ``.data`` that the
    forward rebound. The program recorded is the same: no op is added or removed."""
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    protected = frozenset(t.untyped_storage().data_ptr() for t in (*params.values(), *buffers.values()))
    rec = _OpRecorder(protected=protected)
    data = {name: p.data for name, p in params.items()}
    try:
        clones = {name: b.clone() for name, b in buffers.items()}
        rec.know(params, buffers, clones, args, kwargs)
        watch = Stopwatch()
        with attributes_kept(model), torch.no_grad(), rec:
            torch.func.functional_call(model, clones, args, kwargs, strict=False)
        rec.seconds = watch.seconds
    finally:
        for name, p in params.items():
            if p.data_ptr() != data[name].data_ptr():
                p.data = data[name]
    return rec


def _run_recorded(model: nn.Module, args: tuple, kwargs: dict, stop_at: int | None = None, *,
                  private: bool = False) -> _OpRecorder:
    """Run ``model`` once with no gradients, recording its ops, without changing anything of the
    user's: the member runs in place with clones of its buffers, no op allowed to write into its
    own tensors (Note [Members run in place]); where one would, on a deep copy of the member (its
    parameters, buffers and Python attributes: a forward that clamps its weights in place changes
    the copy). The random number generators are restored afterwards. A member that cannot be
    deep-copied runs through :func:`_run_on_clones` (fx/sample_check.py) instead. ``private=True``:
    ``model`` is already a copy of the checker's own (run as it is)."""
    rec = _OpRecorder(stop_at)
    devices = sorted({t.device.index for t in (*model.parameters(), *model.buffers()) if t.is_cuda} - {None})
    # without cuDNN, as captured: an RNN's cuDNN weight flattening (aten.set_) is no part of the program
    with torch.random.fork_rng(devices=devices), without_cudnn():
        if not private and stop_at is None:  # the source line of an error: read from a copy's frames
            state = torch.random.get_rng_state()
            try:
                return _run_in_place(model, args, kwargs)
            except _WouldWrite as e:
                log.debug("wide_compiler: member check: the forward of %s writes into its own tensors (%s); "
                          "running a copy of it", type(model).__name__, e)
                torch.random.set_rng_state(state)
        try:
            member = model if private else copy.deepcopy(model)
        except Exception as e:  # noqa: BLE001 -- objects that refuse to be copied
            log.debug("wide_compiler: member check: cannot deep-copy %s (%s: %s); running it on clones "
                      "of its tensors and restoring its attributes", type(model).__name__, type(e).__name__, e)
            _run_on_clones(model, args, kwargs, rec)
            return rec
        rec.know(list(member.parameters()), list(member.buffers()), args, kwargs)
        watch = Stopwatch()
        with torch.no_grad(), rec:
            member(*args, **kwargs)
        rec.seconds = watch.seconds
    return rec


def check_run_members(models: Sequence[nn.Module], args: tuple, kwargs: dict | None,
                      constants: dict[str, tuple] | None = None) -> float | None:
    """Run every member once on the sample and compare the ops it runs and their non-tensor
    arguments with member 0's (``WideConfig.run_members``): a member whose forward reads a
    different Python constant (a global, a closure, a class attribute) runs a different program.
    A sample the eager forward cannot run (export succeeded on fake values) skips the check.
    Nothing of the user's changes: each member runs as a copy (see :func:`_run_recorded`), so a
    forward that clamps its weights in place or counts its calls leaves the member as it was.
    With per-member ``constants`` each member is compared with member 0 run with that member's
    own values (one run per distinct configuration), so every member is checked with the values
    it runs with (what the constants themselves change is proved by tracing, Note [Per-member
    constants] in fx/constants.py).

    Returns the quickest of the members' forwards in seconds (the first pays one-time set-up;
    recording adds a little): what the tuning budget follows (Note [Tuning that pays for itself]
    in tuning.py); None when no forward ran to its end."""
    args, kwargs = batch_of_two((tuple(args), dict(kwargs or {})))
    paths = list(constants or {})
    refs: dict[tuple, list] = {}
    seconds: list[float] = []

    held0: list[tuple[int, bool]] = []  # member 0's tensors held outside it: (storage, a parameter), in order

    def timed(rec: _OpRecorder, i: int, own: bool = True) -> list:
        if rec.seconds is not None:
            seconds.append(rec.seconds)
        held = [(h.storage, h.parameter) for _, h in rec.held]
        if own and i == 0:
            held0[:] = held
        elif own:  # Note [Tensors held outside the member]: a parameter of member i's own
            k = next((k for k, (a, b) in enumerate(zip(held, held0)) if (a[1] or b[1]) and a[0] != b[0]), None)
            if k is not None:
                at, _ = rec.held[k]
                where = _run_recorded(models[i], args, kwargs, stop_at=at).where
                raise UnsupportedOperationError(
                    f"wide_compiler: member {i}'s forward reads an nn.Parameter that is not registered in it, "
                    f"at {where} ({rec.ops[at][0]}), and not the one member 0 reads there: a module or parameter "
                    "held in a list, tuple or dict, a plain object, a closure, a bound method or "
                    "functools.partial, or set with object.__setattr__. wide_compiler fuses each member's "
                    "registered parameters and buffers; a tensor held outside would be copied from member 0 "
                    "into the graph for every member, and later updates (an EMA teacher's) not seen. Register "
                    "it in the member (an attribute, nn.ModuleList, nn.ModuleDict, nn.ParameterList; a frozen "
                    "one with requires_grad_(False), or as buffers), or pass it as an input")
        return rec.ops

    def reference(i: int) -> list:
        key = tuple((type(constants[p][i]).__name__, repr(constants[p][i])) for p in paths)
        if key not in refs:
            if i == 0 or not paths:
                refs[key] = timed(_run_recorded(models[0], args, kwargs), 0)
            else:  # a copy of member 0 with member i's values, run as it is (no second copy)
                refs[key] = timed(_run_recorded(with_constants(models[0], constants, i), args, kwargs, private=True),
                                  0, own=False)
        return refs[key]

    try:
        reference(0)
    except UnsupportedOperationError:  # a parameter held outside the member (Note [Tensors held outside the member])
        raise
    except Exception as e:  # the check is a safety net; export already accepted the program
        log.debug("wide_compiler: cannot run member 0 on the sample (%s); run_members check skipped", e)
        return None
    for i, model in enumerate(models[1:], start=1):
        try:
            want = reference(i)
        except UnsupportedOperationError:
            raise
        except Exception as e:  # noqa: BLE001 -- a safety net, as for member 0 above (tracing proved it)
            log.debug("wide_compiler: cannot run member 0 with member %d's constants on the sample (%s); "
                      "run_members check skipped for it", i, e)
            continue
        got = timed(_run_recorded(model, args, kwargs), i)
        k = next((k for k, (g, w) in enumerate(zip(got, want)) if g != w), None)
        if k is None and len(got) == len(want):
            continue
        if k is None:
            raise ArchitectureMismatchError(
                f"member {i}: its forward runs {len(got)} ops, member 0's runs {len(want)}")
        where = _run_recorded(model, args, kwargs, stop_at=k).where
        layout = _layout_differences(models[0], model, i)
        why = ("(a Python constant the forward reads differs between members)" if not layout else
               f"({layout}: an op that follows its input's memory layout, such as a view that becomes a copy, "
               f"makes another program; Note [Members stored in another memory layout]). What to do: store "
               f"every member's parameters and buffers in one layout (member.to(memory_format="
               f"torch.contiguous_format), or convert every member alike)")
        raise ArchitectureMismatchError(
            f"member {i}: its forward runs a different program from member 0's at {where}: "
            f"{got[k][0]} with {_brief(got[k][1])}, member 0{' (with its constants)' if paths else ''} runs "
            f"{want[k][0]} with {_brief(want[k][1])} {why}")
    return min(seconds) if seconds else None


# Note [Members stored in another memory layout]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A member converted with ``.to(memory_format=torch.channels_last)`` (or one whose parameter is a
# transposed view of a contiguous tensor) holds the same values as member 0 in other strides.
# Most ops give the same values and run the same ATen ops whatever the strides, and such members
# compile (the wide model's stacked parameters are its own). Some ops follow their input's layout:
# ``Flatten`` after a channels_last conv is a ``clone`` (a copy) where member 0's is a ``view``, so
# the run-members check sees another program, and refuses it; its message then names the
# parameter whose strides differ (probe 8 of issue 44, P8-8: it blamed a Python constant). The
# compile cache key holds every member's parameter and buffer strides (fx/cache_key.py's
# ``_tensor``), so a hit, which skips this check, is found only for members of the same layouts.
def _layout_differences(ref: nn.Module, model: nn.Module, i: int) -> str:
    """The parameters and buffers of member ``i`` (``model``) whose strides differ from member 0's
    (``ref``), as a phrase for the run-members refusal, or ``""`` (Note [Members stored in another
    memory layout]).

    >>> a, b = nn.Conv2d(2, 4, 3), nn.Conv2d(2, 4, 3).to(memory_format=torch.channels_last)
    >>> _layout_differences(a, b, 1)[:64]
    "member 1's parameter 'weight' is stored in strides (18, 1, 6, 2)"
    """
    def kind(t: torch.Tensor) -> str:
        if t.is_contiguous():
            return "contiguous"
        for fmt, name in ((torch.channels_last, "channels_last"), (torch.channels_last_3d, "channels_last_3d")):
            if t.dim() == (4 if name == "channels_last" else 5) and t.is_contiguous(memory_format=fmt):
                return name
        return "not contiguous"

    mine = dict(model.named_parameters())
    bufs = dict(model.named_buffers())
    found = []
    for what, theirs, table in (("parameter", dict(ref.named_parameters()), mine),
                                ("buffer", dict(ref.named_buffers()), bufs)):
        for name, t0 in theirs.items():
            t = table.get(name)
            if (isinstance(t, torch.Tensor) and t.layout == torch.strided and t0.layout == torch.strided
                    and t.shape == t0.shape and t.stride() != t0.stride()):
                found.append(f"member {i}'s {what} {name!r} is stored in strides {t.stride()} ({kind(t)}), "
                             f"member 0's in {t0.stride()} ({kind(t0)})")
    return "; ".join(found[:3]) + ("; ..." if len(found) > 3 else "")


def _brief(sig: Any) -> str:
    args, kwargs = sig
    parts = [f"tensor{list(a[1])}" if isinstance(a, tuple) and a and a[0] == "tensor" else repr(a) for a in args]
    parts += [f"{k}={v!r}" for k, v in kwargs.items()]
    return "(" + ", ".join(parts) + ")"


def check_traced_members(models: Sequence[nn.Module], args: tuple, kwargs: dict | None,
                         dynamic_shapes: Any, ref: ExportedProgram, constants: dict[str, tuple] | None = None) -> None:
    """Trace every member and compare its program with member 0's (``ref``): catches members
    whose forward reads different Python constants (globals, closures, class attributes set per
    instance in ways the attribute check cannot see)."""
    want = graph_fingerprint(ref)
    for i, model in enumerate(models[1:], start=1):
        member = apply_capture_forms(copy.deepcopy(model))  # as member 0's template was
        if constants:  # per-member constants are traced by the constants pass
            with_constants(member, constants, 0, copy_model=False)
        got = graph_fingerprint(capture(member, args, kwargs, dynamic_shapes=dynamic_shapes))
        for g, w in zip(got, want):
            if g != w:
                node = next((n for n in ref.graph.nodes if n.name == w[0]), None)
                where = f" ({source_line(node)})" if node is not None else ""
                raise ArchitectureMismatchError(
                    f"member {i}: the traced program differs at node '{w[0]}'{where}: "
                    f"{g[1]}{g[2]}, member 0 has {w[1]}{w[2]}")
        if len(got) != len(want):
            raise ArchitectureMismatchError(
                f"member {i}: the traced program has {len(got)} nodes, member 0 has {len(want)}")


def graph_fingerprint(ep: ExportedProgram) -> list[tuple[str, str, str]]:
    """The traced program without tensor values: per node its op, target and non-tensor
    arguments. Two members with equal fingerprints run the same program."""
    out = []
    for node in ep.graph.nodes:
        if node.op in ("call_function", "output"):
            args = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: f"%{n.name}")
            out.append((node.name, str(node.target), repr(args)))
    return out
