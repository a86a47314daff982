"""The padding rules of the ops that compute values (Note [Padded members] in fx/padding.py):
elementwise binaries, contractions (linear, matmul, convolutions with their kernel-size sweeps,
embedding lookups over a padded vocabulary), norms, reductions, softmax, recurrent layers and
attention. What a rule does, and how the rules are chosen per op: fx/padding_rules.py.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

from .padding_layouts import prefix, same_layout
from .padding_rules_shapes import same_dims
from .source import module_path

if TYPE_CHECKING:
    from .padding_pass import Padder

__all__ = ["MATH_INT_ARGS_OK", "MATH_RULES"]

aten = torch.ops.aten


def _binary(p: Padder, node: fx.Node) -> None:
    lay, clean = _binary_layout(p, node)
    p.lay[node] = lay
    if not clean:
        p.mask_after(node, lay)


def _binary_in_place(p: Padder, node: fx.Node) -> None:
    """``a.add_(b)``, ``sub_``, ``mul_``, ``div_`` (a residual ``out += identity``, a scale): the
    result is ``a`` itself, so it must keep ``a``'s layout and come out clean (zero padding): a
    mask after would reach the op's users but not ``a``'s later ones (Note [In-place ops on
    padded values] in fx/padding_rules.py)."""
    lay, clean = _binary_layout(p, node)
    own = p.layout(node.args[0])
    if len(own) != len(lay) or not all(same_layout(a, b) for a, b in zip(own, lay)):
        p.refuse(node, "it writes in place into a tensor padded otherwise than its result")
    if not clean:
        p.refuse(node, "it writes values into the padding of its input in place (a scalar added, an operand "
                       "that does not cover the padding), which no mask after the op can take back from the "
                       "input's later uses")
    p.lay[node] = lay


def _binary_layout(p: Padder, node: fx.Node) -> tuple[list[Any], bool]:
    """A binary op's result layout, and whether its padding comes out zero (clean)."""
    name = node.target.overloadpacket.__name__.removesuffix("_")
    operands = [a for a in node.args[:2]]
    lay = p.operand_layouts(node, operands)
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
    return lay, clean


def _linear(p: Padder, node: fx.Node) -> None:
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


def _matmul(p: Padder, node: fx.Node) -> None:
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


def _conv_kernels(p: Padder, node: fx.Node, name: str, w: Any, rank: int) -> None:
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


def _conv(p: Padder, node: fx.Node) -> None:
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


def _embedding(p: Padder, node: fx.Node) -> None:
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


def _embedding_renorm(p: Padder, node: fx.Node) -> None:
    """``nn.Embedding(max_norm=...)``: ``embedding_renorm_`` scales each looked-up row whose
    ``norm_type``-norm exceeds ``max_norm`` down to it, in place. Over a padded embedding dim a
    zero padding column adds nothing to a row's norm (``norm_type > 0``) and is scaled to zero:
    exact, the table keeps its layout (probe 20 of issue 44, P20-5: refused as a write into the
    padding). A padded vocabulary (rows) is refused: an index past a member's own rows would
    renormalise a padded row before the lookup after it raises."""
    w, idx = node.args[0], node.args[1]
    wl = p.layout(w)
    if any(v is not None for v in p.layout(idx)):
        p.refuse(node, "padded indices")
    norm_type = node.args[3] if len(node.args) > 3 else node.kwargs.get("norm_type", 2.0)
    if not (isinstance(norm_type, (int, float)) and norm_type > 0):
        p.refuse(node, f"norm_type {norm_type!r}: zeros in the padding count in a norm of a non-positive order")
    if wl[0] is not None:
        p.refuse(node, "a renormalised embedding table whose vocabulary (rows) is padded")
    p.lay[node] = list(wl)


def _norm_affine(p: Padder, node: fx.Node, params: Sequence[Any], lays: list[Any]) -> None:
    """Bind the affine parameters (weight, bias over the normalized dims) to the input's layout."""
    for prm in params:
        if isinstance(prm, fx.Node) and prm.op == "get_attr":
            for d in range(len(lays)):
                p.bind(prm, d, lays[d])
        if isinstance(prm, fx.Node):
            for d, v in enumerate(p.layout(prm)):
                if not same_layout(v, lays[d]):
                    p.refuse(node, "the affine parameters are padded differently from the normalized dims")


def _layer_norm(p: Padder, node: fx.Node, rms: bool = False) -> None:
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


def _group_norm(p: Padder, node: fx.Node) -> None:
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


def _batch_norm(p: Padder, node: fx.Node) -> None:
    x = node.args[0]
    xl = p.layout(x)
    if any(v is not None for i, v in enumerate(xl) if i != 1):
        p.refuse(node, "a batch norm over padded dims other than the channels")
    _norm_affine(p, node, [a for a in node.args[1:5]], [xl[1]])
    p.lay[node] = xl  # per channel: zero channels (zero weight and bias) stay zero, stats too


def _mean(p: Padder, node: fx.Node) -> None:
    x = node.args[0]
    xl = p.layout(x)
    rank = len(xl)
    same_dims(p, node, (1, 2), rank)
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


def _sum(p: Padder, node: fx.Node) -> None:
    x = node.args[0]
    xl = p.layout(x)
    rank = len(xl)
    same_dims(p, node, (1, 2), rank)
    dims = list(range(rank)) if len(node.args) < 2 or node.args[1] is None else [d % rank for d in node.args[1]]
    keep = len(node.args) > 2 and node.args[2]
    p.lay[node] = [None if d in dims else v for d, v in enumerate(xl)] if keep else \
        [v for d, v in enumerate(xl) if d not in dims]


def _softmax(p: Padder, node: fx.Node) -> None:
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
        p.mask_after(node, xl)


def _amax(p: Padder, node: fx.Node) -> None:
    """max / amax over dims: the padding set to -inf first where a reduced dim is padded."""
    if len(node.args) > 1 and isinstance(node.args[1], fx.Node):  # torch.max(a, b)
        _binary(p, node)
        return
    x = node.args[0]
    xl = p.layout(x)
    rank = len(xl)
    same_dims(p, node, (1, 2), rank)
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


def _rnn(p: Padder, node: fx.Node) -> None:
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


def _sdpa(p: Padder, node: fx.Node) -> None:
    q, k, v = node.args[:3]
    ql, kl, vl = p.layout(q), p.layout(k), p.layout(v)
    if any(lay[-2] is not None for lay in (ql, kl, vl)):
        p.refuse(node, "attention over a padded sequence length")
    if not (same_layout(ql[-1], kl[-1]) and all(same_layout(a, b) for a, b in zip(ql[:-2], kl[:-2]))):
        p.refuse(node, "query and key padded differently")
    # each member's scale: its own (a member may pass one: transformers' scale=head_dim ** -0.5, or
    # a temperature), else SDPA's default 1 / sqrt(E) with its own head dim E; the padded call's is
    # member 0's, or the default at the padded head dim, so q is scaled per member by the ratio
    scales = [nodes[p.pos[node]].kwargs.get("scale") for nodes in p.nodes]
    if ql[-1] is not None or len(set(scales)) > 1:
        dtype, padded_dim = p.val(q).dtype, ql[-1].shape[1] if ql[-1] is not None else int(p.val(q).shape[-1])
        dims = ql[-1].sum(1).tolist() if ql[-1] is not None else [padded_dim] * p.n
        own = torch.tensor([s if s is not None else 1 / math.sqrt(e) for s, e in zip(scales, dims)],
                           dtype=torch.float64)
        used = scales[0] if scales[0] is not None else 1 / math.sqrt(padded_dim)
        r = (own / used).to(dtype)
        if not torch.equal(r, torch.ones_like(r)):
            rb = p.buffer(r.view(p.n, *([1] * len(ql))), node)
            with p.g.inserting_before(node):
                q2 = p.g.call_function(aten.mul.Tensor, (q, rb))
            node.update_arg(0, q2)  # the query alone: the same node may be the key or value too (P10-10)
    p.lay[node] = ql[:-1] + [vl[-1]]


MATH_RULES: dict[str, Callable[[Padder, fx.Node], None]] = {
    "add": _binary, "sub": _binary, "mul": _binary, "div": _binary, "maximum": _binary,
    "minimum": _binary, "rsub": _binary,
    "add_": _binary_in_place, "sub_": _binary_in_place, "mul_": _binary_in_place, "div_": _binary_in_place,
    "linear": _linear, "matmul": _matmul, "mm": _matmul, "bmm": _matmul,
    "conv1d": _conv, "conv2d": _conv, "conv3d": _conv, "convolution": _conv,
    "conv_transpose1d": _conv, "conv_transpose2d": _conv, "conv_transpose3d": _conv,
    "embedding": _embedding, "embedding_renorm_": _embedding_renorm,
    "layer_norm": _layer_norm, "rms_norm": lambda p, n: _layer_norm(p, n, rms=True),
    "group_norm": _group_norm, "batch_norm": _batch_norm, "instance_norm": _batch_norm,
    "mean": _mean, "sum": _sum, "amax": _amax, "max": _amax, "softmax": _softmax, "log_softmax": _softmax, "_softmax": _softmax,
    "lstm": _rnn, "gru": _rnn, "rnn_tanh": _rnn, "rnn_relu": _rnn,
    "scaled_dot_product_attention": _sdpa,
}
# rules that pad integer arguments which differ between members (INT_ARGS_OK in fx/padding_rules.py)
MATH_INT_ARGS_OK = {_layer_norm, MATH_RULES["rms_norm"], _conv, _group_norm, _mean, _sum, _amax}
