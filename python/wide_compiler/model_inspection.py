"""What a wide model says about itself (mixed into :class:`~wide_compiler.WideModel`): the
strategies of its wide ops, ``summary()`` (the ops, their strategies and timings, the inputs and
their dynamic dims, the per-member constants, the tuning), the fallbacks and ``report()``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .fx.source import module_path
from .model_inputs import _member_dims, _size_range

if TYPE_CHECKING:
    from .fx.widen import WideGraph

__all__ = ["InspectionMixin"]


class InspectionMixin:
    """Inspection of the current train/eval graph. The host class has ``n``, ``training``, the
    graphs (``_graph_for``, ``_ranges``), the measured ``_timings`` and ``per_member_constants``."""

    n: int

    @property
    def strategies(self) -> dict[str, str]:
        """Graph node name -> strategy of every wide op (current train/eval graph)."""
        wg = self._graph_for(self.training)
        return {n.name: n.kwargs["strategy"] for n in wg.graph_module.graph.nodes if "strategy" in n.kwargs}

    def summary(self) -> str:
        """A table of the wide ops of the current graph: node, module, op, strategy, member shapes,
        measured times and why each strategy was chosen (heuristic default, measured against the
        default and the margin, cached, budget exhausted, the model-level check's verdict), under
        a line on the tuning of this graph (time spent, budget, the check's outcome)."""
        wg = self._graph_for(self.training)
        rows = [("node", "module", "wide op", "strategy", "member input", "weight", "tuned (ms)", "why")]
        for node in wg.graph_module.graph.nodes:
            if "wide_op" not in node.meta:
                continue
            shapes = node.meta.get("wide_shapes", {})
            t = self._timings.get((self.training, node.name))
            rows.append((node.name, module_path(node) or "-", node.meta["wide_op"],
                         node.kwargs.get("strategy", "-"), str(shapes.get("input", "-")),
                         str(shapes.get("weight", "-")),
                         ", ".join(f"{k} {v:.3f}" for k, v in t.items()) if t else "-",
                         node.meta.get("wide_strategy_reason")
                         or ("only strategy" if "strategy" in node.kwargs else "-")))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        n_params = sum(p.numel() for p in self.parameters())
        head = (f"WideModel: {self.n} members of {type(self._template).__name__}, "
                f"{n_params // self.n:,} parameters per member, "
                f"{'train' if self.training else 'eval'} graph, "
                f"{len(rows) - 1} wide ops, "
                f"{sum(1 for n in wg.graph_module.graph.nodes if n.meta.get('wide_layout_conversion'))} "
                f"layout conversions (see report())")
        inputs = ", ".join(f"{i.name} [{_member_dims(i.member_shape)}]" for i in wg.inputs
                           if i.kind == "user" and i.member_shape is not None)
        head += f"\ninputs (one member's; B and * are dynamic, numbers fixed): {inputs or '-'}"
        head += f"\n{self._dynamic_dims(wg)}"
        constants = self.per_member_constants
        if constants:
            readers = self.__dict__.get("_constant_readers") or {}
            head += "\nper-member constants: " + "; ".join(
                f"{p} {v} ({', '.join(readers.get(p, [])) or 'read by no op'})" for p, v in constants.items())
        budget = wg.graph_module.meta.get("wide_tuning")
        if budget is not None:
            head += f"\n{budget.describe()}"
        if wg.member_tile and (budget is None or budget.tiles is None):
            head += f"\nmember tiles: chunks of {wg.member_tile} members (Note [Member tiles])"
        return "\n".join([head, *lines])

    def _dynamic_dims(self, wg: WideGraph) -> str:
        """The summary's line naming every dynamic dim of the graph's inputs and why it is."""
        from .fx.capture import _sequence_first

        parts, batch = [], (0, 1) if _sequence_first(self._template) else (0,)
        users = [i for i in wg.inputs if i.kind == "user"]
        ranges = self._ranges.get(id(wg)) or {}
        for k, inp in enumerate(users):
            for d, m in enumerate(inp.member_shape or ()):
                if m is not None:
                    continue
                why = ("since a call with size " + str(self._grown[(k, d)])) if (k, d) in self._grown else \
                    "batch" if d in batch else "dynamic at capture"
                lim = next(((lo, hi) for dd, lo, hi in ranges.get(inp.name, ()) if dd == d), None)
                if lim is not None:
                    why += f"; sizes {_size_range(*lim)}"
                parts.append(f"{inp.name} dim {d} ({why})")
        more = ("; a new size in another dim captures the graph again with that dim dynamic, once"
                if self._dynamic_shapes is None else "; set by compile(dynamic_shapes=...)")
        return f"dynamic dims (one member's): {', '.join(parts) or 'none'}{more}"

    @property
    def fallbacks(self) -> list[dict[str, str]]:
        """Ops of the current graph that run through the per-member fallback (op, node, source,
        how: "vmap" or "loop", reason)."""
        return list(self._graph_for(self.training).fallbacks)

    def report(self) -> str:
        """What the compiler did: each wide op's strategy, every fallback with its source line, and
        the layout conversions the plan keeps."""
        wg = self._graph_for(self.training)
        lines = [self.summary(), ""]
        conversions = [n for n in wg.graph_module.graph.nodes if n.meta.get("wide_layout_conversion")]
        lines.append(f"layout conversions: {len(conversions)}")
        lines.extend(f"  {n.name}: {n.meta['wide_layout_conversion']}" for n in conversions)
        lines.append(f"fallbacks: {len(wg.fallbacks)}" + ("" if wg.fallbacks else " (every op has a wide form)"))
        for fb in wg.fallbacks:
            lines.append(f"  {fb['op']} at node '{fb['node']}' ({fb['how']}): {fb['reason']}; {fb['source']}")
        return "\n".join(lines)
