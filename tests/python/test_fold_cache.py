"""Note [The fold cache] (fx/fold.py): the eval graph's folded conv weights are computed once and
reused while nothing they derive from changed; every way of changing a parameter or buffer
between calls is seen, so a cached fold is never stale."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

import wide_compiler as wc
from wide_compiler import testing
from wide_compiler.fx import fold

FAST = wc.WideConfig.fast()


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6)

    def forward(self, x):
        return self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))


def _members(n=3):
    models = testing.make_members(_Net, n)
    for m in models:  # statistics and affine parameters away from their defaults
        with torch.no_grad():
            for bn in (m.bn1, m.bn2):
                bn.running_mean.uniform_(-1, 1), bn.running_var.uniform_(0.5, 2), bn.weight.uniform_(0.5, 2)
                bn.bias.uniform_(-1, 1)
    return [m.eval() for m in models]


@pytest.fixture
def counted(monkeypatch):
    """How many times the fold is computed."""
    calls = []
    real = fold.folded_conv_params

    def count(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(fold, "folded_conv_params", count)
    return calls


def _check(wide, x):
    """The wide eval output equals the members unfused from its current state (to the rounding
    of the fold: the members run conv then BatchNorm, the wide graph one folded conv)."""
    refs = [m.eval() for m in wide.unfuse()]
    x = x.to(next(wide.parameters()).dtype)
    with torch.no_grad():
        out = wide(x)
    testing.assert_members_close(out, [m(x[i]) for i, m in enumerate(refs)], rtol=1e-4, atol=1e-4)


def test_steady_inference_computes_the_fold_once(counted):
    wide = wc.compile(_members(), torch.randn(2, 3, 8, 8), config=FAST).eval()
    x = torch.randn(3, 2, 3, 8, 8)
    with torch.no_grad():
        first = wide(x)
        assert len(counted) == 2  # two folded convs
        for _ in range(3):
            torch.testing.assert_close(wide(x), first, rtol=0, atol=0)
    with torch.inference_mode():
        wide(x), wide(x)
    assert len(counted) == 4  # once more for inference mode, then reused


def _load_other_state(wide):
    state = {k: v + 0.5 if v.is_floating_point() else v for k, v in wide.state_dict().items()}
    wide.load_state_dict(state)


def _sgd_step(wide):
    wide.train()
    opt = torch.optim.SGD(wide.parameters(), lr=0.05)
    wide(torch.randn(3, 4, 3, 8, 8)).square().sum().backward()  # also moves the running stats
    opt.step()
    wide.eval()


def _wide_adam_step(wide):
    wide.train()
    opt = wc.optim.Adam(wide.parameters(), lr=[0.1, 0.2, 0.3])
    wide(torch.randn(3, 4, 3, 8, 8)).square().sum().backward()
    opt.step()
    wide.eval()


def _in_place_no_grad(wide):
    with torch.no_grad():
        wide.get_buffer("bn2.running_var").mul_(3.0)
        wide.get_parameter("conv1.weight")[1].add_(0.25)  # one member, through a view


def _to_float64(wide):
    wide.to(torch.float64)


def _copy_member_weights(wide):
    wide.copy_member_weights(0, 2)


def _assign_data(wide):
    p = wide.get_parameter("bn1.weight")
    p.data = p.data * 2  # a new storage under the same Parameter


@pytest.mark.parametrize("change", [_load_other_state, _sgd_step, _wide_adam_step, _in_place_no_grad,
                                    _to_float64, _copy_member_weights, _assign_data])
def test_a_change_between_calls_is_seen(change):
    wide = wc.compile(_members(), torch.randn(2, 3, 8, 8), config=FAST).eval()
    x = torch.randn(3, 2, 3, 8, 8)
    with torch.no_grad():
        before = wide(x)
    change(wide)
    _check(wide, x)
    with torch.no_grad():
        assert not torch.allclose(wide(x.to(next(wide.parameters()).dtype)).to(before.dtype), before)


def test_writes_that_bypass_version_counters_need_clear_caches():
    wide = wc.compile(_members(), torch.randn(2, 3, 8, 8), config=FAST).eval()
    x = torch.randn(3, 2, 3, 8, 8)
    with torch.no_grad():
        stale = wide(x)
        wide.get_parameter("conv2.weight").data.mul_(-1)
        torch.testing.assert_close(wide(x), stale)  # the documented limit
    wide.clear_caches()
    _check(wide, x)


def test_gradients_through_an_eval_graph_are_never_cached(counted):
    """With grad mode on and parameters requiring grad, the fold is recomputed and differentiable."""
    models = _members()
    wide = wc.compile(models, torch.randn(2, 3, 8, 8), config=FAST).eval()
    x = torch.randn(3, 2, 3, 8, 8, requires_grad=True)
    for _ in range(2):
        wide(x).sum().backward()
    assert len(counted) == 4
    for i, m in enumerate(models):
        m(x[i].detach()).sum().backward()
    for name, p in wide.named_parameters():
        torch.testing.assert_close(p.grad / 2, torch.stack([m.get_parameter(name).grad for m in models]),
                                   rtol=1e-4, atol=1e-4)


def test_inference_results_never_reach_a_graph_that_saves_for_backward():
    """A fold cached under inference_mode is not reused outside it (an inference tensor cannot be
    saved for backward): parameters frozen, input requiring grad."""
    wide = wc.compile(_members(), torch.randn(2, 3, 8, 8), config=FAST).eval().requires_grad_(False)
    x = torch.randn(3, 2, 3, 8, 8)
    with torch.inference_mode():
        wide(x)
    xg = x.clone().requires_grad_()
    wide(xg).sum().backward()
    assert xg.grad is not None and torch.isfinite(xg.grad).all()


def test_copies_of_a_model_never_share_folded_weights():
    import copy

    wide = wc.compile(_members(), torch.randn(2, 3, 8, 8), config=FAST).eval()
    twin = copy.deepcopy(wide)
    x = torch.randn(3, 2, 3, 8, 8)
    with torch.no_grad():
        wide(x)
        twin.get_parameter("bn2.bias").add_(1.0)
    _check(twin, x)
    _check(wide, x)


def test_threads_calling_one_model_agree():
    wide = wc.compile(_members(), torch.randn(2, 3, 8, 8), config=FAST).eval()
    x = torch.randn(3, 2, 3, 8, 8)
    with torch.no_grad():
        want = wide(x)
    fold.clear_fold_cache()

    def run():
        with torch.no_grad():
            return [wide(x) for _ in range(5)]

    with ThreadPoolExecutor(4) as pool:  # result() re-raises a thread's error
        outs = [out for f in [pool.submit(run) for _ in range(4)] for out in f.result()]
    assert len(outs) == 20
    for out in outs:
        torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_the_cache_dies_with_the_model():
    import gc

    wide = wc.compile(_members(), torch.randn(2, 3, 8, 8), config=FAST).eval()
    with torch.no_grad():
        wide(torch.randn(3, 2, 3, 8, 8))
    weight = wide.get_parameter("conv1.weight")
    assert weight in fold._FOLD_CACHE
    del wide, weight
    gc.collect()
    assert len(fold._FOLD_CACHE) == 0


def test_a_replaced_buffer_is_seen_even_at_the_same_address():
    """A new running_var tensor put in place of the old one (same shape, version 0, possibly the
    same memory once the old is freed) is a different input."""
    wide = wc.compile(_members(), torch.randn(2, 3, 8, 8), config=FAST).eval()
    x = torch.randn(3, 2, 3, 8, 8)
    with torch.no_grad():
        wide(x)
    holder = wide.get_submodule("bn1")
    holder.running_var = holder.running_var * 4  # a new tensor object
    _check(wide, x)
