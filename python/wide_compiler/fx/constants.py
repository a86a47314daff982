"""Per-member constants: members that differ only in scalar hyperparameters fuse.

Note [Per-member constants]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
A sweep varies ``nn.Dropout(p)``, a LeakyReLU slope, a norm's eps or a user's ``self.temperature``
between members whose program is otherwise the same. The member check (fx/member_checks.py
``check_members``) lets through module attributes that are Python numbers, at least one a float,
and returns them as ``{attribute path: (member 0's value, ..., member N-1's)}``; integers (sizes),
booleans (flags) and everything else still refuse.

Export bakes such a float into the graph as an argument (``aten.dropout(x, 0.1, True)``,
``aten.div.Tensor(x, 2.0)``). :func:`plan_constants` captures member 0's program again with the
constants set to every other member's values (one *probe* per distinct configuration, at most
:data:`MAX_PROBES`) and aligns the probes with member 0's graph node by node:

* a probe with other ops, other tensor arguments or other non-float arguments (the constant picks
  a branch, a size, an int) is refused, naming the member, the attribute and both values;
* a float argument that differs is *per member*: its node is widened by its per-member form
  (fx/rules/_constants.py) with a ``[N]`` tensor in place of the scalar, broadcast per member.

The ``[N]`` tensors are buffers of the WideModel, float64 so ``unfuse()`` gives back the values
exactly (cast to the dtype of the op's input at run time, so ``.to(torch.float64)`` after compiling
computes in float64; ``.half()`` rounds them as it rounds every floating buffer). One buffer per
attribute, ``_per_member.<attribute path>``, *persistent* (a checkpoint keeps the sweep; ``.to()`` moves it; ``unfuse()``/``member(i)``
set each member's attribute from it), read live by an argument that is the attribute itself (say
``p`` of dropout). An argument computed from constants (``x * (2 * self.scale)``) reads its own
non-persistent buffer ``_per_member._derived.<node>_<argument>``, its values taken from the probes
(fixed at compile time). Constants no node reads (a stored ``self.lr``) need no graph change and
are only given back by ``unfuse()``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import fx
from torch.export import ExportedProgram

from ..errors import ArchitectureMismatchError
from .member_checks import _describe, with_constants
from .source import source_line

__all__ = ["MAX_PROBES", "ConstantPlan", "plan_constants"]

log = logging.getLogger(__name__)

MAX_PROBES = 8  # distinct member configurations traced; more are covered by direct reads only
BUFFER_ROOT = "_per_member"


@dataclasses.dataclass
class ConstantPlan:
    """What :func:`plan_constants` found."""

    constants: dict[str, tuple]  # attribute path -> every member's value
    # node name (member graph) -> {schema argument name: buffer name}
    args: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    # buffer name -> (every member's value, persistent)
    buffers: dict[str, tuple[tuple[float, ...], bool]] = dataclasses.field(default_factory=dict)
    # attribute path -> what reads it ("aten.dropout at node 'dropout'")
    readers: dict[str, list[str]] = dataclasses.field(default_factory=dict)

    def describe(self) -> str:
        parts = []
        for path, values in self.constants.items():
            used = ", ".join(self.readers.get(path, [])) or "read by no op of the graph"
            parts.append(f"{path} = {list(values)} ({used})")
        return "; ".join(parts)


def buffer_name(path: str) -> str:
    return f"{BUFFER_ROOT}.{path}"


def _named_args(node: fx.Node) -> dict[str, Any]:
    """A call node's arguments by schema name (positional index for targets without a schema)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return {str(k): a for k, a in enumerate(node.args)} | dict(node.kwargs)
    out = {}
    for k, a in enumerate(schema.arguments):
        if k < len(node.args) and not a.kwarg_only:
            out[a.name] = node.args[k]
        elif a.name in node.kwargs:
            out[a.name] = node.kwargs[a.name]
        elif a.has_default_value():  # export leaves out an argument equal to its default
            out[a.name] = a.default_value
    return out


def _is_float(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _nodes(ep: ExportedProgram) -> list[fx.Node]:
    return [n for n in ep.graph.nodes if n.op in ("call_function", "output", "placeholder", "get_attr")]


def plan_constants(model: torch.nn.Module, ep: ExportedProgram, trace: Callable[[torch.nn.Module], ExportedProgram],
                   constants: dict[str, tuple], opaque_paths: dict[str, str] | None = None) -> ConstantPlan:
    """Trace ``model`` (member 0's capture template, captured as ``ep``) with the per-member
    ``constants`` of the other members and find the graph arguments they change (Note
    [Per-member constants]); ``trace(model)`` captures as ``ep`` was. Raises
    :class:`ArchitectureMismatchError` when a constant changes the program, naming the member,
    the attribute and both values."""
    plan = ConstantPlan(dict(constants))
    if not constants:
        return plan
    n = len(next(iter(constants.values())))
    for path in constants:
        for opaque in (opaque_paths or {}).values():
            if path.startswith(opaque + "."):
                j = next(j for j, v in enumerate(constants[path]) if v != constants[path][0])
                raise ArchitectureMismatchError(
                    f"member {j}: {path} is {_describe(constants[path][j])}, member 0 has "
                    f"{_describe(constants[path][0])} (inside the registered module {opaque!r}, whose wide "
                    "form is built from the members as they are; per-member constants are made only for "
                    "captured code)")
    paths = list(constants)
    config = [tuple(constants[p][j] for p in paths) for j in range(n)]
    probes: dict[tuple, ExportedProgram] = {config[0]: ep}
    first_member = {config[0]: 0}
    for j in _probe_order(config, len(paths)):
        if config[j] in probes or len(probes) - 1 >= MAX_PROBES:
            continue
        traced = with_constants(model, constants, j)
        try:
            probes[config[j]] = trace(traced)
        except Exception as e:  # noqa: BLE001 -- the member's program cannot be captured as member 0's
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise _changed(constants, paths, config, j, f"tracing with them fails ({type(e).__name__}: {first})") from e
        first_member[config[j]] = j
    ref_nodes = _nodes(ep)
    per_probe = {cfg: _nodes(p) for cfg, p in probes.items()}
    for cfg, nodes in per_probe.items():
        j = first_member[cfg]
        if len(nodes) != len(ref_nodes):
            raise _changed(constants, paths, config, j, f"the traced program has {len(nodes)} nodes, "
                                                        f"member 0's {len(ref_nodes)}")
        for a, b in zip(ref_nodes, nodes):
            if (a.op, a.target) != (b.op, b.target):
                raise _changed(constants, paths, config, j, f"node '{a.name}' ({source_line(a)}) is "
                                                            f"{b.target}, member 0's is {a.target}")
    for k, node in enumerate(ref_nodes):
        if node.op == "get_attr":  # the body of a region (autocast, no_grad): must be the same
            body = getattr(ep.graph_module, node.target, None)
            for cfg, nodes in per_probe.items():
                other = getattr(probes[cfg].graph_module, nodes[k].target, None)
                if isinstance(body, fx.GraphModule) and (not isinstance(other, fx.GraphModule)
                                                         or body.code != other.code):
                    raise _changed(constants, paths, config, first_member[cfg],
                                   f"the region '{node.target}' ({source_line(node)}) differs (a constant read "
                                   "inside an autocast or no_grad block cannot be per member)")
            continue
        if node.op != "call_function":
            if node.op == "output":
                for cfg, nodes in per_probe.items():
                    if _plain(node.args) != _plain(nodes[k].args):
                        raise _changed(constants, paths, config, first_member[cfg], "the outputs differ")
            continue
        ref_args = _named_args(node)
        for cfg, nodes in per_probe.items():
            if cfg == config[0]:
                continue
            got = _named_args(nodes[k])
            for name in ref_args.keys() | got.keys():
                want, have = ref_args.get(name), got.get(name)
                if _plain(want) == _plain(have):
                    continue
                if not (_is_float(want) and _is_float(have) and float in (type(want), type(have))):
                    raise _changed(constants, paths, config, first_member[cfg],
                                   f"argument {name!r} of {node.target} at node '{node.name}' ({source_line(node)}) "
                                   f"becomes {have!r} instead of {want!r}: not a float, it changes the program "
                                   "(a size, a shape or a flag)")
                plan.args.setdefault(node.name, {})[name] = ""  # filled in below
    from .rules._constants import FORMS  # the per-member forms (imports the widen pass)

    for node_name, names in plan.args.items():
        k = next(i for i, nd in enumerate(ref_nodes) if nd.name == node_name)
        node = ref_nodes[k]
        if node.target not in FORMS:
            j = next(j for j in range(1, n) if config[j] != config[0])
            raise _changed(constants, paths, config, j,
                           f"they change argument(s) {sorted(names)} of {_op(node)} at node '{node.name}' "
                           f"({source_line(node)}), which has no per-member form (per-member forms: dropout, "
                           "leaky_relu, elu, celu, softplus, hardtanh, clamp, mul/div/add/sub/rsub/pow by a scalar, "
                           "layer_norm and rms_norm eps); make the constant the same for every member, or keep it in "
                           "a buffer (a tensor) instead of a Python float")
        for name in names:
            by_cfg = {cfg: _named_args(nodes[k]).get(name) for cfg, nodes in per_probe.items()}
            probed = [by_cfg.get(config[j]) for j in range(n)]
            direct = next((p for p in paths if all(v is None or v == constants[p][j] for j, v in enumerate(probed))),
                          None)
            if direct is not None:
                names[name] = buffer_name(direct)
                plan.readers.setdefault(direct, []).append(f"{_op(node)} at node '{node.name}'")
                continue
            if any(v is None for v in probed):
                j = next(j for j, v in enumerate(probed) if v is None)
                raise _changed(constants, paths, config, j,
                               f"argument {name!r} of {node.target} at node '{node.name}' ({source_line(node)}) is "
                               f"computed from them, and more than {MAX_PROBES} distinct member configurations "
                               "would have to be traced to know every member's value; use the constant directly "
                               "in the op")
            buf = f"{BUFFER_ROOT}._derived.{node_name}_{name}"
            names[name] = buf
            plan.buffers[buf] = (tuple(float(v) for v in probed), False)
            varying = [p for p in paths if len(set(constants[p])) > 1]
            for p in varying:
                plan.readers.setdefault(p, []).append(f"{_op(node)} at node '{node.name}' (computed)")
    for p in paths:
        plan.buffers[buffer_name(p)] = (tuple(float(v) for v in constants[p]), True)
    untraced = sorted({j for j in range(n) if config[j] not in probes})
    log.info("wide_compiler: per-member constants (%d probe(s) traced%s): %s", len(probes) - 1,
             f"; members {untraced} not traced with their own values: their arguments read the constants "
             "directly" if untraced else "", plan.describe())
    return plan


def _probe_order(config: list[tuple], k: int) -> list[int]:
    """Members to trace, first those with each constant's smallest and largest value (a branch
    on a threshold shows there), then the rest in member order."""
    numeric = [j for j in range(1, len(config)) if all(isinstance(v, (int, float)) for v in config[j])]
    first = []
    for a in range(k):
        if numeric:
            first += [min(numeric, key=lambda j: config[j][a]), max(numeric, key=lambda j: config[j][a])]
    return list(dict.fromkeys([*first, *range(1, len(config))]))


def _op(node: fx.Node) -> str:
    t = node.target
    return f"aten.{t.__name__}" if isinstance(t, torch._ops.OpOverload) and t.namespace == "aten" else str(t)


def _plain(v: Any) -> Any:
    """Arguments with nodes replaced by their names (comparable across graphs)."""
    return repr(fx.node.map_arg(v, lambda a: f"%{a.name}"))


def _changed(constants: dict[str, tuple], paths: list[str], config: list[tuple], j: int,
             why: str) -> ArchitectureMismatchError:
    differ = [p for k, p in enumerate(paths) if config[j][k] != config[0][k]]
    what = "; ".join(f"{p} is {_describe(constants[p][j])}, member 0 has {_describe(constants[p][0])}" for p in differ)
    if why.startswith("they change"):  # no per-member form for the op that reads them
        return ArchitectureMismatchError(f"member {j}: {what}, and {why}")
    return ArchitectureMismatchError(
        f"member {j}: {what}, and that changes the traced program: {why}. Float attributes that differ "
        "between members become per-member values only where the program is otherwise the same (an op's "
        "scalar argument); a constant that picks a branch or a size must be the same for every member")
