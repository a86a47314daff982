"""``wide.small_attention`` (the small-sequence CPU kernel) and ``wide.attention`` (SDPA's schema;
the kernel when no gradient is wanted, SDPA otherwise) against ``F.scaled_dot_product_attention``
in float64 (opcheck: test_op_db.py); and the eval fold that routes a wide model's attention through them."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import wide_compiler as wc
from support import DEVICE, cpu_only, run_in_threads
from torch import nn
from wide_compiler.fx.eval_rewrites import attention_kernel
from wide_compiler.testing import check_compile, make_members

wide = torch.ops.wide


def _qkv(b, h, hkv, lq, lk, e, ev, dtype=torch.float32, g=None):
    q = torch.randn(b, h, lq, e, dtype=dtype, generator=g) * 2
    k = torch.randn(b, hkv, lk, e, dtype=dtype, generator=g)
    v = torch.randn(b, hkv, lk, ev, dtype=dtype, generator=g)
    return q, k, v


def _reference(q, k, v, causal=False, scale=None):
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


@pytest.mark.parametrize("seed", range(12))
def test_small_attention_random_shapes(seed):
    g = torch.Generator(DEVICE).manual_seed(seed)
    r = lambda lo, hi: int(torch.randint(lo, hi + 1, (), generator=g))  # noqa: E731
    hkv = r(1, 3)
    shape = (r(1, 3), hkv * r(1, 3), hkv, r(1, 70), r(1, 70), r(1, 72), r(1, 72))
    causal, dtype = bool(seed % 2), (torch.float32, torch.float64)[seed % 3 == 0]
    scale = None if seed % 4 else 0.25
    q, k, v = _qkv(*shape, dtype=dtype, g=g)
    got = wide.small_attention(q, k, v, causal, scale=scale)
    tol = 2e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(got.double(), _reference(q, k, v, causal, scale), atol=tol, rtol=tol,
                               msg=lambda m: f"shape {shape} causal={causal} {dtype}: {m}")
    assert got.dtype == dtype and got.shape == (*shape[:2], shape[3], shape[6])


def test_small_attention_matches_sdpa_layout_and_strided_inputs():
    qkv = torch.randn(3, 9, 3, 4, 16).permute(2, 0, 3, 1, 4)  # what a packed projection gives
    q, k, v = qkv.unbind(0)
    got = wide.small_attention(q, k, v)
    assert got.stride() == F.scaled_dot_product_attention(q, k, v).stride()  # [B, L, H, E] in memory
    assert torch.equal(got, wide.small_attention(q.contiguous(), k.contiguous(), v.contiguous()))
    kt = torch.randn(3, 4, 16, 9).transpose(2, 3)  # last dim not unit-stride: copied first
    torch.testing.assert_close(wide.small_attention(q, kt, v), wide.small_attention(q, kt.contiguous(), v))


def test_small_attention_nan_and_inputs_untouched():
    q, k, v = _qkv(4, 2, 2, 6, 6, 8, 8)
    k[2, 1, 3, 0] = float("nan")
    before = [t.clone() for t in (q, k, v)]
    out = wide.small_attention(q, k, v)
    assert out[2, 1].isnan().all() and not out[2, 0].isnan().any()
    assert not out[[0, 1, 3]].isnan().any()
    for t, b in zip((q, k, v), before):
        torch.testing.assert_close(t, b, atol=0, rtol=0, equal_nan=True)


def test_small_attention_threads_agree():
    q, k, v = _qkv(8, 4, 4, 20, 20, 16, 16)
    want = wide.small_attention(q, k, v)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(wide.small_attention(q, k, v), want)  # heads are independent: bitwise
    finally:
        torch.set_num_threads(threads)
    results = [None] * 4

    def run(i):
        results[i] = wide.small_attention(q, k, v)
    errors = run_in_threads(run, 4)
    assert not errors, errors
    assert all(torch.equal(r, want) for r in results)


def test_small_attention_errors():
    q = torch.randn(2, 4, 5, 8)
    with pytest.raises(RuntimeError, match="expected 4-d"):
        wide.small_attention(q[0], q[0], q[0])
    with pytest.raises(RuntimeError, match="must all be float32 or all float64"):
        wide.small_attention(q.half(), q.half(), q.half())
    with pytest.raises(RuntimeError, match="must agree"):
        wide.small_attention(q, torch.randn(2, 4, 5, 7), q)
    with pytest.raises(RuntimeError, match="no keys"):
        wide.small_attention(q, torch.randn(2, 4, 0, 8), torch.randn(2, 4, 0, 8))


def _kernel_ran(fn) -> bool:
    with torch.profiler.profile() as prof:
        fn()
    return any(e.name == "wide::small_attention" for e in prof.events())


@cpu_only
def test_attention_dispatch():
    q, k, v = _qkv(2, 4, 4, 5, 5, 8, 8)
    assert _kernel_ran(lambda: wide.attention(q, k, v))
    mask = torch.randn(5, 5)
    for kwargs in ({"attn_mask": mask}, {"dropout_p": 0.5}):  # SDPA's own: same result distribution
        assert not _kernel_ran(lambda: wide.attention(q, k, v, **kwargs))
    torch.testing.assert_close(wide.attention(q, k, v, mask), F.scaled_dot_product_attention(q, k, v, mask))
    long_k, long_v = torch.randn(2, 4, 600, 8), torch.randn(2, 4, 600, 8)
    assert not _kernel_ran(lambda: wide.attention(q, long_k, long_v))  # many keys: SDPA's blocked kernel
    # A gradient wanted: SDPA with its autograd, gradients as SDPA's.
    qg = q.clone().requires_grad_()
    assert not _kernel_ran(lambda: wide.attention(qg, k, v, is_causal=True))
    out = wide.attention(qg, k, v, is_causal=True)
    (gq,) = torch.autograd.grad(out.sum(), qg)
    qr = q.clone().requires_grad_()
    (gr,) = torch.autograd.grad(F.scaled_dot_product_attention(qr, k, v, is_causal=True).sum(), qr)
    torch.testing.assert_close(gq, gr)
    with torch.no_grad():
        assert _kernel_ran(lambda: wide.attention(qg, k, v))
    # Grouped-query heads only when asked for, as SDPA.
    kg, vg = torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    torch.testing.assert_close(wide.attention(q, kg, vg, enable_gqa=True),
                               F.scaled_dot_product_attention(q, kg, vg, enable_gqa=True))
    with pytest.raises(RuntimeError):
        wide.attention(q, kg, vg)


@cpu_only
def test_attention_with_a_forward_mode_tangent_is_sdpas():
    """torch.func.jvp through wide.attention: the small kernel has no forward derivative (an op
    without one hands back no tangent, silently), so a tangent sends it to SDPA, which computes
    the tangent or raises as it does for the members (torch 2.13's CPU flash kernel raises)."""
    q, k, v = _qkv(2, 4, 4, 5, 5, 8, 8)
    t = torch.randn_like(q)
    assert _kernel_ran(lambda: wide.attention(q, k, v))  # the kernel's case, without a tangent
    try:
        _, want = torch.func.jvp(lambda q: F.scaled_dot_product_attention(q, k, v), (q,), (t,))
    except NotImplementedError:
        with pytest.raises(NotImplementedError):
            torch.func.jvp(lambda q: wide.attention(q, k, v), (q,), (t,))
    else:
        _, got = torch.func.jvp(lambda q: wide.attention(q, k, v), (q,), (t,))
        torch.testing.assert_close(got, want)


# opcheck of wide.attention / wide.small_attention: test_op_db.py


class Encoder(nn.Module):
    def __init__(self, norm_first=False):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, norm_first=norm_first)

    def forward(self, x):
        return self.layer(x)


@cpu_only
@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
def test_encoder_eval_uses_the_kernel(norm_first):
    models = [m.eval() for m in make_members(lambda: Encoder(norm_first), 3)]
    x = torch.randn(3, 2, 10, 32)
    w = wc.compile(copy.deepcopy(models), x[0], config=wc.WideConfig.fast()).eval()
    with torch.no_grad():
        assert _kernel_ran(lambda: w(x))
        out = w(x)
        for i, m in enumerate(models):
            torch.testing.assert_close(out[i], m(x[i]), atol=1e-5, rtol=1e-5)
    check_compile(models, x[0], config=wc.WideConfig.fast())  # train and eval, grads included


def test_fold_leaves_masked_and_dropout_attention():
    graph = torch.fx.Graph()
    q, mask = graph.placeholder("q"), graph.placeholder("mask")
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    a = graph.call_function(sdpa, (q, q, q))
    b = graph.call_function(sdpa, (q, q, q, mask))
    c = graph.call_function(sdpa, (q, q, q), {"dropout_p": 0.3})
    graph.output((a, b, c))
    gm = torch.fx.GraphModule(nn.Module(), graph)
    assert attention_kernel(gm) == 1
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == [wide.attention.default, sdpa, sdpa]


def test_compiled_eval_encoder_fullgraph():
    models = [m.eval() for m in make_members(lambda: Encoder(), 2)]
    x = torch.randn(2, 3, 6, 32)
    w = wc.compile(copy.deepcopy(models), x[0], config=wc.WideConfig.fast()).eval()
    compiled = torch.compile(w, fullgraph=True)
    with torch.no_grad():
        out = compiled(x)
        for i, m in enumerate(models):
            torch.testing.assert_close(out[i], m(x[i]), atol=1e-5, rtol=1e-5)
