"""The :class:`WideRouter` itself: registration, lookup, the groups' state and what it says about
them. The mechanics are in the package's other modules, one concern each: grouping (grouping.py,
padding.py, sharing.py, optimizer_guard.py), running (running.py, inputs.py, view.py),
``torch.compile`` (compiling.py)."""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ..config import WideConfig
from .compiling import _compile_groups, _compile_options, _device_arg
from .grouping import _group, _ungroup
from .inputs import _tower_inputs
from .running import _wide_forward
from .towers import Tower, _labels, _TowerLabel
from .view import _FusedTowerView

__all__ = ["WideRouter"]

log = logging.getLogger("wide_compiler.router")  # the package's one logger, as before the split


def _check_name(name: Any) -> str:
    if not isinstance(name, str) or not name or "." in name:
        raise ValueError(f"WideRouter: a tower/module name must be a non-empty string without '.', got {name!r}")
    return name


class WideRouter(nn.Module):
    """Named towers of several architectures, grouped by program, each group of two or more run
    as one :class:`~wide_compiler.WideModel`. See :mod:`wide_compiler.router` for the ownership rule.

    Args:
        name: an optional label (``WideRouter('my_collective', auto_discover=True)``, as in the
            router guide); shown in ``repr``.
        auto_discover: when true, :meth:`attach` registers every :class:`Tower` it attaches as
            it comes (turn it off and on through the ``auto_discover`` attribute). Modules that
            are not towers (heads) are never registered. :meth:`discover_towers` registers the
            towers attached otherwise (e.g. set as attributes) either way.
        config: the :class:`~wide_compiler.WideConfig` every group is compiled with (default
            ``WideConfig.default()``; ``WideConfig.fast()`` compiles fastest).
        compile_options: further keyword arguments of :func:`wide_compiler.compile`
            (``validate``, ``strict``, ``dynamic_shapes``...).
        pad: towers of one program up to sizes (a width sweep) may run as ONE padded wide model
            (``compile(pad=True)``) instead of one wide model per size: grouping compiles both,
            times them on the sample inputs, keeps the faster and says which in :meth:`report`
            (and ``pad_decisions``). ``pad="always"`` keeps the padded model wherever padding is
            exact, without measuring: a grouping that does not depend on timings (a checkpoint of
            a padded grouping loads into a router built so).

    Subclass it (attach towers and heads in ``__init__``, call :meth:`wide_forward` in
    ``forward``, reach any attached component as ``self[name]``) or use it as a container.

    Example:
        >>> import torch, wide_compiler as wc
        >>> router = wc.WideRouter("pair", auto_discover=True, config=wc.WideConfig.fast())
        >>> _ = router.attach("a", torch.nn.Linear(3, 2))            # not a Tower: a head
        >>> _ = router.attach("b", wc.Tower("b"))                     # a Tower: registered now
        >>> router.tower_names, router["a"] is router.a
        (['b'], True)
    """

    def __init__(self, name: str | None = None, *, auto_discover: bool = False, config: WideConfig | None = None,
                 compile_options: Mapping[str, Any] | None = None, pad: bool | str = False) -> None:
        super().__init__()
        if name is not None and not isinstance(name, str):
            raise TypeError(f"WideRouter: name must be a string or None, got {type(name).__name__} {name!r} "
                            "(config and compile_options are keyword arguments)")
        if config is not None and not isinstance(config, WideConfig):
            raise TypeError(f"WideRouter: config must be a wide_compiler.WideConfig, got {type(config).__name__}")
        self.name = name
        self.auto_discover = bool(auto_discover)
        self._config = config or WideConfig.default()
        self._compile_options = dict(compile_options or {})
        self._tower_names: list[str] = []
        self.groups = nn.ModuleDict()             # key (first member's name) -> WideModel
        self._members: dict[str, list[str]] = {}  # group key -> its towers, in member order
        self._originals: dict[str, nn.Module] = {}  # grouped towers, kept aside (not submodules)
        self._templates: dict[str, nn.Module] = {}  # group key -> structure for subset calls
        self._fallbacks: dict[tuple[str, ...], str] = {}  # towers of a failed group -> why
        self._structures: dict[str, Any] = {}  # group key -> the input structure it was compiled for
        self._warned_structures: set = set()
        self._compile_opts: dict[str, Any] | None = None  # torch.compile options of compile()
        self._compiled: dict[str, Any] = {}  # group key -> its torch.compile'd wide model (compile())
        self._views: dict[str, _FusedTowerView] = {}  # router[name] of fused towers
        if pad not in (False, True, "always"):
            raise ValueError(f"WideRouter: pad must be False, True (measured) or 'always', got {pad!r}")
        self._pad_sizes = pad
        self.pad_decisions: dict[tuple[str, ...], str] = {}  # towers of one program up to sizes -> verdict
        self._grouped = False

    # -- registration -------------------------------------------------------------------------
    def attach(self, name: str, module: nn.Module) -> nn.Module:
        """Add ``module`` as submodule ``name`` and return it. A :class:`Tower` is registered as a
        tower at once when ``auto_discover`` is on, else when :meth:`discover_towers` runs; any
        other module is a head (reached as ``self[name]`` or ``self.name``)."""
        _check_name(name)
        if not isinstance(module, nn.Module):
            raise TypeError(f"WideRouter.attach: {name!r} is a {type(module).__name__}, expected an nn.Module")
        if (name in self._originals or name == "groups" or hasattr(type(self), name)
                or (name in self.__dict__ and name not in self._modules)):
            raise ValueError(f"WideRouter.attach: the name {name!r} is taken")
        self.add_module(name, module)
        if self.auto_discover and isinstance(module, Tower):
            self.register_tower(name)
        return module

    def register_tower(self, name: str, module: nn.Module | None = None) -> None:
        """Make the attached module ``name`` a tower (attaching ``module`` first when given)."""
        if module is not None:
            self.attach(name, module)
        _check_name(name)
        if name in self._tower_names:
            return
        if name not in self._modules:
            raise KeyError(f"WideRouter.register_tower: no attached module {name!r}; attach it first "
                           "or pass it: register_tower(name, module)")
        _ungroup(self)
        self._tower_names.append(name)

    def unregister_tower(self, name: str) -> None:
        """Stop treating ``name`` as a tower (it stays attached as an ordinary submodule)."""
        if name not in self._tower_names:
            raise KeyError(f"WideRouter.unregister_tower: {name!r} is not a tower; towers: {self._tower_names}")
        _ungroup(self)
        self._tower_names.remove(name)

    def discover_towers(self) -> list[str]:
        """Register every attached submodule that is a :class:`Tower`; returns all tower names."""
        for name, mod in list(self._modules.items()):
            if isinstance(mod, Tower) and name not in self._tower_names and name != "groups":
                self.register_tower(name)
        return self.tower_names

    @property
    def tower_names(self) -> list[str]:
        """The towers, in registration order."""
        return list(self._tower_names)

    def _tower(self, name: str) -> nn.Module:
        """A tower's module: the live submodule, or its (possibly stale) original when grouped."""
        return self._originals[name] if name in self._originals else self._modules[name]

    def __getitem__(self, name: str) -> nn.Module:
        """Any attached component by name (the guide's ``self['fusion'](opinions)``): a head or an
        ungrouped tower is the module itself; a tower fused into a wide group is a live view that
        runs it alone on its rows of the wide parameters (see :mod:`wide_compiler.router`)."""
        if not isinstance(name, str):
            raise TypeError(f"WideRouter[...]: components are looked up by name (a string), got "
                            f"{type(name).__name__} {name!r}")
        if name in self._originals:
            view = self._views.get(name)
            if view is None:
                view = self._views[name] = _FusedTowerView(self, name)
            return view
        if name in self._modules and name != "groups":
            return self._modules[name]
        attached = [n for n in [*self._modules, *self._originals] if n != "groups"]
        raise KeyError(f"WideRouter{'' if self.name is None else ' ' + repr(self.name)}: no attached component "
                       f"{name!r}; attached: {attached}")

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name != "groups" and (name in self._modules or name in self._originals)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            originals = self.__dict__.get("_originals", {})
            if name in originals:
                key = next(k for k, v in self.__dict__["_members"].items() if name in v)
                raise AttributeError(
                    f"WideRouter: tower {name!r} is fused into the WideModel router.groups[{key!r}]; its "
                    f"parameters are the wide ones. Call it through router[{name!r}] (a live view), use "
                    "router.write_back() to update the original module, or router.unfuse()[name] for a "
                    "fresh one") from None
            raise

    # -- grouping (grouping.py) ----------------------------------------------------------------
    def prepare_for_compile(self, *args: Any, tower_names: Iterable[str] | None = None, **kwargs: Any) -> None:
        """Group the towers and compile every group.

        With sample inputs (as for :meth:`wide_forward`; ``tower_names`` is ignored: every tower
        is grouped), now: create the optimizer after this call. With none
        (``prepare_for_compile()``, as in the router guide), grouping happens at the first call,
        which needs real inputs; ``parameters()`` changes then, so make the optimizer after the
        first call (an optimizer made before raises at its ``step()`` naming this), or pass a
        sample here. ``prepare_for_compile(device)`` (a ``torch.device`` or a device string)
        moves the router there first and groups at the first call too.

        Either way the grouping itself never runs inside a ``torch.compile`` trace, so
        ``torch.compile(model)`` of a module holding the router works before and after it.

        Example:
            >>> import torch, wide_compiler as wc
            >>> router = wc.WideRouter(config=wc.WideConfig.fast())
            >>> for i in range(2):
            ...     router.register_tower(f"t{i}", torch.nn.Linear(3, 2))
            >>> router.prepare_for_compile()           # groups at the first call
            >>> router.group_members()                 # not grouped yet: one entry per tower
            {'t0': ['t0'], 't1': ['t1']}
            >>> router.eval().wide_forward(torch.randn(4, 3))["t1"].shape
            torch.Size([4, 2])
            >>> router.group_members()
            {'t0': ['t0', 't1']}
        """
        if not self._tower_names:
            raise ValueError("WideRouter: no towers; attach them and call discover_towers() or register_tower()")
        if len(args) == 1 and not kwargs and _device_arg(args[0]) is not None:
            self.to(_device_arg(args[0]))
            args = ()
        if not args and not kwargs:
            log.info("WideRouter%s: %s", "" if self.name is None else f" {self.name!r}",
                     "already grouped" if self._grouped else "no sample: the towers are grouped at the first call")
            return
        _ungroup(self)
        _, inputs = _tower_inputs(self._tower_names, args, kwargs, None, all_towers=True)
        _group(self, inputs)

    def compile(self, *args: Any, options: Mapping[str, Any] | None = None, **kwargs: Any) -> WideRouter:
        """:meth:`prepare_for_compile` with these sample inputs (or none: grouping at the first
        call), then every group's wide model is wrapped in ``torch.compile(fullgraph=True,
        **options)`` (no graph breaks; a break is an error), used by :meth:`wide_forward` for
        whole-group calls. Returns the router, so ``compiled = router.compile(mode=...)`` of the
        guide works.

        Keywords named as ``torch.compile``'s (``mode``, ``backend``, ``fullgraph``, ``dynamic``,
        ``disable``) are its options, as is the ``options`` dict; every other keyword is a sample
        input. When a tower's forward takes a parameter of such a name, that keyword is a sample
        input if ``options`` is given, else the call is ambiguous and refused.

        This replaces ``nn.Module.compile`` (which would compile :meth:`forward`, not the groups).

        Example:
            >>> import torch, wide_compiler as wc
            >>> router = wc.WideRouter(config=wc.WideConfig.fast())
            >>> for i in range(2):
            ...     router.register_tower(f"t{i}", torch.nn.Linear(3, 2))
            >>> router.compile(torch.randn(4, 3), backend="eager") is router
            True
        """
        self._compile_opts = _compile_options(self, options, kwargs)  # pops them from kwargs
        self._compiled = {}
        self.prepare_for_compile(*args, **kwargs)  # groups (and compiles the groups) when given a sample
        if self._grouped and not self._compiled:
            _compile_groups(self)
        return self

    # -- running (running.py) ------------------------------------------------------------------
    def wide_forward(self, *args: Any, tower_names: Iterable[str] | None = None, **kwargs: Any) -> dict[str, Any]:
        """Run the towers; returns ``{name: output}`` with each tower's own output.

        Inputs: ``wide_forward(x, mask=m)`` gives every tower ``(x,)`` and ``mask=m``;
        ``wide_forward({"a": (xa,), "b": xb}, mask=m)`` gives each tower its own positional inputs
        (further positional arguments and keywords are shared). ``tower_names`` selects a subset
        (default: every tower, or every tower with an entry in the per-tower dict).

        The first call groups the towers (see :meth:`prepare_for_compile`): create the optimizer
        after it (one made before raises at its ``step()``). A group whose towers
        are all selected runs as one wide call (shared inputs as stride-0 ``expand`` views,
        per-tower inputs stacked); a selected part of a group runs member by member on the wide
        parameters (unselected members are not run; with gradients on, their slices get zero
        gradients, which an optimizer with momentum, weight decay or Adam's state still applies:
        warned once per group)."""
        return _wide_forward(self, args, kwargs, tower_names)

    # -- back to the towers -------------------------------------------------------------------
    @torch.no_grad()
    def write_back(self) -> None:
        """Copy every group's wide parameters and buffers into its original tower modules, in
        place (they keep their identity), with each tower's per-member constants (a swept float
        attribute, as ``unfuse()`` has them). Ungrouped towers are live submodules already. Every
        group is checked before any tower is written."""
        writes = [self.groups[key]._write_back_checked([self._originals[n] for n in names])
                  for key, names in self._members.items()]
        for write in writes:
            write()

    def unfuse(self) -> dict[str, nn.Module]:
        """``{name: fresh module}`` for every tower, with the current (trained) weights and
        buffers, in this router's device, dtype and train/eval mode."""
        out: dict[str, nn.Module] = {}
        for key, names in self._members.items():
            for n, fresh in zip(names, self.groups[key].unfuse()):
                # built from one template: each tower gets its own labels (the only attributes
                # the members may differ in) back
                for m, label in zip([m for m in fresh.modules() if isinstance(m, Tower)], _labels(self._originals[n])):
                    m.__dict__["_tower_label"] = _TowerLabel(label)
                out[n] = fresh
        for n in self._tower_names:
            if n not in out:
                out[n] = copy.deepcopy(self._modules[n])
        return {n: out[n] for n in self._tower_names}

    # -- state and inspection -----------------------------------------------------------------
    def get_extra_state(self) -> dict[str, Any]:
        return {"version": 1, "groups": {k: list(v) for k, v in self._members.items()}}

    def set_extra_state(self, state: Any) -> None:
        want = {k: list(v) for k, v in (state or {}).get("groups", {}).items()}
        have = {k: list(v) for k, v in self._members.items()}
        if want != have:
            hint = (" This router is not grouped yet: call prepare_for_compile(sample) first."
                    if not self._grouped else "")
            if self._pad_sizes is True and self._grouped:  # Note: the measured choice may differ between builds
                hint += (" With pad=True grouping measures whether one padded model is faster than a model per "
                         "size, so two builds may group differently: build the router with pad='always' to group "
                         "as a padded checkpoint was saved, or pad=False for one saved by size.")
            raise ValueError(f"WideRouter.load_state_dict: the state was saved from groups {want}, this router "
                             f"has groups {have}; build and group it the same way (same towers, same order, "
                             f"same sample).{hint}")

    def group_members(self) -> dict[str, list[str]]:
        """``{group key: [tower names]}`` for every group: wide groups, singletons and the towers
        of failed groups (each its own key)."""
        out = {k: list(v) for k, v in self._members.items()}
        for n in self._tower_names:
            if not any(n in v for v in out.values()):
                out[n] = [n]
        return {k: out[k] for k in sorted(out, key=lambda k: self._tower_names.index(k))}

    @property
    def fallbacks(self) -> dict[tuple[str, ...], str]:
        """Groups that could not be fused (towers -> reason); their towers run one by one."""
        return dict(self._fallbacks)

    def report(self) -> str:
        """The groups, their members, and every group that fell back to running one by one."""
        if not self._grouped:
            return f"WideRouter: {len(self._tower_names)} towers, not grouped yet: {self._tower_names}"
        failed = {n for names in self._fallbacks for n in names}
        head = (f"WideRouter: {len(self._tower_names)} towers in {len(self.group_members())} groups "
                f"({len(self._members)} wide)")
        lines = [head]
        for key, names in self.group_members().items():
            if key in self._members:
                wide = self.groups[key]
                n_fb = len(wide._graphs[wide.training].fallbacks) if wide.training in wide._graphs else 0
                lines.append(f"  wide {key!r}: {len(names)} x {type(self._originals[key]).__name__}: {names}"
                             f" ({n_fb} op fallbacks)")
            else:
                how = "fallback, one by one" if key in failed else "singleton"
                lines.append(f"  {how} {key!r}: {type(self._modules[key]).__name__}")
        for names, why in self._fallbacks.items():
            lines.append(f"  compile failed for {list(names)}: {why.splitlines()[0]}")
        for names, verdict in self.pad_decisions.items():
            lines.append(f"  sizes of {list(names)}: {verdict}")
        return "\n".join(lines)

    def extra_repr(self) -> str:
        head = "" if self.name is None else f"name={self.name!r}, "
        return f"{head}towers={self._tower_names}"
