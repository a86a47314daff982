"""``wide_compiler.analyze``: what fusing N members of YOUR model buys, measured on this machine.

One call compiles the model for each requested N and reports, in one :class:`AnalysisReport`:

1. the compile result: every wide op with its strategy (eval and train graphs), every op that
   runs through the per-member fallback with its source line and a fix to try, and the layout
   conversions the plan keeps (the data of :meth:`WideModel.summary` / :meth:`~WideModel.report` /
   :attr:`~WideModel.fallbacks`);
2. the measured time of one step of the wide model, of the loop over the N members and of
   ``torch.func`` ensembling (vmap), for inference (forward under ``no_grad``, ``eval()``) and
   one training step (forward + backward of every parameter, ``train()``): medians over
   ``repeats`` interleaved blocks (contenders alternate, so load on the machine hits them alike),
   with throughput per member and in all;
3. where the time goes: ``torch.profiler`` self CPU time grouped by op, wide model beside loop;
4. memory: parameters, gradients and an Adam state estimate (2x parameters) per member, the
   activation memory per member MEASURED as the bytes of the tensors autograd saves during one
   training forward (``torch.autograd.graph.saved_tensors_hooks``) at a few small N, and the
   largest N whose extrapolated training footprint fits a budget (doubling then bisection on
   the linear fit; nothing near the budget is ever allocated);
5. recommendations ranked by measured effect.

The report's class, its text/Markdown/JSON forms and its plot are in
:mod:`wide_compiler.analyze_report`.

Example::

    >>> import wide_compiler as wc
    >>> from wide_compiler import zoo
    >>> from wide_compiler.analyze import analyze
    >>> r = analyze(lambda: zoo.MLP(16, 32, 4), torch.randn(8, 16), n=(2, 4), repeats=3,
    ...             memory="200MB")                                         # doctest: +SKIP
    >>> print(r)                                                            # doctest: +SKIP
    >>> r.to_json(), r.to_markdown()                                        # doctest: +SKIP
"""
from __future__ import annotations

import copy
import importlib.util
import logging
import math
import re
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import measure
from .analyze_report import _pyplot, _speedup_figure  # noqa: F401  (re-exported: older imports)
from .analyze_report import AnalysisReport, _fmt_bytes, plot

__all__ = ["AnalysisReport", "analyze", "available_memory", "load_factory", "parse_bytes", "plot"]

log = logging.getLogger(__name__)

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: float | str) -> int:
    """``8GB`` (10^9), ``8GiB`` (2^30), ``512MB``, ``1.5e9`` or an int -> bytes.

    >>> parse_bytes("200MB"), parse_bytes("1GiB"), parse_bytes(1000)
    (200000000, 1073741824, 1000)
    """
    if isinstance(value, (int, float)):
        return int(value)
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"wide_compiler.analyze: memory budget {value!r}: expected bytes or a size "
                         f"like '8GB', '512MiB'")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def load_factory(spec: str) -> Callable[[], nn.Module]:
    """``"path/to/file.py:make_model"`` -> the zero-argument callable ``make_model`` of that file
    (an ``nn.Module`` class works too). The file is imported as a fresh module.

    >>> load_factory("no_colon")
    Traceback (most recent call last):
    ...
    ValueError: wide_compiler.analyze: expected 'path/to/file.py:factory', got 'no_colon'
    """
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise ValueError(f"wide_compiler.analyze: expected 'path/to/file.py:factory', got {spec!r}")
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"wide_compiler.analyze: {spec!r}: no file {str(file)!r}")
    module = _import_file(file)
    if not hasattr(module, name):
        raise AttributeError(f"wide_compiler.analyze: {str(file)!r} has no {name!r} "
                             f"(found: {sorted(k for k in vars(module) if not k.startswith('_'))})")
    factory = getattr(module, name)
    if not callable(factory):
        raise TypeError(f"wide_compiler.analyze: {spec!r} is a {type(factory).__name__}, expected "
                        "a zero-argument callable returning an nn.Module")
    return factory


def _import_file(file: Path) -> Any:
    """The Python file ``file`` imported as a fresh module (not added to ``sys.modules``)."""
    mod_spec = importlib.util.spec_from_file_location(f"_wc_analyze_{file.stem}", file)
    if mod_spec is None or mod_spec.loader is None:
        raise ImportError(f"wide_compiler.analyze: cannot import {str(file)!r}")
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------- analysis

def _make_members(model_or_factory: nn.Module | Callable[[], nn.Module], n: int) -> list[nn.Module]:
    if isinstance(model_or_factory, nn.Module):
        from .api import _reinitialised_copies

        return _reinitialised_copies(model_or_factory, n)
    if not callable(model_or_factory):
        raise TypeError(f"wide_compiler.analyze: expected an nn.Module or a zero-argument callable "
                        f"returning one, got {type(model_or_factory).__name__}")
    members = [model_or_factory() for _ in range(n)]
    if not isinstance(members[0], nn.Module):
        raise TypeError(f"wide_compiler.analyze: the factory returned a {type(members[0]).__name__}, "
                        "expected an nn.Module")
    return members


def _wide_inputs(sample: tuple, n: int, seed: int = 0, kwargs: dict[str, Any] | None = None
                 ) -> measure.CallInputs:
    """N-first ``(args, kwargs)``: member i gets its own random copy of a float input (integer
    and bool inputs, indices and masks, are repeated)."""
    g = torch.Generator().manual_seed(seed)

    def widen(a: Any) -> Any:
        if not isinstance(a, torch.Tensor):
            return a
        x = a.unsqueeze(0).expand(n, *a.shape).clone()
        if x.is_floating_point():
            std = a.float().std().clamp_min(1e-3) if a.numel() > 1 else torch.tensor(1.0)
            x = (torch.randn(x.shape, generator=g, device=g.device).to(x.device) * std + a.float().mean()).to(x.dtype)
        return x

    return measure.CallInputs(tuple(widen(a) for a in sample), {k: widen(v) for k, v in (kwargs or {}).items()})


def _contenders(wide: nn.Module, members: Sequence[nn.Module]) -> dict[str, measure.Contender]:
    """wide, loop and vmap (torch.func, each member its own randomness) over the N-first
    :class:`~wide_compiler.measure.CallInputs`."""
    return {"wide": measure.wide_contender("wide", wide, members[0]),
            "loop": measure.loop_contender(members),
            "vmap": measure.vmap_contender(members, randomness="different")}


def _interleaved(steps: dict[str, Callable[[], Any]], repeats: int, block_s: float
                 ) -> tuple[dict[str, float], dict[str, str]]:
    """Median ms per call of each step over ``repeats`` blocks of about ``block_s`` seconds, the
    steps taking turns (:func:`wide_compiler.measure.time_interleaved`). A step that raises is
    left out; its message is returned."""
    errors: dict[str, str] = {}
    ms = measure.time_interleaved(steps, min_run_time=block_s * repeats, rounds=repeats, warmup=3,
                                  min_rounds=repeats, errors=errors)
    return ms, errors


def _profile(step: Callable[[], Any], calls: int, top: int, rounds: int = 3) -> list[dict[str, Any]]:
    """Self CPU time per op (``torch.profiler``, grouped by op name), per step: the quietest of
    ``rounds`` profiled runs of ``calls`` steps (a busy machine spoils single runs)."""
    import os

    from torch.profiler import ProfilerActivity, profile

    # Note [Profiler noise]: kineto, torch.profiler's back end, writes a `USDT: ... profiler_start`
    # and a `profiler_stop` line to stderr at every profile (24 in one analyze run) at its default
    # log level. KINETO_LOG_LEVEL, read once when the profiler first starts in a process, sets the
    # least level shown: VERBOSE 0, INFO 1, WARNING 2, STAGE 3, ERROR 4, USDT 5; 6 shows none
    # (no level keeps errors without the USDT lines; the profile's own events say what it
    # recorded). A level the user set is kept.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    step()
    best = None
    for _ in range(rounds):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(calls):
                step()
        events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
        total = sum(e.self_cpu_time_total for e in events) or 1.0
        if best is None or total < best[0]:
            best = (total, events)
    total, events = best
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    return [{"op": e.key, "ms": e.self_cpu_time_total / 1e3 / calls, "calls": e.count / calls,
             "pct": 100.0 * e.self_cpu_time_total / total} for e in events[:top]]


def _storage_key(t: torch.Tensor) -> tuple[int, int] | None:
    try:
        s = t.untyped_storage()
        return s.data_ptr(), s.nbytes()
    except Exception:  # noqa: BLE001 -- sparse, nested, fake...: not counted
        return None


def _saved_bytes(wide: nn.Module, xs: tuple) -> int:
    """Bytes of the distinct storages autograd saves in one training forward (parameters and
    buffers excluded: counted apart), plus the outputs."""
    own = {k[0] for t in list(wide.parameters()) + list(wide.buffers()) if (k := _storage_key(t))}
    seen: dict[int, int] = {}

    def pack(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            k = _storage_key(t)
            if k and k[0] not in own:
                seen[k[0]] = max(seen.get(k[0], 0), k[1])
        return t

    wide.train()
    saved = {name: b.clone() for name, b in wide.named_buffers()}
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = wide(*xs[0], **xs[1])
        for o in torch.utils._pytree.tree_leaves(out):
            if isinstance(o, torch.Tensor) and (k := _storage_key(o)):
                seen[k[0]] = max(seen.get(k[0], 0), k[1])
        del out
    finally:
        with torch.no_grad():
            for name, b in wide.named_buffers():
                b.copy_(saved[name])
    return sum(seen.values())


def _fix_for(fb: dict[str, str]) -> str:
    op = fb["op"]
    if fb.get("how") == "loop":
        return (f"{op} runs as a Python loop over members (vmap cannot run it): register a wide form "
                f"of the module that calls it with @wc.register, or rewrite it with ops that have one")
    return (f"no widen rule for {op}: strict=False runs it per member through torch.vmap; register a "
            f"wide form of the module that calls it with @wc.register (or open an issue for a rule)")


def _compile_info(wide: Any, compile_s: float, modes: Sequence[str]) -> dict[str, Any]:
    from .fx.capture import module_path

    graphs = [("eval" if m == "inference" else "train") for m in modes]
    # One row per op of the model: a row is (module, wide op, k-th such call in the graph), not a
    # node name, which differs between the graphs where a rewrite renames it (the eval graph's
    # add + layer_norm is one `add_layer_norm` node, the train graph's `layer_norm`).
    ops: dict[tuple[str, str, int], dict[str, Any]] = {}
    fallbacks, conversions = [], []
    was_training = wide.training
    for g in graphs:
        wg = wide._graph_for(g == "train")
        seen: dict[tuple[str, str], int] = {}
        for node in wg.graph_module.graph.nodes:
            if node.meta.get("wide_layout_conversion"):
                conversions.append({"graph": g, "node": node.name, "what": str(node.meta["wide_layout_conversion"])})
            if "wide_op" not in node.meta:
                continue
            shapes = node.meta.get("wide_shapes", {})
            module, op = module_path(node), node.meta["wide_op"]
            k = seen[module, op] = seen.get((module, op), -1) + 1
            row = ops.setdefault((module, op, k), {"node": node.name, "module": module, "op": op, "strategy": {},
                                                   "input": "-", "weight": "-"})
            if node.name not in row["node"].split(" / "):
                row["node"] += f" / {node.name}"
            for key in ("input", "weight"):
                if row[key] == "-" and key in shapes:
                    row[key] = str(shapes[key])
            row["strategy"][g] = str(node.kwargs.get("strategy", "-"))
        for fb in wg.fallbacks:
            fallbacks.append(dict(fb, graph=g, fix=_fix_for(fb)))
    wide.train(was_training)
    return {"n": wide.n, "graphs": graphs, "compile_s": compile_s, "wide_ops": list(ops.values()),
            "fallbacks": fallbacks, "layout_conversions": conversions,
            "params_per_member": sum(p.numel() for p in wide.parameters()) // wide.n,
            "summary": wide.summary()}


def _max_n(fixed: float, per_member: float, budget: float, cap: int = 2**40) -> tuple[int, list[int]]:
    """Largest N with ``fixed + N * per_member <= budget``: N doubles while the estimate fits,
    then bisection; returns (N, the Ns tried). 0 if not even one member fits."""
    fits = lambda n: fixed + n * per_member <= budget
    tried = [1]
    if not fits(1):
        return 0, tried
    lo = 1
    while lo < cap and fits(lo * 2):
        lo *= 2
        tried.append(lo)
    hi = min(lo * 2, cap + 1)
    tried.append(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        tried.append(mid)
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, tried


def _slope(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares line through (n, bytes): (intercept, slope)."""
    if len(points) == 1:
        return 0.0, points[0][1] / points[0][0]
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return max(0.0, my - slope * mx), max(0.0, slope)


def analyze(model_or_factory: nn.Module | Callable[[], nn.Module], sample: torch.Tensor | tuple,
            n: int | Sequence[int] = (4, 16), *, sample_kwargs: dict[str, Any] | None = None,
            memory: int | str | None = None, modes: Sequence[str] = ("inference", "train"),
            repeats: int = 7, block_s: float = 0.02, config: Any = None, profile_top: int = 8,
            memory_ns: Sequence[int] = (1, 2, 4), seed: int = 0,
            progress: Callable[[str, int, int], None] | None = None) -> AnalysisReport:
    """Compile, time, profile and size a population of ``model_or_factory`` on this machine.

    Args:
        model_or_factory: an ``nn.Module`` (members are copies re-initialised with
            ``reset_parameters()``, as ``wc.compile(model, sample, n=K)`` makes them) or a
            zero-argument callable returning a fresh member.
        sample: ONE member's input (a tensor or a tuple of positional inputs).
        n: the population sizes to measure.
        sample_kwargs: ONE member's keyword inputs (e.g. ``{"attention_mask": mask}``).
        memory: the budget for the largest-N search: bytes or a string ``"8GB"`` / ``"512MiB"``;
            default: MemAvailable of /proc/meminfo.
        modes: ``"inference"`` (forward under ``no_grad``, ``eval()``) and/or ``"train"``
            (forward + backward of every parameter, ``train()``).
        repeats: interleaved timing blocks per contender (medians are reported).
        block_s: target seconds per timing block.
        config: the :class:`~wide_compiler.WideConfig` (default ``WideConfig.fast()``: the
            heuristic strategies, no tuning at compile time).
        profile_top: rows of the per-op profile.
        memory_ns: the small Ns at which activation memory is measured.
        progress: called as ``progress(stage, done, total)`` when each stage starts (``done``
            stages of ``total`` finished; a stage is a compile, one N and mode timed, one profile
            or one memory measurement) and as ``progress("done", total, total)`` at the end: the
            CLI draws its progress bar with it.

    Example:
        >>> import torch
        >>> from wide_compiler import zoo
        >>> r = analyze(lambda: zoo.MLP(16, 32, 4), torch.randn(8, 16), n=(2,), repeats=2,
        ...             modes=("inference",), memory="100MB")
        >>> r.speed[0]["ms"]["wide"] > 0 and r.memory["max_n_train"] >= 1
        True
    """
    from .api import compile as wide_compile
    from .config import WideConfig

    ns = sorted({int(k) for k in ([n] if isinstance(n, int) else n)})
    if not ns or ns[0] < 1:
        raise ValueError(f"wide_compiler.analyze: expected N >= 1, got n={n!r}")
    modes = list(modes)
    bad = [m for m in modes if m not in measure.MODES]
    if bad or not modes:
        raise ValueError(f"wide_compiler.analyze: modes must be among {measure.MODES}, got {modes}")
    if repeats < 1:
        raise ValueError(f"wide_compiler.analyze: expected repeats >= 1, got {repeats}")
    config = config or WideConfig.fast()
    sample_t = sample if isinstance(sample, tuple) else (sample,)
    sample_kw = dict(sample_kwargs or {})
    tensors = [a for a in [*sample_t, *sample_kw.values()] if isinstance(a, torch.Tensor)]
    batch = tensors[0].shape[0] if tensors and tensors[0].dim() else 1
    machine = measure.machine_info()

    torch.manual_seed(seed)
    mem_ns = sorted({int(k) for k in memory_ns if k >= 1} or {1})
    stages = {"done": 0, "total": 1 + len(ns) * len(modes) + len(modes) + len(mem_ns)}

    def stage(what: str) -> None:
        if progress is not None:
            progress(what, stages["done"], stages["total"])
        stages["done"] += 1

    members_all = _make_members(model_or_factory, max(ns + mem_ns))
    initial = [copy.deepcopy(m.state_dict()) for m in members_all]
    model_name = type(members_all[0]).__name__
    start_mode = members_all[0].training
    wides: dict[int, Any] = {}
    compile_s: dict[int, float] = {}

    def wide_for(k: int) -> Any:
        if k not in wides:
            for m in reset(k):  # one mode and the initial state for all (earlier runs change both)
                m.train(start_mode)
            sw = measure.Stopwatch()
            wides[k] = wide_compile(members_all[:k], sample_t, config=config, sample_kwargs=sample_kw or None)
            compile_s[k] = sw.seconds
        return wides[k]

    def reset(k: int) -> list[nn.Module]:
        members = members_all[:k]
        for m, sd in zip(members, initial):
            m.load_state_dict(sd)
        return members

    # 1. compile result (largest N)
    stage(f"compile N={ns[-1]}")
    compile_info = _compile_info(wide_for(ns[-1]), 0.0, modes)
    compile_info["compile_s"] = compile_s[ns[-1]]

    log.info("wide_compiler.analyze: %s compiled for N=%d in %.2f s", model_name, ns[-1], compile_s[ns[-1]])

    # 2. speed
    speed: list[dict[str, Any]] = []
    steps_at_max: dict[str, dict[str, Callable]] = {}
    for k in ns:
        for mode in modes:
            stage(f"time N={k} {mode}")
            wide = wide_for(k)
            xs = _wide_inputs(sample_t, k, seed, sample_kw)
            training = mode == "train"
            members = [m.train(training) for m in reset(k)]
            wide.train(training)
            contenders = _contenders(wide, members)
            steps = {name: measure.make_step(c, xs, mode) for name, c in contenders.items()}
            err = math.nan
            if not training:
                try:
                    err = measure.max_abs_err(contenders["loop"], steps["loop"](), contenders["wide"],
                                             steps["wide"](), k, mode)
                except Exception as e:  # noqa: BLE001 -- reported, never fatal
                    log.warning("wide_compiler.analyze: comparing wide with the loop failed: %s", e)
            log.info("wide_compiler.analyze: timing N=%d %s (%d interleaved repeats)", k, mode, repeats)
            ms, errors = _interleaved(steps, repeats, block_s)
            if "wide" not in ms:
                raise RuntimeError(f"wide_compiler.analyze: the wide model failed in {mode} mode at N={k}: "
                                   f"{errors.get('wide')}")
            speed.append({
                "n": k, "mode": mode, "batch": batch, "ms": ms, "errors": errors,
                "speedup": {b: ms[b] / ms["wide"] for b in ("loop", "vmap") if b in ms},
                "samples_per_s_per_member": {c: batch / (t / 1e3) for c, t in ms.items()},
                "samples_per_s": {c: k * batch / (t / 1e3) for c, t in ms.items()},
                "max_abs_err_vs_loop": err,
            })
            if k == ns[-1]:
                steps_at_max[mode] = steps

    # 3. profile at the largest N
    runs = []
    for mode, steps in steps_at_max.items():
        stage(f"profile N={ns[-1]} {mode}")
        training = mode == "train"
        wides[ns[-1]].train(training)
        for m in members_all[:ns[-1]]:
            m.train(training)
        wide_ms = next(s["ms"]["wide"] for s in speed if s["n"] == ns[-1] and s["mode"] == mode)
        calls = max(2, min(5, int(0.05 / max(wide_ms / 1e3, 1e-6))))
        runs.append({"mode": mode, "calls": calls, "wide": _profile(steps["wide"], calls, profile_top),
                     "loop": _profile(steps["loop"], calls, profile_top)})
    profile = {"n": ns[-1], "top": profile_top, "runs": runs}

    # 4. memory
    log.info("wide_compiler.analyze: measuring saved activations at N=%s", mem_ns)
    member = members_all[0]
    param_bytes = sum(p.numel() * p.element_size() for p in member.parameters())
    buffer_bytes = sum(b.numel() * b.element_size() for b in member.buffers())
    points = []
    for k in mem_ns:
        stage(f"activation memory N={k}")
        wide = wide_for(k)
        was = wide.training
        points.append((k, float(_saved_bytes(wide, _wide_inputs(sample_t, k, seed, sample_kw)))))
        wide.train(was)
    act_fixed, act_per_member = _slope(points)
    check = None  # the fit checked at the largest requested N (compiled already), when small enough
    k = ns[-1]
    if k > mem_ns[-1] and act_fixed + k * act_per_member < 256 * 2**20:
        measured = float(_saved_bytes(wides[k], _wide_inputs(sample_t, k, seed, sample_kw)))
        predicted = act_fixed + k * act_per_member
        check = {"n": k, "measured_bytes": measured, "predicted_bytes": predicted,
                 "rel_err": abs(measured - predicted) / max(measured, 1.0)}
    adam = 2 * param_bytes
    train_per_member = param_bytes + buffer_bytes + param_bytes + adam + act_per_member
    if memory is None:
        budget, source = available_memory(), "MemAvailable of /proc/meminfo"
        if budget is None:
            budget, source = 8 * 10**9, "default 8 GB (no /proc/meminfo)"
    else:
        budget, source = parse_bytes(memory), f"given: {memory}"
    max_train, tried = _max_n(act_fixed, train_per_member, budget)
    in_bytes = sum(a.numel() * a.element_size() for a in tensors)
    max_inf, _ = _max_n(0.0, param_bytes + buffer_bytes + 2 * in_bytes, budget)
    mem = {
        "param_bytes_per_member": param_bytes, "buffer_bytes_per_member": buffer_bytes,
        "grad_bytes_per_member": param_bytes, "adam_bytes_per_member": adam,
        "activation_bytes_per_member": act_per_member, "activation_fixed_bytes": act_fixed,
        "measured_ns": mem_ns, "measured_points": [{"n": k, "saved_bytes": b} for k, b in points],
        "batch": batch, "train_bytes_per_member": train_per_member,
        "budget_bytes": budget, "budget_source": source, "max_n_train": max_train,
        "max_n_inference": max_inf, "search_ns": tried, "fit_check": check,
        "method": (f"activation bytes = storages autograd saves in one training forward (+ outputs), measured "
                   f"at N={mem_ns} and batch {batch}, extrapolated LINEARLY in N (doubling then bisection on "
                   "the fit; nothing near the budget is allocated); Adam state is an estimate (2x "
                   "parameters); inference counts parameters, buffers and input/output-sized activations "
                   "only; allocator overhead and workspace are not included"),
    }

    recs = _recommendations(compile_info, speed, profile, mem, ns)
    if progress is not None:
        progress("done", stages["total"], stages["total"])
    inputs = [_describe(a) for a in sample_t] + [f"{k}={_describe(v)}" for k, v in sample_kw.items()]
    return AnalysisReport(model=model_name, input_shapes=[list(a.shape) for a in tensors], ns=ns, modes=modes,
                          repeats=repeats, config=_config_name(config), compile=compile_info, speed=speed,
                          profile=profile, memory=mem, recommendations=recs,
                          machine=measure.end_of_run(machine),
                          inputs=inputs)


def _describe(a: Any) -> str:
    """``float32[8, 16]`` for a tensor, ``repr`` for anything else."""
    if isinstance(a, torch.Tensor):
        return f"{str(a.dtype).removeprefix('torch.')}{list(a.shape)}"
    return repr(a)


def _config_name(config: Any) -> str:
    from .config import WideConfig

    for name in ("fast", "default", "safe", "debug"):
        try:
            if config == getattr(WideConfig, name)():
                return f"WideConfig.{name}()"
        except Exception:  # noqa: BLE001,S110 -- only a label
            pass
    return "custom WideConfig"


def _share(profile: dict, mode: str, needle: str) -> float:
    """Percent of the wide model's self CPU time in ops whose name contains ``needle``."""
    for run in profile["runs"]:
        if run["mode"] == mode:
            return sum(e["pct"] for e in run["wide"] if needle in e["op"])
    return 0.0


def _recommendations(c: dict, speed: list[dict], profile: dict, mem: dict, ns: list[int]) -> list[dict]:
    recs: list[dict[str, Any]] = []
    mode0 = profile["runs"][0]["mode"] if profile["runs"] else "inference"
    for fb in c["fallbacks"]:
        op = fb["op"].removeprefix("aten.").split(".")[0]
        pct = max((_share(profile, run["mode"], op) for run in profile["runs"]), default=0.0)
        recs.append({"kind": "fallback", "effect": pct / 100,
                     "text": f"{fb['op']} ({fb['graph']} graph) runs per member ({fb['how']}), {pct:.0f}% of the "
                             f"profiled wide step, at {fb['source']}. {fb['fix']}"})
    for o in c["wide_ops"]:
        loops = [g for g, s in o["strategy"].items() if s == "loop"]
        if loops:
            name = o["op"].split(".")[-1]
            pct = _share(profile, mode0, name)
            recs.append({"kind": "loop_strategy", "effect": pct / 100 / max(1, len(c["wide_ops"])),
                         "text": f"{o['op']} at '{o['module'] or o['node']}' runs as a per-member loop in the "
                                 f"{'/'.join(loops)} graph: measure other strategies with the default "
                                 f"WideConfig (tuning) or WideConfig(strategy=...)"})
    for s in speed:
        for b, x in s["speedup"].items():
            if x < 1:
                recs.append({"kind": "slower", "effect": 1 - x,
                             "text": f"N={s['n']} {s['mode']}: wide is {x:.2f}x the {b} (slower): "
                                     f"{'try the measured strategies (WideConfig.default())' if b == 'loop' else 'torch.func vmap wins here'}"
                                     "; see the per-op profile for where the time goes"})
    if c["layout_conversions"]:
        pct = _share(profile, mode0, "copy")
        k = sum(1 for lc in c["layout_conversions"] if lc["graph"] == c["graphs"][0])
        recs.append({"kind": "layout", "effect": pct / 100 / 2,
                     "text": f"{k} layout conversions in the {c['graphs'][0]} graph (a full activation copy "
                             f"each; aten::copy_ is {pct:.0f}% of the profiled {mode0} step): "
                             + "; ".join(lc["what"] for lc in c["layout_conversions"] if lc["graph"] == c["graphs"][0])})
    for mode in dict.fromkeys(s["mode"] for s in speed):
        rows = [s for s in speed if s["mode"] == mode]
        if len(rows) > 1:
            peak = max(rows, key=lambda s: s["samples_per_s"]["wide"])
            p = peak["samples_per_s"]["wide"]
            parts = ", ".join(f"N={s['n']}: {100 * s['samples_per_s']['wide'] / p:.0f}%" for s in rows)
            recs.append({"kind": "throughput", "effect": 0.0,
                         "text": f"{mode}: aggregate wide throughput relative to its measured peak "
                                 f"(N={peak['n']}, {p:,.0f} samples/s): {parts}"
                                 + ("; larger N may gain more (peak at the largest N measured)"
                                    if peak["n"] == ns[-1] else "")})
    recs.append({"kind": "memory", "effect": 0.0,
                 "text": f"up to N={mem['max_n_train']:,} members fit the {_fmt_bytes(mem['budget_bytes'])} "
                         f"budget for training with Adam (linear extrapolation from N={mem['measured_ns']})"})
    recs.sort(key=lambda r: r["effect"], reverse=True)
    return recs
