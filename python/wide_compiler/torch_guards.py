"""What of torch's own training API would couple the members of a wide model, refused: a
``torch.optim`` optimizer whose update mixes the elements of a stacked parameter (Note
[torch.optim optimizers that mix members]) and torch's norm clipping (Note [torch's norm clipping
over a wide model]). Installed at the first compile (:func:`watch_torch_optimizers`), never at
import; plain parameters are left to torch as they are."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["note_wide_parameters", "watch_torch_optimizers"]

log = logging.getLogger(__name__)


# Note [torch.optim optimizers that mix members]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A wide model's parameters are the members' stacked on dim 0. An optimizer whose update is per
# element (SGD, Adam, NAdam, RAdam, ASGD, Rprop, Adamax, Adadelta, ...) steps each member's slice
# as it steps that member alone. Three torch.optim optimizers compute their update from values
# across the stacked dim instead, and so couple the members silently (probe 8 of issue 44, P8-9:
# Adafactor 0.013 off after 3 steps, LBFGS 0.5): Adafactor factors the second moment of a 2-D
# parameter over its two dims, and a member's 1-D bias is a 2-D ``[N, O]`` parameter of the wide
# model (factored over N; the member's own is not factored); Muon orthogonalizes a 2-D parameter
# (the same ``[N, O]`` biases); LBFGS keeps one history and one line search over all its
# parameters. Their first ``step()`` over a wide model's parameters is refused (nothing changes)
# by a global optimizer step pre-hook installed when a model is compiled: one lookup by class per
# step, and for the three, one search for the parameters' module per optimizer (cached by its
# parameter count), so a plain model's Adafactor is not refused.
_MIXES_MEMBERS = {  # torch.optim class name -> (which stacked parameters it mixes, how)
    "Adafactor": (2, "factors the second moment of a 2-D parameter over both of its dims, and a member's 1-D "
                     "parameter is a 2-D [N, ...] parameter of the wide model (its moments are shared by the "
                     "members; the member's own is not factored)"),
    "Muon": (2, "orthogonalizes each 2-D parameter as a whole, and a member's 1-D parameter is a 2-D [N, ...] "
                "parameter of the wide model (its update mixes the members)"),
    "LBFGS": (None, "keeps one curvature history and one line search over all of its parameters, so every "
                    "member's step depends on the others' losses and gradients"),
}
_CLASS_NAMES: dict[type, str | None] = {}  # optimizer class -> its torch.optim class name (one lookup per step)
_ABSENT = object()
_STEP_HOOK: list[Any] = []  # the handle of the global step pre-hook, once installed
_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> parameter count checked


def watch_torch_optimizers() -> None:
    """Install (once per process) torch's global optimizer step pre-hook that refuses a
    ``torch.optim`` optimizer whose update mixes members over a wide model's parameters (Note
    [torch.optim optimizers that mix members]); called when a model is compiled.

    >>> watch_torch_optimizers(); watch_torch_optimizers()  # once, however often it is called
    >>> len(_STEP_HOOK)
    1
    """
    if not _STEP_HOOK:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _STEP_HOOK.append(register_optimizer_step_pre_hook(_refuse_mixing_step))
        _watch_torch_clipping()


# Note [torch's norm clipping over a wide model]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``torch.nn.utils.clip_grad_norm_(wide.parameters(), max_norm)`` computes ONE norm over all the
# stacked gradients, i.e. over all members together, and scales every member by it: each member is
# clipped by the others' gradients (probe 9, P9-20: 0.06-0.43 off, silently). The per-member form is
# ``wc.optim.clip_grad_norm_`` (one norm per member, as torch's on that member alone). So torch's
# norm clipping refuses a wide model's parameters, before anything is changed, naming it:
# ``clip_grad_norm_`` (and the deprecated ``clip_grad_norm``), ``clip_grads_with_norm_`` (and the
# ``_clip_grads_with_norm_`` the original ``clip_grad_norm_`` calls through its module's globals, so
# a ``from torch.nn.utils import clip_grad_norm_`` made before the first compile refuses too) and
# ``get_total_norm`` given a wide model's gradients (or parameters). A mix of wide and plain
# parameters is refused as well (the plain ones clip by the wide ones' norm). ``clip_grad_value_``
# is elementwise (exact per member) and is left alone. The wrappers are installed with the step
# hook above, when the first model is compiled, never at import, and call torch's function
# unchanged for anything else. Which parameters are a wide model's: those ``wc.compile`` made
# (``note_wide_parameters``), or found held by a wide_compiler module (``_wide_owners``: a
# ``wc.nn`` layer; searched once per parameter: the modules found are kept by weak reference, the
# plain parameters by id, so a plain model's clipping costs one search at its first call). ``get_total_norm``
# is given gradients, whose parameter cannot be searched for: it refuses the gradients (or the
# parameters) of those parameters found so far. Not checked: a function imported from torch before
# the first compile other than ``clip_grad_norm_`` (``from torch.nn.utils import get_total_norm``
# or ``clip_grads_with_norm_`` at the top of a script: the name holds torch's own function), and a call traced by ``torch.compile`` (the check is skipped there, so that a
# compiled training step of a plain model traces as before).
_WRAPPED = "_wide_compiler_wraps"  # attribute of a wrapper: the torch function it wraps
_WRAPPERS: dict[int, Any] = {}  # id(torch function) -> its wrapper (one per function, for all its names)
# The modules known to hold wide parameters (compiled models; wc.nn layers found by _wide_owners):
# weak references to the MODULES, never to their tensors (a weak reference to a tensor makes
# torch.utils.swap_tensors, which .to()/.float() use under swap_module_params_on_conversion, refuse
# it); and the ids of tensors found to be no wide model's (a plain model's clipping searches once).
_WIDE_MODULES: weakref.WeakSet = weakref.WeakSet()
_PLAIN: set[int] = set()
_PLAIN_MAX = 100_000  # forgotten past this many: a later search finds them again


def note_wide_parameters(model: torch.nn.Module) -> None:
    """Remember ``model`` as one holding a wide model's stacked parameters (Note [torch's norm
    clipping over a wide model]); called by ``wc.compile``."""
    _WIDE_MODULES.add(model)


def _wide_among(tensors: Sequence[torch.Tensor], *, grads: bool = False) -> list[torch.Tensor]:
    """Those of ``tensors`` that are a wide model's parameters, or (``grads``) a wide model's
    parameters or their gradients: those of the modules known (no search for the parameter a
    gradient belongs to)."""
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    known = {id(p) for m in list(_WIDE_MODULES) for p in m.parameters()}
    if grads:
        known |= {id(p.grad) for m in list(_WIDE_MODULES) for p in m.parameters() if p.grad is not None}
        return [t for t in tensors if id(t) in known]
    unknown = [t for t in tensors if id(t) not in known and id(t) not in _PLAIN]
    if unknown:
        owners = _wide_owners(unknown)
        _WIDE_MODULES.update(owners.values())
        known |= owners.keys()
        if len(_PLAIN) > _PLAIN_MAX:
            _PLAIN.clear()
        _PLAIN.update(id(t) for t in unknown if id(t) not in owners)
    return [t for t in tensors if id(t) in known]


def _refuse_wide_clipping(name: str, tensors: Any, *, grads: bool = False) -> None:
    """Raise for torch's ``name`` over a wide model's parameters (Note [torch's norm clipping over a
    wide model]); return for anything else."""
    ts = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    if not ts:
        return
    wide = _wide_among(ts, grads=grads)
    if not wide:
        return
    from .errors import UnsupportedOperationError

    shapes = ", ".join(str(list(t.shape)) for t in wide[:4]) + (", ..." if len(wide) > 4 else "")
    plain = len(ts) - len(wide)
    mixed = (f" together with {plain} tensor(s) that are not a wide model's (clipped by the norm of "
             f"all of them)") if plain else ""
    what = "gradients" if grads else "parameters"
    fix = ("wide_compiler.optim.member_grad_norms(wide.parameters()) (a norm per member, [N])" if grads else
           "wide_compiler.optim.clip_grad_norm_(wide.parameters(), max_norm) (a norm per member, each "
           "member clipped as torch clips it alone; max_norm a float or N values)")
    raise UnsupportedOperationError(
        f"wide_compiler: torch.nn.utils.{name} was given a wide model's stacked {what} (shape {shapes}){mixed}: "
        f"it computes ONE norm over all of them, i.e. over all members together, so each member would be "
        f"clipped by the others' gradients, not as it is alone (Note [torch's norm clipping over a wide "
        f"model] in wide_compiler/torch_guards.py). Nothing was changed.\n"
        f"What to do: use {fix}"
        + ("; clip other parameters with torch's own call on them alone" if plain else "")
        + ". torch.nn.utils.clip_grad_value_ is elementwise and fine as it is.")


def _wrap_clipping(fn: Any, name: str, *, grads: bool = False) -> Any:
    """``fn`` (a torch.nn.utils clipping function) refusing a wide model's parameters first."""
    import functools

    if getattr(fn, _WRAPPED, None) is not None:
        return fn
    if id(fn) in _WRAPPERS:
        return _WRAPPERS[id(fn)]
    first = "tensors" if grads else "parameters"

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if args:
            tensors = args[0] if isinstance(args[0], torch.Tensor) else list(args[0])  # a generator: read once
            args = (tensors, *args[1:])
        elif first in kwargs:
            tensors = kwargs[first] if isinstance(kwargs[first], torch.Tensor) else list(kwargs[first])
            kwargs[first] = tensors
        else:
            return fn(*args, **kwargs)  # torch's own error
        if not torch.compiler.is_compiling():  # nothing for torch.compile to trace into (a fullgraph step)
            _refuse_wide_clipping(name, tensors, grads=grads)
        return fn(*args, **kwargs)

    setattr(wrapper, _WRAPPED, fn)
    _WRAPPERS[id(fn)] = wrapper
    return wrapper


def _watch_torch_clipping() -> None:
    """Wrap torch's norm clipping functions (Note [torch's norm clipping over a wide model])."""
    import torch.nn.utils as nn_utils
    from torch.nn.utils import clip_grad

    for module in (nn_utils, clip_grad):
        for attr, name, grads in (("clip_grad_norm_", "clip_grad_norm_", False),
                                  ("clip_grad_norm", "clip_grad_norm", False),
                                  ("clip_grads_with_norm_", "clip_grads_with_norm_", False),
                                  ("_clip_grads_with_norm_", "clip_grads_with_norm_", False),
                                  ("get_total_norm", "get_total_norm", True)):
            fn = vars(module).get(attr)
            if callable(fn):
                setattr(module, attr, _wrap_clipping(fn, name, grads=grads))


def _wide_owners(params: Sequence[torch.Tensor]) -> dict[int, torch.nn.Module]:
    """``id(p)`` -> the wide_compiler module that holds ``p`` as a parameter, for
    those of ``params`` a wide_compiler module (a wide model) holds: found through the garbage
    collector's referrers (the module's ``_parameters`` dict, its ``__dict__``, the module), run
    once per optimizer of the three mixing classes only."""
    import gc

    if not params:
        return {}
    ids = {id(p) for p in params}
    tables = [d for d in gc.get_referrers(*params) if type(d) is dict and any(id(v) in ids for v in d.values())]
    found: dict[int, torch.nn.Module] = {}
    level = tables
    for _ in range(2):  # the table's holder: the module itself, or its __dict__ and then the module
        if not level:
            break
        nxt = []
        for r in gc.get_referrers(*level):
            if isinstance(r, torch.nn.Module):
                table = vars(r).get("_parameters")
                if any(table is d for d in tables) and type(r).__module__.startswith("wide_compiler"):
                    found.update({id(p): r for p in table.values() if p is not None and id(p) in ids})
            elif type(r) is dict and any(r.get("_parameters") is d for d in tables):
                nxt.append(r)
        level = nxt
    return found


def _refuse_mixing_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """torch's global optimizer step pre-hook (Note [torch.optim optimizers that mix members])."""
    kind = type(optimizer)
    name = _CLASS_NAMES.get(kind, _ABSENT)
    if name is _ABSENT:
        name = _CLASS_NAMES[kind] = _torch_optim_class(optimizer)
    if name not in _MIXES_MEMBERS:
        return None
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if _CHECKED.get(optimizer) == len(params):
        return None
    dim, how = _MIXES_MEMBERS[name]
    owners = _wide_owners(params)
    mixed = [p for p in params if id(p) in owners and p.dim() >= 1 and p.shape[0] > 1
             and (dim is None or p.dim() == dim)]
    if mixed:
        from .errors import UnsupportedOperationError

        shapes = ", ".join(str(list(p.shape)) for p in mixed[:4]) + (", ..." if len(mixed) > 4 else "")
        raise UnsupportedOperationError(
            f"wide_compiler: torch.optim.{name} holds a wide model's stacked parameter(s) (shape {shapes}) "
            f"and {how}: the members would not train as they train alone "
            f"(Note [torch.optim optimizers that mix members] in wide_compiler/torch_guards.py). Nothing was changed.\n"
            f"What to do: use an optimizer whose update is per element (torch.optim.Adam/AdamW/SGD/..., or "
            f"wide_compiler.optim's), or step each member with its own {name} (wide.member(i))")
    _CHECKED[optimizer] = len(params)
    return None


def _torch_optim_class(optimizer: torch.optim.Optimizer) -> str | None:
    """The name of the ``torch.optim`` class ``optimizer`` is an instance of, if any."""
    for cls in type(optimizer).__mro__:
        if cls is not torch.optim.Optimizer and getattr(torch.optim, cls.__name__, None) is cls:
            return cls.__name__
    return None
