"""Mixed-precision training of N members: a gradient scaler with one loss scale per member.

``torch.amp.GradScaler`` keeps ONE scale: used on a wide model, one member's overflow would skip
every member's step and back off everyone's scale. :class:`GradScaler` keeps N scales (and N
growth trackers): member ``i``'s loss is multiplied by ``scale[i]``, its gradients (its slice
``[i]`` of every stacked ``[N, ...]`` gradient) are unscaled by ``1 / scale[i]`` and checked for
inf/NaN on their own, a member whose gradients overflow skips ITS step (its slice of the
parameters and of the optimizer state is left untouched) and backs off ITS scale, and the others
step and grow as usual. Member ``i`` follows exactly what a ``torch.amp.GradScaler`` does for
that member trained alone.

Example:
    >>> import torch, wide_compiler as wc
    >>> models = [torch.nn.Linear(4, 1) for _ in range(3)]
    >>> wide = wc.compile(models, torch.randn(2, 4), config=wc.WideConfig.fast())
    >>> opt = wc.optim.SGD(wide.parameters(), lr=0.1)
    >>> scaler = wc.amp.GradScaler(init_scale=2.0 ** 16)
    >>> x = torch.randn(3, 8, 4)
    >>> x[2, 0, 0] = float("inf")                    # member 2 overflows this step
    >>> losses = wide(x).pow(2).mean(dim=(1, 2))     # one loss per member: [3]
    >>> scaler.scale(losses).sum().backward()        # member i's gradients are scaled by scale[i]
    >>> before = wide.member_state_dict(2)["weight"].clone()
    >>> scaler.step(opt)                             # members 0 and 1 step, member 2 skips
    >>> scaler.update()
    >>> scaler.get_scale().tolist()
    [65536.0, 65536.0, 32768.0]
    >>> torch.equal(wide.member_state_dict(2)["weight"], before)
    True
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable, Mapping, Sequence
from enum import Enum
from typing import Any

import torch

__all__ = ["GradScaler"]

log = logging.getLogger(__name__)


class _Stage(Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


def _fresh_state() -> dict[str, Any]:
    return {"stage": _Stage.READY, "found_inf": None}


# Note [Skipping one member's step]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# When some members overflow and others do not, the optimizer steps once for all and the skipped
# members' slices are put back: of the parameters, and of every per-member state tensor (dim 0 =
# N). That is exact only when every state the update reads is per member, and when state the
# step creates can be set, in a skipped member's slice, to what the optimizer would create:
#
# * ``torch.optim`` optimizers keep one ``step`` (a 0-d tensor) per stacked parameter, shared by
#   all members. Adam, AdamW, Adamax, NAdam, RAdam, Adafactor (bias correction, decay rates),
#   ASGD (``eta``, ``mu``), Adagrad with ``lr_decay != 0`` and LBFGS (all of its state) read it,
#   so a skipped member would later step with the others' count (issue 44: Adam 20% off after a
#   skipped first step). No slice can hold two counts: such a step is refused before the
#   optimizer runs (nothing changes), and the first step() with such an optimizer warns that it
#   will be. SGD, RMSprop, Adadelta, Rprop and Adagrad without ``lr_decay`` only count with it;
#   it then counts the optimizer's steps, not the member's, and nothing reads it.
# * A state created by this step (the first step with state) starts, in a skipped member's
#   slice, as the optimizer starts it: zeros (moments, RMSprop's and Adadelta's averages,
#   Rprop's ``prev``, SGD's momentum buffer), Rprop's ``step_size`` at the group's ``lr``. SGD
#   starts its buffer at the first gradient, undamped, which a zero buffer gives only with
#   ``dampening == 0``: with dampening, such a first step is refused too. That holds for
#   ``wide_compiler.optim.SGD`` (and any optimizer with ``momentum`` and ``dampening`` in its
#   groups) as well, counting only the skipped members' hyperparameters where they are per
#   member: a member whose first step was skipped ended a quarter of an update off its own run
#   (probe 6 of issue 44, F4).
# * Other optimizers (``wide_compiler.optim``'s, whose state is per member, and third-party
#   ones) keep the generic rule: fresh per-member state starts at zero, and shared state is
#   reported with a warning.
_READ_SHARED = {  # torch.optim class name -> the shared state its update reads
    "Adam": "`step` (bias correction)", "AdamW": "`step` (bias correction)",
    "Adamax": "`step` (bias correction)", "NAdam": "`step` and `mu_product` (bias correction)",
    "RAdam": "`step` (bias correction, rectification)", "Adafactor": "`step` (its decay rate)",
    "ASGD": "`step`, `eta` and `mu` (its averaging and learning rate)",
    "SparseAdam": "`step` (bias correction)",
    "LBFGS": "its whole state (directions, step size, iteration counts)",
}


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
# ``wc.nn`` layer; searched once per parameter, the answer kept by identity, so a plain model's
# clipping costs one search at its first call, then a lookup per parameter). ``get_total_norm``
# is given gradients, whose parameter cannot be searched for: it refuses the gradients (or the
# parameters) of those parameters found so far. Not checked: a function imported from torch before
# the first compile other than ``clip_grad_norm_`` (``from torch.nn.utils import get_total_norm``
# or ``clip_grads_with_norm_`` at the top of a script: the name holds torch's own function), and a call traced by ``torch.compile`` (the check is skipped there, so that a
# compiled training step of a plain model traces as before).
_WRAPPED = "_wide_compiler_wraps"  # attribute of a wrapper: the torch function it wraps
_WRAPPERS: dict[int, Any] = {}  # id(torch function) -> its wrapper (one per function, for all its names)
_TABLES: list[Any] = []  # [checked, wide]: torch.utils.weak.WeakIdKeyDictionary's, made at first use


def _tables() -> tuple[Any, Any]:
    """(every parameter checked -> whether a wide model's, the wide models' parameters -> True)."""
    if not _TABLES:
        from torch.utils.weak import WeakIdKeyDictionary

        _TABLES.extend([WeakIdKeyDictionary(), WeakIdKeyDictionary()])
    return _TABLES[0], _TABLES[1]


def note_wide_parameters(params: Iterable[torch.Tensor]) -> None:
    """Remember ``params`` as a wide model's stacked parameters (Note [torch's norm clipping over a
    wide model]); called by ``wc.compile``."""
    checked, wide = _tables()
    for p in params:
        checked[p] = wide[p] = True


def _wide_among(tensors: Sequence[torch.Tensor], *, grads: bool = False) -> list[torch.Tensor]:
    """Those of ``tensors`` that are a wide model's parameters, or (``grads``) a wide model's
    parameters or their gradients: those are found among the parameters seen (no search for the
    parameter a gradient belongs to)."""
    checked, wide = _tables()
    if grads:
        wide_grads = {id(p.grad) for p in list(wide.keys()) if p.grad is not None}
        return [t for t in tensors if t in wide or id(t) in wide_grads]
    unknown = [t for t in tensors if isinstance(t, torch.Tensor) and t not in checked]
    if unknown:
        owners = _wide_owners(unknown)
        for t in unknown:
            checked[t] = id(t) in owners
            if id(t) in owners:
                wide[t] = True
    return [t for t in tensors if isinstance(t, torch.Tensor) and checked.get(t)]


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
        f"model] in wide_compiler/amp.py). Nothing was changed.\n"
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


def _wide_owners(params: Sequence[torch.Tensor]) -> dict[int, str]:
    """``id(p)`` -> the class name of the wide_compiler module that holds ``p`` as a parameter, for
    those of ``params`` a wide_compiler module (a wide model) holds: found through the garbage
    collector's referrers (the module's ``_parameters`` dict, its ``__dict__``, the module), run
    once per optimizer of the three mixing classes only."""
    import gc

    if not params:
        return {}
    ids = {id(p) for p in params}
    tables = [d for d in gc.get_referrers(*params) if type(d) is dict and any(id(v) in ids for v in d.values())]
    found: dict[int, str] = {}
    level = tables
    for _ in range(2):  # the table's holder: the module itself, or its __dict__ and then the module
        if not level:
            break
        nxt = []
        for r in gc.get_referrers(*level):
            if isinstance(r, torch.nn.Module):
                table = vars(r).get("_parameters")
                if any(table is d for d in tables) and type(r).__module__.startswith("wide_compiler"):
                    found.update({id(p): type(r).__name__ for p in table.values() if p is not None and id(p) in ids})
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
            f"(Note [torch.optim optimizers that mix members] in wide_compiler/amp.py). Nothing was changed.\n"
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


def _shared_read(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer`` cannot skip one member's step (state shared by the members that its
    update reads), or None: Note [Skipping one member's step]."""
    name = _torch_optim_class(optimizer)
    if name in _READ_SHARED:
        return f"keeps {_READ_SHARED[name]} shared by all members of a stacked parameter, and its update reads it"
    if name == "Adagrad" and any(bool(torch.as_tensor(g.get("lr_decay", 0)).ne(0).any())
                                 for g in optimizer.param_groups):
        return "keeps `step` shared by all members of a stacked parameter, and with lr_decay != 0 its update reads it"
    return None


def _fresh_refusal(optimizer: torch.optim.Optimizer, skipped: Sequence[int]) -> str | None:
    """Why a step that creates ``optimizer``'s state cannot leave the ``skipped`` members as never
    stepped, or None (Note [Skipping one member's step]): SGD's momentum buffer, torch.optim's or
    wide_compiler.optim's (per-member hyperparameters: only the skipped members' count)."""
    for group in optimizer.param_groups:
        if "momentum" not in group or "dampening" not in group:
            continue
        momentum, dampening = (torch.as_tensor(group[k]).cpu() for k in ("momentum", "dampening"))
        dampens = (momentum != 0) & (dampening != 0)
        if dampens.dim() == 1:  # one value per member
            dampens = dampens[torch.as_tensor(list(skipped), dtype=torch.long)]
        if not bool(dampens.any()):
            continue
        if any(p.grad is not None and "momentum_buffer" not in optimizer.state.get(p, {}) for p in group["params"]):
            return ("starts its momentum buffer at the first gradient, undamped, and with dampening != 0 a "
                    "buffer that starts at zero (a skipped member's) gives another first step")
    return None


def _fresh_value(optimizer: torch.optim.Optimizer, group: Mapping[str, Any], key: str) -> float:
    """What ``optimizer`` starts its state ``key`` at (Note [Skipping one member's step])."""
    if key == "step_size" and _torch_optim_class(optimizer) == "Rprop":
        lr = group["lr"]
        return float(lr.item() if isinstance(lr, torch.Tensor) else lr)
    return 0.0


class GradScaler:
    """Per-member loss scaling for N fused members (``torch.amp.GradScaler``, one scale per member).

    Use it as ``torch.amp.GradScaler``, with one difference: :meth:`scale` takes the members'
    losses as a tensor whose dim 0 is the member dim (``[N]``, or ``[N, ...]``), not their sum,
    and scales member ``i``'s by ``scale[i]``; sum the result before ``backward()``.

    Args:
        device: accepted for symmetry with ``torch.amp.GradScaler``; the scales live on the device
            of the first tensor given to :meth:`scale`.
        init_scale: the initial scale, one float for all members or N values.
        growth_factor, backoff_factor, growth_interval: as in ``torch.amp.GradScaler``, applied
            to each member on its own: a member whose gradients overflow multiplies its scale by
            ``backoff_factor`` and restarts its count of good steps; a member with
            ``growth_interval`` good steps in a row multiplies its scale by ``growth_factor``.
        enabled: ``False`` makes every method a pass-through (``step`` just steps).
        n: the number of members; default: dim 0 of the first tensor given to :meth:`scale`.

    Optimizers: any ``torch.optim.Optimizer`` over stacked ``[N, ...]`` parameters (a
    :class:`~wide_compiler.WideModel`'s), :mod:`wide_compiler.optim` ones included. When some
    members overflow and others do not, the optimizer steps once and the skipped members' slices
    of the parameters and of every per-member state tensor (dim 0 = N: moments, momentum buffers,
    the per-member ``step`` counts of :mod:`wide_compiler.optim`) are put back as they were (or,
    for state this step created, set as the optimizer creates it), so a skipped member is exactly
    where ``torch.amp.GradScaler`` leaves it, from the first step on. A ``torch.optim`` optimizer
    whose update reads state shared by all members (``Adam``'s one 0-d ``step`` per stacked
    parameter, for its bias correction) cannot skip one member's step: a warning says so at its
    first step, and a step where some members overflow and others do not raises before anything
    changes (Note [Skipping one member's step]); use :mod:`wide_compiler.optim`, whose state is
    per member.

    Example:
        >>> import torch, wide_compiler as wc
        >>> models = [torch.nn.Linear(3, 1) for _ in range(4)]
        >>> wide = wc.compile(models, torch.randn(2, 3), config=wc.WideConfig.fast())
        >>> opt = wc.optim.Adam(wide.parameters(), lr=[1e-3, 1e-2, 1e-2, 1e-1])
        >>> scaler = wc.amp.GradScaler()
        >>> x, y = torch.randn(4, 16, 3), torch.randn(4, 16, 1)
        >>> for _ in range(3):
        ...     losses = wc.optim.member_losses(torch.nn.functional.mse_loss, wide(x), y)  # [4]
        ...     opt.zero_grad()
        ...     scaler.scale(losses).sum().backward()
        ...     scaler.unscale_(opt)                     # optional: e.g. to clip per member
        ...     _ = wc.optim.clip_grad_norm_(wide.parameters(), max_norm=1.0)
        ...     scaler.step(opt)
        ...     scaler.update()
        >>> scaler.get_scale().shape
        torch.Size([4])
    """

    def __init__(self, device: str = "cpu", init_scale: float | Sequence[float] | torch.Tensor = 2.0 ** 16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5, growth_interval: int = 2000,
                 enabled: bool = True, *, n: int | None = None) -> None:
        if growth_factor <= 1.0:
            raise ValueError(f"wc.amp.GradScaler: growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"wc.amp.GradScaler: backoff_factor must be in (0, 1), got {backoff_factor}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"wc.amp.GradScaler: growth_interval must be an int >= 1, got {growth_interval!r}")
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"wc.amp.GradScaler: n must be an int >= 1, got {n!r}")
        self._device = device
        self._enabled = bool(enabled)
        self._init_scale = init_scale
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = growth_interval
        self._n = n
        self._scale: torch.Tensor | None = None          # float32 [N]
        self._growth_tracker: torch.Tensor | None = None  # int32 [N]
        self._per_optimizer_states: dict[int, dict[str, Any]] = {}
        self._warned_shared: set[int] = set()
        if self._enabled and n is not None:
            self._scale = self._initial_scale(n, torch.device("cpu"))

    # -- set-up ---------------------------------------------------------------------------------
    def _initial_scale(self, n: int, device: torch.device) -> torch.Tensor:
        v = self._init_scale
        if isinstance(v, torch.Tensor):
            t = v.detach().to(device=device, dtype=torch.float32).reshape(-1)
        elif isinstance(v, (int, float)):
            t = torch.full((n,), float(v), dtype=torch.float32, device=device)
        else:
            t = torch.tensor([float(x) for x in v], dtype=torch.float32, device=device)
        if t.numel() == 1:
            t = t.expand(n).clone()
        if t.numel() != n:
            raise ValueError(f"wc.amp.GradScaler: init_scale has {t.numel()} values; expected one "
                             f"or N={n} (one per member)")
        bad = (~torch.isfinite(t) | (t <= 0)).nonzero()
        if len(bad):
            i = int(bad[0])
            raise ValueError(f"wc.amp.GradScaler: init_scale for member {i} is {t[i].item()}; "
                             "expected a finite positive number")
        return t.clone()

    def _lazy_init(self, n: int, device: torch.device) -> None:
        if self._n is None:
            self._n = n
        elif n != self._n:
            raise ValueError(f"wc.amp.GradScaler: got a tensor with {n} members on dim 0, but the "
                             f"scaler has N={self._n} (one scale per member)")
        if self._scale is None:
            self._scale = self._initial_scale(self._n, device)
        elif self._scale.device != device:
            self._scale = self._scale.to(device)
        if self._growth_tracker is None:
            self._growth_tracker = torch.zeros(self._n, dtype=torch.int32, device=self._scale.device)
        elif self._growth_tracker.device != self._scale.device:
            self._growth_tracker = self._growth_tracker.to(self._scale.device)

    @property
    def n(self) -> int | None:
        """The number of members (None until known)."""
        return self._n

    def is_enabled(self) -> bool:
        return self._enabled

    # -- scaling ----------------------------------------------------------------------------------
    def scale(self, outputs: Any) -> Any:
        """Member ``i``'s slice ``[i]`` of ``outputs`` (a tensor ``[N, ...]``, typically the
        members' losses ``[N]``, or a list/tuple/dict of such tensors) multiplied by ``scale[i]``.
        Sum the result before ``backward()``: member ``i``'s gradients are then scaled by
        ``scale[i]`` and by nothing else.

        A 0-d tensor (the members' losses already summed) is refused: its gradient reaches every
        member with one factor, so it cannot carry one scale per member."""
        if not self._enabled:
            return outputs

        def one(t: torch.Tensor) -> torch.Tensor:
            if t.dim() == 0:
                raise ValueError(
                    "wc.amp.GradScaler.scale: got a 0-d tensor (one loss for all members?); pass "
                    "the members' losses as a tensor [N] (e.g. wc.optim.member_losses(...)) and "
                    "sum the scaled result: each member's loss gets its own scale")
            self._lazy_init(int(t.shape[0]), t.device)
            s = self._scale if self._scale.device == t.device else self._scale.to(t.device)
            return t * s.reshape(-1, *([1] * (t.dim() - 1)))

        def walk(v: Any) -> Any:
            if isinstance(v, torch.Tensor):
                return one(v)
            if isinstance(v, Mapping):
                return {k: walk(x) for k, x in v.items()}
            if isinstance(v, (list, tuple)):
                out = [walk(x) for x in v]
                return type(v)(out) if type(v) in (list, tuple) else out
            raise TypeError(f"wc.amp.GradScaler.scale: expected a tensor [N, ...] or a list/tuple/"
                            f"dict of them, got {type(v).__name__}")

        return walk(outputs)

    def _state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return self._per_optimizer_states.setdefault(id(optimizer), _fresh_state())

    def _scaled_state(self, optimizer: torch.optim.Optimizer, method: str) -> dict[str, Any]:
        """``optimizer``'s state once :meth:`scale` has run; before, a RuntimeError naming ``method``."""
        if self._scale is None or self._n is None:
            raise RuntimeError(f"wc.amp.GradScaler.{method}: no scale yet; call scale() on the "
                               "members' losses first")
        return self._state(optimizer)

    def _grads(self, optimizer: torch.optim.Optimizer) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        for gi, group in enumerate(optimizer.param_groups):
            for k, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                g = p.grad
                if g.is_sparse:
                    raise ValueError("wc.amp.GradScaler: sparse gradients are not supported")
                if g.dim() == 0 or g.shape[0] != self._n:
                    raise ValueError(
                        f"wc.amp.GradScaler: parameter {k} of param group {gi} has a gradient of "
                        f"shape {list(g.shape)}; expected [N, ...] with N={self._n} members on dim 0 "
                        "(the stacked parameters of a WideModel)")
                yield p, g

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide member ``i``'s slice of every gradient of ``optimizer`` by ``scale[i]`` (in place)
        and record which members' gradients hold an inf or NaN. Optional: :meth:`step` calls it
        when it was not called; call it before clipping gradients. Once per :meth:`update`."""
        if not self._enabled:
            return
        state = self._scaled_state(optimizer, "unscale_")
        if state["stage"] is _Stage.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is _Stage.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        self._unscale(optimizer, state, self._found_inf(optimizer))

    def _found_inf(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """1.0 for each member with an inf or NaN in a gradient of ``optimizer``, else 0.0 (the
        scaled gradients are read, as torch's kernel tests each value before it unscales it)."""
        self._lazy_init(self._n, self._scale.device)
        found = torch.zeros(self._n, dtype=torch.float32, device=self._scale.device)
        for _, g in self._grads(optimizer):
            if g.dtype == torch.float16:
                raise ValueError("Attempting to unscale FP16 gradients.")
            bad = ~torch.isfinite(g).reshape(self._n, -1).all(dim=1)
            found = torch.where(bad.to(found.device), torch.ones_like(found), found)
        return found

    def _unscale(self, optimizer: torch.optim.Optimizer, state: dict[str, Any], found: torch.Tensor) -> None:
        # as torch: the reciprocal in double, rounded to float32; grad * inv_scale as its kernel does
        inv = self._scale.double().reciprocal().float()
        with torch.no_grad():
            for _, g in self._grads(optimizer):
                g.mul_(inv.to(g.device).reshape(-1, *([1] * (g.dim() - 1))))
        state["found_inf"] = found
        state["stage"] = _Stage.UNSCALED

    # -- stepping ---------------------------------------------------------------------------------
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless :meth:`unscale_` was called) and step: the members whose gradients
        are finite step, each member that found an inf or NaN keeps its parameters and optimizer
        state as they were. Returns what ``optimizer.step`` returns (None when every member
        skipped)."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        state = self._scaled_state(optimizer, "step")
        if state["stage"] is _Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        shared = _shared_read(optimizer)
        if shared is not None and id(optimizer) not in self._warned_shared:
            self._warned_shared.add(id(optimizer))
            log.warning("wc.amp.GradScaler: %s %s, so it cannot skip one member's step: a step where some "
                        "members overflow and others do not will raise (use wide_compiler.optim, whose state "
                        "is per member)", type(optimizer).__name__, shared)
        # found before unscaling: a refusal below leaves the gradients and this scaler as they were
        # before step() (a retry with new gradients then unscales those)
        unscaled = state["stage"] is _Stage.UNSCALED
        found = state["found_inf"] if unscaled else self._found_inf(optimizer)
        skip = (found > 0).cpu()
        if bool(skip.any()) and not bool(skip.all()):
            members = skip.nonzero().flatten().tolist()
            reason = shared or _fresh_refusal(optimizer, members)
            if reason is not None:
                advice = ("Use the wide_compiler.optim optimizer (per-member state), or one optimizer per member."
                          if shared else
                          "A first momentum buffer that one tensor holds for every member cannot start for some "
                          "members only (torch.optim's SGD and wide_compiler.optim's alike): use dampening=0, or "
                          "one optimizer and one torch.amp.GradScaler per member.")
                raise RuntimeError(
                    f"wc.amp.GradScaler.step: member(s) {members} found inf/NaN gradients and the others did "
                    f"not, so only theirs must be skipped, but {type(optimizer).__name__} {reason}: skipping "
                    "them could not leave them where their own torch.amp.GradScaler would (Note [Skipping "
                    "one member's step] in wide_compiler/amp.py). Nothing was changed (parameters, optimizer "
                    f"state, the gradients ({'unscaled by your unscale_()' if unscaled else 'still scaled'}) "
                    f"and this scaler are as they were before step()). {advice}")
        if not unscaled:
            self._unscale(optimizer, state, found)
        state["stage"] = _Stage.STEPPED
        if not bool(skip.any()):
            return optimizer.step(*args, **kwargs)
        if bool(skip.all()):
            return None
        return self._masked_step(optimizer, skip.nonzero().flatten().tolist(), args, kwargs)

    def _masked_step(self, optimizer: torch.optim.Optimizer, members: list[int], args: tuple,
                     kwargs: dict) -> Any:
        """Step ``optimizer`` for every member, then put the slices of ``members`` (parameters and
        per-member optimizer state) back as they were, or for state this step created, as the
        optimizer creates it (Note [Skipping one member's step])."""
        idx = torch.tensor(members, dtype=torch.long)
        saved = []
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    i = idx.to(p.device)
                    st = optimizer.state.get(p)
                    slices = None if not st else {
                        k: v.index_select(0, i.to(v.device)) for k, v in st.items()
                        if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == self._n}
                    if st:
                        self._warn_shared(optimizer, st)
                    saved.append((p, group, i, p.detach().index_select(0, i), slices))
        retval = optimizer.step(*args, **kwargs)
        with torch.no_grad():
            for p, group, i, weights, slices in saved:
                p.index_copy_(0, i, weights)
                st = optimizer.state.get(p) or {}
                if slices is None:
                    self._warn_shared(optimizer, st)
                for k, v in st.items():
                    if not (isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == self._n):
                        continue
                    if slices is not None and k in slices:
                        v.index_copy_(0, i.to(v.device), slices[k])
                    else:             # state created by this step: the member's starts as the optimizer's
                        v.index_fill_(0, i.to(v.device), _fresh_value(optimizer, group, k))
        return retval

    def _warn_shared(self, optimizer: torch.optim.Optimizer, st: Mapping[str, Any]) -> None:
        """Warn once that ``optimizer`` (not a torch.optim one: Note [Skipping one member's step])
        keeps tensor state shared by the members, which a skipped member still advances."""
        if id(optimizer) in self._warned_shared or _torch_optim_class(optimizer) is not None:
            return
        shared = [k for k, v in st.items() if isinstance(v, torch.Tensor) and (v.dim() == 0 or v.shape[0] != self._n)]
        if shared:
            self._warned_shared.add(id(optimizer))
            log.warning("wc.amp.GradScaler: %s keeps state %s shared by all members; a member whose step is "
                        "skipped still advances it (use wide_compiler.optim, whose state is per member, to "
                        "match torch.amp.GradScaler exactly)", type(optimizer).__name__, shared)

    def update(self, new_scale: float | Sequence[float] | torch.Tensor | None = None) -> None:
        """Per member, as ``torch.amp.GradScaler.update``: a member that found an inf or NaN (in
        any optimizer stepped since the last update) multiplies its scale by ``backoff_factor``
        and restarts its count; the others count a good step and grow their scale by
        ``growth_factor`` after ``growth_interval`` good steps in a row (when the grown scale is
        finite). ``new_scale`` (one float, or N values) sets the scales instead."""
        if not self._enabled:
            return
        if self._scale is None or self._growth_tracker is None:
            raise RuntimeError("wc.amp.GradScaler.update: no scale yet; call scale() first")
        if new_scale is not None:
            if isinstance(new_scale, torch.Tensor) and new_scale.requires_grad:
                raise ValueError("wc.amp.GradScaler.update: new_scale must not require grad")
            saved, self._init_scale = self._init_scale, new_scale
            try:
                self._scale = self._initial_scale(self._n, self._scale.device)
            finally:
                self._init_scale = saved
        else:
            found = [s["found_inf"] for s in self._per_optimizer_states.values() if s["found_inf"] is not None]
            if not found:
                raise AssertionError("No inf checks were recorded prior to update.")
            bad = torch.stack([f.to(self._scale.device) for f in found]).sum(0) > 0
            good = self._growth_tracker + 1
            grow = ~bad & (good == self._growth_interval)
            # as torch's kernel: the product in double, rounded to float32
            backed = (self._scale.double() * self._backoff_factor).float()
            grown = (self._scale.double() * self._growth_factor).float()
            grown = torch.where(torch.isfinite(grown), grown, self._scale)
            self._scale = torch.where(bad, backed, torch.where(grow, grown, self._scale))
            self._growth_tracker = torch.where(bad | grow, torch.zeros_like(good), good).to(torch.int32)
        self._per_optimizer_states = {}

    # -- introspection and state ------------------------------------------------------------------
    def get_scale(self) -> torch.Tensor | float:
        """The members' current scales, a float32 tensor ``[N]`` (a copy); 1.0 when disabled;
        ``init_scale`` for each member before the first :meth:`scale` (when N is known)."""
        if not self._enabled:
            return 1.0
        if self._scale is None:
            if self._n is None:
                raise RuntimeError("wc.amp.GradScaler.get_scale: N is not known yet (pass n=... or "
                                   "call scale() first)")
            return self._initial_scale(self._n, torch.device("cpu"))
        return self._scale.detach().clone()

    def get_growth_tracker(self) -> torch.Tensor | int:
        """Each member's count of good steps in a row (int32 ``[N]``)."""
        if self._growth_tracker is None:
            return 0 if self._n is None else torch.zeros(self._n, dtype=torch.int32)
        return self._growth_tracker.clone()

    def found_inf(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """Which members' gradients held an inf or NaN at the last unscale of ``optimizer``
        (a bool ``[N]``; None before it): the members whose step is (or was) skipped."""
        f = self._per_optimizer_states.get(id(optimizer), {}).get("found_inf")
        return None if f is None else f > 0

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._growth_factor = float(new_factor)

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._backoff_factor = float(new_factor)

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._growth_interval = int(new_interval)

    def state_dict(self) -> dict[str, Any]:
        """``{"scale": [N], "growth_factor", "backoff_factor", "growth_interval",
        "_growth_tracker": [N]}`` (tensors on the CPU); empty when disabled."""
        if not self._enabled:
            return {}
        return {"scale": self.get_scale().cpu(), "growth_factor": self._growth_factor,
                "backoff_factor": self._backoff_factor, "growth_interval": self._growth_interval,
                "_growth_tracker": torch.as_tensor(self.get_growth_tracker()).cpu()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; the number of members must match (when this scaler knows
        it). A ``torch.amp.GradScaler``'s state (one scale) gives every member that scale."""
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError("The source state dict is empty, possibly because it was saved "
                               "from a disabled instance of GradScaler.")
        scale = torch.as_tensor(state_dict["scale"], dtype=torch.float32).reshape(-1)
        tracker = torch.as_tensor(state_dict["_growth_tracker"], dtype=torch.int32).reshape(-1)
        if self._n is not None and scale.numel() == 1 and tracker.numel() == 1:
            # one scale (a torch.amp.GradScaler's state_dict): every member starts from it
            scale, tracker = scale.expand(self._n), tracker.expand(self._n)
        n = scale.numel()
        if self._n is not None and n != self._n:
            raise ValueError(f"wc.amp.GradScaler.load_state_dict: the saved state has {n} members' "
                             f"scales; this scaler has N={self._n}")
        if tracker.numel() != n:
            raise ValueError(f"wc.amp.GradScaler.load_state_dict: {tracker.numel()} growth trackers "
                             f"for {n} scales")
        device = self._scale.device if self._scale is not None else torch.device("cpu")
        self._n = n
        self._init_scale = scale
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._scale = scale.clone().to(device)
        self._growth_tracker = tracker.clone().to(device)
