"""The widen pass, one glue-op rule at a time (tracker issue 3, DESIGN §4).

Every case is a small model: a Linear (so there are per-member parameters and an input gradient
to check), then ONE pattern of glue ops, sometimes mixed with per-member parameters and buffers.
Members have different weights and each member gets its own input ``x[i]``; the wide model's
outputs, input gradients and parameter gradients must equal those of every member run alone, in
train AND eval mode (each mode is its own captured graph: every case runs alone in train mode,
then all cases of a family together in one eval-mode model, which keeps the suite quick). Inputs
use another batch size than the compile sample (the batch is dynamic). ``strict=True`` proves the
op has a real wide rule: a fallback would raise. Library bugs found here are strict xfails at the
end of the file, with the reason.

The check is :func:`wide_compiler.testing.check_compile` / ``check_equivalence`` (buffers after
the call are compared too).
"""
from __future__ import annotations

import copy
from collections.abc import Sequence

import pytest
import torch
import torch.nn.functional as F
import wide_compiler as wc
from support import LinearModel, aminmax_operand
from torch import nn
from wide_compiler.testing import check_compile, check_equivalence, make_members

FAST = wc.WideConfig.fast()  # no timing at compile time


# ---------------------------------------------------------------------------------------------
# Helpers (the check itself is wide_compiler.testing.check_equivalence / check_compile)
# ---------------------------------------------------------------------------------------------

def compile_wide(models, sample, *, strict: bool = True, config: wc.WideConfig = FAST, **kwargs):
    return wc.compile(models, sample, config=config.replace(strict=strict or config.strict), **kwargs)


# ---------------------------------------------------------------------------------------------
# The case model
# ---------------------------------------------------------------------------------------------
class Case(nn.Module):
    """Linear -> ``fn(self, h, x)``, with per-member parameters and a buffer ``fn`` may use."""

    def __init__(self, fn, in_features: int = 8, hidden: int = 8):
        super().__init__()
        self.fn = fn
        self.fc = nn.Linear(in_features, hidden)
        self.scale = nn.Parameter(torch.randn(hidden))       # [H] per member
        self.p = nn.Parameter(torch.randn(()))               # 0-dim per member
        self.mat = nn.Parameter(torch.randn(hidden, hidden))  # [H, H] per member
        self.register_buffer("bias_buf", torch.randn(hidden))

    def forward(self, x):
        return self.fn(self, self.fc(x), x)


B2, B3, B4 = (4, 8), (4, 3, 8), (4, 2, 3, 8)  # member shapes: [B, F], [B, T, F], [B, C, T, F]


def _call_shape(shape):
    """The per-member input shape at call time: another batch than the sample's (dynamic batch)."""
    return (shape[0] + 1, *shape[1:])


def run_case(fn, shape, *, strict: bool = True, modes: Sequence[str] = ("train",), seed: int = 0):
    """One case in train mode (the mode the members are in at compile time: one capture), on
    per-member inputs of another batch size than the sample's. Eval mode of every case is covered
    by `test_family_in_eval_mode` (one model per family). Returns (wide, report)."""
    models = make_members(lambda: Case(fn, in_features=shape[-1]), 3, seed)
    torch.manual_seed(seed + 101)
    inputs = [torch.randn(*_call_shape(shape)) for _ in range(3)]
    return check_compile(models, torch.randn(*shape), inputs=inputs, modes=modes, shared=False,
                         strict=strict, config=FAST)


class Family(nn.Module):
    """Every case of a family that takes one input shape, in one model: a dict output, one entry
    per case, each on its own copy of the activation (some cases work in place)."""

    def __init__(self, fns: dict, in_features: int = 8, hidden: int = 8):
        super().__init__()
        self.fns = fns
        self.fc = nn.Linear(in_features, hidden)
        self.scale = nn.Parameter(torch.randn(hidden))
        self.p = nn.Parameter(torch.randn(()))
        self.mat = nn.Parameter(torch.randn(hidden, hidden))
        self.register_buffer("bias_buf", torch.randn(hidden))

    def forward(self, x):
        h = self.fc(x)
        return {name: fn(self, h.clone(), x) for name, fn in self.fns.items()}


def _cases(table: dict):
    return pytest.mark.parametrize("name", list(table))


# ---------------------------------------------------------------------------------------------
# Pointwise (unary / binary / ternary, broadcasting against per-member parameters and buffers)
# ---------------------------------------------------------------------------------------------
POINTWISE = {
    "exp": (lambda s, h, x: torch.exp(h), B2),
    # sqrt(|gelu(h)| + 0.01): sqrt's derivative is unbounded at 0, where two correct float32
    # programs (cuBLAS's batched and single GEMMs) differed 5x their own rounding on a GPU
    "unary-chain": (lambda s, h, x: (F.gelu(h).abs() + 0.01).sqrt() + torch.erf(h) * h.sigmoid(), B3),
    "clamp-scalars": (lambda s, h, x: torch.clamp(h, -0.3, 0.3) + F.hardtanh(h, -0.2, 0.2), B2),
    "scalar-arith": (lambda s, h, x: 2.0 - (0.5 * h + 1.0) / 3.0 + h ** 2, B2),
    "mul-param": (lambda s, h, x: h * s.scale, B3),
    "add-buffer": (lambda s, h, x: h + s.bias_buf, B2),
    "sub-0dim-param": (lambda s, h, x: h - s.p, B3),
    "div-0dim-param": (lambda s, h, x: h / (s.p.abs() + 1), B2),
    "pow-param": (lambda s, h, x: h ** 2 + s.p ** 2 * h, B2),
    "where-0dim-param": (lambda s, h, x: torch.where(h > 0, h, s.p), B2),
    "where-param-vector": (lambda s, h, x: torch.where(h > 0, s.scale, h), B3),
    "where-buffer-cond": (lambda s, h, x: torch.where(s.bias_buf > 0, h, -h), B3),
    "addcmul-param": (lambda s, h, x: torch.addcmul(h, h, s.scale, value=0.5), B2),
    "lerp-param": (lambda s, h, x: torch.lerp(h, s.scale, 0.3), B2),
    "masked_fill": (lambda s, h, x: h.masked_fill(h > 0.2, 0.0), B2),
    "maximum-param": (lambda s, h, x: torch.maximum(h, s.scale) + torch.min(h, x), B2),
    "clamp-tensor-bounds": (lambda s, h, x: torch.clamp(h, min=-s.scale.abs(), max=s.bias_buf.abs()), B2),
    "compare-param": (lambda s, h, x: (h > s.scale).float() * h, B2),
    "atan2-param": (lambda s, h, x: torch.atan2(h, s.scale), B2),
    "fmod-remainder": (lambda s, h, x: torch.fmod(h, 0.3) + torch.remainder(h, s.scale.abs() + 0.1), B2),
    "floor-div": (lambda s, h, x: torch.div(h, 0.3, rounding_mode="floor") * h, B2),
    "outer-broadcast-param": (lambda s, h, x: h[:, :, None] * s.scale, B2),
    "param-broadcast-up": (lambda s, h, x: s.scale[:, None] + h[:, None, :], B2),
    "act-outer-product": (lambda s, h, x: h.unsqueeze(1) * h.unsqueeze(2), B2),
    "in-place-with-param": (lambda s, h, x: h.mul_(2).add_(s.scale).mul_(s.p), B2),
    "dtype-casts": (lambda s, h, x: (h * 3).long().float() + h.double().float() * h.type_as(x), B2),
}


@_cases(POINTWISE)
def test_pointwise(name):
    fn, shape = POINTWISE[name]
    run_case(fn, shape)


# ---------------------------------------------------------------------------------------------
# Dim-taking ops and reductions (positive dims shift, negative stay, dim=None is per member)
# ---------------------------------------------------------------------------------------------
DIMS = {
    "softmax-dim1": (lambda s, h, x: F.softmax(h, dim=1), B2),
    "softmax-dim1-3d": (lambda s, h, x: F.softmax(h, dim=1), B3),
    "softmax-dim0": (lambda s, h, x: h.softmax(0), B3),
    "softmax-dim-1": (lambda s, h, x: torch.softmax(h, dim=-1), B3),
    "log_softmax-dim1": (lambda s, h, x: F.log_softmax(h, dim=1), B3),
    "log_softmax-dim-1": (lambda s, h, x: F.log_softmax(h, dim=-1), B3),
    "cumsum-dim1": (lambda s, h, x: h.cumsum(1), B3),
    "cumsum-dim-1": (lambda s, h, x: torch.cumsum(h, dim=-1), B3),
    "cumprod-logcumsumexp": (lambda s, h, x: torch.cumprod(h, 1) + torch.logcumsumexp(h, 0), B2),
    "norm-dim": (lambda s, h, x: h.norm(dim=1), B2),
    "norm-all": (lambda s, h, x: h * h.norm(), B3),
    "norm-p1-keepdim": (lambda s, h, x: h.norm(p=1, dim=-1, keepdim=True), B3),
    "vector_norm-dims": (lambda s, h, x: torch.linalg.vector_norm(h, dim=(1, 2)), B3),
    "mean-dim1": (lambda s, h, x: h.mean(dim=1), B3),
    "mean-neg-dims": (lambda s, h, x: h.mean((-1, -2)), B3),
    "sum-dims-keepdim": (lambda s, h, x: h.sum(dim=(0, 2), keepdim=True), B3),
    "sum-neg-keepdim": (lambda s, h, x: h.sum(-2, keepdim=True), B3),
    "sum-dtype": (lambda s, h, x: h.sum(dtype=torch.float64), B2),
    "amax-dim": (lambda s, h, x: h.amax(dim=-1), B3),
    "amax-all": (lambda s, h, x: h.amax() * h, B3),
    "amin-keepdim": (lambda s, h, x: h.amin(dim=(0, 1), keepdim=True), B3),
    "argmax-dim": (lambda s, h, x: h.argmax(dim=1), B3),
    "argmax-all": (lambda s, h, x: h.argmax(), B3),
    "argmax-all-keepdim": (lambda s, h, x: h.argmax(keepdim=True), B3),
    "argmin-neg": (lambda s, h, x: h.argmin(-2), B3),
    "var-keepdim": (lambda s, h, x: h.var(dim=1, keepdim=True), B3),
    "var-all": (lambda s, h, x: h.var(), B3),
    "std-biased": (lambda s, h, x: h.std(dim=-1, unbiased=False), B3),
    "std-correction": (lambda s, h, x: h.std(dim=(0, 2), correction=0), B3),
    "std-all": (lambda s, h, x: h * h.std(), B3),
    "sum-all": (lambda s, h, x: h.sum(), B3),
    "mean-all": (lambda s, h, x: h.mean(), B3),
    "max-all": (lambda s, h, x: h.max(), B3),
    "prod-all": (lambda s, h, x: h.prod(), B2),
    "max-dim-tuple": (lambda s, h, x: h.max(dim=1), B3),
    "min-dim-keepdim": (lambda s, h, x: h.min(dim=-1, keepdim=True), B3),
    "logsumexp": (lambda s, h, x: torch.logsumexp(h, dim=1), B3),
    "topk": (lambda s, h, x: torch.topk(h, 3, dim=-1), B3),
    "sort-dim1": (lambda s, h, x: torch.sort(h, dim=1), B3),
    "aminmax": (lambda s, h, x: torch.aminmax(aminmax_operand(h), dim=1), B3),
    "any-all-bool": (lambda s, h, x: h * (h > 0).any() + (h > -1).all(dim=1).float().sum(), B3),
    "cummax": (lambda s, h, x: torch.cummax(h, dim=1), B3),
    "median-dim": (lambda s, h, x: h.median(dim=-1), B3),
    "gather-argsort": (lambda s, h, x: torch.gather(h, 1, h.argsort(dim=1)), B3),
}


@_cases(DIMS)
def test_dim_ops(name):
    fn, shape = DIMS[name]
    run_case(fn, shape)


SIZES = {
    "size-dim-ndim": (lambda s, h, x: h * h.size(1) / h.dim() + x.shape[0] + h.ndim, B2),
    "size-negative": (lambda s, h, x: h.reshape(h.size(0), h.size(-1) // 2, 2), B2),
    "size-tuple": (lambda s, h, x: h.view(*x.shape[:-1], 2, 4), B3),
    "size-whole": (lambda s, h, x: h.reshape(x.size()).flatten(1).view(h.size()), B3),
    "numel": (lambda s, h, x: h / h.numel(), B2),
    "size-float-arith": (lambda s, h, x: (h @ h.T) / h.shape[-1] ** 0.5, B2),
}


@_cases(SIZES)
def test_sizes_are_one_members(name):
    """x.size(), x.size(d), x.shape, x.dim()/ndim, numel read one member's sizes."""
    fn, shape = SIZES[name]
    run_case(fn, shape)


# ---------------------------------------------------------------------------------------------
# Shape ops
# ---------------------------------------------------------------------------------------------
def _setitem(h):
    h = h.clone()
    h[:, 0] = 0.0
    return h


SHAPE = {
    "view-minus-one": (lambda s, h, x: h.view(-1, 2, 4), B2),
    "view-size0": (lambda s, h, x: h.view(x.size(0), -1), B3),
    "reshape": (lambda s, h, x: h.reshape(-1, 4, 4), (4, 2, 8)),
    "flatten1": (lambda s, h, x: torch.flatten(h, 1), B3),
    "flatten-all": (lambda s, h, x: torch.flatten(h), B3),
    "flatten0-1": (lambda s, h, x: h.flatten(0, 1), B3),
    "unflatten-neg": (lambda s, h, x: h.unflatten(-1, (2, 4)), B3),
    "unflatten1": (lambda s, h, x: h.unflatten(1, (2, 4)), B2),
    "permute": (lambda s, h, x: h.permute(2, 0, 1), B3),
    "permute-neg": (lambda s, h, x: h.permute(-1, 0, -2), B3),
    "transpose12": (lambda s, h, x: h.transpose(1, 2), B3),
    "transpose0-neg": (lambda s, h, x: h.transpose(0, -1), B3),
    "T": (lambda s, h, x: h.T, B2),
    "mT": (lambda s, h, x: h.mT, B3),
    "movedim": (lambda s, h, x: h.movedim(0, -1), B3),
    "squeeze-all": (lambda s, h, x: h[:, :1].squeeze(), B2),
    "squeeze-dim": (lambda s, h, x: h.unsqueeze(1).squeeze(1), B2),
    "squeeze-dims": (lambda s, h, x: h[:, :1, None].squeeze((1, 2)), B3),
    "unsqueeze": (lambda s, h, x: h.unsqueeze(0) + h.unsqueeze(-1).mean(), B2),
    "expand": (lambda s, h, x: h[:, None, :].expand(-1, 3, -1), B2),
    "expand-param": (lambda s, h, x: s.scale.expand(x.size(0), 8) * h, B2),
    "repeat": (lambda s, h, x: h.repeat(2, 1, 3), B2),
    "contiguous": (lambda s, h, x: h.transpose(0, 1).contiguous().view(-1), B2),
    "chunk": (lambda s, h, x: torch.chunk(h, 2, dim=-1), B3),
    "chunk-dim1-getitem": (lambda s, h, x: h.chunk(3, dim=1)[1] * 2, B3),
    "split-sizes": (lambda s, h, x: h.split([3, 5], dim=1), B2),
    "split-int-list": (lambda s, h, x: list(h.split(3, dim=-1)), B3),
    "tensor_split": (lambda s, h, x: torch.tensor_split(h, 3, dim=1), B2),
    "unbind": (lambda s, h, x: h.unbind(1), B3),
    "cat-dim1": (lambda s, h, x: torch.cat([h, x], 1), B2),
    "cat-neg": (lambda s, h, x: torch.cat([h, h * 2], -1), B3),
    "cat-dim0": (lambda s, h, x: torch.cat([h, h * 2], 0), B2),
    "cat-param": (lambda s, h, x: torch.cat([h, s.scale.expand(h.size(0), -1)], 1), B2),
    "cat-shared": (lambda s, h, x: torch.cat([torch.zeros(h.size(0), 2), h], -1), B2),
    "stack-dim1": (lambda s, h, x: torch.stack([h, x], 1), B2),
    "stack-neg": (lambda s, h, x: torch.stack([h, x, h], -1), B2),
    "stack-params": (lambda s, h, x: torch.stack([s.scale, s.bias_buf]) @ h.T, B2),
    "select": (lambda s, h, x: h[:, 0], B3),
    "select-neg": (lambda s, h, x: h[:, -1] + h[0, 0], B3),
    "select-param": (lambda s, h, x: s.mat[0] * h + s.mat[:, 1], B2),
    "slice-ellipsis": (lambda s, h, x: h[..., :3], B3),
    "slice-step": (lambda s, h, x: h[:, ::2], B2),
    "index-none": (lambda s, h, x: h[:, None], B2),
    "narrow-neg": (lambda s, h, x: h.narrow(-1, 2, 3), B3),
    "narrow-dim1": (lambda s, h, x: torch.narrow(h, 1, 1, 2), B3),
    "roll-dim": (lambda s, h, x: torch.roll(h, 2, dims=1), B2),
    "roll-dims": (lambda s, h, x: torch.roll(h, (1, -1), dims=(0, 2)), B3),
    "flip": (lambda s, h, x: h.flip(1), B3),
    "flip-dims": (lambda s, h, x: h.flip((0, -1)), B3),
    "index-list": (lambda s, h, x: h[:, [0, 2, 3]], B2),
    "index-tensor": (lambda s, h, x: h[:, torch.tensor([0, 2])], B3),
    "index-bool-mask": (lambda s, h, x: h[:, torch.arange(8) % 2 == 0], B2),
    "index-two-adjacent": (lambda s, h, x: h[:, [0, 1], [2, 3]], B3),
    "index-param": (lambda s, h, x: s.scale[[1, 3]] * h[:, :2], B2),
    "tril": (lambda s, h, x: h.reshape(-1, 2, 4).tril(), B2),
    "triu-param": (lambda s, h, x: h @ s.mat.triu(1), B2),
    "diagonal": (lambda s, h, x: h.reshape(-1, 2, 4).diagonal(dim1=-2, dim2=-1), B2),
    "repeat_interleave-dim": (lambda s, h, x: h.repeat_interleave(2, dim=1), B2),
}


@_cases(SHAPE)
def test_shape_ops(name):
    fn, shape = SHAPE[name]
    run_case(fn, shape)


# ---------------------------------------------------------------------------------------------
# Products: matmul/mm/bmm/einsum (activation x activation, activation x parameter, 1-D operands),
# F.linear with a parameter weight, scaled dot-product attention
# ---------------------------------------------------------------------------------------------
def _heads(h):  # [B, T=3, 8] -> [B, 2 heads, 3, 4]
    return h.view(h.size(0), 3, 2, 4).transpose(1, 2)


def _sdpa(h, **kwargs):
    q = _heads(h)
    return F.scaled_dot_product_attention(q, q * 0.5, q + 1, **kwargs)


PRODUCTS = {
    "act@act": (lambda s, h, x: h @ h.transpose(-1, -2), B3),
    "bmm": (lambda s, h, x: torch.bmm(h, h.transpose(1, 2)), B3),
    "mm-act-act": (lambda s, h, x: torch.mm(h.T, h), B2),
    "act@param": (lambda s, h, x: h @ s.mat, B3),
    "mm-act-param": (lambda s, h, x: torch.mm(h, s.mat), B2),
    "param@act": (lambda s, h, x: s.mat @ h.T, B2),
    "param@act-3d": (lambda s, h, x: s.mat @ h.transpose(1, 2), B3),
    "act@vector-param": (lambda s, h, x: h @ s.scale, B3),
    "vector-param@act": (lambda s, h, x: s.scale @ h.transpose(-1, -2), B3),
    "vector@vector-params": (lambda s, h, x: h * (s.scale @ s.bias_buf), B2),
    "act-1d@act-1d": (lambda s, h, x: h[0] @ h[1], B2),
    "act-1d@param": (lambda s, h, x: h[0] @ s.mat, B2),
    "act@shared": (lambda s, h, x: h @ torch.ones(8, 2), B3),
    "shared@act": (lambda s, h, x: torch.ones(2, x.size(0)) @ h, B2),
    "einsum-act-param": (lambda s, h, x: torch.einsum("bi,ij->bj", h, s.mat), B2),
    "einsum-act-act": (lambda s, h, x: torch.einsum("bij,bkj->bik", h, h), B3),
    "einsum-act-vector": (lambda s, h, x: torch.einsum("bi,i->b", h, s.scale), B2),
    "einsum-ellipsis": (lambda s, h, x: torch.einsum("...i,ij->...j", h, s.mat), B3),
    "einsum-two-params": (lambda s, h, x: h * torch.einsum("i,i->", s.scale, s.bias_buf), B2),
    "linear-param": (lambda s, h, x: F.linear(h, s.mat, s.scale), B3),
    "linear-param-nobias": (lambda s, h, x: F.linear(h, s.mat), B2),
    "linear-param-1d-input": (lambda s, h, x: F.linear(h[0], s.mat, s.scale), B2),
    "sdpa": (lambda s, h, x: _sdpa(h), B3),
    "sdpa-causal": (lambda s, h, x: _sdpa(h, is_causal=True), B3),
    "sdpa-shared-bool-mask": (lambda s, h, x: _sdpa(h, attn_mask=torch.ones(3, 3, dtype=torch.bool).tril()), B3),
    "sdpa-activation-mask": (lambda s, h, x: _sdpa(h, attn_mask=h[:, None, :, :3] @ h[:, None, :, :3].mT), B3),
    "sdpa-3d": (lambda s, h, x: F.scaled_dot_product_attention(h, h, h), B3),
    "sdpa-3d-param-mask": (lambda s, h, x: F.scaled_dot_product_attention(h, h, h, attn_mask=s.mat[:3, :3]), B3),
    "sdpa-scale": (lambda s, h, x: _sdpa(h, scale=0.3), B3),
}


@_cases(PRODUCTS)
def test_products(name):
    fn, shape = PRODUCTS[name]
    run_case(fn, shape)


# The same rules under torch.compile(fullgraph=True) of the wide model
def _heads_sdpa(h):
    q = h.view(h.size(0), 3, 2, 4).transpose(1, 2)
    return F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).flatten(2)


TORCH_COMPILE_CASES = {
    "softmax-sum": (lambda s, h, x: F.softmax(h, dim=1) * h.sum(), (4, 8)),
    "view-size0-cat": (lambda s, h, x: torch.cat([h.reshape(x.size(0), -1), x.flatten(1)], 1), (4, 3, 8)),
    "max-tuple-argmax": (lambda s, h, x: (h.max(dim=1), h.argmax()), (4, 3, 8)),
    "split-pad-reflect": (lambda s, h, x: [F.pad(t, (1, 1), mode="reflect") for t in h.split(4, -1)], (4, 3, 8)),
    "einsum-param-arange": (lambda s, h, x: torch.einsum("bi,ij->bj", h, s.mat) * torch.arange(8), (4, 8)),
    "sdpa-causal": (lambda s, h, x: _heads_sdpa(h), (4, 3, 8)),
    "where-param-squeeze": (lambda s, h, x: torch.where(h > 0, h, s.p)[:, :1].squeeze(1), (4, 8)),
}


@pytest.mark.parametrize("name", list(TORCH_COMPILE_CASES))
def test_torch_compile_fullgraph_gives_the_same_outputs(name):
    fn, shape = TORCH_COMPILE_CASES[name]
    n = 3
    models = make_members(lambda: Case(fn, in_features=shape[-1]), n)
    wide = compile_wide(models, torch.randn(*shape))
    torch._dynamo.reset()
    compiled = torch.compile(wide, fullgraph=True, backend="aot_eager")
    xs = torch.randn(n, *shape)
    check_equivalence(compiled, models, xs)


# ---------------------------------------------------------------------------------------------
# Spatial glue (padding, interpolation) and tensor creation inside forward
# ---------------------------------------------------------------------------------------------
SPATIAL = {
    "pad-constant": (lambda s, h, x: F.pad(h, (1, 2)), B3),
    "pad-constant-2d-value": (lambda s, h, x: F.pad(h, (1, 2, 0, 1), value=0.5), B3),
    "pad-reflect": (lambda s, h, x: F.pad(h, (2, 1), mode="reflect"), B3),
    "pad-reflect-2d": (lambda s, h, x: F.pad(h, (2, 1, 1, 1), mode="reflect"), B4),
    "pad-replicate": (lambda s, h, x: F.pad(h, (2, 1), mode="replicate"), B3),
    "pad-circular": (lambda s, h, x: F.pad(h, (2, 1), mode="circular"), B3),
    "interpolate-nearest": (lambda s, h, x: F.interpolate(h, scale_factor=2), B3),
    "interpolate-linear-size": (lambda s, h, x: F.interpolate(h, size=11, mode="linear"), B3),
    "interpolate-bilinear": (lambda s, h, x: F.interpolate(h, scale_factor=2, mode="bilinear"), B4),
}

CREATION = {
    "zeros_like-ones_like": (lambda s, h, x: h + torch.zeros_like(h) + torch.ones_like(x).sum(), B2),
    "full_like": (lambda s, h, x: torch.full_like(h, 2.0) * h, B2),
    "arange": (lambda s, h, x: torch.arange(h.size(-1)) * h, B2),
    "arange-batch": (lambda s, h, x: torch.arange(x.size(0))[:, None] * h, B2),
    "new_zeros": (lambda s, h, x: torch.cat([h, h.new_zeros(h.shape)], 1), B2),
    "new_ones-batch": (lambda s, h, x: torch.cat([h.new_ones(h.size(0), 1), h], 1), B2),
    "new_tensor": (lambda s, h, x: h.new_tensor([1.0, 2.0]).repeat(4) * h, B2),
    "ones": (lambda s, h, x: h + torch.ones(8), B2),
    "ones-batch": (lambda s, h, x: torch.cat([torch.ones(h.size(0), 1), h], 1), B2),
    "zeros-shape": (lambda s, h, x: torch.zeros(h.shape) + h, B2),
    "eye": (lambda s, h, x: h @ torch.eye(8) * 2, B2),
    "full": (lambda s, h, x: torch.full((1, 8), 3.0) - h, B2),
    "shared-output": (lambda s, h, x: (h, torch.full((h.size(0), 2), 0.5)), B2),
    "tensor-literal": (lambda s, h, x: h * torch.tensor([1.0, 2.0]).repeat(4), B2),
}


@_cases(SPATIAL)
def test_spatial_glue(name):
    fn, shape = SPATIAL[name]
    run_case(fn, shape)


@_cases(CREATION)
def test_creation_in_forward(name):
    fn, shape = CREATION[name]
    run_case(fn, shape)


class RandomCreation(LinearModel):
    linears, fields = {"fc": (8, 8)}, ("which",)

    def forward(self, x):
        h = self.fc(x)
        if self.which == "randn_like":
            return h + torch.randn_like(h)
        if self.which == "rand_like-of-input":
            return h * torch.rand_like(x)
        if self.which == "randn-size":
            return h + torch.randn(8)
        return h + torch.bernoulli(torch.full_like(h, 0.5))


@pytest.mark.parametrize("which", ["randn_like", "rand_like-of-input", "randn-size", "bernoulli"])
def test_random_creation_draws_per_member(which):
    """Identical members on one shared input: the only difference between their outputs is the
    random draw, which must be independent per member (never one draw shared by all)."""
    torch.manual_seed(0)
    model = RandomCreation(which)
    models = [copy.deepcopy(model) for _ in range(3)]
    wide = compile_wide(models, torch.randn(4, 8))
    x = torch.randn(5, 8)
    out = wide(x.expand(3, *x.shape))
    assert out.shape == (3, 5, 8)
    for i in range(1, 3):
        assert not torch.equal(out[0], out[i]), f"member {i} got member 0's random draw"
    # The deterministic part is right: the noise has the right distribution around fc(x).
    noise = out - model.fc(x)
    if which == "rand_like-of-input":
        noise = out / model.fc(x)
        assert ((noise >= 0) & (noise <= 1)).all()
    elif which == "bernoulli":
        assert ((noise.round() == 0) | (noise.round() == 1)).all()
        assert torch.allclose(noise, noise.round(), atol=1e-5)
    else:
        assert noise.std() > 0.3, noise.std()
    if which == "randn-size":  # one [8] draw per member, shared over its batch
        assert torch.allclose(noise, noise[:, :1].expand_as(noise), atol=1e-5)


# ---------------------------------------------------------------------------------------------
# The upstream failure list: each of these was silently wrong before; each must be right now
# ---------------------------------------------------------------------------------------------
class Upstream(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.op = op
        self.fc1 = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 16)

    def forward(self, x):
        a, b = self.fc1(x), self.fc2(x)
        return self.op(a, b, x)


UPSTREAM = {
    "softmax(x, dim=1)": (lambda a, b, x: torch.softmax(a, dim=1), (4, 16)),
    "y * x.sum()": (lambda a, b, x: b * a.sum(), (4, 16)),
    "x.transpose(1, 2)": (lambda a, b, x: a.transpose(1, 2), (4, 3, 16)),
    "x.mean(dim=1)": (lambda a, b, x: a.mean(dim=1), (4, 3, 16)),
    "x.reshape(-1, 4, 4)": (lambda a, b, x: a.reshape(-1, 4, 4), (4, 16)),
    "torch.flatten(x, 1)": (lambda a, b, x: torch.flatten(a.view(-1, 4, 4), 1), (4, 16)),
    "x.view(x.size(0), -1)": (lambda a, b, x: a.view(x.size(0), -1), (4, 2, 16)),
    "torch.cat([a, b], 1)": (lambda a, b, x: torch.cat([a, b], 1), (4, 16)),
}


@pytest.mark.parametrize("name", list(UPSTREAM))
def test_upstream_failures_are_fixed(name):
    """Train and eval, each on per-member inputs and on one shared input x.expand(N, ...)."""
    op, shape = UPSTREAM[name]
    n = 4
    models = make_members(lambda: Upstream(op), n, seed=1)
    wide = compile_wide(models, torch.randn(*shape))
    for training in (True, False):
        wide.train(training)
        for m in models:
            m.train(training)
        for shared in (False, True):
            xs = [torch.randn(*_call_shape(shape)) for _ in range(n)]
            out = check_equivalence(wide, models, xs[0] if shared else xs, shared=shared,
                                    what=f"{'train' if training else 'eval'} shared={shared}").wide_output
            # The members really differ (a rule running member 0 for all would be caught above).
            assert not torch.allclose(out[0].float(), out[1].float())


FAMILIES = {"pointwise": POINTWISE, "dims": DIMS, "sizes": SIZES, "shape": SHAPE,
            "products": PRODUCTS, "spatial": SPATIAL, "creation": CREATION}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_in_eval_mode(family):
    """Every case above again, in eval mode (members and wide model captured in eval), grouped by
    input shape into one model per family so the suite stays quick. A failure names the case
    (the key of the dict output)."""
    table = FAMILIES[family]
    shapes = sorted({shape for _, shape in table.values()})
    for shape in shapes:
        fns = {name: fn for name, (fn, s) in table.items() if s == shape}
        models = make_members(lambda fns=fns, f=shape[-1]: Family(fns, in_features=f).eval(), 3, seed=7)
        wide = compile_wide(models, torch.randn(*shape))
        assert not wide.training
        torch.manual_seed(8)
        per_member = [torch.randn(*_call_shape(shape)) for _ in range(3)]
        out = check_equivalence(wide, models, per_member, what=f"eval {family} {shape}").wide_output
        assert isinstance(out, dict) and list(out) == list(fns)


# ---------------------------------------------------------------------------------------------
# Regressions: library bugs this suite found (all fixed); each case must stay correct
# ---------------------------------------------------------------------------------------------


class ViewAfterLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return self.fc(x).view(x.size(0), -1)


def test_view_of_linear_output_on_shared_input():
    """Was: on a shared input wide.linear returns a strided N-first view, so the member's legal
    .view() raised 'view size is not compatible'. Views now become reshapes unless written to."""
    models = make_members(ViewAfterLinear, 2)
    wide = compile_wide(models, torch.randn(4, 2, 16))
    x = torch.randn(5, 2, 16)
    check_equivalence(wide, models, x, shared=True)


REGRESSIONS = {  # name: (fn, member shape, exception the bug raised, strict, what was wrong)
    "swapaxes": (
        lambda s, h, x: h.swapaxes(0, 1), B3, AssertionError, True,
        ("library bug: aten.swapaxes names its dims axis0/axis1, which reduction.DIM_ARGS does not "
        "list, so they are not shifted: the member dim is swapped with the batch (silently wrong)")),
    "unfold": (
        lambda s, h, x: h.unfold(1, 3, 2), B2, AssertionError, True,
        ("library bug: aten.unfold names its dim 'dimension', not in reduction.DIM_ARGS, so it "
        "unfolds the wrong wide dim (silently wrong)")),
    "repeat_interleave-no-dim": (
        lambda s, h, x: h.repeat_interleave(2), B2, AssertionError, True,
        ("library bug: repeat_interleave(dim=None) flattens the whole wide tensor (members mixed) "
        "instead of each member")),
    "diag_embed-explicit-dims": (
        lambda s, h, x: torch.diag_embed(h, 0, 0, 2), B2, AssertionError, True,
        ("library bug: shape._trailing passes diag_embed's dim1/dim2 through unshifted; only the "
        "negative defaults are right (silently wrong)")),
    "renorm": (
        lambda s, h, x: torch.renorm(h, 2, 1, 1.0), B3, AssertionError, False,
        ("library bug: renorm normalises each slice along `dim` over ALL other dims, which on the "
        "wide tensor include the member dim: the norm mixes members (silently wrong)")),
    "index_select-shared-index": (
        lambda s, h, x: h.index_select(-1, torch.tensor([1, 0])), B2, IndexError, True,
        ("library bug: dim_rule expands the shared 1-D index to [N, k]; index_select raises "
        "'Index is supposed to be a vector'")),
    "sdpa-param-mask-no-batch": (
        lambda s, h, x: _sdpa(h, attn_mask=s.mat[:3, :3]), B3, RuntimeError, True,
        ("library bug: a per-member attn_mask without the batch dim is folded to [N, ...] while "
        "q/k/v are folded to [N*B, ...]: RuntimeError size mismatch")),
    "contiguous-channels_last": (
        lambda s, h, x: h.reshape(-1, 2, 2, 2).contiguous(memory_format=torch.channels_last), B2,
        RuntimeError, True,
        ("library bug: contiguous/clone(memory_format=channels_last) of a 4-D member is passed to "
        "the 5-D wide tensor: 'required rank 4 tensor to use channels_last format'")),
    "select_scatter-fallback-grads": (
        lambda s, h, x: torch.select_scatter(h, h[:, 0] * 2, 1, 1), B3, AssertionError, False,
        ("library bug: select_scatter has no rule; its torch.vmap fallback gives the right output "
        "but WRONG input gradients (torch.vmap's select_scatter backward, torch 2.13): the "
        "fallback is silently wrong in training")),
}


@pytest.mark.parametrize("name", list(REGRESSIONS))
def test_former_bugs_stay_fixed(name):
    fn, shape, _, strict, _ = REGRESSIONS[name]
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        run_case(fn, shape, strict=strict)


# ---------------------------------------------------------------------------------------------
# Ops without a rule (today) still give the right answer through the fallback
# ---------------------------------------------------------------------------------------------
FALLBACK_OK = {
    "roll-flattened": (lambda s, h, x: torch.roll(h, 3), B2),
    "einsum-implicit-output": (lambda s, h, x: torch.einsum("bi,ij", h, s.mat), B2),
    "index-non-adjacent": (lambda s, h, x: h[[0, 1], :, [2, 3]], B3),
    "setitem-slice": (lambda s, h, x: _setitem(h), B2),
    "normalize": (lambda s, h, x: F.normalize(h, dim=1), B3),
    "expand_as-param": (lambda s, h, x: s.scale.expand_as(h) * h, B2),
    "cosine_similarity-param": (lambda s, h, x: F.cosine_similarity(h, s.scale, dim=-1), B2),
    "bool-and-or": (lambda s, h, x: ((h > 0) & (h < 0.5) | ~(h > 0.9)).float() * h, B2),
    "var_mean": (lambda s, h, x: torch.var_mean(h, dim=1), B3),
}


@_cases(FALLBACK_OK)
def test_ops_correct_with_or_without_a_rule(name):
    """These may run through the per-member fallback (a warning is fine): never wrong."""
    fn, shape = FALLBACK_OK[name]
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        run_case(fn, shape, strict=False)


# ---------------------------------------------------------------------------------------------
# The harness itself can fail
# ---------------------------------------------------------------------------------------------
class _WrongGrads(nn.Module):
    """Right outputs, wrong gradients: ``2y - y.detach()`` is ``y`` exactly (``2y`` is exact, and
    so is its difference with ``y``), its gradient twice ``y``'s."""

    def __init__(self, wide):
        super().__init__()
        self.wide = wide

    def forward(self, x):
        y = self.wide(x)
        return 2 * y - y.detach()

    def named_parameters(self, *args, **kwargs):
        yield from self.wide.named_parameters(*args, **kwargs)

    def named_buffers(self, *args, **kwargs):
        yield from self.wide.named_buffers(*args, **kwargs)


def test_harness_detects_a_member_mixup_and_wrong_gradients():
    fn, shape = DIMS["softmax-dim1"]
    models = make_members(lambda: Case(fn, in_features=shape[-1]), 3)
    wide = compile_wide(models, torch.randn(*shape))
    per_member = [torch.randn(*shape) for _ in range(3)]
    check_equivalence(wide, models, per_member)  # the real thing passes
    with pytest.raises(AssertionError, match=r"member 0 of 3"):
        check_equivalence(wide, models[::-1], per_member)
    with pytest.raises(AssertionError, match=r"grad of"):
        check_equivalence(_WrongGrads(wide), models, per_member)
