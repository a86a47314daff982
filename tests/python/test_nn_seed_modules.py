"""wc.nn: strategy validation on every module, and the WideDropout*, WideAdaptive*Pool* and
WideMultiheadAttention modules, each member against its own torch module (outputs, weights, input
and parameter grads, buffers), train and eval, with random shapes and adversarial inputs."""
from __future__ import annotations

import copy
import itertools
import random
import re

import pytest
import torch
import wide_compiler as wc
from torch import nn
from support import DEVICE, cpu_only
from wide_compiler.testing import (
    assert_members_close,
    assert_trees_members_close,
    check_equivalence,
    make_members,
)

N = 3
LINEAR, CONV, FUSED_LOOP, AUTO = ("auto", "bmm", "bmm_t", "loop"), ("auto", "grouped", "grouped_cl", "loop"), ("auto", "fused", "loop"), ("auto",)


def _ints(*shape, high=10):
    return lambda: torch.randint(0, high, shape)


def _randn(*shape):
    return lambda: torch.randn(*shape)


# class name -> (member factory, one member's input, the strategies the class must accept)
CASES = {
    "WideLinear": (lambda: nn.Linear(4, 3), _randn(2, 4), LINEAR),
    "WideConv1d": (lambda: nn.Conv1d(2, 4, 3), _randn(2, 2, 7), CONV),
    "WideConv2d": (lambda: nn.Conv2d(2, 4, 3, padding=1), _randn(2, 2, 5, 5), CONV),
    "WideConv3d": (lambda: nn.Conv3d(2, 2, 2), _randn(1, 2, 3, 3, 3), CONV),
    "WideConvTranspose1d": (lambda: nn.ConvTranspose1d(2, 3, 3, stride=2), _randn(2, 2, 4), CONV),
    "WideConvTranspose2d": (lambda: nn.ConvTranspose2d(2, 3, 2), _randn(2, 2, 3, 3), CONV),
    "WideConvTranspose3d": (lambda: nn.ConvTranspose3d(2, 2, 2), _randn(1, 2, 2, 2, 2), CONV),
    "WideBatchNorm1d": (lambda: nn.BatchNorm1d(3), _randn(4, 3), AUTO),
    "WideBatchNorm2d": (lambda: nn.BatchNorm2d(3), _randn(2, 3, 2, 2), AUTO),
    "WideBatchNorm3d": (lambda: nn.BatchNorm3d(3), _randn(2, 3, 2, 2, 2), AUTO),
    "WideInstanceNorm1d": (lambda: nn.InstanceNorm1d(3, affine=True), _randn(2, 3, 5), AUTO),
    "WideInstanceNorm2d": (lambda: nn.InstanceNorm2d(3), _randn(2, 3, 3, 3), AUTO),
    "WideInstanceNorm3d": (lambda: nn.InstanceNorm3d(3), _randn(2, 3, 2, 2, 2), AUTO),
    "WideGroupNorm": (lambda: nn.GroupNorm(2, 4), _randn(2, 4, 3), AUTO),
    "WideLayerNorm": (lambda: nn.LayerNorm(5), _randn(2, 3, 5), FUSED_LOOP),
    "WideRMSNorm": (lambda: nn.RMSNorm(5), _randn(2, 5), AUTO),
    "WideEmbedding": (lambda: nn.Embedding(10, 4), _ints(2, 3), AUTO),
    "WideEmbeddingBag": (lambda: nn.EmbeddingBag(10, 4), _ints(2, 3), AUTO),
    "WidePReLU": (lambda: nn.PReLU(3), _randn(2, 3, 4), AUTO),
    "WideLSTM": (lambda: nn.LSTM(4, 5), _randn(3, 2, 4), FUSED_LOOP),
    "WideGRU": (lambda: nn.GRU(4, 5, batch_first=True), _randn(2, 3, 4), FUSED_LOOP),
    "WideRNN": (lambda: nn.RNN(4, 5), _randn(3, 2, 4), FUSED_LOOP),
    "WideLSTMCell": (lambda: nn.LSTMCell(4, 5), _randn(2, 4), AUTO),
    "WideGRUCell": (lambda: nn.GRUCell(4, 5), _randn(2, 4), AUTO),
    "WideRNNCell": (lambda: nn.RNNCell(4, 5), _randn(2, 4), AUTO),
    "WideDropout": (lambda: nn.Dropout(0.3).eval(), _randn(2, 4), AUTO),
    "WideDropout1d": (lambda: nn.Dropout1d(0.3).eval(), _randn(2, 3, 4), AUTO),
    "WideDropout2d": (lambda: nn.Dropout2d(0.3).eval(), _randn(2, 3, 4, 4), AUTO),
    "WideDropout3d": (lambda: nn.Dropout3d(0.3).eval(), _randn(2, 3, 2, 2, 2), AUTO),
    "WideAdaptiveAvgPool1d": (lambda: nn.AdaptiveAvgPool1d(2), _randn(2, 3, 5), AUTO),
    "WideAdaptiveAvgPool2d": (lambda: nn.AdaptiveAvgPool2d(2), _randn(2, 3, 5, 4), AUTO),
    "WideAdaptiveAvgPool3d": (lambda: nn.AdaptiveAvgPool3d(2), _randn(2, 3, 3, 4, 5), AUTO),
    "WideAdaptiveMaxPool1d": (lambda: nn.AdaptiveMaxPool1d(2), _randn(2, 3, 5), AUTO),
    "WideAdaptiveMaxPool2d": (lambda: nn.AdaptiveMaxPool2d(2, return_indices=True), _randn(2, 3, 5, 4), AUTO),
    "WideAdaptiveMaxPool3d": (lambda: nn.AdaptiveMaxPool3d(2), _randn(2, 3, 3, 4, 5), AUTO),
    "WideMultiheadAttention": (lambda: nn.MultiheadAttention(8, 2, kdim=4, vdim=6),
                               lambda: (torch.randn(3, 2, 8), torch.randn(5, 2, 4), torch.randn(5, 2, 6)), LINEAR),
}


def test_every_wide_module_has_a_case():
    assert sorted(CASES) == sorted(wc.nn.__all__)


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_strategy_matches_the_members_and_bad_ones_fail_at_construction(name):
    cls = getattr(wc.nn, name)
    factory, sample, strategies = CASES[name]
    assert tuple(cls.STRATEGIES) == strategies
    members = make_members(factory, N)
    inputs = [sample() for _ in range(N)]
    for s in strategies:
        wide = cls.from_modules(members, strategy=s)
        assert wide.strategy == s and repr(s) in repr(wide)
        check_equivalence(wide, members, inputs)
    for bad in ("nonsense", "AUTO", "", None):
        with pytest.raises(ValueError, match=rf"{name}: expected strategy in \({', '.join(map(repr, strategies))},?\)"):
            cls.from_modules(members, strategy=bad)


@pytest.mark.parametrize("make", [
    lambda s: wc.nn.WideLinear(2, 3, 4, strategy=s),
    lambda s: wc.nn.WideDropout(2, strategy=s),
    lambda s: wc.nn.WideAdaptiveAvgPool2d(2, 3, strategy=s),
    lambda s: wc.nn.WideMultiheadAttention(2, 8, 2, strategy=s),
], ids=["linear", "dropout", "pool", "mha"])
def test_constructors_validate_strategy(make):
    with pytest.raises(ValueError, match=r"expected strategy in"):
        make("fastest")


@pytest.mark.parametrize("op,call,mine", [
    ("linear", lambda s: torch.ops.wide.linear(torch.randn(2, 1, 3), torch.randn(2, 4, 3), strategy=s), LINEAR),
    ("conv", lambda s: torch.ops.wide.conv(torch.randn(2, 1, 2, 4), torch.randn(2, 3, 2, 2), None, [1], [0], [1], 1,
                                           strategy=s), CONV),
    ("layer_norm", lambda s: torch.ops.wide.layer_norm(torch.randn(2, 1, 3), [3], strategy=s), FUSED_LOOP),
    ("rnn", lambda s: torch.ops.wide.rnn(torch.randn(2, 3, 1, 2), [], [torch.randn(2, 4, 2), torch.randn(2, 4, 4)],
                                         "RNN_TANH", 1, False, False, 0.0, False, False, strategy=s), FUSED_LOOP),
])
def test_strategy_tables_are_the_ops_own(op, call, mine):
    """The names each module accepts are exactly those its torch.ops.wide op accepts."""
    with pytest.raises(RuntimeError, match="strategy") as err:
        call("nonsense")
    listed = re.search(r"expected strategy (.*), got", str(err.value)).group(1)
    assert tuple(re.findall(r"['\"](\w+)['\"]", listed)) == mine
    for s in mine:
        call(s)


def test_layer_norm_strategy_reaches_the_op(monkeypatch):
    seen = []
    real = wc.functional.layer_norm
    monkeypatch.setattr(wc.functional, "layer_norm", lambda *a, **k: seen.append(k["strategy"]) or real(*a, **k))
    wc.nn.WideLayerNorm.from_modules(make_members(lambda: nn.LayerNorm(4), 2), strategy="loop")(torch.randn(2, 3, 4))
    assert seen == ["loop"]


# --------------------------------------------------------------------------------------------
# Dropout
# --------------------------------------------------------------------------------------------
DROPOUTS = [(nn.Dropout, wc.nn.WideDropout), (nn.Dropout1d, wc.nn.WideDropout1d),
            (nn.Dropout2d, wc.nn.WideDropout2d), (nn.Dropout3d, wc.nn.WideDropout3d)]
# member shapes per class; at p=0.5 a dim the mask varies along looks constant with odds < 2^-15
SHAPES = {nn.Dropout: [(40,), (16, 3), (16, 3, 4)], nn.Dropout1d: [(20, 3), (16, 5, 3)],
          nn.Dropout2d: [(16, 5, 3), (16, 5, 3, 2)], nn.Dropout3d: [(20, 3, 2, 2), (16, 5, 2, 3, 2), (20, 3, 3)]}


def _varying_dims(y: torch.Tensor) -> set[int]:
    """The dims of a 0/non-0 mask pattern that it varies along."""
    z = (y != 0)
    return {d for d in range(z.dim()) if not torch.equal(z, z.narrow(d, 0, 1).expand_as(z))}


@pytest.mark.parametrize("base,wcls", DROPOUTS, ids=lambda v: getattr(v, "__name__", ""))
def test_dropout_masks_independent_per_member_with_the_members_pattern(base, wcls, recwarn):
    torch.manual_seed(0)
    ps = [0.5, 0.25, 0.5, 0.0, 1.0]
    wide = wcls.from_modules([base(p) for p in ps])
    assert wide.training and wide.p == tuple(ps)
    for shape in SHAPES[base]:
        x = torch.full((len(ps), *shape), 3.0, requires_grad=True)
        y = wide(x)
        for i, p in enumerate(ps):
            kept = y[i][y[i] != 0]
            if p < 1:
                assert torch.allclose(kept, torch.full_like(kept, 3.0 / (1 - p))), f"member {i} scale"
            if p == 0.5:  # the member's own drop pattern: same dims vary as nn.Dropout*'s
                ref = base(0.5)(torch.ones(shape))
                assert _varying_dims(y[i]) == _varying_dims(ref), f"member {i}, shape {shape}"
            if 0 < p < 1:
                frac = 1 - kept.numel() / y[i].numel()
                assert abs(frac - p) < 0.3, f"member {i} dropped {frac:.2f}, p={p}"
        assert bool((y[3] == 3).all()) and bool((y[4] == 0).all())
        assert not torch.equal(y[0] != 0, y[2] != 0), "members 0 and 2 (same p) drew the same mask"
        y.backward(torch.ones_like(y))
        assert torch.equal(x.grad, y.detach() / 3.0), "gradient is not mask * scale"
    wide.eval()
    x = torch.randn(len(ps), *SHAPES[base][-1])
    assert torch.equal(wide(x), x)
    back = wide.unfuse()
    assert [type(m) for m in back] == [base] * len(ps) and [m.p for m in back] == ps
    assert not any(m.training for m in back)


def test_dropout_errors_and_options():
    with pytest.raises(wc.ArchitectureMismatchError, match=r"member 2: inplace is True, member 0 has False"):
        wc.nn.WideDropout.from_modules([nn.Dropout(), nn.Dropout(), nn.Dropout(inplace=True)])
    with pytest.raises(wc.ArchitectureMismatchError, match=r"member 1: training is False"):
        wc.nn.WideDropout.from_modules([nn.Dropout(), nn.Dropout().eval()])
    with pytest.raises(wc.ArchitectureMismatchError, match=r"member 1: expected Dropout, got Dropout2d"):
        wc.nn.WideDropout.from_modules([nn.Dropout(), nn.Dropout2d()])
    with pytest.raises(wc.ArchitectureMismatchError, match=r"member 1: type is Mine, member 0 has Dropout2d"):
        wc.nn.WideDropout2d.from_modules([nn.Dropout2d(), type("Mine", (nn.Dropout2d,), {})()])
    with pytest.raises(ValueError, match=r"at least one"):
        wc.nn.WideDropout.from_modules([])
    with pytest.raises(ValueError, match=r"member 1 has 1.5"):
        wc.nn.WideDropout(2, [0.1, 1.5])
    with pytest.raises(ValueError, match=r"one p per member \(3\), got 2"):
        wc.nn.WideDropout(3, [0.1, 0.2])
    with pytest.raises(ValueError, match=r"N=3 members"):
        wc.nn.WideDropout(3)(torch.randn(2, 4))
    with pytest.raises(ValueError, match=r"WideDropout1d: expected an N-first input"):
        wc.nn.WideDropout1d(2)(torch.randn(2, 2, 3, 4, 5))
    with pytest.warns(UserWarning, match=r"3-D member input"):
        wc.nn.WideDropout2d(2)(torch.randn(2, 3, 4, 5))
    wide = wc.nn.WideDropout.from_modules([nn.Dropout(0.5, inplace=True)] * 2)
    x = torch.ones(2, 50)
    assert wide(x) is x and bool((x == 0).any())
    assert "p=0.5" in repr(wide) and "p=(0.1, 0.2)" in repr(wc.nn.WideDropout(2, [0.1, 0.2]))
    members = [nn.Dropout(0.1), nn.Dropout(0.2)]
    wc.nn.WideDropout.from_modules(members).unfuse()
    assert [m.p for m in members] == [0.1, 0.2] and all(m.training for m in members)


# --------------------------------------------------------------------------------------------
# Adaptive pools
# --------------------------------------------------------------------------------------------
POOLS = [(d, kind) for d in (1, 2, 3) for kind in ("Avg", "Max")]


@pytest.mark.parametrize("d,kind", POOLS, ids=[f"{k}{d}d" for d, k in POOLS])
@pytest.mark.parametrize("trial", range(3))
def test_adaptive_pools_random_shapes(d, kind, trial):
    rng = random.Random(100 * d + trial)
    base = getattr(nn, f"Adaptive{kind}Pool{d}d")
    wcls = getattr(wc.nn, f"WideAdaptive{kind}Pool{d}d")
    size = tuple(rng.choice([None, 1, 2, 3, 5]) for _ in range(d)) if d > 1 else rng.choice([1, 2, 4, 7])
    extra = {"return_indices": rng.random() < 0.5} if kind == "Max" else {}
    members = [base(size, **extra) for _ in range(N)]
    wide = wcls.from_modules(members)
    for batch in (1, rng.randint(2, 4), None):  # None: unbatched members
        spatial = [rng.randint(1, 9) for _ in range(d)]
        lead = [] if batch is None else [batch]
        check_equivalence(wide, members, torch.randn(N, *lead, rng.randint(1, 4), *spatial))
    back = wide.unfuse()
    assert all(type(m) is base and m.output_size == size for m in back)


def test_adaptive_pool_errors():
    with pytest.raises(wc.ArchitectureMismatchError, match=r"member 2: output_size is \(3, 3\), member 0 has 2"):
        wc.nn.WideAdaptiveAvgPool2d.from_modules([nn.AdaptiveAvgPool2d(2)] * 2 + [nn.AdaptiveAvgPool2d((3, 3))])
    wc.nn.WideAdaptiveAvgPool2d.from_modules([nn.AdaptiveAvgPool2d(2), nn.AdaptiveAvgPool2d((2, 2))])  # same size
    with pytest.raises(wc.ArchitectureMismatchError, match=r"member 1: return_indices is True"):
        wc.nn.WideAdaptiveMaxPool1d.from_modules([nn.AdaptiveMaxPool1d(2), nn.AdaptiveMaxPool1d(2, True)])
    with pytest.raises(wc.ArchitectureMismatchError, match=r"member 1: expected AdaptiveAvgPool1d"):
        wc.nn.WideAdaptiveAvgPool1d.from_modules([nn.AdaptiveAvgPool1d(2), nn.AdaptiveMaxPool1d(2)])
    wide = wc.nn.WideAdaptiveAvgPool2d(3, 2)
    with pytest.raises(ValueError, match=r"N=3 members and 5 dims \(or 4 for unbatched"):
        wide(torch.randn(2, 4, 3, 5, 5))
    with pytest.raises(ValueError, match=r"got \[3, 5, 5\]"):
        wide(torch.randn(3, 5, 5))
    assert wide(torch.randn(3, 0, 2, 4, 4)).shape == (3, 0, 2, 2, 2)


# --------------------------------------------------------------------------------------------
# MultiheadAttention
# --------------------------------------------------------------------------------------------
def _mha_members(n=N, seed=0, **kw):
    ms = make_members(lambda: nn.MultiheadAttention(**kw), n, seed)
    with torch.no_grad():  # nonzero biases, so a missing bias would show
        for m in ms:
            for p in m.parameters():
                p.add_(torch.randn_like(p) * 0.1)
    return ms


def _layout(batch_first, b, length, e):
    return (length, e) if b is None else ((b, length, e) if batch_first else (length, b, e))


def _check_mha(wide, members, q, k, v, wide_kw=None, member_kws=None, *, same="", grads=True, equal_nan=False):
    """Member i on ``(q[i], k[i], v[i], **member_kws[i])`` vs ``wide(q, k, v, **wide_kw)``: outputs,
    attention weights, and the gradients of q/k/v and every parameter. ``same``: "qkv" passes one
    tensor as query, key and value (torch's packed self-attention path), "kv" one as key and value."""
    member_kws = member_kws or [{}] * len(members)

    def leaves(qq, kk, vv):
        qq = qq.detach().clone().requires_grad_(grads)
        kk = qq if same == "qkv" else kk.detach().clone().requires_grad_(grads)
        vv = kk if same in ("qkv", "kv") else vv.detach().clone().requires_grad_(grads)
        return qq, kk, vv

    def grads_of(out, ins, params, cot):
        terms = [(t, c) for t, c in zip(out, cot) if t is not None]
        wrt = list({id(t): t for t in ins}.values()) + list(params.values())
        got = torch.autograd.grad([t for t, _ in terms], wrt, [c for _, c in terms], allow_unused=True)
        return got[:len(wrt) - len(params)], dict(zip(params, got[len(wrt) - len(params):]))

    wq, wk, wv = leaves(q, k, v)
    out = wide(wq, wk, wv, **(wide_kw or {}))
    refs, ref_grads = [], []
    for i, m in enumerate(members):
        m = copy.deepcopy(m)
        ins = leaves(q[i], k[i], v[i])
        ref = m(*ins, **member_kws[i])
        refs.append(ref)
        if grads:
            cot = [None if t is None else torch.randn(t.shape, generator=torch.Generator(DEVICE).manual_seed(i + 7 * j))
                   for j, t in enumerate(ref)]
            ref_grads.append((cot, grads_of(ref, ins, dict(m.named_parameters()), cot)))
    assert_trees_members_close(out, refs, equal_nan=equal_nan)
    if grads:
        cot = [None if t is None else torch.stack([c[j] for c, _ in ref_grads]) for j, t in enumerate(out)]
        (gin, gpar) = grads_of(out, (wq, wk, wv), dict(wide.named_parameters()), cot)
        for j, g in enumerate(gin):
            assert_members_close(g, [r[1][0][j] for r in ref_grads], kind="grad", what=f"grad of input {j}")
        assert list(gpar) == [name for name, _ in members[0].named_parameters()]
        for name, g in gpar.items():
            assert_members_close(g, [r[1][1][name] for r in ref_grads], kind="grad", what=f"grad of {name}")
    return out


MHA_CONFIGS = list(itertools.product([True, False], [False, True], [True, False], [False, True], [False, True]))


@pytest.mark.parametrize("batch_first,kv_dims,bias,bias_kv,zero_attn", MHA_CONFIGS,
                         ids=["-".join(f"{k}{int(v)}" for k, v in zip(("bf", "kv", "b", "bkv", "z"), c))
                              for c in MHA_CONFIGS])
def test_mha_every_option_cross_attention(batch_first, kv_dims, bias, bias_kv, zero_attn):
    rng = random.Random(hash((batch_first, kv_dims, bias, bias_kv, zero_attn)) % 1000)
    h = rng.choice([1, 2, 4])
    e = h * rng.choice([1, 2, 3])
    kd, vd = (rng.randint(1, 7), rng.randint(1, 7)) if kv_dims else (None, None)
    members = _mha_members(embed_dim=e, num_heads=h, bias=bias, add_bias_kv=bias_kv, add_zero_attn=zero_attn,
                           kdim=kd, vdim=vd, batch_first=batch_first)
    wide = wc.nn.WideMultiheadAttention.from_modules(members, strategy=rng.choice(LINEAR))
    for b in (1, rng.randint(2, 3), None):
        l, s = rng.randint(1, 5), rng.randint(1, 5)
        q = torch.randn(N, *_layout(batch_first, b, l, e))
        k = torch.randn(N, *_layout(batch_first, b, s, kd or e))
        v = torch.randn(N, *_layout(batch_first, b, s, vd or e))
        for training in (True, False):
            wide.train(training)
            for m in members:
                m.train(training)
            kw = {"need_weights": rng.random() < 0.5, "average_attn_weights": rng.random() < 0.5}
            _check_mha(wide, members, q, k, v, kw, [kw] * N)
            if not kv_dims:
                _check_mha(wide, members, q, q, q, kw, [kw] * N, same="qkv")
                _check_mha(wide, members, q, k, k, kw, [kw] * N, same="kv")


def _masks(rng, n, b, h, l, s, dtype):
    """(wide attn_mask, per-member attn_masks) for each accepted form, bool or float."""
    def make(*shape):
        m = torch.rand(*shape) < 0.3
        m[..., 0] = False  # every query sees a key (fully masked rows are tested separately)
        return m if dtype is torch.bool else torch.where(m, -1e4, torch.randn(*shape))
    bb = b or 1
    shared = make(l, s)
    per2 = make(n, l, s)
    per3 = make(n, bb * h, l, s)  # each row a member's 3-D form: [B*H, L, S] ([H, L, S] unbatched)
    return [(shared, [shared] * n), (per2, list(per2)), (per3, list(per3)),
            (per3[0].expand(n, *per3[0].shape), [per3[0]] * n)]


def _kpms(rng, n, b, s, dtype):
    def make(*shape):
        m = torch.rand(*shape) < 0.4
        m[..., 0] = False
        return m if dtype is torch.bool else torch.where(m, float("-inf"), torch.zeros(()))
    member = (b, s) if b else (s,)
    shared, per = make(*member), make(n, *member)
    return [(shared, [shared] * n), (per, list(per))]


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("dtype", [torch.bool, torch.float32], ids=["bool", "float"])
@pytest.mark.parametrize("batched", [True, False])
def test_mha_masks(batch_first, dtype, batched):
    rng = random.Random(int(batch_first) + 2 * int(batched) + 4 * (dtype is torch.bool))
    torch.manual_seed(1)
    e, h = 8, 2
    members = _mha_members(embed_dim=e, num_heads=h, batch_first=batch_first, add_bias_kv=rng.random() < 0.5,
                           add_zero_attn=rng.random() < 0.5)
    wide = wc.nn.WideMultiheadAttention.from_modules(members)
    b = 2 if batched else None
    l, s = 3, 4
    q = torch.randn(N, *_layout(batch_first, b, l, e))
    k, v = torch.randn(N, *_layout(batch_first, b, s, e)), torch.randn(N, *_layout(batch_first, b, s, e))
    cases = [(am, km) for am in [(None, [None] * N)] + _masks(rng, N, b, h, l, s, dtype)
             for km in [(None, [None] * N)] + _kpms(rng, N, b, s, dtype)]
    for (wa, ma), (wk, mk) in cases:
        for need_weights, avg in ((True, True), (True, False), (False, True)):
            kw = {"need_weights": need_weights, "average_attn_weights": avg}
            _check_mha(wide, members, q, k, v, dict(kw, attn_mask=wa, key_padding_mask=wk),
                       [dict(kw, attn_mask=a, key_padding_mask=p) for a, p in zip(ma, mk)])


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")  # float mask + bool kpm, as torch
@pytest.mark.parametrize("batch_first", [True, False])
def test_mha_is_causal(batch_first):
    e, h, l = 8, 4, 5
    members = _mha_members(embed_dim=e, num_heads=h, batch_first=batch_first)
    wide = wc.nn.WideMultiheadAttention.from_modules(members)
    x = torch.randn(N, *_layout(batch_first, 2, l, e))
    causal = nn.Transformer.generate_square_subsequent_mask(l)
    kpm = torch.zeros(2, l, dtype=torch.bool)
    kpm[1, -1] = True
    for need_weights, mask, pad in itertools.product([True, False], [causal, causal < 0], [None, kpm]):
        kw = {"attn_mask": mask, "is_causal": True, "need_weights": need_weights, "key_padding_mask": pad}
        _check_mha(wide, members, x, x, x, kw, [kw] * N, same="qkv")
        _check_mha(wide, members, x, x.flip(1), x.flip(2), kw, [kw] * N)
    with pytest.raises(RuntimeError, match="need attn_mask"):
        wide(x, x, x, is_causal=True)
    with pytest.raises(RuntimeError, match="Need attn_mask"):
        members[0](x[0], x[0], x[0], is_causal=True)


def test_mha_fully_masked_rows_and_nan_inputs():
    members = _mha_members(embed_dim=4, num_heads=2, batch_first=True)
    wide = wc.nn.WideMultiheadAttention.from_modules(members)
    x = torch.randn(N, 2, 3, 4)
    kpm = torch.zeros(N, 2, 3, dtype=torch.bool)
    kpm[1, 0] = True  # member 1, sample 0: every key masked -> NaN, as the member
    for need_weights in (True, False):
        kw = [{"key_padding_mask": kpm[i], "need_weights": need_weights} for i in range(N)]
        out = _check_mha(wide, members, x, x, x, {"key_padding_mask": kpm, "need_weights": need_weights}, kw,
                         same="qkv", grads=False, equal_nan=True)
        assert not out[0][[0, 2]].isnan().any(), "a NaN leaked into another member"
    y = x.clone()
    y[2, 1, 0, 0] = float("nan")
    out, w = wide(y, y, y)
    assert not out[:2].isnan().any() and not w[:2].isnan().any() and out[2, 1].isnan().all()


def test_mha_eval_no_grad_matches_torch_fast_path():
    members = [m.eval() for m in _mha_members(embed_dim=8, num_heads=2, batch_first=True)]
    wide = wc.nn.WideMultiheadAttention.from_modules(members)
    x = torch.randn(N, 2, 5, 8)
    kpm = torch.rand(N, 2, 5) < 0.3
    kpm[..., 0] = False
    with torch.no_grad():
        for kw in ({}, {"need_weights": False}, {"key_padding_mask": kpm, "need_weights": False}):
            ref = [m(x[i], x[i], x[i], **{k: (v[i] if k == "key_padding_mask" else v) for k, v in kw.items()})
                   for i, m in enumerate(members)]
            out = wide(x, x, x, **kw)
            assert_trees_members_close(out, ref, equal_nan=True)


def test_mha_dropout_independent_per_member_and_off_in_eval():
    torch.manual_seed(0)
    member = nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True)
    wide = wc.nn.WideMultiheadAttention.from_modules([member] * 4)  # four identical members
    x = torch.randn(1, 2, 16, 8).expand(4, 2, 16, 8)
    for need_weights in (True, False):
        out, _ = wide(x, x, x, need_weights=need_weights)
        for i in range(1, 4):
            assert not torch.allclose(out[0], out[i]), f"members 0 and {i} drew the same dropout mask"
    _, w = wide(x, x, x, average_attn_weights=False)
    assert bool(((w == 0) | (w > 0)).all()) and bool((w == 0).any())
    wide.eval()
    member.eval()
    out, w = wide(x, x, x)
    ref_out, ref_w = member(x[0], x[0], x[0])
    assert_members_close(out, [ref_out] * 4)
    assert_members_close(w, [ref_w] * 4)


def test_mha_shared_expanded_input_and_unfuse_round_trip():
    members = _mha_members(embed_dim=6, num_heads=3, kdim=2, vdim=5, add_bias_kv=True)
    wide = wc.nn.WideMultiheadAttention.from_modules(members)
    q, k, v = torch.randn(4, 2, 6), torch.randn(3, 2, 2), torch.randn(3, 2, 5)
    check_equivalence(wide, members, (q, k, v), shared=True)
    with torch.no_grad():
        for p in wide.parameters():
            p.mul_(2)
    back = wide.unfuse()
    for i, m in enumerate(back):
        assert type(m) is nn.MultiheadAttention and not m._qkv_same_embed_dim and m.kdim == 2
        for (name, p), (_, ref) in zip(m.named_parameters(), members[i].named_parameters()):
            assert torch.equal(p, ref * 2), f"member {i} {name}"
    check_equivalence(wc.nn.WideMultiheadAttention.from_modules(back), back, (q, k, v), shared=True)


def test_mha_users_modules_never_mutated():
    members = _mha_members(embed_dim=4, num_heads=2)
    before = [copy.deepcopy(m.state_dict()) for m in members]
    wide = wc.nn.WideMultiheadAttention.from_modules(members)
    x = torch.randn(N, 3, 2, 4)
    opt = torch.optim.SGD(wide.parameters(), lr=1.0)
    wide(x, x, x)[0].sum().backward()
    opt.step()
    back = wide.unfuse()
    with torch.no_grad():
        back[0].in_proj_weight.zero_()
    assert not torch.equal(wide.in_proj_weight[0], back[0].in_proj_weight)
    for m, sd in zip(members, before):
        assert all(torch.equal(m.state_dict()[k], t) for k, t in sd.items())
        assert all(p.grad is None for p in m.parameters())


def test_mha_constructor_and_repr():
    torch.manual_seed(0)
    wide = wc.nn.WideMultiheadAttention(3, 8, 2, dropout=0.1, bias=False, add_bias_kv=True, kdim=3, batch_first=True,
                                        strategy="loop", dtype=torch.float64)
    assert wide.q_proj_weight.shape == (3, 8, 8) and wide.k_proj_weight.shape == (3, 8, 3)
    assert wide.in_proj_weight is None and wide.in_proj_bias is None and wide.bias_k.shape == (3, 1, 1, 8)
    assert wide.out_proj.bias is None and wide.out_proj.weight.dtype == torch.float64
    assert not torch.equal(wide.q_proj_weight[0], wide.q_proj_weight[1])
    text = repr(wide)
    for part in ("n=3", "embed_dim=8", "num_heads=2", "bias=False", "add_bias_kv=True", "kdim=3", "'loop'"):
        assert part in text, text
    members = wide.unfuse()
    check_equivalence(wide.eval(), [m.eval() for m in members],
                      [tuple(torch.randn(2, t, f, dtype=torch.float64) for t, f in ((4, 8), (5, 3), (5, 8)))
                       for _ in range(3)],
                      dtype=torch.float64)
    with pytest.raises(ValueError, match=r"n >= 1"):
        wc.nn.WideMultiheadAttention(0, 8, 2)


@cpu_only
def test_mha_member_mismatch_errors():
    base = {"embed_dim": 8, "num_heads": 2}
    for kw, msg in [({"num_heads": 4}, r"member 1: num_heads is 4, member 0 has 2"),
                    ({"dropout": 0.2}, r"member 1: dropout is 0.2, member 0 has 0.0"),
                    ({"batch_first": True}, r"member 1: batch_first is True"),
                    ({"kdim": 3}, r"member 1: kdim is 3, member 0 has 8"),
                    ({"add_bias_kv": True}, (r"member 1: bias_k is a \[1, 1, 8\] torch.float32 tensor on cpu, "
                                             r"member 0 has None")),
                    ({"bias": False}, r"member 1: in_proj_bias is None")]:
        with pytest.raises(wc.ArchitectureMismatchError, match=msg):
            wc.nn.WideMultiheadAttention.from_modules([nn.MultiheadAttention(**base),
                                                       nn.MultiheadAttention(**{**base, **kw})])
    odd = nn.MultiheadAttention(**base)
    odd.out_proj.bias = None
    with pytest.raises(wc.ArchitectureMismatchError, match=r"member 1: out_proj.bias is None"):
        wc.nn.WideMultiheadAttention.from_modules([nn.MultiheadAttention(**base), odd])
    with pytest.raises(wc.ArchitectureMismatchError, match=r"member 1: training is False"):
        wc.nn.WideMultiheadAttention.from_modules([nn.MultiheadAttention(**base), nn.MultiheadAttention(**base).eval()])
    with pytest.raises(wc.ArchitectureMismatchError, match=r"member 0: expected MultiheadAttention, got Linear"):
        wc.nn.WideMultiheadAttention.from_modules([nn.Linear(2, 2)])


def test_mha_input_errors():
    wide = wc.nn.WideMultiheadAttention.from_modules(_mha_members(embed_dim=8, num_heads=2, kdim=3))
    q, k, v = torch.randn(N, 4, 2, 8), torch.randn(N, 5, 2, 3), torch.randn(N, 5, 2, 8)
    wide(q, k, v)
    for args, msg in [((q[:2], k[:2], v[:2]), r"N-first query \[N, L, B, E\] \(N=3 members, 8 features"),
                      ((q, k.transpose(-1, -2), v), r"N-first key \[N, L, B, E\] \(N=3 members, 3 features"),
                      ((q, k[..., :2], v), r"3 features"),
                      ((q, k, v[:, :4]), r"one sequence length"),
                      ((q, k[:, :, :1], v[:, :, :1]), r"one batch size"),
                      ((q[:, :, 0], k, v), r"N-first key \[N, L, E\]"),
                      ((q.flatten(0, 1), k, v), r"N-first query")]:
        with pytest.raises(ValueError, match=msg):
            wide(*args)
    for kw, msg in [({"attn_mask": torch.zeros(2 * 2, 4, 5)}, (r"attn_mask of shape \[4, 5\] or \[3, 4, 5\] or "
                                                               r"\[3, 1, 4, 5\] or \[3, 4, 4, 5\], got \[4, 4, 5\]")),
                    ({"attn_mask": torch.zeros(4, 6)}, r"attn_mask.*got \[4, 6\]"),
                    ({"key_padding_mask": torch.zeros(2, 5, dtype=torch.bool).T}, (r"key_padding_mask of shape "
                                                                                    r"\[2, 5\] or \[3, 2, 5\]")),
                    ({"key_padding_mask": torch.zeros(N, 5, dtype=torch.bool)}, r"got \[3, 5\]")]:
        with pytest.raises(ValueError, match=msg):
            wide(q, k, v, **kw)
    with pytest.raises(AssertionError, match="only bool and floating"):
        wide(q, k, v, attn_mask=torch.zeros(4, 5, dtype=torch.int64))


def test_non_contiguous_inputs():
    members = _mha_members(embed_dim=6, num_heads=2, kdim=4, vdim=5, batch_first=True)
    wide = wc.nn.WideMultiheadAttention.from_modules(members)
    q = torch.randn(2, 3, 6, N).permute(3, 0, 1, 2)  # [N, B, L, E], permuted
    k = torch.randn(N, 2, 10, 4)[:, :, ::2]  # strided
    v = torch.randn(N, 5, 2, 5).transpose(1, 2)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    _check_mha(wide, members, q, k, v)
    pools = [nn.AdaptiveMaxPool2d((2, 3), return_indices=True) for _ in range(N)]
    x = torch.randn(4, 5, N, 2, 3).permute(2, 3, 4, 0, 1)  # [N, B, C, H, W], strided
    check_equivalence(wc.nn.WideAdaptiveMaxPool2d.from_modules(pools), pools, x)


def test_mha_three_dim_mask_ambiguous_when_n_equals_batch_times_heads():
    """N == B*num_heads: a 3-D mask could be per member or one member's; refused, never guessed."""
    import wide_compiler as wc

    mods = [torch.nn.MultiheadAttention(8, 2, batch_first=True) for _ in range(4)]
    wide = wc.nn.WideMultiheadAttention.from_modules(mods)
    x = torch.randn(4, 2, 3, 8)  # N=4, B=2, heads=2: B*H == N
    mask = torch.rand(4, 3, 3) > 0.3
    mask[..., 0] = False  # no fully masked row
    with pytest.raises(ValueError, match=r"ambiguous.*\[N, 1, L, S\]"):
        wide(x, x, x, attn_mask=mask)
    out, _ = wide(x, x, x, attn_mask=mask[:, None])  # per member, unambiguous
    for i, m in enumerate(mods):
        torch.testing.assert_close(out[i], m(x[i], x[i], x[i], attn_mask=mask[i])[0], rtol=1e-5, atol=1e-5)
