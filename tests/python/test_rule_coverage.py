"""Every row of the rule table is reached by a case (fx/table.py, Note [Adding a widen rule]).

Each case below is a small module, one member's sample input and the set of rule-table rows
(``wide_compiler.fx.table.RULES`` keys) it is meant to reach. Many ops share one case (one forward
applies all the unary pointwise ops, another all the reductions, ...) so the file stays quick. For
every case and mode, N=3 members with different weights are compiled with ``strict=True`` (no
per-op fallback) and ``WideConfig.fast()``; the test asserts that

* every declared row is in ``rules_used`` of the compiled graph, so a case that silently stops
  reaching its op (a rewritten forward, a different export) fails, and
* the wide model agrees with every member run alone: outputs, input and parameter gradients and
  buffers (running stats) numerically (``wide_compiler.testing.check_equivalence``), or, for
  random ops, in shape, dtype, member independence and a statistical sanity check.

``test_every_rule_row_has_a_case`` then checks that the declared rows cover the whole table, so a
new row cannot land without a case. The tests at the end hold the rest of the op checklist
(docs/internals.md, "The op checklist"): every row states its padding (fx/padding_rules.py), every
wide op its autocast policy (an ``AUTOCAST`` dict beside the rule that emits it), every
channel-packed row whether a channels-last value is followed through it (fx/rules/conv.py), and
each statement is checked against what the op does. Ops reached with no per-member argument are copied without
their rule, so every case feeds the module's input or parameters into each op.

Rows reached here only through a direct ``torch.ops.aten`` call (no public Python API emits them
on CPU in torch 2.13) are grouped in the ``direct-aten`` case, with the reason next to each op.
The ``fill-value-*`` cases are regressions of bugs this test found: a per-member 0-d fill value
(and index_fill's shared 0-d value) used to be broadcast like an operand and fail at run time.
"""
from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import wide_compiler as wc
from support import LinearModel, StackedScalar, aminmax_operand, cpu_only
from test_autocast import OP_CASES as AUTOCAST_CASES  # each wide op's call under autocast (the op checklist)
from torch import nn
from torch.utils._pytree import tree_flatten
from wide_compiler.fx.table import RULES, aten_op
from wide_compiler.testing import check_equivalence, stack_inputs

N = 3
FAST = wc.WideConfig.fast()
aten = torch.ops.aten

_SPECIAL_KEYS = {
    "getitem": operator.getitem,
    "opaque_module": torch.ops.wide_compiler.opaque_module.default,
    "wrap_with_set_grad_enabled": torch.ops.higher_order.wrap_with_set_grad_enabled,
    "wrap_with_autocast": torch.ops.higher_order.wrap_with_autocast,
}


def _key(spec: Any) -> Any:
    """A declared op -> its RULES key: ``"add.Tensor"`` -> ``aten.add.Tensor``, ``"getitem"`` ->
    ``operator.getitem``, ``"opaque_module"`` -> the registered-module op; objects pass through."""
    if not isinstance(spec, str):
        return spec
    return _SPECIAL_KEYS[spec] if spec in _SPECIAL_KEYS else aten_op(spec)


# ---------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    make: Callable[[], nn.Module]  # one member (called with a different seed per member)
    inputs: Callable[[], tuple]  # one member's positional inputs (called with a different seed per member)
    ops: tuple  # RULES keys (or specs for _key) the case must reach in every mode it runs
    modes: tuple[str, ...] = ("train",)
    random: tuple[str, ...] = ()  # modes whose outputs are random (checked by `check_random`)
    check_random: Callable | None = None  # (wide_leaves, member_leaves, inputs) -> None
    harness: Callable | None = None  # wide model -> extra keywords of check_equivalence


def _fn_module(fn: Callable, arity: int, **params: tuple) -> Callable[[], nn.Module]:
    """A factory of modules whose forward is ``fn(self, *inputs)`` with parameters of the given
    shapes (random, so members differ). One class per arity: export wants a fixed signature."""
    bases = {1: _Fn1, 2: _Fn2, 3: _Fn3}

    def make() -> nn.Module:
        m = bases[arity](fn)
        for name, shape in params.items():
            m.register_parameter(name, nn.Parameter(torch.randn(shape)))
        return m

    return make


class _Fn(nn.Module):
    def __init__(self, fn: Callable) -> None:
        super().__init__()
        self.fn = fn


class _Fn1(_Fn):
    def forward(self, x):
        return self.fn(self, x)


class _Fn2(_Fn):
    def forward(self, x, y):
        return self.fn(self, x, y)


class _Fn3(_Fn):
    def forward(self, x, y, z):
        return self.fn(self, x, y, z)


def _randn(*shapes: tuple) -> Callable[[], tuple]:
    return lambda: tuple(torch.randn(s) for s in shapes)


# --- pointwise ---------------------------------------------------------------------------------
def _unary(m, x):
    h = x * m.w
    a, pos = h.abs(), h > 0
    return (
        F.relu(h), F.gelu(h), F.silu(h), torch.tanh(h), torch.sigmoid(h), F.leaky_relu(h, 0.1),
        F.hardtanh(h), F.elu(h), F.celu(h), F.selu(h), F.softplus(h), F.mish(h), F.hardswish(h),
        F.hardsigmoid(h), F.logsigmoid(h), -h, torch.exp(h), torch.log(a + 1), torch.sqrt(a),
        torch.rsqrt(a + 1), torch.sin(h), torch.cos(h), torch.square(h), torch.reciprocal(a + 1),
        h.clamp(-0.5, 0.5), h.clone(), h[...], h.detach(), torch.erf(h), torch.sign(h), h.t().contiguous(),
        F.rrelu(h, training=False), torch.nan_to_num(h / pos), torch.logical_not(pos),
        torch.bitwise_not(pos), h.double(), h.to("cpu"), h.to("cpu", torch.float64), h.type_as(x.double()),
    )


def _inplace(m, x, y):
    h = x * m.w
    c = h.clone
    return (
        F.relu(c(), inplace=True), F.silu(c(), inplace=True), c().tanh_(), c().sigmoid_(),
        F.leaky_relu(c(), 0.1, inplace=True), F.hardtanh(c(), inplace=True), F.elu(c(), inplace=True),
        F.celu(c(), inplace=True), F.selu(c(), inplace=True), F.mish(c(), inplace=True),
        F.hardswish(c(), inplace=True), F.hardsigmoid(c(), inplace=True), c().clamp_(-0.5, 0.5),
        c().add_(y), c().sub_(y), c().mul_(y), c().div_(y.abs() + 1),
    )


def _binary(m, x, y):
    h = x * m.w
    p, q = h > 0, y > 0
    return (
        h + y, h - y, torch.rsub(h, y), 1 - h, h * y, h / y, torch.div(h, y, rounding_mode="trunc"),
        h ** 2, h.abs() ** y, torch.maximum(h, y), torch.minimum(h, y), p & q, p | q, p ^ q,
        torch.bitwise_and(p, q), torch.bitwise_or(p, q), torch.bitwise_xor(p, q), torch.logical_and(p, q),
        torch.logical_or(p, q), torch.logical_xor(p, q), h.masked_fill(q, 1.0),
        h.masked_fill(q, torch.tensor(2.0)), torch.where(q, h, y), torch.lerp(h, y, 0.3),
        torch.lerp(h, y, y.sigmoid()), torch.addcmul(h, h, y), torch.addcdiv(h, h, y.abs() + 1),
        h.clamp(min=y), h.clamp(max=m.w),
    )


_UNARY_OPS = (
    "mul.Tensor", "abs", "relu", "gelu", "silu", "tanh", "sigmoid", "leaky_relu", "hardtanh", "elu",
    "celu", "selu", "softplus", "mish", "hardswish", "hardsigmoid", "log_sigmoid", "neg", "exp", "log",
    "sqrt", "rsqrt", "sin", "cos", "square", "reciprocal", "clamp", "clone", "alias", "detach", "erf",
    "sign", "rrelu", "contiguous", "nan_to_num", "logical_not", "bitwise_not", "to.dtype",
    "to.dtype_layout", "to.device", "type_as", "_assert_tensor_metadata", "add.Tensor", "div.Tensor",
)
_INPLACE_OPS = (
    "clone", "relu_", "silu_", "tanh_", "sigmoid_", "leaky_relu_", "hardtanh_", "elu_", "celu_", "selu_",
    "mish_", "hardswish_", "hardsigmoid_", "clamp_", "add_.Tensor", "sub_.Tensor", "mul_.Tensor",
    "div_.Tensor",
)
_BINARY_OPS = (
    "add.Tensor", "sub.Tensor", "rsub.Tensor", "rsub.Scalar", "mul.Tensor", "div.Tensor", "div.Tensor_mode",
    "pow.Tensor_Scalar", "pow.Tensor_Tensor", "maximum", "minimum", "__and__.Tensor", "__or__.Tensor",
    "__xor__.Tensor", "bitwise_and.Tensor", "bitwise_or.Tensor", "bitwise_xor.Tensor", "logical_and",
    "logical_or", "logical_xor", "masked_fill.Scalar", "masked_fill.Tensor", "where.self", "lerp.Scalar",
    "lerp.Tensor", "addcmul", "addcdiv", "clamp.Tensor",
)


# --- reductions and dim ops ----------------------------------------------------------------------
def _reduce_all(m, x):
    h = x * m.w
    p = h > 0
    return (
        h.sum(), h.mean(), h.max(), h.min(), h.prod(), p.all(), p.any(), h.std(unbiased=False),
        h.var(unbiased=False), h.nansum(), h.argmax(), h.argmin(), h.argmax(keepdim=True),
        torch.var_mean(h), torch.std_mean(h), torch.aminmax(aminmax_operand(h)), h.var(), h.std(),
    )


def _reduce_dim(m, x):
    h = x * m.w  # [B, 8]
    p = h > 0
    idx = torch.tensor([[0, 2, 5]]).expand(h.shape[0], 3)
    return (
        h.sum(1), h.mean(1), h.amax(1), h.amin(-1), h.argmax(1), h.argmin(1), h.var(1), h.std(1),
        h.var(1, correction=0), h.std(1, correction=0), torch.var_mean(h, 1), torch.std_mean(h, 1),
        torch.linalg.vector_norm(h, 2, 1), h.max(1), h.min(1), h.logsumexp(1), h.prod(1), p.any(1),
        p.any((0, 1)), p.all(1), p.all((0, 1)), h.topk(3, 1), h.sort(1), h.sort(dim=1, stable=True),
        h.argsort(1), h.argsort(dim=1, stable=True), h.cummax(1), h.cummin(1), h.median(1), h.mode(1),
        h.kthvalue(2, 1), h.nansum(1), torch.aminmax(aminmax_operand(h), dim=1), h.softmax(1), h.log_softmax(-1),
        h.cumsum(1), h.cumprod(1), h.logcumsumexp(1), F.glu(h, 1), h.gather(1, idx),
    )


def _scatter(m, x, y):
    h = x * m.w  # [B, 6]
    idx = torch.tensor([[0, 2]]).expand(h.shape[0], 2)
    cols = torch.tensor([0, 2])
    h3, y3 = h.view(-1, 2, 3), y.view(-1, 2, 3)
    src = y[:, :2]  # the shape of idx: scatter's backward gives src a gradient of idx's shape
    return (
        torch.select_scatter(h, y[:, 0], 1, 0), torch.slice_scatter(h, y[:, :2], 1, 0, 2),
        torch.diagonal_scatter(h3, y3[:, :, 0], 0, 1, 2), h.scatter(1, idx, src), h.scatter(1, idx, 2.0),
        h.scatter_add(1, idx, src), h.scatter_reduce(1, idx, src, "amax"), h.index_add(1, cols, y[:, :2]),
        h.index_copy(1, cols, y[:, :2]), h.index_fill(1, cols, 1.0),
        torch.diag_embed(h), h.index_select(1, cols), h[:, cols], h[cols],
    )


_REDUCE_ALL_OPS = (
    "sum.default", "mean.default", "max.default", "min.default", "prod.default", "all.default",
    "any.default", "std.default", "var.default", "nansum", "argmax", "argmin", "var_mean.correction",
    "std_mean.correction", "aminmax", "var.correction", "std.correction",
)
_REDUCE_DIM_OPS = (
    "sum.dim_IntList", "mean.dim", "amax", "amin", "argmax", "argmin", "var.dim", "std.dim",
    "var.correction", "std.correction", "var_mean.dim", "std_mean.dim", "linalg_vector_norm", "max.dim",
    "min.dim", "logsumexp", "prod.dim_int", "any.dim", "any.dims", "all.dim", "all.dims", "topk",
    "sort.default", "sort.stable", "argsort.default", "argsort.stable", "cummax", "cummin", "median.dim",
    "mode", "kthvalue", "nansum", "aminmax", "softmax.int", "log_softmax.int", "cumsum", "cumprod",
    "logcumsumexp", "glu", "gather", "getitem",
)
_SCATTER_OPS = (
    "select_scatter", "slice_scatter", "diagonal_scatter", "scatter.src", "scatter.value", "scatter_add",
    "scatter_reduce.two", "index_add", "index_copy", "index_fill.int_Scalar",
    "diag_embed", "index_select", "index.Tensor", "select.int", "slice.Tensor", "view",
)


def _inplace_writes(m, x, y):
    h = x * m.w  # [B, 6]
    q = y > 0
    idx, cols = torch.tensor([[0, 2]]).expand(h.shape[0], 2), torch.tensor([0, 2])
    c = h.clone
    out = torch.zeros(x.shape[0], 8)  # a shared tensor written with per-member values
    out[:, 1:7] = h
    return (
        c().copy_(y), c().fill_(2.0), c().fill_(torch.tensor(3.0)), c().zero_(), c().masked_fill_(q, 1.0),
        c().masked_fill_(q, torch.tensor(2.0)), c().index_add_(1, cols, y[:, :2]), c().index_copy_(1, cols, y[:, :2]),
        c().index_fill_(1, cols, 1.0), c().scatter_(1, idx, y[:, :2]), c().scatter_(1, idx, 2.0),
        c().scatter_add_(1, idx, y[:, :2]), c().scatter_reduce_(1, idx, y[:, :2], "sum"), out,
    )


_INPLACE_WRITE_OPS = (
    "copy_", "fill_.Scalar", "fill_.Tensor", "zero_", "masked_fill_.Scalar", "masked_fill_.Tensor",
    "index_add_", "index_copy_", "index_fill_.int_Scalar", "scatter_.src", "scatter_.value", "scatter_add_",
    "scatter_reduce_.two",
)


# --- shape ops ------------------------------------------------------------------------------------
def _shape(m, x, y):
    h = x * m.w  # [B, 6]
    h3 = h.view(-1, 2, 3)
    return (
        h.transpose(0, 1), h.unsqueeze(1), h.unsqueeze(1).squeeze(1), h.unsqueeze(1).unsqueeze(1).squeeze((1, 2)),
        h.unsqueeze(1).squeeze(), h3.flatten(1), h.unflatten(1, (2, 3)), h[:, 1], h[:, 1:3], h.narrow(1, 0, 2),
        h.split(2, 1), h.split([2, 4], 1), h.chunk(2, 1), h.unbind(1), h.tensor_split(2, 1),
        h.tensor_split([1, 3], 1), h.flip(1), h.movedim(0, 1), torch.movedim(h3, (1, 2), (2, 1)),
        h3.diagonal(0, 1, 2), h.repeat_interleave(2, 1), h.unfold(1, 2, 2), h.swapaxes(0, 1),
        h.swapdims(0, 1), h.reshape(-1, 3, 2), h[:, :1].expand_as(h), h.view_as(y), h.reshape_as(y),
        h.unsqueeze(1).expand(-1, 3, -1), h.repeat(2, 1), h3.permute(2, 0, 1), h.t(), h.T,
        torch.cat([h, y], 1), torch.stack([h, y], 1), h.roll(1, 1), h3.mT, h3.mH, h3.adjoint(), h.tril(),
        h.triu(1), h.view(h.size(0), 2, 3), h.view(x.numel() // 6, 6), h.double(), (h * 1).detach_(),
    )


_SHAPE_OPS = (
    "transpose.int", "unsqueeze", "squeeze.dim", "squeeze.dims", "squeeze.default", "flatten.using_ints",
    "unflatten.int", "select.int", "slice.Tensor", "narrow", "split.Tensor", "split_with_sizes", "chunk",
    "unbind.int", "tensor_split.sections", "tensor_split.indices", "flip", "movedim.int", "movedim.intlist",
    "diagonal", "repeat_interleave.self_int", "unfold", "swapaxes", "swapdims", "view", "reshape",
    "expand_as", "view_as", "reshape_as", "expand", "repeat", "permute", "t", "numpy_T", "cat", "stack",
    "roll", "getitem", "_assert_tensor_metadata", "mT", "mH", "adjoint", "tril", "triu", "sym_size.int",
    "sym_numel", "detach_",
)


# --- creation ------------------------------------------------------------------------------------
def _creation(m, x):
    h = x * m.w
    return (
        torch.zeros_like(h), torch.ones_like(h), torch.full_like(h, 2.0), h.new_zeros(3), h.new_ones(3),
        h.new_full((3,), 2.0),
    )


def _random_creation(m, x):
    h = x * m.w
    s = h.sigmoid()
    return (
        torch.rand_like(h), torch.randn_like(h), torch.randint_like(h, 10), torch.randint_like(h, 2, 10),
        torch.bernoulli(s), torch.bernoulli(h, 0.5), torch.rand(64), torch.randn(64), torch.randint(10, (64,)),
        torch.randint(2, 10, (64,)), torch.normal(3.0, 0.5, (64,)), torch.empty_like(h), h.new_empty(3),
    )


def _check_random_creation(wide, members, inputs) -> None:
    rand_like, randn_like, ri, ri_low, bern, bern_p, rand, randn, rint, rint_low, normal, _, _ = wide
    for t in (rand_like, rand):
        assert ((t >= 0) & (t < 1)).all()
    for t in (ri, ri_low, rint, rint_low):
        assert t.dtype == (torch.int64 if t is rint or t is rint_low else torch.float32)
    assert ((ri >= 0) & (ri < 10)).all() and (ri == ri.round()).all()
    assert ((ri_low >= 2) & (ri_low < 10)).all() and ((rint >= 0) & (rint < 10)).all()
    assert ((rint_low >= 2) & (rint_low < 10)).all()
    for t in (bern, bern_p):
        assert ((t == 0) | (t == 1)).all()
    assert abs(normal.mean().item() - 3.0) < 0.3 and 0.3 < normal.std().item() < 0.7
    assert abs(randn.mean().item()) < 0.5 and 0.6 < randn.std().item() < 1.4
    _members_differ([rand_like, randn_like, ri, ri_low, bern, bern_p, rand, randn, rint, rint_low, normal])


_CREATION_OPS = ("zeros_like", "ones_like", "full_like", "new_zeros", "new_ones", "new_full")
_RANDOM_CREATION_OPS = (
    "rand_like", "randn_like", "randint_like.default", "randint_like.low_dtype", "bernoulli.default",
    "bernoulli.p", "rand.default", "randn.default", "randint.default", "randint.low", "normal.float_float",
    "empty_like", "new_empty",
)


# --- linear algebra --------------------------------------------------------------------------------
def _matmul(m, x):
    q = x.view(-1, 2, 3)  # [B, 2, 3]: one member's [H, L, E] for unbatched SDPA
    q4 = x.view(-1, 1, 2, 3)  # [B, 1, 2, 3]
    causal = torch.ones(2, 2, dtype=torch.bool).tril()
    return (
        F.linear(x, m.W, m.b), x @ m.M, torch.mm(x, m.M), torch.bmm(q, q.transpose(1, 2)), torch.mv(x, m.v),
        torch.dot(m.v, m.v * 2), torch.einsum("bi,ij->bj", x, m.M), F.scaled_dot_product_attention(q, q, q),
        F.scaled_dot_product_attention(q4, q4 * 2, q4, attn_mask=causal),
        F.scaled_dot_product_attention(q4, q4, q4 * 3, attn_mask=m.mask), torch.outer(m.v, m.u),
        torch.addmm(m.u, x, m.M), m.M.t() @ m.v,
    )


_MATMUL_OPS = (
    "linear", "matmul", "mm", "bmm", "mv", "dot", "einsum", "scaled_dot_product_attention", "outer", "addmm",
    "t", "view", "transpose.int",
)


# --- convolutions, norms ------------------------------------------------------------------------------
class _Convs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c1s = nn.Conv1d(3, 4, 3), nn.Conv1d(3, 4, 3, padding="same", dilation=2)
        self.c2, self.c2s = nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.Conv2d(3, 4, 2, padding="same")
        self.c3, self.c3s = nn.Conv3d(3, 4, 3, bias=False), nn.Conv3d(3, 2, 3, padding="valid")
        self.t1 = nn.ConvTranspose1d(3, 4, 3, stride=2, output_padding=1)
        self.t2 = nn.ConvTranspose2d(3, 4, 3, groups=1, bias=False)
        self.t3 = nn.ConvTranspose3d(3, 2, 2, stride=2)
        self.r = nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect")

    def forward(self, x1, x2, x3):
        c = self.c2
        return (self.c1(x1), self.c1s(x1), c(x2), self.c2s(x2), self.c3(x3), self.c3s(x3), self.t1(x1),
                self.t2(x2), self.t3(x3), self.r(x2), self.c1(x1[0]),
                torch.convolution(x2, c.weight, c.bias, [1, 1], [1, 1], [1, 1], False, [0, 0], 1),
                torch.convolution(x2, self.t2.weight, None, [2, 2], [0, 0], [1, 1], True, [1, 1], 1))


_CONV_OPS = (
    "conv1d.default", "conv1d.padding", "conv2d.default", "conv2d.padding", "conv3d.default", "conv3d.padding",
    "conv_transpose1d.default", "conv_transpose2d.input", "conv_transpose3d.input", "convolution.default",
    "pad", "select.int",
)


class _Norms(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn1, self.bn2 = nn.BatchNorm1d(6), nn.BatchNorm2d(3)
        self.inorm = nn.InstanceNorm2d(3, affine=True, track_running_stats=True)
        self.gn, self.prelu, self.prelu1 = nn.GroupNorm(3, 6), nn.PReLU(3), nn.PReLU()
        self.ln, self.rms = nn.LayerNorm(6), nn.RMSNorm([2, 3])

    def forward(self, x, img):
        feats = torch.cat([img, img * 2], 1)  # [B, 6, H, W]
        return (self.bn1(x), self.bn2(img), self.inorm(img), self.gn(feats), self.prelu(img), self.prelu1(x),
                self.ln(x), self.rms(x.view(-1, 2, 3)))


_NORM_OPS = ("batch_norm", "instance_norm", "group_norm", "prelu", "layer_norm", "rms_norm")


# --- random fills in place (fx/rules/randomness.py) ---------------------------------------------
def _random_fills(m, x):
    h = x * m.w
    rows = torch.empty(h.shape[0], 16).bernoulli_(0.5)  # shared tensor made in forward: gets a member dim
    return (
        rows, torch.empty_like(h).bernoulli_(h.sigmoid()), torch.empty_like(h).uniform_(2.0, 3.0),
        torch.empty_like(h).normal_(5.0, 0.5), torch.empty_like(h).exponential_(2.0),
    )


def _check_random_fills(wide, members, inputs) -> None:
    rows, bern_t, uniform, normal, expo = wide
    for t in (rows, bern_t):
        assert ((t == 0) | (t == 1)).all()
    assert ((uniform >= 2) & (uniform <= 3)).all()
    assert abs(normal.mean().item() - 5.0) < 0.3 and 0.3 < normal.std().item() < 0.7
    assert (expo >= 0).all() and 0.2 < expo.mean().item() < 1.0
    _members_differ([rows, bern_t, uniform, normal, expo])


_RANDOM_FILL_OPS = ("bernoulli_.float", "bernoulli_.Tensor", "uniform_", "normal_", "exponential_")


# --- pooling, dropout, spatial ----------------------------------------------------------------------
def _pools(m, x1, x2, x3):
    x1, x2, x3 = x1 * m.w.view(3, 1), x2 * m.w.view(3, 1, 1), x3 * m.w.view(3, 1, 1, 1)
    return (
        F.max_pool1d(x1, 2), F.max_pool1d(x1, 2, return_indices=True), F.avg_pool1d(x1, 2),
        F.adaptive_avg_pool1d(x1, 3), F.adaptive_max_pool1d(x1, 3), F.adaptive_max_pool1d(x1, 3, True),
        F.max_pool2d(x2, 2), F.max_pool2d(x2, 3, 2, 1, return_indices=True), F.avg_pool2d(x2, 2),
        F.adaptive_avg_pool2d(x2, (3, 2)), F.adaptive_max_pool2d(x2, 3), F.adaptive_max_pool2d(x2, 2, True),
        F.max_pool3d(x3, 2), F.max_pool3d(x3, 2, return_indices=True), F.avg_pool3d(x3, 2),
        F.adaptive_avg_pool3d(x3, 2), F.adaptive_max_pool3d(x3, 2), F.max_pool2d(x2[0], 2),
    )


_POOL_OPS = (
    "max_pool1d", "max_pool1d_with_indices", "avg_pool1d", "adaptive_avg_pool1d", "adaptive_max_pool1d",
    "max_pool2d", "max_pool2d_with_indices", "avg_pool2d", "adaptive_avg_pool2d", "adaptive_max_pool2d",
    "max_pool3d", "max_pool3d_with_indices", "avg_pool3d", "adaptive_avg_pool3d", "adaptive_max_pool3d",
    "getitem",
)


class _Dropouts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 1, 1) + 3)  # away from 0: kept values are recognisable
        self.drop, self.alpha, self.drop2d = nn.Dropout(0.5), nn.AlphaDropout(0.5), nn.Dropout2d(0.5)
        self.falpha, self.rrelu = nn.FeatureAlphaDropout(0.5), nn.RReLU()

    def forward(self, img):  # img [B, 4, H, W]
        h = img * self.w
        native, mask = torch.native_dropout(h, 0.5, self.training)
        return self.drop(h), self.alpha(h), self.drop2d(h), self.falpha(h), native, mask, self.rrelu(h - 3)


def _check_dropouts(wide, members, inputs) -> None:
    drop, alpha, drop2d, falpha, native, mask, rrelu = wide
    h = torch.stack([inp[0] * m.w for inp, m in zip(inputs, members)]).detach()
    for out in (drop, native):  # kept values are scaled by 1/(1-p) = 2, dropped ones are 0
        kept = out != 0
        torch.testing.assert_close(out[kept], 2 * h[kept])
        assert 0.2 < kept.float().mean().item() < 0.8
    torch.testing.assert_close(native, 2 * h * mask)
    planes = drop2d.flatten(3)  # Dropout2d: whole (sample, channel) planes are kept or dropped
    kept = (planes != 0).all(-1)
    assert (kept | (planes == 0).all(-1)).all()
    torch.testing.assert_close(drop2d[kept], 2 * h[kept])
    assert 0.1 < kept.float().mean().item() < 0.9
    for out in (alpha, falpha):
        assert torch.isfinite(out).all() and not torch.equal(out, h)
    neg = h < 3  # RReLU in train: negative inputs scaled by a slope drawn in [1/8, 1/3]
    slope = rrelu[neg] / (h[neg] - 3)
    assert ((slope >= 1 / 8 - 1e-6) & (slope <= 1 / 3 + 1e-6)).all()
    _members_differ([drop, alpha, drop2d, falpha, native, rrelu])


_DROPOUT_OPS = ("dropout", "alpha_dropout", "feature_dropout", "feature_alpha_dropout", "native_dropout", "rrelu")


def _spatial(m, x1, x2, x3):
    x1, x2, x3 = x1 * m.w.view(3, 1), x2 * m.w.view(3, 1, 1), x3 * m.w.view(3, 1, 1, 1)
    up = lambda x, mode, **kw: F.interpolate(x, scale_factor=2, mode=mode, **kw)  # noqa: E731
    return (
        F.pad(x2, (1, 2, 0, 1)), F.pad(x2, (1, 1, 2, 0), mode="reflect"), F.pad(x2, (1, 1, 1, 1), mode="replicate"),
        F.pad(x2, (1, 1, 1, 1), mode="circular"), F.pad(x1, (2, 1), mode="reflect"), F.pad(x1[0], (1, 1), "reflect"),
        F.pad(x3, (1, 1, 1, 1, 1, 1), mode="replicate"), torch.constant_pad_nd(x2, [1, 1], 0.5),
        up(x1, "nearest"), up(x1, "nearest-exact"), up(x1, "linear"), up(x2, "nearest"), up(x2, "nearest-exact"),
        up(x2, "bilinear"), up(x2, "bicubic", align_corners=True), up(x2, "bilinear", antialias=True),
        F.interpolate(x2, size=(3, 3), mode="bicubic", antialias=True), up(x3, "nearest"), up(x3, "nearest-exact"),
        up(x3, "trilinear"), F.pixel_shuffle(torch.cat([x2, x2 + 1, x2 * 2, x2 - 1], 1), 2),
        F.pixel_unshuffle(x2, 2), F.channel_shuffle(torch.cat([x2, x2 * 2], 1), 2),
        F.fold(F.unfold(x2, 2, padding=1), (6, 6), 2, padding=1), F.unfold(x2[0], 3, stride=2),
        F.fold(F.unfold(x2, 2)[0], (6, 6), 2),
    )


_SPATIAL_OPS = (
    "pad", "constant_pad_nd", "upsample_nearest1d.vec", "_upsample_nearest_exact1d.vec", "upsample_linear1d.vec",
    "upsample_nearest2d.vec", "_upsample_nearest_exact2d.vec", "upsample_bilinear2d.vec", "upsample_bicubic2d.vec",
    "_upsample_bilinear2d_aa.vec", "_upsample_bicubic2d_aa.vec", "upsample_nearest3d.vec",
    "_upsample_nearest_exact3d.vec", "upsample_trilinear3d.vec", "pixel_shuffle", "pixel_unshuffle",
    "channel_shuffle", "cat", "im2col", "col2im",
)


# --- embeddings ----------------------------------------------------------------------------------
class _Embeddings(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.renorm = nn.Embedding(10, 4, padding_idx=0), nn.Embedding(10, 4, max_norm=1.0)
        self.bag = nn.EmbeddingBag(10, 4, mode="mean")
        self.bag_max = nn.EmbeddingBag(10, 4, mode="max", padding_idx=1)
        self.bag_sum = nn.EmbeddingBag(10, 4, mode="sum")

    def forward(self, tokens, flat, offsets):
        return (self.emb(tokens), self.renorm(tokens), self.bag(flat, offsets), self.bag_max(flat, offsets),
                self.bag(tokens), self.bag_sum(flat, offsets, per_sample_weights=flat.float() / 10),
                torch.embedding_bag(self.bag.weight, flat, offsets, False, 1, False, None, False)[0])


def _embedding_inputs() -> tuple:
    return torch.randint(0, 10, (4, 3)), torch.randint(0, 10, (7,)), torch.tensor([0, 2, 2, 5])


_EMBEDDING_OPS = ("embedding", "embedding_renorm_", "embedding_bag.default", "embedding_bag.padding_idx",
                  "getitem", "reshape")


# --- a module with a user-registered wide form ----------------------------------------------------
class _Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.rand(()))

    def forward(self, x):
        return x * self.s if self.s > 0.5 else x - self.s  # data-dependent: export cannot trace it


@wc.register(_Gate)
class _WideGate(StackedScalar):
    def forward(self, x):
        s = self.per_member(x)
        return torch.where(s > 0.5, x * s, x - s)

    def unfuse(self):
        out = [_Gate() for _ in range(self.s.shape[0])]
        for m, s in zip(out, self.s.detach()):
            m.s.data.copy_(s)
        return out


class _WithGate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.gate = nn.Linear(6, 6), _Gate()

    def forward(self, x):
        return self.gate(self.lin(x)).relu()


# --- rows reachable only by a direct torch.ops.aten call (see the module doc) ----------------------
def _direct_aten(m, x):
    h = x * m.w  # [B, 6]
    return (
        aten.norm.Scalar(h, 2),  # torch.norm -> linalg_vector_norm on CPU/CUDA; _VF.norm on other devices
        aten.norm.ScalarOpt_dim(h, 3, [1]),  # likewise, with a dim
        aten._unsafe_view(h, [-1]),  # no Python API emits it in export's training IR
    )


_DIRECT_ATEN_OPS = ("norm.Scalar", "norm.ScalarOpt_dim", "_unsafe_view")


# --- 0-d fill values (regressions) -----------------------------------------------------------------
def _masked_fill_member_value(m, x):
    return x.masked_fill(x > 0, m.w[0])  # the fill value is a per-member 0-d tensor


def _masked_fill_inplace_member_value(m, x):
    return (x * 1).masked_fill_(x > 0, m.w[0])


def _fill_member_value(m, x):
    return (x * 1).fill_(m.w[0])


def _index_fill_tensor_value(m, x):
    return (x * m.w).index_fill(1, torch.tensor([0, 2]), torch.tensor(2.0))  # a shared 0-d value


def _index_fill_inplace_tensor_value(m, x):
    return (x * m.w).index_fill_(1, torch.tensor([0, 2]), torch.tensor(2.0))  # a shared 0-d value


def _index_fill_member_value(m, x):
    return x.index_fill(1, torch.tensor([0, 2]), m.w[0])  # the fill value is a per-member 0-d tensor


def _fill_value_case(name: str, fn: Callable, op: str) -> Case:
    """A 0-d fill value regression: ``fn`` on one [4, 6] input with a parameter ``w`` [6] covers ``op``."""
    return Case(f"fill-value-{name}", _fn_module(fn, 1, w=(6,)), _randn((4, 6)), (op,))


def _index_per_member(m, x, y):
    """Indices that differ per member (a GCN's edge_index buffer, positions computed from the
    member's values): position lists, same-rank indices, index_put and a per-member mask."""
    h = x * m.w  # [B, 6]
    cols = m.w.detach().argsort()  # a per-member permutation of 0..5: distinct positions
    idx = cols[:2].expand(h.shape[0], 2)
    out = h.clone()
    out[:, cols[:2]] = y[:, :2]  # index_put_ behind a slice
    return (
        h.index_select(1, cols), h.index_add(1, cols[:3], y[:, :3]), h.clone().index_add_(1, cols[:3], y[:, :3]),
        h.index_copy(1, cols[:2], y[:, :2]), h.index_fill(1, cols[:2], 1.0), h.index_fill(1, cols[:2], m.w[0]),
        h.gather(1, idx), h.scatter_add(1, idx, y[:, :2]), torch.index_put(h, (cols[:2] % 2,), y[0], True), out,
        h.clone().index_put_((h > 0,), torch.tensor(0.0)),
    )


# --- recurrent layers and cells ------------------------------------------------------------------
class _Recurrent(nn.Module):
    def __init__(self, rnn: nn.Module) -> None:
        super().__init__()
        self.rnn = rnn

    def forward(self, x):
        out, _ = self.rnn(x)
        return out


class _Cells(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm, self.gru = nn.LSTMCell(6, 6), nn.GRUCell(6, 6)
        self.tanh, self.relu = nn.RNNCell(6, 6), nn.RNNCell(6, 6, nonlinearity="relu")

    def forward(self, x):
        h, c = self.lstm(x)
        return self.relu(self.tanh(self.gru(h), c))


def _model_ops(m, x):  # ops real models emit (ConvBERT, MultiheadAttention masks, losses' softmax)
    h = x * m.w
    a = torch.multiply(h, 2.0) + torch.floor_divide(h.detach(), 0.7)  # no derivative
    b = torch.where(h > 0, 1.0, h) + torch.where(h > 0, h, 0.5) + torch.where(h > 0, 1.0, 0.0)
    c = h.clone().abs_()
    e = torch.special.softmax(h, 1) + torch.special.log_softmax(h, 1)
    f = torch.baddbmm(m.A, m.A, m.A, beta=0.5, alpha=2.0) + torch.baddbmm(m.A, m.A, m.A, beta=0.0)
    return a + b + c + e, h[:3, :3].H, f


def _dropout_inplace(m, x):
    return F.dropout(x * m.w, 0.3, training=m.training, inplace=True)


class _Regions(LinearModel):
    linears = {"fc": (6, 6)}

    def forward(self, x):
        h = self.fc(x)
        with torch.no_grad():
            scale = h.abs().mean(-1, keepdim=True) + 1
        with torch.autocast("cpu", enabled=False):
            return h / scale


CASES: list[Case] = [
    Case("unary", _fn_module(_unary, 1, w=(8,)), _randn((4, 8)), _UNARY_OPS),
    Case("inplace", _fn_module(_inplace, 2, w=(8,)), _randn((4, 8), (4, 8)), _INPLACE_OPS),
    Case("binary", _fn_module(_binary, 2, w=(8,)), _randn((4, 8), (4, 8)), _BINARY_OPS),
    Case("reduce-all", _fn_module(_reduce_all, 1, w=(8,)), _randn((4, 8)), _REDUCE_ALL_OPS),
    Case("reduce-dim", _fn_module(_reduce_dim, 1, w=(8,)), _randn((4, 8)), _REDUCE_DIM_OPS),
    Case("scatter-index", _fn_module(_scatter, 2, w=(6,)), _randn((4, 6), (4, 6)), _SCATTER_OPS),
    Case("inplace-writes", _fn_module(_inplace_writes, 2, w=(6,)), _randn((4, 6), (4, 6)), _INPLACE_WRITE_OPS),
    Case("index-per-member", _fn_module(_index_per_member, 2, w=(6,)), _randn((4, 6), (4, 6)),
         ("index_select", "index_add", "index_add_", "index_copy", "index_fill.int_Scalar", "index_fill.int_Tensor",
          "gather", "scatter_add", "index_put", "index_put_")),
    Case("shape", _fn_module(_shape, 2, w=(6,)), _randn((4, 6), (4, 6)), _SHAPE_OPS),
    Case("creation", _fn_module(_creation, 1, w=(8,)), _randn((4, 8)), _CREATION_OPS),
    Case("random-creation", _fn_module(_random_creation, 1, w=(8,)), _randn((4, 8)), _RANDOM_CREATION_OPS,
         random=("train",), check_random=_check_random_creation),
    Case("random-fills", _fn_module(_random_fills, 1, w=(8,)), _randn((4, 8)), _RANDOM_FILL_OPS,
         random=("train",), check_random=_check_random_fills),
    Case("matmul", _fn_module(_matmul, 1, W=(5, 6), b=(5,), M=(6, 5), v=(6,), u=(5,), mask=(2, 2)),
         _randn((4, 6)), _MATMUL_OPS),
    Case("conv", _Convs, _randn((2, 3, 9), (2, 3, 6, 6), (2, 3, 4, 4, 4)), _CONV_OPS),
    Case("norm", _Norms, _randn((4, 6), (4, 3, 5, 5)), _NORM_OPS, modes=("train", "eval")),
    Case("pooling", _fn_module(_pools, 3, w=(3,)), _randn((2, 3, 9), (2, 3, 7, 7), (2, 3, 4, 4, 4)), _POOL_OPS),
    Case("dropout", _Dropouts, _randn((4, 4, 3, 3)), _DROPOUT_OPS, modes=("train", "eval"), random=("train",),
         check_random=_check_dropouts),
    Case("spatial", _fn_module(_spatial, 3, w=(3,)), _randn((2, 3, 6), (2, 3, 6, 6), (2, 3, 3, 3, 3)),
         _SPATIAL_OPS),
    Case("embedding", _Embeddings, _embedding_inputs, _EMBEDDING_OPS),
    # wide_params: the wide model lists the registered module's parameters first, not in the
    # member's order, which check_equivalence's default refuses.
    Case("rnn-lstm", lambda: _Recurrent(nn.LSTM(6, 5, num_layers=2, bidirectional=True)), _randn((3, 4, 6)),
         ("lstm.input",)),
    Case("rnn-gru", lambda: _Recurrent(nn.GRU(6, 5, batch_first=True)), _randn((4, 3, 6)), ("gru.input",)),
    Case("rnn-tanh", lambda: _Recurrent(nn.RNN(6, 5)), _randn((3, 4, 6)), ("rnn_tanh.input",)),
    Case("rnn-relu", lambda: _Recurrent(nn.RNN(6, 5, nonlinearity="relu")), _randn((3, 4, 6)), ("rnn_relu.input",)),
    Case("rnn-cells", _Cells, _randn((4, 6)),
         ("lstm_cell.default", "gru_cell.default", "rnn_tanh_cell.default", "rnn_relu_cell.default")),
    Case("model-ops", _fn_module(_model_ops, 1, w=(6,), A=(2, 3, 3)), _randn((4, 6)),
         ("multiply.Tensor", "floor_divide.default", "where.ScalarOther", "where.ScalarSelf", "where.Scalar",
          "abs_.default", "matrix_H.default", "special_softmax.default", "special_log_softmax.default",
          "baddbmm.default"), modes=("train", "eval")),
    Case("dropout-inplace", _fn_module(_dropout_inplace, 1, w=(6,)), _randn((4, 6)), ("dropout_.default",),
         modes=("eval",)),
    Case("parametrizations", lambda: nn.Sequential(
        torch.nn.utils.parametrizations.weight_norm(nn.Linear(6, 5)),
        torch.nn.utils.parametrizations.spectral_norm(nn.Linear(5, 3))), _randn((4, 6)),
        ("_weight_norm.default", "vdot.default"), modes=("train", "eval")),
    Case("regions", _Regions, _randn((4, 6)), ("wrap_with_set_grad_enabled", "wrap_with_autocast", "linear")),
    Case("registered", _WithGate, _randn((4, 6)), ("opaque_module", "linear", "relu"),
         harness=lambda wide: {"wide_params": dict(wide.named_parameters())}),
    Case("direct-aten", _fn_module(_direct_aten, 1, w=(6,)), _randn((4, 6)), _DIRECT_ATEN_OPS),
    _fill_value_case("masked-fill-member-value", _masked_fill_member_value, "masked_fill.Tensor"),
    _fill_value_case("masked-fill-inplace-member-value", _masked_fill_inplace_member_value, "masked_fill_.Tensor"),
    _fill_value_case("fill-member-value", _fill_member_value, "fill_.Tensor"),
    _fill_value_case("index-fill-tensor-value", _index_fill_tensor_value, "index_fill.int_Tensor"),
    _fill_value_case("index-fill-inplace-tensor-value", _index_fill_inplace_tensor_value, "index_fill_.int_Tensor"),
    _fill_value_case("index-fill-member-value", _index_fill_member_value, "index_fill.int_Tensor"),
]


# ---------------------------------------------------------------------------------------------
# The checks
# ---------------------------------------------------------------------------------------------
def _members_differ(outs) -> None:
    """Random outputs: members draw independently (member 0 and 1 differ)."""
    for k, t in enumerate(outs):
        assert not torch.equal(t[0], t[1]), f"random output {k}: members 0 and 1 drew the same values"


def _clone(inputs: tuple) -> tuple:
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in inputs)


def _check(wide, models, inputs, **harness) -> None:
    """The wide model on the stacked inputs == every member on its own input: outputs, input and
    parameter gradients, buffers after the call (the project's equivalence harness)."""
    check_equivalence(wide, models, inputs, equal_nan=True, **harness)


def _run_random(case: Case, wide, models, inputs) -> None:
    """Random outputs: per-member shape and dtype as the member's own output, then the case's
    statistical checks."""
    with torch.no_grad():
        got, _ = tree_flatten(wide(*stack_inputs([_clone(i) for i in inputs])))
        for i, m in enumerate(models):
            want, _ = tree_flatten(m(*_clone(inputs[i])))
            assert len(got) == len(want)
            for k, (g, w) in enumerate(zip(got, want)):
                assert g.shape == (N, *w.shape), f"output {k}: shape {tuple(g.shape)}, member has {tuple(w.shape)}"
                assert g.dtype == w.dtype, f"output {k}: dtype {g.dtype}, member has {w.dtype}"
        case.check_random(got, models, inputs)


def _params():
    for case in CASES:
        for mode in case.modes:
            yield pytest.param(case, mode, id=f"{case.name}-{mode}")


@pytest.mark.parametrize(("case", "mode"), list(_params()))
def test_case(case: Case, mode: str) -> None:
    models = []
    for i in range(N):
        torch.manual_seed(100 + i)
        models.append(case.make().train(mode == "train"))
    inputs = []
    for i in range(N):
        torch.manual_seed(200 + i)
        inputs.append(case.inputs())
    wide = wc.compile(models, inputs[0], strict=True, config=FAST)
    assert wide.training == (mode == "train")

    used = wide._graph_for(wide.training).rules_used
    missing = [str(_key(s)) for s in case.ops if _key(s) not in used]
    assert not missing, f"case {case.name!r} ({mode}) no longer reaches the rows {missing}"

    torch.manual_seed(0)
    if mode in case.random:
        _run_random(case, wide, models, inputs)
    else:
        _check(wide, models, inputs, **(case.harness(wide) if case.harness else {}))


def test_declared_ops_are_rule_rows() -> None:
    """A declared op that is not a row (renamed, removed) makes its case meaningless."""
    bad = [f"{case.name}: {spec}" for case in CASES for spec in case.ops if _key(spec) not in RULES]
    assert not bad, "declared ops that are not rows of the rule table:\n  " + "\n  ".join(bad)


def test_every_rule_row_has_a_case() -> None:
    """Every row of the rule table is reached by some case of this file."""
    declared = {_key(spec) for case in CASES for spec in case.ops}
    uncovered = sorted(f"{RULES[k].family}: {k}" for k in RULES if k not in declared)
    assert not uncovered, (f"{len(uncovered)} of {len(RULES)} rule rows have no case in "
                           "tests/python/test_rule_coverage.py:\n  " + "\n  ".join(uncovered))


# ---------------------------------------------------------------------------------------------
# The op checklist (Note [Adding a widen rule]): the per-op facts beside the rule-table row
# ---------------------------------------------------------------------------------------------
W = torch.ops.wide


def _op_name(op: Any) -> str:
    """The name the padding pass looks an op up by: the ATen packet's, else the target's."""
    if isinstance(op, torch._ops.OpOverload):
        return op.overloadpacket.__name__
    return getattr(op, "__name__", str(op))


def test_every_rule_row_states_its_padding() -> None:
    """Every op of the rule table is padded by fx/padding_rules.py (a rule, zero- or mask-keeping)
    or refused there with its reason (``REFUSED``): a new row must say which."""
    from wide_compiler.fx import padding_rules as pr

    padded = set(pr.RULES) | pr.ZERO_UNARY | pr.MASK_UNARY | pr.BY_THE_PASS
    both = sorted(padded & set(pr.REFUSED))
    assert not both, f"ops both padded and refused in fx/padding_rules.py: {both}"
    unstated = sorted({f"{RULES[k].family}: {_op_name(k)}" for k in RULES
                       if _op_name(k) not in padded and _op_name(k) not in pr.REFUSED})
    assert not unstated, ("rule rows whose padding fx/padding_rules.py does not state (a rule, ZERO_UNARY, "
                          "MASK_UNARY or REFUSED with the reason):\n  " + "\n  ".join(unstated))
    names = {_op_name(k) for k in RULES}
    stale = sorted(set(pr.REFUSED) - names)
    assert not stale, f"REFUSED names ops that no widen rule handles: {stale}"


def test_a_refused_op_says_why_with_padded_members() -> None:
    """A refusal with ``pad=True`` gives the op's stated reason, not only "no rule" (a scan along
    the padded dim: Note [Positions along a dim that is not padded])."""
    from wide_compiler.fx.padding_rules_shapes import REFUSED_ALONG_PADDED as REFUSED

    class Scan(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.fc = nn.Linear(4, width)

        def forward(self, x):
            return torch.cumsum(self.fc(x), -1)

    with pytest.raises(wc.UnsupportedOperationError, match="cumsum") as err:
        wc.compile([Scan(4), Scan(8)], torch.randn(2, 4), pad=True, config=FAST)
    assert REFUSED["cumsum"] in str(err.value)


def _autocast_statements() -> dict[str, tuple[str, str]]:
    """``{wide op name: (policy, rules file)}`` from every rules file's ``AUTOCAST``."""
    import importlib
    import pkgutil

    import wide_compiler.fx.rules as package

    stated: dict[str, tuple[str, str]] = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for name, policy in getattr(module, "AUTOCAST", {}).items():
            assert name not in stated, f"wide.{name}: autocast policy stated in {stated[name][1]} and {info.name}"
            stated[name] = (policy, info.name)
    return stated


def test_every_wide_op_states_its_autocast_policy() -> None:
    """Every wide op a graph can hold states its autocast policy beside the rule that emits it, and
    the statement matches the dispatcher: an autocast kernel exactly where it says the op is cast."""
    from wide_compiler.fx.rules._autocast import NOT_CAST, POLICIES
    from wide_compiler.ops import WIDE_OPS

    stated = _autocast_statements()
    in_graphs = {name for name, op in WIDE_OPS.items() if op.kind != "optimizer"}  # steps never run under autocast
    assert set(stated) == in_graphs, ("wide ops with no AUTOCAST statement in fx/rules/: "
                                      f"{sorted(in_graphs - set(stated))}; stated but not graph ops: "
                                      f"{sorted(set(stated) - in_graphs)}")
    registered = {key: set(torch._C._dispatch_get_registrations_for_dispatch_key(key))
                  for key in ("AutocastCPU", "AutocastCUDA")}
    for name, (policy, family) in stated.items():
        assert policy in POLICIES, f"wide.{name} ({family}): unknown autocast policy {policy!r}"
        qualified = f"wide::{name}"
        cast = policy != NOT_CAST
        wrong = (f"wide.{name} ({family}) states {policy!r}, but an {{}} kernel is "
                 + ("missing" if cast else "registered"))
        assert (qualified in registered["AutocastCPU"]) == cast, wrong.format("AutocastCPU")
        runs_on_cuda = any(torch._C._dispatch_has_kernel_for_dispatch_key(qualified, key)
                           for key in ("CUDA", "CompositeImplicitAutograd"))  # not a CPU-only kernel
        if runs_on_cuda:
            assert (qualified in registered["AutocastCUDA"]) == cast, wrong.format("AutocastCUDA")
        if cast:  # its behaviour against ATen's op: test_autocast.py's cases (prefixed by mode for BY_MODE ops)
            assert any(case == name or case.startswith(f"{name}_") for case in AUTOCAST_CASES), \
                f"wide.{name} ({family}) is cast ({policy!r}) but has no case in test_autocast.py OP_CASES"


def _stated_with_a_case() -> list[tuple[str, str]]:
    """The ops whose policy is one dtype on CPU (not by mode) and that test_autocast.py calls."""
    from wide_compiler.fx.rules._autocast import BY_MODE
    return sorted((name, policy) for name, (policy, _) in _autocast_statements().items()
                  if policy != BY_MODE and name in AUTOCAST_CASES)


@cpu_only
@pytest.mark.parametrize(("name", "policy"), _stated_with_a_case(), ids=[n for n, _ in _stated_with_a_case()])
def test_stated_autocast_policy_holds_on_cpu(name: str, policy: str) -> None:
    """Each op's stated policy, run through its case of test_autocast.py under CPU autocast on a
    float32 activation: lower precision gives bfloat16, every other policy float32. (That each
    op returns what the ATen op it replaces returns is test_autocast.py's own check.)"""
    from wide_compiler.fx.rules._autocast import LOWER

    torch.manual_seed(0)
    wide_call, _ = AUTOCAST_CASES[name](torch.float32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = wide_call()
    leaf = tree_flatten(out)[0][0]
    assert leaf.dtype == (torch.bfloat16 if policy == LOWER else torch.float32), (name, policy, leaf.dtype)


def test_by_mode_autocast_ops_have_cases() -> None:
    """The recurrent ops' policy depends on the mode: test_autocast.py checks every mode, with and
    without a state given, against ATen."""
    from wide_compiler.fx.rules._autocast import BY_MODE

    for name, (policy, _) in _autocast_statements().items():
        if policy == BY_MODE:
            for mode in ("lstm", "gru", "rnn"):
                for suffix in ("", "_state"):
                    assert f"{name}_{mode}{suffix}" in AUTOCAST_CASES, (name, mode, suffix)


def test_every_packed_row_states_whether_it_keeps_channels_last() -> None:
    """Every channel-packed row says whether the layout plan follows a channels-last value through
    it (Note [Layout-keeping ops] in fx/rules/conv.py), and fx/layout.py follows exactly those."""
    from wide_compiler.fx.layout import _KEEPS_LAYOUT
    from wide_compiler.fx.rules.conv import KEEPS_CHANNELS_LAST, LAYOUT_KEEPING_ACTIVATIONS
    from wide_compiler.fx.table import find_rule

    packed = {op for op, entry in RULES.items() if entry.layout == "packed"}
    assert set(KEEPS_CHANNELS_LAST) == packed, (
        f"packed rows not stated in KEEPS_CHANNELS_LAST: {sorted(map(str, packed - set(KEEPS_CHANNELS_LAST)))}; "
        f"stated but not packed rows: {sorted(map(str, set(KEEPS_CHANNELS_LAST) - packed))}")
    followed = {w for op, keeps in KEEPS_CHANNELS_LAST.items() if keeps for w in RULES[op].packed}
    assert _KEEPS_LAYOUT == followed | LAYOUT_KEEPING_ACTIVATIONS, sorted(map(str, _KEEPS_LAYOUT ^ followed))
    assert all(find_rule(op).layout == "elementwise" for op in LAYOUT_KEEPING_ACTIVATIONS)


def _packed_calls() -> dict[Any, Callable[[torch.Tensor], torch.Tensor]]:
    """A call of each packed norm on a packed input ``x [B, N*C, H, W]`` (N=2, C=4)."""
    w, b = torch.rand(2, 4) + 0.5, torch.randn(2, 4)
    return {
        W.batch_norm.default: lambda x: W.batch_norm(x, w, b, torch.zeros(2, 4), torch.ones(2, 4), True, 0.1, 1e-5,
                                                     packed_input=True),
        W.instance_norm.default: lambda x: W.instance_norm(x, w, b, None, None, True, 0.1, 1e-5, packed_input=True),
        W.group_norm.default: lambda x: W.group_norm(x, 2, 2, w, b, 1e-5, packed_input=True),
        W.prelu.default: lambda x: W.prelu(x, w, packed_input=True),
    }


@cpu_only
def test_followed_packed_ops_keep_channels_last() -> None:
    """A packed row stated as layout-keeping really returns a channels-last result for a
    channels-last packed input."""
    from wide_compiler.fx.rules.conv import KEEPS_CHANNELS_LAST

    calls = _packed_calls()
    x = torch.randn(2, 8, 5, 5).contiguous(memory_format=torch.channels_last)
    for op, keeps in KEEPS_CHANNELS_LAST.items():
        for wide_op in RULES[op].packed if keeps else ():
            assert wide_op in calls, f"{op} is stated layout-keeping: add a call of {wide_op} to _packed_calls"
            y = calls[wide_op](x)
            assert y.is_contiguous(memory_format=torch.channels_last) and not y.is_contiguous(), (op, y.stride())


def test_stem_default_follows_every_layout_keeping_norm() -> None:
    """Note [Stem layout] walks through the rows stated layout-keeping: an RGB stem whose
    InstanceNorm and ReLU end in a max pool runs channels-last in the train graph, as one with a
    BatchNorm does (the stem heuristic once named BatchNorm and GroupNorm only, while the layout
    plan also followed InstanceNorm)."""
    from wide_compiler.fx.pipeline import PASSES, Compilation, run_pipeline

    class Stem(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.norm = nn.Conv2d(3, 8, 3, padding=1), nn.InstanceNorm2d(8, affine=True)

        def forward(self, x):
            return F.max_pool2d(torch.relu(self.norm(self.conv(x))), 2)

    c = Compilation(Stem(), ((torch.randn(2, 3, 16, 16),), {}), N, FAST, device=torch.device("cpu"))
    run_pipeline(c, [p for p in PASSES if p.name in ("capture", "widen", "layout", "strategies")])
    (stem,) = c.wide.graph_module.graph.find_nodes(op="call_function", target=torch.ops.wide.conv.default)
    assert stem.kwargs["strategy"] == "grouped_cl", stem.meta.get("wide_strategy_reason")
