"""wc.nn.WideLinear: N nn.Linear layers as one module over torch.ops.wide.linear."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import wide_compiler as wc
from support import DEVICE
from torch import nn
from wide_compiler.testing import assert_close, assert_members_close

WideLinear = wc.nn.WideLinear


def linears(n, in_features=6, out_features=4, bias=True, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return [nn.Linear(in_features, out_features, bias=bias, dtype=dtype) for _ in range(n)]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("n", [1, 4])
def test_from_modules_unfuse_round_trip(n, bias):
    layers = linears(n, bias=bias)
    wide = WideLinear.from_modules(layers)
    assert (wide.n, wide.in_features, wide.out_features) == (n, 6, 4)
    assert wide.weight.shape == (n, 4, 6)
    assert (wide.bias is None) == (not bias)
    if bias:
        assert wide.bias.shape == (n, 4)
    back = wide.unfuse()
    assert len(back) == n
    for i, (orig, m) in enumerate(zip(layers, back)):
        assert type(m) is nn.Linear
        assert torch.equal(wide.weight[i], orig.weight), f"member {i} weight"
        assert torch.equal(m.weight, orig.weight), f"unfused member {i} weight"
        if bias:
            assert torch.equal(m.bias, orig.bias), f"unfused member {i} bias"
        else:
            assert m.bias is None


def test_from_modules_copies_and_unfuse_copies():
    layers = linears(3)
    snapshot = [l.weight.detach().clone() for l in layers]
    wide = WideLinear.from_modules(layers)
    with torch.no_grad():
        wide.weight.add_(1.0)
        wide.bias.add_(1.0)
    for i, l in enumerate(layers):
        assert torch.equal(l.weight, snapshot[i]), f"editing the wide module changed layer {i}"
    back = wide.unfuse()
    with torch.no_grad():
        back[0].weight.zero_()
    assert not torch.equal(wide.weight[0], back[0].weight), "unfuse returned a view, not a copy"
    with torch.no_grad():
        layers[1].weight.zero_()
    assert not torch.equal(wide.weight[1], layers[1].weight)


@pytest.mark.parametrize("strategy", ["auto", "bmm", "bmm_t", "loop"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", [(), (5,), (2, 3)], ids=["rank1", "rank2", "rank3"])
def test_forward_equals_the_linears(strategy, bias, lead):
    n = 3
    layers = linears(n, bias=bias)
    wide = WideLinear.from_modules(layers, strategy=strategy)
    assert wide.strategy == strategy
    x = torch.randn(n, *lead, 6, requires_grad=True)
    out = wide(x)
    assert out.shape == (n, *lead, 4)
    assert_members_close(out, [layers[i](x[i]) for i in range(n)])
    # Shared input.
    x1 = torch.randn(*lead, 6)
    assert_members_close(wide(x1.expand(n, *x1.shape)), [l(x1) for l in layers])
    # Gradients reach the stacked parameters, per member.
    g = torch.randn_like(out)
    (out * g).sum().backward()
    for i, layer in enumerate(layers):
        layer.zero_grad()
        (layer(x[i].detach()) * g[i]).sum().backward()
    assert_members_close(wide.weight.grad, [l.weight.grad for l in layers], kind="grad")
    if bias:
        assert_members_close(wide.bias.grad, [l.bias.grad for l in layers], kind="grad")


def test_constructor_shapes_and_init_bound_per_member():
    torch.manual_seed(0)
    n, i, o = 8, 50, 40
    wide = WideLinear(n, i, o)
    assert wide.weight.shape == (n, o, i) and wide.bias.shape == (n, o)
    assert isinstance(wide.weight, nn.Parameter) and isinstance(wide.bias, nn.Parameter)
    bound = 1 / math.sqrt(i)
    for k in range(n):
        w, b = wide.weight[k], wide.bias[k]
        assert w.abs().max() <= bound, f"member {k}: weight outside U(-{bound}, {bound})"
        assert b.abs().max() <= bound, f"member {k}: bias outside U(-{bound}, {bound})"
        # Uniform over the whole range, not a degenerate init: std of U(-a, a) is a/sqrt(3).
        assert abs(w.std().item() - bound / math.sqrt(3)) < 0.2 * bound, f"member {k} std"
        assert w.abs().max() > 0.9 * bound
    # Members are initialised independently.
    for k in range(1, n):
        assert not torch.equal(wide.weight[k], wide.weight[0])
    no_bias = WideLinear(2, 3, 5, bias=False)
    assert no_bias.bias is None
    assert "bias" not in dict(no_bias.named_parameters())


def test_reset_parameters_reinitialises():
    wide = WideLinear(3, 6, 4)
    before = wide.weight.detach().clone()
    wide.reset_parameters()
    assert not torch.equal(wide.weight, before)
    assert wide.weight.abs().max() <= 1 / math.sqrt(6)


def test_constructor_dtype_and_device():
    wide = WideLinear(2, 3, 4, dtype=torch.float64, device=DEVICE)
    assert wide.weight.dtype == torch.float64 and wide.bias.dtype == torch.float64
    assert wide.weight.device.type == DEVICE.type
    x = torch.randn(2, 5, 3, dtype=torch.float64)
    assert wide(x).dtype == torch.float64


def test_constructor_rejects_zero_members():
    with pytest.raises(ValueError, match=r"n >= 1"):
        WideLinear(0, 3, 4)


def test_from_modules_errors():
    with pytest.raises(wc.ArchitectureMismatchError, match=r"member 2: in_features is 5, member 0 "
                                                         r"has 6"):
        WideLinear.from_modules(linears(2) + [nn.Linear(5, 4)])
    with pytest.raises(wc.ArchitectureMismatchError, match=r"member 1: out_features is 3, member 0 "
                                                         r"has 4"):
        WideLinear.from_modules(linears(1) + [nn.Linear(6, 3)])
    with pytest.raises(wc.ArchitectureMismatchError, match=r"member 1: bias is False, member 0 has "
                                                         r"True"):
        WideLinear.from_modules(linears(1) + linears(1, bias=False))
    with pytest.raises(wc.ArchitectureMismatchError, match=r"member 3: expected nn\.Linear, got "
                                                         r"Conv1d"):
        WideLinear.from_modules(linears(3) + [nn.Conv1d(6, 4, 1)])
    with pytest.raises(wc.ArchitectureMismatchError, match=r"member 1: weight\.dtype"):
        WideLinear.from_modules(linears(1) + linears(1, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"at least one"):
        WideLinear.from_modules([])


def test_state_dict_round_trip():
    a = WideLinear.from_modules(linears(3, seed=0))
    b = WideLinear.from_modules(linears(3, seed=1))
    sd = a.state_dict()
    assert set(sd) == {"weight", "bias"}
    assert sd["weight"].shape == (3, 4, 6) and sd["bias"].shape == (3, 4)
    x = torch.randn(3, 2, 6)
    assert not torch.allclose(a(x), b(x))
    b.load_state_dict(sd)
    assert torch.equal(a(x), b(x))
    with pytest.raises(RuntimeError, match=r"size mismatch"):
        WideLinear.from_modules(linears(2)).load_state_dict(sd)


def test_to_float64():
    layers = linears(3)
    wide = WideLinear.from_modules(layers).to(torch.float64)
    assert wide.weight.dtype == torch.float64 and wide.bias.dtype == torch.float64
    x = torch.randn(3, 5, 6, dtype=torch.float64)
    out = wide(x)
    assert out.dtype == torch.float64
    assert_members_close(out, [l.double()(x[i]) for i, l in enumerate(layers)], torch.float64)
    unfused = wide.unfuse()
    assert all(m.weight.dtype == torch.float64 for m in unfused)


def test_sgd_step_matches_each_linear():
    layers = linears(3)
    wide = WideLinear.from_modules(layers)
    x, t = torch.randn(3, 5, 6), torch.randn(3, 5, 4)
    opt = torch.optim.SGD(wide.parameters(), lr=0.1)
    ((wide(x) - t) ** 2).mean(dim=(1, 2)).sum().backward()
    opt.step()
    for i, layer in enumerate(layers):
        opt_i = torch.optim.SGD(layer.parameters(), lr=0.1)
        F.mse_loss(layer(x[i]), t[i]).backward()
        opt_i.step()
    assert_members_close(wide.weight.detach(), [l.weight.detach() for l in layers])
    assert_members_close(wide.bias.detach(), [l.bias.detach() for l in layers])


def test_extra_repr():
    text = repr(WideLinear(3, 6, 4, bias=False, strategy="loop"))
    for part in ("n=3", "in_features=6", "out_features=4", "bias=False", "loop"):
        assert part in text, text


def test_bad_strategy_is_rejected():
    # Rejected at construction at the latest when called: never silently ignored.
    with pytest.raises((ValueError, RuntimeError), match=r"strategy"):
        wide = WideLinear(2, 3, 4, strategy="fastest")
        wide(torch.randn(2, 5, 3))


def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    layers = linears(3)
    wide = WideLinear.from_modules(layers)
    compiled = torch.compile(wide, fullgraph=True, backend="aot_eager")
    x = torch.randn(3, 5, 6)
    assert_close(compiled(x), wide(x))
