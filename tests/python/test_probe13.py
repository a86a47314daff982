"""Probes 13 and 14 of issue 44 (independent re-runs of the adversarial probe, on pad=True): each
finding as a test that failed before its fix (P14-1, of the deferred compile, is in test_deferred.py)."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import wide_compiler as wc
from support import cpu_only

FAST = wc.WideConfig.fast()
WIDTHS = (2, 3, 5)


def padded_members_match(members, x, *, backward=True):
    """``compile(pad=True)`` of ``members`` (float64) against each member alone on ``x[i]``:
    outputs, and with ``backward`` the input and weight gradients of a weighted sum."""
    wide = wc.compile(copy.deepcopy(members), x[0], config=FAST, pad=True)
    xw = x.clone().requires_grad_(backward)
    out = wide.member_outputs(wide(xw))
    total = 0
    for i, m in enumerate(members):
        xi = x[i].clone().requires_grad_(backward)
        own = m(xi)
        assert torch.allclose(out[i], own, atol=1e-12, rtol=0), (i, out[i], own)
        if not backward:
            continue
        w = torch.linspace(0.3, 1.7, own.numel(), dtype=own.dtype).reshape(own.shape)
        (own * w).sum().backward()
        total = total + (out[i] * w).sum()
        assert torch.isfinite(xi.grad).all()
        m.__dict__["_input_grad"] = xi.grad
    if backward:
        total.backward()
        for i, m in enumerate(members):
            assert torch.allclose(xw.grad[i], m.__dict__.pop("_input_grad"), atol=1e-12, rtol=0), i
            for name, p in m.named_parameters():
                got = wide.get_parameter(name).grad[i]
                assert torch.allclose(got, wide.member_padded(i, p.grad, state=name), atol=1e-12, rtol=0), (i, name)
    return wide


class _Hardtanh(nn.Module):
    def __init__(self, h, bounds, post):
        super().__init__()
        self.a = nn.Linear(4, h)
        self.bounds, self.post = bounds, post

    def forward(self, x):
        return self.post(F.hardtanh(self.a(x), *self.bounds))


@pytest.mark.parametrize("bounds", [(0.2, 0.8), (-0.8, -0.2), (-1.0, 1.0), (0.0, 6.0)])
@pytest.mark.parametrize("post", ["sum", "mean", "layer_norm"])
def test_hardtanh_whose_range_leaves_out_zero_keeps_the_padding_zero(bounds, post):
    """P13-4: hardtanh(0) is min_val when min_val > 0 (max_val when max_val < 0): the padding
    became 0.2 and a sum over the padded dim counted it (0.6 off; LayerNorm 1.56 off)."""
    reduce = {"sum": lambda h: h.sum(-1), "mean": lambda h: h.mean(-1),
              "layer_norm": lambda h: F.layer_norm(h, h.shape[-1:])}[post]
    torch.manual_seed(0)
    members = [_Hardtanh(h, bounds, reduce).double() for h in WIDTHS]
    padded_members_match(members, torch.randn(3, 2, 4, dtype=torch.float64))


class _Heads(nn.Module):
    """Attention over swept heads (head dim 2) with a causal mask given as ``how``: added (0 or
    -inf), or written by masked_fill; ``where`` picks between the scores and -inf."""

    def __init__(self, heads, how):
        super().__init__()
        self.q = nn.Linear(4, heads * 2)
        self.o = nn.Linear(heads * 2, 2)
        self.how = how

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, -1, 2).transpose(1, 2)
        causal = torch.ones(t, t, dtype=torch.bool).triu(1)
        att = q @ q.transpose(-1, -2)
        if self.how == "add":
            att = att + torch.zeros(t, t, dtype=x.dtype).masked_fill(causal, float("-inf"))
        elif self.how == "masked_fill":
            att = att.masked_fill(causal, float("-inf"))
        else:
            att = torch.where(causal, torch.full_like(att, float("-inf")), att)
        return self.o((torch.softmax(att, -1) @ q).transpose(1, 2).reshape(b, t, -1))


@pytest.mark.parametrize("how", ["add", "masked_fill", "where"])
def test_a_causal_mask_over_padded_heads(how):
    """P13-2: scores + an additive causal mask (-inf) over padded heads: exact outputs, NaN
    gradients for every padded member (-inf * 0 in the padding's mask, through softmax's
    backward); P13-3: the same mask by masked_fill or where was refused as a positional op."""
    torch.manual_seed(1)
    members = [_Heads(h, how).double() for h in WIDTHS]
    padded_members_match(members, torch.randn(3, 2, 5, 4, dtype=torch.float64))


class _SequenceMask(nn.Module):
    """Hidden units swept; a sequence mask over [B, T] written into every unit (masked_fill of 0,
    or an additive -inf mask before a max over time)."""

    def __init__(self, h, additive):
        super().__init__()
        self.a = nn.Linear(4, h)
        self.b = nn.Linear(h, 2)
        self.additive = additive

    def forward(self, x, keep):
        h = self.a(x)
        if self.additive:
            return self.b((h + torch.zeros_like(keep, dtype=h.dtype).masked_fill(~keep, float("-inf"))
                           .unsqueeze(-1)).amax(1))
        return self.b(h.masked_fill(~keep.unsqueeze(-1), 0.0).sum(1))


@pytest.mark.parametrize("additive", [False, True])
def test_a_sequence_mask_over_padded_units(additive):
    """P13-3: h.masked_fill(mask[B, T, None], 0) with the hidden size swept was refused; an
    additive -inf mask before a max over time gave NaN outputs for the padded members (the next
    Linear's zero rows times -inf * 0)."""
    torch.manual_seed(2)
    members = [_SequenceMask(h, additive).double() for h in WIDTHS]
    x = torch.randn(3, 2, 5, 4, dtype=torch.float64)
    keep = torch.tensor([[True, True, True, False, False], [True, True, True, True, True]]).expand(3, 2, 5)
    wide = wc.compile(copy.deepcopy(members), (x[0], keep[0]), config=FAST, pad=True)
    xw = x.clone().requires_grad_(True)
    out = wide.member_outputs(wide(xw, keep))
    total = 0
    for i, m in enumerate(members):
        xi = x[i].clone().requires_grad_(True)
        own = m(xi, keep[i])
        assert torch.allclose(out[i], own, atol=1e-12, rtol=0), i
        own.sum().backward()
        total = total + out[i].sum()
        m.__dict__["_input_grad"] = xi.grad
    total.backward()
    for i, m in enumerate(members):
        assert torch.allclose(xw.grad[i], m.__dict__.pop("_input_grad"), atol=1e-12, rtol=0), i
        for name, p in m.named_parameters():
            assert torch.allclose(wide.get_parameter(name).grad[i], wide.member_padded(i, p.grad, state=name),
                                  atol=1e-12, rtol=0), (i, name)


class _Head(nn.Module):
    """A Linear on a non-contiguous 3-D input: a batch_first recurrent layer's output, or a
    transposed input."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.r = getattr(nn, kind)(3, 5, num_layers=2, bidirectional=True, batch_first=True) if kind != "T" else None
        self.o = nn.Linear(10 if kind != "T" else 3, 2)

    def forward(self, x):
        return self.o(self.r(x)[0] if self.r is not None else x.transpose(0, 1))


@cpu_only  # ATen's CPU linear (and CPU autocast) rounds so; CUDA's has its own path
@pytest.mark.parametrize("kind", ["T", "GRU", "RNN", "LSTM"])
def test_a_linear_on_a_non_contiguous_input_under_bfloat16_autocast(kind):
    """P13-5: ATen's linear adds the bias after the product (two bfloat16 roundings) for a
    non-contiguous input of 3 dims (a batch_first RNN's output, a transpose); the wide linear
    added it inside (one rounding): one bfloat16 ulp off in a third of the outputs. Now bit for
    bit, in train and eval mode (Note [A bias added after the product])."""
    torch.manual_seed(3)
    members = [_Head(kind) for _ in range(3)]
    x = torch.randn(3, 2, 4, 3)
    wide = wc.compile(copy.deepcopy(members), x[0], config=FAST)
    for training in (True, False):
        wide.train(training)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = wide(x)
            for i, m in enumerate(members):
                own = m.train(training)(x[i])
                assert y.dtype == own.dtype == torch.bfloat16
                assert torch.equal(y[i], own), (training, i, int((y[i] != own).sum()))


@pytest.mark.parametrize("criterion", ["cross_entropy", "module", "mse", "shared"])
def test_member_losses_of_a_padded_class_sweep(criterion):
    """P13-6: wc.optim.member_losses(F.cross_entropy, wide(x), y) on a padded model whose output
    width (classes) differs between members counted the zero padding as extra classes (2.12 where
    the member's loss is 1.51). Each member's loss is now on its own classes: losses and gradients."""
    torch.manual_seed(4)
    members = [nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, v)).double() for v in (5, 7, 9)]
    x = torch.randn(3, 8, 4, dtype=torch.float64)
    wide = wc.compile(copy.deepcopy(members), x[0], config=FAST, pad=True)
    if criterion == "mse":  # a padded target: each member's own width
        y = torch.stack([wide.member_padded(i, torch.randn(8, m[2].out_features, dtype=torch.float64), output=0)
                         for i, m in enumerate(members)])
        fn, targets = F.mse_loss, [y[i][:, : m[2].out_features] for i, m in enumerate(members)]
    else:
        y = torch.randint(0, 5, (3, 8))
        fn = nn.CrossEntropyLoss(label_smoothing=0.1) if criterion == "module" else F.cross_entropy
        targets = list(y)
    if criterion == "shared":
        y = y[0].expand(3, 8)
        targets = [y[0]] * 3
    losses = wc.optim.member_losses(fn, wide(x), y)
    own = torch.stack([fn(m(x[i]), targets[i]) for i, m in enumerate(members)])
    assert torch.allclose(losses, own, atol=1e-12, rtol=0)
    losses.sum().backward()
    own.sum().backward()
    for i, m in enumerate(members):
        for name, p in m.named_parameters():
            assert torch.allclose(wide.get_parameter(name).grad[i], wide.member_padded(i, p.grad, state=name),
                                  atol=1e-12, rtol=0), (i, name)


def test_the_wide_model_constructor_refuses_a_member_attribute_named_per_member():
    """P9-24's other door: ``wc.WideModel(members, sample)`` (not through wc.compile) with a member
    whose top-level ``_per_member`` collides with the per-member constants' buffers: the same
    refusal with the fix, not a bare KeyError."""

    class Net(nn.Module):
        def __init__(self, s):
            super().__init__()
            self._per_member = nn.Linear(4, 4)
            self.bias = s

        def forward(self, x):
            return self._per_member(x) * self.bias

    with pytest.raises(wc.WideCompileError, match="_per_member.*rename it"):
        wc.WideModel([Net(0.5), Net(2.0)], (torch.randn(3, 4),), config=FAST)


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("before, after", [(torch.float64, torch.float32), (torch.float32, torch.float64)])
def test_padded_recurrent_members_after_a_dtype_change(kind, before, after):
    """P14-2: pad=True with a recurrent layer, then wide.to(dtype): every call failed inside the
    graph (the zero state the layer makes was captured in the padded programs' old dtype). Now
    the padded programs are made again in the new dtype; member(i) follows it too."""
    torch.manual_seed(5)
    members = [nn.Sequential(nn.Linear(5, h), getattr(nn, kind)(h, h, batch_first=True)).to(before) for h in (4, 7)]
    wide = wc.compile(copy.deepcopy(members), torch.randn(2, 4, 5, dtype=before), config=FAST, pad=True).to(after)
    x = torch.randn(2, 2, 4, 5, dtype=after)
    for training in (True, False):
        out = wide.train(training).member_outputs(wide(x))
        for i, m in enumerate(members):
            own = copy.deepcopy(m).to(after).train(training)(x[i])
            assert out[i][0].dtype == after
            assert torch.allclose(out[i][0], own[0], atol=1e-6, rtol=0), (training, i)
    assert next(wide.member(0).parameters()).dtype == after


class _Scaled(nn.Module):
    def __init__(self, t, slope):
        super().__init__()
        self.a, self.act, self.b, self.t = nn.Linear(4, 6), nn.LeakyReLU(slope), nn.Linear(6, 2), t

    def forward(self, x):
        return self.b(self.act(self.a(x))) / self.t


@pytest.mark.parametrize("eval_first", [False, True])
def test_load_members_restores_a_configuration_no_member_holds_now(tmp_path, eval_first):
    """P14-4: wcd.load_members of a checkpoint saved before copy_member_weights refused member 1's
    own compiled configuration (no member held it any more); load_state_dict restored it. Now both
    restore it, in train and eval, with its derived arguments (LeakyReLU's slope)."""
    import wide_compiler.distributed as wcd

    torch.manual_seed(6)
    members = [_Scaled(t, s) for t, s in ((1.0, 0.01), (2.0, 0.1), (0.5, 0.2))]
    wide = wc.compile(copy.deepcopy(members), torch.randn(5, 4), config=FAST)
    opt = wc.optim.Adam(wide.parameters(), lr=0.01)
    x = torch.randn(3, 5, 4)
    if eval_first:
        wide.eval()(x)
        wide.train()
    wcd.save_members(wide, tmp_path, opt)
    wide.copy_member_weights(0, 1, optimizer=opt)
    assert wide.member(1).t == 1.0
    wcd.load_members(wide, tmp_path, opt)
    assert wide.member(1).t == 2.0 and wide.member(1).act.negative_slope == 0.1
    for training in (True, False):
        out = wide.train(training)(x)
        for i, m in enumerate(members):
            assert torch.allclose(out[i], m.train(training)(x[i]), atol=1e-6), (training, i)


def test_a_call_with_a_keyword_the_sample_lacks_and_a_namedtuple_input():
    """P14-3: with a namedtuple input, a call with a keyword the sample lacks raised a TypeError
    from inside the library (rebuilding the namedtuple) instead of the structure error."""
    from collections import namedtuple

    Pair = namedtuple("Pair", "a b")

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, p, scale=1.0):
            return self.fc(p.a + p.b) * scale

    wide = wc.compile([Net() for _ in range(2)], (Pair(torch.randn(3, 4), torch.randn(3, 4)),), config=FAST)
    p = Pair(torch.randn(2, 3, 4), torch.randn(2, 3, 4))
    assert wide(p).shape == (2, 3, 2)
    for kw in ({"scale": 2.0}, {"bogus": 1}):
        with pytest.raises(ValueError, match="nested as in the sample"):
            wide(p, **kw)


def test_a_head_dim_sweep_with_attention_weights_is_refused_saying_why():
    """P14-6: nn.MultiheadAttention over a head-dim sweep with need_weights=True was refused as a
    member 'called with 0.5 where member 0 has 0.707', pointing at a hyperparameter nobody set:
    the message now names a float computed from a size (head_dim ** -0.5) and what to do."""

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.i, self.att, self.o = nn.Linear(5, d), nn.MultiheadAttention(d, 2, batch_first=True), nn.Linear(d, 2)

        def forward(self, x):
            h = self.i(x)
            a, w = self.att(h, h, h, need_weights=True)
            return self.o(a), w

    with pytest.raises(wc.ArchitectureMismatchError, match=r"(?s)head_dim \*\* -0\.5.*WideRouter groups them"):
        wc.compile([Block(d) for d in (4, 8)], torch.randn(2, 3, 5), config=FAST, pad=True)


def test_a_router_call_of_part_of_a_group_with_gradients_warns():
    """P15-1 (probe 15): wide_forward(tower_names=[...]) with gradients on gives the towers left out
    zero gradients in their slices (a tower that did not run has None), so SGD with momentum moved
    a tower that was never called (0.28 off), silently. Warned once per group, naming the towers;
    no warning without gradients."""

    class Tower(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.o = nn.Linear(6, 8), nn.Linear(8, 3)

        def forward(self, x):
            return self.o(torch.tanh(self.a(x)))

    router = wc.WideRouter(config=FAST)
    for k in range(3):
        router.register_tower(f"t{k}", Tower())
    router.prepare_for_compile(torch.randn(5, 6))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        router.wide_forward(torch.randn(5, 6), tower_names=["t0", "t1"])
    with pytest.warns(UserWarning, match=r"towers \['t2'\] .* were not called with gradients on"):
        router.wide_forward(torch.randn(5, 6), tower_names=["t0", "t1"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per group
        router.wide_forward(torch.randn(5, 6), tower_names=["t0", "t1"])
