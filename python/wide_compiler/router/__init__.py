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

The package, one concern a module: :class:`WideRouter` itself (core.py: registration, lookup, the
groups' state and report), :class:`Tower` and its label (towers.py), grouping (grouping.py; the
padded groups of a width sweep in padding.py, the refusal of shared tensors in sharing.py, the
guard against stale optimizers in optimizer_guard.py), running (running.py; a call's inputs in
inputs.py, ``router[name]`` of a fused tower in view.py) and ``torch.compile`` (compiling.py,
compile_router.py).

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

from .compile_router import CompileRouter
from .core import WideRouter
from .towers import Tower

# A router pickled (or torch.save'd whole) before the package was split into modules names its
# classes as wide_compiler.router.<class>, the private ones too: they stay importable from here.
from .towers import _TowerLabel  # noqa: F401  # isort: skip
from .view import _FusedTowerView  # noqa: F401  # isort: skip

__all__ = ["CompileRouter", "Tower", "WideRouter"]
