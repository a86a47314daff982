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
  optimizer AFTER grouping: an optimizer that still holds a grouped tower's own parameters raises
  at its ``step()`` (it would train nothing), and a router grouped lazily in training mode warns;
* ``router[name]`` is any attached component: a head or an ungrouped tower is the module itself, a
  fused tower is a live view that runs that tower alone on its rows of the wide parameters;
* towers that form no group (singletons, and the towers of a group whose compile failed) stay
  ordinary submodules and run as themselves;
* a tensor a grouped tower shares with anything else in the router (a head, another tower, a
  parameter registered on the router) would be untied by stacking: such a group is not fused (one
  warning naming the tensor) and its towers run one by one;
* the originals go stale while training: :meth:`~WideRouter.write_back` copies the wide values
  into them in place, :meth:`~WideRouter.unfuse` returns fresh modules instead.

Registering or unregistering a tower after grouping writes the groups back into the originals and
ungroups; the next call groups again (and ``parameters()`` changes again).

Example (the router guide's pattern: a named router, named towers, ``self[...]`` for a head):
    >>> import torch, wide_compiler as wc
    >>> from wide_compiler.router import Tower, WideRouter
    >>> class MLP(Tower):
    ...     def __init__(self, name, width):
    ...         super().__init__(name)
    ...         self.net = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Tanh(), torch.nn.Linear(width, 2))
    ...     def forward(self, x):
    ...         return self.net(x)
    >>> class Collective(WideRouter):
    ...     def __init__(self):
    ...         super().__init__("collective", auto_discover=True, config=wc.WideConfig.fast())
    ...         for i in range(3):
    ...             self.attach(f"small{i}", MLP(f"small{i}", 8))   # registered as it comes
    ...         self.attach("big", MLP("big", 16))
    ...         self.attach("fusion", torch.nn.Linear(8, 2))       # not a Tower: a head
    ...     def forward(self, x):
    ...         opinions = self.wide_forward(x)
    ...         return self["fusion"](torch.cat(list(opinions.values()), dim=-1))
    >>> router = Collective()
    >>> router.tower_names
    ['small0', 'small1', 'small2', 'big']
    >>> x = torch.randn(5, 4)
    >>> router.prepare_for_compile(x)          # group + compile now; make the optimizer after
    >>> router(x).shape
    torch.Size([5, 2])
    >>> router.group_members()
    {'small0': ['small0', 'small1', 'small2'], 'big': ['big']}
    >>> torch.allclose(router["small1"](x), router.wide_forward(x)["small1"])  # a live view
    True
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import threading
import warnings
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_map, tree_unflatten

from .api import compile as _wide_compile
from .config import WideConfig
from .errors import ArchitectureMismatchError, UnsupportedOperationError
from .fx.member_checks import check_members, check_run_members
from .fx.padding import pad_members
from .measure import time_interleaved
from .model import WideModel
from .padded import PaddedWideModel

__all__ = ["CompileRouter", "Tower", "WideRouter"]

log = logging.getLogger(__name__)

# -- tower names ------------------------------------------------------------------------------
# Reads of Tower.name while a router groups towers (the forwards the member check and the capture
# run): a forward that reads its tower's name computes something that depends on the name.
_name_watch = threading.local()


@contextlib.contextmanager
def _watch_names() -> Iterator[list]:
    """Record every :attr:`Tower.name` read in this thread inside the block."""
    outer = getattr(_name_watch, "reads", None)
    _name_watch.reads = reads = []
    try:
        yield reads
    finally:
        _name_watch.reads = outer
        if outer is not None:
            outer.extend(reads)


class _TowerLabel:
    """A tower's name, held so that the member check (which compares every non-tensor attribute
    of the members) treats towers of different names as one program: the name labels a tower, it
    is not part of what the tower computes. A forward that does read ``self.name`` is caught while
    grouping and never shares a program with towers of other names."""

    __slots__ = ("value",)

    def __init__(self, value: str | None) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _TowerLabel)

    def __hash__(self) -> int:
        return hash(_TowerLabel)

    def __repr__(self) -> str:
        return repr(self.value)

    def __reduce__(self) -> tuple:
        return (_TowerLabel, (self.value,))


def _check_label(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"Tower: name must be a string or None, got {type(value).__name__} {value!r}")
    return value


class Tower(nn.Module):
    """Base class of a router tower: an attached module of this type is registered by
    :meth:`WideRouter.discover_towers`, and by :meth:`WideRouter.attach` itself on a router made
    with ``auto_discover=True``. Any module can be made a tower with
    :meth:`WideRouter.register_tower`.

    Args:
        name: an optional label (the router guide builds towers as ``MyTower('tower_0', dim)``).
            The router knows a tower by the name it is attached under. Towers that differ only in
            their labels share one wide program, unless their forward reads ``self.name`` (then
            each runs alone: one program cannot hold several names).

    Example:
        >>> import torch
        >>> from wide_compiler.router import Tower
        >>> class MyTower(Tower):
        ...     def __init__(self, name, dim):
        ...         super().__init__(name)
        ...         self.fc = torch.nn.Linear(dim, dim)
        ...     def forward(self, x):
        ...         return self.fc(x)
        >>> MyTower("tower_0", 4).name
        'tower_0'
        >>> MyTower("tower_0", 4)
        MyTower(
          name='tower_0'
          (fc): Linear(in_features=4, out_features=4, bias=True)
        )
    """

    def __init__(self, name: str | None = None) -> None:
        label = self.__dict__.get("_tower_label")  # a name set before super().__init__() is kept
        super().__init__()
        self.__dict__["_tower_label"] = _TowerLabel(_check_label(name)) if name is not None or label is None else label

    @property
    def name(self) -> str | None:
        """The tower's label (``None`` when it was built without one)."""
        reads = getattr(_name_watch, "reads", None)
        if reads is not None:
            reads.append(self)
        label = self.__dict__.get("_tower_label")
        return None if label is None else label.value

    @name.setter
    def name(self, value: str | None) -> None:
        self.__dict__["_tower_label"] = _TowerLabel(_check_label(value))

    def extra_repr(self) -> str:
        label = self.__dict__.get("_tower_label")
        return "" if label is None or label.value is None else f"name={label.value!r}"


def _labels(mod: nn.Module) -> list[str | None]:
    """The labels of every Tower inside ``mod`` (itself included), in module order."""
    return [m.__dict__["_tower_label"].value for m in mod.modules()
            if isinstance(m, Tower) and "_tower_label" in m.__dict__]


# -- optimizers holding parameters that grouping replaced -------------------------------------
# id(parameter) -> (weak ref to it, weak ref to its router, why it is stale). A global optimizer
# step pre-hook refuses to step an optimizer that holds one of them while its router is alive:
# such a parameter no longer takes part in the router's forward, so its step would train nothing.
_retired: dict[int, tuple[weakref.ref, weakref.ref, str]] = {}
_retired_version = [0]
_checked_optimizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_retired_lock = threading.Lock()
_hook_handle: list[Any] = []


def _retire(tensors: Iterable[torch.Tensor], router: WideRouter, why: str) -> None:
    """Mark ``tensors`` as no longer ``router``'s live parameters (see :func:`_check_optimizer`)."""
    rref = weakref.ref(router)
    with _retired_lock:
        for t in tensors:
            k = id(t)

            def gone(r: weakref.ref, k: int = k) -> None:
                entry = _retired.get(k)
                if entry is not None and entry[0] is r:
                    _retired.pop(k, None)

            _retired[k] = (weakref.ref(t, gone), rref, why)
        _retired_version[0] += 1
        if not _hook_handle:
            _hook_handle.append(register_optimizer_step_pre_hook(_check_optimizer))


def _revive(tensors: Iterable[torch.Tensor]) -> None:
    """Undo :func:`_retire` (a tower ungrouped: its own parameters are live again)."""
    with _retired_lock:
        for t in tensors:
            entry = _retired.get(id(t))
            if entry is not None and entry[0]() is t:
                del _retired[id(t)]
        _retired_version[0] += 1


def _check_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global optimizer step pre-hook (registered at the first grouping): raise when the optimizer
    holds a parameter that a live router's grouping (or ungrouping) replaced, whatever mode the
    grouping ran in. Cached per optimizer: a step costs a few dict lookups unless the optimizer's
    parameters or the set of replaced parameters changed."""
    if not _retired:
        return
    groups = optimizer.param_groups
    stamp = (_retired_version[0], len(groups), sum(len(g["params"]) for g in groups))
    try:
        if _checked_optimizers.get(optimizer) == stamp:
            return
    except TypeError:  # cannot be weakly referenced: checked at every step
        pass
    stale: dict[str, int] = {}
    for g in groups:
        for p in g["params"]:
            entry = _retired.get(id(p))
            if entry is not None and entry[0]() is p and entry[1]() is not None:
                stale[entry[2]] = stale.get(entry[2], 0) + 1
    if stale:
        what = "; ".join(f"{n} {why}" for why, n in stale.items())
        raise RuntimeError(
            f"WideRouter: this {type(optimizer).__name__} holds parameters that are no longer the router's "
            f"live parameters ({what}), so stepping it would train nothing. Create the optimizer after "
            "grouping: call router.prepare_for_compile(sample_input) (or run one wide_forward) first, then "
            "build it from router.parameters(). To train a tower module on its own, take a fresh copy "
            "with router.unfuse()[name]")
    try:
        _checked_optimizers[optimizer] = stamp
    except TypeError:
        pass


# -- tensors a tower shares ------------------------------------------------------------------
_MODULE_KEYS = frozenset(nn.Module().__dict__) | {"_compiled_call_impl", "_tower_label"}


def _tensors(mod: nn.Module) -> dict[int, tuple[torch.Tensor, str, bool]]:
    """Every tensor ``mod`` reaches: ``id -> (tensor, where, registered)`` for its parameters and
    buffers and for tensors held as plain attributes (directly, in a list/tuple/dict, or behind a
    weak reference) of any of its submodules."""
    out: dict[int, tuple[torch.Tensor, str, bool]] = {}

    def add(t: Any, where: str, registered: bool) -> None:
        if isinstance(t, weakref.ref):
            t = t()
        if isinstance(t, torch.Tensor) and (registered or id(t) not in out):
            out[id(t)] = (t, where, registered)

    for path, m in mod.named_modules(remove_duplicate=False):
        pre = f"{path}." if path else ""
        for k, t in m._parameters.items():
            add(t, pre + k, True)
        for k, t in m._buffers.items():
            add(t, pre + k, True)
        for k, v in m.__dict__.items():
            if k in _MODULE_KEYS:
                continue
            if isinstance(v, (list, tuple)):
                for j, t in enumerate(v):
                    add(t, f"{pre}{k}[{j}]", False)
            elif isinstance(v, dict):
                for j, t in v.items():
                    add(t, f"{pre}{k}[{j!r}]", False)
            else:
                add(v, pre + k, False)
    return out


def _tied(t: torch.Tensor, registered: bool) -> bool:
    """Whether a tensor reached from two places must stay one object: a parameter, anything
    trained, or anything registered (a buffer can be updated in place); a plain constant tensor
    read by both is only read."""
    return registered or isinstance(t, nn.Parameter) or t.requires_grad


def _describe_tensor(t: torch.Tensor) -> str:
    kind = "Parameter" if isinstance(t, nn.Parameter) else "tensor"
    return f"{kind} {list(t.shape)} {t.dtype}"


# -- inputs -----------------------------------------------------------------------------------
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


def _plain(args: tuple, kwargs: dict) -> bool:
    """Whether a call is positional tensors only (the common call: no pytree walk needed)."""
    return not kwargs and all(isinstance(a, torch.Tensor) for a in args)


def _structure(args: tuple, kwargs: dict) -> Any:
    """What a compiled program fixes about its inputs: the nesting and the non-tensor values."""
    if _plain(args, kwargs):
        return len(args)
    flat, spec = tree_flatten((args, kwargs))
    return spec, [None if isinstance(a, torch.Tensor) else ("value", a) for a in flat]


def _expand(tree: Any, n: int) -> Any:
    """One input shared by n members: every tensor as a stride-0 view ``x.expand(n, *x.shape)``."""
    if _plain(*tree):
        return tuple(a.expand(n, *a.shape) for a in tree[0]), {}
    return tree_map(lambda a: a.expand(n, *a.shape) if isinstance(a, torch.Tensor) else a, tree)


def _input_name(path: tuple) -> str:
    """A leaf of ``(args, kwargs)`` as the user wrote it: ``args[0]``, ``mask=``, ``args[1]['k']``."""
    if not path:
        return "the input"
    head, rest = path[0], keystr(path[1:])
    if getattr(head, "idx", None) == 1 and rest.startswith("['"):
        key, _, more = rest[2:].partition("']")
        return f"keyword {key}{more}"
    return f"args{rest}"


def _stack(trees: list, names: list[str]) -> Any:
    """Per-member inputs of one structure -> one N-first input (non-tensor values must agree;
    tensors must have one shape, dtype and device: they are stacked)."""
    flats = [tree_flatten_with_path(t) for t in trees]
    spec = flats[0][1]
    for (_, s), name in zip(flats, names):
        if s != spec:
            raise ValueError(f"WideRouter: tower {name!r} got inputs structured as {s}, tower "
                             f"{names[0]!r} of its group got {spec}")
    leaves = []
    for k, (path, first) in enumerate(flats[0][0]):
        column = [f[0][k][1] for f in flats]
        if isinstance(first, torch.Tensor):
            kinds = [(tuple(c.shape), c.dtype, c.device) if isinstance(c, torch.Tensor) else None for c in column]
            if any(kd != kinds[0] for kd in kinds):
                got = ", ".join(f"{n!r}: " + (f"{list(kd[0])} {kd[1]} {kd[2]}" if kd else type(c).__name__)
                                for n, kd, c in zip(names, kinds, column))
                raise ValueError(
                    f"WideRouter: towers {names} are one group, run as one wide call that stacks their "
                    f"per-tower inputs, but their {_input_name(path)} differ ({got}). Give the towers of a "
                    "group inputs of one shape, dtype and device (e.g. pad or crop to one batch size), or "
                    "run them in separate wide_forward calls with tower_names=[...]")
            leaves.append(torch.stack(column))
        else:
            if any(c != first for c in column):
                raise ValueError(f"WideRouter: the towers of group {names} got different non-tensor inputs "
                                 f"{column}; they are baked into the group's program")
            leaves.append(first)
    return tree_unflatten(leaves, spec)


def _device_arg(a: Any) -> torch.device | None:
    """``a`` as a device when it is one (``prepare_for_compile(device)`` of the guide), else None."""
    if isinstance(a, torch.device):
        return a
    if isinstance(a, str):
        try:
            return torch.device(a)
        except (RuntimeError, ValueError):
            return None
    return None


def _named_parameter(mod: nn.Module, name: str) -> bool:
    """Whether ``mod.forward`` has a parameter literally called ``name``."""
    try:
        return name in inspect.signature(mod.forward).parameters
    except (TypeError, ValueError):
        return False


_TORCH_COMPILE_KEYS = ("mode", "backend", "fullgraph", "dynamic", "disable")


@contextlib.contextmanager
def _untouched(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Calls inside leave ``modules`` as they were: buffers (running statistics), gradients and
    the random number generators are restored after."""
    modules = list(modules)
    buffers = [(b, b.detach().clone()) for m in modules for b in m.buffers()]
    grads = [(q, q.grad) for m in modules for q in m.parameters()]
    for q, _ in grads:
        q.grad = None
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for q, g in grads:
            q.grad = g


class _FusedTowerView(nn.Module):
    """``router[name]`` for a tower fused into a wide group: calling it runs that tower alone on
    its rows of the group's wide parameters and buffers (reads them live, and gradients reach
    them, so an optimizer over ``router.parameters()`` trains it). The view follows the tower by
    name: after the router ungroups, it calls the live tower module.

    It owns no parameters: ``parameters()`` raises (the trainable tensors are the router's), and
    ``state_dict()``/``load_state_dict()`` read and write the tower's rows. For a standalone copy
    of the tower use ``router.unfuse()[name]``."""

    def __init__(self, router: WideRouter, name: str) -> None:
        super().__init__()
        self.__dict__["_router"] = router  # not a submodule: the router owns the view, not the reverse
        self.__dict__["_tower_name"] = name

    def _where(self) -> tuple[str | None, int | nn.Module]:
        """(group key, member index) while fused, else (None, the live tower module)."""
        router, name = self.__dict__["_router"], self.__dict__["_tower_name"]
        for key, members in router._members.items():
            if name in members:
                return key, members.index(name)
        if name in router._modules and name in router._tower_names:
            return None, router._modules[name]
        raise KeyError(f"router[{name!r}]: {name!r} is no longer a tower of this router; towers: "
                       f"{router._tower_names}")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        key, where = self._where()
        if key is None:
            return where(*args, **kwargs)
        return self.__dict__["_router"]._run_member(key, where, args, kwargs)

    def _refuse(self, what: str) -> None:
        name = self.__dict__["_tower_name"]
        raise RuntimeError(
            f"router[{name!r}].{what}: tower {name!r} is fused into a wide group, so its parameters are rows "
            "of the router's wide parameters and have no tensors of their own: train it with an optimizer "
            f"over router.parameters(); read its values with router[{name!r}].state_dict(); for a standalone "
            f"module use router.unfuse()[{name!r}] (a copy)")

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        self._refuse("parameters()")

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        self._refuse("named_parameters()")

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """The tower's ``state_dict``: copies of its rows of the wide parameters and buffers."""
        key, where = self._where()
        if key is None:
            return where.state_dict(*args, **kwargs)
        return self.__dict__["_router"].groups[key].member_state_dict(where)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Write an ordinary tower ``state_dict`` into the tower's rows (strict: the tower's own
        keys and shapes, all checked before anything is written)."""
        key, where = self._where()
        if key is None:
            return where.load_state_dict(state_dict, strict=strict, assign=assign)
        if not strict or assign:
            raise ValueError("router[name].load_state_dict of a fused tower is strict and copies into the wide "
                             "parameters: strict=False and assign=True are not supported")
        self.__dict__["_router"].groups[key].load_member_state_dict(where, state_dict)
        return None

    def __getattr__(self, attr: str) -> Any:
        try:
            return super().__getattr__(attr)
        except AttributeError:
            name = self.__dict__.get("_tower_name")
            if name is None:  # half-built (unpickling, copying)
                raise
            raise AttributeError(
                f"router[{name!r}] is a live view of tower {name!r}, fused into a wide group: it can be called "
                f"and has state_dict()/load_state_dict(), but no attribute {attr!r} (the fused tower has no "
                f"module of its own). Use router.unfuse()[{name!r}] for a copy of the module, or "
                "router.write_back() to update the original one") from None

    def extra_repr(self) -> str:
        try:
            key, where = self._where()
        except KeyError:
            return f"tower={self.__dict__['_tower_name']!r} (detached)"
        return (f"tower={self.__dict__['_tower_name']!r}, "
                + ("not fused" if key is None else f"fused: member {where} of router.groups[{key!r}]"))


class WideRouter(nn.Module):
    """Named towers of several architectures, grouped by program, each group of two or more run
    as one :class:`~wide_compiler.WideModel`. See the module docstring for the ownership rule.

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
            (and ``pad_decisions``).

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
                 compile_options: Mapping[str, Any] | None = None, pad: bool = False) -> None:
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
        self._pad_sizes = bool(pad)
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

    def __getitem__(self, name: str) -> nn.Module:
        """Any attached component by name (the guide's ``self['fusion'](opinions)``): a head or an
        ungrouped tower is the module itself; a tower fused into a wide group is a live view that
        runs it alone on its rows of the wide parameters (see the module docstring)."""
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

    # -- grouping -----------------------------------------------------------------------------
    def _same_program(self, a: str, b: str, inputs: dict[str, tuple]) -> str | None:
        """None when towers a and b may share one program, else why not."""
        if _signature(*inputs[a]) != _signature(*inputs[b]):
            return "different input shapes"
        ta, tb = self._tower(a), self._tower(b)
        try:
            check_members([ta, tb])
            if self._config.run_members:
                with _watch_names() as reads:
                    check_run_members([ta, tb], *inputs[a])
                if reads and _labels(ta) != _labels(tb):
                    return self._reads_name_why([a, b])
        except ArchitectureMismatchError as e:
            return str(e)
        except Exception as e:  # noqa: BLE001 -- a tower that cannot even run is a group of its own
            return f"{type(e).__name__}: {e}"
        return None

    def _reads_name_why(self, names: list[str]) -> str:
        labels = {n: _labels(self._tower(n)) for n in names}
        return (f"the forward of tower {names[0]!r} reads Tower.name, and the towers' names differ "
                f"({labels}): one wide program would give every tower the name of the first")

    def _check_not_shared(self, names: list[str]) -> None:
        """Stacking copies a group's tensors: a parameter or buffer a grouped tower shares with
        anything else in the router (another tower of the group or outside it, a head, a tensor
        registered on the router itself), held registered or as a plain attribute, would be
        silently untied. Raise naming the first one."""
        inside: dict[int, tuple[str, str, bool]] = {}  # id -> (tower, where, tied on its side)
        for n in names:
            for i, (t, where, registered) in _tensors(self._modules[n]).items():
                if i in inside and inside[i][0] != n and _tied(t, registered):
                    n0, w0, _ = inside[i]
                    raise ValueError(f"tower {n!r} ({where!r}) and tower {n0!r} ({w0!r}) of the group share "
                                     f"one {_describe_tensor(t)}: fusing would give each member its own copy "
                                     "and untie them")
                inside.setdefault(i, (n, where, _tied(t, registered)))
        outside = [(o, m) for o, m in [*self._modules.items(), *self._originals.items()]
                   if o not in names and o != "groups"]
        own = {id(t): (t, k, True) for k, t in [*self._parameters.items(), *self._buffers.items()] if t is not None}
        for k, v in self.__dict__.items():
            if isinstance(v, torch.Tensor) and id(v) not in own:
                own[id(v)] = (v, k, False)
        for other, found in [("the router itself", own), *((repr(o), _tensors(m)) for o, m in outside)]:
            for i, (t, where, registered) in found.items():
                if i in inside and (_tied(t, registered) or inside[i][2]):
                    n, w, _ = inside[i]
                    raise ValueError(f"tower {n!r} shares its tensor {w!r} ({_describe_tensor(t)}) with {other} "
                                     f"({where!r}), outside the group: fusing would copy it into the group's "
                                     "stacked parameters and untie them")

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
        built: dict[tuple[str, ...], WideModel] = {}
        if self._pad_sizes:
            partition = self._pad_partition(partition, inputs, built)
        for names in partition:
            if len(names) < 2 or tuple(names) in self._fallbacks:
                continue
            towers = [self._modules[n] for n in names]
            args, kwargs = inputs[names[0]]
            try:
                self._check_not_shared(names)
                with _watch_names() as reads:
                    wide = built.get(tuple(names)) or _wide_compile(
                        towers, args, sample_kwargs=kwargs, config=self._config, **self._compile_options)
                if reads and len({tuple(_labels(t)) for t in towers}) > 1:
                    raise ValueError(self._reads_name_why(names))
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
            _retire([p for t in towers for p in t.parameters()], self,
                    f"are the own parameters of towers {names}, which grouping replaced by the wide parameters "
                    f"of router.groups[{key!r}]")
        self._grouped = True
        if self._compile_opts is not None:
            self._compile_groups()
        log.info("WideRouter: %s", self.report())

    def _pad_partition(self, partition: list[list[str]], inputs: dict[str, tuple],
                       built: dict[tuple[str, ...], WideModel]) -> list[list[str]]:
        """With ``pad``: the groups of one program up to sizes become one padded group where that
        measures faster than a wide model per size (both compiled here, into ``built``; the
        verdict goes to ``pad_decisions``)."""
        clusters: list[list[list[str]]] = []
        refused: dict[int, str] = {}  # id(cluster) -> why padding it is refused
        for names in partition:
            for cluster in clusters:
                a, b = cluster[0][0], names[0]
                if inputs[a] is not inputs[b] and _signature(*inputs[a]) != _signature(*inputs[b]):
                    continue
                try:
                    pad_members([self._tower(a), self._tower(b)], *inputs[a])
                except ArchitectureMismatchError as e:  # not one program up to sizes: its own group
                    log.debug("WideRouter: %r and %r are not one program up to sizes: %s", a, b, e)
                    continue
                except Exception as e:  # noqa: BLE001 -- one program, but padding it is refused
                    refused.setdefault(id(cluster), str(e).splitlines()[0])
                cluster.append(names)
                break
            else:
                clusters.append([names])
        out: list[list[str]] = []
        for cluster in clusters:
            if len(cluster) < 2:
                out += cluster
                continue
            names = [n for group in cluster for n in group]
            args, kwargs = inputs[names[0]]
            try:
                if id(cluster) in refused:
                    raise UnsupportedOperationError(refused[id(cluster)])
                self._check_not_shared(names)
                padded = _wide_compile([self._tower(n) for n in names], args, sample_kwargs=kwargs,
                                       config=self._config, pad=True, **self._compile_options)
            except Exception as e:  # noqa: BLE001 -- padding refused: groups by size, and we say why
                self.pad_decisions[tuple(names)] = f"by size (padding refused: {str(e).splitlines()[0]})"
                out += cluster
                continue
            for group in cluster:
                if len(group) > 1:
                    built[tuple(group)] = _wide_compile([self._tower(n) for n in group], args, sample_kwargs=kwargs,
                                                        config=self._config, **self._compile_options)

            train = self.training and torch.is_grad_enabled()

            def run(groups: list[tuple[list[str], Any]]) -> None:
                """One call of every group: a forward, and in training a backward too (timed as used)."""
                with torch.set_grad_enabled(train):
                    outs = []
                    for members, wide in groups:
                        if isinstance(wide, nn.Module) and len(members) > 1:
                            a, k = _stack([inputs[n] for n in members], members)
                            outs.append(wide(*a, **k))
                        else:
                            outs.append(self._tower(members[0])(*inputs[members[0]][0], **inputs[members[0]][1]))
                    leaves = [t for t in tree_flatten(outs)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
                    if train and leaves:
                        torch.autograd.backward([t.sum() for t in leaves])

            by_size = [(g, built.get(tuple(g))) for g in cluster]
            timed = [padded, *(w for _, w in by_size if isinstance(w, nn.Module)),
                     *(self._tower(g[0]) for g in cluster if len(g) == 1)]
            with _untouched(timed):  # the timing's calls change no buffer, gradient or RNG state
                ms = time_interleaved({"padded": lambda: run([(names, padded)]), "by_size": lambda: run(by_size)},
                                      min_run_time=0.1)
            chosen = "padded" if ms["padded"] <= ms["by_size"] else "by size"
            self.pad_decisions[tuple(names)] = (
                f"{chosen}: one padded model {ms['padded']:.3f} ms, a model per size {ms['by_size']:.3f} ms per "
                f"{'training step' if train else 'call'} (measured at grouping)")
            log.info("WideRouter: towers %s of one program up to sizes: %s", names, self.pad_decisions[tuple(names)])
            if chosen == "padded":
                built[tuple(names)] = padded
                out.append(names)
            else:
                out += cluster
        return out

    @torch.compiler.disable
    def _group_lazily(self, args: tuple, kwargs: dict) -> None:
        """The first :meth:`wide_forward` groups (outside any torch.compile trace: grouping
        captures and compiles, eagerly)."""
        if self.training and any(p.requires_grad for n in self._tower_names for p in self._tower(n).parameters()):
            warnings.warn("WideRouter: grouping the towers on the first wide_forward: parameters() now "
                          "yields the wide parameters. Create the optimizer after this call (or call "
                          "prepare_for_compile(sample) first); an optimizer made before raises at its step()",
                          stacklevel=4)
        self._group(self._inputs(args, kwargs, None, all_towers=True)[1])  # every tower needs an input

    def _ungroup(self) -> None:
        """Write every group back into its originals and make them submodules again."""
        if not self._grouped:
            return
        self.write_back()
        keys = list(self._members)
        _retire(list(self.groups.parameters()), self,
                f"are wide parameters of groups {keys}, which registering or unregistering a tower ungrouped "
                "(the next call groups again, with new wide parameters)")
        for key, names in self._members.items():
            for n in names:
                self._modules[n] = self._originals.pop(n).train(self.groups[key].training)
                _revive(self._modules[n].parameters())
        self.groups = nn.ModuleDict()
        self._members.clear()
        self._templates.clear()
        self._structures.clear()
        self._compiled = {}
        self._grouped = False

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
        self._ungroup()
        _, inputs = self._inputs(args, kwargs, None, all_towers=True)
        self._group(inputs)

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
        opts = dict(options or {})
        for k in _TORCH_COMPILE_KEYS:
            if k not in kwargs:
                continue
            takers = [n for n in self._tower_names if _named_parameter(self._tower(n), k)]
            if takers and options is not None:
                continue  # options given explicitly: a keyword the towers take is a sample input
            if takers:
                raise TypeError(f"WideRouter.compile: {k}= is ambiguous: it is a torch.compile option and a "
                                f"parameter of the forward of towers {takers}. Pass torch.compile's options "
                                f"as options={{...}} (then {k}=... is a sample input)")
            if k in opts:
                raise TypeError(f"WideRouter.compile: {k} given twice, as {k}= and in options")
            opts[k] = kwargs.pop(k)
        if "options" in opts and not isinstance(opts["options"], Mapping):
            raise TypeError("WideRouter.compile: options must be a dict of torch.compile keyword arguments")
        self._compile_opts = {"fullgraph": True, **opts}
        self._compiled = {}
        self.prepare_for_compile(*args, **kwargs)  # groups (and compiles the groups) when given a sample
        if self._grouped and not self._compiled:
            self._compile_groups()
        return self

    def _compile_groups(self) -> None:
        """Wrap every group's wide model in ``torch.compile`` with :meth:`compile`'s options."""
        # Every group runs the same code (WideModel.forward) with its own guards: dynamo's
        # per-code-object limit must admit a few entries per group (raised, never lowered).
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = limit + 4 * len(self.groups)  # train/eval, shapes
        self._compiled = {key: torch.compile(wide, **self._compile_opts) for key, wide in self.groups.items()}

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

        The first call groups the towers (see :meth:`prepare_for_compile`): create the optimizer
        after it (one made before raises at its ``step()``). A group whose towers
        are all selected runs as one wide call (shared inputs as stride-0 ``expand`` views,
        per-tower inputs stacked); a selected part of a group runs member by member on the wide
        parameters (unselected members are not touched)."""
        names, inputs = self._inputs(args, kwargs, tower_names)
        if not self._grouped:
            self._group_lazily(args, kwargs)
        selected = set(names)
        out: dict[str, Any] = {}
        structures: dict[int, Any] = {}  # id of a distinct input -> its structure (a shared input: once a call)
        for key, members in self._members.items():
            chosen = [i for i, n in enumerate(members) if n in selected]
            if not chosen:
                continue
            wide: WideModel = self.groups[key]
            distinct = {id(inputs[members[i]]): inputs[members[i]] for i in chosen}  # shared input: one
            for k, a in distinct.items():
                if k not in structures:
                    structures[k] = _structure(*a)
            same = all(structures[k] == self._structures[key] for k in distinct)
            seen = (key, str(structures[id(inputs[members[chosen[0]]])]))
            if not same and seen not in self._warned_structures:
                self._warned_structures.add(seen)
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
        if isinstance(wide, PaddedWideModel):  # each tower's own sizes
            return {n: o for n, o in zip(members, wide.member_outputs(y)) if n in chosen}
        if isinstance(y, torch.Tensor):  # the common case: one unbind, no pytree walk per tower
            return {n: t for n, t in zip(members, y.unbind(0)) if n in chosen}

        def row(i: int) -> Any:
            return tree_map(lambda t: t[i] if isinstance(t, torch.Tensor) else t, y)

        return {n: row(i) for i, n in enumerate(members) if n in chosen}

    def _run_member(self, key: str, i: int, args: tuple, kwargs: dict) -> Any:
        """Member i of a group alone, on row i of the wide parameters and buffers (gradients reach
        the wide parameters; running statistics are updated in place in the wide buffers)."""
        wide = self.groups[key]
        if isinstance(wide, PaddedWideModel):  # the tower's own module, on views of its own sizes
            template = self._templates.get(f"{key}/{i}")
            if template is None:
                template = self._templates[f"{key}/{i}"] = copy.deepcopy(wide._originals[i])
            tensors = wide.member_tensors(i)
        else:
            template = self._templates[key]
            params, buffers = wide._member_names()
            tensors = {name: wide._stacked(name)[i] for name in (*params, *buffers)}
        return torch.func.functional_call(template.train(wide.training), tensors, args, kwargs, strict=False)

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


class CompileRouter:
    """``torch.compile`` of a module that holds :class:`WideRouter` s, as the router guide's
    Compilation (Option 3) and "Integration with CompileRouter" sections use it::

        model.collective.prepare_for_compile()
        compiler = CompileRouter.from_module(model)
        compiler.compile_towers()                      # optional: each router's groups compiled
        model = compiler.compile(mode="reduce-overhead")

    It holds the module and changes nothing until called: :meth:`compile_towers` makes every
    router inside compile its groups' wide models (``fullgraph=True``) once they are grouped,
    :meth:`compile` returns ``torch.compile(module, **options)``. Grouping never runs inside a
    ``torch.compile`` trace, so routers grouped before or at the first call both work.

    Example:
        >>> import torch, wide_compiler as wc
        >>> from wide_compiler.router import CompileRouter
        >>> router = wc.WideRouter("collective", config=wc.WideConfig.fast())
        >>> for i in range(2):
        ...     router.register_tower(f"t{i}", torch.nn.Linear(3, 2))
        >>> model = torch.nn.ModuleDict({"collective": router})
        >>> model["collective"].prepare_for_compile(torch.randn(4, 3))
        >>> compiler = CompileRouter.from_module(model)
        >>> compiler.routers() == [router]
        True
        >>> compiled = compiler.compile(backend="eager")
        >>> compiled._orig_mod is model
        True
    """

    def __init__(self, module: nn.Module) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"CompileRouter: expected an nn.Module, got {type(module).__name__}")
        self.module = module

    @classmethod
    def from_module(cls, module: nn.Module) -> CompileRouter:
        """The compiler of ``module`` (the guide's spelling of the constructor)."""
        return cls(module)

    def routers(self) -> list[WideRouter]:
        """Every :class:`WideRouter` inside the module, itself included, in module order."""
        return [m for m in self.module.modules() if isinstance(m, WideRouter)]

    def compile_towers(self, **options: Any) -> None:
        """Every router compiles its groups' wide models (``WideRouter.compile`` without a
        sample: now where the router is grouped, else at its first call)."""
        routers = self.routers()
        if not routers:
            raise ValueError(f"CompileRouter: {type(self.module).__name__} holds no WideRouter")
        for r in routers:
            r.compile(options=options)

    def compile(self, **options: Any) -> nn.Module:
        """``torch.compile(module, **options)``."""
        return torch.compile(self.module, **options)

