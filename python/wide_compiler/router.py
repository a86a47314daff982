"""WideRouter: a heterogeneous collective of named towers, grouped by program, each group run as
ONE :class:`~wide_compiler.WideModel` (DESIGN §7, "Router").

A router holds named towers of several architectures. :meth:`WideRouter.wide_forward` gives every
tower the same inputs (or each its own), runs every group of two or more towers that are the same
program as one wide model, and returns ``{tower name: output}``.

Ownership rule (one source of truth)
------------------------------------
Before grouping, a tower is an ordinary submodule of the router. Grouping (on the first
:meth:`~WideRouter.wide_forward`, or ahead of time with :meth:`~WideRouter.prepare_for_compile`)
stacks the parameters and buffers of each group of 2+ towers into a ``WideModel`` registered under
``router.groups[<first tower's name>]``, and the grouped tower modules stop being submodules: they
are kept aside, untouched, as the *originals*. From then on:

* the wide tensors ARE the towers' parameters: ``router.parameters()`` yields each exactly once,
  optimizers, ``.to()``, ``.train()``/``.eval()`` and ``state_dict`` act on them. Create the
  optimizer AFTER grouping (a router grouped lazily in training mode warns once);
* towers that form no group (singletons, and the towers of a group whose compile failed) stay
  ordinary submodules and run as themselves;
* the originals go stale while training: :meth:`~WideRouter.write_back` copies the wide values
  into them in place, :meth:`~WideRouter.unfuse` returns fresh modules instead.

Registering or unregistering a tower after grouping writes the groups back into the originals and
ungroups; the next call groups again (and ``parameters()`` changes again).

Example:
    >>> import torch, wide_compiler as wc
    >>> from wide_compiler.router import Tower, WideRouter
    >>> class MLP(Tower):
    ...     def __init__(self, width):
    ...         super().__init__()
    ...         self.net = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Tanh(), torch.nn.Linear(width, 2))
    ...     def forward(self, x):
    ...         return self.net(x)
    >>> router = WideRouter(config=wc.WideConfig.fast())
    >>> for i in range(3):
    ...     _ = router.attach(f"small{i}", MLP(8))
    >>> _ = router.attach("big", MLP(16))
    >>> router.discover_towers()
    ['small0', 'small1', 'small2', 'big']
    >>> x = torch.randn(5, 4)
    >>> router.prepare_for_compile(x)
    >>> outs = router.wide_forward(x)
    >>> sorted(outs), outs["big"].shape
    (['big', 'small0', 'small1', 'small2'], torch.Size([5, 2]))
    >>> router.group_members()
    {'small0': ['small0', 'small1', 'small2'], 'big': ['big']}
"""

from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .api import compile as _wide_compile
from .config import WideConfig
from .errors import ArchitectureMismatchError
from .fx.capture import check_members, check_run_members
from .model import WideModel

__all__ = ["Tower", "WideRouter"]

log = logging.getLogger(__name__)


class Tower(nn.Module):
    """Marker base class: an attached module of this type is found by
    :meth:`WideRouter.discover_towers`. It adds nothing else; any module can be made a tower with
    :meth:`WideRouter.register_tower`."""


def _check_name(name: Any) -> str:
    if not isinstance(name, str) or not name or "." in name:
        raise ValueError(f"WideRouter: a tower/module name must be a non-empty string without '.', got {name!r}")
    return name


def _signature(args: tuple, kwargs: dict) -> Any:
    """The input structure of a call, tensors by shape/dtype/device, other values by value:
    towers given different signatures cannot share one wide program."""
    flat, spec = tree_flatten((args, kwargs))
    return spec, [("tensor", tuple(a.shape), a.dtype, a.device) if isinstance(a, torch.Tensor) else ("value", a)
                  for a in flat]


def _structure(args: tuple, kwargs: dict) -> Any:
    """What a compiled program fixes about its inputs: the nesting and the non-tensor values."""
    flat, spec = tree_flatten((args, kwargs))
    return spec, [None if isinstance(a, torch.Tensor) else ("value", a) for a in flat]


def _expand(tree: Any, n: int) -> Any:
    """One input shared by n members: every tensor as a stride-0 view ``x.expand(n, *x.shape)``."""
    return tree_map(lambda a: a.expand(n, *a.shape) if isinstance(a, torch.Tensor) else a, tree)


def _stack(trees: list, names: list[str]) -> Any:
    """Per-member inputs of one structure -> one N-first input (non-tensor values must agree)."""
    flats = [tree_flatten(t) for t in trees]
    spec = flats[0][1]
    for (_, s), name in zip(flats, names):
        if s != spec:
            raise ValueError(f"WideRouter: tower {name!r} got inputs structured as {s}, tower "
                             f"{names[0]!r} of its group got {spec}")
    leaves = []
    for k, first in enumerate(flats[0][0]):
        column = [f[0][k] for f in flats]
        if isinstance(first, torch.Tensor):
            leaves.append(torch.stack(column))
        else:
            if any(c != first for c in column):
                raise ValueError(f"WideRouter: the towers of group {names} got different non-tensor inputs "
                                 f"{column}; they are baked into the group's program")
            leaves.append(first)
    return tree_unflatten(leaves, spec)


class WideRouter(nn.Module):
    """Named towers of several architectures, grouped by program, each group of two or more run
    as one :class:`~wide_compiler.WideModel`. See the module docstring for the ownership rule.

    Args:
        config: the :class:`~wide_compiler.WideConfig` every group is compiled with (default
            ``WideConfig.default()``; ``WideConfig.fast()`` compiles fastest).
        compile_options: further keyword arguments of :func:`wide_compiler.compile`
            (``validate``, ``strict``, ``dynamic_shapes``...).

    Subclass it (attach towers and heads in ``__init__``, call :meth:`wide_forward` in
    ``forward``) or use it as a container.
    """

    def __init__(self, *, config: WideConfig | None = None, compile_options: Mapping[str, Any] | None = None) -> None:
        super().__init__()
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
        self._compiled: dict[str, Any] = {}  # group key -> its torch.compile'd wide model (compile())
        self._grouped = False

    # -- registration -------------------------------------------------------------------------
    def attach(self, name: str, module: nn.Module) -> nn.Module:
        """Add ``module`` as submodule ``name`` (a tower, if it is a :class:`Tower`, once
        :meth:`discover_towers` runs; a head or anything else otherwise). Returns ``module``."""
        _check_name(name)
        if not isinstance(module, nn.Module):
            raise TypeError(f"WideRouter.attach: {name!r} is a {type(module).__name__}, expected an nn.Module")
        if (name in self._originals or name == "groups" or hasattr(type(self), name)
                or (name in self.__dict__ and name not in self._modules)):
            raise ValueError(f"WideRouter.attach: the name {name!r} is taken")
        self.add_module(name, module)
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
        self._ungroup()
        self._tower_names.append(name)

    def unregister_tower(self, name: str) -> None:
        """Stop treating ``name`` as a tower (it stays attached as an ordinary submodule)."""
        if name not in self._tower_names:
            raise KeyError(f"WideRouter.unregister_tower: {name!r} is not a tower; towers: {self._tower_names}")
        self._ungroup()
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

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            originals = self.__dict__.get("_originals", {})
            if name in originals:
                key = next(k for k, v in self.__dict__["_members"].items() if name in v)
                raise AttributeError(
                    f"WideRouter: tower {name!r} is fused into the WideModel router.groups[{key!r}]; its "
                    "parameters are the wide ones. Use router.write_back() to update the original "
                    "module, or router.unfuse()[name] for a fresh one") from None
            raise

    # -- grouping -----------------------------------------------------------------------------
    def _same_program(self, a: str, b: str, inputs: dict[str, tuple]) -> str | None:
        """None when towers a and b may share one program, else why not."""
        if _signature(*inputs[a]) != _signature(*inputs[b]):
            return "different input shapes"
        ta, tb = self._tower(a), self._tower(b)
        try:
            check_members([ta, tb])
            if self._config.run_members:
                check_run_members([ta, tb], *inputs[a])
        except ArchitectureMismatchError as e:
            return str(e)
        except Exception as e:  # noqa: BLE001 -- a tower that cannot even run is a group of its own
            return f"{type(e).__name__}: {e}"
        return None

    def _group(self, inputs: dict[str, tuple]) -> None:
        """Partition the towers by program and compile every group of 2+ (inputs: name -> (args,
        kwargs) of one member, for every tower)."""
        partition: list[list[str]] = []
        for name in self._tower_names:
            for group in partition:
                why = self._same_program(group[0], name, inputs)
                if why is None:
                    group.append(name)
                    break
                log.debug("WideRouter: tower %r is not in group %r: %s", name, group[0], why)
            else:
                partition.append([name])
        for names in partition:
            if len(names) < 2 or tuple(names) in self._fallbacks:
                continue
            towers = [self._modules[n] for n in names]
            args, kwargs = inputs[names[0]]
            try:
                self._check_not_shared(names)
                wide = _wide_compile(towers, args, sample_kwargs=kwargs, config=self._config,
                                     **self._compile_options)
            except Exception as e:  # noqa: BLE001 -- the towers still run, one by one, and we say so
                why = f"{type(e).__name__}: {e}"
                self._fallbacks[tuple(names)] = why
                warnings.warn(f"WideRouter: towers {names} are one program but could not be fused into "
                              f"one WideModel, so they run one by one ({why.splitlines()[0]})", stacklevel=3)
                continue
            key = names[0]
            self.groups[key] = wide
            self._members[key] = names
            self._templates[key] = copy.deepcopy(towers[0])
            self._structures[key] = _structure(args, kwargs)
            for n in names:
                self._originals[n] = self._modules.pop(n)
        self._grouped = True
        log.info("WideRouter: %s", self.report())

    def _check_not_shared(self, names: list[str]) -> None:
        """Stacking copies a group's tensors: a parameter or buffer a grouped tower shares with a
        module outside the group (another tower, a head) would be silently untied."""
        def ids(mod: nn.Module) -> dict[int, str]:
            return {id(t): k for k, t in [*mod.named_parameters(remove_duplicate=False),
                                          *mod.named_buffers(remove_duplicate=False)]}
        inside = {i: (n, k) for n in names for i, k in ids(self._modules[n]).items()}
        for other, mod in self._modules.items():
            if other in names or other == "groups":
                continue
            for i, k in ids(mod).items():
                if i in inside:
                    n, k0 = inside[i]
                    raise ValueError(f"tower {n!r} shares its tensor {k0!r} with {other!r} ({k!r}), "
                                     "outside the group: fusing would untie them")

    def _ungroup(self) -> None:
        """Write every group back into its originals and make them submodules again."""
        if not self._grouped:
            return
        self.write_back()
        for key, names in self._members.items():
            for n in names:
                self._modules[n] = self._originals.pop(n).train(self.groups[key].training)
        self.groups = nn.ModuleDict()
        self._members.clear()
        self._templates.clear()
        self._structures.clear()
        self._compiled = {}
        self._grouped = False

    def prepare_for_compile(self, *args: Any, tower_names: Iterable[str] | None = None, **kwargs: Any) -> None:
        """Group the towers and compile every group now, with these sample inputs (as for
        :meth:`wide_forward`; ``tower_names`` is ignored: every tower is grouped). Create the
        optimizer after this call."""
        if not self._tower_names:
            raise ValueError("WideRouter: no towers; attach them and call discover_towers() or register_tower()")
        self._ungroup()
        _, inputs = self._inputs(args, kwargs, None, all_towers=True)
        self._group(inputs)

    def compile(self, *args: Any, options: Mapping[str, Any] | None = None, **kwargs: Any) -> WideRouter:
        """:meth:`prepare_for_compile` with these sample inputs, then every group's wide model is
        wrapped in ``torch.compile(fullgraph=True, **options)`` (no graph breaks; a break is an
        error), used by :meth:`wide_forward` for whole-group calls. Returns the router.

        This replaces ``nn.Module.compile`` (which would compile :meth:`forward`, not the groups)."""
        self.prepare_for_compile(*args, **kwargs)
        opts = {"fullgraph": True, **dict(options or {})}
        # Every group runs the same code (WideModel.forward) with its own guards: dynamo's
        # per-code-object limit must admit a few entries per group (raised, never lowered).
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = limit + 4 * len(self.groups)  # train/eval, shapes
        self._compiled = {key: torch.compile(wide, **opts) for key, wide in self.groups.items()}
        return self

    # -- running ------------------------------------------------------------------------------
    def _inputs(self, args: tuple, kwargs: dict, tower_names: Iterable[str] | None,
                all_towers: bool = False) -> tuple[list[str], dict[str, tuple]]:
        """(selected towers, name -> (args, kwargs) of that tower) for a call."""
        per_tower = args[0] if args and isinstance(args[0], Mapping) else None
        if tower_names is not None and not all_towers:
            names = list(tower_names)
        elif per_tower is not None and not all_towers:
            names = [n for n in self._tower_names if n in per_tower]
        else:
            names = list(self._tower_names)
        for n in names:
            if n not in self._tower_names:
                raise KeyError(f"WideRouter: {n!r} is not a tower; towers: {self._tower_names}")
        if per_tower is None:  # one shared (args, kwargs) object, for every tower
            shared = (tuple(args), dict(kwargs))
            return names, {n: shared for n in self._tower_names}
        unknown = set(per_tower) - set(self._tower_names)
        if unknown:
            raise KeyError(f"WideRouter: inputs given for {sorted(unknown)}, which are not towers")
        inputs = {}
        for n in names:
            if n not in per_tower:
                raise KeyError(f"WideRouter: no input for tower {n!r} in the per-tower input dict")
            own = per_tower[n]
            own = tuple(own) if isinstance(own, (tuple, list)) else (own,)
            inputs[n] = (own + tuple(args[1:]), dict(kwargs))
        return names, inputs

    def wide_forward(self, *args: Any, tower_names: Iterable[str] | None = None, **kwargs: Any) -> dict[str, Any]:
        """Run the towers; returns ``{name: output}`` with each tower's own output.

        Inputs: ``wide_forward(x, mask=m)`` gives every tower ``(x,)`` and ``mask=m``;
        ``wide_forward({"a": (xa,), "b": xb}, mask=m)`` gives each tower its own positional inputs
        (further positional arguments and keywords are shared). ``tower_names`` selects a subset
        (default: every tower, or every tower with an entry in the per-tower dict).

        The first call groups the towers (see :meth:`prepare_for_compile`). A group whose towers
        are all selected runs as one wide call (shared inputs as stride-0 ``expand`` views,
        per-tower inputs stacked); a selected part of a group runs member by member on the wide
        parameters (unselected members are not touched)."""
        names, inputs = self._inputs(args, kwargs, tower_names)
        if not self._grouped:
            if self.training and any(p.requires_grad for n in self._tower_names for p in self._tower(n).parameters()):
                warnings.warn("WideRouter: grouping the towers on the first wide_forward: parameters() now "
                              "yields the wide parameters. Create the optimizer after this call (or call "
                              "prepare_for_compile(...) first)", stacklevel=2)
            self._group(self._inputs(args, kwargs, None, all_towers=True)[1])  # every tower needs an input
        selected = set(names)
        out: dict[str, Any] = {}
        for key, members in self._members.items():
            chosen = [i for i, n in enumerate(members) if n in selected]
            if not chosen:
                continue
            wide: WideModel = self.groups[key]
            distinct = {id(inputs[members[i]]): inputs[members[i]] for i in chosen}  # shared input: one
            same = all(_structure(*a) == self._structures[key] for a in distinct.values())
            if not same and (key, str(_structure(*inputs[members[chosen[0]]]))) not in self._warned_structures:
                self._warned_structures.add((key, str(_structure(*inputs[members[chosen[0]]]))))
                warnings.warn(f"WideRouter: group {members} was compiled for other inputs (another nesting, "
                              "other keywords or non-tensor values); these inputs run member by member on "
                              "the wide parameters (correct, slower): call prepare_for_compile(...) with "
                              "them for one wide call", stacklevel=2)
            if same and (len(chosen) == len(members) or wide._registered):
                result = self._run_group(wide, members, inputs, [members[i] for i in chosen])
            else:
                result = {members[i]: self._run_member(key, i, *inputs[members[i]]) for i in chosen}
            out.update(result)
        for n in names:
            if n not in out:
                a, k = inputs[n]
                out[n] = self._modules[n](*a, **k)
        return {n: out[n] for n in names}

    def _run_group(self, wide: WideModel, members: list[str], inputs: dict[str, tuple],
                   chosen: list[str]) -> dict[str, Any]:
        first = inputs[chosen[0]]
        if all(inputs.get(n) is first for n in members):
            args, kwargs = _expand(first, len(members))  # one input for all: stride-0 views
        elif all(n in inputs for n in members):
            args, kwargs = _stack([inputs[n] for n in members], members)
        else:
            raise ValueError(f"WideRouter: group {members} runs as one wide model (its towers have registered "
                             f"wide forms), so every tower of it needs an input; got inputs for {chosen}")
        y = self._compiled.get(members[0], wide)(*args, **kwargs)
        if isinstance(y, torch.Tensor):  # the common case: one unbind, no pytree walk per tower
            return {n: t for n, t in zip(members, y.unbind(0)) if n in chosen}

        def row(i: int) -> Any:
            return tree_map(lambda t: t[i] if isinstance(t, torch.Tensor) else t, y)

        return {n: row(i) for i, n in enumerate(members) if n in chosen}

    def _run_member(self, key: str, i: int, args: tuple, kwargs: dict) -> Any:
        """Member i of a group alone, on row i of the wide parameters and buffers (gradients reach
        the wide parameters; running statistics are updated in place in the wide buffers)."""
        wide = self.groups[key]
        template = self._templates[key].train(wide.training)
        params, buffers = wide._member_names()
        tensors = {name: wide._stacked(name)[i] for name in (*params, *buffers)}
        return torch.func.functional_call(template, tensors, args, kwargs, strict=False)

    # -- back to the towers -------------------------------------------------------------------
    @torch.no_grad()
    def write_back(self) -> None:
        """Copy every group's wide parameters and buffers into its original tower modules, in
        place (they keep their identity). Ungrouped towers are live submodules already."""
        for key, names in self._members.items():
            self.groups[key].write_back([self._originals[n] for n in names])

    def unfuse(self) -> dict[str, nn.Module]:
        """``{name: fresh module}`` for every tower, with the current (trained) weights and
        buffers, in this router's device, dtype and train/eval mode."""
        out: dict[str, nn.Module] = {}
        for key, names in self._members.items():
            out.update(zip(names, self.groups[key].unfuse()))
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
        return "\n".join(lines)

    def extra_repr(self) -> str:
        return f"towers={self._tower_names}"
