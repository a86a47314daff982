"""Per-member constants: members that differ only in scalar hyperparameters fuse.

Note [Per-member constants]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
A sweep varies ``nn.Dropout(p)``, a LeakyReLU slope, a norm's eps or a user's ``self.temperature``
between members whose program is otherwise the same. The member check (fx/member_checks.py
``check_members``) lets through module attributes that are Python numbers, at least one a float,
and returns them as ``{attribute path: (member 0's value, ..., member N-1's)}``; integers (sizes),
booleans (flags) and everything else still refuse. Two values differ unless they are the same type
and value (fx/state_reads.py ``same_value``, not ``==``): ``-0.0`` is not ``0.0`` (``x / s`` gives
``-inf`` for one, ``inf`` for the other), ``1`` is not ``1.0`` and ``True`` is not ``1.0`` (refused:
a boolean is a flag), and a NaN in every member is one shared value.

Export bakes such a float into the graph as an argument (``aten.dropout(x, 0.1, True)``,
``aten.div.Tensor(x, 2.0)``), or into a tensor the forward makes (``torch.tensor(self.s)``, a
*lifted constant*). The program is *proved* for every member, not sampled: :func:`plan_constants`
captures member 0's program again with the constants set to each other distinct configuration of
values (one *probe* per distinct configuration, every one of them: members that share a
configuration share its probe; a cheaper proof, capturing once with the attributes as symbolic
inputs, would refuse every legitimate use of a Python float, ``F.dropout(x, self.p)`` included)
and aligns each probe with member 0's graph node by node:

* a probe with other ops, other tensor arguments or other non-float arguments (the constant picks
  a branch, a size, an int: ``h * s if s != 0 else tanh(h)``, ``if 0.2 < p < 0.5``) is refused,
  naming the first member with that configuration, the attribute and both values;
* a float argument that differs is *per member*: its node is widened by its per-member form
  (fx/rules/_constants.py, fx/rules/_constant_tensors.py) with a ``[N]`` tensor in place of the
  scalar, broadcast per member;
* a lifted constant whose values differ (same shape and dtype) is per member too: each of its
  elements is a ``[N]`` tensor, and the ``lift_fresh_copy`` that reads it is widened to an
  ``[N, ...]`` tensor of each member's own values (Note [Per-member tensor constants] in
  fx/rules/_constant_tensors.py); read by anything else, or with more than
  :data:`MAX_TENSOR_ELEMENTS` elements, it is refused.

The ``[N]`` tensors are buffers of the WideModel, float64 so ``unfuse()`` gives back the values
exactly (cast to the dtype of the op's input at run time, so ``.to(torch.float64)`` after compiling
computes in float64; ``.half()`` rounds them as it rounds every floating buffer). One buffer per
attribute, ``_per_member.<attribute path>``, *persistent* (``.to()`` moves it; ``unfuse()``/``member(i)``
set each member's attribute from it), read live by an argument that equals the attribute itself for
every member (say ``p`` of dropout). An argument computed from constants (``x * (2 * self.scale)``,
``round(self.s, 2)``, an element of ``torch.tensor(self.s)`` in float32) reads its own
non-persistent buffer ``_per_member._derived.<node>_<argument>_<digest>``, every member's value
taken from the probe of that member's own configuration (fixed at compile time; the digest, of the
value per configuration, keeps the train and eval graphs' buffers apart where a node name means
different things in the two). Constants no node reads (a stored ``self.lr``) need no graph change and
are only given back by ``unfuse()``.

The configurations a model was compiled for are the only ones proved: the paths that change a
member's constants after compiling keep every member inside them. ``copy_member_weights`` copies a
member's configuration with its weights (:func:`copy_member_constants`), and
``wide_compiler.distributed.save_members``/``load_members`` save each member's constants and load
them only where the receiving model holds that very configuration (:func:`check_member_constants`,
:func:`set_member_constants`): a configuration no member of the receiver had at its compile, or a
per-member value the receiver shares, is refused, naming the member, the attribute and the values.
Not covered here: writing a ``_per_member`` buffer by hand and ``WideModel.load_state_dict`` of a
wide state dict with other constants (model.py) change the attributes' buffers alone, so a derived
argument keeps its compiled values and a new value is not proved; :meth:`ConstantPlan.unproved`
is the check for them (the plan's ``proved`` configurations against the model's buffers). After
any of these moves, a capture (new inputs, the other train/eval mode) traces the values the members
hold then, not those of the first compile (Note [Constants the members hold now] in
model_constants.py), and ``write_back`` writes them into the user's modules.

Note [Every configuration's guards]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A probe proves a configuration's program equal to member 0's *at the sample*, and export's guards
(Note [Guards] in fx/guards.py) say for which other inputs that capture holds. A forward whose
branch reads a size and a constant together (``h * s if T * s < 2 else tanh(h)``, ``T >= self.min_len``,
``B >= self.s``, ``h[:, :T // 2] if T / s > 3 else h``) gives each configuration its own guards:
member 0's (s = 0.1) hold for ``T < 20``, member 2's (s = 0.3) for ``T < 6.67`` only. The wide graph
runs every member, so it may run only where *every* configuration's capture holds: the guards of
the graph are the conjunction of member 0's and each probe's (:func:`conjoin_guards`; the pipeline's
``check_programs`` pass makes them, so a first compile, a capture for new inputs and a recapture
with a dim made dynamic each prove and guard every configuration anew, with that capture's sample
and dims). A probe's guard member 0's do not have is kept with the configuration named (``T <= 6
(member 2's constants: s = 0.3)``), so a call outside it captures a graph for its inputs, where
that configuration's probe either follows member 0's program again (its guards then hold there)
or is refused, naming the member, the attribute and what differs (the failed guard in the
message); it never runs member 0's branch for member 2. Besides the shape guards and ranges, a dim
a probe fixed that member 0's capture kept dynamic becomes an equality guard, and the state a
probe's code read (flags, layout, device, grad mode, module globals: Note [State a forward reads])
is guarded as member 0's is. Cost at the call: only the guards member 0's do not already have
(the same text is kept once), in the same generated conjunction.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from ..errors import ArchitectureMismatchError
from .member_checks import _MODULE_INTERNALS, _describe, with_constants
from .source import source_line

__all__ = ["EARLIER_AT_MOST", "MAX_TENSOR_ELEMENTS", "ConstantPlan", "check_member_constants", "conjoin_guards",
           "constant_key", "copy_member_constants", "member_constants", "member_value", "plan_constants",
           "set_member_constants"]

log = logging.getLogger(__name__)

BUFFER_ROOT = "_per_member"
DERIVED_ROOT = f"{BUFFER_ROOT}._derived"
# a tensor made from a per-member constant in the forward is per member element by element (one
# [N] buffer each): small tensors only (a scalar, a few coefficients); larger ones are refused
MAX_TENSOR_ELEMENTS = 64
# the ops that read a lifted constant and can make it per member (fx/rules/_constant_tensors.py)
_LIFTS = (torch.ops.aten.lift_fresh_copy.default, torch.ops.aten.lift_fresh.default)


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
    configurations: int = 1  # distinct configurations of the constants, each traced (member 0's included)
    # the configurations traced, as value keys (fx/constants.py ``constant_key`` of float(value)) in the
    # order of ``constants``: what the graph is proved for
    proved: frozenset = frozenset()
    # Note [Every configuration's guards]: (label naming the configuration, the guards of its probe)
    # of every configuration traced; for :func:`conjoin_guards`, not kept (a compile cache keeps the
    # conjoined guards of the graph)
    probe_guards: list = dataclasses.field(default_factory=list, repr=False, compare=False)
    # Note [Configurations proved before]: configurations no member held at planning, proved too
    # ({attribute path: value} each), and their derived buffers' values by configuration key
    earlier: list = dataclasses.field(default_factory=list)
    earlier_table: dict = dataclasses.field(default_factory=dict)

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "probe_guards"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update({"probe_guards": [], **state})

    def unproved(self, root: nn.Module) -> dict[int, dict[str, float]]:
        """The members of ``root`` (the WideModel running this plan's graph) whose constants, as
        its ``_per_member`` buffers hold them now, are not a configuration this plan proved:
        ``{member: {attribute path: value}}`` (empty when every member is proved)."""
        from .state import get_tensor

        paths = list(self.constants)
        if not paths:
            return {}
        rows = [get_tensor(root, buffer_name(p)).detach().double().cpu().tolist() for p in paths]
        out = {}
        for j in range(len(rows[0])):
            if tuple(constant_key(float(r[j])) for r in rows) not in self.proved:
                out[j] = {p: r[j] for p, r in zip(paths, rows)}
        return out

    def table(self) -> tuple[list[str], dict[tuple, dict[str, float]]] | None:
        """Note [Per-member constants at the call]: ``(attribute paths, {configuration key: {derived
        buffer: value}})`` for every configuration this plan proved, as compiled (a snapshot: later
        moves of members' constants do not change it); None without constants."""
        paths = list(self.constants)
        if not paths:
            return None
        derived = [name for name, (_, persistent) in self.buffers.items() if not persistent]
        by_key: dict[tuple, dict[str, float]] = {}
        for j in range(len(self.constants[paths[0]])):
            key = tuple(constant_key(float(self.constants[p][j])) for p in paths)
            by_key.setdefault(key, {name: self.buffers[name][0][j] for name in derived})
        for key, values in self.earlier_table.items():  # Note [Configurations proved before]
            by_key.setdefault(key, values)
        return paths, by_key

    def configurations_proved(self) -> list[dict[str, Any]]:
        """Every configuration this plan proved, ``{attribute path: value}`` each (the values as
        the members hold them: 1 and 1.0 differ), the members' and the earlier ones."""
        paths = list(self.constants)
        n = len(self.constants[paths[0]]) if paths else 0
        return [*({p: self.constants[p][j] for p in paths} for j in range(n)), *self.earlier]

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


def constant_key(v: Any) -> tuple[str, str]:
    """A constant's value as a configuration key: 1 and 1.0 differ (``torch.tensor(s)`` is int64 for
    one, float32 for the other), so do 0.0 and -0.0; every nan is the same."""
    return type(v).__name__, repr(v)


def _lifted(ep: ExportedProgram) -> dict[str, torch.Tensor]:
    """The lifted tensor constants of ``ep`` by placeholder name."""
    return {s.arg.name: ep.constants[s.target] for s in ep.graph_signature.input_specs
            if s.kind == InputKind.CONSTANT_TENSOR and s.target in ep.constants
            and isinstance(ep.constants[s.target], torch.Tensor)}


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same shape, dtype and bits (``-0.0`` is not ``0.0``: ``1 / torch.tensor(s)`` is -inf for one,
    probe 9 of issue 44, P9-18; every NaN the same, as values compare elsewhere)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        a, b = (torch.where(t.isnan(), torch.nan, t) if t.is_floating_point() else t for t in (a, b))
        return bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    return bool(torch.equal(a, b))


# Note [Configurations proved before]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Each graph is proved for the configurations its plan traced, and a member may be set only to one
# of those (Note [Per-member constants at the call] in model_constants.py). A graph made later
# (the other train/eval mode at its first call, a capture for new sizes) traced the members'
# configurations of that moment only: after copy_member_weights (a PBT exploit) had given member 0
# member 1's constants, restoring the state saved before was refused though the first graph had
# proved it (probes 9 and 10 of issue 44, P9-15, P10-5), depending on when each graph was made. So
# a later plan also traces the configurations the model's earlier graphs proved (``earlier``, as
# extra columns no member holds: each traced and aligned as a member's); their derived values go
# to ``earlier_table``. Where one of them cannot be proved for the new graph (it takes another
# branch there), the plan is made for the members' own configurations, as before: that
# configuration is then refused for this graph, clearly, when a member is set to it.
EARLIER_AT_MOST = 32  # configurations carried from earlier graphs (each costs a trace)


def plan_constants(model: torch.nn.Module, ep: ExportedProgram, trace: Callable[[torch.nn.Module], ExportedProgram],
                   constants: dict[str, tuple], opaque_paths: dict[str, str] | None = None,
                   guards_of: Callable[[ExportedProgram], Any] | None = None,
                   earlier: Sequence[dict[str, Any]] = ()) -> ConstantPlan:
    """:func:`_plan`, and the configurations ``earlier`` (``{attribute path: value}``, proved by
    other graphs of the model) too where they can be proved (Note [Configurations proved before])."""
    n = len(next(iter(constants.values()))) if constants else 0
    seen = {tuple(constant_key(constants[p][j]) for p in constants) for j in range(n)}
    extra = []
    for cfg in earlier:
        key = tuple(constant_key(cfg.get(p)) for p in constants)
        if set(cfg) == set(constants) and key not in seen:
            seen.add(key)
            extra.append(cfg)
    extra = extra[-EARLIER_AT_MOST:]
    if extra:
        wider = {p: (*constants[p], *(cfg[p] for cfg in extra)) for p in constants}
        try:
            plan = _plan(model, ep, trace, wider, opaque_paths, guards_of)
        except Exception as e:  # noqa: BLE001 -- not provable for this graph: the members' own, as before
            log.info("wide_compiler: per-member constants: configuration(s) proved by the model's other graphs "
                     "are not proved for this one (%s); planned for the members' own",
                     str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
        else:
            return _keep_members(plan, n, extra)
    return _plan(model, ep, trace, constants, opaque_paths, guards_of)


def _keep_members(plan: ConstantPlan, n: int, extra: list[dict[str, Any]]) -> ConstantPlan:
    """A plan made with ``extra`` configurations as columns after the ``n`` members': the
    members' columns kept, the others' derived values moved to ``earlier_table``."""
    paths = list(plan.constants)
    derived = [name for name, (_, persistent) in plan.buffers.items() if not persistent]
    for j, cfg in enumerate(extra, start=n):
        key = tuple(constant_key(float(plan.constants[p][j])) for p in paths)
        plan.earlier_table.setdefault(key, {name: plan.buffers[name][0][j] for name in derived})
    plan.earlier = list(extra)
    plan.constants = {p: tuple(v[:n]) for p, v in plan.constants.items()}
    plan.buffers = {name: (tuple(v[:n]), persistent) for name, (v, persistent) in plan.buffers.items()}
    return plan


def _plan(model: torch.nn.Module, ep: ExportedProgram, trace: Callable[[torch.nn.Module], ExportedProgram],
          constants: dict[str, tuple], opaque_paths: dict[str, str] | None = None,
          guards_of: Callable[[ExportedProgram], Any] | None = None) -> ConstantPlan:
    """Trace ``model`` (member 0's capture template, captured as ``ep``) with every other distinct
    configuration of the per-member ``constants`` and find the graph arguments and tensor
    constants they change (Note [Per-member constants]); ``trace(model)`` captures as ``ep`` was.
    With ``guards_of`` (a probe's :class:`~wide_compiler.fx.guards.Guards`, as ``ep``'s were made)
    the plan keeps each probe's guards in ``probe_guards`` for :func:`conjoin_guards` (Note [Every
    configuration's guards]). Raises :class:`ArchitectureMismatchError` when a constant changes the program, naming the
    first member with that configuration, the attribute and both values."""
    plan = ConstantPlan(dict(constants))
    if not constants:
        return plan
    n = len(next(iter(constants.values())))
    for path in constants:
        for opaque in (opaque_paths or {}).values():
            if path.startswith(opaque + "."):
                j = next(j for j, v in enumerate(constants[path]) if constant_key(v) != constant_key(constants[path][0]))
                raise ArchitectureMismatchError(
                    f"member {j}: {path} is {_describe(constants[path][j])}, member 0 has "
                    f"{_describe(constants[path][0])} (inside the registered module {opaque!r}, whose wide "
                    "form is built from the members as they are; per-member constants are made only for "
                    "captured code)")
    paths = list(constants)
    config = [tuple(constants[p][j] for p in paths) for j in range(n)]
    keys = [tuple(constant_key(v) for v in cfg) for cfg in config]
    first_member: dict[tuple, int] = {}
    for j, key in enumerate(keys):
        first_member.setdefault(key, j)
    ref_nodes = _nodes(ep)
    ref_lifted = _lifted(ep)
    ref_args = {k: _named_args(nd) for k, nd in enumerate(ref_nodes) if nd.op == "call_function"}
    # ``ep`` is the program of the template's own values: member 0's at the first compile, and
    # perhaps no member's after copy_member_weights or load_members changed member 0's (a later
    # compile of the other train/eval mode): every member configuration but that one is traced
    base = tuple(constant_key(_attribute(model, p)) for p in paths)
    # configuration -> {(node index, argument name): value} where it differs from ``ep``'s
    # (argument name "value" of a placeholder: a lifted constant's tensor)
    differs: dict[tuple, dict[tuple[int, str], Any]] = {base: {}}
    start = time.perf_counter()
    for key, j in first_member.items():
        if key == base:
            continue
        before = {p: _attribute(model, p) for p in paths}
        try:  # on the template itself (the compiler's own copy, no deep copy per configuration), restored after
            probe = trace(with_constants(model, constants, j, copy_model=False))
        except Exception as e:  # noqa: BLE001 -- the member's program cannot be captured as member 0's
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise _changed(constants, paths, config, j, f"tracing with them fails ({type(e).__name__}: {first})") from e
        finally:
            for p, v in before.items():
                _set_attribute(model, p, v)
        differs[key] = _align(ep, ref_nodes, ref_args, ref_lifted, probe,
                              lambda why, j=j: _changed(constants, paths, config, j, why))
        if guards_of is not None:  # Note [Every configuration's guards]
            plan.probe_guards.append((_label(constants, paths, config, j), guards_of(probe)))
    plan.configurations = len(first_member)
    plan.proved = frozenset(tuple(constant_key(float(v)) for v in cfg) for cfg in config)
    elapsed = time.perf_counter() - start
    from .rules import _constant_tensors  # noqa: F401 -- registers the forms of made tensors
    from .rules._constants import FORMS, refused_values

    varying = [p for p in paths if len(set(map(constant_key, constants[p]))) > 1]
    wanted = sorted({k_name for d in differs.values() for k_name in d})

    def first_differing(k_name: tuple[int, str]) -> int:
        return next(j for j in range(n) if k_name in differs[keys[j]])

    for k, name in wanted:
        node = ref_nodes[k]
        if node.op == "placeholder":
            _plan_lifted(plan, node, [differs[keys[j]].get((k, name), ref_lifted[node.name]) for j in range(n)],
                         keys, constants, paths, varying,
                         lambda why, k=k, name=name: _changed(constants, paths, config,
                                                              first_differing((k, name)), why))
            continue
        if node.target not in FORMS:
            raise _changed(constants, paths, config, first_differing((k, name)),
                           f"they change argument(s) {sorted(nm for kk, nm in wanted if kk == k)} of {_op(node)} at "
                           f"node '{node.name}' ({source_line(node)}), which has no per-member form (per-member "
                           "forms: dropout, leaky_relu, elu, celu, softplus, hardtanh, clamp, mul/div/add/sub/rsub/pow "
                           "by a scalar, layer_norm and rms_norm eps, full/full_like/new_full/scalar_tensor fill "
                           "values); make the constant the same for every member, or keep it in a buffer (a "
                           "tensor) instead of a Python float")
        values = [differs[keys[j]].get((k, name), ref_args[k].get(name)) for j in range(n)]
        refused = refused_values(node, name, values)  # a value its form cannot follow (a NaN hardtanh bound)
        if refused is not None:
            raise _changed(constants, paths, config, refused[0], refused[1])
        plan.args.setdefault(node.name, {})[name] = _buffer_for(
            plan, values, keys, constants, paths, varying, f"{node.name}_{name}",
            f"{_op(node)} at node '{node.name}'")
    for p in paths:
        plan.buffers[buffer_name(p)] = (tuple(float(v) for v in constants[p]), True)
    log.info("wide_compiler: per-member constants: %d distinct configuration(s) of %d member(s), each traced "
             "(%.2f s): %s", plan.configurations, n, elapsed, plan.describe())
    return plan


def _label(constants: dict[str, tuple], paths: list[str], config: list[tuple], j: int) -> str:
    """How a probe's guard names its configuration: ``member 2's constants: s = 0.3``."""
    differ = [p for k, p in enumerate(paths) if constant_key(config[j][k]) != constant_key(config[0][k])] or paths
    return f"member {j}'s constants: " + ", ".join(f"{p} = {constants[p][j]!r}" for p in differ)


def conjoin_guards(guards: Any, probes: list[tuple[str, Any]]) -> Any:
    """Note [Every configuration's guards]: ``guards`` (member 0's capture's
    :class:`~wide_compiler.fx.guards.Guards`) and every probe's in ``probes`` (``(label, Guards)``,
    :attr:`ConstantPlan.probe_guards`), as one :class:`~wide_compiler.fx.guards.Guards` that holds
    only where each of them does: member 0's guards, then each probe's guard member 0's lack (its
    shape guards and ranges, the dims it fixed), shown with its label; the state any of them read
    (flags, layout, device, grad mode, inputs' requires_grad, watched globals). The inputs (names,
    dtypes, ranks) are the same sample's for all. ``guards`` itself when no probe adds anything.

    >>> from wide_compiler.fx.guards import Guards
    >>> def over_x(code, shown):  # one float input x, rank 2, no dim fixed
    ...     return Guards(1, (torch.float32,), ((2, {}),), ("x",), (code,), (shown,))
    >>> both = conjoin_guards(over_x("s[0][1] < 20", "x.size()[1] < 20"),
    ...                       [("member 2's constants: s = 0.3", over_x("s[0][1] < 7", "x.size()[1] < 7"))])
    >>> both.shown
    ('x.size()[1] < 20', "x.size()[1] < 7 (member 2's constants: s = 0.3)")
    >>> both.holds((torch.zeros(1, 3, 6),)), both.holds((torch.zeros(1, 3, 8),))
    (True, False)
    """
    if guards is None or not probes:
        return guards
    code, shown = list(guards.code), list(guards.shown)
    seen = set(code)
    flags = dict(guards.flags)
    watched = {(m, q, name): (entry, owner) for entry, owner, (m, q, name, _) in
               zip(guards.watched, guards._owners or (None,) * len(guards.watched), guards.watched)}
    layout, device, grad_mode = guards.layout, guards.device, guards.grad_mode
    grads = guards.grads  # per input requires_grad, where the code reads it
    added = False  # (values are not compared: a watched value may be a tensor's reference)
    for label, g in probes:
        extra = []
        for k, (mine, theirs) in enumerate(zip(guards.fixed, g.fixed)):
            if guards.dtypes[k] is None or not isinstance(theirs, tuple) or not isinstance(mine, tuple):
                continue  # a non-tensor input: the sample's value for every configuration
            extra += [(f"s[{k}][{d}] == {v}", f"{guards.names[k]}.size()[{d}] == {v}")
                      for d, v in sorted(theirs[1].items()) if d not in mine[1]]
        extra += zip(g.code, g.shown)
        for c, s in extra:
            if c not in seen:
                seen.add(c)
                code.append(c)
                shown.append(f"{s} ({label})")
                added = True
        for key, value in g.flags:
            added |= key not in flags
            flags.setdefault(key, value)
        for entry, owner in zip(g.watched, g._owners or (None,) * len(g.watched)):
            added |= entry[:3] not in watched
            watched.setdefault(entry[:3], (entry, owner))
        added |= (not layout and bool(g.layout)) or (device is None and g.device is not None) or (
            grad_mode is None and g.grad_mode is not None) or (not grads and bool(g.grads))
        grads = grads or g.grads
        layout = layout or g.layout
        device = device if device is not None else g.device
        grad_mode = grad_mode if grad_mode is not None else g.grad_mode
    if not added:
        return guards
    return dataclasses.replace(guards, code=tuple(code), shown=tuple(shown), flags=tuple(flags.items()),
                               layout=layout, device=device, grad_mode=grad_mode, grads=grads,
                               watched=tuple(e for e, _ in watched.values()),
                               _owners=tuple(o for _, o in watched.values()), _fn=None, _each=None, _ns=None)


def _attribute(model: nn.Module, path: str) -> Any:
    mod_path, _, key = path.rpartition(".")
    return (model.get_submodule(mod_path) if mod_path else model).__dict__[key]


def _set_attribute(model: nn.Module, path: str, value: Any) -> None:
    mod_path, _, key = path.rpartition(".")
    setattr(model.get_submodule(mod_path) if mod_path else model, key, value)


def _align(ep: ExportedProgram, ref_nodes: list[fx.Node], ref_args: dict[int, dict], ref_lifted: dict,
           probe: ExportedProgram, changed: Callable[[str], Exception]) -> dict[tuple[int, str], Any]:
    """Align one probe with member 0's graph node by node: the same ops, the same regions, the
    same outputs, arguments equal but for floats, lifted constants of the same shape and dtype.
    Returns what differs: ``{(node index, argument name): the probe's value}``."""
    nodes = _nodes(probe)
    for a, b in zip(ref_nodes, nodes):  # the first op that differs names the branch taken
        if (a.op, a.target) != (b.op, b.target):
            raise changed(f"node '{a.name}' ({source_line(a)}) is {b.target} ({source_line(b)}), member 0's is "
                          f"{a.target}")
    if len(nodes) != len(ref_nodes):
        raise changed(f"the traced program has {len(nodes)} nodes, member 0's {len(ref_nodes)}")
    lifted = _lifted(probe)
    out: dict[tuple[int, str], Any] = {}
    for k, (node, other) in enumerate(zip(ref_nodes, nodes)):
        if node.op == "get_attr":  # the body of a region (autocast, no_grad): must be the same
            body = getattr(ep.graph_module, node.target, None)
            theirs = getattr(probe.graph_module, other.target, None)
            if isinstance(body, fx.GraphModule) and (not isinstance(theirs, fx.GraphModule)
                                                     or body.code != theirs.code):
                raise changed(f"the region '{node.target}' ({source_line(node)}) differs (a constant read "
                              "inside an autocast or no_grad block cannot be per member)")
            continue
        if node.op == "placeholder":
            if (node.name in ref_lifted) != (other.name in lifted):
                raise changed(f"input '{node.name}' is of another kind")
            if node.name in ref_lifted:
                want, have = ref_lifted[node.name], lifted[other.name]
                if want.shape != have.shape or want.dtype != have.dtype:
                    raise changed(f"the tensor constant '{node.name}' (read at {_readers(node)}) is "
                                  f"{list(have.shape)} {have.dtype}, member 0's {list(want.shape)} {want.dtype}")
                if not _same_tensor(want, have):
                    out[(k, "value")] = have.detach().clone()
            continue
        if node.op == "output":
            if _plain(node.args) != _plain(other.args):
                raise changed("the outputs differ")
            continue
        if _dtypes(node) != _dtypes(other):  # an int argument for one member, a float for another: int vs float math
            raise changed(f"{_op(node)} at node '{node.name}' ({source_line(node)}) gives {_dtypes(other)}, member 0's "
                          f"gives {_dtypes(node)}")
        want_args, got = ref_args[k], _named_args(other)
        for name in want_args.keys() | got.keys():
            want, have = want_args.get(name), got.get(name)
            if _plain(want) == _plain(have):
                continue
            if not (_is_float(want) and _is_float(have) and float in (type(want), type(have))):
                raise changed(f"argument {name!r} of {node.target} at node '{node.name}' ({source_line(node)}) "
                              f"becomes {have!r} instead of {want!r}: not a float, it changes the program "
                              "(a size, a shape or a flag)")
            out[(k, name)] = have
    return out


def _dtypes(node: fx.Node) -> list:
    """The dtypes of a node's tensor value(s) (None for a non-tensor)."""
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else [val]
    return [str(v.dtype).removeprefix("torch.") if isinstance(v, torch.Tensor) else None for v in vals]


def _readers(node: fx.Node) -> str:
    users = list(node.users)
    return ", ".join(f"{_op(u)} at node '{u.name}' ({source_line(u)})" for u in users[:2]) or "no node"


def _buffer_for(plan: ConstantPlan, values: list, keys: list[tuple], constants: dict[str, tuple], paths: list[str],
                varying: list[str], stem: str, reader: str) -> str:
    """The buffer an argument with every member's ``values`` reads: an attribute's own buffer when
    it is that attribute for every member, else a derived one (values from each member's probe)."""
    direct = next((p for p in paths if all(constant_key(float(v)) == constant_key(float(c)) for v, c in zip(values, constants[p]))),
                  None)
    if direct is not None:
        plan.readers.setdefault(direct, []).append(reader)
        return buffer_name(direct)
    by_config = sorted({keys[j]: constant_key(float(v)) for j, v in enumerate(values)}.items())
    digest = hashlib.sha1(repr(by_config).encode()).hexdigest()[:8]
    buf = f"{DERIVED_ROOT}.{stem}_{digest}"
    plan.buffers[buf] = (tuple(float(v) for v in values), False)
    for p in varying:
        plan.readers.setdefault(p, []).append(f"{reader} (computed)")
    return buf


def _plan_lifted(plan: ConstantPlan, node: fx.Node, values: list[torch.Tensor], keys: list[tuple],
                 constants: dict[str, tuple], paths: list[str], varying: list[str],
                 changed: Callable[[str], Exception]) -> None:
    """A lifted constant whose value differs between members: per member, element by element, at
    every ``lift_fresh_copy`` that reads it (Note [Per-member tensor constants] in
    fx/rules/_constant_tensors.py), or refused."""
    ref = values[0]
    where = _readers(node)
    if ref.is_complex() or ref.numel() > MAX_TENSOR_ELEMENTS:
        raise changed(f"the tensor constant '{node.name}' (read at {where}), {list(ref.shape)} {ref.dtype}, is made "
                      f"from them and differs between members; a per-member tensor constant is made only for real "
                      f"tensors of at most {MAX_TENSOR_ELEMENTS} elements: register the tensor as a buffer "
                      "(self.register_buffer) instead of making it in the forward")
    bad = next((u for u in node.users if u.target not in _LIFTS), None)
    if bad is not None:
        raise changed(f"the tensor constant '{node.name}' differs between members and is read by {_op(bad)} at node "
                      f"'{bad.name}' ({source_line(bad)}), which cannot take a per-member tensor constant; register "
                      "the tensor as a buffer (self.register_buffer) instead of making it in the forward")
    flat = [v.detach().reshape(-1).to(torch.float64).tolist() for v in values]
    for user in node.users:
        for after in user.users:  # export detaches the fresh copy in place: on the whole per-member copy
            if after.target is torch.ops.aten.detach_.default:
                plan.args.setdefault(after.name, {})
        names = plan.args.setdefault(user.name, {})
        for e in range(ref.numel()):
            names[f"self.{e}"] = _buffer_for(plan, [f[e] for f in flat], keys, constants, paths, varying,
                                             f"{user.name}_{e}", f"a tensor made at node '{user.name}'")


def _op(node: fx.Node) -> str:
    t = node.target
    return f"aten.{t.__name__}" if isinstance(t, torch._ops.OpOverload) and t.namespace == "aten" else str(t)


def _plain(v: Any) -> Any:
    """Arguments with nodes replaced by their names (comparable across graphs)."""
    return repr(fx.node.map_arg(v, lambda a: f"%{a.name}"))


def _changed(constants: dict[str, tuple], paths: list[str], config: list[tuple], j: int,
             why: str) -> ArchitectureMismatchError:
    differ = [p for k, p in enumerate(paths) if constant_key(config[j][k]) != constant_key(config[0][k])] or paths
    what = "; ".join(f"{p} is {_describe(constants[p][j])}, member 0 has {_describe(constants[p][0])}" for p in differ)
    if why.startswith("they change"):  # no per-member form for the op that reads them
        return ArchitectureMismatchError(f"member {j}: {what}, and {why}")
    return ArchitectureMismatchError(
        f"member {j}: {what}, and that changes the traced program: {why}. Float attributes that differ "
        "between members become per-member values only where the program is otherwise the same (an op's "
        "scalar argument); a constant that picks a branch or a size must be the same for every member")


# --- members' constants after compiling: member(i), copy_member_weights, checkpoints -------------
def _numbers(module: nn.Module) -> dict[str, Any]:
    """The Python numbers (not booleans) among the module attributes of ``module``'s tree, by
    attribute path as :func:`~wide_compiler.fx.member_checks.check_members` names them."""
    out = {}
    for name, m in module.named_modules(remove_duplicate=False):
        for key, v in m.__dict__.items():
            if key not in _MODULE_INTERNALS and _is_float(v):
                out[f"{name}.{key}" if name else key] = v
    return out


def _per_member_buffers(root: nn.Module) -> dict[str, torch.Tensor]:
    """Every ``_per_member`` buffer of ``root`` (the attributes' own and the derived ones), ``[N]``."""
    return {name: b for name, b in root.named_buffers() if name.startswith(BUFFER_ROOT + ".")}


def member_value(root: nn.Module, path: str, i: int) -> Any:
    """Member ``i``'s value of the per-member constant ``path`` of ``root`` (a
    :class:`~wide_compiler.WideModel`): the original Python value while the buffer still holds it
    (the same type's value and sign, :func:`constant_key`), else the buffer's value as a float."""
    from .state import get_tensor

    value = float(get_tensor(root, buffer_name(path))[i])
    original = root.__dict__["_constants"][path][i]
    return original if constant_key(float(original)) == constant_key(value) else value


def member_constants(root: nn.Module, i: int) -> dict[str, Any]:
    """Member ``i``'s Python number attributes (``{attribute path: value}``): the template's, with
    the per-member constants (Note [Per-member constants]) at member ``i``'s values. ``root`` is a
    :class:`~wide_compiler.WideModel`, ``i`` a member index of it."""
    out = _numbers(root._template)
    for path in root.__dict__.get("_constants") or {}:
        out[path] = member_value(root, path, i)
    return out


def check_member_constants(root: nn.Module, saved: Mapping[int, Mapping[str, Any]], label: Callable[[int], str],
                           source: str = "the checkpoint") -> dict[int, tuple[int, dict[str, Any]]]:
    """Check that ``root`` (a :class:`~wide_compiler.WideModel`) can take the constants ``saved``
    (``{member index: {attribute path: value}}``, as :func:`member_constants` gives them) without
    running any member outside what its compile proved (Note [Per-member constants]): a value of
    an attribute the model shares must be that shared value, and a member's per-member values must
    be the configuration of some member of the model (whose derived arguments it then takes).
    Returns the moves for :func:`set_member_constants`: ``{i: (the member whose configuration it
    takes, or None for one a graph proved that no member holds now, {attribute path: value})}``. Raises ``ValueError`` naming ``label(i)``, the attribute and
    the values (that come from ``source``); nothing changes here."""
    fix = ("compile the receiving model from members with these values (for a checkpoint, "
           "wide_compiler.distributed.load_member_constants reads them)")
    consts = root.__dict__.get("_constants") or {}
    paths = list(consts)
    shared = {p: v for p, v in _numbers(root._template).items() if p not in consts}
    current = [tuple(member_value(root, p, j) for p in paths) for j in range(root.n)]
    owners: dict[tuple, int] = {}
    for j, cfg in enumerate(current):
        owners.setdefault(tuple(constant_key(float(v)) for v in cfg), j)
    moves = {}
    for i, values in saved.items():
        for path, v in values.items():
            if path in shared and _is_float(v) and float in (type(v), type(shared[path])) \
                    and constant_key(float(v)) != constant_key(float(shared[path])):
                raise ValueError(
                    f"{label(i)}: {path} is {v!r} in {source}, and this model has {shared[path]!r} for every "
                    f"member: it was compiled from members that agree on {path}, so its graph reads that one value "
                    f"and cannot represent another; {fix}")
        if not paths:
            continue
        missing = [p for p in paths if not _is_float(values.get(p))]
        if missing:
            raise ValueError(f"{label(i)}: {source} has no value of the per-member constant(s) {missing} "
                             "(its members are not this model's members: another module tree)")
        key = tuple(constant_key(float(values[p])) for p in paths)
        j = owners.get(key)
        if j is None and key in _proved_keys(root, paths):
            # a configuration a graph proved that no member holds now (a checkpoint saved before
            # copy_member_weights: probe 14 of issue 44, P14-4): its derived arguments come from the
            # graphs' constant tables at the next call
            moves[i] = (None, {p: values[p] for p in paths})
            continue
        if j is None:
            have = sorted({", ".join(f"{p} = {v!r}" for p, v in zip(paths, cfg)) for cfg in current})
            shown = "; ".join(f"({c})" for c in have[:4]) + ("; ..." if len(have) > 4 else "")
            raise ValueError(
                f"{label(i)}: its constants in {source} ({', '.join(f'{p} = {values[p]!r}' for p in paths)}) are "
                f"not a configuration this model was compiled for (its members have {shown}); each configuration "
                "is traced at compile time to prove it runs the fused program (Note [Per-member constants]), so "
                f"another one cannot be set on it: {fix}")
        moves[i] = (j, {p: values[p] for p in paths})
    return moves


def _proved_keys(root: nn.Module, paths: list[str]) -> set[tuple]:
    """The configurations of ``paths`` that ``root``'s graphs were compiled for (Note
    [Configurations proved before]), as :func:`constant_key` tuples."""
    return {tuple(constant_key(float(cfg[p])) for p in paths) for cfg in root._earlier_constants()
            if all(p in cfg for p in paths)}


@torch.no_grad()
def set_member_constants(root: nn.Module, moves: Mapping[int, tuple[int, Mapping[str, Any]]]) -> None:
    """Apply the moves of :func:`check_member_constants`: member ``i`` takes member ``j``'s values
    of every ``_per_member`` buffer (its configuration's constants and derived arguments, all
    proved at compile time) and the given Python values of its constants (what ``member(i)`` and a
    later compile of another train/eval mode read)."""
    if not moves:
        return
    buffers = _per_member_buffers(root)
    before = {name: b.clone() for name, b in buffers.items()}
    consts = root.__dict__.get("_constants") or {}
    for i, (j, values) in moves.items():
        if j is None:  # a proved configuration no member holds: the constants only (Note [Per-member constants at the call])
            for path, v in values.items():
                buffers[buffer_name(path)][i] = float(v)
        else:
            for name, b in buffers.items():
                b[i] = before[name][j]
        for path, v in values.items():
            row = list(consts[path])
            row[i] = v
            consts[path] = tuple(row)


def copy_member_constants(root: nn.Module, src: int, dst: int) -> None:
    """Member ``dst`` of ``root`` (a :class:`~wide_compiler.WideModel`) takes member ``src``'s
    per-member constants and derived arguments (``copy_member_weights``)."""
    consts = root.__dict__.get("_constants") or {}
    if consts and src != dst:
        set_member_constants(root, {dst: (src, {p: member_value(root, p, src) for p in consts})})
