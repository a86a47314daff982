"""Probe 10 of issue 44 (an independent re-run of the adversarial probe): each finding as a test
that failed before its fix (P10-1, a recurrent op under CPU autocast, is in test_autocast.py)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import wide_compiler as wc

FAST = wc.WideConfig.fast()


class _RoundSTE(torch.autograd.Function):
    """A straight-through estimator: rounds forward, passes the gradient through."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):
        return g


class _Quantized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 3)

    def forward(self, x):
        return _RoundSTE.apply(self.lin(x) * 4)


def test_a_backward_through_an_eval_graph_with_a_custom_function_is_refused_not_zero():
    """P10-2: the eval graph of a forward with a custom autograd Function computes the members'
    outputs, but its backward was autograd's gradient of the traced forward (a rounding STE: 0
    where the members' input gradients reach 26). The forward stays exact; the backward raises,
    naming the Function (Note [An eval graph whose backward is not the members'])."""
    members = [_Quantized().eval() for _ in range(2)]
    wide = wc.compile(copy.deepcopy(members), torch.randn(4, 5), config=FAST)
    x = torch.randn(2, 4, 5, requires_grad=True)
    out = wide(x)
    for i, m in enumerate(members):
        assert torch.equal(out[i], m(x[i]))
    with pytest.raises(RuntimeError, match=r"(?s)backward through this wide model's eval graph is refused.*_RoundSTE"):
        out.sum().backward()
    with torch.no_grad():  # no backward asked: the same values, no error
        assert torch.equal(wide(x), out.detach())
    assert wide(x.detach()).requires_grad  # the parameters still require grad: a backward is refused, not dropped


def test_an_eval_graph_without_such_code_keeps_its_backward():
    members = [nn.Sequential(nn.Linear(5, 3), nn.Tanh()).eval() for _ in range(2)]
    wide = wc.compile(copy.deepcopy(members), torch.randn(4, 5), config=FAST)
    x = torch.randn(2, 4, 5, requires_grad=True)
    wide(x).sum().backward()
    for i, m in enumerate(members):
        xi = x.detach()[i].clone().requires_grad_()
        m(xi).sum().backward()
        torch.testing.assert_close(x.grad[i], xi.grad)
