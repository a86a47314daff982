"""The command line (``python -m wide_compiler ...`` in a subprocess) and the benchmark engine.

No assertion here depends on timing: benchmark numbers are checked for being finite and
positive, never compared with each other. (The interleaved timer's own tests compare a callable
that sleeps 5 ms with one that does nothing, which no noisy machine reverses.)
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch
from torch import nn
from wide_compiler import cli
from wide_compiler.bench import engine, linear


def run_cli(*args: str, cache_dir, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, WIDE_COMPILER_CACHE_DIR=str(cache_dir))
    return subprocess.run([sys.executable, "-m", "wide_compiler", *args], env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


# ---------------------------------------------------------------------------------- subprocess

def test_info_lists_ops_and_build_info(tmp_path):
    proc = run_cli("info", cache_dir=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "wide::linear" in proc.stdout
    assert "parallel_for_threads_used" in proc.stdout
    assert torch.__version__ in proc.stdout
    assert torch.backends.cpu.get_cpu_capability() in proc.stdout


@pytest.fixture(scope="module")
def ci_run(tmp_path_factory):
    """One `benchmark linear --preset ci --json` run shared by the checks below."""
    tmp = tmp_path_factory.mktemp("bench")
    out = tmp / "nested" / "dir" / "linear.json"  # parent dirs do not exist yet
    proc = run_cli("benchmark", "linear", "--preset", "ci", "--json", str(out),
                   cache_dir=tmp / "cache")
    assert proc.returncode == 0, proc.stderr
    return proc, json.loads(out.read_text())


def test_benchmark_ci_writes_valid_records(ci_run):
    _, records = ci_run
    assert isinstance(records, list) and records
    for r in records:
        missing = set(engine.RECORD_KEYS) - set(r)
        assert not missing, f"record lacks {missing}: {r}"
        assert r["target"] == "linear" and r["preset"] == "ci"
        assert r["mode"] in ("inference", "train") and r["execution"] == "eager"
        assert math.isfinite(r["wide_ms"]) and r["wide_ms"] > 0
        assert r["errors"] == {}
        assert set(r["baseline_ms"]) >= {"loop", "vmap"}
        assert set(r["speedup"]) == set(r["baseline_ms"])
        for name, ms in r["baseline_ms"].items():
            assert math.isfinite(ms) and ms > 0, (name, ms)
            assert math.isfinite(r["speedup"][name]) and r["speedup"][name] > 0
        assert r["max_abs_err"] < 1e-4
        assert all(e < 1e-4 for e in r["baseline_max_abs_err"].values())
        m = r["machine"]
        assert m["threads"] >= 1 and m["torch"] == torch.__version__
        assert m["cpu_capability"] == torch.backends.cpu.get_cpu_capability()


def test_benchmark_ci_covers_cases(ci_run):
    _, records = ci_run
    sep = [r for r in records if r["case"] == "separate"]
    shared = [r for r in records if r["case"] == "shared"]
    assert {r["strategy"] for r in sep} == {"auto", "bmm", "bmm_t", "loop"}
    assert {r["mode"] for r in records} == {"inference", "train"}
    assert shared and all("gemm" in r["baseline_ms"] for r in shared)
    assert {r["n"] for r in sep} == {4, 16}


def test_benchmark_prints_table(ci_run):
    proc, records = ci_run
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("target"))
    for col in ("wide ms", "loop ms", "vs loop", "vmap ms", "max err"):
        assert col in lines[header]
    assert len([line for line in lines if line.startswith("linear ")]) == len(records)
    assert "wrote" in proc.stdout


def test_unknown_target_is_a_clear_error(tmp_path):
    proc = run_cli("benchmark", "conv9d", "--preset", "ci", cache_dir=tmp_path)
    assert proc.returncode == 2
    assert "conv9d" in proc.stderr and "linear" in proc.stderr


def test_benchmark_list_prints_the_registry(capsys):
    from wide_compiler import bench

    assert cli.main(["benchmark", "--list"]) == 0
    assert capsys.readouterr().out.split() == list(bench.TARGETS)  # what `make bench` runs


def test_benchmark_without_target_lists_targets(capsys):
    from wide_compiler import bench

    assert cli.main(["benchmark"]) == 0
    out = capsys.readouterr().out
    for name, t in bench.TARGETS.items():
        assert f"  {name}" in out and t.description in out
    assert "ci" in out and "quick" in out and "full" in out


def _fake_records(name, preset, progress=False):
    return [{"target": name, "case": c, "n": n, "mode": "inference", "strategy": "s", "wide_ms": 1.0,
             "baseline_ms": {"loop": x, "vmap": 2 * x}, "speedup": {"loop": x, "vmap": 2 * x}}
            for c, n, x in (("a", 4, 1.5), ("a", 16, 3.0), ("b", 4, 0.5))]


def test_benchmark_all_save_and_top(tmp_path, monkeypatch, capsys):
    """`benchmark all` runs every target; --save writes one timestamped file under bench-results/;
    --top K prints only the K records with the largest speedup over their best baseline."""
    from wide_compiler import bench

    ran = []
    monkeypatch.setattr(bench, "run", lambda name, preset, progress=False, cases=None: ran.append(name) or _fake_records(name, preset))
    monkeypatch.setattr(bench, "format_records", lambda name, recs: "\n".join(
        f"{r['target']} {r['case']} N={r['n']} x{r['speedup']['loop']}" for r in recs))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["benchmark", "all", "--preset", "ci", "--save", "--top", "1"]) == 0
    assert ran == list(bench.TARGETS)
    out = capsys.readouterr().out
    assert out.count("N=16 x3.0") == len(bench.TARGETS) and "N=4" not in out  # top 1 per target
    (saved,) = (tmp_path / "bench-results").glob("all-ci-*.json")
    assert len(json.loads(saved.read_text())) == 3 * len(bench.TARGETS)


def test_benchmark_plot_needs_matplotlib_or_draws(tmp_path, monkeypatch, capsys):
    import importlib.util

    from wide_compiler import bench

    monkeypatch.setattr(bench, "run", _fake_records)
    monkeypatch.setattr(bench, "format_records", lambda name, recs: "")
    png = tmp_path / "speedup.png"
    code = cli.main(["benchmark", "linear", "--preset", "ci", "--plot", str(png), "--quiet"])
    if importlib.util.find_spec("matplotlib") is None:
        assert code == 2 and "needs matplotlib" in capsys.readouterr().err and not png.exists()
    else:
        assert code == 0 and png.stat().st_size > 0


def test_compile_all_runs_every_contender_compiled():
    """`--compile`: engine.run_case wraps the wide contender and the baselines in torch.compile
    (the reference loop stays eager) and marks the records."""
    from wide_compiler.nn import WideLinear

    models = [torch.nn.Linear(3, 2) for _ in range(2)]
    wide = WideLinear.from_modules(models)
    contender = engine.Contender("wide", wide, list(wide.parameters()), "wide")
    x = torch.randn(2, 4, 3)
    with engine.compile_all(backend="eager"):
        (rec,) = engine.run_case(models, x, [contender], [engine.loop_contender(models)], mode="inference",
                                 base={"target": "t", "dtype": "float32"}, min_run_time=0.01, machine={})
    assert rec["execution"] == "compiled" and rec["max_abs_err"] < 1e-6 and rec["baseline_ms"]["loop"] > 0
    assert engine.COMPILE_OPTIONS is None  # restored


def test_self_test_passes(tmp_path):
    proc = run_cli("test", cache_dir=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FAIL" not in proc.stdout
    assert proc.stdout.count("PASS") >= 5


def test_parser_rejects_unknown_preset():
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(["benchmark", "linear", "--preset", "huge"])
    assert e.value.code == 2


# ---------------------------------------------------------------------------------- engine

def _population(n=3, i=5, o=4, b=2):
    torch.manual_seed(0)
    models = [nn.Linear(i, o) for _ in range(n)]
    x = torch.randn(n, b, i)
    W, bias = engine.stacked_params(models)
    return models, x, W, bias


def _wide_op(W, bias, name="bmm", strategy="bmm"):
    return engine.Contender(
        name, lambda x: torch.ops.wide.linear(x, W, bias, strategy=strategy), [W, bias])


def test_make_record_fields_and_speedup():
    r = engine.make_record(
        base={"target": "linear", "n": 4, "batch": 2, "in_features": 8, "out_features": 3,
              "dtype": "float32"},
        mode="train", strategy="loop", wide_ms=2.0, baseline_ms={"loop": 6.0, "vmap": 1.0},
        max_abs_err=1e-7, machine={"threads": 2})
    assert set(engine.RECORD_KEYS) <= set(r)
    assert r["speedup"] == {"loop": 3.0, "vmap": 0.5}
    assert r["case"] == "separate" and r["execution"] == "eager" and r["errors"] == {}
    json.dumps(r)  # JSON-able
    with pytest.raises(ValueError, match="mode"):
        engine.make_record(base={}, mode="training", strategy="bmm", wide_ms=1.0,
                           baseline_ms={}, max_abs_err=0.0, machine={})
    with pytest.raises(ValueError, match="dtype"):  # the DESIGN §10 fields are required
        engine.make_record(base={"target": "linear", "n": 4}, mode="train", strategy="bmm",
                           wide_ms=1.0, baseline_ms={}, max_abs_err=0.0, machine={})


def test_machine_info():
    m = engine.machine_info()
    assert m["threads"] == torch.get_num_threads()
    assert m["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert m["torch"] == torch.__version__


@pytest.mark.parametrize("mode", engine.MODES)
def test_max_abs_err_matches_and_detects_a_wrong_member(mode):
    models, x, W, bias = _population()
    ref = engine.loop_contender(models)
    ref_result = engine.make_step(ref, x, mode)()
    good = _wide_op(W, bias)
    err = engine.max_abs_err(ref, ref_result, good, engine.make_step(good, x, mode)(), 3, mode)
    assert err < 1e-5

    W_bad = W.detach().clone()
    W_bad[1, 0, 0] += 1.0  # member 1 is wrong
    W_bad.requires_grad_()
    bad = _wide_op(W_bad, bias)
    err = engine.max_abs_err(ref, ref_result, bad, engine.make_step(bad, x, mode)(), 3, mode)
    assert err > 0.1


def test_max_abs_err_checks_gradients():
    models, x, W, bias = _population()
    ref = engine.loop_contender(models)
    ref_result = engine.make_step(ref, x, "train")()
    # Right outputs, wrong gradient: scale the weight gradient through a custom hook.
    W2 = W.detach().clone().requires_grad_()
    W2.register_hook(lambda g: g * 2)
    c = _wide_op(W2, bias)
    err = engine.max_abs_err(ref, ref_result, c, engine.make_step(c, x, "train")(), 3, "train")
    assert err > 0.1


def test_vmap_contender_matches_loop():
    models, x, _, _ = _population()
    ref = engine.loop_contender(models)
    for shared, xx in ((False, x), (True, x[0].expand_as(x))):
        v = engine.vmap_contender(models, shared=shared)
        for mode in engine.MODES:
            ref_result = engine.make_step(ref, xx, mode)()
            err = engine.max_abs_err(ref, ref_result, v, engine.make_step(v, xx, mode)(), 3, mode)
            assert err < 1e-5, (shared, mode)


def test_run_case_records_and_failing_baseline():
    models, x, W, bias = _population()

    def broken(x):
        raise RuntimeError("baseline exploded\nsecond line")

    recs = engine.run_case(
        models, x, [_wide_op(W, bias, "bmm", "bmm"), _wide_op(W, bias, "loop", "loop")],
        [engine.loop_contender(models), engine.Contender("broken", broken, [], "members")],
        mode="train", base={"target": "linear", "batch": 2, "dtype": "float32"}, min_run_time=0.001,
        machine={"threads": 1})
    assert [r["strategy"] for r in recs] == ["bmm", "loop"]
    for r in recs:
        assert r["n"] == 3 and r["mode"] == "train"
        assert set(r["baseline_ms"]) == {"loop"}
        assert r["errors"] == {"broken": "RuntimeError: baseline exploded"}
        assert r["max_abs_err"] < 1e-4
    table = engine.format_table(recs)
    assert "broken failed: RuntimeError: baseline exploded" in table
    assert "error" in table.splitlines()[-2]


def test_wide_contender_errors_propagate():
    models, x, W, bias = _population()
    with pytest.raises(RuntimeError, match="wide::linear"):
        engine.run_case(models, x, [_wide_op(W, bias, "bad", "not-a-strategy")], [],
                        mode="inference", base={}, min_run_time=0.001, machine={})


def test_format_table_aligned_columns():
    base = {"target": "linear", "batch": 32, "in_features": 64, "out_features": 128,
            "dtype": "float32"}
    recs = [engine.make_record(base=dict(base, n=n), mode="inference", strategy=s,
                               wide_ms=ms, baseline_ms={"loop": 10 * ms, "vmap": 2 * ms},
                               max_abs_err=1e-7, machine={})
            for n, s, ms in ((4, "bmm", 0.01), (256, "loop", 1234.5))]
    lines = engine.format_table(recs, header=False).splitlines()
    assert len(lines) == 4
    header, rule = lines[0], lines[1]
    # the rule marks each column's extent; every cell stays inside its column
    starts = [i for i in range(len(rule)) if rule[i] == "-" and (i == 0 or rule[i - 1] == " ")]
    assert len(starts) == 14  # 9 fixed + 2 for each of 2 baselines + max err
    for line in [header] + lines[2:]:
        for s in starts[1:]:
            assert line[s - 1] == " " and line[s - 2] == " ", (s, line)
    assert "10.00x" not in lines[2] and "10.0x" in lines[2]


def test_linear_presets():
    assert set(linear.PRESETS) == {"ci", "quick", "full"}
    headline = linear.LinearCase(64, 32, 64, 128)
    quick = linear.PRESETS["quick"].grid
    assert headline in quick["cases"] and any(c.shared for c in quick["cases"])
    full = linear.PRESETS["full"].grid
    assert {c.n for c in full["cases"]} == {4, 16, 64, 256}
    assert {(c.in_features, c.out_features) for c in full["cases"]} == {(64, 128), (512, 1024)}
    assert full["compile_loop"] and headline in full["cases"]
    ci = linear.PRESETS["ci"].grid
    assert not ci["compile_loop"] and not ci["tuned"]
    assert max(c.n * c.in_features * c.out_features for c in ci["cases"]) <= 16 * 64 * 64
    assert len(linear.jobs(linear.PRESETS["full"])) == len(full["cases"])


def test_build_case_shared_input_is_stride0():
    models, x, (W, _) = linear.build_case(linear.LinearCase(3, 2, 8, 4, shared=True))
    assert x.stride(0) == 0 and x.shape == (3, 2, 8)
    assert torch.equal(W[2], models[2].weight) and W.requires_grad
    assert linear.LinearCase(3, 2, 8, 4, shared=True).base()["case"] == "shared"


@pytest.mark.parametrize("argv", [["-v", "test"], ["test", "-v"]])
def test_verbose_before_or_after_command(argv):
    assert cli.build_parser().parse_args(argv).verbose is True
    assert cli.build_parser().parse_args(["test"]).verbose is False


def test_contention_note():
    assert engine.contention_note({"cpu_count": 4, "load_avg": [0.5, 0.4, 0.3]}) is None
    note = engine.contention_note({"cpu_count": 2, "load_avg": [0.1, 0, 0],
                                   "load_avg_end": [3.0, 2, 1]})
    assert note and "3.0" in note and "unreliable" in note
    assert engine.contention_note({}) is None


@pytest.mark.parametrize("model", ["mlp", "convnet"])
def test_trace_prints_both_graphs_and_the_report(model, tmp_path):
    env = dict(os.environ, WIDE_COMPILER_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "wide_compiler", "trace", "-m", model, "-n", "3"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert f"captured member graph ({model})" in out.stdout and "wide graph (N=3)" in out.stdout
    assert "wide.linear.default" in out.stdout and "aten.linear.default" in out.stdout
    assert "fallbacks: 0" in out.stdout


def test_test_command_checks_a_users_model(tmp_path, capsys):
    """`test path/to/file.py:factory --shape ...` runs testing.check_compile on N members."""
    f = tmp_path / "my_model.py"
    f.write_text("import torch\n\ndef make():\n    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh())\n")
    assert cli.main(["test", f"{f}:make", "--shape", "4,5", "-n", "2"]) == 0
    out = capsys.readouterr().out
    assert "PASS  train/own" in out and "PASS  eval/shared" in out and "all 2 members match" in out
    assert cli.main(["test", f"{f}:make"]) == 2  # no shape for a user's model


# ---------------------------------------------------------------------------------- interleaved timing

class _Counted:
    """A callable that counts its calls, sleeps ``sleep_s`` each and raises from call ``fail_at`` on."""

    def __init__(self, sleep_s: float = 0.0, fail_at: int | None = None):
        self.calls, self.sleep_s, self.fail_at = 0, sleep_s, fail_at

    def __call__(self):
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at:
            raise RuntimeError(f"failed at call {self.calls}")
        if self.sleep_s:
            time.sleep(self.sleep_s)


def test_time_interleaved_one_positive_time_per_name_and_rounds_honoured():
    fns = {"a": _Counted(), "b": _Counted(), "c": _Counted()}
    ms = engine.time_interleaved(fns, min_run_time=0.003, rounds=7, warmup=2)
    assert list(ms) == ["a", "b", "c"]
    assert all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in ms.values())
    for name, f in fns.items():
        assert f.calls >= 2 + 1 + 7, (name, f.calls)  # warm-up, calibration, one block a round
    assert engine.time_interleaved({}, min_run_time=0.01) == {}
    with pytest.raises(ValueError, match="rounds"):
        engine.time_interleaved(fns, rounds=0)


def test_time_interleaved_orders_by_cost_and_rotates():
    order = []
    fns = {k: (lambda k=k, s=s: (order.append(k), time.sleep(s) if s else None))
           for k, s in (("slow", 0.005), ("fast", 0.0), ("mid", 0.0))}
    ms = engine.time_interleaved(fns, min_run_time=0.06, rounds=3, warmup=0)
    assert ms["slow"] > ms["fast"]  # a sleep of 5 ms against nothing: no machine is that noisy
    assert 1.0 < ms["slow"] < 1000.0  # milliseconds, not seconds or microseconds
    # the rounds: which callable ran first changes every round (runs of one callable = blocks)
    blocks = [k for i, k in enumerate(order) if i == 0 or order[i - 1] != k]
    timed = blocks[-9:]  # the 3 rounds of 3 blocks
    assert [timed[0], timed[3], timed[6]] == ["slow", "fast", "mid"]
    assert sorted(timed[:3]) == sorted(timed[3:6]) == sorted(timed[6:]) == ["fast", "mid", "slow"]


def test_time_interleaved_names_a_callable_that_raises():
    fns = {"ok": _Counted(), "bad": _Counted(fail_at=4)}
    with pytest.raises(engine.TimingError, match="bad: RuntimeError: failed at call 4") as e:
        engine.time_interleaved(fns, min_run_time=0.003, rounds=5)
    assert e.value.name == "bad" and isinstance(e.value.error, RuntimeError)
    assert e.value.__cause__ is e.value.error


def test_run_case_times_interleaved_and_drops_a_baseline_failing_while_timed():
    """A baseline that passes its check then fails while timed is left out (message in
    ``errors``); the wide contender and the other baselines are still timed."""
    models, x, W, bias = _population()
    calls = {"n": 0}
    loop = engine.loop_contender(models)

    def flaky(x):  # right for its first calls (the check, the warm-up), then fails
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("flaky baseline gave up")
        return loop.forward(x)

    recs = engine.run_case(
        models, x, [_wide_op(W, bias, "bmm", "bmm")],
        [engine.loop_contender(models), engine.Contender("flaky", flaky, loop.params, "members")],
        mode="inference", base={"target": "linear", "batch": 2, "dtype": "float32"},
        min_run_time=0.002, machine={})
    (r,) = recs
    assert calls["n"] > 3
    assert set(r["baseline_ms"]) == set(r["speedup"]) == {"loop"} and r["baseline_ms"]["loop"] > 0
    assert r["errors"] == {"flaky": "RuntimeError: flaky baseline gave up"}
    assert r["baseline_max_abs_err"]["flaky"] < 1e-6  # its check passed before it failed
    assert r["wide_ms"] > 0 and r["timing"] == "interleaved"


def test_run_case_wide_contender_failing_while_timed_propagates():
    models, x, W, bias = _population()
    good = _wide_op(W, bias)
    calls = {"n": 0}

    def flaky(x):
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("wide contender gave up")
        return good.forward(x)

    with pytest.raises(RuntimeError, match="wide contender gave up"):
        engine.run_case(models, x, [engine.Contender("flaky", flaky, [W, bias])],
                        [engine.loop_contender(models)], mode="inference",
                        base={"target": "linear", "dtype": "float32"}, min_run_time=0.002, machine={})


def test_time_with_baselines_keeps_wide_and_baseline_names_apart():
    """A wide callable and a baseline may share a name (e.g. strategy ``loop`` and baseline
    ``loop``): both are timed."""
    wide, base = _Counted(), _Counted()
    wide_ms, base_ms, errors = engine.time_with_baselines({"loop": wide}, {"loop": base},
                                                          min_run_time=0.002)
    assert wide_ms["loop"] > 0 and base_ms["loop"] > 0 and errors == {}
    assert wide.calls > 0 and base.calls > 0
