"""The ``check_tuning`` pass: the model-level tuning check (Note [Model-level tuning check]).

It runs after ``strategies`` on the graph and the wide state of the compilation (``c.state``:
stacked by ``stack_state`` at the first compile, the model's live tensors when it compiles its
other train/eval mode), through :func:`~wide_compiler.fx.state.call_graph`, the function the
model's forward calls too.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from .. import measure, tuning
from .state import call_graph, holders, missing_constants, put_tensor, state_module

__all__ = ["alternating_runs", "check_tuning", "sample_runs"]

# The check's records keep the logger they always had (the check ran in the model before it was
# a pass): filters and tests select "wide_compiler.model".
log = logging.getLogger("wide_compiler.model")


def check_tuning(c: Any) -> None:
    """Note [Model-level tuning check]: each op's strategy is measured alone, on contiguous
    random inputs; in the model an op meets other layouts and caches (an eval graph keeps its
    activations channels-last, Note [Channels-last max pooling]). When tuning changed any
    strategy, the whole graph runs on the sample (N-first copies; forward, plus backward for
    a train graph) with the tuned and with the default strategies, in alternating blocks of
    calls (the first of each block warms up; medians; up to three rounds of a block per set,
    fewer once the two sets' runs are clearly apart, ``tuning.clearly_apart``), and the
    defaults are kept unless the tuned graph is faster by more than ``tune_margin``: this
    check has the final word. Its outcome is cached with the ops' picks (a later compile of
    the same graph decides the same without running it) and is bounded by what is left of
    ``tune_budget_s``: with nothing left, or cut short before the runs made were clearly
    apart (too few to trust), the defaults are kept and nothing is cached, so only a check
    that saw a clear difference or ran to the end can keep tuned strategies. Buffers are
    restored and no ``.grad`` is written; a sample the graph cannot run keeps the tuned
    choices (logged at debug level). Each changed op's ``summary()`` reason says what the
    check decided. The graph runs on ``c.state`` (and the constants it reads), under a
    stand-in module (:func:`~wide_compiler.fx.state.state_module`); run_pipeline has grad mode
    on, so a train graph's runs have their backward whatever the caller's mode."""
    gm = c.wide.graph_module
    nodes = [node for node in gm.graph.nodes if "wide_tune" in node.meta]
    tuned = {node: node.kwargs.get("strategy") for node in nodes}
    default = {node: node.meta["wide_tune"].default for node in nodes}
    budget = gm.meta.get("wide_tuning")
    if not c.config.tune or c.config.strategy != "auto" or tuned == default:
        if budget is not None and nodes:
            budget.finish("model-level check: not needed (every op kept its default)")
        return
    margin = c.config.tune_margin

    def use(strategies: dict) -> None:
        for node, name in strategies.items():
            node.update_kwarg("strategy", name)
        gm.recompile()

    def decide(keep: bool, outcome: str) -> None:
        use(tuned if keep else default)
        brief = outcome.split(" (")[0].replace(" ms vs defaults ", " vs ")  # the header has it all
        for node in nodes:
            if tuned[node] == default[node]:
                continue
            alone = node.meta.get("wide_strategy_reason", "")
            node.meta["wide_strategy_reason"] = (
                f"{alone}; model-level check kept it ({brief})" if keep else
                f"model-level check kept the default ({brief}); alone: {alone}")
        if budget is not None:
            budget.finish(f"model-level check: {outcome}, kept the {'tuned set' if keep else 'defaults'}")
        log.info("wide_compiler: %s graph: model-level check: %s: keeping the %s",
                 "train" if c.training else "eval", outcome, "tuned strategies" if keep else "defaults")

    def compare(t_tuned: float, t_default: float) -> tuple[bool, str]:
        keep = t_tuned < t_default * (1 - margin)
        return keep, (f"tuned set {t_tuned:.3f} ms vs defaults {t_default:.3f} ms, "
                      f"{t_tuned / max(t_default, 1e-12):.0%} of the defaults' time "
                      f"({'<' if keep else 'not <'} {1 - margin:.0%} needed)")

    key = tuning.cache_key("model_check", train=c.training, n=c.n,
                           ops=[[node.meta.get("wide_tune_key"), tuned[node]] for node in nodes])
    hit = tuning.lookup(key, c.config)
    ms = (hit or {}).get("timings_ms") or {}
    if hit is not None and hit["strategy"] in ("tuned", "default") and {"tuned", "default"} <= set(ms):
        decide(hit["strategy"] == "tuned", "cached: " + compare(ms["tuned"], ms["default"])[1])
        return
    if budget is not None and budget.not_measured is not None:  # Note [Tuning that pays for itself]
        if not budget.check_fits():
            decide(False, "not run: the graph is too slow to check in the tuning budget")
            return
        budget.checking = True  # cached picks: checked within the budget, though no op was measured
    if budget is not None and budget.exhausted():
        decide(False, "skipped: tuning budget exhausted")
        return

    sets = {"tuned": tuned, "default": default}
    try:
        with sample_runs(c) as run:
            times, complete = alternating_runs(c, run, list(sets), lambda label: use(sets[label]), budget)
    except Exception as e:  # noqa: BLE001 -- a check of speed never fails a compile
        if isinstance(e, measure.TimingError):
            e = e.error
        log.debug("wide_compiler: model-level tuning check skipped (%s: %s)", type(e).__name__, e)
        use(tuned)
        if budget is not None:
            budget.finish(f"model-level check skipped (the sample does not run: {type(e).__name__}), "
                          "kept the tuned set")
        return
    # Cut short by the budget: too few runs to trust on a machine this busy, unless the runs
    # made are clearly apart; else the defaults, not cached.
    if not complete and tuning.clearly_apart(times, margin) is None:
        ran = f"{len(times['tuned'])} tuned and {len(times['default'])} default runs"
        decide(False, f"cut short by the tuning budget after {ran}")
        return
    t_tuned, t_default = (1e3 * statistics.median(times[label]) for label in ("tuned", "default"))
    keep, outcome = compare(t_tuned, t_default)
    tuning.remember(key, {"strategy": "tuned" if keep else "default",
                          "timings_ms": {"tuned": t_tuned, "default": t_default}}, c.config)
    decide(keep, outcome)


@contextlib.contextmanager
def sample_runs(c: Any) -> Iterator[Callable[[], None]]:
    """A run of ``c.wide`` on the sample (N-first copies) and ``c.state`` (with the constants
    the graph reads, under a stand-in module): forward, plus backward for a train graph (no
    ``.grad`` written); CUDA synchronised. The buffers the runs change are restored on exit."""
    root = state_module(c.state)
    # the capture's constants, or those a compile-cache entry came with
    captured = c.ep if c.ep is not None else c.cached
    for name, t, persistent, _ in missing_constants(captured, c.constant_plan, root):
        put_tensor(root, name, t, persistent)
    wide_sample = tree_map(lambda a: a.unsqueeze(0).expand(c.n, *a.shape).clone()
                           if isinstance(a, torch.Tensor) else a, c.sample)
    params = [p for p in root.parameters() if p.requires_grad]
    saved = {name: b.clone() for name, b in root.named_buffers()}
    cuda = any(p.is_cuda for p in root.parameters())
    plan: list = []  # the graph's holders under root, made at the first run (a failure there skips the check)

    def run() -> None:
        if not plan:
            plan.extend(holders(root, c.wide))
        flat, spec = tree_flatten(wide_sample)
        if spec != c.wide.in_spec:
            raise ValueError("wide_compiler: the sample is not nested as the captured inputs")
        with torch.set_grad_enabled(c.training):
            out = call_graph(c.wide, root, plan, flat)
            loss = [o.float().sum() for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
            if loss and params:
                torch.autograd.grad(sum(loss), params, allow_unused=True)
        if cuda:
            torch.cuda.synchronize()

    try:
        yield run
    finally:
        with torch.no_grad():
            for name, b in root.named_buffers():
                b.copy_(saved[name])


def alternating_runs(c: Any, run: Callable[[], None], labels: list, setup: Callable[[Any], None],
                     budget: tuning.Budget | None) -> tuple[dict[Any, list[float]], bool]:
    """Seconds per ``run`` for each of ``labels`` (``setup(label)`` first), and whether the runs
    went to their end: up to 3 rounds of one block per label, the order alternating; the first
    call of a block warms up (it pays the switch). After a round the runs end once one label is
    clearly apart (``tuning.clearly_apart`` by ``tune_margin``). The budget is asked after every
    run, so it overruns by one run at most."""
    times: dict[Any, list[float]] = {label: [] for label in labels}
    complete = True
    for k in range(3):
        order = labels[::-1] if k % 2 else labels
        rounds = measure.interleave({label: run for label in order}, 1, block_warmup=1,
                                    per_block=max(2, c.config.tune_repeats // 2), setup=setup,
                                    stop=lambda: budget is not None and budget.exhausted())
        for label, samples in rounds.samples.items():
            times[label] += samples
        complete = rounds.complete
        if not complete or tuning.clearly_apart(times, c.config.tune_margin) is not None:
            break
    return times, complete
