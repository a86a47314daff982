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
from collections.abc import Iterable, Mapping, Sequence
from enum import Enum
from typing import Any

import torch

from .torch_guards import _torch_optim_class

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
            dampens = dampens[torch.as_tensor(list(skipped), dtype=torch.long, device=dampens.device)]
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
