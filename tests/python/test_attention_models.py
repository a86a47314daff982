"""nn.MultiheadAttention and the nn.Transformer layers through compile(), member by member, in
every calling form: the batch-first self-attention capture form (fx/forms.py) for plain
self-attention, and MultiheadAttention's own forward for everything else (masks, attention
weights, cross-attention, bias_k/bias_v, kdim/vdim)."""
from __future__ import annotations

import pytest
import torch
import wide_compiler as wc
from torch import nn
from wide_compiler.fx.forms import _SelfAttentionForm
from wide_compiler.testing import check_compile, make_members

FAST = wc.WideConfig.fast()


class Attend(nn.Module):
    """One MultiheadAttention called in the form given by ``how``."""

    def __init__(self, how: str, batch_first: bool = True, **mha):
        super().__init__()
        self.how, self.batch_first = how, batch_first
        self.attn = nn.MultiheadAttention(16, 4, batch_first=batch_first, **mha)

    def forward(self, x):
        t = x.shape[1] if self.batch_first else x.shape[0]
        if self.how == "self":
            return self.attn(x, x, x, need_weights=False)[0]
        if self.how == "weights":  # need_weights=True (the default): the output and the weights
            return self.attn(x, x, x)
        if self.how == "causal":
            mask = torch.triu(torch.full((t, t), float("-inf")), 1)
            return self.attn(x, x, x, attn_mask=mask, need_weights=False, is_causal=True)[0]
        if self.how == "padding":  # the last position of every sequence is padding
            pad = torch.zeros(x.shape[:2] if self.batch_first else x.shape[1::-1], dtype=torch.bool)
            pad[:, -1] = True
            return self.attn(x, x, x, key_padding_mask=pad, need_weights=False)[0]
        if self.how == "cross":  # key/value a different tensor than the query
            kv = x.flip(1 if self.batch_first else 0) * 0.5
            return self.attn(x, kv, kv, need_weights=False)[0]
        raise AssertionError(self.how)


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("how", ["self", "weights", "causal", "padding", "cross"])
def test_multihead_attention_every_calling_form(how, batch_first):
    models = make_members(lambda: Attend(how, batch_first), 3)
    x = torch.randn(2, 5, 16) if batch_first else torch.randn(5, 2, 16)
    check_compile(models, x, config=FAST)


@pytest.mark.parametrize("mha", [{"add_bias_kv": True}, {"add_zero_attn": True}, {"kdim": 8, "vdim": 8},
                                 {"bias": False}], ids=["bias_kv", "zero_attn", "kdim_vdim", "no_bias"])
def test_multihead_attention_options(mha):
    if "kdim" in mha:
        class KV(nn.Module):
            def __init__(self):
                super().__init__()
                self.attn = nn.MultiheadAttention(16, 4, batch_first=True, **mha)

            def forward(self, x, kv):
                return self.attn(x, kv, kv, need_weights=False)[0]
        check_compile(make_members(KV, 3), (torch.randn(2, 5, 16), torch.randn(2, 4, 8)), config=FAST)
        return
    check_compile(make_members(lambda: Attend("self", **mha), 3), torch.randn(2, 5, 16), config=FAST)


def _layer(kind: str, norm_first: bool, batch_first: bool):
    if kind == "encoder":
        return nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=batch_first,
                                          norm_first=norm_first, activation="gelu")
    return nn.TransformerDecoderLayer(16, 4, 32, dropout=0.0, batch_first=batch_first, norm_first=norm_first)


class Layer(nn.Module):
    def __init__(self, kind, norm_first, batch_first):
        super().__init__()
        self.kind, self.layer = kind, _layer(kind, norm_first, batch_first)

    def forward(self, x):
        return self.layer(x) if self.kind == "encoder" else self.layer(x, x * 0.5)


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_transformer_layers(kind, norm_first, batch_first):
    models = make_members(lambda: Layer(kind, norm_first, batch_first), 3)
    x = torch.randn(2, 6, 16) if batch_first else torch.randn(6, 2, 16)
    check_compile(models, x, config=FAST)


def test_encoder_layer_uses_the_capture_form_and_leaves_the_members_alone():
    models = make_members(lambda: Layer("encoder", False, True), 2)
    wide = wc.compile(models, torch.randn(2, 6, 16), config=FAST)
    assert all(type(m.layer.self_attn) is nn.MultiheadAttention for m in models)
    assert type(wide._template.layer.self_attn) is nn.MultiheadAttention
    assert type(wide._capture_template[0].layer.self_attn) is _SelfAttentionForm
    ops = [str(n.target) for n in wide._graph_for(False).graph_module.graph.nodes if n.op == "call_function"]
    assert "aten.contiguous.default" not in ops  # the sequence-first splitting copies are gone
    assert type(wide.unfuse()[0].layer.self_attn) is nn.MultiheadAttention


def test_dropout_attention_in_training_draws_per_member_and_eval_matches():
    models = make_members(lambda: Attend("self", dropout=0.5), 3)
    _, report = check_compile(models, torch.randn(2, 5, 16), config=FAST)
    assert "eval" in str(report)
