"""Attention dropout sweeps (Note [Per-member attention dropout] in fx/rules/_attention_dropout.py,
Note [Attention weights with dropout in training] in fx/forms.py): members whose attention drops
with different rates fuse with no fallback, each member dropping with its own rate, its own mask.

The keep-rate tests make the dropped attention weights readable from the output: with ``v`` the
identity, the output row of query ``t`` is its (dropped, rescaled) weight row, every weight
positive, so an output element is 0 exactly where the member's mask dropped that weight."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import wide_compiler as wc
from torch import nn

FAST = wc.WideConfig.fast()  # strict (no fallback) and every member traced
PS = [0.0, 0.2, 0.5]


def _in_distribution(kept: torch.Tensor, p: float) -> None:
    """The fraction of True in ``kept`` is within 5 sigma of ``1 - p`` (all of them for p = 0)."""
    n, rate = kept.numel(), kept.double().mean().item()
    if p == 0:
        assert rate == 1.0
        return
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(rate - (1 - p)) < 5 * sigma, (p, rate, sigma)


def _ops(wide, training: bool) -> list:
    return [n.target for n in wide._graph_for(training).graph_module.graph.nodes if n.op == "call_function"]


def _fused_sdpa_in_eval(wide) -> bool:
    names = {str(t) for t in _ops(wide, False)}
    return any("scaled_dot_product_attention" in s or s.startswith("wide.attention") for s in names)


# --- nn.TransformerEncoderLayer ----------------------------------------------------------------
def _layers(batch_first: bool, ps=PS) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.TransformerEncoderLayer(8, 2, 16, dropout=p, batch_first=batch_first).double() for p in ps]


@pytest.mark.parametrize("batch_first", [True, False])
def test_transformer_encoder_layer_dropout_sweep_fuses_and_matches_members(batch_first):
    models = _layers(batch_first)
    wide = wc.compile(models, torch.randn(3, 5, 8, dtype=torch.float64), config=FAST)
    assert wide.fallbacks == []
    consts = wide.per_member_constants
    assert consts["self_attn.dropout"] == PS and consts["dropout.p"] == PS
    xs = torch.randn(len(PS), 3, 5, 8, dtype=torch.float64)
    # train: member 0 (p = 0) draws nothing, so it is its own forward exactly
    y = wide(xs)
    torch.testing.assert_close(y[0], models[0](xs[0]))
    for i in (1, 2):  # the others drop: their training output is not their eval one
        assert not torch.allclose(y[i], models[i].eval()(xs[i]))
    # eval: every member exactly, with the attention still one fused SDPA call
    wide.eval()
    for m in models:
        m.eval()
    y = wide(xs)
    for i, m in enumerate(models):
        torch.testing.assert_close(y[i], m(xs[i]))
    assert _fused_sdpa_in_eval(wide)


@pytest.mark.parametrize("batch_first", [True, False])
def test_transformer_encoder_layer_attention_dropout_alone_is_per_member(batch_first):
    """Only the attention drops (the layer's other dropouts set to 0 after construction, the same
    for every member): member 0 (p = 0) is exact in training, the others are not their eval output."""
    models = _layers(batch_first)
    for m in models:
        m.dropout.p = m.dropout1.p = m.dropout2.p = 0.0
    wide = wc.compile(models, torch.randn(3, 5, 8, dtype=torch.float64), config=FAST)
    assert wide.fallbacks == [] and wide.per_member_constants == {"self_attn.dropout": PS}
    xs = torch.randn(len(PS), 3, 5, 8, dtype=torch.float64)
    y = wide(xs)
    torch.testing.assert_close(y[0], models[0](xs[0]))
    for i in (1, 2):
        assert not torch.allclose(y[i], models[i].eval()(xs[i]))
        models[i].train()
    y.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in wide.parameters() if p.grad is not None)


# --- a bare nn.MultiheadAttention ---------------------------------------------------------------
class _SelfAttention(nn.Module):
    def __init__(self, p: float, need_weights: bool, batch_first: bool, e: int = 32, heads: int = 2):
        super().__init__()
        self.attn = nn.MultiheadAttention(e, heads, dropout=p, batch_first=batch_first, dtype=torch.float64)
        self.need_weights = need_weights

    def forward(self, x):
        out, w = self.attn(x, x, x, need_weights=self.need_weights)
        return out if w is None else (out, w)


def _readable(m: _SelfAttention) -> _SelfAttention:
    """q = k = 0 (every weight 1/T), v and the out projection the identity: with x = I the
    output element (t, e) is the dropped weight of query t, key e, head e // head_dim."""
    a, e = m.attn, m.attn.embed_dim
    with torch.no_grad():
        a.in_proj_weight.zero_()
        a.in_proj_weight[2 * e:] = torch.eye(e, dtype=torch.float64)
        a.in_proj_bias.zero_()
        a.out_proj.weight.copy_(torch.eye(e, dtype=torch.float64))
        a.out_proj.bias.zero_()
    return m


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_attention_dropout_sweep_keeps_each_members_rate(need_weights, batch_first):
    torch.manual_seed(0)
    models = [_readable(_SelfAttention(p, need_weights, batch_first)) for p in PS]
    e, b = 32, 8
    wide = wc.compile(models, torch.randn(4, e, e, dtype=torch.float64), config=FAST)
    assert wide.fallbacks == [] and wide.per_member_constants == {"attn.dropout": PS}
    eye = torch.eye(e, dtype=torch.float64)
    x = eye.expand(b, e, e) if batch_first else eye.unsqueeze(1).expand(e, b, e)
    torch.manual_seed(1)
    out = wide(x.expand(len(PS), *x.shape).contiguous())
    out = out[0] if need_weights else out
    masks = []
    for i, p in enumerate(PS):
        kept = out[i] != 0
        _in_distribution(kept, p)
        # a kept weight is 1/T rescaled by 1/(1 - p_i)
        torch.testing.assert_close(out[i][kept], torch.full_like(out[i][kept], 1 / e / (1 - p)))
        masks.append(kept)
    assert not torch.equal(masks[1], masks[2])  # the members draw their own masks


@pytest.mark.parametrize("need_weights", [True, False])
def test_multihead_attention_dropout_sweep_exact_for_p0_in_train_and_every_member_in_eval(need_weights):
    torch.manual_seed(0)
    models = [_SelfAttention(p, need_weights, True, e=8) for p in PS]
    wide = wc.compile(models, torch.randn(2, 5, 8, dtype=torch.float64), config=FAST)
    assert wide.fallbacks == []
    xs = torch.randn(len(PS), 2, 5, 8, dtype=torch.float64)
    def member(y, i):  # member i's (output, weights) or output
        return (y[0][i], y[1][i]) if need_weights else y[i]

    torch.testing.assert_close(member(wide(xs), 0), models[0](xs[0]))  # train: p = 0 draws nothing
    wide.eval()
    y = wide(xs)
    for i, m in enumerate(models):
        torch.testing.assert_close(member(y, i), m.eval()(xs[i]))


# --- F.scaled_dot_product_attention(dropout_p=self.p) ------------------------------------------
class _Sdpa(nn.Module):
    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x):
        return F.scaled_dot_product_attention(x, x, x, dropout_p=self.p if self.training else 0.0)


def test_functional_sdpa_dropout_sweep_rates_masks_and_exactness():
    models = [_Sdpa(p) for p in PS]
    wide = wc.compile(models, torch.randn(2, 2, 16, 16, dtype=torch.float64), config=FAST)
    assert wide.fallbacks == [] and wide.per_member_constants == {"p": PS}
    # x = I: weight row t is softmax(scale * e_t), every weight positive; out = dropped weights
    b, h, e = 4, 4, 16
    x = torch.eye(e, dtype=torch.float64).expand(len(PS), b, h, e, e).contiguous()
    torch.manual_seed(0)
    out = wide(x)
    plain = F.scaled_dot_product_attention(x[0], x[0], x[0])
    masks = []
    for i, p in enumerate(PS):
        kept = out[i] != 0
        _in_distribution(kept, p)
        torch.testing.assert_close(out[i][kept], plain[kept] / (1 - p))
        masks.append(kept)
    assert not torch.equal(masks[1], masks[2])
    # p = 0 exact on any input in train; every member exact in eval
    xs = torch.randn(len(PS), 2, 2, 6, 16, dtype=torch.float64)
    torch.testing.assert_close(wide(xs)[0], models[0](xs[0]))
    wide.eval()
    y = wide(xs)
    for i, m in enumerate(models):
        torch.testing.assert_close(y[i], m.eval()(xs[i]))
    assert _fused_sdpa_in_eval(wide)
    assert not any("scaled_dot_product_attention" in str(t) for t in _ops(wide, True))


def test_functional_sdpa_dropout_sweep_with_a_causal_mask_and_a_per_member_bool_mask():
    class Masked(nn.Module):
        def __init__(self, p: float, causal: bool):
            super().__init__()
            self.p, self.causal = p, causal

        def forward(self, x, mask=None):
            if self.causal:
                return F.scaled_dot_product_attention(x, x, x, dropout_p=self.p, is_causal=True)
            return F.scaled_dot_product_attention(x, x, x, attn_mask=x[..., :1] @ x[..., :1].transpose(-2, -1) > 0,
                                                  dropout_p=self.p)

    for causal in (True, False):
        models = [Masked(p, causal) for p in (0.0, 0.3)]
        wide = wc.compile(models, torch.randn(2, 2, 6, 8, dtype=torch.float64), config=FAST)
        assert wide.fallbacks == []
        xs = torch.randn(2, 2, 2, 6, 8, dtype=torch.float64)
        torch.testing.assert_close(wide(xs)[0], models[0](xs[0]), equal_nan=True)


def test_a_dropout_p_set_outside_0_1_after_compiling_fails_the_call():
    """The rate is read live from its buffer; a bad one (as a load_state_dict could bring) fails
    the call, naming the op, as the member alone would fail, instead of dropping something else."""
    wide = wc.compile([_Sdpa(p) for p in PS], torch.randn(2, 2, 4, 8), config=FAST)
    wide(torch.randn(len(PS), 2, 2, 4, 8))  # fine as compiled
    with torch.no_grad():
        dict(wide.named_buffers())["_per_member.p"][1] = 1.5
    with pytest.raises(ValueError, match=r"per-member constants \(p = 1\.5\) are not a configuration"):
        wide(torch.randn(len(PS), 2, 2, 4, 8))


@pytest.mark.parametrize("gqa", [False, True])
def test_a_per_member_attention_scale_matches_members_in_train_and_eval(gqa):
    """A temperature sweep (``scale=self.s``) takes the same explicit form; with ``enable_gqa``
    the key/value heads are repeated for the query heads, as SDPA does."""
    class Scaled(nn.Module):
        def __init__(self, s: float):
            super().__init__()
            self.s = s

        def forward(self, x):
            kv = x[:, :2] if gqa else x  # 2 key/value heads for 4 query heads
            return F.scaled_dot_product_attention(x, kv * 0.5, kv, scale=self.s, enable_gqa=gqa)

    scales = [0.1, 0.35, 1.0]
    models = [Scaled(s) for s in scales]
    wide = wc.compile(models, torch.randn(2, 4, 5, 8, dtype=torch.float64), config=FAST)
    assert wide.fallbacks == [] and wide.per_member_constants == {"s": scales}
    xs = torch.randn(len(scales), 2, 4, 5, 8, dtype=torch.float64)
    for training in (True, False):
        wide.train(training)
        y = wide(xs)
        for i, m in enumerate(models):
            torch.testing.assert_close(y[i], m(xs[i]))
