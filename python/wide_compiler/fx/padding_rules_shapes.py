"""The padding rules of the ops that move, size or pick values (Note [Padded members] in
fx/padding.py): reshapes, permutations, flatten and squeeze, sizes computed in Python, zeros,
concatenation, expand, size reads, copies, select and slice. What a rule does, and how the rules
are chosen per op: fx/padding_rules.py.
"""
from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

from .padding_layouts import Prefer, prefix, same_layout
from .source import source_line

if TYPE_CHECKING:
    from .padding_pass import Padder

__all__ = ["SHAPE_INT_ARGS_OK", "SHAPE_RULES", "same_dims", "size_arith"]


def same_dims(p: Padder, node: fx.Node, positions: Sequence[int], rank: int) -> None:
    """Refuse unless every member passes the same dims (normalised modulo ``rank``) at these
    argument positions: a reduction, permutation or flatten over other dims in one member is
    another program, not another size (it would silently run member 0's dims)."""
    def norm(v: Any) -> Any:
        if isinstance(v, int) and not isinstance(v, bool):
            return v % rank if rank else v
        if isinstance(v, (list, tuple)):
            return tuple(norm(u) for u in v)
        return v

    vals = [tuple(norm(nodes[p.pos[node]].args[k]) if len(nodes[p.pos[node]].args) > k else None
                  for k in positions) for nodes in p.nodes]
    bad = next((i for i, v in enumerate(vals) if v != vals[0]), None)
    if bad is not None:
        p.refuse(node, f"member {bad} passes the dims {list(vals[bad])} where member 0 passes {list(vals[0])}: "
                       "its program differs in more than sizes")


def _view(p: Padder, node: fx.Node) -> None:
    x = node.args[0]
    xl = p.layout(x)
    ins, outs = p.max_shape(x), p.max_shape(node)
    if math.prod(ins) != math.prod(outs):
        p.refuse(node, "a reshape whose padded input and output have different sizes: the largest "
                       "sizes of the dims it splits come from different members (e.g. both the number "
                       "of heads and the head dim vary)")
    # groups of dims whose products match (a merge or a split)
    lay: list[Any] = [None] * len(outs)
    i = j = 0
    while i < len(ins) or j < len(outs):
        gi, gj = [i], [j]
        pi = ins[i] if i < len(ins) else 1
        pj = outs[j] if j < len(outs) else 1
        while pi != pj:
            if pi < pj:
                i += 1
                gi.append(i)
                pi *= ins[i]
            else:
                j += 1
                gj.append(j)
                pj *= outs[j]
        gi = [k for k in gi if k < len(ins)]
        gj = [k for k in gj if k < len(outs)]
        padded_in = [k for k in gi if xl[k] is not None]
        if padded_in:
            # the group's valid positions, flattened, must factor over the output dims
            flat = None
            for k in gi:
                v = xl[k] if xl[k] is not None else torch.ones(p.n, ins[k], dtype=torch.bool)
                flat = v if flat is None else (flat[:, :, None] & v[:, None, :]).flatten(1)
            sizes = [outs[k] for k in gj]
            grid = flat.view(p.n, *sizes)
            for t, k in enumerate(gj):
                other = [s for s in range(len(gj)) if s != t]
                proj = grid.any(dim=[o + 1 for o in other]) if other else grid
                lay[k] = None if bool(proj.all()) else proj
            rebuilt = None
            for t, k in enumerate(gj):
                v = lay[k] if lay[k] is not None else torch.ones(p.n, outs[k], dtype=torch.bool)
                rebuilt = v if rebuilt is None else (rebuilt[:, :, None] & v[:, None, :]).flatten(1)
            padded_out = [k for k in gj if lay[k] is not None]
            # a box, and of each member's own output sizes: 24 of 36 values laid out as a prefix
            # are the box [2, 12] of a [3, 12] output, not the member's [3, 8] (heads 2 and 3)
            true = p.shapes(node)
            fits = torch.equal(rebuilt, flat) and all(
                (lay[k].sum(1).tolist() if lay[k] is not None else [outs[k]] * p.n) == [s[k] for s in true]
                for k in gj)
            for k in padded_out:
                if not isinstance(node.meta["val"].shape[k], int):
                    # merged with a dynamic dim (attention folding heads into the batch): laid out
                    # for the sample's size only, so no mask may be built from it (Padder.mask_of)
                    p.symbolic.add(id(lay[k]))
            if fits and len(gi) == 1 and len(padded_out) == 1 and id(xl[gi[0]]) in p.origin:
                target, dim, back = p.origin[id(xl[gi[0]])]
                j_out = padded_out[0]

                def through(want: torch.Tensor, back=back, gj=gj, j_out=j_out) -> torch.Tensor:
                    flat_want = None
                    for k in gj:
                        v = want if k == j_out else torch.ones(p.n, outs[k], dtype=torch.bool)
                        flat_want = v if flat_want is None else (flat_want[:, :, None] & v[:, None, :]).flatten(1)
                    return back(flat_want)
                p.origin[id(lay[j_out])] = (target, dim, through)
            if not fits:
                if len(padded_in) == 1 and id(xl[padded_in[0]]) in p.origin:
                    # a parameter's dim laid out as a prefix by default: lay it out so that each
                    # member's values are a box of the new dims, if one layout of it does that
                    k = padded_in[0]
                    true = [[s[j] for j in gj] for s in p.shapes(node)]
                    box = None
                    for t, j in enumerate(gj):
                        v = prefix([tr[t] for tr in true], outs[j])
                        box = v if box is None else (box[:, :, None] & v[:, None, :]).flatten(1)
                    grid = box.view(p.n, *[ins[g] for g in gi])
                    others = [t + 1 for t, g in enumerate(gi) if g != k]
                    want = grid.any(dim=others) if others else grid
                    again = None
                    for g in gi:
                        v = want if g == k else torch.ones(p.n, ins[g], dtype=torch.bool)
                        again = v if again is None else (again[:, :, None] & v[:, None, :]).flatten(1)
                    if torch.equal(again, box):
                        target, dim, back = p.origin[id(xl[k])]
                        raise Prefer((target, dim), back(want))
                p.refuse(node, "a reshape that splits or merges a padded dim so that each member's "
                               "values are not a box of the new dims (e.g. both factors of a split vary)")
        i, j = i + 1, j + 1
    # the shape argument: the padded sizes where the members' differ
    shape_arg = list(node.args[1])
    max_out = p.max_shape(node)
    for d, s in enumerate(shape_arg):
        if isinstance(s, int) and s != -1:
            shape_arg[d] = max_out[d]
    node.args = (x, shape_arg, *node.args[2:])
    p.lay[node] = lay


def _permute(p: Padder, node: fx.Node) -> None:
    xl = p.layout(node.args[0])
    name = node.target.overloadpacket.__name__
    rank = len(xl)
    same_dims(p, node, range(1, len(node.args)), rank + (name == "unsqueeze"))
    if name == "permute":
        p.lay[node] = [xl[d % rank] for d in node.args[1]]
    elif name in ("transpose", "swapaxes"):
        a, b = node.args[1] % rank, node.args[2] % rank
        out = list(xl)
        out[a], out[b] = out[b], out[a]
        p.lay[node] = out
    elif name == "t":
        p.lay[node] = xl[::-1]
    elif name == "unsqueeze":
        d = node.args[1] % (rank + 1)
        p.lay[node] = xl[:d] + [None] + xl[d:]
    elif name == "squeeze":
        dims = node.args[1] if len(node.args) > 1 else [d for d, s in enumerate(p.max_shape(node.args[0])) if s == 1]
        dims = [dims] if isinstance(dims, int) else dims
        dims = {d % rank for d in dims if p.max_shape(node.args[0])[d % rank] == 1}
        p.lay[node] = [v for d, v in enumerate(xl) if d not in dims]
    elif name == "flatten":
        _view_like(p, node)


def _view_like(p: Padder, node: fx.Node) -> None:
    """flatten / unflatten through the view rule (their sizes come from the shapes)."""
    x = node.args[0]
    if node.target.overloadpacket.__name__ == "unflatten":  # the dim; its sizes may differ
        same_dims(p, node, (1,), len(p.max_shape(x)))
    saved = node.args
    node.args = (x, list(p.max_shape(node)))
    _view(p, node)
    node.args = saved
    if node.target.overloadpacket.__name__ == "unflatten":  # its sizes: the padded ones
        dim = saved[1] % len(p.max_shape(x))
        node.args = (x, saved[1], list(p.max_shape(node)[dim: dim + len(saved[2])]), *saved[3:])


# the ops that read a size computed by size_arith as a shape (its padded value is right there)
_SHAPE_READERS = frozenset({"view", "reshape", "_unsafe_view", "expand", "unflatten", "zeros", "new_zeros", "sym_size"})


def size_arith(p: Padder, node: fx.Node) -> None:
    """A size computed in Python from a number that differs between members, as attention's
    ``batch * num_heads``: a product of a dynamic size and a member's number uses the largest
    number (its value feeds the padded program's view shapes)."""
    if node.target is not operator.mul or len(node.args) != 2:
        p.refuse(node, "the program computes a size in Python from a number that differs between "
                       "members, in a way padding cannot follow")
    k = next((t for t, a in enumerate(node.args) if isinstance(a, int)), None)
    if k is None or not isinstance(node.args[1 - k], fx.Node):
        p.refuse(node, "a product of two sizes that both differ between members")
    for user in node.users:  # the largest number is right for a shape only, not for a value (P12-5)
        name = getattr(getattr(user.target, "overloadpacket", None), "__name__", None)
        if name not in _SHAPE_READERS and getattr(user.target, "__module__", None) not in ("_operator", "operator"):
            p.refuse(node, f"a size that differs between members (a count: numel(), a product of sizes) is read as a "
                           f"value by {user.target} at {source_line(user)}, where padding would give every member "
                           "the largest")
    args = list(node.args)
    args[k] = max(nodes[p.pos[node]].args[k] for nodes in p.nodes)
    node.args = tuple(args)
    p.lay[node] = []


def _zeros(p: Padder, node: fx.Node) -> None:
    """zeros / new_zeros / zeros_like: zero everywhere, so clean in any layout (a prefix where its
    size differs between members, the padded size in its arguments)."""
    name = node.target.overloadpacket.__name__
    if name == "zeros_like":
        p.lay[node] = p.layout(node.args[0])
        return
    k = 1 if name == "new_zeros" else 0
    out = p.max_shape(node)
    node.args = (*node.args[:k], [s if not isinstance(s, int) else out[d] for d, s in enumerate(node.args[k])],
                 *node.args[k + 1:])
    shapes = p.shapes(node)
    p.lay[node] = [None if len({s[d] for s in shapes}) == 1 else prefix([s[d] for s in shapes], out[d])
                   for d in range(len(out))]


def _cat(p: Padder, node: fx.Node) -> None:
    parts = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else 0
    lays = [p.layout(a) for a in parts]
    rank = len(lays[0])
    dim %= rank
    out: list[Any] = []
    for d in range(rank):
        if d == dim:
            if all(lay[d] is None for lay in lays):
                out.append(None)
            else:
                joined = torch.cat([lay[d] if lay[d] is not None else torch.ones(p.n, p.max_shape(a)[d], dtype=torch.bool)
                                    for lay, a in zip(lays, parts)], dim=1)
                own = joined.sum(1).tolist()
                if joined.shape[1] != max(own):  # probe 16, P16-3: refused as an internal mismatch
                    p.refuse(node, f"a concatenation of parts whose widths are swept in different directions (each "
                                   f"part padded to its own largest member): the result is {joined.shape[1]} wide, "
                                   f"no member's own width ({own}), and what follows it is padded to the widest "
                                   f"member's. Sweep the parts' widths together (the widest member widest in every "
                                   f"part), or compile the members in groups of one size (the router does)")
                out.append(joined)
        else:
            vals = [lay[d] for lay in lays]
            if any(v is not None for v in vals) and not all(same_layout(v, vals[0]) for v in vals):
                p.refuse(node, f"a concatenation whose parts are padded differently in dim {d}")
            out.append(vals[0])
    p.lay[node] = out


def _expand(p: Padder, node: fx.Node) -> None:
    x = node.args[0]
    xl = p.layout(x)
    outs = p.max_shape(node)
    lay = [None] * (len(outs) - len(xl)) + list(xl)
    p.lay[node] = lay
    shape_arg = list(node.args[1])
    for d, s in enumerate(shape_arg):
        if isinstance(s, int) and s != -1:
            shape_arg[d] = outs[d]
    node.args = (x, shape_arg, *node.args[2:])
    shapes = p.shapes(node)
    if any(lay[d] is None and len({s[d] for s in shapes}) > 1 for d in range(len(lay))):
        p.refuse(node, "an expand to a size that differs between members (the padding would get copies)")


def _sym_size(p: Padder, node: fx.Node) -> None:
    xl = p.layout(node.args[0])
    if xl[node.args[1] % len(xl)] is not None:
        p.refuse(node, "the program reads the size of a padded dim")
    p.lay[node] = []


def _copy(p: Padder, node: fx.Node) -> None:
    dst, src = node.args[0], node.args[1]
    sl = p.layout(src)
    if isinstance(dst, fx.Node) and dst.op == "get_attr":
        for d, v in enumerate(sl):
            p.bind(dst, d, v)
    dl = p.layout(dst)
    for d, v in enumerate(sl):  # the destination laid out as its source, or values land elsewhere (P10-12)
        od = len(dl) - len(sl) + d
        if v is not None and 0 <= od and dl[od] is not None and not same_layout(dl[od], v):
            p.refuse(node, f"it copies a value into a tensor padded differently in dim {od} (one laid out in blocks, "
                           "a cat of padded parts or a view into heads, the other as one part): make the "
                           "destination from the value (torch.zeros_like(h), h.clone())")
    p.lay[node] = dl


def _select_slice(p: Padder, node: fx.Node) -> None:
    x = node.args[0]
    xl = p.layout(x)
    dim = (node.args[1] if len(node.args) > 1 else 0) % len(xl)
    if xl[dim] is not None:
        p.refuse(node, "indexing or slicing a padded dim")
    name = node.target.overloadpacket.__name__
    p.lay[node] = [v for d, v in enumerate(xl) if d != dim] if name == "select" else xl


# Note [Positions along a dim that is not padded]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Ops that move, pick or scan positions (flip, roll, index_select, cumsum, chunk, split, unbind,
# stack) are refused along a padded dim: each member's own positions are another prefix of it.
# Along a dim no member's size differs (the time of a hidden-size sweep) nothing is padded: every
# member's positions are the same, the padded positions of the other dims move with them and stay
# zero (a cumsum or cumprod of zeros is zero), so the result keeps the input's layout; an index
# tensor must be the same for all members (not padded). Refused along a padded dim as before, now
# saying which (probe 17 of issue 44, P17-4: all were refused, the time dim blamed).
_POSITIONS = "it reads or writes positions given by indices, a mask or an offset, which padding moves"
_WHOLE_DIM = ("its result depends on every position of the dim it reduces or scans (a count, an order, "
              "a product): along a padded dim the padding would count, and along a dim no member pads it has "
              "no padding rule yet")
# the reason of each refused along a padded dim
REFUSED_ALONG_PADDED = {**dict.fromkeys(("flip", "roll", "index_select", "chunk", "split", "split_with_sizes",
                                         "unbind", "stack"), _POSITIONS),
                        **dict.fromkeys(("cumsum", "cumprod"), _WHOLE_DIM)}
_ALONG = {"flip": "dims", "roll": "dims", "index_select": "dim", "cumsum": "dim", "cumprod": "dim",
          "chunk": "dim", "split": "dim", "split_with_sizes": "dim", "unbind": "dim", "stack": "dim"}


def _along_dims(node: fx.Node, rank: int) -> list[int] | None:
    """The dims a positional op of ``_ALONG`` works along (None: all of them, a roll without dims)."""
    name = node.target.overloadpacket.__name__
    key = _ALONG[name]
    schema = [a.name for a in node.target._schema.arguments]
    at = schema.index(key)
    v = node.args[at] if at < len(node.args) else node.kwargs.get(key, 0 if key == "dim" else None)
    if v is None or (isinstance(v, (list, tuple)) and not v):
        return None
    dims = list(v) if isinstance(v, (list, tuple)) else [v]
    return [d % rank for d in dims]


def _along_unpadded(p: Padder, node: fx.Node) -> None:
    """Note [Positions along a dim that is not padded]."""
    name = node.target.overloadpacket.__name__
    x = node.args[0]
    parts = list(x) if name == "stack" else [x]
    lays = [p.layout(a) for a in parts]
    lay = lays[0]
    rank = len(lay) + (1 if name == "stack" else 0)
    dims = _along_dims(node, rank)
    if name == "stack":
        if any(not all(same_layout(a, b) for a, b in zip(la, lay)) for la in lays[1:]):
            p.refuse(node, "a stack whose parts are padded differently")
        d = dims[0]
        p.lay[node] = [*lay[:d], None, *lay[d:]]
        return
    if dims is None or any(lay[d] is not None for d in dims):
        where = "all its dims" if dims is None else f"dim {next(d for d in dims if lay[d] is not None)}"
        p.refuse(node, f"along {where}, which is padded: {REFUSED_ALONG_PADDED[name]}")
    index = node.args[2] if name == "index_select" else None
    if isinstance(index, fx.Node) and any(v is not None for v in p.layout(index)):
        p.refuse(node, "its index differs between members (padded)")
    if name == "unbind":
        d = dims[0]
        p.lay[node] = [[*lay[:d], *lay[d + 1:]] for _ in node.meta.get("val", ())]
    elif name in ("chunk", "split", "split_with_sizes"):
        p.lay[node] = [list(lay) for _ in node.meta.get("val", ())]
    else:
        p.lay[node] = list(lay)


SHAPE_RULES: dict[str, Callable[[Padder, fx.Node], None]] = {
    "view": _view, "reshape": _view, "_unsafe_view": _view, "flatten": _permute,
    "unflatten": _view_like, "view_as": lambda p, n: _view_like(p, n),
    "permute": _permute, "transpose": _permute, "swapaxes": _permute, "t": _permute,
    "unsqueeze": _permute, "squeeze": _permute,
    "zeros": _zeros, "new_zeros": _zeros, "zeros_like": _zeros,
    "cat": _cat, "expand": _expand, "sym_size": _sym_size,
    "copy_": _copy, "select": _select_slice, "slice": _select_slice,
    **dict.fromkeys(_ALONG, _along_unpadded),
}
# rules that pad integer arguments which differ between members (INT_ARGS_OK in fx/padding_rules.py)
SHAPE_INT_ARGS_OK = {size_arith, _zeros, _view, _expand, _view_like, _permute}
