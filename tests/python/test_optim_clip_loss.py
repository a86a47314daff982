"""Per-member gradient clipping and per-member losses against the same ops on each member."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import wide_compiler as wc
from torch import nn
from support import DEVICE

N = 6


def grads(seed=0):
    g = torch.Generator(DEVICE).manual_seed(seed)
    ps = [nn.Parameter(torch.zeros(N, 4, 3)), nn.Parameter(torch.zeros(N, 5))]
    scale = torch.tensor([0.01, 0.1, 1.0, 10.0, 100.0, 0.5])
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g) * scale.view(N, *([1] * (p.dim() - 1)))
    return ps


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
@pytest.mark.parametrize("max_norm", [1.0, [0.5, 1.0, 2.0, 5.0, 50.0, 0.1]])
def test_clip_grad_norm_is_per_member(norm_type, max_norm):
    ps = grads()
    members = [[nn.Parameter(torch.zeros(p.shape[1:])) for p in ps] for _ in range(N)]
    for i, mps in enumerate(members):
        for mp, p in zip(mps, ps):
            mp.grad = p.grad[i].clone()
    norms = wc.optim.clip_grad_norm_(ps, max_norm, norm_type)
    assert norms.shape == (N,)
    for i, mps in enumerate(members):
        mn = max_norm if isinstance(max_norm, float) else max_norm[i]
        ref = torch.nn.utils.clip_grad_norm_(mps, mn, norm_type)
        torch.testing.assert_close(norms[i], ref, rtol=1e-6, atol=0)
        for mp, p in zip(mps, ps):
            torch.testing.assert_close(p.grad[i], mp.grad, rtol=1e-6, atol=1e-7)
    # one norm over all N would have clipped the small members too: make sure we did not
    assert torch.equal(grads()[0].grad[0], ps[0].grad[0]) or norms[0] > (max_norm if isinstance(max_norm, float) else max_norm[0])


def test_clip_grad_norm_errors():
    ps = grads()
    ps[0].grad[2, 0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="member 2"):
        wc.optim.clip_grad_norm_(ps, 1.0, error_if_nonfinite=True)
    with pytest.raises(ValueError, match="got 2 values but there are N=6"):
        wc.optim.clip_grad_norm_(grads(), [1.0, 2.0])
    bad = grads()
    bad.append(nn.Parameter(torch.zeros(N + 1, 2)))
    bad[-1].grad = torch.zeros(N + 1, 2)
    with pytest.raises(ValueError, match="N=6"):
        wc.optim.clip_grad_norm_(bad, 1.0)


def test_clip_grad_value_per_member():
    ps = grads()
    before = [p.grad.clone() for p in ps]
    cv = [0.005, 0.05, 0.5, 5.0, 50.0, 0.25]
    wc.optim.clip_grad_value_(ps, cv)
    for p, b in zip(ps, before):
        for i in range(N):
            ref = b[i].clone()
            torch.nn.utils.clip_grad_value_([_with_grad(ref)], cv[i])
            assert torch.equal(p.grad[i], _last.grad)


_last = None


def _with_grad(g):
    global _last
    _last = nn.Parameter(torch.zeros_like(g))
    _last.grad = g
    return _last


def test_member_grad_norms():
    ps = grads()
    norms = wc.optim.member_grad_norms(ps)
    for i in range(N):
        ref = torch.linalg.vector_norm(torch.cat([p.grad[i].flatten() for p in ps]))
        torch.testing.assert_close(norms[i], ref, rtol=1e-6, atol=0)


# ------------------------------------------------------------------------------------- losses
B, C = 5, 4


def _cls_target(shared):
    return torch.randint(0, C, (B,) if shared else (N, B))


LOSSES = [
    ("cross_entropy", F.cross_entropy, {}, "class"),
    ("cross_entropy_smooth_ignore", F.cross_entropy, {"label_smoothing": 0.1, "ignore_index": 1}, "class"),
    ("cross_entropy_weight", nn.CrossEntropyLoss(weight=torch.rand(C) + 0.5), {}, "class"),
    ("cross_entropy_weight_smooth", nn.CrossEntropyLoss(weight=torch.rand(C) + 0.5, label_smoothing=0.2), {}, "class"),
    ("cross_entropy_probs", F.cross_entropy, {}, "probs"),
    ("nll", F.nll_loss, {}, "class_logp"),
    ("nll_module_weight", nn.NLLLoss(weight=torch.rand(C) + 0.5, ignore_index=0), {}, "class_logp"),
    ("mse", F.mse_loss, {}, "real"),
    ("mse_sum", nn.MSELoss(reduction="sum"), {}, "real"),
    ("l1", nn.L1Loss(), {}, "real"),
    ("huber", F.huber_loss, {"delta": 0.5}, "real"),
    ("smooth_l1", nn.SmoothL1Loss(beta=0.3), {}, "real"),
    ("bce_logits", F.binary_cross_entropy_with_logits, {}, "binary"),
    ("bce_logits_pos_weight", nn.BCEWithLogitsLoss(pos_weight=torch.rand(C) + 0.5), {}, "binary"),
    ("kl_div_generic", F.kl_div, {"reduction": "batchmean"}, "generic"),
]


def _make(kind, shared):
    x = torch.randn(N, B, C, requires_grad=True)
    if kind in ("class", "class_logp"):
        t = _cls_target(shared)
    elif kind == "probs":
        t = torch.softmax(torch.randn((B, C) if shared else (N, B, C)), -1)
    elif kind == "binary":
        t = torch.randint(0, 2, (B, C) if shared else (N, B, C)).float()
    else:
        t = torch.randn((B, C) if shared else (N, B, C))
        if kind == "generic":
            t = torch.softmax(t, -1)
    return x, t


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("name,crit,kw,kind", LOSSES, ids=[c[0] for c in LOSSES])
def test_member_losses_give_each_member_its_own_gradient(name, crit, kw, kind, shared):
    torch.manual_seed(0)
    x, t = _make(kind, shared)
    inp = torch.log_softmax(x, -1) if kind in ("class_logp", "generic") else x
    losses = wc.optim.member_losses(crit, inp, t, shared_target=shared, **kw)
    assert losses.shape == (N,)
    (g,) = torch.autograd.grad(losses.sum(), x)
    for i in range(N):
        xi = x.detach()[i].clone().requires_grad_()
        inp_i = torch.log_softmax(xi, -1) if kind in ("class_logp", "generic") else xi
        ti = t if shared else t[i]
        ref = crit(inp_i, ti, **kw)
        torch.testing.assert_close(losses[i], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} member {i}: {m}")
        (gi,) = torch.autograd.grad(ref, xi)
        torch.testing.assert_close(g[i], gi, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name} grad member {i}: {m}")


def test_member_losses_expanded_target_is_shared_and_errors():
    x = torch.randn(N, B, C)
    t = torch.randint(0, C, (B,))
    a = wc.optim.member_losses(F.cross_entropy, x, t.expand(N, B))
    b = wc.optim.member_losses(F.cross_entropy, x, t, shared_target=True)
    torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="shared_target=True"):
        wc.optim.member_losses(F.cross_entropy, x, t)
    with pytest.raises(ValueError, match="reduction"):
        wc.optim.member_losses(nn.MSELoss(reduction="none"), x, torch.randn(N, B, C))
