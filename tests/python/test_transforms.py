"""torch.func transforms through the wide ops whose CPU kernels are differentiated by C++ autograd
Functions (Note [Kernels under transforms], csrc/wide/ops/transforms.h): under grad, jvp and their
compositions the ops take their ATen composites, and the results are the plain autograd ones; and
torch.func.grad of a whole WideModel."""
from __future__ import annotations

import pytest
import torch
import wide_compiler as wc
from torch import nn
from torch.func import functional_call, grad, jvp
from support import DEVICE

W = torch.ops.wide
F64 = torch.float64


def _r(g, *shape):
    return torch.randn(*shape, generator=g, dtype=F64)


def _case(name):
    """(loss of a parameter w, w): each op at a size that takes its kernel without a transform."""
    g = torch.Generator(DEVICE).manual_seed(0)
    if name == "batch_norm":  # 25 values per (sample, channel)
        x = _r(g, 2, 3, 4, 5, 5)
        return (lambda w: W.batch_norm(x, w, None, None, None, True, 0.1, 1e-5).pow(3).sum()), _r(g, 2, 4) + 2
    if name == "layer_norm":
        x = _r(g, 2, 3, 5)
        return (lambda w: W.layer_norm(x, [5], w, None, 1e-5).pow(3).sum()), _r(g, 2, 5) + 2
    if name == "conv_loop":
        x = _r(g, 2, 2, 3, 6, 6)
        return (lambda w: W.conv(x, w, None, [1, 1], [1, 1], [1, 1], 1, strategy="loop").pow(2).sum()), _r(g, 2, 4, 3, 3, 3)
    if name == "to_channels_first":  # a channels-last input needing a gradient
        x = _r(g, 2, 4, 3, 3).contiguous(memory_format=torch.channels_last)
        return (lambda w: W.to_channels_first(x * w.view(1, 4, 1, 1)).pow(3).sum()), _r(g, 4)
    if name == "attention":
        k, v = _r(g, 2, 2, 5, 4), _r(g, 2, 2, 5, 4)
        return (lambda q: W.attention(q, k, v).pow(2).sum()), _r(g, 2, 2, 5, 4)
    if name == "rnn_loop":
        x = _r(g, 2, 3, 4, 3)
        ps = [_r(g, 2, 16, 3), _r(g, 2, 16, 4), _r(g, 2, 16), _r(g, 2, 16)]
        return (lambda w: W.rnn(x, [], [w, *ps[1:]], "LSTM", 1, False, True, 0.0, False, True, 0,
                                strategy="loop")[0].pow(2).sum()), ps[0]
    raise AssertionError(name)


CASES = ["batch_norm", "layer_norm", "conv_loop", "to_channels_first", "attention", "rnn_loop"]


@pytest.mark.parametrize("name", CASES)
def test_torch_func_grad_equals_autograd(name):
    """torch.func.grad (which refuses C++ autograd Functions) through the op equals
    torch.autograd.grad of the same loss, which takes the kernel."""
    loss, w = _case(name)
    leaf = w.clone().requires_grad_()
    (want,) = torch.autograd.grad(loss(leaf), leaf)
    torch.testing.assert_close(grad(loss)(w), want)


@pytest.mark.parametrize("name", [c for c in CASES if c not in ("attention", "rnn_loop")])
def test_hessian_vector_products(name):
    """Forward over reverse (jvp of grad, as torch.func.hessian composes them) matches central
    differences of the gradient in float64. (Attention and the LSTM are left out: ATen's CPU SDPA
    and oneDNN's LSTM have no forward derivative, for the members either.)"""
    loss, w = _case(name)
    v = torch.randn(w.shape, generator=torch.Generator(DEVICE).manual_seed(1), dtype=F64)
    _, hv = jvp(grad(loss), (w,), (v,))
    eps = 1e-6
    fd = (grad(loss)(w + eps * v) - grad(loss)(w - eps * v)) / (2 * eps)
    torch.testing.assert_close(hv, fd, rtol=1e-5, atol=1e-6)


def test_torch_func_grad_of_a_whole_wide_model():
    """torch.func.grad of a loss through a compiled WideModel (functional_call with its stacked
    parameters) equals the model's own backward. Its BatchNorm keeps no running statistics: a
    BatchNorm that updates them in place cannot run under torch.func.grad, for a plain module
    either (functorch refuses to mutate a captured buffer)."""
    torch.manual_seed(0)

    def member():
        return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4, track_running_stats=False), nn.ReLU(),
                             nn.Flatten(), nn.Linear(4 * 5 * 5, 3))
    members = [member() for _ in range(3)]
    x = torch.randn(3, 2, 3, 5, 5)
    wide = wc.compile(members, x[0], config=wc.WideConfig.fast()).train()
    params = {k: v.detach() for k, v in wide.named_parameters()}
    got = grad(lambda p: functional_call(wide, p, (x,)).pow(2).sum())(params)
    wide(x).pow(2).sum().backward()
    for name, p in wide.named_parameters():
        torch.testing.assert_close(got[name], p.grad, msg=name)
