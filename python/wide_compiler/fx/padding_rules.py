"""The padding rule of each op (Note [Padded members] in fx/padding.py): how a padded input maps
to the layout of the result, what a rule rewrites to stay exact (a mask after, a decomposition
with each member's count, -inf before a max), and what it refuses. A rule is ``rule(padder, node)``
and sets ``padder.lay[node]``; :data:`RULES` maps an ATen op's name to its rule, ops in
:data:`ZERO_UNARY` keep zero padding as it is, ops in :data:`MASK_UNARY` are masked after, and
:data:`REFUSED` names the ops a widen rule handles that are refused with padded members, and why.
Every op of the widen rule table (fx/table.py) is in one of them (or is ``getitem``, which the pass
follows itself): tests/python/test_rule_coverage.py fails for a new widen rule whose padding is not
stated here.
"""
from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

from .source import module_path

if TYPE_CHECKING:
    from .padding import _Padder

__all__ = ["BY_THE_PASS", "FREE", "INT_ARGS_OK", "MASK_UNARY", "REFUSED", "RULES", "ZERO_UNARY", "Prefer",
           "flat_layout", "layout_mask", "mask_unary", "prefix", "same_layout", "scatter", "size_arith", "zero_unary"]

aten = torch.ops.aten

FREE = "free"  # a parameter dim whose layout no consumer has fixed yet (prefix unless one does)

# f(0) = 0 and f'(0) finite: a clean input gives a clean output
ZERO_UNARY = {
    "relu", "gelu", "silu", "tanh", "neg", "leaky_relu", "hardtanh", "elu", "celu", "selu", "mish",
    "hardswish", "abs", "sin", "sinh", "asinh", "atan", "erf", "sign", "softsign", "tanhshrink",
    "hardshrink", "softshrink", "relu6", "clone", "alias", "detach", "detach_", "contiguous", "_to_copy", "to",
    "dropout", "native_dropout", "lift_fresh_copy", "square", "expm1", "log1p", "type_as", "rrelu",
    "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "avg_pool1d",
    "avg_pool2d", "avg_pool3d", "max_pool1d", "max_pool2d", "max_pool3d", "max_pool2d_with_indices",
    "adaptive_max_pool2d", "upsample_nearest2d", "upsample_bilinear2d",
}
# finite with a finite derivative at 0, but f(0) != 0: masked after (anything else is refused:
# log, rsqrt, reciprocal, pow with a negative exponent would put inf or NaN into the padding)
MASK_UNARY = {"sigmoid", "exp", "cos", "cosh", "hardsigmoid", "softplus", "logsigmoid", "clamp",
              "clamp_min", "clamp_max", "fill", "ones_like", "full_like"}


def prefix(sizes: Sequence[int], most: int) -> torch.Tensor:
    return torch.arange(most)[None, :] < torch.tensor(list(sizes))[:, None]


def same_layout(a: Any, b: Any) -> bool:
    if a is None or b is None or isinstance(a, str) or isinstance(b, str):
        return a is b or (isinstance(a, str) and isinstance(b, str))
    return a.shape == b.shape and bool(torch.equal(a, b))


def flat_layout(lay: Any) -> list[Any]:
    """Every dim's entry of a layout (a tuple result's per-output layouts flattened)."""
    if not lay:
        return []
    return [v for sub in lay for v in sub] if isinstance(lay[0], list) else list(lay)


class Prefer(Exception):  # noqa: N818 (a request, not an error)
    """Run the pass again with this parameter dim laid out so (a later split needs it)."""

    def __init__(self, where: tuple[str, int], layout: torch.Tensor) -> None:
        super().__init__(where)
        self.where, self.layout = where, layout


def layout_mask(lay: dict[int, torch.Tensor], rank: int, n: int, dtype: torch.dtype,
                device: torch.device | None = None) -> torch.Tensor:
    """``[N, *shape]`` 0/1 values of a layout ({dim: bool [N, size]}): 1 where a member's own
    values are, size 1 along the dims the layout does not pad (they broadcast)."""
    m = torch.ones((n,) + (1,) * rank, dtype=dtype, device=device)
    for d, v in lay.items():
        view = [n] + [1] * rank
        view[d + 1] = v.shape[1]
        m = m * v.to(device=device, dtype=dtype).view(view)
    return m


def scatter(t: torch.Tensor, lay: dict[int, torch.Tensor], i: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Member ``i``'s tensor ``t`` placed at its layout's positions of a zero tensor of ``shape``."""
    out = t
    for d, v in sorted(lay.items()):
        idx = v[i].nonzero().flatten().to(t.device)
        grown = list(out.shape)
        grown[d] = shape[d]
        z = out.new_zeros(grown)
        z.index_copy_(d, idx, out)
        out = z
    return out.contiguous()


# ------------------------------------------------------------------------------------ the rules
def zero_unary(p: _Padder, node: fx.Node) -> None:
    src = node.args[0]
    lay = p.layout(src)
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):  # (result, mask/indices): both shaped like the input
        p.lay[node] = [list(lay) for _ in val]
        return
    if len(lay) != val.dim():
        p.refuse(node, "the result's dims do not follow its input's")
    p.lay[node] = lay


def mask_unary(p: _Padder, node: fx.Node) -> None:
    operands = [a for a in node.args if isinstance(a, fx.Node)]
    lay = p.operand_layouts(node, operands)
    p.lay[node] = lay
    p.mask_after(node, lay)


def _binary(p: _Padder, node: fx.Node) -> None:
    name = node.target.overloadpacket.__name__
    operands = [a for a in node.args[:2]]
    lay = p.operand_layouts(node, operands)
    p.lay[node] = lay
    rank = len(lay)

    def covers(a: Any) -> bool:  # operand zero wherever the result is padded
        if not isinstance(a, fx.Node):
            return False
        la = p.layout(a)
        for d, v in enumerate(lay):
            if v is None:
                continue
            k = d - (rank - len(la))
            if k < 0 or la[k] is None or not same_layout(la[k], v):
                return False
        return True

    nodes = [a for a in operands if isinstance(a, fx.Node)]
    if name in ("div", "true_divide") and len(nodes) == 2 and any(v is not None for v in p.layout(operands[1])):
        p.refuse(node, "division by a padded value (0/0 in the padding)")
    clean = all(covers(a) for a in operands) if name in ("add", "sub", "rsub", "maximum", "minimum", "max", "min") \
        else any(covers(a) for a in operands)
    if name in ("div", "true_divide"):
        clean = covers(operands[0])
    if not clean:
        p.mask_after(node, lay)


def _linear(p: _Padder, node: fx.Node) -> None:
    x, w = node.args[0], node.args[1]
    b = node.args[2] if len(node.args) > 2 else None
    xl = p.layout(x)
    if isinstance(w, fx.Node) and w.op == "get_attr":
        p.bind(w, 1, xl[-1])
    wl = p.layout(w)
    if not same_layout(wl[1], xl[-1]):
        p.refuse(node, "the input's features and the weight's columns are padded differently")
    if isinstance(b, fx.Node):
        if b.op == "get_attr":
            p.bind(b, 0, wl[0])
        if not same_layout(p.layout(b)[0], wl[0]):
            p.refuse(node, "the bias and the weight's rows are padded differently")
    p.lay[node] = xl[:-1] + [wl[0]]
    if b is not None and any(v is not None for v in xl[:-1]):
        p.mask_after(node, p.lay[node])  # padded rows get the bias


def _matmul(p: _Padder, node: fx.Node) -> None:
    a, b = node.args[0], node.args[1]
    al, bl = p.layout(a), p.layout(b)
    if len(al) < 2 or len(bl) < 2:
        p.refuse(node, "a matrix product with a 1-d operand")
    if isinstance(b, fx.Node) and b.op == "get_attr":
        p.bind(b, len(bl) - 2, al[-1])
        bl = p.layout(b)
    if not same_layout(al[-1], bl[-2]):
        p.refuse(node, "the contracted dim is padded differently in the two operands")
    batch: list[Any] = [None] * (len(p.max_shape(node)) - 2)
    lead_a, lead_b = al[:-2], bl[:-2]
    for d in range(len(batch)):
        ka, kb = d - (len(batch) - len(lead_a)), d - (len(batch) - len(lead_b))
        va = lead_a[ka] if ka >= 0 else None
        vb = lead_b[kb] if kb >= 0 else None
        if va is not None and vb is not None and not same_layout(va, vb):
            p.refuse(node, "the batch dims of the operands are padded differently")
        batch[d] = va if va is not None else vb
    p.lay[node] = batch + [al[-2], bl[-1]]


# Note [Kernel-size sweeps]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# A convolution reads input position ``o*s - P + j*d`` with kernel tap ``j`` (stride s, padding
# P, dilation d; a transposed convolution writes output ``i*s - P + j*d`` from input ``i``: the
# same algebra). Member ``i``'s kernel of size ``k`` placed at offset ``c`` of a zero kernel of
# size ``K`` (tap ``j`` becomes ``j + c``) reads the same positions under padding
# ``P = p + d*c``, and the output length ``(L + 2P - d(K-1) - 1) // s + 1`` (transposed:
# ``(L-1)s - 2P + d(K-1) + output_padding + 1``) is the member's own exactly when ``2c = K - k``:
# the smaller kernel is centred. So a kernel-size sweep is exact when, per spatial dim, every
# member's ``K - k`` is even and ``p + d*(K-k)/2`` is the same for all of them (``padding = d*(k-1)/2``,
# odd kernels, is the usual case); the padded program then runs with that common padding. With
# ``padding='same'`` torch pads ``d*(k-1)//2`` on the left and the rest on the right, so member
# ``i``'s offset is ``(d*(K-1)//2 - d*(k-1)//2) / d``, exact when that is an integer (even
# kernels included, when the dilation allows). ``'valid'`` with different kernels gives outputs
# of different lengths. Stride, dilation and output_padding must be the same for every member.
# Anything else is refused naming the member, the module and the attribute. The kernel's
# spatial dims are laid out at those offsets (not as a prefix), so its gradient mask, its
# checkpoints and ``member_state_dict`` follow.

# name -> positions of (stride, padding, dilation, output_padding) in the ATen op's arguments
_CONV_ARGS = {"conv1d": (3, 4, 5, None), "conv2d": (3, 4, 5, None), "conv3d": (3, 4, 5, None),
              "convolution": (3, 4, 5, 7), "conv_transpose1d": (3, 4, 7, 5),
              "conv_transpose2d": (3, 4, 7, 5), "conv_transpose3d": (3, 4, 7, 5)}
_CONV_KW = ("stride", "padding", "dilation", "output_padding")


def _conv_geometry(node: fx.Node, name: str, rank: int) -> list[Any]:
    """(stride, padding, dilation, output_padding) of one member's conv node, each a list of
    ``rank`` ints (padding: a string when given as one)."""
    out = []
    for pos, kw, default in zip(_CONV_ARGS[name], _CONV_KW, (1, 0, 1, 0)):
        v = default if pos is None else node.args[pos] if len(node.args) > pos else node.kwargs.get(kw, default)
        if isinstance(v, str):
            out.append(v)
            continue
        v = [v] if isinstance(v, int) else list(v)
        out.append(v * rank if len(v) == 1 else v)
    return out


def _conv_kernels(p: _Padder, node: fx.Node, name: str, w: Any, rank: int) -> None:
    """Per-member stride, padding and dilation of a convolution, and kernel sizes that differ
    between members (Note [Kernel-size sweeps]): the kernel's spatial dims laid out centred and
    the common padding set, or a refusal."""
    geo = [_conv_geometry(nodes[p.pos[node]], name, rank) for nodes in p.nodes]
    where = f"module {module_path(node) or '<root>'!r}"
    for k, what in ((0, "stride"), (2, "dilation"), (3, "output_padding")):
        bad = next((i for i, g in enumerate(geo) if g[k] != geo[0][k]), None)
        if bad is not None:
            p.refuse(node, f"{where}: member {bad}'s {what} {geo[bad][k]} is not member 0's {geo[0][k]}: "
                           f"padding fuses convolutions of one {what} only")
    kernels = [tuple(s[2:]) for s in p.shapes(w)] if isinstance(w, fx.Node) else [()]
    pads = [g[1] for g in geo]
    if len(set(kernels)) == 1:
        bad = next((i for i, q in enumerate(pads) if q != pads[0]), None)
        if bad is not None:
            p.refuse(node, f"{where}: member {bad}'s padding {pads[bad]} is not member 0's {pads[0]} at one "
                           "kernel size: their outputs are not aligned")
        return
    dil = geo[0][2]
    big = [max(k[s] for k in kernels) for s in range(rank)]
    common: list[Any] = []
    lays: list[torch.Tensor | None] = []  # per spatial dim: the kernel's layout (None: one size)
    for s in range(rank):
        lay = torch.zeros(p.n, big[s], dtype=torch.bool)
        want = None
        for i, (k, q) in enumerate(zip(kernels, pads)):
            ks, d, extra = k[s], dil[s], big[s] - k[s]
            if q == "same":
                c, rem = divmod(d * (big[s] - 1) // 2 - d * (ks - 1) // 2, d)
                why = (f"with padding='same' and dilation {d}, torch pads {d * (ks - 1) // 2} on the left "
                       f"for kernel_size {ks} and {d * (big[s] - 1) // 2} for {big[s]}: not a whole number "
                       "of dilated taps apart")
                here = "same"
            elif isinstance(q, str):
                c, rem, here = 0, 1, q
                why = f"with padding={q!r}, kernels of different sizes give outputs of different lengths"
            else:
                c, rem = divmod(extra, 2)
                here = q[s] + d * c
                why = (f"its kernel_size {ks} cannot be centred in the largest, {big[s]} (an odd "
                       "difference), so its output length differs from the padded convolution's")
            if rem == 0 and want is not None and here != want:
                rem = 1
                why = (f"its padding {q[s]} minus dilation * (kernel_size - 1) / 2 is {q[s] - d * (ks - 1) / 2:g}, "
                       f"member 0's is {pads[0][s] - d * (kernels[0][s] - 1) / 2:g}: centred in the "
                       "largest kernel, its kernel would read other input positions")
            if rem or not 0 <= c <= extra:
                sizes = ", ".join(f"{list(k)} (padding {q!r})" for k, q in zip(kernels, pads))
                p.refuse(node, f"{where}: the members' kernel_size differ (in member order: {sizes}); in "
                               f"spatial dim {s}, member {i}: {why}. Padding fuses a kernel-size sweep only "
                               "where each member's kernel, centred in the largest, computes exactly its own "
                               "convolution (Note [Kernel-size sweeps]), as with padding = dilation * "
                               "(kernel_size - 1) / 2 or 'same'")
            want = here
            lay[i, c:c + ks] = True
        common.append(want)
        lays.append(None if bool(lay.all()) else lay)
    if isinstance(w, fx.Node) and w.op == "get_attr":
        for s, lay in enumerate(lays):
            p.bind(w, 2 + s, lay)
    for s, lay in enumerate(lays):
        if not same_layout(p.layout(w)[2 + s], lay):
            p.refuse(node, f"{where}: a kernel whose spatial dim {s} is padded other than centred")
    if not isinstance(pads[0], str):  # the common padding (a 'same' string stays)
        k = _CONV_ARGS[name][1]
        if len(node.args) > k:
            node.args = (*node.args[:k], common, *node.args[k + 1:])
        else:
            node.kwargs = {**node.kwargs, "padding": common}


def _conv(p: _Padder, node: fx.Node) -> None:
    x, w = node.args[0], node.args[1]
    b = node.args[2] if len(node.args) > 2 else None
    name = node.target.overloadpacket.__name__
    transposed = "transpose" in name or (name == "convolution" and node.args[6])
    groups_pos = {"conv1d": 6, "conv2d": 6, "conv3d": 6, "convolution": 8, "conv_transpose1d": 6,
                  "conv_transpose2d": 6, "conv_transpose3d": 6}[name]
    groups = [nodes[p.pos[node]].args[groups_pos] if len(nodes[p.pos[node]].args) > groups_pos else 1
              for nodes in p.nodes]
    xl = p.layout(x)
    if any(v is not None for v in xl[2:]):
        p.refuse(node, "a convolution over padded spatial dims")
    _conv_kernels(p, node, name, w, len(xl) - 2)
    wshapes = p.shapes(w) if isinstance(w, fx.Node) else None
    depthwise = len(set(groups)) > 1
    if depthwise:
        if any(g != ws[0] or ws[1] != 1 for g, ws in zip(groups, wshapes)) or transposed:
            p.refuse(node, "the groups differ between members, and the convolution is not depthwise "
                           "(groups == channels in every member)")
        p.bind(w, 0, xl[1])
        mx = max(groups)
        a = list(node.args) + [1] * (groups_pos + 1 - len(node.args))
        a[groups_pos] = mx
        node.args = tuple(a)
    elif groups[0] != 1 and xl[1] is not None:
        p.refuse(node, "a grouped convolution (groups > 1) over padded channels")
    else:
        p.bind(w, 0 if transposed else 1, xl[1])
    wl = p.layout(w)
    out_ch = wl[1] if transposed else wl[0]
    if depthwise:
        out_ch = wl[0]
    if isinstance(b, fx.Node):
        if b.op == "get_attr":
            p.bind(b, 0, out_ch)
        if not same_layout(p.layout(b)[0], out_ch):
            p.refuse(node, "the bias and the output channels are padded differently")
    p.lay[node] = [xl[0], out_ch] + [None] * (len(xl) - 2)
    if xl[0] is not None:
        p.refuse(node, "a convolution over a padded batch dim")


def _embedding(p: _Padder, node: fx.Node) -> None:
    """Note [Padded vocabularies]: a member's table of ``V_i`` rows sits in the first ``V_i`` rows
    of the padded one, where an index ``V_i <= x < V`` would read a zero row instead of raising
    IndexError as the member's own lookup does. The indices go through ``where(x < V_i, x, x + V)``
    first (a compare and a select on the indices, per member bound ``V_i`` a buffer): an index
    outside the member's own table is outside the padded one too, so the wide lookup raises
    IndexError naming the member, and :class:`~wide_compiler.PaddedWideModel` says which table
    and the member's own index (``x + V`` decoded)."""
    w, idx = node.args[0], node.args[1]
    wl = p.layout(w)
    il = p.layout(idx)
    if any(v is not None for v in il):
        p.refuse(node, "padded indices")
    if wl[0] is not None:
        sizes = [s[0] for s in p.shapes(w)]
        most = wl[0].shape[1]
        if not torch.equal(wl[0], prefix(sizes, most)):
            p.refuse(node, "an embedding table whose rows (the vocabulary) are padded other than at the end "
                           "(another op reading the table lays them out so): an index would read another row")
        ival = p.val(idx)
        bound = p.buffer(torch.tensor(sizes, dtype=ival.dtype).view(p.n, *([1] * ival.dim())), node)
        with p.g.inserting_before(node):
            c = p.g.call_function
            inside = c(aten.lt.Tensor, (idx, bound))
            checked = c(aten.where.self, (inside, idx, c(aten.add.Tensor, (idx, most))))
        node.replace_input_with(idx, checked)
        p.index_bounds.append((w.target if w.op == "get_attr" else str(w), sizes, most))
    p.lay[node] = [None] * len(il) + [wl[1]]


def _norm_affine(p: _Padder, node: fx.Node, params: Sequence[Any], lays: list[Any]) -> None:
    """Bind the affine parameters (weight, bias over the normalized dims) to the input's layout."""
    for prm in params:
        if isinstance(prm, fx.Node) and prm.op == "get_attr":
            for d in range(len(lays)):
                p.bind(prm, d, lays[d])
        if isinstance(prm, fx.Node):
            for d, v in enumerate(p.layout(prm)):
                if not same_layout(v, lays[d]):
                    p.refuse(node, "the affine parameters are padded differently from the normalized dims")


def _layer_norm(p: _Padder, node: fx.Node, rms: bool = False) -> None:
    x = node.args[0]
    xl = p.layout(x)
    k = len(node.args[1])
    norm_dims = list(range(len(xl) - k, len(xl)))
    w = node.args[2] if len(node.args) > 2 else None
    b = None if rms else (node.args[3] if len(node.args) > 3 else None)
    eps = node.args[3 if rms else 4] if len(node.args) > (3 if rms else 4) else (None if rms else 1e-5)
    _norm_affine(p, node, [w, b], xl[len(xl) - k:])
    p.lay[node] = xl
    if all(xl[d] is None for d in norm_dims):
        if b is not None and any(v is not None for v in xl):
            p.mask_after(node, xl)
        return
    # the decomposition with each member's count (Note [Padded members])
    val = p.val(x)
    inner = [None] * (len(xl) - k) + [xl[d] for d in norm_dims]
    mask = p.mask_of(inner, val.dtype)
    count = mask.flatten(1).sum(1) * math.prod(1 if xl[d] is not None else p.max_shape(x)[d] for d in norm_dims)
    m = p.buffer(mask, node)
    cnt = p.buffer(count.view(p.n, *([1] * len(xl))).to(val.dtype), node)
    if eps is None:
        eps = torch.finfo(val.dtype).eps
    with p.g.inserting_before(node):
        c = p.g.call_function
        if rms:
            ms = c(aten.div.Tensor, (c(aten.sum.dim_IntList, (c(aten.mul.Tensor, (x, x)), norm_dims, True)), cnt))
            y = c(aten.mul.Tensor, (x, c(aten.rsqrt.default, (c(aten.add.Tensor, (ms, eps)),))))
        else:
            mean = c(aten.div.Tensor, (c(aten.sum.dim_IntList, (x, norm_dims, True)), cnt))
            xc = c(aten.mul.Tensor, (c(aten.sub.Tensor, (x, mean)), m))
            var = c(aten.div.Tensor, (c(aten.sum.dim_IntList, (c(aten.mul.Tensor, (xc, xc)), norm_dims, True)), cnt))
            y = c(aten.mul.Tensor, (xc, c(aten.rsqrt.default, (c(aten.add.Tensor, (var, eps)),))))
        if w is not None:
            y = c(aten.mul.Tensor, (y, w))
        if b is not None:
            y = c(aten.add.Tensor, (y, b))
    node.replace_all_uses_with(y)
    p.g.erase_node(node)
    p.lay[y], p.pos[y] = xl, p.pos[node]
    if any(xl[d] is not None for d in range(len(xl) - k)):
        p.mask_after(y, xl)


def _group_norm(p: _Padder, node: fx.Node) -> None:
    x, groups = node.args[0], node.args[1]
    w = node.args[2] if len(node.args) > 2 else None
    b = node.args[3] if len(node.args) > 3 else None
    eps = node.args[4] if len(node.args) > 4 else 1e-5
    xl = p.layout(x)
    _norm_affine(p, node, [w, b], [xl[1]])
    p.lay[node] = xl
    if any(v is not None for i, v in enumerate(xl) if i != 1):
        p.refuse(node, "a group norm over padded dims other than the channels")
    if xl[1] is None:
        return
    gs = {nodes[p.pos[node]].args[1] for nodes in p.nodes}
    if len(gs) != 1:
        p.refuse(node, "the number of groups differs between members")
    val = p.val(x)
    cmax = xl[1].shape[1]
    onehot = torch.zeros(p.n, cmax, groups, dtype=val.dtype)
    for i in range(p.n):
        idx = xl[1][i].nonzero().flatten()
        per = len(idx) // groups
        if per * groups != len(idx):
            p.refuse(node, f"member {i}'s {len(idx)} channels are not divisible by {groups} groups")
        onehot[i, idx, torch.arange(len(idx)) // per] = 1
    per_group = onehot.sum(1)  # [N, G]
    a = p.buffer(onehot, node)
    at = p.buffer(onehot.transpose(1, 2).contiguous(), node)
    cnt = p.buffer(per_group, node)
    with p.g.inserting_before(node):
        c = p.g.call_function
        # [B, C, spatial]: a [B, C] input (no spatial dims) as [B, C, 1]
        x3 = c(aten.unsqueeze.default, (x, -1)) if len(xl) == 2 else c(aten.flatten.using_ints, (x, 2))
        mean_c = c(aten.mean.dim, (x3, [-1]))                                   # [B, C]
        mean_g = c(aten.div.Tensor, (c(aten.matmul.default, (mean_c, a)), cnt))    # [B, G]
        xc = c(aten.sub.Tensor, (x3, c(aten.unsqueeze.default, (c(aten.matmul.default, (mean_g, at)), -1))))
        var_c = c(aten.mean.dim, (c(aten.mul.Tensor, (xc, xc)), [-1]))
        var_g = c(aten.div.Tensor, (c(aten.matmul.default, (var_c, a)), cnt))
        rstd_c = c(aten.matmul.default, (c(aten.rsqrt.default, (c(aten.add.Tensor, (var_g, eps)),)), at))
        y = c(aten.view_as.default, (c(aten.mul.Tensor, (xc, c(aten.unsqueeze.default, (rstd_c, -1)))), x))
        shape = [1, -1] + [1] * (len(xl) - 2)
        if w is not None:
            y = c(aten.mul.Tensor, (y, c(aten.view.default, (w, shape))))
        if b is not None:
            y = c(aten.add.Tensor, (y, c(aten.view.default, (b, shape))))
    node.replace_all_uses_with(y)
    p.g.erase_node(node)
    p.lay[y], p.pos[y] = xl, p.pos[node]


def _batch_norm(p: _Padder, node: fx.Node) -> None:
    x = node.args[0]
    xl = p.layout(x)
    if any(v is not None for i, v in enumerate(xl) if i != 1):
        p.refuse(node, "a batch norm over padded dims other than the channels")
    _norm_affine(p, node, [a for a in node.args[1:5]], [xl[1]])
    p.lay[node] = xl  # per channel: zero channels (zero weight and bias) stay zero, stats too


def _same_dims(p: _Padder, node: fx.Node, positions: Sequence[int], rank: int) -> None:
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


def _mean(p: _Padder, node: fx.Node) -> None:
    x = node.args[0]
    xl = p.layout(x)
    rank = len(xl)
    _same_dims(p, node, (1, 2), rank)
    dims = list(range(rank)) if len(node.args) < 2 or node.args[1] is None else \
        [d % rank for d in node.args[1]]
    keep = len(node.args) > 2 and node.args[2]
    p.lay[node] = [v for d, v in enumerate(xl) if d not in dims or keep] if not keep else \
        [None if d in dims else v for d, v in enumerate(xl)]
    padded = [d for d in dims if xl[d] is not None]
    if not padded:
        return
    val = p.val(x)
    ratio = torch.ones(p.n, dtype=val.dtype)
    for d in padded:
        ratio = ratio * (xl[d].shape[1] / xl[d].sum(1).to(val.dtype))
    r = p.buffer(ratio.view(p.n, *([1] * len(p.lay[node]))), node)
    out = p.call(aten.mul.Tensor, node, r, after=node)
    for u in [u for u in node.users if u is not out]:
        u.replace_input_with(node, out)
    p.lay[out], p.pos[out] = p.lay[node], p.pos[node]


def _sum(p: _Padder, node: fx.Node) -> None:
    x = node.args[0]
    xl = p.layout(x)
    rank = len(xl)
    _same_dims(p, node, (1, 2), rank)
    dims = list(range(rank)) if len(node.args) < 2 or node.args[1] is None else [d % rank for d in node.args[1]]
    keep = len(node.args) > 2 and node.args[2]
    p.lay[node] = [None if d in dims else v for d, v in enumerate(xl)] if keep else \
        [v for d, v in enumerate(xl) if d not in dims]


def _softmax(p: _Padder, node: fx.Node) -> None:
    """softmax / log_softmax: -inf in the padding of the reduced dim first; padded rows (other
    padded dims) come out uniform, and log_softmax's padding -inf: masked after (by ``where``,
    since -inf * 0 is NaN)."""
    x, dim = node.args[0], node.args[1]
    xl = p.layout(x)
    d = dim % len(xl)
    p.lay[node] = xl
    if xl[d] is not None:
        inner = [v if k == d else None for k, v in enumerate(xl)]
        mask = p.mask_of(inner, p.val(x).dtype)
        fill = p.buffer(torch.where(mask > 0, torch.zeros_like(mask), torch.full_like(mask, -math.inf)), node)
        with p.g.inserting_before(node):
            masked = p.g.call_function(aten.add.Tensor, (x, fill))
        node.replace_input_with(x, masked)
    if "log" in node.target.overloadpacket.__name__ or any(v is not None for k, v in enumerate(xl) if k != d):
        p.mask_after(node, xl, nan_safe=True)


def _amax(p: _Padder, node: fx.Node) -> None:
    """max / amax over dims: the padding set to -inf first where a reduced dim is padded."""
    if len(node.args) > 1 and isinstance(node.args[1], fx.Node):  # torch.max(a, b)
        _binary(p, node)
        return
    x = node.args[0]
    xl = p.layout(x)
    rank = len(xl)
    _same_dims(p, node, (1, 2), rank)
    dims = node.args[1] if len(node.args) > 1 else list(range(rank))
    dims = [dims] if isinstance(dims, int) else list(dims) or list(range(rank))
    dims = [d % rank for d in dims]
    keep = len(node.args) > 2 and node.args[2]
    out = [None if d in dims else v for d, v in enumerate(xl)] if keep else [v for d, v in enumerate(xl) if d not in dims]
    p.lay[node] = [out, out] if isinstance(node.meta.get("val"), (tuple, list)) else out
    inner = [v if d in dims else None for d, v in enumerate(xl)]
    if all(v is None for v in inner):
        return
    mask = p.mask_of(inner, p.val(x).dtype)
    fill = p.buffer(torch.where(mask > 0, torch.zeros_like(mask), torch.full_like(mask, -math.inf)), node)
    with p.g.inserting_before(node):
        masked = p.g.call_function(aten.add.Tensor, (x, fill))
    node.replace_input_with(x, masked)


def _view(p: _Padder, node: fx.Node) -> None:
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


def _permute(p: _Padder, node: fx.Node) -> None:
    xl = p.layout(node.args[0])
    name = node.target.overloadpacket.__name__
    rank = len(xl)
    _same_dims(p, node, range(1, len(node.args)), rank + (name == "unsqueeze"))
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


def _view_like(p: _Padder, node: fx.Node) -> None:
    """flatten / unflatten through the view rule (their sizes come from the shapes)."""
    x = node.args[0]
    if node.target.overloadpacket.__name__ == "unflatten":  # the dim; its sizes may differ
        _same_dims(p, node, (1,), len(p.max_shape(x)))
    saved = node.args
    node.args = (x, list(p.max_shape(node)))
    _view(p, node)
    node.args = saved
    if node.target.overloadpacket.__name__ == "unflatten":  # its sizes: the padded ones
        dim = saved[1] % len(p.max_shape(x))
        node.args = (x, saved[1], list(p.max_shape(node)[dim: dim + len(saved[2])]), *saved[3:])


def size_arith(p: _Padder, node: fx.Node) -> None:
    """A size computed in Python from a number that differs between members, as attention's
    ``batch * num_heads``: a product of a dynamic size and a member's number uses the largest
    number (its value feeds the padded program's view shapes)."""
    if node.target is not operator.mul or len(node.args) != 2:
        p.refuse(node, "the program computes a size in Python from a number that differs between "
                       "members, in a way padding cannot follow")
    k = next((t for t, a in enumerate(node.args) if isinstance(a, int)), None)
    if k is None or not isinstance(node.args[1 - k], fx.Node):
        p.refuse(node, "a product of two sizes that both differ between members")
    args = list(node.args)
    args[k] = max(nodes[p.pos[node]].args[k] for nodes in p.nodes)
    node.args = tuple(args)
    p.lay[node] = []


def _zeros(p: _Padder, node: fx.Node) -> None:
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


def _rnn(p: _Padder, node: fx.Node) -> None:
    """lstm / gru / rnn_tanh / rnn_relu with a swept hidden size. Each gate's block of the weights
    is laid out as the hidden units (a prefix per gate); a padded unit's gates see zero weights
    and biases, so its state stays zero at every step (LSTM: i = f = o = 1/2, g = 0, c = h = 0;
    GRU: r = z = 1/2, n = 0, h = 0; RNN: tanh/relu(0) = 0), and its gradients are masked."""
    name = node.target.overloadpacket.__name__
    x, hx, params = node.args[0], node.args[1], node.args[2]
    has_biases, num_layers, bidirectional = node.args[3], node.args[4], node.args[7]
    if not isinstance(hx, (list, tuple)):  # the GRU / RNN form: hx is one tensor
        hx = [hx]
    gates = {"lstm": 4, "gru": 3}.get(name, 1)
    per_layer = (4 if has_biases else 2)
    dirs = 2 if bidirectional else 1
    if len(params) != per_layer * num_layers * dirs:
        p.refuse(node, "a recurrent layer with projections or a parameter list padding cannot follow")
    hidden = [s[1] for s in p.shapes(params[1])]  # w_hh [G*H, H]
    if any(v is not None for v in p.layout(x)[:-1]):
        p.refuse(node, "a recurrent layer over padded time or batch dims")
    lay_h = None if len(set(hidden)) == 1 else prefix(hidden, max(hidden))
    blocks = None if lay_h is None else torch.cat([lay_h] * gates, dim=1)
    layer_in = p.layout(x)[-1]
    out_lay = None if lay_h is None else (torch.cat([lay_h] * dirs, dim=1) if dirs > 1 else lay_h)
    for layer in range(num_layers):
        for d in range(dirs):
            k = (layer * dirs + d) * per_layer
            w_ih, w_hh = params[k], params[k + 1]
            for w, cols in ((w_ih, layer_in), (w_hh, lay_h)):
                p.bind(w, 0, blocks)
                p.bind(w, 1, cols)
            for b in params[k + 2:k + per_layer]:
                p.bind(b, 0, blocks)
        layer_in = out_lay
    for h in hx:
        if not same_layout(p.layout(h)[-1], lay_h):
            p.refuse(node, "an initial state padded differently from the hidden units")
    x_lay = p.layout(x)
    p.lay[node] = [x_lay[:-1] + [out_lay]] + [[None, None, lay_h] for _ in hx]


def _cat(p: _Padder, node: fx.Node) -> None:
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
                out.append(torch.cat([lay[d] if lay[d] is not None else torch.ones(p.n, p.max_shape(a)[d], dtype=torch.bool)
                                      for lay, a in zip(lays, parts)], dim=1))
        else:
            vals = [lay[d] for lay in lays]
            if any(v is not None for v in vals) and not all(same_layout(v, vals[0]) for v in vals):
                p.refuse(node, f"a concatenation whose parts are padded differently in dim {d}")
            out.append(vals[0])
    p.lay[node] = out


def _expand(p: _Padder, node: fx.Node) -> None:
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


def _sdpa(p: _Padder, node: fx.Node) -> None:
    q, k, v = node.args[:3]
    ql, kl, vl = p.layout(q), p.layout(k), p.layout(v)
    if any(lay[-2] is not None for lay in (ql, kl, vl)):
        p.refuse(node, "attention over a padded sequence length")
    if not (same_layout(ql[-1], kl[-1]) and all(same_layout(a, b) for a, b in zip(ql[:-2], kl[:-2]))):
        p.refuse(node, "query and key padded differently")
    if ql[-1] is not None:
        scale = node.kwargs.get("scale", node.args[6] if len(node.args) > 6 else None)
        if scale is None:  # SDPA's default 1 / sqrt(E) with each member's own head dim
            dtype = p.val(q).dtype
            r = (ql[-1].shape[1] / ql[-1].sum(1).to(dtype)).sqrt()
            rb = p.buffer(r.view(p.n, *([1] * len(ql))), node)
            with p.g.inserting_before(node):
                q2 = p.g.call_function(aten.mul.Tensor, (q, rb))
            node.replace_input_with(q, q2)
    p.lay[node] = ql[:-1] + [vl[-1]]


def _sym_size(p: _Padder, node: fx.Node) -> None:
    xl = p.layout(node.args[0])
    if xl[node.args[1] % len(xl)] is not None:
        p.refuse(node, "the program reads the size of a padded dim")
    p.lay[node] = []


def _copy(p: _Padder, node: fx.Node) -> None:
    dst, src = node.args[0], node.args[1]
    sl = p.layout(src)
    if isinstance(dst, fx.Node) and dst.op == "get_attr":
        for d, v in enumerate(sl):
            p.bind(dst, d, v)
    p.lay[node] = p.layout(dst)


def _select_slice(p: _Padder, node: fx.Node) -> None:
    x = node.args[0]
    xl = p.layout(x)
    dim = (node.args[1] if len(node.args) > 1 else 0) % len(xl)
    if xl[dim] is not None:
        p.refuse(node, "indexing or slicing a padded dim")
    name = node.target.overloadpacket.__name__
    p.lay[node] = [v for d, v in enumerate(xl) if d != dim] if name == "select" else xl


RULES: dict[str, Callable[[_Padder, fx.Node], None]] = {
    "add": _binary, "sub": _binary, "mul": _binary, "div": _binary, "maximum": _binary,
    "minimum": _binary, "rsub": _binary,
    "linear": _linear, "matmul": _matmul, "mm": _matmul, "bmm": _matmul,
    "conv1d": _conv, "conv2d": _conv, "conv3d": _conv, "convolution": _conv,
    "conv_transpose1d": _conv, "conv_transpose2d": _conv, "conv_transpose3d": _conv,
    "embedding": _embedding,
    "layer_norm": _layer_norm, "rms_norm": lambda p, n: _layer_norm(p, n, rms=True),
    "group_norm": _group_norm, "batch_norm": _batch_norm, "instance_norm": _batch_norm,
    "mean": _mean, "sum": _sum, "amax": _amax, "max": _amax, "softmax": _softmax, "log_softmax": _softmax, "_softmax": _softmax,
    "view": _view, "reshape": _view, "_unsafe_view": _view, "flatten": _permute,
    "unflatten": _view_like, "view_as": lambda p, n: _view_like(p, n),
    "permute": _permute, "transpose": _permute, "swapaxes": _permute, "t": _permute,
    "unsqueeze": _permute, "squeeze": _permute,
    "zeros": _zeros, "new_zeros": _zeros, "zeros_like": _zeros,
    "lstm": _rnn, "gru": _rnn, "rnn_tanh": _rnn, "rnn_relu": _rnn,
    "cat": _cat, "expand": _expand, "scaled_dot_product_attention": _sdpa, "sym_size": _sym_size,
    "copy_": _copy, "select": _select_slice, "slice": _select_slice,
}
INT_ARGS_OK = {size_arith, _zeros, _view, _expand, _layer_norm, RULES["rms_norm"], _conv, _group_norm, _view_like,
                _permute, _mean, _sum, _amax}

# Ops a widen rule handles that are refused with padded members (a refusal names the op, its line
# and this reason); the reasons, shortest first:
_NO_RULE = "no padding rule for this op yet"
_NEW = "it makes values whose padding would not be zero (random, uninitialised or a fill value)"
_REGION = ("it runs a region that export captured as a graph of its own (a torch.no_grad(), enable_grad() or "
           "autocast block inside the forward, or a parametrization's, such as spectral_norm's power iteration), "
           "and the padding rules do not reach into such regions")
_IN_PLACE = "it writes into its input in place, and the padding rules follow results, not writes"
_NOT_FINITE = "it is infinite, or has an infinite derivative, at 0: it would put inf or NaN into the padding"
_POSITIONS = "it reads or writes positions given by indices, a mask or an offset, which padding moves"
_WHOLE_DIM = ("its result depends on every position of the dim it reduces or scans (a count, an order, "
              "a product), the padding included")
REFUSED: dict[str, str] = {
    **dict.fromkeys(("bernoulli", "empty_like", "new_empty", "new_full", "new_ones", "normal", "rand",
                     "rand_like", "randint", "randint_like", "randn", "randn_like", "bernoulli_", "exponential_",
                     "normal_", "uniform_", "alpha_dropout", "feature_alpha_dropout"), _NEW),
    **dict.fromkeys(("abs_", "add_", "celu_", "clamp_", "div_", "elu_", "fill_", "hardsigmoid_", "hardswish_",
                     "hardtanh_", "leaky_relu_", "masked_fill_", "mish_", "mul_", "relu_", "selu_", "sigmoid_",
                     "silu_", "sub_", "tanh_", "zero_", "dropout_", "embedding_renorm_"), _IN_PLACE),
    **dict.fromkeys(("log", "rsqrt", "reciprocal", "sqrt", "pow"), _NOT_FINITE),
    **dict.fromkeys(("gather", "index_add", "index_add_", "index_copy", "index_copy_", "index_fill", "index_fill_",
                     "index_put", "index_put_", "index_select", "scatter", "scatter_", "scatter_add", "scatter_add_",
                     "scatter_reduce", "scatter_reduce_", "where", "masked_fill", "index", "narrow", "chunk", "split",
                     "split_with_sizes", "tensor_split", "unbind", "flip", "roll", "diagonal", "tril", "triu",
                     "unfold", "diag_embed", "diagonal_scatter", "select_scatter", "slice_scatter", "glu",
                     "pixel_shuffle", "pixel_unshuffle", "channel_shuffle", "repeat", "repeat_interleave"),
                    _POSITIONS),
    **dict.fromkeys(("all", "amin", "aminmax", "any", "argmax", "argmin", "argsort", "cummax", "cummin", "cumprod",
                     "cumsum", "kthvalue", "linalg_vector_norm", "logcumsumexp", "logsumexp", "median", "min", "mode",
                     "nansum", "norm", "prod", "sort", "std", "std_mean", "topk", "var", "var_mean"), _WHOLE_DIM),
    **dict.fromkeys((
        "embedding_bag", "addmm", "baddbmm", "dot", "einsum", "mv", "outer", "vdot", "_weight_norm", "prelu",
        "__and__", "__or__", "__xor__", "bitwise_and", "bitwise_not", "bitwise_or", "bitwise_xor", "logical_and",
        "logical_not", "logical_or", "logical_xor", "addcdiv", "addcmul", "floor_divide", "lerp", "log_sigmoid",
        "multiply", "nan_to_num", "adaptive_max_pool1d", "adaptive_max_pool3d", "max_pool1d_with_indices",
        "max_pool3d_with_indices", "feature_dropout", "special_log_softmax", "special_softmax",
        "opaque_module", "gru_cell", "lstm_cell",
        "rnn_relu_cell", "rnn_tanh_cell", "_assert_tensor_metadata", "adjoint", "expand_as", "mH", "mT",
        "matrix_H", "movedim", "numpy_T", "reshape_as", "stack", "swapdims", "sym_numel",
        "_upsample_bicubic2d_aa", "_upsample_bilinear2d_aa", "_upsample_nearest_exact1d",
        "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "upsample_bicubic2d", "upsample_linear1d",
        "upsample_nearest1d", "upsample_nearest3d", "upsample_trilinear3d", "constant_pad_nd", "pad", "col2im",
        "im2col"), _NO_RULE),
    **dict.fromkeys(("wrap_with_autocast", "wrap_with_set_grad_enabled"), _REGION),
}
# Followed by the pass itself, not by a rule: a tuple element takes its own part of the tuple's layout.
BY_THE_PASS = frozenset({"getitem"})
