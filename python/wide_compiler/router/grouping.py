"""Grouping a router's towers: partition them by program, fuse every group of two or more into
one :class:`~wide_compiler.WideModel` (the ownership rule of the package docstring: the grouped
towers are kept aside as the originals), and undo it (ungrouping writes the groups back)."""

from __future__ import annotations

import copy
import logging
import warnings
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..api import compile as _wide_compile
from ..errors import ArchitectureMismatchError
from ..fx.member_checks import check_members
from ..fx.member_runs import check_run_members
from ..model import WideModel
from .compiling import _compile_groups
from .inputs import _signature, _structure, _tower_inputs
from .optimizer_guard import _retire, _revive
from .padding import _pad_partition
from .sharing import _check_not_shared
from .towers import _labels, _watch_names

if TYPE_CHECKING:
    from .core import WideRouter

__all__: list[str] = []

log = logging.getLogger("wide_compiler.router")  # the package's one logger, as before the split


def _same_program(router: WideRouter, a: str, b: str, inputs: dict[str, tuple]) -> str | None:
    """None when towers a and b may share one program, else why not."""
    if _signature(*inputs[a]) != _signature(*inputs[b]):
        return "different input shapes"
    ta, tb = router._tower(a), router._tower(b)
    try:
        check_members([ta, tb])
        if router._config.run_members:
            with _watch_names() as reads:
                check_run_members([ta, tb], *inputs[a])
            if reads and _labels(ta) != _labels(tb):
                return _reads_name_why(router, [a, b])
    except ArchitectureMismatchError as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 -- a tower that cannot even run is a group of its own
        return f"{type(e).__name__}: {e}"
    return None


def _reads_name_why(router: WideRouter, names: list[str]) -> str:
    """Why towers whose forward reads :attr:`Tower.name` cannot share one program."""
    labels = {n: _labels(router._tower(n)) for n in names}
    return (f"the forward of tower {names[0]!r} reads Tower.name, and the towers' names differ "
            f"({labels}): one wide program would give every tower the name of the first")


def _group(router: WideRouter, inputs: dict[str, tuple]) -> None:
    """Partition the towers by program and compile every group of 2+ (inputs: name -> (args,
    kwargs) of one member, for every tower)."""
    partition: list[list[str]] = []
    for name in router._tower_names:
        for group in partition:
            why = _same_program(router, group[0], name, inputs)
            if why is None:
                group.append(name)
                break
            log.debug("WideRouter: tower %r is not in group %r: %s", name, group[0], why)
        else:
            partition.append([name])
    built: dict[tuple[str, ...], WideModel] = {}
    if router._pad_sizes:
        partition = _pad_partition(router, partition, inputs, built)
    for names in partition:
        if len(names) < 2 or tuple(names) in router._fallbacks:
            continue
        towers = [router._modules[n] for n in names]
        args, kwargs = inputs[names[0]]
        try:
            _check_not_shared(router, names)
            with _watch_names() as reads:
                wide = built.get(tuple(names)) or _wide_compile(
                    towers, args, sample_kwargs=kwargs, config=router._config, **router._compile_options)
            if reads and len({tuple(_labels(t)) for t in towers}) > 1:
                raise ValueError(_reads_name_why(router, names))
        except Exception as e:  # noqa: BLE001 -- the towers still run, one by one, and we say so
            why = f"{type(e).__name__}: {e}"
            router._fallbacks[tuple(names)] = why
            warnings.warn(f"WideRouter: towers {names} are one program but could not be fused into "
                          f"one WideModel, so they run one by one ({why.splitlines()[0]})", stacklevel=3)
            continue
        key = names[0]
        router.groups[key] = wide
        router._members[key] = names
        router._templates[key] = copy.deepcopy(towers[0])
        router._structures[key] = _structure(args, kwargs)
        for n in names:
            router._originals[n] = router._modules.pop(n)
        _retire([p for t in towers for p in t.parameters()], router,
                f"are the own parameters of towers {names}, which grouping replaced by the wide parameters "
                f"of router.groups[{key!r}]")
    router._grouped = True
    if router._compile_opts is not None:
        _compile_groups(router)
    log.info("WideRouter: %s", router.report())


@torch.compiler.disable


def _group_lazily(router: WideRouter, args: tuple, kwargs: dict) -> None:
    """The first :meth:`WideRouter.wide_forward` groups (outside any torch.compile trace: grouping
    captures and compiles, eagerly)."""
    if router.training and any(p.requires_grad for n in router._tower_names for p in router._tower(n).parameters()):
        warnings.warn("WideRouter: grouping the towers on the first wide_forward: parameters() now "
                      "yields the wide parameters. Create the optimizer after this call (or call "
                      "prepare_for_compile(sample) first); an optimizer made before raises at its step()",
                      stacklevel=5)  # the caller of wide_forward
    _, inputs = _tower_inputs(router._tower_names, args, kwargs, None, all_towers=True)  # every tower needs one
    _group(router, inputs)


def _ungroup(router: WideRouter) -> None:
    """Write every group back into its originals and make them submodules again."""
    if not router._grouped:
        return
    router.write_back()
    keys = list(router._members)
    _retire(list(router.groups.parameters()), router,
            f"are wide parameters of groups {keys}, which registering or unregistering a tower ungrouped "
            "(the next call groups again, with new wide parameters)")
    for key, names in router._members.items():
        for n in names:
            router._modules[n] = router._originals.pop(n).train(router.groups[key].training)
            _revive(router._modules[n].parameters())
    router.groups = nn.ModuleDict()
    router._members.clear()
    router._templates.clear()
    router._structures.clear()
    router._compiled = {}
    router._grouped = False
