"""Towers of one program up to sizes (a width sweep), with ``WideRouter(pad=True)``: grouping
compiles them both as one padded wide model and as a wide model per size, times both on the
sample inputs and keeps the faster."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ..api import compile as _wide_compile
from ..errors import ArchitectureMismatchError, UnsupportedOperationError
from ..fx.padding import pad_members
from ..measure import time_interleaved
from ..model import WideModel
from .inputs import _signature, _stack
from .sharing import _check_not_shared

if TYPE_CHECKING:
    from .core import WideRouter

__all__: list[str] = []

log = logging.getLogger("wide_compiler.router")  # the package's one logger, as before the split


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


def _pad_partition(router: WideRouter, partition: list[list[str]], inputs: dict[str, tuple],
                   built: dict[tuple[str, ...], WideModel]) -> list[list[str]]:
    """With ``pad``: the groups of ``partition`` of one program up to sizes become one padded group where that
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
                pad_members([router._tower(a), router._tower(b)], *inputs[a])
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
            _check_not_shared(router, names)
            padded = _wide_compile([router._tower(n) for n in names], args, sample_kwargs=kwargs,
                                   config=router._config, pad=True, **router._compile_options)
        except Exception as e:  # noqa: BLE001 -- padding refused: groups by size, and we say why
            router.pad_decisions[tuple(names)] = f"by size (padding refused: {str(e).splitlines()[0]})"
            out += cluster
            continue
        if router._pad_sizes == "always":  # a grouping that does not depend on timings
            router.pad_decisions[tuple(names)] = "padded (pad='always': not measured)"
            built[tuple(names)] = padded
            out.append(names)
            continue
        for group in cluster:
            if len(group) > 1:
                built[tuple(group)] = _wide_compile([router._tower(n) for n in group], args, sample_kwargs=kwargs,
                                                    config=router._config, **router._compile_options)

        train = router.training and torch.is_grad_enabled()

        def run(groups: list[tuple[list[str], Any]]) -> None:
            """One call of every group: a forward, and in training a backward too (timed as used)."""
            with torch.set_grad_enabled(train):
                outs = []
                for members, wide in groups:
                    if isinstance(wide, nn.Module) and len(members) > 1:
                        a, k = _stack([inputs[n] for n in members], members)
                        outs.append(wide(*a, **k))
                    else:
                        outs.append(router._tower(members[0])(*inputs[members[0]][0], **inputs[members[0]][1]))
                leaves = [t for t in tree_flatten(outs)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
                if train and leaves:
                    torch.autograd.backward([t.sum() for t in leaves])

        by_size = [(g, built.get(tuple(g))) for g in cluster]
        timed = [padded, *(w for _, w in by_size if isinstance(w, nn.Module)),
                 *(router._tower(g[0]) for g in cluster if len(g) == 1)]
        with _untouched(timed):  # the timing's calls change no buffer, gradient or RNG state
            ms = time_interleaved({"padded": lambda: run([(names, padded)]), "by_size": lambda: run(by_size)},
                                  min_run_time=0.1)
        chosen = "padded" if ms["padded"] <= ms["by_size"] else "by size"
        router.pad_decisions[tuple(names)] = (
            f"{chosen}: one padded model {ms['padded']:.3f} ms, a model per size {ms['by_size']:.3f} ms per "
            f"{'training step' if train else 'call'} (measured at grouping)")
        log.info("WideRouter: towers %s of one program up to sizes: %s", names, router.pad_decisions[tuple(names)])
        if chosen == "padded":
            built[tuple(names)] = padded
            out.append(names)
        else:
            out += cluster
    return out
