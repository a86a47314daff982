"""The benchmark targets built on bench.vision (conv, norm, pool, embedding, models, attention,
dropout) in preset ``ci``.

No assertion depends on timing: times are checked for being finite and positive, and every wide
contender (and every baseline that ran) for matching the separate members.
"""
from __future__ import annotations

import math

import pytest
import torch
from wide_compiler import bench
from torch import nn
from torch.utils._pytree import tree_leaves
from wide_compiler import measure
from wide_compiler.bench import attention, dropout, vision
from wide_compiler.bench.vision_models import MODELS
from support import VISION_CI_TARGETS, check_design_fields

CASES = {"conv": vision.conv_cases, "norm": vision.norm_cases, "pool": vision.pool_cases,
         "embedding": vision.embedding_cases, "models": vision.model_cases,
         "attention": attention.attention_cases, "dropout": dropout.dropout_cases}
TARGETS = tuple(CASES)
assert TARGETS == VISION_CI_TARGETS  # test_bench_registry.py leaves these to this file
MAX_ERR = 1e-3
#: Cases whose every record must have every baseline measured (no errors at all) and these wide
#: contenders (hand-built module and wc.compile), per target.
STRICT = {"attention": {"mha_self": {"module:auto", "compile:auto"},
                        "mha_self_weights": {"module:auto", "compile:auto"}},
          "dropout": {"linear+dropout": {"module", "compile:auto"}},
          "models": {"transformer": {"compile:auto"},
                     "flux_double": {"module:auto", "compile:auto"},
                     "flux_single": {"module:auto", "compile:auto"}},
          "norm": {"instancenorm2d": {"module", "compile:auto"}, "rmsnorm": {"module", "compile:auto"}},
          "conv": {"convT4x4_s2": {"module:grouped", "module:loop", "compile:auto"}}}


@pytest.fixture(scope="module", params=TARGETS)
def ci_records(request, tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("WIDE_COMPILER_CACHE_DIR", str(tmp_path_factory.mktemp("wc-cache")))
    return request.param, bench.run(request.param, "ci")


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_registered():
    for t in TARGETS:
        spec = bench.TARGETS[t]
        assert set(bench.PRESET_NAMES) <= set(spec.presets)
        assert spec.formatter is vision.format_records
        for name, preset in spec.presets.items():
            jobs = spec.jobs(preset)
            cases = CASES[t](preset.grid["size"])
            assert len(jobs) == len(cases) * len(preset.grid["ns"]), (t, name)
    assert bench.TARGETS["models"].presets["full"].grid["compile_variants"] == ("auto", "fast", "loop")


def test_ci_records(ci_records):
    target, records = ci_records
    assert records, target
    cases = {c.name for c in CASES[target](bench.TARGETS[target].presets["ci"].grid["size"])}
    assert {r["case"] for r in records} == cases
    for r in records:
        what = f"{target}/{r['case']}/{r['mode']}/{r['strategy']}"
        check_design_fields(r, target, "ci")
        assert r["target"] == target and r["mode"] in measure.MODES and r["dtype"] == "float32"
        assert r["n"] == 4 and r["preset"] == "ci"
        assert not any(k.startswith("compile:") for k in r["errors"]), (what, r["errors"])
        assert math.isfinite(r["wide_ms"]) and r["wide_ms"] > 0, what
        assert r["max_abs_err"] < MAX_ERR, (what, r["max_abs_err"])
        assert "loop" in r["baseline_ms"], (what, r["errors"])
        for name, ms in r["baseline_ms"].items():
            assert math.isfinite(ms) and ms > 0, (what, name)
            assert math.isfinite(r["speedup"][name]) and r["speedup"][name] > 0
        for name, err in r["baseline_max_abs_err"].items():
            assert err < MAX_ERR, (what, name, err)
        assert set(r["baseline_ms"]) | set(r["errors"]) >= {"loop", "vmap"}, what
        if r["strategy"].startswith("compile:"):
            assert isinstance(r["strategies"], dict), what
            assert bool(r["chosen_strategy"]) == bool(r["strategies"]), what
            assert r["compile_s"] > 0
        # achieved GFLOP/s against the machine's peak (every conv; models whose FLOPs torch's
        # counter sees: not the fused inference path of nn.TransformerEncoderLayer)
        if target == "conv" or (target == "models" and r["case"] != "transformer"):
            assert r["gflop"] > 0 and r["peak_gflops"] > 0, what
            assert set(r["gflops_per_s"]) == {"wide", *r["baseline_ms"]}, what
            assert r["gflops_per_s"]["wide"] == pytest.approx(r["gflop"] / r["wide_ms"] * 1e3), what
    if target == "models":  # every model, and what `auto` chose for each of its wide ops
        assert {r["case"] for r in records} == set(MODELS)
        auto = [r for r in records if r["strategy"] == "compile:auto"]
        assert len(auto) == 2 * len(MODELS)
        for r in auto:
            assert r["strategies"] and set(r["strategies"].values()) <= {"grouped", "grouped_cl", "loop", "bmm", "bmm_t", "fused"}
            assert not r["fallbacks"], (r["case"], r["fallbacks"])
    for case, wides in STRICT.get(target, {}).items():  # the targets and cases of issue 12
        for mode in measure.MODES:
            recs = [r for r in records if r["case"] == case and r["mode"] == mode]
            assert {r["strategy"] for r in recs} == wides, (case, mode)
            for r in recs:
                assert not r["errors"], (case, mode, r["strategy"], r["errors"])
                assert set(r["baseline_ms"]) == set(r["baseline_max_abs_err"]) == {"loop", "vmap"}
    modes = {(r["case"], r["mode"]) for r in records}
    assert {m for _, m in modes} == set(measure.MODES)
    table = bench.format_records(target, records)
    assert all(r["case"] in table for r in records)
    assert ("GFLOP/s" in table) == any("gflop" in r for r in records), target


def test_vision_models_run_one_member():
    g = torch.Generator().manual_seed(0)
    for name, spec in MODELS.items():
        for size in ("tiny", "small"):
            m = spec.make(size).eval()
            with torch.no_grad():
                ys = tree_leaves(m(*spec.inputs((spec.batch[size],), size, g)))
            assert ys and all(y.shape[0] == spec.batch[size] for y in ys), (name, size)


def test_dropout_check_catches_wrong_masks():
    """The dropout target's check (each member replayed with the mask it drew) accepts the wide
    module and refuses one mask shared by all members, the wrong p and the wrong scale."""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(16, 16), nn.Dropout(dropout.P)) for _ in range(4)]
    x = torch.randn(4, 8, 4, 16)
    W, b = measure.stacked_params([m[0] for m in models])

    def masked(draw):
        def forward(xs):
            z = torch.einsum("nbti,noi->nbto", xs[0], W) + b[:, None, None]
            return z * draw(z.shape)
        return measure.Contender("bad", forward, [W, b])

    p = dropout.P
    bad = {"shared mask": masked(lambda s: (torch.rand(s[1:]) > p) / (1 - p)),
           "wrong p": masked(lambda s: (torch.rand(s) > 0.5) / 0.5),
           "wrong scale": masked(lambda s: (torch.rand(s) > p).float())}
    check = dropout.replay_check(models, (x,), "train")
    wide = measure.wide_contender("module", dropout._module(models, ""), models[0])
    assert check(wide, measure.make_step(wide, (x,), "train")()) < 1e-5
    loop = measure.loop_contender(models)
    assert check(loop, measure.make_step(loop, (x,), "train")()) < 1e-5
    for name, c in bad.items():
        assert check(c, measure.make_step(c, (x,), "train")()) > 0.1, name


@pytest.mark.parametrize("at_real_size", [False, True], ids=["toy", "real"])
def test_run_case_collects_after_each_mode_only_at_real_sizes(at_real_size, monkeypatch):
    """A full gc.collect() after each mode frees a real-size mode's copies before the next mode
    makes its own; at toy sizes it only costs a walk of the whole heap (Note [Collect after a mode
    only at real sizes] in bench/vision.py). Members of 0 bytes "at real size": a threshold of 0."""
    import types

    calls = []
    monkeypatch.setattr(vision, "gc", types.SimpleNamespace(collect=lambda *a: calls.append(a) or 0))
    if at_real_size:
        monkeypatch.setattr(vision, "COLLECT_BYTES", 0)
    case = vision.pool_cases("tiny")[0]
    records = vision.run_case(case, 2, compile_variants=(), min_run_time=0.001)
    assert {r["mode"] for r in records} == set(measure.MODES)
    assert len(calls) == (len(measure.MODES) if at_real_size else 0)


def test_baselines_chosen_on_the_command_line_replace_each_cases_own():
    """``benchmark --baselines``: the compiled loop and the compiled vmapped members (torch.compile of
    each) are timed and checked against the members like any baseline; unknown names are refused."""
    from wide_compiler.cli.parser import build_parser

    with bench.engine.with_baselines(("loop", "compile_loop", "compile_vmap")):
        records = bench.run("models", "ci", cases=["tabular N=4"])
    assert records and all(set(r["baseline_ms"]) == {"loop", "compile_loop", "compile_vmap"} for r in records), records
    for r in records:
        assert all(err < MAX_ERR for err in r["baseline_max_abs_err"].values()), r["baseline_max_abs_err"]
        assert not r["errors"], r["errors"]
    assert bench.engine.BASELINES is None
    args = build_parser().parse_args(["benchmark", "models", "--baselines", "loop, compile_vmap"])
    assert args.baselines == ("loop", "compile_vmap")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["benchmark", "models", "--baselines", "loop,jit"])


def test_the_processes_baseline_times_n_processes_and_says_why_when_it_cannot():
    """``--baselines processes``: N processes, one member each, started together; its time is in
    every record of the case (no output to compare). A case built outside a target's jobs cannot
    be rebuilt by name in the processes: recorded as an error, the other contenders timed."""
    with bench.engine.with_baselines(("loop", "processes")):
        records = bench.run("models", "ci", cases=["tabular N=4"])
        direct = vision.run_case(next(c for c in vision.model_cases("tiny") if c.name == "tabular"), 2,
                                 modes=("inference",), min_run_time=0.01)
    for r in records:
        assert r["baseline_ms"]["processes"] > 0 and r["speedup"]["processes"] > 0, r
        assert "processes" not in r["errors"], r["errors"]
    assert all("needs a case of a target's jobs" in r["errors"]["processes"] for r in direct)
    assert all(set(r["baseline_ms"]) == {"loop"} for r in direct)


def test_the_processes_baseline_refuses_more_processes_than_its_cap(monkeypatch):
    """Above MAX_PROCESSES the baseline starts nothing and says so in every record of the case
    (N=256 processes took the first GPU run's whole benchmark time)."""
    from wide_compiler.bench import processes

    started = []
    monkeypatch.setattr(processes, "MAX_PROCESSES", 3)
    monkeypatch.setattr(processes.subprocess, "Popen", lambda *a, **k: started.append(a))
    with bench.engine.with_baselines(("loop", "processes")):
        records = bench.run("models", "ci", cases=["tabular N=4"])
    assert not started
    assert records and all("more than MAX_PROCESSES=3" in r["errors"]["processes"] for r in records)
    assert all(r["baseline_ms"]["loop"] > 0 for r in records)


def test_each_job_is_handed_on_as_it_ends():
    """``bench.run(on_job=...)`` gets every job's records when it ends, in order: the CLI logs
    them and rewrites --json, so a run cut short keeps what it measured."""
    seen = []
    records = bench.run("models", "ci", cases=["tabular"], on_job=lambda recs: seen.append(list(recs)))
    assert seen and all(seen)
    assert [r["case"] for recs in seen for r in recs] == [r["case"] for r in records]
