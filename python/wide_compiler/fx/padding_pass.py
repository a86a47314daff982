"""The padding pass (Note [Padded members] in fx/padding.py): one pass over member 0's captured
program, aligned node by node with the other members' (only sizes may differ: Note [Aligning sizes
computed in Python], Note [Tied tensors when padding]), that gives every value the layout of its
padded dims and runs each op's rule (fx/padding_rules.py) to keep the padding zero, or refuses.
"""
from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

from ..errors import ArchitectureMismatchError, UnsupportedOperationError
from .padded_members import PadInfo
from .padding_layouts import FREE, flat_layout, layout_mask, prefix, same_layout
from .padding_rules import INT_ARGS_OK, MASK_UNARY, REFUSED, RULES, ZERO_UNARY, mask_unary, zero_unary
from .padding_rules_shapes import size_arith
from .source import module_path, source_line

__all__ = ["Padder"]

aten = torch.ops.aten


def _hint(d: Any) -> int:
    if isinstance(d, int):
        return d
    hint = getattr(getattr(d, "node", None), "hint", None)
    if hint is None:
        raise UnsupportedOperationError(f"wide_compiler: pad=True: a size ({d}) has no value to compare")
    return int(hint)


def _shape(v: Any) -> tuple[int, ...] | None:
    return tuple(_hint(d) for d in v.shape) if isinstance(v, torch.Tensor) else None


def _size_arith(node: fx.Node) -> bool:
    """Whether ``node`` computes a size in Python (``batch * heads``: an ``operator`` call on
    symbolic sizes), which export shares between equal sizes."""
    return node.op == "call_function" and getattr(node.target, "__module__", None) in ("_operator", "operator") \
        and isinstance(node.meta.get("val"), (int, torch.SymInt))


# Note [Aligning sizes computed in Python]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Export records a size computed in Python (attention's ``batch * heads``, ``length * batch``)
# as an ``operator`` node, and shares one node between products of equal value: a member whose
# number of heads equals the sample's sequence length has ONE ``5 * batch`` where the others
# have ``2 * batch`` and ``5 * batch``. So the programs are aligned on their ATen ops (and
# placeholders, attributes, outputs), and every size node is matched through the place its
# first user reads it: member 0's size nodes are first made one per user (_unshare_sizes), so
# several of them may match one shared node of another member, and the padded program computes
# each with the largest factor (``size_arith``). Every argument is then compared as before; a
# member that reads a size where member 0 reads a product (a product by 1 left out: one head)
# is refused.


def _unshare_sizes(g: fx.Graph) -> None:
    """One copy of each size node per user (Note [Aligning sizes computed in Python])."""
    for node in [n for n in reversed(g.nodes) if _size_arith(n)]:  # a copy's arguments get a user: later
        for user in list(node.users)[1:]:
            with g.inserting_after(node):
                twin = g.call_function(node.target, node.args, node.kwargs)
            twin.meta = dict(node.meta)
            user.replace_input_with(node, twin)


def _same_place(u: fx.Node, b: fx.Node, a: fx.Node) -> Any:
    """What ``b`` (another member's node of ``u``'s op) reads where ``u`` first reads ``a``."""
    x, y = (u.args, u.kwargs), (b.args, b.kwargs)
    if len(u.args) != len(b.args):
        x, y = _full_args(u), _full_args(b)
    xs, ys = torch.utils._pytree.tree_leaves(x), torch.utils._pytree.tree_leaves(y)
    if len(xs) != len(ys):
        return None
    return next((v for w, v in zip(xs, ys) if w is a), None)


def _without_scale(node: fx.Node) -> tuple[tuple, dict]:
    """An attention call's arguments but its ``scale`` (which the padding rule makes per member)."""
    return node.args, {k: v for k, v in node.kwargs.items() if k != "scale"}


def _full_args(node: fx.Node) -> tuple[tuple, dict]:
    """An ATen call's arguments with the positional defaults its schema fills in spelled out
    (export leaves out trailing defaults: ``conv1d(x, w, b)`` for padding 0, ``conv1d(x, w, b,
    [1], [1])`` for padding 1)."""
    args, kwargs = list(node.args), dict(node.kwargs)
    if isinstance(node.target, torch._ops.OpOverload):
        for arg in node.target._schema.arguments[len(args):]:
            if arg.kwarg_only:
                break
            if arg.name in kwargs:
                args.append(kwargs.pop(arg.name))
            elif arg.has_default_value():
                args.append(arg.default_value)
            else:
                break
    return tuple(args), kwargs


# Note [Tied tensors when padding]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A tensor held under two names (an LM head tied to its embedding: ``fc.weight = e.weight``) is
# one parameter: ``named_parameters`` lists it once, under its first name, and export's program
# may read it under the other (``get_attr fc.weight``). The padding pass renames every read to
# the name that holds it, so the tensor has ONE layout that every op reading it must agree on
# (each op's rule binds or checks it, as for any parameter read twice); the padded members
# hold it under both names as the same tensor, as the member does, so the wide compiler ties it
# as for any tied model, and the state dicts carry both keys. The members must tie the same
# names (checked), else their programs differ in more than sizes.
def _tied(gms: Sequence[fx.GraphModule]) -> dict[str, str]:
    """Each member program's tied names -> the name that holds the tensor, the same for every
    member; every ``get_attr`` of such a name renamed to the holder (Note [Tied tensors when padding])."""
    found = []
    for gm in gms:
        held: dict[int, str] = {}
        aliases: dict[str, str] = {}
        for kind in (gm.named_parameters, gm.named_buffers):
            for name, t in kind(remove_duplicate=False):
                if id(t) in held and held[id(t)] != name:
                    aliases[name] = held[id(t)]
                else:
                    held.setdefault(id(t), name)
        found.append(aliases)
    for i, aliases in enumerate(found[1:], start=1):
        if aliases != found[0]:
            raise ArchitectureMismatchError(
                f"pad=True: member {i} ties {sorted(aliases.items()) or 'no tensors'} where member 0 ties "
                f"{sorted(found[0].items()) or 'no tensors'} (name, the name holding it): its program differs "
                "in more than sizes")
    for gm in gms:
        for node in gm.graph.nodes:
            if node.op == "get_attr" and node.target in found[0]:
                node.target = found[0][node.target]
    return found[0]


class _SymbolicMask(Exception):  # noqa: N818 -- raised by mask_of, turned into a refusal naming the node
    pass


def _said(nodes: list[fx.Node], k: int) -> str:
    """Node ``k`` of a member's program in words, with its module and line (probe 16, P16-2: the
    refusal named only the numbers of nodes)."""
    if k >= len(nodes) or nodes[k].op == "output":
        return "nothing more (its program ends there)"
    node = nodes[k]
    path = module_path(node)
    return f"{node.target}{f' in module {path!r}' if path else ''} ({source_line(node)})"


class Padder:
    """One pass over member 0's captured graph, aligned node by node with the others'."""

    def __init__(self, eps: Sequence[Any], persistent: set[str], tag: str,
                 prefs: dict[tuple[str, int], torch.Tensor]) -> None:
        self.n, self.tag, self.prefs = len(eps), tag, prefs
        # id(layout) -> (parameter, dim, f): the layout comes from that parameter dim's default
        # (a prefix), and f maps a layout wanted here to the one the parameter dim needs for it
        self.origin: dict[int, tuple[str, int, Callable[[torch.Tensor], torch.Tensor]]] = {}
        self.gms = [ep.module() for ep in eps]
        self.gm = self.gms[0]
        self.g = self.gm.graph
        self.aliases = _tied(self.gms)
        _unshare_sizes(self.g)
        # nodes[i][k]: member i's node that is member 0's k-th (Note [Aligning sizes computed in Python])
        self.nodes = [list(gm.graph.nodes) for gm in self.gms]
        self.pos = {node: k for k, node in enumerate(self.nodes[0])}
        self.state = [{**dict(gm.named_parameters()), **dict(gm.named_buffers())} for gm in self.gms]
        self.device = next(iter(self.state[0].values())).device if self.state[0] else torch.device("cpu")
        self.parameters = {name for name, _ in self.gm.named_parameters()}
        self.persistent = persistent
        self.lay: dict[fx.Node, Any] = {}
        self.state_lay: dict[str, list[Any]] = {}
        self.buffers: dict[str, torch.Tensor] = {}  # new per-member buffers: name -> [N, ...]
        self.int_diffs: dict[fx.Node, set[int]] = {}
        self.symbolic: set[int] = set()  # id(layout) of dims merged with a dynamic size
        self.index_bounds: list[tuple[str, list[int], int]] = []  # PadInfo.index_bounds
        self._check_programs()

    # ---------------------------------------------------------------- the programs agree
    def _check_programs(self) -> None:
        n0 = self.nodes[0]
        core0 = [a for a in n0 if not _size_arith(a)]
        for i, nodes in enumerate(self.nodes[1:], start=1):
            core = [b for b in nodes if not _size_arith(b)]
            if len(core) != len(core0):
                k = next((k for k, (a, b) in enumerate(zip(core0, core)) if a.op != b.op or a.target != b.target),
                         min(len(core), len(core0)))
                raise ArchitectureMismatchError(
                    f"pad=True: member {i} runs {len(core)} graph nodes, member 0 runs {len(core0)}; they part at "
                    f"node {k}, where member {i} runs {_said(core, k)} and member 0 runs {_said(core0, k)}: its "
                    "program differs in more than sizes (a branch on an attribute or on a size, such as a "
                    "residual taken only where two widths are equal)")
            for a, b in zip(core0, core):
                if a.op != b.op or a.target != b.target:
                    raise ArchitectureMismatchError(
                        f"pad=True: member {i} runs {b.op} {b.target} where member 0 runs {a.op} {a.target} "
                        f"at {source_line(a)}: its program differs in more than sizes")
            aligned = dict(zip(core0, core))
            for a in reversed(n0):  # a size's users come after it: aligned already
                if not _size_arith(a):
                    continue
                user = min((u for u in a.users if u in aligned), key=self.pos.__getitem__, default=None)
                y = None if user is None else _same_place(user, aligned[user], a)
                if not (isinstance(y, fx.Node) and _size_arith(y)):
                    raise self._size_mismatch(i, a)
                aligned[a] = y
            self.nodes[i] = [aligned[a] for a in n0]
        for i, nodes in enumerate(self.nodes[1:], start=1):
            for a, b in zip(n0, nodes):
                diffs: set[int] = set()
                x, y = (a.args, a.kwargs), (b.args, b.kwargs)
                if len(a.args) != len(b.args):  # one member's call spells out a default the other's leaves out
                    x, y = _full_args(a), _full_args(b)
                if a.target is torch.ops.aten.scaled_dot_product_attention.default:
                    x, y = _without_scale(a), _without_scale(b)  # a scale per member: its padding rule's
                self._compare(a, x, y, i, diffs, [0])
                if diffs:
                    self.int_diffs.setdefault(a, set()).update(diffs)

    def _size_mismatch(self, i: int, node: fx.Node) -> UnsupportedOperationError:
        return UnsupportedOperationError(
            f"wide_compiler: pad=True: {node.target} at {source_line(node)}: member {i} runs the same ops as "
            f"member 0 but reads a size there that it does not compute as member 0 does (one of them leaves "
            "out a product by 1: a member with one attention head has no batch * heads), so padding cannot "
            "follow it. Sweep 2 or more heads, or compile the members in groups of one size (the router "
            "does)")

    def _compare(self, node: fx.Node, x: Any, y: Any, i: int, diffs: set[int], counter: list[int]) -> None:
        """Raise unless ``y`` (member ``i``'s arguments of ``node``) is ``x`` (member 0's) up to
        integers, whose positions go to ``diffs``."""
        if isinstance(x, fx.Node) or isinstance(y, fx.Node):
            if not (isinstance(x, fx.Node) and isinstance(y, fx.Node)) or self.nodes[i][self.pos[x]] is not y:
                if any(isinstance(v, fx.Node) and _size_arith(v) for v in (x, y)):
                    raise self._size_mismatch(i, node)
                raise ArchitectureMismatchError(
                    f"pad=True: member {i}: {node.target} at {source_line(node)} reads other values than member 0's")
            return
        if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)) and len(x) == len(y):
            for u, v in zip(x, y):
                self._compare(node, u, v, i, diffs, counter)
            return
        if isinstance(x, dict) and isinstance(y, dict) and x.keys() == y.keys():
            for k in x:
                self._compare(node, x[k], y[k], i, diffs, counter)
            return
        k = counter[0]
        counter[0] += 1
        if type(x) is int and type(y) is int:
            if x != y:
                diffs.add(k)
            return
        if type(x) is not type(y) or x != y:
            why = ("a float computed from a size that differs between them (a scale such as head_dim ** -0.5, "
                   "which nn.MultiheadAttention computes itself with need_weights=True), or a hyperparameter "
                   "that differs" if isinstance(x, float) and isinstance(y, float)
                   else "a value that differs between them")
            raise ArchitectureMismatchError(
                f"pad=True: member {i}: {node.target} at {source_line(node)} is called with {y!r} where "
                f"member 0 has {x!r}: {why}; only sizes may differ between padded members (as tensor shapes: "
                "such a number is baked into each member's program, so these members cannot share one padded "
                "program); compile each size on its own (WideRouter groups them)")

    # ---------------------------------------------------------------- shapes and layouts
    def shapes(self, node: fx.Node) -> list[tuple[int, ...]]:
        k = self.pos[node]
        return [_shape(nodes[k].meta.get("val")) for nodes in self.nodes]

    def val(self, node: fx.Node) -> Any:
        """Member 0's traced value of ``node`` (its ``meta["val"]``); a node a rule inserted in
        place of another (a norm's decomposition, a mask after) has the value of the node it
        replaces."""
        val = node.meta.get("val")
        return val if val is not None else self.nodes[0][self.pos[node]].meta.get("val")

    def max_shape(self, node: fx.Node) -> tuple[int, ...]:
        shapes = self.shapes(node)
        return tuple(max(s[d] for s in shapes) for d in range(len(shapes[0])))

    def refuse(self, node: fx.Node, why: str) -> None:
        shapes = self.shapes(node) if isinstance(node.meta.get("val"), torch.Tensor) else None
        sizes = f" (member shapes {', '.join(str(list(s)) for s in shapes)})" if shapes else ""
        raise UnsupportedOperationError(
            f"wide_compiler: pad=True: {node.target} at {source_line(node)}{sizes}: {why}. Members that "
            "differ in size are fused only where padding is exact; compile them in groups of one size "
            "(the router does), or make this size the same for all members")

    def layout(self, node: Any) -> list[Any]:
        """The node's layout, free parameter dims as their prefix (fixed from now on)."""
        if not isinstance(node, fx.Node):
            return []
        lay = self.lay.get(node)
        if lay is None:
            return [None] * len(self.max_shape(node)) if isinstance(node.meta.get("val"), torch.Tensor) else []
        if node.op == "get_attr":
            for d, v in enumerate(lay):
                if isinstance(v, str):
                    default = self.prefs.get((node.target, d))
                    if default is None:
                        default = prefix([s[d] for s in self.shapes(node)], self.max_shape(node)[d])
                    self.origin[id(default)] = (node.target, d, lambda want: want)
                    self.bind(node, d, default)
            lay = self.lay[node]
        return list(lay)

    def bind(self, node: Any, d: int, layout: torch.Tensor | None) -> None:
        """Give a parameter's free dim ``d`` the layout a consumer needs; check it otherwise."""
        if not isinstance(node, fx.Node) or node not in self.lay:
            if layout is not None:
                self.refuse(node, "a value that is the same in every member is read where a padded one is")
            return
        cur = self.lay[node][d]
        if isinstance(cur, str):
            if layout is None or layout.shape[1] != self.max_shape(node)[d] or \
                    layout.sum(1).tolist() != [s[d] for s in self.shapes(node)]:
                self.refuse(node, f"its dim {d} is read with a padding that does not fit its sizes")
            self.lay[node][d] = layout
            self.state_lay[node.target][d] = layout
        elif not same_layout(cur, layout):
            self.refuse(node, f"dim {d} is read with two different paddings")

    # ---------------------------------------------------------------- graph edits
    def buffer(self, values: torch.Tensor, near: fx.Node, *, after: bool = False) -> fx.Node:
        """A new per-member buffer (``values`` [N, ...]) read just before (or after) ``near``."""
        name = f"_wc_pad_{self.tag}{len(self.buffers)}"
        values = values.to(self.device)
        self.buffers[name] = values
        self.gm.register_buffer(name, values[0].clone(), persistent=False)
        with self.g.inserting_after(near) if after else self.g.inserting_before(near):
            return self.g.get_attr(name)

    def mask_of(self, lay: list[Any], dtype: torch.dtype) -> torch.Tensor | None:
        """[N, *shape] 0/1 values of a layout, broadcasting over unpadded dims (None: unpadded)."""
        if all(v is None for v in lay):
            return None
        if any(id(v) in self.symbolic for v in lay):
            raise _SymbolicMask
        return layout_mask({d: v for d, v in enumerate(lay) if v is not None}, len(lay), self.n, dtype)

    def call(self, target: Any, *args: Any, after: fx.Node | None = None, before: fx.Node | None = None) -> fx.Node:
        ctx = self.g.inserting_after(after) if after is not None else self.g.inserting_before(before)
        with ctx:
            return self.g.call_function(target, args)

    def mask_after(self, node: fx.Node, lay: list[Any]) -> None:
        """Zero ``node``'s result outside its layout (every later use reads the masked value): a
        ``where`` on the mask, never a multiply by it (Note [Padding is zeroed by where])."""
        val = self.val(node)
        dtype = val.dtype if isinstance(val, torch.Tensor) else torch.float32
        mask = self.mask_of(lay, dtype)
        if mask is None:
            return
        users = list(node.users)
        zero = False if dtype == torch.bool else 0.0 if dtype.is_floating_point or dtype.is_complex else 0
        m = self.buffer(mask > 0, node, after=True)
        out = self.call(aten.where.ScalarOther, m, node, zero, after=m)
        for u in users:
            u.replace_input_with(node, out)
        self.lay[out], self.pos[out] = lay, self.pos[node]

    # Note [Padding is zeroed by where]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # A result whose padding is not zero (a bias added to padded rows, exp(0) = 1, a value added
    # from an operand that covers only the member's own positions) is zeroed outside each member's
    # layout. Multiplying by a 0/1 mask did that until probe 13 of issue 44 (P13-2, P13-3): an
    # additive attention mask holding -inf (``scores + causal``, ``h + mask`` before a max over
    # time) put -inf into the padded heads or units, -inf * 0 is NaN, and the NaN reached the
    # padded members' gradients (a softmax backward) or outputs (the next Linear's zero rows:
    # 0 * NaN). ``where(mask, x, 0)`` gives 0 there whatever x holds, and its backward an exact 0.

    # ---------------------------------------------------------------- the pass
    def run(self) -> tuple[PadInfo, list[dict[int, torch.Tensor]]]:
        """Rewrite the program (Note [Padded members]); returns what padding did and the
        layouts of the flat outputs."""
        for node in [n for n in self.g.nodes if n.op == "call_module" and n.target == "_guards_fn"]:
            self.g.erase_node(node)  # export's input guards of member 0's sizes (and not picklable)
            self.gm.delete_submodule("_guards_fn")
        for node in list(self.g.nodes):
            if node.op == "get_attr":
                self._get_attr(node)
            elif node.op == "placeholder":
                lay = self._dims_that_differ(node)
                if any(v is not None for v in lay):
                    self.refuse(node, "the members' inputs differ in size")
                self.lay[node] = lay
            elif node.op == "call_function":
                self._call(node)
            elif node.op == "output":
                outs = []
                for leaf in torch.utils._pytree.tree_leaves(node.args[0]):
                    lay = self.layout(leaf) if isinstance(leaf, fx.Node) else []
                    outs.append({d: v for d, v in enumerate(lay) if v is not None})
                self.outputs = outs
            elif node.op == "call_module":
                self.refuse(node, "a submodule call inside the captured program")
        self.g.lint()
        self.gm.recompile()
        # pickled GraphModules are traced again on load: with the plain tracer (export's needs
        # arguments a pickle does not carry)
        self.gm._tracer_cls = self.g._tracer_cls = None
        return self._info(), self.outputs

    def _dims_that_differ(self, node: fx.Node) -> list[Any]:
        shapes = self.shapes(node)
        if shapes[0] is None:
            return []
        return [None if len({s[d] for s in shapes}) == 1 else FREE for d in range(len(shapes[0]))]

    def _get_attr(self, node: fx.Node) -> None:
        name = node.target
        if name not in self.state[0]:  # a region export captured as a graph of its own: its user's rule decides
            self.lay[node] = []
            return
        shapes = [tuple(st[name].shape) for st in self.state]
        if len({len(s) for s in shapes}) != 1:
            self.refuse(node, "the members' tensors have different numbers of dims")
        lay = [None if len({s[d] for s in shapes}) == 1 else FREE for d in range(len(shapes[0]))]
        self.lay[node] = lay
        self.state_lay[name] = lay

    def _info(self) -> PadInfo:
        state_layouts = {}
        for name in self.state[0]:
            lay = self.state_lay.get(name)
            if lay is None:  # not read by the program: prefix
                shapes = [tuple(st[name].shape) for st in self.state]
                lay = [None if len({s[d] for s in shapes}) == 1 else prefix([s[d] for s in shapes],
                       max(s[d] for s in shapes)) for d in range(len(shapes[0]))]
            for d, v in enumerate(lay):
                if isinstance(v, str):
                    shapes = [tuple(st[name].shape) for st in self.state]
                    lay[d] = prefix([s[d] for s in shapes], max(s[d] for s in shapes))
            state_layouts[name] = {d: v for d, v in enumerate(lay) if v is not None}
        true_shapes = {name: [tuple(st[name].shape) for st in self.state] for name in self.state[0]}
        padded = {name: tuple(max(s[d] for s in shapes) for d in range(len(shapes[0])))
                  for name, shapes in true_shapes.items()}
        for alias, held in self.aliases.items():  # Note [Tied tensors when padding]
            state_layouts[alias], true_shapes[alias], padded[alias] = \
                state_layouts[held], true_shapes[held], padded[held]
        return PadInfo(self.n, state_layouts, true_shapes, padded, {}, aliases=dict(self.aliases))

    # ---------------------------------------------------------------- op rules
    def _call(self, node: fx.Node) -> None:
        target = node.target
        name = target.overloadpacket.__name__ if isinstance(target, torch._ops.OpOverload) else getattr(
            target, "__name__", str(target))
        # padded inputs, without fixing a parameter's free dims (the op's rule binds them)
        in_padded = any(v is not None for a in node.all_input_nodes for v in flat_layout(self.lay.get(a)))
        out_shapes = self.shapes(node) if isinstance(node.meta.get("val"), torch.Tensor) else None
        out_padded = out_shapes is not None and len({s for s in out_shapes}) > 1
        if target is operator.getitem:
            src, k = node.args
            lay = self.lay.get(src)
            self.lay[node] = list(lay[k]) if isinstance(lay, list) and lay and isinstance(lay[0], list) \
                else self._unpadded(node)
            return
        if not in_padded and not out_padded and node not in self.int_diffs:
            self.lay[node] = self._unpadded(node)
            return
        rule = RULES.get(name)
        if not isinstance(target, torch._ops.OpOverload) and node in self.int_diffs:
            rule = size_arith
        if rule is None:
            if name in ZERO_UNARY:
                rule = zero_unary
            elif name in MASK_UNARY:
                rule = mask_unary
            else:
                self.refuse(node, REFUSED.get(name, "no padding rule for this op (its result on zero padding is not "
                                                    "known to be exact)"))
        if node in self.int_diffs and rule not in INT_ARGS_OK:
            self.refuse(node, "its integer arguments differ between members, and this op's rule pads only sizes "
                              "that follow the members' tensor sizes: an integer that is no such size (a "
                              "multiplier, a count) must be the same for every member")
        try:
            rule(self, node)
        except _SymbolicMask:
            self.refuse(node, "its padding would need a mask over a dim merged with a dynamic size (the "
                              "batch: attention folds batch * heads into one dim, and its averaged "
                              "attention weights over padded heads are such a value)")
        self._check_layout(node)

    def _unpadded(self, node: fx.Node) -> Any:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return [None] * val.dim()
        if isinstance(val, (tuple, list)):
            return [[None] * v.dim() if isinstance(v, torch.Tensor) else [] for v in val]
        return []

    def _check_layout(self, node: fx.Node) -> None:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return
        lay = self.lay[node]
        shapes = self.shapes(node)
        for d in range(len(shapes[0])):
            sizes = [s[d] for s in shapes]
            v = lay[d] if d < len(lay) else None
            if v is None:
                if len(set(sizes)) != 1:
                    self.refuse(node, f"internal: dim {d} differs between members but has no padding")
            elif v.sum(1).tolist() != sizes or v.shape[1] != max(sizes):
                self.refuse(node, f"internal: the padding of dim {d} does not match the sizes {sizes}")

    def operand_layouts(self, node: fx.Node, operands: Sequence[Any]) -> list[Any]:
        """Broadcast layouts of elementwise operands (parameters bound to the others'); None dims
        of operands that are padded elsewhere make the result dirty there (see _binary)."""
        out_rank = len(self.max_shape(node))
        result: list[Any] = [None] * out_rank
        for a in operands:  # activations first: they fix the parameters' free dims
            if not isinstance(a, fx.Node) or a.op == "get_attr":
                continue
            lay = self.layout(a)
            for d, v in enumerate(lay):
                od = out_rank - len(lay) + d
                if v is not None and result[od] is not None and not same_layout(result[od], v):
                    # one operand's dim laid out in blocks (a cat of padded parts, heads) and the other's
                    # as a prefix (a Linear's output, zeros of the member's size): no position is both
                    # (probe 10 of issue 44, P10-12, P10-13: misplaced values, 0.2-2.3 off, silently)
                    self.refuse(node, f"its operands are padded differently in dim {od} (one laid out in blocks, "
                                      "a cat of padded parts or a view into heads, the other as one part), so "
                                      "each member's values would meet another position's")
                if v is not None:
                    result[od] = v
        for a in operands:
            if isinstance(a, fx.Node) and a.op == "get_attr":
                lay = self.lay[a]
                for d, v in enumerate(lay):
                    od = out_rank - len(lay) + d
                    if isinstance(v, str):
                        if result[od] is not None:
                            self.bind(a, d, result[od])
                        else:
                            self.layout(a)
                for d, v in enumerate(self.layout(a)):
                    od = out_rank - len(self.layout(a)) + d
                    if v is not None and result[od] is None:
                        result[od] = v
        return result
