"""How a compile cache entry pickles: the graphs of a compiled program as tables of nodes, rebuilt
node by node at load, operators by name, and a :class:`~wide_compiler.fx.widen.WideGraph` as its
fields (Note [The compile cache] in fx/compile_cache.py).

Note [Graphs as node tables]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
How a graph is stored. An ``fx.GraphModule`` pickles by regenerating its code, which loses node
metadata, and its nodes are a linked list that plain pickling walks recursively. So each graph is
written as a table of nodes (op, name, target, arguments with nodes named, metadata) and rebuilt
node by node (names kept, so ``strategies``, ``summary()`` and ``keep_strategies`` see what a fresh
compile gives), recursively for the bodies of higher-order regions (``wrap_with_set_grad_enabled``,
``wrap_with_autocast``: fx/rules/regions.py's ``Region``) and the tiled graph. Operators are stored
by name (``torch.ops.<ns>.<op>.<overload>``, ``torch.ops.higher_order.<name>``) and looked up at
load, so the ``wide`` ops of the running extension are the ones called. Metadata kept: every
``wide_*`` key, ``stack_trace`` (the user's source line in error messages and the fallback
report) and ``nn_module_stack`` (module paths; the classes as their names); the fake values
(``val``, ``tensor_meta``) are dropped: nothing reads them after compiling. A tuning spec's
``make`` (a closure measuring the op) is replaced by a stub that refuses to run: a cached graph
is never measured again (its picks are final; a recapture measures nothing either). A graph whose
pickling fails (an object that does not pickle: a lambda in a registered form...) is simply not
cached (logged at DEBUG).
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import types
from typing import Any

import torch
from torch import fx, nn

from .context import TuneSpec
from .widen import GraphInput, WideGraph

__all__: list[str] = []


@dataclasses.dataclass(frozen=True)
class _NodeRef:
    name: str


def _op_overload(namespace: str, name: str, overload: str) -> Any:
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def _op_packet(namespace: str, name: str) -> Any:
    return getattr(getattr(torch.ops, namespace), name)


def _higher_order(name: str) -> Any:
    return getattr(torch.ops.higher_order, name)


def _not_measured(n: int, options: dict) -> dict:
    raise RuntimeError("wide_compiler: this graph came from the compile cache: its strategies are final and "
                       "are not measured again (Note [The compile cache])")


def _plain(v: Any) -> Any:
    """fx's immutable containers as plain ones (they pickle as their base types' copies)."""
    if isinstance(v, (list, tuple)):
        items = [_plain(x) for x in v]
        return items if isinstance(v, list) else (type(v)(*items) if hasattr(v, "_fields") else tuple(items))
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, slice):
        return slice(_plain(v.start), _plain(v.stop), _plain(v.step))
    return v


def _meta(meta: dict) -> dict:
    out = {}
    for k, v in meta.items():
        if k.startswith("wide_") or k == "stack_trace":
            out[k] = v
        elif k == "nn_module_stack" and isinstance(v, dict):
            out[k] = {key: (entry[0], entry[1] if isinstance(entry[1], str) else
                            f"{getattr(entry[1], '__module__', '')}.{getattr(entry[1], '__qualname__', entry[1])}")
                      if isinstance(entry, tuple) and len(entry) == 2 else entry for key, entry in v.items()}
    tune = out.get("wide_tune")
    if isinstance(tune, TuneSpec):
        out["wide_tune"] = dataclasses.replace(tune, make=_not_measured)
    return out


def _graph_module_table(gm: fx.GraphModule) -> tuple:
    nodes = []
    attrs: dict[str, Any] = {}
    for node in gm.graph.nodes:
        if node.op in ("get_attr", "call_module"):
            attrs[node.target] = gm.get_submodule(node.target) if node.op == "call_module" else \
                _get_attr(gm, node.target)
        nodes.append((node.op, node.name, node.target, _plain(node.args), _plain(node.kwargs), _meta(node.meta)))
    codegen = gm.graph._codegen
    return (type(gm).__name__, nodes, attrs, codegen if type(codegen) is not fx.graph.CodeGen else None,
            dict(gm.meta))


def _get_attr(gm: nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _rebuild_graph_module(class_name: str, nodes: list, attrs: dict, codegen: Any, meta: dict) -> fx.GraphModule:
    graph = fx.Graph()
    if codegen is not None:
        graph._codegen = codegen
    env: dict[str, fx.Node] = {}

    def resolve(a: Any) -> Any:
        return fx.node.map_aggregate(a, lambda x: env[x.name] if isinstance(x, _NodeRef) else x)

    for op, name, target, args, kwargs, node_meta in nodes:
        node = graph.create_node(op, target, resolve(args), resolve(kwargs), name=name)
        if node.name != name:
            raise ValueError(f"node {name!r} came back as {node.name!r}")
        node.meta.update(node_meta)
        env[name] = node
    root = nn.Module()
    for target, value in attrs.items():
        *parents, last = target.split(".")
        holder = root
        for part in parents:
            if not hasattr(holder, part):
                holder.add_module(part, nn.Module())
            holder = getattr(holder, part)
        if isinstance(value, nn.Module):
            holder.add_module(last, value)
        elif isinstance(value, torch.Tensor):
            holder.register_buffer(last, value)
        else:
            setattr(holder, last, value)
    gm = fx.GraphModule(root, graph, class_name=class_name)
    gm.meta.update(meta)
    return gm


class _Pickler(pickle.Pickler):
    """Operators by name, graph modules as node tables, nodes by name (Note [Graphs as node tables])."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch._ops.OpOverload):
            ns, name = obj._schema.name.split("::")
            return _op_overload, (ns, name, obj._overloadname)
        if isinstance(obj, torch._ops.OpOverloadPacket):
            ns, name = obj._qualified_op_name.split("::")
            return _op_packet, (ns, name)
        if isinstance(obj, torch._ops.HigherOrderOperator):
            return _higher_order, (obj.name(),)
        if isinstance(obj, fx.GraphModule):
            return _rebuild_graph_module, _graph_module_table(obj)
        if isinstance(obj, fx.Node):
            return _NodeRef, (obj.name,)
        if isinstance(obj, (torch.SymInt, torch.SymFloat, torch.SymBool)) or type(obj).__name__ == "FakeTensor":
            raise pickle.PicklingError(f"a symbolic or fake value ({type(obj).__name__}) in the graph")
        if isinstance(obj, (types.LambdaType, types.FunctionType)) and (
                "<lambda>" in obj.__qualname__ or "<locals>" in obj.__qualname__):
            raise pickle.PicklingError(f"a local function {obj.__qualname__}")
        return NotImplemented


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def _wide_graph_state(wg: WideGraph) -> dict:
    fields = {f.name: getattr(wg, f.name) for f in dataclasses.fields(wg)}
    fields["inputs"] = [(i.kind, i.name, i.node.name, i.member_shape, i.sample_value) for i in wg.inputs]
    fields["constant_table"] = None  # the model makes it from the plan
    return fields


def _wide_graph(fields: dict) -> WideGraph:
    gm = fields["graph_module"]
    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    fields = dict(fields, inputs=[GraphInput(kind, name, placeholders[node], shape, value)
                                  for kind, name, node, shape, value in fields["inputs"]])
    return WideGraph(**fields)
