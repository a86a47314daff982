"""Note [Tuning after the first runs] (tuning.py, model_tuning.py): by default a compile measures no
strategy; the model measures a graph at a call boundary after its first runs, or at ``tune()``."""

import copy
import logging

import pytest
import torch
from torch import nn

import wide_compiler as wc
from wide_compiler import model_tuning, tuning
from support import cpu_only, steady_measuring_clock

N = 3


def _members(bn: bool = False):
    torch.manual_seed(0)
    layers = lambda: [nn.Linear(6, 12), *([nn.BatchNorm1d(12)] if bn else []), nn.ReLU(), nn.Linear(12, 3)]  # noqa: E731
    return [nn.Sequential(*layers()) for _ in range(N)]


@pytest.fixture
def measured(monkeypatch):
    """Every op measured within the budget (a fake clock), and how many candidate sets were timed."""
    steady_measuring_clock(monkeypatch)
    calls = []
    real = tuning._measure
    monkeypatch.setattr(tuning, "_measure", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _close(wide, members, x):
    out = wide(x)
    return all(torch.allclose(out[i], m(x[i]), atol=1e-5) for i, m in enumerate(members))


@cpu_only
def test_compile_measures_nothing_and_the_graph_is_measured_after_its_runs(measured, tmp_path):
    members = _members()
    wide = wc.compile(members, torch.randn(4, 6), config=wc.WideConfig(cache_dir=str(tmp_path), tune_after_runs=3))
    assert measured == [], "a compile measured strategies"
    assert "deferred: measured after the graph's first 3 runs" in wide.summary()
    x = torch.randn(N, 5, 6)
    for _ in range(2):
        assert _close(wide, members, x)
    assert measured == []
    assert _close(wide, members, x)  # the third run: measured at its start, then run
    assert measured, "the graph was not measured after its runs"
    assert "deferred" not in wide.summary() and "measured" in wide.summary()
    count = len(measured)
    for _ in range(3):
        assert _close(wide, members, x)
    assert len(measured) == count, "measured twice"


def test_tune_measures_now_and_returns_the_model(measured, tmp_path):
    members = _members()
    wide = wc.compile(members, torch.randn(4, 6), config=wc.WideConfig(cache_dir=str(tmp_path)))
    assert measured == []
    assert wide.tune() is wide and measured
    count = len(measured)
    wide.eval()  # the eval graph: compiled now, measured at tune()
    assert len(measured) == count
    wide.tune()
    assert len(measured) > count
    assert _close(wide, members, torch.randn(N, 2, 6))


def test_tune_after_runs_zero_measures_at_compile(measured, tmp_path):
    wc.compile(_members(), torch.randn(4, 6), config=wc.WideConfig(cache_dir=str(tmp_path), tune_after_runs=0))
    assert measured


@cpu_only
def test_the_measuring_run_leaves_the_callers_state_alone(measured, tmp_path):
    """Under no_grad, autocast and a seeded stream: grad mode, the random stream, the buffers, the
    parameters' gradients and the hooks on them are as if nothing had been measured."""
    members = _members(bn=True)
    wide = wc.compile(copy.deepcopy(members), torch.randn(4, 6),
                      config=wc.WideConfig(cache_dir=str(tmp_path), tune_after_runs=2))
    hooked = []
    next(wide.parameters()).register_hook(lambda g: hooked.append(1))
    x = torch.randn(N, 5, 6)
    wide(x).sum().backward()
    members_out = [m(x[i]) for i, m in enumerate(members)]
    sum(o.sum() for o in members_out).backward()
    grads = [p.grad.clone() for p in wide.parameters()]
    torch.manual_seed(7)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        out = wide(x)  # the second run: measured here
        assert not torch.is_grad_enabled()
    after = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(after, torch.rand(3)), "measuring moved the caller's random stream"
    assert measured and hooked == [1], hooked
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, wide.parameters())), "a .grad was written"
    with torch.no_grad():
        want = [m(x[i]) for i, m in enumerate(members)]  # the members' second train-mode run
    assert all(torch.allclose(out[i], want[i], atol=1e-5) for i in range(N))
    for i, m in enumerate(members):  # running statistics: two runs each, as the members'
        got = wide.member(i)
        for a, b in zip(got.buffers(), m.buffers()):
            assert torch.allclose(a, b, atol=1e-6)


@cpu_only
def test_the_tuned_graph_is_stored_for_the_next_compile(measured, cache_dir):
    config = wc.WideConfig(tune_after_runs=1)
    wide = wc.compile(_members(), torch.randn(4, 6), config=config)
    wide(torch.randn(N, 4, 6))
    assert measured
    count = len(measured)
    again = wc.compile(_members(), torch.randn(4, 6), config=config)
    text = again.summary()
    assert "compile cache" in text and "deferred" not in text, text
    assert model_tuning.pending_runs(again._graphs[True]) is None
    again(torch.randn(N, 4, 6))
    assert len(measured) == count


@cpu_only
def test_a_copy_shares_the_graphs_and_their_measuring(measured, tmp_path):
    members = _members()
    wide = wc.compile(members, torch.randn(4, 6), config=wc.WideConfig(cache_dir=str(tmp_path), tune_after_runs=2))
    twin = copy.deepcopy(wide)
    assert twin._graphs[True] is wide._graphs[True] and model_tuning.pending_runs(twin._graphs[True]) == 2
    x = torch.randn(N, 4, 6)
    assert _close(twin, members, x) and _close(wide, members, x)  # one run each: the graph's second
    assert measured and model_tuning.pending_runs(wide._graphs[True]) is None


@cpu_only
def test_a_failed_measuring_keeps_the_graph_and_is_not_retried(tmp_path, monkeypatch, caplog):
    members = _members()
    wide = wc.compile(members, torch.randn(4, 6), config=wc.WideConfig(cache_dir=str(tmp_path), tune_after_runs=1))
    before = dict(wide.strategies)

    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(tuning, "measure_strategy", broken)
    x = torch.randn(N, 4, 6)
    with caplog.at_level(logging.WARNING, logger="wide_compiler.model"):
        assert _close(wide, members, x)
    assert "measuring the strategies of the train graph failed (RuntimeError: boom)" in caplog.text
    assert model_tuning.pending_runs(wide._graphs[True]) is None and wide.strategies == before
    assert _close(wide, members, x)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_tune_after_runs_is_validated(bad):
    with pytest.raises(ValueError, match="tune_after_runs"):
        wc.WideConfig(tune_after_runs=bad)
