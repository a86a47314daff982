"""Per-member operations of a WideModel (mixed into :class:`~wide_compiler.WideModel`): write the
trained members back into the original modules, extract one member's state, copy one member
onto another (population-based training)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ._deprecation import warn_renamed

__all__ = ["MemberOpsMixin"]


class MemberOpsMixin:
    """Methods acting on single members of a wide model.

    The host class has ``n`` (members), ``_template`` (a structural copy of member 0) and its
    stacked ``[N, ...]`` parameters and buffers registered under the template's names.
    """

    n: int
    _template: nn.Module

    # -- helpers ------------------------------------------------------------------------------
    def _member_names(self) -> tuple[list[str], list[str]]:
        params = [name for name, _ in self._template.named_parameters()]
        buffers = [name for name, _ in self._template.named_buffers()]
        return params, buffers

    def _stacked(self, name: str) -> torch.Tensor:
        path, _, attr = name.rpartition(".")
        mod = self.get_submodule(path) if path else self  # type: ignore[attr-defined]
        t = mod._parameters.get(attr)
        return t if t is not None else mod._buffers[attr]

    def _check_member_index(self, i: Any, what: str = "member") -> int:
        if isinstance(i, bool) or not isinstance(i, int) or not -self.n <= i < self.n:
            raise IndexError(f"wide_compiler: {what} index {i!r} out of range for a wide model "
                             f"of N={self.n} members")
        return i % self.n

    # -- back to the original modules --------------------------------------------------------
    @torch.no_grad()
    def write_back(self, models: Sequence[nn.Module]) -> None:
        """Copy every member's weights and buffers into ``models[i]`` IN PLACE (the original
        modules keep their identity, so optimizers and references to them stay valid), and its
        per-member constants (Note [Per-member constants] in fx/constants.py: a swept dropout
        ``p`` or ``self.s``, as ``member(i)`` has them, after ``copy_member_weights`` too).
        Everything is checked before anything is written.

        Example:
            >>> import torch, wide_compiler as wc
            >>> models = [torch.nn.Linear(3, 2) for _ in range(4)]
            >>> wide = wc.compile(models, torch.randn(1, 3), config=wc.WideConfig.fast())
            >>> with torch.no_grad():
            ...     _ = wide.weight.mul_(2)
            >>> w0 = models[0].weight
            >>> wide.write_back(models)
            >>> models[0].weight is w0 and torch.equal(models[0].weight, wide.weight[0])
            True
            >>> sweep = [torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Dropout(p)) for p in (0.1, 0.2)]
            >>> wide = wc.compile(sweep, torch.randn(1, 3), config=wc.WideConfig.fast())
            >>> wide.copy_member_weights(src=1, dst=0)          # member 0 takes p = 0.2 too
            >>> wide.write_back(sweep)
            >>> [m[1].p for m in sweep]
            [0.2, 0.2]
        """
        self._write_back_checked(models)()

    def _write_back_checked(self, models: Sequence[nn.Module]) -> Callable[[], None]:
        """:meth:`write_back` checked: raises (nothing written) unless every module can take its
        member, else returns the write (the router checks every group before writing any)."""
        models = list(models)
        if len(models) != self.n:
            raise ValueError(f"wide_compiler.write_back: expected {self.n} modules (one per member), "
                             f"got {len(models)}")
        params, buffers = self._member_names()
        for i, m in enumerate(models):
            for kind, names, get in (("parameter", params, "get_parameter"), ("buffer", buffers, "get_buffer")):
                for name in names:
                    try:
                        t = getattr(m, get)(name)
                    except AttributeError as e:
                        raise ValueError(f"wide_compiler.write_back: member {i} ({type(m).__name__}) "
                                         f"has no {kind} {name!r}") from e
                    src = self._stacked(name)
                    if t is None or t.shape != src.shape[1:]:
                        raise ValueError(f"wide_compiler.write_back: member {i} {kind} {name!r} has "
                                         f"shape {None if t is None else list(t.shape)}; expected "
                                         f"{list(src.shape[1:])}")
        constants = self._constants_to_write(models, "wide_compiler.write_back")  # type: ignore[attr-defined]

        @torch.no_grad()
        def write() -> None:
            for i, m in enumerate(models):
                for name in params:
                    m.get_parameter(name).copy_(self._stacked(name)[i])
                for name in buffers:
                    m.get_buffer(name).copy_(self._stacked(name)[i])
                for path, value in constants[i].items():
                    mod_path, _, key = path.rpartition(".")
                    setattr(m.get_submodule(mod_path) if mod_path else m, key, value)

        return write

    def member_state_dict(self, i: int) -> dict[str, torch.Tensor]:
        """Member ``i``'s ``state_dict()``: the keys and shapes of the original module's, with
        copies of that member's values; loadable with ``original.load_state_dict``. Like any
        module's, it holds tensors only: the member's per-member constants (Python attributes, Note
        [Per-member constants] in fx/constants.py) are on :meth:`member` and in the checkpoints of
        ``wide_compiler.distributed.save_members``.

        Example:
            >>> import torch, wide_compiler as wc
            >>> models = [torch.nn.Linear(3, 2) for _ in range(4)]
            >>> wide = wc.compile(models, torch.randn(1, 3), config=wc.WideConfig.fast())
            >>> sd = wide.member_state_dict(2)
            >>> sorted(sd), torch.equal(sd["weight"], models[2].weight)
            (['bias', 'weight'], True)
        """
        i = self._check_member_index(i)
        keys = self._template.state_dict().keys()
        return {k: self._stacked(k)[i].detach().clone() for k in keys}

    @torch.no_grad()
    def load_member_state_dict(self, i: int, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load one member's weights and buffers from an ordinary module's ``state_dict`` (e.g.
        a freshly initialised model: the "restart" move of population-based training). Strict:
        the keys and shapes must be the original module's, every value a tensor whose dtype
        casts safely to the member's (``torch.can_cast``: no float into an integer buffer, no
        complex into a real one); checked before anything changes.

        Raises ``KeyError`` (missing or unexpected keys), ``TypeError`` (a value that is not a
        tensor, or a dtype that does not cast safely) or ``ValueError`` (a shape), naming the
        key and the member."""
        i = self._check_member_index(i)
        self._load_member_state_dict(i, state_dict, f"member {i}")

    @torch.no_grad()
    def _load_member_state_dict(self, i: int, state_dict: Any, label: str) -> None:
        """:meth:`load_member_state_dict` of local member ``i``; errors name it ``label``."""
        name = "wide_compiler.load_member_state_dict"
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"{name}: {label}: expected a state_dict (a mapping of names to "
                            f"tensors), got a {type(state_dict).__name__}")
        keys = list(self._template.state_dict().keys())
        missing = [k for k in keys if k not in state_dict]
        extra = [k for k in state_dict if k not in keys]
        if missing or extra:
            raise KeyError(f"{name}: {label}: missing keys {missing}, unexpected keys {extra}")
        for k in keys:
            v, target = state_dict[k], self._stacked(k)
            expected = list(target.shape[1:])
            if not isinstance(v, torch.Tensor):
                text = repr(v)
                text = text if len(text) <= 60 else text[:57] + "..."
                raise TypeError(f"{name}: {label}: {k!r} is a {type(v).__name__} ({text}); expected "
                                f"a tensor of shape {expected} ({target.dtype})")
            if tuple(v.shape) != tuple(expected):
                raise ValueError(f"{name}: {label}: {k!r} has shape {list(v.shape)}; expected {expected}")
            if not torch.can_cast(v.dtype, target.dtype):
                raise TypeError(f"{name}: {label}: {k!r} is {v.dtype}, which does not cast safely to "
                                f"the member's {target.dtype}; convert it explicitly if that is meant")
        for k in keys:
            self._stacked(k)[i].copy_(state_dict[k])

    # -- population-based training -------------------------------------------------------------
    @torch.no_grad()
    def copy_member_weights(self, src: int, dst: int, optimizer: Any = None) -> None:
        """Member ``dst`` becomes a copy of member ``src``: weights and buffers (BatchNorm
        statistics included), its per-member constants (a swept dropout ``p`` or temperature,
        Note [Per-member constants] in fx/constants.py: ``member(dst)`` is then ``member(src)``),
        and, when ``optimizer`` is given, its optimizer state and hyperparameters too
        (``optimizer.copy_member_state(src, dst)``, a :class:`wide_compiler.optim.WideOptimizer`).
        The "exploit" step of population-based training.

        Example:
            >>> import torch, wide_compiler as wc
            >>> models = [torch.nn.Linear(3, 2) for _ in range(4)]
            >>> wide = wc.compile(models, torch.randn(1, 3), config=wc.WideConfig.fast())
            >>> opt = wc.optim.SGD(wide.parameters(), lr=[0.1, 0.2, 0.3, 0.4], momentum=0.9)
            >>> wide.copy_member_weights(3, 0, opt)
            >>> torch.equal(wide.weight[0], wide.weight[3]), opt.param_groups[0]["lr"][0].item()
            (True, 0.4)
        """
        src = self._check_member_index(src, "src")
        dst = self._check_member_index(dst, "dst")
        if optimizer is not None:
            if not hasattr(optimizer, "copy_member_state"):
                raise TypeError(f"wide_compiler.copy_member_weights: {type(optimizer).__name__} has no "
                                f"copy_member_state(); use a wide_compiler.optim optimizer")
            if getattr(optimizer, "n", self.n) != self.n:
                raise ValueError(f"wide_compiler.copy_member_weights: the optimizer has N={optimizer.n} "
                                 f"members, the model {self.n}")
        if src == dst:
            return
        from .fx.constants import copy_member_constants

        params, buffers = self._member_names()
        for name in (*params, *buffers):
            t = self._stacked(name)
            t[dst].copy_(t[src])
        copy_member_constants(self, src, dst)  # type: ignore[arg-type]
        if optimizer is not None:
            optimizer.copy_member_state(src, dst)

    def copy_member(self, src: int, dst: int, optimizer: Any = None) -> None:
        """Deprecated alias of :meth:`copy_member_weights` (warns once)."""
        warn_renamed("WideModel.copy_member", "WideModel.copy_member_weights")
        self.copy_member_weights(src, dst, optimizer)

    def member(self, i: int) -> nn.Module:
        """Member ``i`` as an ordinary module (the original class, a copy of its weights and
        buffers in this model's dtype and device, this model's train/eval mode): ``unfuse()[i]``
        without building the others."""
        import copy as _copy

        i = self._check_member_index(i)
        m = _copy.deepcopy(self._template)
        with torch.no_grad():  # .data: the values, dtype and device now (after a .to()); ties kept
            for named in (m.named_parameters, m.named_buffers):
                for name, t in named():  # a tied tensor once
                    t.data = self._stacked(name)[i].detach().clone()
        self._set_member_constants(m, i)  # type: ignore[attr-defined]
        return m.train(self.training)  # type: ignore[attr-defined]
