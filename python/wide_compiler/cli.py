"""Command line: ``python -m wide_compiler {info,test,trace,benchmark,analyze}`` (console script
``wide_compiler``).

Examples::

    python -m wide_compiler info
    python -m wide_compiler test
    python -m wide_compiler test path/to/model.py:make_model --shape 32,64
    python -m wide_compiler analyze convnet -n 4,16 --memory 8GB
    python -m wide_compiler trace -m transformer
    python -m wide_compiler benchmark linear --preset quick --json bench-results/linear.json
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import json
import logging
import math
import platform
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["build_parser", "main"]


# ---------------------------------------------------------------------------------- info

def _registered_ops() -> list[tuple[str, list[str], list[str]]]:
    """(name, schemas, dispatch keys with a kernel) of every ``wide::`` operator."""
    import torch

    keys = ("CompositeImplicitAutograd", "CompositeExplicitAutograd", "CPU", "CUDA", "Meta",
            "Autograd", "AutogradCPU")
    out = []
    for name in sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("wide::")):
        schemas = []
        packet = getattr(torch.ops.wide, name.split("::", 1)[1], None)
        if packet is not None:
            for ov in packet.overloads():
                schemas.append(str(getattr(packet, ov)._schema))
        has = [k for k in keys if torch._C._dispatch_has_kernel_for_dispatch_key(name, k)]
        out.append((name, schemas, has))
    return out


def cmd_info(args: argparse.Namespace) -> int:
    import torch

    import wide_compiler as wc

    print(f"wide_compiler {getattr(wc, '__version__', 'unknown')}  "
          f"({Path(wc.__file__).parent})")
    print(f"torch {torch.__version__}  (debug={torch.version.debug}, "
          f"cuda={torch.version.cuda or 'none'})")
    print(f"python {platform.python_version()}  ({sys.executable})")
    print(f"platform {platform.platform()}")
    print(f"threads: {torch.get_num_threads()} intra-op, {torch.get_num_interop_threads()} "
          f"inter-op")
    print(f"cpu capability (torch kernels): {torch.backends.cpu.get_cpu_capability()}")
    print(f"mkldnn: {torch.backends.mkldnn.is_available()}, mkl: {torch.backends.mkl.is_available()}"
          f", openmp: {torch.backends.openmp.is_available()}")
    print()
    print("C++ core (torch.ops.wide._build_info()):")
    try:
        info = torch.ops.wide._build_info()
    except Exception as e:  # noqa: BLE001 (the library did not load: say so, keep going)
        print(f"  unavailable: {type(e).__name__}: {e}")
    else:
        for line in info.rstrip().splitlines():
            print(f"  {line}")
    print()
    ops = _registered_ops()
    print(f"registered operators ({len(ops)}):")
    for name, schemas, keys in ops:
        print(f"  {name}  [{', '.join(keys) or 'no kernel'}]")
        for s in schemas:
            print(f"    {s}")
    return 0


# ---------------------------------------------------------------------------------- test

class _Checks:
    """Runs named checks, prints one PASS/FAIL line each, remembers failures."""

    def __init__(self, verbose: bool) -> None:
        self.verbose = verbose
        self.failed: list[str] = []
        self.count = 0

    def run(self, name: str, fn: Callable[[], str | None]) -> Any:
        self.count += 1
        start = time.perf_counter()
        try:
            detail = fn()
        except Exception as e:  # noqa: BLE001 (a failed check is a FAIL line, not a crash)
            self.failed.append(name)
            print(f"FAIL  {name}: {type(e).__name__}: {e}", flush=True)
            if self.verbose:
                traceback.print_exc()
            return None
        ms = (time.perf_counter() - start) * 1e3
        print(f"PASS  {name}{f'  ({detail})' if detail else ''}  [{ms:.0f} ms]", flush=True)
        return detail


def _max_err(a: Any, b: Any) -> float:
    return (a.detach().double() - b.detach().double()).abs().max().item()


def _check_close(what: str, err: float, tol: float) -> None:
    if not err <= tol:  # also catches NaN
        raise AssertionError(f"{what}: max abs err {err:.3g} > {tol:g}")


def _test_op() -> str:
    import torch
    import torch.nn.functional as F

    from . import testing

    torch.manual_seed(0)
    n, b, i, o = 5, 3, 7, 4
    w = torch.randn(n, o, i, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(n, o, dtype=torch.float64, requires_grad=True)
    xs = {"separate": torch.randn(n, b, i, dtype=torch.float64),
          "shared": torch.randn(b, i, dtype=torch.float64).expand(n, b, i),
          "non-contiguous": torch.randn(n, i, b, dtype=torch.float64).transpose(1, 2)}
    worst = 0.0
    for xname, x in xs.items():
        for strategy in ("auto", "bmm", "bmm_t", "loop"):
            out = torch.ops.wide.linear(x, w, bias, strategy=strategy)
            gw, gb = torch.autograd.grad(out.square().sum(), (w, bias))
            refs = [F.linear(x[k], w[k], bias[k]) for k in range(n)]
            ref_grads = [torch.autograd.grad(r.square().sum(), (w, bias)) for r in refs]
            where = f"{xname} input, strategy={strategy}"
            testing.assert_members_close(out, refs, what=f"{where} output")
            testing.assert_members_close(gw, [g[0][k] for k, g in enumerate(ref_grads)], kind="grad",
                                         what=f"{where} weight grad")
            testing.assert_members_close(gb, [g[1][k] for k, g in enumerate(ref_grads)], kind="grad",
                                         what=f"{where} bias grad")
            worst = max(worst, testing.max_member_error(out, refs))
    return f"3 inputs x 4 strategies x {n} members (float64), max err {worst:.1e}"


def _test_opcheck() -> str:
    import torch
    from torch.library import opcheck

    torch.manual_seed(0)
    w = torch.randn(3, 4, 5, requires_grad=True)
    b = torch.randn(3, 4, requires_grad=True)
    samples = [((torch.randn(3, 2, 5, requires_grad=True), w, b), {"strategy": "bmm"}),
               ((torch.randn(3, 2, 5), w, None), {"strategy": "loop"}),
               ((torch.randn(2, 5).expand(3, 2, 5), w, b), {})]
    for args, kwargs in samples:
        result = opcheck(torch.ops.wide.linear.default, args, kwargs)
        bad = {k: v for k, v in result.items() if v != "SUCCESS"}
        if bad:
            raise AssertionError(f"opcheck(wide::linear, strategy={kwargs.get('strategy')}): {bad}")
    return f"{len(samples)} samples: schema, autograd registration, fake tensor, aot dispatch"


def _test_wide_linear() -> str:
    import torch
    from torch import nn

    import wide_compiler as wc

    torch.manual_seed(0)
    layers = [nn.Linear(6, 3) for _ in range(4)]
    wide = wc.nn.WideLinear.from_modules(layers)
    report = wc.testing.check_equivalence(wide, layers, torch.randn(4, 2, 6))
    back = wide.unfuse()
    for k, (a, m) in enumerate(zip(layers, back)):
        if type(m) is not nn.Linear or not (torch.equal(a.weight, m.weight)
                                            and torch.equal(a.bias, m.bias)):
            raise AssertionError(f"member {k}: unfuse() did not give back the same nn.Linear")
    return f"from_modules -> forward (outputs, gradients) -> unfuse, max err {report.max_error():.1e}"


class _MLP:  # built lazily so that `import wide_compiler.cli` does not import torch.nn
    @staticmethod
    def make(seed: int, sizes: Sequence[int] = (16, 32, 32, 4)) -> Any:
        import torch
        from torch import nn

        torch.manual_seed(seed)
        layers: list[nn.Module] = []
        for k, (a, b) in enumerate(itertools.pairwise(sizes)):
            layers.append(nn.Linear(a, b))
            if k < len(sizes) - 2:
                layers.append(nn.GELU() if k % 2 else nn.ReLU())
        return nn.Sequential(*layers)


def _compare_population(models: Sequence[Any], wide: Any, x: Any, *, shared: bool = False) -> float:
    """Every member's outputs, input and parameter gradients and buffers against the wide
    model's (:func:`wide_compiler.testing.check_equivalence`, raises on a difference); returns
    the max error. ``x``: the N-first input, or one member's input with ``shared``."""
    from . import testing

    return testing.check_equivalence(wide, models, x, shared=shared).max_error()


def _test_compile() -> str:
    import torch

    import wide_compiler as wc

    n = 8
    models = [_MLP.make(seed) for seed in range(n)]
    x = torch.randn(n, 5, 16)
    wide = wc.compile(models, x[0], config=wc.WideConfig.fast())
    if wide.n != n:
        raise AssertionError(f"WideModel.n is {wide.n}, expected {n}")
    err = _compare_population(models, wide, x)
    err_s = _compare_population(models, wide, torch.randn(5, 16), shared=True)
    return f"{n} MLPs 16->32->32->4, outputs + gradients, max err {max(err, err_s):.1e}"


def _test_compile_strategies() -> str:
    import torch

    import wide_compiler as wc

    n = 4
    models = [_MLP.make(100 + seed) for seed in range(n)]
    x = torch.randn(n, 3, 16)
    worst = 0.0
    for strategy in ("bmm", "loop"):
        wide = wc.compile(models, x[0], config=wc.WideConfig(strategy=strategy, tune=False))
        chosen = set(wide.strategies.values())
        if chosen != {strategy}:
            raise AssertionError(f"strategy={strategy!r} forced, got {wide.strategies}")
        worst = max(worst, _compare_population(models, wide, x))
    return f"forced bmm and loop, max err {worst:.1e}"


def _test_check_compile() -> str:
    import torch
    from torch import nn

    import wide_compiler as wc

    torch.manual_seed(300)
    models = [nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2)) for _ in range(3)]
    _, report = wc.testing.check_compile(models, torch.randn(2, 3, 6, 6), config=wc.WideConfig.fast())
    worst = max(r.max_error() for r in report.values())
    return (f"{len(report)} checks (train/eval x own/shared input): outputs, gradients, running "
            f"stats, max err {worst:.1e}")


def _test_unfuse() -> str:
    import torch

    import wide_compiler as wc

    n = 4
    models = [_MLP.make(200 + seed) for seed in range(n)]
    x = torch.randn(n, 3, 16)
    wide = wc.compile(models, x[0], config=wc.WideConfig.fast())
    back = wide.unfuse()
    if len(back) != n:
        raise AssertionError(f"unfuse() returned {len(back)} modules, expected {n}")
    worst = 0.0
    for k, (a, b) in enumerate(zip(models, back)):
        if type(a) is not type(b):
            raise AssertionError(f"member {k}: unfuse() gave {type(b).__name__}, "
                                 f"expected {type(a).__name__}")
        e = _max_err(a(x[k]), b(x[k]))
        _check_close(f"member {k} after unfuse", e, 0.0)
        worst = max(worst, e)
    sd = wide.state_dict()
    for name, p in models[0].named_parameters():
        if name not in sd or tuple(sd[name].shape) != (n, *p.shape):
            raise AssertionError(f"state_dict()[{name!r}]: expected shape {(n, *p.shape)}, "
                                 f"got {tuple(sd[name].shape) if name in sd else 'no such key'}")
    return "unfuse() and state_dict() give back every member exactly"


def cmd_test(args: argparse.Namespace) -> int:
    import torch

    import wide_compiler as wc

    if getattr(args, "model", None):
        return _test_model(args)

    print(f"wide_compiler {getattr(wc, '__version__', 'unknown')}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}")
    checks = _Checks(args.verbose)
    checks.run("wide::linear registered", lambda: str(torch.ops.wide.linear.default._schema))
    checks.run("wide::linear matches F.linear per member (outputs, gradients)", _test_op)
    checks.run("torch.library.opcheck(wide::linear)", _test_opcheck)
    checks.run("WideLinear round trip", _test_wide_linear)
    checks.run("compile(): MLP population vs every member", _test_compile)
    checks.run("compile(): forced strategies", _test_compile_strategies)
    checks.run("testing.check_compile(): CNN with BatchNorm, train and eval", _test_check_compile)
    checks.run("WideModel.unfuse() round trip", _test_unfuse)
    if checks.failed:
        print(f"{len(checks.failed)} of {checks.count} checks FAILED")
        return 1
    print(f"all {checks.count} checks passed")
    return 0


def _test_model(args: argparse.Namespace) -> int:
    """``test MODEL``: compile N members of the user's model and check every member in train and
    eval mode (outputs, input and parameter gradients, buffers) with ``testing.check_compile``."""
    import torch

    import wide_compiler as wc

    factory, shape = model_and_shape(args.model, args.shape)
    if shape is None:
        print(f"wide_compiler test: {args.model}: give one member's input shape with --shape, e.g. --shape 32,64")
        return 2
    torch.manual_seed(0)
    models = [factory() for _ in range(args.n)]
    try:
        wide, report = wc.testing.check_compile(models, torch.randn(*shape), strict=args.strict,
                                                config=wc.WideConfig.fast())
    except (AssertionError, wc.WideCompileError, ValueError) as e:
        print(f"FAIL  {args.model}: {type(e).__name__}: {e}")
        return 1
    for key, rep in report.items():
        print(f"PASS  {key}: {rep}")
    for fb in wide.fallbacks:
        print(f"note  per-member fallback: {fb['op']} at {fb['source']}")
    print(f"{args.model}: all {args.n} members match their own models")
    return 0


def model_and_shape(model: str, shape: str | Sequence[int] | None) -> tuple[Callable[[], Any], tuple[int, ...] | None]:
    """The CLI's MODEL and ``--shape``: a built-in model (with its own sample shape) or
    ``path/to/file.py:factory``; ``shape`` (parsed, or a string like ``32,64`` or ``32x64``,
    see :func:`parse_shape`) overrides."""
    from . import zoo
    from .analyze import load_factory

    factory, default = zoo.MODELS[model] if model in zoo.MODELS else (load_factory(model), None)
    if isinstance(shape, str):
        shape = parse_shape(shape)
    return factory, tuple(shape) if shape else default


def parse_shape(text: str) -> tuple[int, ...]:
    """``--shape``: one member's input shape as positive sizes separated by ``,`` or ``x``
    (``32,64``, ``32x64``). Raises ValueError naming the bad part.

    >>> parse_shape("32,64"), parse_shape("4x8x8")
    ((32, 64), (4, 8, 8))
    >>> parse_shape("4,abc")
    Traceback (most recent call last):
    ...
    ValueError: '4,abc': 'abc' is not an integer size (expected positive sizes like 32,64)
    """
    parts = [p.strip() for p in text.replace("x", ",").split(",")]
    if not text.strip() or not any(parts):
        raise ValueError(f"{text!r}: no sizes (expected positive sizes like 32,64)")
    sizes = []
    for part in parts:
        if not part:
            raise ValueError(f"{text!r}: an empty size (expected positive sizes like 32,64)")
        try:
            size = int(part)
        except ValueError:
            raise ValueError(f"{text!r}: {part!r} is not an integer size (expected positive sizes "
                             f"like 32,64)") from None
        if size < 1:
            raise ValueError(f"{text!r}: size {size} must be at least 1 (expected positive sizes like 32,64)")
        sizes.append(size)
    return tuple(sizes)


def _shape_arg(text: str) -> tuple[int, ...]:
    """argparse ``type`` of ``--shape``: a bad shape is a usage error (exit 2), not a traceback."""
    try:
        return parse_shape(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cmd_analyze(args: argparse.Namespace) -> int:
    """``python -m wide_compiler analyze MODEL``: print the report; ``--json``/``--markdown``/``--plot``
    also write it to files."""
    import torch

    import wide_compiler as wc
    from .analyze import analyze, plot

    factory, shape = model_and_shape(args.model, args.shape)
    if shape is None:
        print(f"wide_compiler analyze: {args.model}: give one member's input shape with --shape, e.g. --shape 32,64")
        return 2
    torch.manual_seed(0)
    report = analyze(factory, torch.randn(*shape), n=[int(k) for k in str(args.n).split(",") if k.strip()],
                     memory=args.memory, modes=[m.strip() for m in args.modes.split(",") if m.strip()],
                     repeats=args.repeats, config=getattr(wc.WideConfig, args.config)())
    print(report)
    if args.json:
        Path(args.json).write_text(report.to_json())
    if args.markdown:
        Path(args.markdown).write_text(report.to_markdown())
    if args.plot:
        if importlib.util.find_spec("matplotlib") is None:
            print("error: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
            return 2
        plot(report, args.plot)
    return 0


# ---------------------------------------------------------------------------------- benchmark

def _benchmark_targets() -> str:
    """The registered benchmark targets, one line each with its description, and the presets."""
    from . import bench

    width = max(map(len, bench.TARGETS))
    lines = ["targets:"] + [f"  {name.ljust(width)}  {t.description}"
                            for name, t in bench.TARGETS.items()]
    lines.append("presets: ci (smoke run, seconds), quick (headline cases, default), "
                 "full (grid, minutes)")
    return "\n".join(lines)


def cmd_benchmark(args: argparse.Namespace) -> int:
    from . import bench

    if args.list:  # machine-readable: one target name a line (the Makefile's `make bench`)
        print("\n".join(bench.TARGETS))
        return 0
    if args.target is None:
        print("usage: python -m wide_compiler benchmark TARGET|all [--preset ci|quick|full] "
              "[--json FILE] [--save] [--top K] [--plot FILE.png] [--compile]\n")
        print(_benchmark_targets())
        return 0
    targets = list(bench.TARGETS) if args.target == "all" else [args.target]
    for name in targets:
        if name not in bench.TARGETS:
            print(f"error: unknown benchmark target {name!r}; expected one of "
                  f"{', '.join(bench.TARGETS)} or all", file=sys.stderr)
            return 2
        if args.preset not in bench.TARGETS[name].presets:
            print(f"error: target {name!r} has no preset {args.preset!r}; "
                  f"expected one of {', '.join(bench.TARGETS[name].presets)}", file=sys.stderr)
            return 2
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        print("error: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return 2
    if args.tuned_allocator:  # the same process-wide setting for every contender
        from .allocator import tune_cpu_allocator

        tune_cpu_allocator()
    records = []
    for name in targets:
        with bench.engine.compile_all() if args.compile else contextlib.nullcontext():
            try:
                recs = bench.run(name, args.preset, progress=not args.quiet, cases=args.case)
            except ValueError as e:
                if not str(e).startswith(f"benchmark {name}/"):
                    raise
                print(f"error: {e}", file=sys.stderr)
                return 2
        records += recs
        if not args.quiet:
            print(bench.format_records(name, top_records(recs, args.top) if args.top else recs))
    paths = [Path(args.json)] if args.json else []
    if args.save:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        paths.append(Path("bench-results") / f"{args.target}-{args.preset}-{stamp}.json")
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            json.dump(_finite(records), f, indent=1, default=str, allow_nan=False)
            f.write("\n")
        if not args.quiet:
            print(f"wrote {len(records)} records to {path}")
    if args.plot:
        plot_speedups(records, args.plot)
        if not args.quiet:
            print(f"wrote {args.plot}")
    return 0


def _best_speedup(record: dict) -> float:
    """A record's speedup over its best (fastest) baseline; -inf when it has none."""
    speedups = [v for v in (record.get("speedup") or {}).values() if isinstance(v, (int, float))]
    return min(speedups) if speedups else -math.inf


def top_records(records: Sequence[dict], k: int) -> list[dict]:
    """The ``k`` records with the largest speedup over their best baseline, best first.

    >>> recs = [{"speedup": {"loop": 3.0, "vmap": 1.5}}, {"speedup": {"loop": 2.0}}, {"speedup": {}}]
    >>> [min(r["speedup"].values(), default=None) for r in top_records(recs, 2)]
    [2.0, 1.5]
    """
    return sorted(records, key=_best_speedup, reverse=True)[:k]


def plot_speedups(records: Sequence[dict], path: str) -> None:
    """Speedup of wide over each baseline against N, one line per (target, case, mode, strategy,
    baseline), log-scaled N, a dashed line at 1x; written to ``path`` (matplotlib, optional)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        for baseline, x in (r.get("speedup") or {}).items():
            if isinstance(x, (int, float)) and math.isfinite(x) and r.get("n"):
                label = f"{r['target']}/{r.get('case') or ''} {r.get('mode') or ''} {r.get('strategy') or ''} vs {baseline}"
                series.setdefault(label, []).append((r["n"], x))
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for label, points in sorted(series.items()):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("N (members)")
    ax.set_ylabel("speedup of wide (baseline ms / wide ms)")
    ax.legend(fontsize=6, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _finite(o: Any) -> Any:
    """Records with NaN/inf floats replaced by None: the file stays strict JSON."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


# ---------------------------------------------------------------------------------- trace

def _side_by_side(left: str, right: str, titles: tuple[str, str], cut: int = 72) -> str:
    def clip(line: str) -> str:
        return line if len(line) <= cut else line[: cut - 3] + "..."

    a, b = [clip(x) for x in left.splitlines()], [clip(x) for x in right.splitlines()]
    width = max([len(titles[0])] + [len(line) for line in a])
    rows = [f"{titles[0].ljust(width)} | {titles[1]}", f"{'-' * width}-+-{'-' * len(titles[1])}"]
    for i in range(max(len(a), len(b))):
        rows.append(f"{(a[i] if i < len(a) else '').ljust(width)} | {b[i] if i < len(b) else ''}")
    return "\n".join(rows)


def _graph_lines(graph: Any) -> str:
    """One line per call node: ``name = target(args)``, placeholders and output included."""
    lines = []
    for node in graph.nodes:
        if node.op == "placeholder":
            lines.append(f"{node.name} = input")
        elif node.op == "output":
            lines.append(f"return {node.args[0]}")
        else:
            target = getattr(node.target, "__name__", str(node.target))
            ns = getattr(node.target, "namespace", "")
            args = ", ".join([str(a) for a in node.args] + [f"{k}={v}" for k, v in node.kwargs.items()])
            lines.append(f"{node.name} = {ns + '.' if ns else ''}{target}({args})")
    return "\n".join(lines)


def cmd_trace(args: argparse.Namespace) -> int:
    import torch

    import wide_compiler as wc
    from wide_compiler import zoo
    from wide_compiler.fx.capture import capture

    factory, shape = zoo.MODELS[args.model]
    torch.manual_seed(0)
    models = [factory() for _ in range(args.n)]
    sample = torch.randn(*shape)
    ep = capture(models[0], (sample,))
    wide = wc.compile(models, sample, config=wc.WideConfig.fast())
    wide_graph = wide._graph_for(wide.training).graph_module.graph
    print(_side_by_side(_graph_lines(ep.graph), _graph_lines(wide_graph),
                        (f"captured member graph ({args.model})", f"wide graph (N={args.n})")))
    print()
    print(wide.report())
    return 0


# ---------------------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    from . import bench

    parser = argparse.ArgumentParser(
        prog="wide_compiler",
        description="Fuse N models of one architecture into one wide model.")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log INFO messages (and tracebacks of failed checks)")
    # -v is accepted before or after the command (SUPPRESS: a subcommand's default must not
    # overwrite a -v given before it).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="log INFO messages (and tracebacks of failed checks)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("info", parents=[common],
                       help="versions, threads, CPU ISA, C++ build, registered ops")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("test", parents=[common],
                       help="quick self-check on this machine, or check a model of yours member by member "
                            "(PASS/FAIL, exit 0/1)")
    p.add_argument("model", nargs="?", help="path/to/file.py:factory (a zero-argument callable returning one "
                                            "member) or a built-in model: checks N members of it with "
                                            "wide_compiler.testing.check_compile; without: the self-check")
    p.add_argument("--shape", type=_shape_arg, metavar="SHAPE",
                   help="one member's input shape, e.g. 32,64 (built-in models: their own)")
    p.add_argument("-n", type=int, default=3, help="members to check (default 3)")
    p.add_argument("--strict", action="store_true", help="refuse per-member fallbacks")
    p.set_defaults(func=cmd_test)

    from . import zoo

    p = sub.add_parser("trace", parents=[common],
                       help="a built-in model's captured graph and wide graph side by side")
    p.add_argument("-m", "--model", required=True, choices=sorted(zoo.MODELS), help="built-in model")
    p.add_argument("-n", type=int, default=4, help="number of members (default 4)")
    p.set_defaults(func=cmd_trace)

    all_presets = sorted({name for t in bench.TARGETS.values() for name in t.presets})
    p = sub.add_parser("benchmark", parents=[common], help="time wide ops against loop / vmap / torch.compile",
                       description="Time the wide model against the baselines; print a table "
                                   "and optionally write JSON records.\nWithout a target: the "
                                   "list of targets.",
                       epilog=_benchmark_targets(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    # Checked by cmd_benchmark (not `choices`): no target lists the targets, exit 0.
    p.add_argument("target", nargs="?", metavar="TARGET",
                   help=f"what to benchmark: {', '.join(bench.TARGETS)}, or all")
    p.add_argument("--list", action="store_true",
                   help="print the target names, one a line, and exit")
    p.add_argument("--preset", default="quick", choices=all_presets,
                   help="ci: tiny smoke run; quick: the headline case (default); full: the grid")
    p.add_argument("--json", metavar="FILE", help="write the records (a JSON list) to FILE")
    p.add_argument("--compile", action="store_true",
                   help="run the wide model and every baseline under torch.compile (targets on the "
                        "shared engine: all but optim and train), checked against the eager loop")
    p.add_argument("--save", action="store_true",
                   help="also write them to bench-results/TARGET-PRESET-YYYYmmdd-HHMMSS.json")
    p.add_argument("--top", type=int, metavar="K",
                   help="print only the K records with the largest speedup over their best baseline")
    p.add_argument("--plot", metavar="FILE.png",
                   help="draw speedup vs N per baseline to FILE.png (needs matplotlib)")
    p.add_argument("--case", action="append", metavar="NAME",
                   help="run only this case of the target (repeatable; 'resnet18' or 'resnet18 N=4'): "
                        "one process per case bounds memory when the models are large")
    p.add_argument("--tuned-allocator", action="store_true",
                   help="call wc.tune_cpu_allocator() first (raises glibc's malloc thresholds for "
                        "the whole process, every contender alike; by default nothing process-wide "
                        "changes); records say which in 'allocator'")
    p.add_argument("-q", "--quiet", action="store_true", help="no table, no progress bar")
    p.set_defaults(func=cmd_benchmark)

    p = sub.add_parser(
        "analyze", parents=[common], help="compile, time, profile and size N members of a model",
        description="Report what fusing N members of a model buys on this machine: wide ops and "
                    "fallbacks, speed vs loop and vmap, per-op profile, memory and the largest N "
                    "that fits, recommendations.")
    p.add_argument("model", help="a built-in model (mlp, resblock, convnet, transformer) or "
                                 "path/to/file.py:factory (a zero-argument callable returning one member)")
    p.add_argument("--shape", type=_shape_arg, metavar="SHAPE",
                   help="one member's input shape, e.g. 32,64 (default for built-in models: "
                        "their sample shape)")
    p.add_argument("-n", default="4,16", help="population sizes, comma-separated (default 4,16)")
    p.add_argument("--modes", default="inference,train", help="inference,train (default both)")
    p.add_argument("--memory", help="memory budget for the largest-N search, e.g. 8GB (default: MemAvailable)")
    p.add_argument("--repeats", type=int, default=7, help="interleaved timing repeats (default 7)")
    p.add_argument("--config", default="fast", choices=("fast", "default", "safe"),
                   help="WideConfig preset to compile with (default fast: heuristic strategies; "
                        "default: strategies measured at compile time)")
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON to FILE")
    p.add_argument("--markdown", metavar="FILE", help="also write the report as Markdown to FILE")
    p.add_argument("--plot", metavar="FILE.png", help="draw per-member throughput vs N (needs matplotlib)")
    p.set_defaults(func=cmd_analyze)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m wide_compiler`` and the ``wide_compiler`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
