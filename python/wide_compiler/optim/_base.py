"""The base of the per-member optimizers: hyperparameters with one value per member, and the
member operations (copy, change, extract) that population-based training needs."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from numbers import Real
from typing import Any

import torch

from .._deprecation import warn_renamed

__all__ = ["WideOptimizer", "first_member", "per_member"]


def first_member(mask: torch.Tensor) -> int | None:
    """The first member whose entry of a boolean ``[N]`` mask is set (the first member to name in
    an error), or None where none is."""
    hits = mask.nonzero()
    return int(hits[0]) if len(hits) else None


# A per-member hyperparameter as given by the user: one float for all members, or N values.
HParam = float | Sequence[float] | torch.Tensor


def zeros_state(p: torch.Tensor) -> torch.Tensor:
    """A fresh contiguous state tensor shaped like parameter ``p``."""
    return torch.zeros_like(p, memory_format=torch.contiguous_format)


def per_member(value: Any, n: int, *, what: str) -> torch.Tensor:
    """``value`` (a float, N floats, or a 0-d / ``[N]`` tensor) as a float64 CPU tensor ``[N]``.

    Raises ``ValueError`` naming ``what`` when the number of values is not N or a value is not
    finite, and ``TypeError`` for something that is not a number.

    Example:
        >>> per_member(0.1, 3, what="lr")
        tensor([0.1000, 0.1000, 0.1000], dtype=torch.float64)
        >>> per_member([0.1, 0.2, 0.3], 3, what="lr").tolist()
        [0.1, 0.2, 0.3]
    """
    if isinstance(value, bool):
        raise TypeError(f"{what}: expected a float or {n} floats (one per member), got a bool")
    if isinstance(value, torch.Tensor):
        if value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{what}: expected a real tensor, got dtype {value.dtype}")
        t = value.detach().to("cpu", torch.float64)
        if t.dim() == 0 or (t.dim() == 1 and t.numel() == 1 and n != 1):
            t = t.reshape(()).expand(n)
        elif t.dim() != 1 or t.numel() != n:
            raise ValueError(
                f"{what}: expected one value per member (shape [{n}]) or one shared value, got a "
                f"tensor of shape {list(t.shape)}")
        t = t.clone()
    elif isinstance(value, Real):
        t = torch.full((n,), float(value), dtype=torch.float64, device="cpu")
    elif isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        values = list(value)
        if len(values) != n:
            raise ValueError(
                f"{what}: got {len(values)} values but there are N={n} members (dim 0 of every "
                f"parameter); pass one float for all members or exactly {n} values")
        for i, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, (Real, torch.Tensor)):
                raise TypeError(f"{what}: value {i} is {v!r}; expected a float")
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device="cpu")
    else:
        raise TypeError(f"{what}: expected a float or {n} floats (one per member), got {value!r}")
    i = first_member(~torch.isfinite(t))
    if i is not None:
        raise ValueError(f"{what}: value for member {i} is {t[i].item()}; expected a finite number")
    return t


# name -> (predicate on a float64 [N] tensor, the rule in words)
Rule = tuple[Callable[[torch.Tensor], torch.Tensor], str]


class WideOptimizer(torch.optim.Optimizer):
    """Base of the per-member optimizers of :mod:`wide_compiler.optim`.

    Every parameter is a stacked ``[N, ...]`` tensor whose dim 0 is the member dim (the parameters
    of a :class:`~wide_compiler.WideModel`, or any tensor laid out that way). Every hyperparameter
    of every param group is stored as a float64 tensor ``[N]`` (one value per member); flags
    (``nesterov``, ``amsgrad``, ``maximize``, ...) are shared. Subclasses declare
    ``_hparams`` (per-member names), ``_rules`` (validation) and implement ``_step_param``.
    """

    _hparams: tuple[str, ...] = ()
    _pairs: tuple[str, ...] = ()        # hyperparameters that are pairs of per-member values (betas)
    _flags: tuple[str, ...] = ()
    _rules: Mapping[str, Rule] = {}

    @torch.no_grad()
    def step(self, closure=None):
        """One step for every member; returns ``closure()`` when given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            self._renormalize(group, gi)
            prepared = self._prepare_group(group)
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{self._name} does not support sparse gradients")
                self._step_param(p, group, prepared)
        return loss

    def _renormalize(self, group: dict, index: int) -> None:
        """Hyperparameters assigned by hand since the last step (``group["lr"] = 1e-4``, the
        manual-schedule idiom) become per-member tensors again, validated."""
        def ok(v: Any) -> bool:
            return isinstance(v, torch.Tensor) and v.dtype == torch.float64 and v.shape == (self.n,)

        stale = {k: group[k] for k in self._hparams if k in group and not ok(group[k])}
        stale.update({k: group[k] for k in self._pairs
                      if k in group and not (isinstance(group[k], tuple) and all(ok(v) for v in group[k]))})
        if stale:
            group.update(self._normalize(stale, where=f"param group {index}"))
            self._check_group(group)

    def _renormalize_all(self) -> None:
        for gi, group in enumerate(self.param_groups):
            self._renormalize(group, gi)

    def _prepare_group(self, group: dict) -> Any:
        """What ``_step_param`` needs once per param group (default: nothing)."""
        return None

    def _step_param(self, p: torch.Tensor, group: dict, prepared: Any) -> None:
        """Update ``p`` and its state for all members: ONE fused ``torch.ops.wide.*_step`` call."""
        raise NotImplementedError

    def __init__(self, params: Iterable, defaults: dict[str, Any], *, n: int | None = None) -> None:
        if isinstance(params, torch.Tensor):
            raise TypeError(f"{self._name}: params must be an iterable of tensors or of param group "
                            f"dicts, got a Tensor")
        params = list(params)
        if n is None:
            first = next((p for p in _flat_params(params)), None)
            if first is None:
                raise ValueError(f"{self._name}: got an empty parameter list")
            if first.dim() == 0:
                raise ValueError(f"{self._name}: parameters must be stacked [N, ...] tensors (dim 0 "
                                 f"is the member dim), got a 0-dim parameter")
            n = int(first.shape[0])
        if n < 1:
            raise ValueError(f"{self._name}: expected N >= 1 members, got {n}")
        self.n = n
        super().__init__(params, self._normalize(defaults, where="defaults"))

    @property
    def _name(self) -> str:
        return f"wide_compiler.optim.{type(self).__name__}"

    # -- hyperparameters --------------------------------------------------------------------
    def _normalize(self, values: Mapping[str, Any], *, where: str) -> dict[str, Any]:
        """Validated copy of ``values`` with every per-member hyperparameter as a tensor [N]."""
        out = dict(values)
        for name in self._hparams:
            if name in values:
                out[name] = self._check(name, per_member(values[name], self.n,
                                                         what=f"{self._name}: {name} ({where})"))
        for name in self._pairs:
            if name in values:
                pair = values[name]
                if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                    raise ValueError(f"{self._name}: {name} ({where}) must be a pair (first, second), "
                                     f"each a float or {self.n} values; got {pair!r}")
                out[name] = tuple(
                    self._check(f"{name}[{k}]", per_member(v, self.n, what=f"{self._name}: "
                                                           f"{name}[{k}] ({where})"))
                    for k, v in enumerate(pair))
        for name in self._flags:
            if name in values and not isinstance(values[name], bool):
                raise TypeError(f"{self._name}: {name} ({where}) is a flag shared by all members; "
                                f"expected a bool, got {values[name]!r}")
        return out

    def _check(self, name: str, t: torch.Tensor) -> torch.Tensor:
        rule = self._rules.get(name)
        if rule is not None:
            ok, text = rule
            i = first_member(~ok(t))
            if i is not None:
                raise ValueError(f"{self._name}: invalid {name} {t[i].item()} for member {i}; "
                                 f"expected {text}")
        return t

    def _check_group(self, group: Mapping[str, Any]) -> None:
        """Cross-hyperparameter rules of a normalized group (e.g. nesterov); raises ValueError."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not isinstance(param_group, dict):
            raise TypeError(f"{self._name}: param_group must be a dict, got {type(param_group)}")
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for k, p in enumerate(params):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"{self._name}: parameter {k} is a {type(p).__name__}, not a Tensor")
            if p.dim() == 0 or p.shape[0] != self.n:
                raise ValueError(
                    f"{self._name}: parameter {k} of the group has shape {list(p.shape)}; expected "
                    f"[N, ...] with N={self.n} members on dim 0")
            if not p.is_floating_point():
                raise TypeError(f"{self._name}: parameter {k} has dtype {p.dtype}; expected a "
                                f"floating-point tensor")
        group = self._normalize(param_group, where="param group")
        group["params"] = params
        full = {**{k: v for k, v in self.defaults.items()}, **group}
        self._check_group(full)
        super().add_param_group(group)

    def member_hyperparameters(self, member: int, group: int = 0) -> dict[str, Any]:
        """Member ``member``'s hyperparameters in param group ``group``, as plain floats (and the
        shared flags), i.e. the keyword arguments of the torch.optim optimizer for that member.

        Example:
            >>> import torch, wide_compiler as wc
            >>> w = torch.nn.Parameter(torch.zeros(3, 4))
            >>> opt = wc.optim.SGD([w], lr=[0.1, 0.2, 0.3], momentum=0.9)
            >>> opt.member_hyperparameters(1)["lr"]
            0.2
        """
        self._renormalize_all()  # hyperparameters assigned by hand since the last step
        self._check_member(member)
        g = self.param_groups[group]
        out: dict[str, Any] = {}
        for name in self._hparams:
            out[name] = float(g[name][member])
        for name in self._pairs:
            out[name] = tuple(float(t[member]) for t in g[name])
        for name in self._flags:
            out[name] = g[name]
        return out

    def set_member_hyperparameters(self, member: int, group: int | None = None, **values: Any) -> None:
        """Change member ``member``'s hyperparameters in place (all param groups, or ``group``);
        the other members are untouched. Everything is validated before anything changes.

        Example:
            >>> import torch, wide_compiler as wc
            >>> w = torch.nn.Parameter(torch.zeros(3, 4))
            >>> opt = wc.optim.Adam([w], lr=1e-3)
            >>> opt.set_member_hyperparameters(2, lr=1e-2, betas=(0.8, 0.99))
            >>> opt.param_groups[0]["lr"].tolist()
            [0.001, 0.001, 0.01]
        """
        groups = range(len(self.param_groups)) if group is None else [group]
        self._set_member_values(member, {gi: values for gi in groups})

    def _member_values(self, member: int) -> dict[int, dict[str, Any]]:
        """Member ``member``'s per-member hyperparameters (and ``initial_lr`` where a group has
        one) in every param group, as floats: what :meth:`_set_member_values` takes."""
        out: dict[int, dict[str, Any]] = {}
        for gi, g in enumerate(self.param_groups):
            vals: dict[str, Any] = {name: float(g[name][member]) for name in self._hparams}
            vals.update({name: tuple(float(t[member]) for t in g[name]) for name in self._pairs})
            if "initial_lr" in g:
                vals["initial_lr"] = float(g["initial_lr"][member])
            out[gi] = vals
        return out

    def _set_member_values(self, member: int, values: Mapping[int, Mapping[str, Any]]) -> None:
        """Set member ``member``'s hyperparameters: ``values[gi]`` maps names (a per-member
        hyperparameter: a float; a pair: two floats; ``initial_lr``: a float) to its new values in
        param group ``gi``; the other members are untouched. Setting ``lr`` sets ``initial_lr``
        too where the group has one (unless given). Everything is validated (rules and
        cross-hyperparameter checks) before anything changes."""
        self._renormalize_all()  # hyperparameters assigned by hand since the last step
        self._check_member(member)

        def one(name: str, old: torch.Tensor, value: Any) -> torch.Tensor:
            t = per_member(old, self.n, what=f"{self._name}: {name}")  # a float64 copy
            t[member] = float(value)
            return self._check(name, per_member(t, self.n, what=f"{self._name}: {name}"))

        updates: list[tuple[dict, dict]] = []
        for gi, vals in values.items():
            g = self.param_groups[gi]
            new: dict[str, Any] = {}
            for name, value in vals.items():
                if name in self._hparams:
                    new[name] = one(name, g[name], value)
                elif name == "initial_lr":
                    new[name] = one(name, g.get("initial_lr", g["lr"]), value)
                elif name in self._pairs:
                    if not isinstance(value, (tuple, list)) or len(value) != 2:
                        raise ValueError(f"{self._name}: {name} must be a pair of floats, got {value!r}")
                    new[name] = tuple(one(f"{name}[{k}]", old, v) for k, (old, v) in enumerate(zip(g[name], value)))
                else:
                    known = ", ".join((*self._hparams, *self._pairs))
                    raise ValueError(f"{self._name}: {name!r} is not a per-member hyperparameter; "
                                     f"expected one of {known}")
            if "lr" in vals and "initial_lr" not in vals and "initial_lr" in g:
                new["initial_lr"] = one("initial_lr", g["initial_lr"], vals["lr"])
            self._check_group({**g, **new})
            updates.append((g, new))
        for g, new in updates:
            g.update(new)

    # -- member state ---------------------------------------------------------------------------
    def _check_member(self, i: int, what: str = "member") -> None:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.n:
            raise IndexError(f"{self._name}: {what} {i!r} out of range for N={self.n} members")

    def _member_tensors(self):
        """Every per-member tensor of the optimizer state (dim 0 = N), with its param."""
        for group in self.param_groups:
            for p in group["params"]:
                for key, v in self.state.get(p, {}).items():
                    if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == self.n:
                        yield key, v

    @torch.no_grad()
    def copy_member_state(self, src: int, dst: int, *, hyperparameters: bool = True) -> None:
        """Member ``dst`` takes member ``src``'s optimizer state (moments, buffers, step counts)
        and, with ``hyperparameters=True``, its hyperparameters: the "exploit" step of
        population-based training (copy the weights with :meth:`WideModel.copy_member_weights`).

        Example:
            >>> import torch, wide_compiler as wc
            >>> w = torch.nn.Parameter(torch.randn(3, 4))
            >>> opt = wc.optim.Adam([w], lr=[0.1, 0.2, 0.3])
            >>> w.grad = torch.randn(3, 4); opt.step()
            >>> opt.copy_member_state(0, 2)
            >>> torch.equal(opt.state[w]["exp_avg"][2], opt.state[w]["exp_avg"][0])
            True
            >>> opt.param_groups[0]["lr"].tolist()
            [0.1, 0.2, 0.1]
        """
        self._renormalize_all()  # hyperparameters assigned by hand since the last step
        self._check_member(src, "src")
        self._check_member(dst, "dst")
        if src == dst:
            return
        for _, t in self._member_tensors():
            t[dst].copy_(t[src])
        if hyperparameters:
            self._set_member_values(dst, self._member_values(src))

    def copy_member(self, src: int, dst: int, *, hyperparameters: bool = True) -> None:
        """Deprecated alias of :meth:`copy_member_state` (warns once)."""
        warn_renamed("WideOptimizer.copy_member", "WideOptimizer.copy_member_state")
        self.copy_member_state(src, dst, hyperparameters=hyperparameters)

    @torch.no_grad()
    def reset_member_state(self, member: int) -> None:
        """Zero member ``member``'s optimizer state (moments, buffers, step counts), as a fresh
        optimizer would have it (Adagrad's sums restart at ``initial_accumulator_value``)."""
        self._check_member(member)
        for key, t in self._member_tensors():
            t[member].zero_()
        self._after_reset(member)

    def _after_reset(self, member: int) -> None:
        pass

    def member_state_dict(self, member: int) -> dict[str, Any]:
        """Member ``member``'s optimizer state as the ``state_dict()`` of the matching torch.optim
        optimizer over that member's parameters alone (same param order), loadable with
        ``load_state_dict`` into it: per-member tensors are sliced (``step`` becomes 0-d) and
        hyperparameters become floats.

        Example:
            >>> import torch, wide_compiler as wc
            >>> w = torch.nn.Parameter(torch.randn(3, 4))
            >>> opt = wc.optim.Adam([w], lr=[0.1, 0.2, 0.3])
            >>> w.grad = torch.randn(3, 4); opt.step()
            >>> ref = torch.optim.Adam([torch.nn.Parameter(w[1].detach().clone())])
            >>> ref.load_state_dict(opt.member_state_dict(1))
            >>> ref.param_groups[0]["lr"]
            0.2
        """
        self._renormalize_all()  # hyperparameters assigned by hand since the last step
        self._check_member(member)
        sd = self.state_dict()
        group_of = {pid: gi for gi, g in enumerate(sd["param_groups"]) for pid in g["params"]}
        state = {}
        for pid, st in sd["state"].items():
            drop = self._member_state_absent(self.param_groups[group_of[pid]], member)
            one = {k: (v[member].clone() if isinstance(v, torch.Tensor) and v.dim() >= 1
                       and v.shape[0] == self.n else v) for k, v in st.items() if k not in drop}
            if one:
                state[pid] = one
        groups = []
        for g in sd["param_groups"]:
            out = {}
            for k, v in g.items():
                if k in self._hparams or k == "initial_lr":
                    out[k] = float(v[member])
                elif k in self._pairs:
                    out[k] = tuple(float(t[member]) for t in v)
                else:
                    out[k] = v
            groups.append(out)
        return {"state": state, "param_groups": groups}

    def _member_state_absent(self, group: Mapping[str, Any], member: int) -> set[str]:
        """State keys that torch.optim would not hold for this member alone (e.g. the momentum
        buffer of a member whose momentum is 0)."""
        return set()

    # -- state dict -----------------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer.load_state_dict``; every hyperparameter and per-member state
        tensor is checked against N before anything changes."""
        groups = state_dict.get("param_groups", [])
        checked = []
        for gi, g in enumerate(groups):
            # torch's Optimizer.__setstate__ (run by every load) adds 'differentiable' to
            # defaults, which the param groups never carry: not a sign of another optimizer.
            missing = sorted(set(self.defaults) - set(g) - {"params", "differentiable"})
            if missing:
                raise ValueError(f"{self._name}: saved param group {gi} has no {', '.join(map(repr, missing))}: "
                                 f"it was saved by another optimizer (load it into the same class)")
            checked.append(self._normalize({k: v for k, v in g.items() if k != "params"},
                                           where=f"saved param group {gi}"))
            if "initial_lr" in g:
                checked[-1]["initial_lr"] = per_member(g["initial_lr"], self.n,
                                                       what=f"{self._name}: saved initial_lr")
        params = {pid: p for g, cur in zip(groups, self.param_groups) for pid, p in zip(g["params"], cur["params"])}
        for pid, st in state_dict.get("state", {}).items():
            p = params.get(pid)
            for k, v in st.items():
                if not isinstance(v, torch.Tensor) or v.dim() == 0:
                    continue
                if v.shape[0] != self.n:
                    raise ValueError(f"{self._name}: saved state {k!r} of parameter {pid} has shape "
                                     f"{list(v.shape)}; expected dim 0 = N = {self.n}")
                if p is not None and v.shape not in (p.shape, (self.n,)):
                    raise ValueError(f"{self._name}: saved state {k!r} of parameter {pid} has shape "
                                     f"{list(v.shape)}; expected {list(p.shape)} (the parameter's) or [{self.n}]")
        super().load_state_dict(state_dict)
        for g, c in zip(self.param_groups, checked):
            for k, v in c.items():
                g[k] = v


def _flat_params(params: list) -> Iterable[torch.Tensor]:
    for p in params:
        if isinstance(p, dict):
            ps = p.get("params", [])
            yield from ([ps] if isinstance(ps, torch.Tensor) else ps)
        else:
            yield p


def nonneg(t: torch.Tensor) -> torch.Tensor:
    return t >= 0


def in_unit(t: torch.Tensor) -> torch.Tensor:
    return (t >= 0) & (t < 1)
