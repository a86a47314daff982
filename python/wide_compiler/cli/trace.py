"""``python -m wide_compiler trace MODEL``: the captured member graph beside the wide graph (one
line per node), then the compile report.
"""
from __future__ import annotations

import argparse
import sys
import traceback
from typing import Any

from .inputs import UsageError
from .models import model_and_sample

__all__ = ["run"]


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


def run(args: argparse.Namespace) -> int:
    """``trace MODEL``: the captured member graph beside the wide graph, then the compile report."""
    import wide_compiler as wc
    from ..fx.capture import capture

    spec = args.model or args.model_opt
    if not spec:
        raise UsageError("give a model: a built-in one (mlp, resblock, convnet, transformer) or "
                         "path/to/file.py:factory with its input (see trace --help)")
    args.model = spec
    loaded, models, sample = model_and_sample(args, "trace", args.n)
    try:
        ep = capture(models[0], sample.args, sample.kwargs)
        wide = wc.compile(models, sample.args, sample_kwargs=sample.kwargs or None, config=wc.WideConfig.fast())
    except wc.WideCompileError as e:
        print(f"wide_compiler trace: {loaded.label} cannot be fused: {e}", file=sys.stderr)
        if args.verbose:
            traceback.print_exc()
        return 1
    wide_graph = wide._graph_for(wide.training).graph_module.graph
    print(_side_by_side(_graph_lines(ep.graph), _graph_lines(wide_graph),
                        (f"captured member graph ({loaded.label})", f"wide graph (N={args.n})")))
    print()
    print(wide.report())
    return 0
