"""The persistent compile cache (Note [The compile cache] in fx/compile_cache.py): a cached compile
gives the fresh compile's graphs, bit for bit; every part of the key changes it; bad entries are
ignored with one warning; the switches turn it off. The suite runs with the cache off
(conftest.py); these tests turn it on, in a temporary directory."""
from __future__ import annotations

import copy
import json
import logging
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch
import wide_compiler as wc
from support import cache_entries, cpu_only
from torch import nn
from wide_compiler.fx import cache_key, compile_cache, pipeline
from wide_compiler.fx.pipeline import PASSES, Compilation, run_pipeline

FAST = wc.WideConfig.fast()


class _NoCapture:
    """Replaces the pipeline's capture: a compile that captures fails the test."""

    def __init__(self, monkeypatch):
        monkeypatch.setattr(pipeline, "capture", self)

    def __call__(self, *args, **kwargs):
        raise AssertionError("captured: the compile cache missed")


# --- models ------------------------------------------------------------------------------------
class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(4 * 4 * 4, 5)

    def forward(self, x):
        return self.fc(self.pool(self.bn(self.conv(x)).relu()).flatten(1))


class Regions(nn.Module):
    """A no_grad region (a higher-order op), a per-member fallback (linalg.det has no wide rule) and a
    lifted constant tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)

    def forward(self, x):
        y = self.fc(x)
        with torch.no_grad():
            z = y * 2
        det = torch.linalg.det(torch.stack([y[:, :2], y[:, 2:4]], 1)).unsqueeze(-1)
        return (y + z) * det + torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(4, 6, batch_first=True)
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


def _transformer():
    return nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.1, batch_first=True)


def _sweep():
    return nn.Sequential(nn.Linear(4, 8), nn.LeakyReLU(), nn.Dropout(), nn.Linear(8, 3))


def _sweep_members(n=3):
    models = [_sweep() for _ in range(n)]
    for i, m in enumerate(models):
        m[1].negative_slope, m[2].p = 0.01 * (i + 1), 0.1 * i
    return models


CASES = {
    # name: (members, one member's sample, compile keywords)
    "conv_bn": (lambda: [ConvNet() for _ in range(3)], lambda: torch.randn(2, 3, 8, 8), {}),
    "conv_bn_tiled": (lambda: [ConvNet() for _ in range(4)], lambda: torch.randn(2, 3, 8, 8),
                      {"config": FAST.replace(member_tile=2)}),
    "transformer": (lambda: [_transformer() for _ in range(3)], lambda: torch.randn(2, 5, 8), {}),
    "padded": (lambda: [nn.Sequential(nn.Linear(4, h), nn.ReLU(), nn.Linear(h, 2)) for h in (4, 12, 8)],
               lambda: torch.randn(2, 4), {"pad": True}),
    "constant_sweep": (_sweep_members, lambda: torch.randn(2, 4), {}),
    "rnn": (lambda: [Recurrent() for _ in range(3)], lambda: torch.randn(2, 5, 4), {}),
    "regions_fallback": (lambda: [Regions() for _ in range(3)], lambda: torch.randn(2, 4), {}),
}


def _run(wide, x, training):
    """Outputs, and for training the gradients of every parameter, under a fixed seed."""
    wide.train(training)
    torch.manual_seed(7)
    wide.zero_grad()
    out = wide(x)
    grads = {}
    if training:
        out.float().square().sum().backward()
        grads = {name: p.grad.clone() for name, p in wide.named_parameters() if p.grad is not None}
    return out.detach(), grads


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_cached_compile_is_the_fresh_compile_bit_for_bit(case, cache_dir, monkeypatch, caplog):
    make, sample, kwargs = CASES[case]
    torch.manual_seed(0)
    members, x1 = make(), sample()
    kwargs = {"config": FAST, **kwargs}
    x = x1.unsqueeze(0).expand(len(members), *x1.shape).contiguous() + 0.1 * torch.randn(len(members), *x1.shape)
    fresh = wc.compile(copy.deepcopy(members), x1, **kwargs)
    want = {mode: _run(fresh, x, mode) for mode in (True, False)}  # both graphs compiled (and stored)
    assert len(cache_entries(cache_dir)) == 2, case

    _NoCapture(monkeypatch)
    with caplog.at_level(logging.INFO, logger="wide_compiler.fx.pipeline"):
        cached = wc.compile(copy.deepcopy(members), x1, **kwargs)
        got = {mode: _run(cached, x, mode) for mode in (True, False)}
    assert sum("loaded from the compile cache" in r.getMessage() for r in caplog.records) == 2
    for mode in (True, False):
        out, grads = got[mode]
        assert torch.equal(out, want[mode][0]), (case, mode)
        assert grads.keys() == want[mode][1].keys()
        for name, g in grads.items():
            assert torch.equal(g, want[mode][1][name]), (case, mode, name)
        fresh.train(mode), cached.train(mode)
        assert cached.strategies == fresh.strategies
        assert cached.report() == fresh.report()  # strategies, reasons, layout conversions, fallbacks
        wf, wcached = fresh._graph_for(mode), cached._graph_for(mode)
        assert wcached.guards.describe() == wf.guards.describe()
        assert wcached.member_tile == wf.member_tile and (wcached.tiled is None) == (wf.tiled is None)
        assert wcached.constant_table == wf.constant_table
        assert wcached.graph_module.code == wf.graph_module.code
    assert cached.per_member_constants == fresh.per_member_constants
    assert {k: v.shape for k, v in cached.state_dict().items()} == {k: v.shape for k, v in fresh.state_dict().items()}


def test_a_hit_runs_no_member(cache_dir, monkeypatch):
    """The members' run check is the entry's: every member's digest is in the key (Note [The
    compile cache]); a hit runs no member."""
    members = [nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)) for _ in range(3)]
    wc.compile(members, torch.randn(2, 4), config=FAST)

    def no_run(*args, **kwargs):
        raise AssertionError("a member ran")

    monkeypatch.setattr(pipeline, "check_run_members", no_run)
    _NoCapture(monkeypatch)
    wc.compile(members, torch.randn(2, 4), config=FAST)


def test_error_messages_keep_the_source_lines(cache_dir, monkeypatch):
    """Node metadata round-trips: the fallback report names the user's line, as fresh."""
    torch.manual_seed(0)
    members = [Regions() for _ in range(2)]
    fresh = wc.compile(members, torch.randn(2, 4), config=FAST)
    _NoCapture(monkeypatch)
    cached = wc.compile(members, torch.randn(2, 4), config=FAST)
    assert cached.fallbacks == fresh.fallbacks
    assert "test_compile_cache.py" in cached.fallbacks[0]["source"]
    node = next(n for n in cached._graph_for(True).graph_module.graph.nodes if "wide_source" in n.meta
                and "test_compile_cache.py" in (n.meta.get("stack_trace") or ""))
    assert node.meta["nn_module_stack"]


def test_a_tuned_compile_round_trips_its_measurements(cache_dir, monkeypatch):
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)) for _ in range(3)]
    config = wc.WideConfig(tune_after_runs=0, tune_repeats=1, tune_budget_s=None)
    fresh = wc.compile(members, torch.randn(2, 4), config=config)
    _NoCapture(monkeypatch)
    cached = wc.compile(members, torch.randn(2, 4), config=config)
    tuning = lambda summary: next(line for line in summary.splitlines() if line.startswith("tuning:"))  # noqa: E731
    rest = lambda summary: [line for line in summary.splitlines() if not line.startswith("tuning:")]  # noqa: E731
    assert rest(cached.summary()) == rest(fresh.summary())  # timings, reasons
    assert cached._timings == fresh._timings
    # the tuning line says the measuring happened at the first compile, not now (issue 45)
    first, line = tuning(fresh.summary()), tuning(cached.summary())
    assert "measured," in first and "compile cache" not in first
    assert line.startswith("tuning: nothing measured now: the graph and its strategies came from the compile cache")
    assert str(cache_dir) in line and line.endswith(first.removeprefix("tuning: "))


def test_a_tuning_cut_short_is_not_stored(cache_dir, monkeypatch):
    """Ops left unmeasured are measured by a later compile: that graph is not stored."""
    from wide_compiler import tuning

    monkeypatch.setattr(tuning.Budget, "exhausted", lambda self, share=1.0: self.seconds is not None)
    members = [nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)) for _ in range(2)]
    wc.compile(members, torch.randn(2, 4), config=wc.WideConfig(tune_after_runs=0, tune_budget_s=1.0))
    assert cache_entries(cache_dir) == []
    wc.compile(members, torch.randn(2, 4), config=FAST)  # nothing measured: stored
    assert len(cache_entries(cache_dir)) == 1


@cpu_only
def test_a_new_process_hits(cache_dir, monkeypatch):
    """The key is the same in another process (no addresses, ids or hash seeds in it). wide_compiler's
    source digest is pinned in both: other work on the sources between the two must not miss."""
    pinned = ("0.1.0", "pinned sources", [])
    monkeypatch.setattr(cache_key, "_project_versions", lambda: pinned)
    script = textwrap.dedent("""
        import torch, wide_compiler as wc
        from wide_compiler.fx import cache_key
        cache_key._project_versions = lambda: {pinned!r}
        torch.set_num_threads({threads})
        torch.manual_seed(0)
        members = [torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)) for _ in range(3)]
        wide = wc.compile(members, torch.randn(2, 4), config=wc.WideConfig.fast())
        torch.save(wide(torch.ones(3, 2, 4)), {out!r})
    """).format(out=str(cache_dir / "out.pt"), pinned=pinned, threads=torch.get_num_threads())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=900)  # a hang guard
    assert len(cache_entries(cache_dir)) == 1
    _NoCapture(monkeypatch)
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)) for _ in range(3)]
    wide = wc.compile(members, torch.randn(2, 4), config=FAST)
    assert torch.equal(wide(torch.ones(3, 2, 4)), torch.load(cache_dir / "out.pt"))


# --- the key -----------------------------------------------------------------------------------
SCALE = 2.0


class Scaled(nn.Module):
    def __init__(self, width: int = 3) -> None:
        super().__init__()
        self.fc = nn.Linear(4, width)
        self.act = nn.LeakyReLU(0.1)

    def forward(self, x):
        return self.act(self.fc(x)) * SCALE


def _other_class():
    """A class of the same name and module whose forward differs by one constant."""
    namespace = {"nn": nn, "__name__": __name__}
    exec(textwrap.dedent("""
        class Scaled(nn.Module):
            def __init__(self, width=3):
                super().__init__()
                self.fc = nn.Linear(4, width)
                self.act = nn.LeakyReLU(0.1)

            def forward(self, x):
                return self.act(self.fc(x)) * 3.0
    """), namespace)
    return namespace["Scaled"]


def _members_of(cls, n=3):
    return [cls() for _ in range(n)]


def _key(members=None, sample=(torch.randn(2, 4),), config=FAST, **fields):
    members = members if members is not None else [Scaled() for _ in range(3)]
    c = Compilation.of_members(members, sample, config=config)
    for name, value in fields.items():
        setattr(c, name, value)
    run_pipeline(c, [p for p in PASSES if p.name == "check_members"])
    return compile_cache.key_of(c)


def _hooked():
    members = [Scaled() for _ in range(3)]
    for m in members:
        m.fc.register_forward_hook(lambda mod, args, out: out * 2)
    return _key(members)


def _constants(slopes):
    members = [Scaled() for _ in range(3)]
    for m, s in zip(members, slopes):
        m.act.negative_slope = s
    return _key(members)


def _global(monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "SCALE", 4.0)
    return _key()


def _frozen():
    members = [Scaled() for _ in range(3)]
    for m in members:
        m.fc.bias.requires_grad_(False)
    return _key(members)


CHANGES = {
    "code": lambda mp: _key(_members_of(_other_class())),
    "global read by forward": _global,
    "hook": lambda mp: _hooked(),
    "hyperparameter": lambda mp: _constants((0.2, 0.2, 0.2)),
    "per-member constants": lambda mp: _constants((0.1, 0.2, 0.1)),
    "parameter shape": lambda mp: _key([Scaled(5) for _ in range(3)]),
    "parameter dtype": lambda mp: _key([Scaled().double() for _ in range(3)],
                                       (torch.randn(2, 4, dtype=torch.float64),)),
    "requires_grad": lambda mp: _frozen(),
    "eval mode": lambda mp: _key([Scaled().eval() for _ in range(3)]),
    "input shape": lambda mp: _key(sample=(torch.randn(2, 3, 4),)),
    "input dtype": lambda mp: _key(sample=(torch.randn(2, 4, dtype=torch.float64),)),
    "input structure": lambda mp: _key(sample=((torch.randn(2, 4),),)),
    "dynamic shapes": lambda mp: _key(dynamic_shapes=({0: torch.export.Dim("b", min=2, max=64)},)),
    "dims made dynamic later": lambda mp: _key(extra_dims={0: frozenset({1})}),
    "grad mode": lambda mp: _key(grad_enabled=False),
    "n": lambda mp: _key([Scaled() for _ in range(2)]),
    "config": lambda mp: _key(config=FAST.replace(strategy="loop")),
    "member tile": lambda mp: _key(config=FAST.replace(member_tile=2)),
    "wide state dtype": lambda mp: _key(dtype=torch.float64),
    "torch version": lambda mp: (mp.setattr(torch, "__version__", "0.0.1"), _key())[1],
    "wide_compiler sources": lambda mp: (mp.setattr(cache_key, "_project_versions",
                                                    lambda: ("0.1.0", "other", [])), _key())[1],
    "processor": lambda mp: (mp.setattr(cache_key, "hardware", lambda device: "another CPU (AVX512)"), _key())[1],
    "threads": lambda mp: (mp.setattr(torch, "get_num_threads", lambda: 97), _key())[1],
}


def test_the_key_is_stable():
    assert _key() == _key() is not None


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_every_part_changes_the_key(change, monkeypatch):
    base = _key()
    assert CHANGES[change](monkeypatch) != base


SETTINGS = types.SimpleNamespace(shift=1.0)  # a plain object whose attribute a forward reads


class Shifted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        if sys.modules.get("wide_compiler") is None:  # reads the standard library: not part of the key
            raise RuntimeError("unreachable")
        return self.fc(x) + SETTINGS.shift


def test_an_attribute_of_a_global_object_is_in_the_key_and_the_standard_library_is_not(monkeypatch):
    key = _key([Shifted() for _ in range(2)])
    monkeypatch.setitem(sys.modules, "wide_compiler_test_module", types.ModuleType("wide_compiler_test_module"))
    assert _key([Shifted() for _ in range(2)]) == key  # an import elsewhere changes nothing
    monkeypatch.setattr(SETTINGS, "shift", 2.0)
    assert _key([Shifted() for _ in range(2)]) != key


def test_options_that_do_not_change_the_program_keep_the_key():
    assert _key(config=FAST.replace(validate=True, rtol=1e-3, cache_dir="/elsewhere")) == _key()


def test_a_changed_key_part_recompiles(cache_dir, monkeypatch, caplog):
    """End to end: a class whose forward differs (same name and module) is captured again, and runs
    its own code."""
    torch.manual_seed(0)
    wc.compile([Scaled() for _ in range(3)], torch.randn(2, 4), config=FAST)
    other = _members_of(_other_class())
    wide = wc.compile(other, torch.randn(2, 4), config=FAST)
    x = torch.randn(3, 2, 4)
    assert torch.allclose(wide(x)[1], other[1](x[1]), atol=1e-6)
    assert len(cache_entries(cache_dir)) == 2


def test_a_changed_global_recompiles(cache_dir, monkeypatch):
    torch.manual_seed(0)
    members = [Scaled() for _ in range(2)]
    wc.compile(members, torch.randn(2, 4), config=FAST)
    monkeypatch.setattr(sys.modules[__name__], "SCALE", 5.0)
    wide = wc.compile(members, torch.randn(2, 4), config=FAST)
    x = torch.randn(2, 2, 4)
    assert torch.allclose(wide(x)[0], members[0](x[0]), atol=1e-6)


# --- bad entries -------------------------------------------------------------------------------
def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])


def _flip(path):
    data = bytearray(path.read_bytes())
    data[-50] ^= 0xFF
    path.write_bytes(bytes(data))


def _foreign(path):
    magic, header, body = path.read_bytes().split(b"\n", 2)
    path.write_bytes(magic + b"\n" + header.replace(b'"format": 1', b'"format": 99') + b"\n" + body)


def _garbage(path):
    path.write_bytes(b"\x00not a cache file")


@pytest.mark.parametrize("damage", [_truncate, _flip, _foreign, _garbage], ids=lambda f: f.__name__[1:])
def test_a_bad_entry_is_ignored_with_one_warning_and_replaced(damage, cache_dir, monkeypatch, caplog):
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)) for _ in range(2)]
    wc.compile(members, torch.randn(2, 4), config=FAST)
    (path,) = cache_entries(cache_dir)
    damage(path)
    with caplog.at_level(logging.WARNING, logger="wide_compiler"):
        wide = wc.compile(members, torch.randn(2, 4), config=FAST)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "ignoring the compile cache entry" in warnings[0] and str(path) in warnings[0]
    x = torch.randn(2, 2, 4)
    assert torch.allclose(wide(x)[1], members[1](x[1]), atol=1e-6)
    _NoCapture(monkeypatch)  # replaced by a good entry
    wc.compile(members, torch.randn(2, 4), config=FAST)


def test_an_entry_that_does_not_fit_the_members_is_ignored(cache_dir, monkeypatch, caplog):
    """The cheap check of a loaded graph: with every key made equal, an entry for other shapes is
    refused (the stacked state differs) and the model compiled afresh."""
    monkeypatch.setattr(compile_cache, "key_of", lambda c: "0" * 64)
    wc.compile([nn.Linear(4, 3) for _ in range(2)], torch.randn(2, 4), config=FAST)
    members = [nn.Linear(4, 5) for _ in range(2)]
    with caplog.at_level(logging.WARNING, logger="wide_compiler"):
        wide = wc.compile(members, torch.randn(2, 4), config=FAST)
    assert any("weight" in r.getMessage() and "ignoring" in r.getMessage() for r in caplog.records)
    x = torch.randn(2, 2, 4)
    assert torch.allclose(wide(x)[1], members[1](x[1]), atol=1e-6)


# --- switches ----------------------------------------------------------------------------------
def test_off_by_environment_and_by_config(cache_dir, monkeypatch):
    members = [nn.Linear(4, 3) for _ in range(2)]
    wc.compile(members, torch.randn(2, 4), config=FAST.replace(compile_cache=False))
    wc.compile(members, torch.randn(2, 4), config=FAST.replace(cache=False))
    monkeypatch.setenv("WIDE_COMPILE_CACHE", "0")
    wc.compile(members, torch.randn(2, 4), config=FAST)
    assert cache_entries(cache_dir) == []


def test_the_directory_keeps_the_newestcache_entries(cache_dir, monkeypatch):
    monkeypatch.setattr(compile_cache, "MAX_ENTRIES", 2)
    for width in (3, 4, 5):
        wc.compile([nn.Linear(4, width) for _ in range(2)], torch.randn(2, 4), config=FAST)
    assert len(cache_entries(cache_dir)) == 2
    _NoCapture(monkeypatch)  # the newest is kept
    wc.compile([nn.Linear(4, 5) for _ in range(2)], torch.randn(2, 4), config=FAST)


def test_the_suite_runs_with_the_cache_off():
    """conftest.py turns it off: tests compile what they mean to compile."""
    assert not compile_cache.enabled(FAST)


def test_a_code_digest_does_not_depend_on_the_hash_seed():
    """A set literal in a forward (``mode in {"a", "b"}``: a frozenset constant) repr's in the order
    of its strings' hashes, which differ by process: the key must not (transformers' BERT missed
    in every new process)."""
    script = textwrap.dedent("""
        import json
        from wide_compiler.fx import compile_cache
        def forward(x, mode):
            return x if mode in {"absolute", "relative_key", "relative_key_query", "alibi", "rotary"} else -x
        print(json.dumps([repr(forward.__code__.co_consts), compile_cache._code_text(forward.__code__)]))
    """)
    runs = [json.loads(subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True,
                                      timeout=900, env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout)
            for seed in (1, 2)]
    # two processes suffice: these two hash seeds order the set's strings differently (checked)
    assert runs[0][0] != runs[1][0], runs
    assert runs[0][1] == runs[1][1], runs
