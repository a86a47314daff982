"""The report of :func:`wide_compiler.analyze.analyze`: :class:`AnalysisReport` (its text,
Markdown and JSON forms) and :func:`plot`, its speedups drawn against N.
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from typing import Any

from . import measure

__all__ = ["AnalysisReport", "plot"]


@dataclasses.dataclass
class AnalysisReport:
    """The result of :func:`analyze`; ``str(report)`` is a readable report, :meth:`to_json`
    and :meth:`to_markdown` the same data for files."""

    model: str
    input_shapes: list[list[int]]
    ns: list[int]
    modes: list[str]
    repeats: int
    config: str
    compile: dict[str, Any]
    speed: list[dict[str, Any]]
    profile: dict[str, Any]
    memory: dict[str, Any]
    recommendations: list[dict[str, Any]]
    machine: dict[str, Any]
    inputs: list[str] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return _finite(dataclasses.asdict(self))

    def to_json(self, indent: int | None = 2) -> str:
        """The report as JSON (NaN and infinities as null)."""
        return json.dumps(self.to_dict(), indent=indent)

    def __str__(self) -> str:
        return "\n".join(self._sections(markdown=False))

    def to_markdown(self) -> str:
        """The report as Markdown: a heading per section, tables as pipe tables."""
        return "\n".join(self._sections(markdown=True))

    # -- rendering ------------------------------------------------------------------------------
    def _sections(self, markdown: bool) -> list[str]:
        out: list[str] = []
        table = _md_table if markdown else _text_table

        def head(title: str) -> None:
            out.extend(["", f"## {title}", ""] if markdown else ["", f"== {title} =="])

        m = self.machine
        shapes = ", ".join(self.inputs or [str(s) for s in self.input_shapes])
        title = f"wide_compiler analyze: {self.model}, one member's input {shapes}, N = {', '.join(map(str, self.ns))}"
        out.append(f"# {title}" if markdown else title)
        out.append(f"{'' if not markdown else chr(10)}torch {m.get('torch')}, {m.get('threads')} threads, CPU "
                   f"capability {m.get('cpu_capability')}, config {self.config}, medians of {self.repeats} "
                   f"interleaved repeats")
        note = measure.contention_note(m)
        if note:
            out.append(note)

        c = self.compile
        head(f"Compile (N={c['n']})")
        per_graph = ", ".join(f"{sum(1 for lc in c['layout_conversions'] if lc['graph'] == g)} ({g} graph)"
                              for g in c["graphs"])
        out.append(f"{len(c['wide_ops'])} wide ops, {len(c['fallbacks'])} fallbacks, "
                   f"layout conversions: {per_graph}, "
                   f"{c['params_per_member']:,} parameters per member, compile {c['compile_s']:.2f} s")
        if c["wide_ops"]:
            out.extend(table(["node", "module", "wide op", *[f"strategy ({g})" for g in c["graphs"]],
                              "member input", "weight"],
                             [[o["node"], o["module"] or "-", o["op"],
                               *[o["strategy"].get(g, "-") for g in c["graphs"]],
                               o["input"], o["weight"]] for o in c["wide_ops"]]))
        for fb in c["fallbacks"]:
            out.append(f"{'- ' if markdown else '  '}fallback ({fb['graph']}): {fb['op']} ({fb['how']}, "
                       f"{fb['reason']}) at {fb['source']}. Fix: {fb['fix']}")
        for lc in c["layout_conversions"]:
            out.append(f"{'- ' if markdown else '  '}layout conversion ({lc['graph']}): {lc['node']}: {lc['what']}")

        head("Speed (ms per step; speedup = baseline / wide)")
        rows = []
        for s in self.speed:
            ms, sp, tp = s["ms"], s["speedup"], s["samples_per_s_per_member"]
            rows.append([str(s["n"]), s["mode"], measure.fmt_ms(ms.get("wide")),
                         _cell(ms, s, "loop", measure.fmt_ms), _cell(ms, s, "vmap", measure.fmt_ms),
                         measure.fmt_x(sp.get("loop")), measure.fmt_x(sp.get("vmap")),
                         _num(tp.get("wide")), _num(tp.get("loop")), _num(s["samples_per_s"].get("wide")),
                         _err(s.get("max_abs_err_vs_loop"))])
        out.extend(table(["N", "mode", "wide ms", "loop ms", "vmap ms", "vs loop", "vs vmap",
                          "wide samples/s/member", "loop samples/s/member", "wide samples/s (all)",
                          "max err vs loop"], rows))
        errs = {(s["mode"], k, v) for s in self.speed for k, v in s["errors"].items()}
        for mode, k, v in sorted(errs):
            out.append(f"{k} failed ({mode}): {v}")

        p = self.profile
        if p.get("runs"):
            head(f"Where the time goes (N={p['n']}, self CPU ms per step, torch.profiler, top {p['top']})")
            for run in p["runs"]:
                out.append(f"{run['mode']}:" if not markdown else f"**{run['mode']}**")
                if markdown:
                    out.append("")
                w, lp = run["wide"], run["loop"]
                rows = []
                for i in range(max(len(w), len(lp))):
                    a = w[i] if i < len(w) else None
                    b = lp[i] if i < len(lp) else None
                    rows.append([a["op"] if a else "", measure.fmt_ms(a["ms"]) if a else "",
                                 f"{a['pct']:.0f}%" if a else "",
                                 b["op"] if b else "", measure.fmt_ms(b["ms"]) if b else "",
                                 f"{b['pct']:.0f}%" if b else ""])
                out.extend(table(["wide op", "ms", "%", "loop op", "ms", "%"], rows))
                if markdown:
                    out.append("")

        mem = self.memory
        head("Memory")
        mb = _fmt_bytes
        out.extend(table(["per member", "bytes"], [
            ["parameters + buffers", mb(mem["param_bytes_per_member"] + mem["buffer_bytes_per_member"])],
            ["gradients", mb(mem["param_bytes_per_member"])],
            ["Adam state (estimate: 2x parameters)", mb(mem["adam_bytes_per_member"])],
            [f"activations saved for backward (measured at N={mem['measured_ns']}, batch {mem['batch']})",
             mb(mem["activation_bytes_per_member"])],
            ["training footprint", mb(mem["train_bytes_per_member"])],
        ]))
        out.append(f"budget {mb(mem['budget_bytes'])} ({mem['budget_source']}): largest N for one training "
                   f"step with Adam = {mem['max_n_train']} (inference: {mem['max_n_inference']})")
        chk = mem.get("fit_check")
        if chk:
            out.append(f"linear fit checked at N={chk['n']}: measured {mb(chk['measured_bytes'])} of saved "
                       f"activations, predicted {mb(chk['predicted_bytes'])} ({100 * chk['rel_err']:.1f}% off)")
        out.append(mem["method"])

        head("Recommendations (ranked by measured effect)")
        if not self.recommendations:
            out.append("nothing to change: no fallbacks, no per-member loops, wide is faster everywhere")
        for i, r in enumerate(self.recommendations, 1):
            out.append(f"{i}. {r['text']}")
        return out


def _fmt_bytes(v: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if v >= scale:
            return f"{v / scale:,.2f} {unit}"
    return f"{v:,.0f} B"


def _cell(ms: dict, s: dict, name: str, fmt: Callable) -> str:
    return "error" if name in s["errors"] else fmt(ms.get(name))


def _err(v: float | None) -> str:
    return "-" if v is None or not math.isfinite(v) else f"{v:.1e}"


def _num(v: float | None) -> str:
    if v is None or not math.isfinite(v):
        return "-"
    return f"{v:,.0f}"


def _text_table(cols: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(cols)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
    return [line(cols), line(["-" * w for w in widths])] + [line(r) for r in rows]


def _md_table(cols: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    esc = lambda s: str(s).replace("|", "\\|")
    return ["| " + " | ".join(map(esc, cols)) + " |", "|" + "---|" * len(cols)] + [
        "| " + " | ".join(map(esc, r)) + " |" for r in rows]


def _finite(o: Any) -> Any:
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {str(k): _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


# ---------------------------------------------------------------------------------- plot

def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only), or ImportError naming the extra."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(f"wide_compiler: plotting needs matplotlib ({e}); install it with "
                          "pip install 'wide_compiler[plot]' (or pip install matplotlib)") from None
    return plt


def plot(report: AnalysisReport, path: str) -> None:
    """Speedup of the wide model over each baseline (loop, vmap) against N: one panel per mode,
    each with its own y axis (inference and training speedups differ by far), one line per
    baseline, a dashed line at 1x (above it, wide is faster); written to ``path`` (needs
    matplotlib: the ``plot`` extra)."""
    plt = _pyplot()
    fig = _speedup_figure(plt, report)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _speedup_figure(plt: Any, report: AnalysisReport) -> Any:
    """The figure of :func:`plot`. Each panel's y axis runs from 0 to above its highest point
    and its label (and 1x), so no point is cut off, whatever the other panel holds."""
    modes = [m for m in report.modes if any(s["mode"] == m for s in report.speed)] or list(report.modes)
    fig, axes = plt.subplots(1, len(modes), figsize=(5.5 * len(modes), 4), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        rows = sorted((s for s in report.speed if s["mode"] == mode), key=lambda s: s["n"])
        top = 1.0
        for baseline, marker in (("loop", "o"), ("vmap", "s")):
            pts = [(s["n"], s["speedup"][baseline]) for s in rows
                   if isinstance(s["speedup"].get(baseline), (int, float)) and math.isfinite(s["speedup"][baseline])]
            if not pts:
                continue
            line, = ax.plot(*zip(*pts), marker=marker, label=f"vs {baseline}")
            for x, y in pts:
                ax.annotate(f"{y:.2f}x", (x, y), textcoords="offset points", xytext=(0, 6), ha="center",
                            fontsize=8, color=line.get_color())
            top = max(top, *(y for _, y in pts))
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set_ylim(0, top * 1.2)  # headroom for the labels above the highest point
        ax.set_xscale("log", base=2)
        ax.set_xticks(report.ns, [str(k) for k in report.ns])
        ax.set_xlabel("N (members)")
        ax.set_ylabel("speedup of wide (baseline ms / wide ms)")
        ax.set_title(mode)
        ax.legend(fontsize=8)
    fig.suptitle(f"{report.model}: speedup against N ({', '.join(report.inputs) or 'sample'})", fontsize=10)
    fig.tight_layout()
    return fig
