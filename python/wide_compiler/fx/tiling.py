"""The ``tile_members`` pass: the wide graph run on chunks of members (Note [Member tiles]).

Note [Member tiles]
    A wide graph runs all N members at once: every activation holds every member. Where one
    member's activations are large and its ops small (a ResNet-style net with 16-channel convs at
    32x32, batch 8: 512 KB per member and activation), N members' activations outgrow the cores'
    caches and oneDNN's grouped conv with many groups runs slower per member than with a few:
    16 such members ran in 13.4 ms as one graph and in 10.2 ms as four graphs of 4 (inference;
    training 61.8 against 57.1 ms; `WideConfig.fast()`, this machine, 2 cores with 1 MB of L2
    each). A tiled graph runs the graph of k members on each chunk of k consecutive members (the
    last chunk may be smaller): every stacked parameter and buffer and every N-first input is split
    along dim 0 (views; in the backward one concatenation per tensor), and each output of the chunk
    graphs (the buffers' new values, then the N-first outputs) is concatenated along dim 0. Eval
    BatchNorm folds (Note [Folding BatchNorm into the conv], fx/fold.py) are computed once for all
    members and then split, so the fold cache keeps holding. The chunk graphs are widened from the
    same capture and take the N-member graph's strategies node by node: member i computes what it
    computes untiled, by the same kind of kernel. ``summary()``, ``strategies`` and ``report()``
    describe the N-member graph, which stays the graph's description; only the run is tiled.

    Chosen by measurement, never by default: with tuning on (``WideConfig.strategy="auto"``), on
    a CPU, after the model-level check and within what is left of the tuning budget, the
    N-member graph and tiled graphs run on the sample in alternating blocks (forward, plus
    backward for a train graph; buffers restored), and a tiled graph is kept only when it is
    faster than the untiled one by more than ``tune_margin``; the outcome is cached as the
    ops' picks are. The tile sizes tried come from the working set: k members whose largest
    activation fits in the L2 caches of the threads (read from sysfs, 1 MB per core if it cannot
    be read), and 2k; none when that is below 2 members or above N/2 (ResNet-18 at its real
    widths has 2 MB activations per member: nothing is tried, and 16 members as 4 graphs of 4
    measured level with one graph). ``WideConfig(member_tile=k)`` tiles by k without measuring
    (every device), ``member_tile=0`` never tiles.

    Never tiled (logged at debug level; forced tiles log a warning): graphs whose random ops draw
    (members would draw from other positions of the generator's stream than untiled ones), graphs
    with registered wide modules (their tensors are held by a module the graph gets whole), and
    graphs with an output that is not an N-first tensor.
"""

from __future__ import annotations

import functools
import logging
import math
import operator
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

from .. import tuning
from .fold import cached_folded_conv_params
from .model_check import alternating_runs, sample_runs
from .widen import WideGraph

__all__ = ["build_tiled", "chunk_sizes", "tile_candidates", "tile_members"]

log = logging.getLogger(__name__)
aten = torch.ops.aten
_SPLIT = ("parameter", "buffer")  # stacked [N, ...] state; "constant" inputs are shared by all members


def chunk_sizes(n: int, k: int) -> list[int]:
    """The chunk sizes of ``n`` members tiled by ``k``: k, k, ..., then what is left.

    >>> chunk_sizes(16, 4), chunk_sizes(5, 2)
    ([4, 4, 4, 4], [2, 2, 1])
    """
    return [k] * (n // k) + ([n % k] if n % k else [])


@functools.cache
def _l2_bytes() -> int:
    """One core's L2 cache in bytes (sysfs; 1 MB where it cannot be read)."""
    import glob

    for index in sorted(glob.glob("/sys/devices/system/cpu/cpu0/cache/index*")):
        try:
            with open(f"{index}/level") as f:
                level = f.read().strip()
            with open(f"{index}/size") as f:
                size = f.read().strip()
        except OSError:
            continue
        if level == "2" and size[:-1].isdigit():
            return int(size[:-1]) * {"K": 1 << 10, "M": 1 << 20}.get(size[-1], 1)
    return 1 << 20


def _largest_activation(ep: Any) -> int:
    """Bytes of the member program's largest intermediate tensor (sizes at the sample's)."""
    largest = 0
    for node in ep.graph.nodes:
        val = node.meta.get("val")
        if node.op == "call_function" and isinstance(val, torch.Tensor):
            if any(isinstance(s, torch.SymInt) and s.node.hint is None for s in val.shape):
                continue  # a size only the data gives (h[h > 0], nonzero): no sample size (probe 12, P12-3)
            numel = math.prod(int(s.node.hint) if isinstance(s, torch.SymInt) else int(s) for s in val.shape)
            largest = max(largest, numel * val.element_size())
    return largest


def tile_candidates(n: int, activation_bytes: int, cache_bytes: int) -> list[int]:
    """Tile sizes worth measuring: the k members whose largest activation fits in
    ``cache_bytes``, and 2k, each between 2 and n/2.

    >>> tile_candidates(16, 512 << 10, 2 << 20), tile_candidates(16, 2 << 20, 2 << 20)
    ([4, 8], [])
    """
    k = cache_bytes // activation_bytes if activation_bytes > 0 else 0
    return [t for t in (k, 2 * k) if t <= n // 2] if k >= 2 else []


def tileable(wg: WideGraph) -> str | None:
    """Why ``wg`` cannot be tiled, or None."""
    if wg.random_ops:
        return f"its random ops draw ({', '.join(sorted(wg.random_ops))})"
    if any(i.kind == "root" for i in wg.inputs):
        return "it runs registered wide modules"
    out = next(iter(wg.graph_module.graph.find_nodes(op="output")))
    if not all(isinstance(o, fx.Node) for o in out.args[0]):
        return "an output is not an N-first tensor"
    return None


def _is_fold(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is cached_folded_conv_params and all(
        not isinstance(a, fx.Node) or a.op == "placeholder" for a in node.args)


def build_tiled(full: WideGraph, chunks: Sequence[tuple[int, WideGraph]]) -> fx.GraphModule:
    """The graph module running ``full``'s inputs through ``chunks`` ((members, graph of that
    many members) in member order; Note [Member tiles]): same inputs, same outputs."""
    sizes = [k for k, _ in chunks]
    g = fx.Graph()
    inputs: dict[str, fx.Node] = {}
    splits: dict[str, fx.Node] = {}
    for inp in full.inputs:
        node = inputs[inp.node.name] = g.placeholder(inp.node.name)
        node.meta.update(inp.node.meta)
        if inp.kind in _SPLIT or (inp.kind == "user" and isinstance(inp.node.meta.get("val"), torch.Tensor)):
            splits[inp.node.name] = g.call_function(aten.split_with_sizes.default, (node, sizes))
    # Folds on all members, split once (Note [The fold cache] keys on the whole tensors).
    folds: dict[str, list[fx.Node]] = {}  # fold node name -> its outputs, split
    for node in chunks[0][1].graph_module.graph.nodes:
        if _is_fold(node):
            whole = g.call_function(node.target, tuple(inputs[a.name] if isinstance(a, fx.Node) else a
                                                        for a in node.args))
            folds[node.name] = [g.call_function(aten.split_with_sizes.default,
                                                (g.call_function(operator.getitem, (whole, i)), sizes))
                                for i in range(2)]
    outputs: list[list[fx.Node]] = []
    for c, (_, wg) in enumerate(chunks):
        env: dict[fx.Node, fx.Node] = {}
        for node in wg.graph_module.graph.nodes:
            if node.op == "placeholder":
                split = splits.get(node.name)
                env[node] = inputs[node.name] if split is None else g.call_function(operator.getitem, (split, c))
            elif node.op == "output":
                outputs.append([env[o] for o in node.args[0]])
            elif node.name in folds:
                continue
            elif node.target is operator.getitem and node.args[0].name in folds:
                env[node] = g.call_function(operator.getitem, (folds[node.args[0].name][node.args[1]], c))
            else:
                env[node] = g.node_copy(node, lambda a: env[a])
    g.output(tuple(g.call_function(aten.cat.default, (list(outs), 0)) for outs in zip(*outputs)))
    g.eliminate_dead_code()  # the splits of tensors read only by the folds
    g.lint()
    return fx.GraphModule(torch.nn.Module(), g, class_name="TiledWideGraph")


def apply_tile(c: Any, k: int, chunk_graph: Callable[[int], WideGraph], *, level: int = logging.WARNING) -> bool:
    """Tile ``c.wide`` by ``k`` members (``chunk_graph(m)``: the graph of m members); a tile that
    cannot be built leaves the graph untiled, logged at ``level``."""
    try:
        graphs = {m: chunk_graph(m) for m in set(chunk_sizes(c.n, k))}
        c.wide.tiled = build_tiled(c.wide, [(m, graphs[m]) for m in chunk_sizes(c.n, k)])
    except Exception as e:  # noqa: BLE001 -- the untiled graph is exact: run that instead
        log.log(level, "wide_compiler: the %s graph runs untiled: tiles of %d members could not be built (%s: %s)",
                "train" if c.training else "eval", k, type(e).__name__, e)
        return False
    c.wide.member_tile = k
    return True


def tile_members(c: Any, chunk_graph: Callable[[int], WideGraph]) -> None:
    """Note [Member tiles]: tile ``c.wide`` when forced (``c.member_tile`` from an earlier graph
    of the model, else ``config.member_tile``) or when measured faster."""
    forced = c.member_tile if c.member_tile is not None else c.config.member_tile
    why = tileable(c.wide)
    if forced is not None:
        if forced == 0 or forced >= c.n:
            return
        if why is not None:
            log.warning("wide_compiler: member_tile=%d: the %s graph is not tiled: %s", forced,
                        "train" if c.training else "eval", why)
            return
        apply_tile(c, forced, chunk_graph)
        return
    budget = c.wide.graph_module.meta.get("wide_tuning")
    if (not c.config.tune or c.config.strategy != "auto" or c.state is None or why is not None
            or c.device is not None and c.device.type != "cpu"):
        if why is not None:
            log.debug("wide_compiler: member tiles not tried: %s", why)
        return
    sizes = tile_candidates(c.n, _largest_activation(c.ep), _l2_bytes() * torch.get_num_threads())
    if not sizes:
        return
    key = tuning.cache_key("member_tile", train=c.training, n=c.n, sizes=sizes,
                           ops=[[node.meta.get("wide_tune_key"), node.kwargs.get("strategy")]
                                for node in c.wide.graph_module.graph.nodes if "wide_tune" in node.meta])
    hit = tuning.lookup(key, c.config)
    cached = hit["strategy"] if hit is not None else ""
    if cached.isdigit() and (int(cached) == 0 or int(cached) in sizes):
        pick = int(cached) if int(cached) and apply_tile(c, int(cached), chunk_graph) else 0
        _describe(budget, pick, hit.get("timings_ms") or {}, cached=True)
        return
    if budget is not None and budget.exhausted():
        return
    tiled = {k: c.wide.tiled for k in sizes if apply_tile(c, k, chunk_graph, level=logging.DEBUG)}
    c.wide.tiled, c.wide.member_tile = None, 0
    if not tiled:
        return

    def use(k: int) -> None:
        c.wide.tiled, c.wide.member_tile = tiled.get(k), k

    try:
        with sample_runs(c) as run:
            times, _ = alternating_runs(c, run, [0, *tiled], use, budget)
    except Exception as e:  # noqa: BLE001 -- a check of speed never fails a compile
        log.debug("wide_compiler: member tiles not kept (%s: %s)", type(e).__name__, getattr(e, "error", e))
        use(0)
        return
    if not all(len(v) >= 2 for v in times.values()):
        use(0)
        return
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    best = min(tiled, key=ms.__getitem__)
    pick = best if ms[best] < ms[0] * (1 - c.config.tune_margin) else 0
    use(pick)
    tuning.remember(key, {"strategy": str(pick), "timings_ms": {str(k): v for k, v in ms.items()}}, c.config)
    _describe(budget, pick, ms, cached=False)


def _describe(budget: Any, pick: int, ms: dict, *, cached: bool) -> None:
    """Log the outcome and put it on the budget's line of ``summary()``."""
    times = ", ".join(f"{'untiled' if str(k) == '0' else f'by {k}'} {v:.3f} ms" for k, v in ms.items())
    text = (f"member tiles{' (cached)' if cached else ''}: "
            f"{f'chunks of {pick} members' if pick else 'untiled'} ({times})")
    log.info("wide_compiler: %s", text)
    if budget is not None:
        budget.tiles = text
