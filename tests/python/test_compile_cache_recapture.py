"""Recaptures through the compile cache (issue 45; Note [The compile cache] in
fx/compile_cache.py, Note [Dynamic sizes on demand] in model.py): the graph captured again for a
new sequence length is stored, and a later model (this process or another) that meets the same
size loads it instead of exporting; its key holds the dims made dynamic and what the recapture
takes from the graph it replaces, so each of those recompiles; a graph whose new dim export
fixes is never stored (the call's error stays)."""
from __future__ import annotations

import copy

import pytest
import torch
import wide_compiler as wc
from support import cache_entries
from torch import nn
from wide_compiler.fx import compile_cache, pipeline
from wide_compiler.fx.pipeline import Compilation

FAST = wc.WideConfig.fast()
N = 3


class Captures:
    """Counts the pipeline's captures."""

    def __init__(self, monkeypatch):
        self.count = 0
        real = pipeline.capture

        def counted(*args, **kwargs):
            self.count += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(pipeline, "capture", counted)


class Seq(nn.Module):
    """A sequence model whose sequence length (dim 1) is free: a recapture makes it dynamic."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.norm = nn.Linear(4, 6), nn.LayerNorm(6)

    def forward(self, x):
        return self.norm(self.fc(x)).mean(1)


class FixedLength(nn.Module):
    """A Linear over the sequence dim: export fixes it, a new length is refused."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        return self.fc(x.transpose(1, 2))


def _members(cls=Seq):
    torch.manual_seed(0)
    return [cls() for _ in range(N)]


def test_a_recapture_is_stored_and_a_later_model_loads_it(cache_dir, monkeypatch, caplog):
    members, sample, x = _members(), torch.randn(2, 3, 4), torch.randn(N, 2, 5, 4)
    captures = Captures(monkeypatch)
    first = wc.compile(copy.deepcopy(members), sample, config=FAST)
    want = first(x)  # a recapture: sequence length 5, captured at 3
    assert captures.count == 2 and len(cache_entries(cache_dir)) == 2  # the train graph, its recapture
    second = wc.compile(copy.deepcopy(members), sample, config=FAST)
    with caplog.at_level("INFO", logger="wide_compiler"):
        got = second(x)
    assert captures.count == 2  # neither the compile nor the recapture captured (before: 3)
    assert any("recaptured train graph loaded from the compile cache" in r.getMessage() for r in caplog.records)
    assert torch.equal(got, want)
    assert second._graph_for(True).graph_module.code == first._graph_for(True).graph_module.code
    assert "x dim 1 (since a call with size 5" in second.summary()
    x7 = torch.randn(N, 2, 7, 4)
    got7 = second(x7)  # later sizes reuse it
    for i, m in enumerate(members):
        torch.testing.assert_close(got7[i], m(x7[i]), rtol=1e-5, atol=1e-5)
    assert captures.count == 2


def test_a_loaded_recapture_computes_the_members_outputs_in_both_modes(cache_dir, monkeypatch):
    members, sample = _members(), torch.randn(2, 3, 4)
    x = torch.randn(N, 2, 6, 4)
    for training in (True, False):
        wc.compile(copy.deepcopy(members), sample, config=FAST).train(training)(x)
    captures = Captures(monkeypatch)
    for training in (True, False):
        wide = wc.compile(copy.deepcopy(members), sample, config=FAST).train(training)
        got = wide(x)
        for i, m in enumerate(members):
            torch.testing.assert_close(got[i], m.train(training)(x[i]), rtol=1e-5, atol=1e-5)
    assert captures.count == 0


def test_each_part_of_a_recaptures_key_recompiles(cache_dir, monkeypatch):
    members, sample = _members(), torch.randn(2, 3, 4)
    wc.compile(copy.deepcopy(members), sample, config=FAST)(torch.randn(N, 2, 5, 4))
    captures = Captures(monkeypatch)
    # another dim made dynamic (the batch and the sequence length together: a new dims set)
    wc.compile(copy.deepcopy(members), sample, config=FAST).eval()(torch.randn(N, 2, 5, 4))  # the eval graph
    assert captures.count == 2  # the eval graph, then its own recapture: the mode is in the key
    # the strategies the recapture keeps from the graph it replaces
    wide = wc.compile(copy.deepcopy(members), sample, config=FAST)
    like = wide._graph_for(True)
    c = Compilation(wide._capture_template[0].train(True), wide._sample, N, FAST.replace(tune=False),
                    opaque_paths={}, extra_dims={0: frozenset({1})})
    tuned = next(n for n in like.graph_module.graph.nodes if "wide_tune" in n.meta)
    key = compile_cache.key_of(c, extra=pipeline._taken_from(like))
    other = set(tuned.meta["wide_tune"].names) - {tuned.kwargs["strategy"]}
    old = tuned.kwargs["strategy"]
    tuned.update_kwarg("strategy", sorted(other)[0])
    try:
        assert compile_cache.key_of(c, extra=pipeline._taken_from(like)) != key
    finally:
        tuned.update_kwarg("strategy", old)
    assert compile_cache.key_of(c, extra=pipeline._taken_from(like)) == key
    like_tile = copy.copy(like)
    like_tile.member_tile = 2
    assert compile_cache.key_of(c, extra=pipeline._taken_from(like_tile)) != key
    # another member 0 (its weights' shapes): the first compile and the recapture miss
    other_members = [nn.Sequential() for _ in range(N)]
    for m in other_members:
        m.add_module("inner", Seq())
        m.inner.fc = nn.Linear(4, 6, bias=False)
    before = captures.count
    wc.compile(other_members, sample, config=FAST)(torch.randn(N, 2, 5, 4))
    assert captures.count == before + 2


def test_a_dim_export_fixes_is_not_stored_and_still_refused(cache_dir, monkeypatch):
    members, sample = _members(FixedLength), torch.randn(2, 3, 2)
    wide = wc.compile(copy.deepcopy(members), sample, config=FAST)
    stored = cache_entries(cache_dir)
    with pytest.raises(ValueError, match="fixed at capture"):
        wide(torch.randn(N, 2, 4, 2))
    assert cache_entries(cache_dir) == stored
    again = wc.compile(copy.deepcopy(members), sample, config=FAST)
    with pytest.raises(ValueError, match="fixed at capture"):
        again(torch.randn(N, 2, 4, 2))


def test_with_the_cache_off_a_recapture_stores_nothing(cache_dir, monkeypatch):
    monkeypatch.setenv("WIDE_COMPILE_CACHE", "0")
    wc.compile(_members(), torch.randn(2, 3, 4), config=FAST)(torch.randn(N, 2, 5, 4))
    assert cache_entries(cache_dir) == []


def _padded(widths):
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(4, h), nn.ReLU(), nn.Linear(h, 2)) for h in widths]


def test_a_padded_model_is_stored_and_other_widths_recompile(cache_dir, monkeypatch):
    """pad=True (padded.py): the padded program is the member the cache keys; the members' widths
    change it, so other widths capture again, and run their own weights."""
    sample, x = torch.randn(2, 4), torch.randn(3, 5, 4)
    wc.compile(_padded((4, 12, 8)), sample, pad=True, config=FAST)
    captures = Captures(monkeypatch)
    again = _padded((4, 12, 8))
    got = wc.compile(again, sample, pad=True, config=FAST)(x)
    assert captures.count == 0  # loaded
    for i, m in enumerate(again):
        torch.testing.assert_close(got[i], m(x[i]), rtol=1e-5, atol=1e-5)
    # a member narrower within the padded widths: the same padded program (the masks are state), a hit
    other = _padded((4, 12, 9))
    got = wc.compile(other, sample, pad=True, config=FAST)(x)
    for i, m in enumerate(other):
        torch.testing.assert_close(got[i], m(x[i]), rtol=1e-5, atol=1e-5)
    assert captures.count == 0
    wider = _padded((4, 16, 8))  # the padded widths: another program, captured again
    got = wc.compile(wider, sample, pad=True, config=FAST)(x)
    assert captures.count == 1
    for i, m in enumerate(wider):
        torch.testing.assert_close(got[i], m(x[i]), rtol=1e-5, atol=1e-5)
