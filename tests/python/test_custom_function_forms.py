"""A custom torch.autograd.Function in a train graph, through a wide form that applies the same
function to the wide tensor (so its own backward runs): the built-in form of transformers'
BloomGelu (Note [BLOOM's GeLU is pointwise] in wide_compiler/nn/library_forms.py) and a user's
@wide_compiler.register form, which the refusal of such a function recommends."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import wide_compiler as wc
from torch import nn
from wide_compiler.nn import library_forms
from wide_compiler.testing import check_equivalence

FAST = wc.WideConfig.fast()


def _bloom():
    return pytest.importorskip("transformers.models.bloom.modeling_bloom")


def _net(gelu_cls) -> nn.Module:
    return nn.Sequential(nn.Linear(5, 8), gelu_cls(), nn.Linear(8, 3), gelu_cls())


@pytest.fixture
def counted_backward(monkeypatch):
    """transformers' GeLUFunction.backward, counting its calls and doubling its gradient: a
    backward that is not autograd's gradient of the forward, so a wide model whose gradients are
    the members' must have run it."""
    bloom = _bloom()
    calls = []
    own = bloom.GeLUFunction.backward

    def backward(ctx, g):
        calls.append(tuple(g.shape))
        return own(ctx, g) * 2

    monkeypatch.setattr(bloom.GeLUFunction, "backward", staticmethod(backward))
    return calls


def test_bloom_gelu_trains_fused_with_its_own_backward(counted_backward):
    """Before: refused in train (the custom Function). Now: the wide form runs GeLUFunction on
    the wide tensor, once per module per backward, and every member's gradients are its own."""
    bloom = _bloom()
    torch.manual_seed(0)
    models = [_net(bloom.BloomGelu) for _ in range(3)]
    wide = wc.compile(models, torch.randn(4, 5), strict=True, config=FAST)
    assert wide._registered == ["1", "3"] and not wide.fallbacks
    x = torch.randn(3, 4, 5)
    counted_backward.clear()
    report = check_equivalence(wide, models, x)  # raises where an output or a gradient differs
    assert report["param_grad"] is not None and report["input_grad"] is not None
    # both GeLUs of the wide model, once each, on the wide tensor [N, B, C]
    assert sorted(s for s in counted_backward if len(s) == 3) == [(3, 4, 3), (3, 4, 8)], counted_backward


def test_bloom_gelu_gradients_are_the_custom_backwards_not_autograds(counted_backward):
    """The doubled backward shows in the wide gradient: autograd's gradient of the traced forward
    (what a captured train graph would compute) is half of it."""
    bloom = _bloom()
    torch.manual_seed(1)
    models = [nn.Sequential(nn.Linear(5, 8), bloom.BloomGelu()) for _ in range(2)]
    wide = wc.compile(models, torch.randn(4, 5), strict=True, config=FAST)
    x = torch.randn(2, 4, 5)
    wide(x).sum().backward()
    grad = wide.get_parameter("0.weight").grad
    for i, m in enumerate(models):
        h = m[0](x[i])
        plain = torch.autograd.grad(bloom.bloom_gelu_forward(h).sum(), m[0].weight)[0]
        torch.testing.assert_close(grad[i], 2 * plain, rtol=1e-4, atol=1e-5)


class Square(torch.autograd.Function):
    calls = 0

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        Square.calls += 1
        (x,) = ctx.saved_tensors
        return 3 * x * g  # not autograd's 2 * x * g: only this function gives it


class SquareModule(nn.Module):
    def forward(self, x):
        return Square.apply(x)


@wc.register(SquareModule)
class WideSquare(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    @classmethod
    def from_modules(cls, modules):
        return cls(len(modules))

    def forward(self, x):
        return Square.apply(x)

    def unfuse(self):
        return [SquareModule() for _ in range(self.n)]


def test_a_registered_form_with_a_custom_function_trains():
    """The refusal of a custom Function says: give its module a wide form with @register. Before,
    that form was refused too (member 0's module, run for the opaque call's output shapes during
    capture, was seen calling the Function); now the form is taken and its backward runs."""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(3, 4), SquareModule()) for _ in range(2)]
    wide = wc.compile(models, torch.randn(5, 3), config=FAST)
    x = torch.randn(2, 5, 3)
    Square.calls = 0
    wide(x).sum().backward()
    assert Square.calls == 1
    for i, m in enumerate(models):
        h = m[0](x[i])
        want = torch.autograd.grad((h * h).sum(), m[0].weight, grad_outputs=None)[0] * 1.5
        torch.testing.assert_close(wide.get_parameter("0.weight").grad[i], want, rtol=1e-5, atol=1e-6)


def test_a_custom_function_without_a_form_is_still_refused_in_train():
    class Bare(nn.Module):
        def forward(self, x):
            return Square.apply(x)

    with pytest.raises(wc.WideCompileError, match=r"custom autograd function Square"):
        wc.compile([nn.Sequential(nn.Linear(3, 4), Bare()) for _ in range(2)], torch.randn(5, 3), config=FAST)


def test_bloom_form_only_for_the_source_it_was_written_for(monkeypatch):
    """Another transformers source of BloomGelu/GeLUFunction (here: another expected hash) gets no
    form, so its train graph is refused as any custom Function is; a subclass gets none either."""
    bloom = _bloom()
    models = [_net(bloom.BloomGelu) for _ in range(2)]
    assert library_forms.library_wide_form(models[0][1]) is library_forms.WideBloomGelu
    library_forms._bloom_form_applies.cache_clear()
    monkeypatch.setattr(library_forms, "_BLOOM_SOURCE", "0" * 64)
    try:
        assert library_forms.library_wide_form(models[0][1]) is None
        with pytest.raises(wc.WideCompileError, match=r"custom autograd function GeLUFunction"):
            wc.compile(models, torch.randn(4, 5), config=FAST)
    finally:
        library_forms._bloom_form_applies.cache_clear()

    class MyGelu(bloom.BloomGelu):
        pass

    assert library_forms.library_wide_form(MyGelu()) is None


def test_bloom_form_refuses_members_with_hooks():
    bloom = _bloom()
    gelus = [bloom.BloomGelu() for _ in range(2)]
    gelus[1].register_forward_hook(lambda m, i, o: o * 2)
    with pytest.raises(TypeError, match=r"member 1's BloomGelu has hooks"):
        library_forms.WideBloomGelu.from_modules(gelus)
    with pytest.raises(TypeError, match=r"member 0 is a Linear"):
        library_forms.WideBloomGelu.from_modules([nn.Linear(2, 2)])


def test_bloom_form_unfuses_and_keeps_eval_exact():
    bloom = _bloom()
    torch.manual_seed(2)
    models = [_net(bloom.BloomGelu).eval() for _ in range(2)]
    wide = wc.compile(models, torch.randn(4, 5), strict=True, config=FAST)
    x = torch.randn(2, 4, 5)
    for i, m in enumerate(models):
        torch.testing.assert_close(wide(x)[i], m(x[i]), rtol=1e-6, atol=1e-6)
    back = wide.unfuse()
    assert [type(b[1]) for b in back] == [bloom.BloomGelu] * 2
    torch.testing.assert_close(back[1](x[1]), models[1](x[1]), rtol=1e-6, atol=1e-6)


def test_import_wide_compiler_does_not_import_transformers():
    code = ("import sys, wide_compiler, wide_compiler.registry, wide_compiler.nn.library_forms; "
            "assert 'transformers' not in sys.modules, 'transformers imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
