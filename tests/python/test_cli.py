"""The command line (``python -m wide_compiler ...`` in a subprocess) and the benchmark engine.

No assertion here depends on timing: benchmark numbers are checked for being finite and
positive, never compared with each other. (The interleaved timer's own tests compare a callable
that sleeps 5 ms with one that does nothing, which no noisy machine reverses.)
"""
from __future__ import annotations

import importlib.util
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
from wide_compiler.cli import models as cli_models
from wide_compiler.cli import progress as cli_progress
from wide_compiler import measure
from wide_compiler.measure import timing
from wide_compiler.bench import engine, linear


# ---------------------------------------------------------------------------------- subprocess

@pytest.fixture(scope="module")
def info_run(tmp_path_factory):
    """One fresh `python -m wide_compiler info` (runpy.run_module, as -m runs it, so that the
    process can then print which of the package's modules it imported), shared by the two info
    tests: (exit status, stdout before the module list, the modules)."""
    code = ("import runpy, sys\n"
            "sys.argv = ['wide_compiler', 'info']\n"
            "try:\n"
            "    runpy.run_module('wide_compiler', run_name='__main__', alter_sys=True)\n"
            "except SystemExit as e:\n"
            "    status = e.code\n"
            "print('\\nMODULES', status, *sorted(m for m in sys.modules if m.startswith('wide_compiler')))\n")
    env = dict(os.environ, WIDE_COMPILER_CACHE_DIR=str(tmp_path_factory.mktemp("info")), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=900, env=env)  # a hang guard
    assert proc.returncode == 0, proc.stderr
    out, _, modules = proc.stdout.rpartition("\nMODULES ")
    status, *names = modules.split()
    return status, out, set(names)


def test_info_lists_ops_and_build_info(info_run):
    status, out, _ = info_run
    assert status == "0", out
    assert "wide::linear" in out
    assert "parallel_for_threads_used" in out
    assert torch.__version__ in out
    assert torch.backends.cpu.get_cpu_capability() in out


@pytest.fixture(scope="module")
def ci_run(tmp_path_factory):
    """One `benchmark linear --preset ci --json` run shared by the checks below: ``cli.main`` in
    this process (the fresh-process entry point, ``python -m wide_compiler``, is info_run's; a
    fresh process here cost its imports of torch and the package); (exit status and stdout, the
    records)."""
    import contextlib
    import io
    import types

    tmp = tmp_path_factory.mktemp("bench")
    out = tmp / "nested" / "dir" / "linear.json"  # parent dirs do not exist yet
    stdout = io.StringIO()
    with pytest.MonkeyPatch.context() as env, contextlib.redirect_stdout(stdout):
        env.setenv("WIDE_COMPILER_CACHE_DIR", str(tmp / "cache"))
        status = cli.main(["benchmark", "linear", "--preset", "ci", "--json", str(out)])
    proc = types.SimpleNamespace(returncode=status, stdout=stdout.getvalue())
    assert proc.returncode == 0, proc.stdout
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


def test_unknown_target_is_a_clear_error(capsys):
    assert cli.main(["benchmark", "conv9d", "--preset", "ci"]) == 2  # the exit status of `python -m`
    err = capsys.readouterr().err
    assert "conv9d" in err and "linear" in err


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


def _fake_records(name, preset, progress=False, cases=None, on_job=None):
    records = [{"target": name, "case": c, "n": n, "mode": "inference", "strategy": "s", "wide_ms": 1.0,
                "baseline_ms": {"loop": x, "vmap": 2 * x}, "speedup": {"loop": x, "vmap": 2 * x}}
               for c, n, x in (("a", 4, 1.5), ("a", 16, 3.0), ("b", 4, 0.5))]
    for r in records:  # one job per record
        if on_job is not None:
            on_job([r])
    return records


def test_benchmark_logs_and_writes_each_job_as_it_ends(tmp_path, monkeypatch, capsys):
    """A run cut short (a GPU loan's time box) keeps what it measured: each job's records are logged
    and the --json file rewritten as the job ends."""
    from wide_compiler import bench

    def cut_after_two(name, preset, progress=False, cases=None, on_job=None):
        records = _fake_records(name, preset)
        on_job(records[:1])
        on_job(records[1:2])
        raise KeyboardInterrupt  # the time box's SIGINT
    monkeypatch.setattr(bench, "run", cut_after_two)
    out = tmp_path / "r.json"
    with pytest.raises(KeyboardInterrupt):
        cli.main(["benchmark", "linear", "--preset", "ci", "--json", str(out)])
    assert [(r["case"], r["n"]) for r in json.loads(out.read_text())] == [("a", 4), ("a", 16)]
    err = capsys.readouterr().err
    assert "  a N=4 inference s: wide 1.000 ms  loop 1.50x  vmap 3.00x" in err and "a N=16" in err


def test_benchmark_all_save_and_top(tmp_path, monkeypatch, capsys):
    """`benchmark all` runs every target; --save writes one timestamped file under bench-results/;
    --top K prints only the K records with the largest speedup over their best baseline."""
    from wide_compiler import bench

    ran = []
    monkeypatch.setattr(bench, "run", lambda name, preset, progress=False, cases=None, on_job=None:
                        ran.append(name) or _fake_records(name, preset))
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
    contender = measure.Contender("wide", wide, list(wide.parameters()), "wide")
    x = torch.randn(2, 4, 3)
    with engine.compile_all(backend="eager"):
        (rec,) = engine.run_case(models, x, [contender], [measure.loop_contender(models)], mode="inference",
                                 base={"target": "t", "dtype": "float32"}, min_run_time=0.01, machine={})
    assert rec["execution"] == "compiled" and rec["max_abs_err"] < 1e-6 and rec["baseline_ms"]["loop"] > 0
    assert engine.COMPILE_OPTIONS is None  # restored


def test_self_test_passes(capsys):
    """`test` with no model (the built-in self-test), in this process: the fresh-process entry
    point is the info and benchmark cases' (one more fresh process cost imports, not checks)."""
    code = cli.main(["test"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "FAIL" not in out
    assert out.count("PASS") >= 5


def test_parser_rejects_unknown_preset():
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(["benchmark", "linear", "--preset", "huge"])
    assert e.value.code == 2


# ---------------------------------------------------------------------------------- engine

def _population(n=3, i=5, o=4, b=2):
    torch.manual_seed(0)
    models = [nn.Linear(i, o) for _ in range(n)]
    x = torch.randn(n, b, i)
    W, bias = measure.stacked_params(models)
    return models, x, W, bias


def _wide_op(W, bias, name="bmm", strategy="bmm"):
    return measure.Contender(
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
    m = measure.machine_info()
    assert m["threads"] == torch.get_num_threads()
    assert m["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert m["torch"] == torch.__version__


@pytest.mark.parametrize("mode", measure.MODES)
def test_max_abs_err_matches_and_detects_a_wrong_member(mode):
    models, x, W, bias = _population()
    ref = measure.loop_contender(models)
    ref_result = measure.make_step(ref, x, mode)()
    good = _wide_op(W, bias)
    err = measure.max_abs_err(ref, ref_result, good, measure.make_step(good, x, mode)(), 3, mode)
    assert err < 1e-5

    W_bad = W.detach().clone()
    W_bad[1, 0, 0] += 1.0  # member 1 is wrong
    W_bad.requires_grad_()
    bad = _wide_op(W_bad, bias)
    err = measure.max_abs_err(ref, ref_result, bad, measure.make_step(bad, x, mode)(), 3, mode)
    assert err > 0.1


def test_max_abs_err_checks_gradients():
    models, x, W, bias = _population()
    ref = measure.loop_contender(models)
    ref_result = measure.make_step(ref, x, "train")()
    # Right outputs, wrong gradient: scale the weight gradient through a custom hook.
    W2 = W.detach().clone().requires_grad_()
    W2.register_hook(lambda g: g * 2)
    c = _wide_op(W2, bias)
    err = measure.max_abs_err(ref, ref_result, c, measure.make_step(c, x, "train")(), 3, "train")
    assert err > 0.1


def test_vmap_contender_matches_loop():
    models, x, _, _ = _population()
    ref = measure.loop_contender(models)
    for shared, xx in ((False, x), (True, x[0].expand_as(x))):
        v = measure.vmap_contender(models, shared=shared)
        for mode in measure.MODES:
            ref_result = measure.make_step(ref, xx, mode)()
            err = measure.max_abs_err(ref, ref_result, v, measure.make_step(v, xx, mode)(), 3, mode)
            assert err < 1e-5, (shared, mode)


def test_run_case_records_and_failing_baseline():
    models, x, W, bias = _population()

    def broken(x):
        raise RuntimeError("baseline exploded\nsecond line")

    recs = engine.run_case(
        models, x, [_wide_op(W, bias, "bmm", "bmm"), _wide_op(W, bias, "loop", "loop")],
        [measure.loop_contender(models), measure.Contender("broken", broken, [], "members")],
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
    assert measure.contention_note({"cpu_count": 4, "load_avg": [0.5, 0.4, 0.3]}) is None
    note = measure.contention_note({"cpu_count": 2, "load_avg": [0.1, 0, 0],
                                   "load_avg_end": [3.0, 2, 1]})
    assert note and "3.0" in note and "unreliable" in note
    assert measure.contention_note({}) is None
    # measured: the CPUs other processes kept busy, whatever the load average (which counts the run)
    quiet = {"cpu_count": 2, "load_avg": [1.9, 1, 0], "load_avg_end": [2.0, 1, 0], "others_load": 0.1}
    assert measure.contention_note(quiet) is None
    assert "0.8 of 2 CPUs" in measure.contention_note({**quiet, "others_load": 0.8})


def test_end_of_run_does_not_count_the_runs_own_load(monkeypatch):
    """others_load is what other processes kept busy, not the run's own CPU seconds (the load
    average would count both). The clocks are injected: a run of 2 s wall that used 1 s of CPU
    while all CPUs were busy 4 s in total leaves 1.5 CPUs to others, however busy the machine
    running the test is."""
    from types import SimpleNamespace
    from wide_compiler.measure import machine as machine_facts

    clocks = {"cpu": 10.0, "wall": 100.0, "busy": 500.0}
    monkeypatch.setattr(machine_facts, "time", SimpleNamespace(process_time=lambda: clocks["cpu"],
                                                               monotonic=lambda: clocks["wall"]))
    monkeypatch.setattr(machine_facts, "_busy_cpu_s", lambda: clocks["busy"])
    monkeypatch.setattr(machine_facts, "load_avg", lambda: [1.9, 1.8, 1.7])
    machine = measure.machine_info()
    assert machine["run_clock"] == [10.0, 100.0, 500.0]
    clocks.update(cpu=11.0, wall=102.0, busy=504.0)
    end = measure.end_of_run(machine)
    assert end["others_load"] == 1.5  # (4 busy - 1 own) / 2 wall; counting its own would say 2.0
    assert end["load_avg_end"] == [1.9, 1.8, 1.7]
    clocks.update(busy=500.5)  # less busy time than the run's own CPU (tick rounding): never negative
    assert measure.end_of_run(machine)["others_load"] == 0.0
    monkeypatch.setattr(machine_facts, "_busy_cpu_s", lambda: None)  # no /proc/stat
    assert measure.end_of_run(measure.machine_info())["others_load"] is None


@pytest.mark.parametrize("model", ["mlp", "convnet"])
def test_trace_prints_both_graphs_and_the_report(model, capsys):
    """In this process (`python -m wide_compiler` itself is run by the info, benchmark and self-test
    cases above; a fresh process here added only the imports)."""
    assert cli.main(["trace", "-m", model, "-n", "3"]) == 0
    out = capsys.readouterr().out
    assert f"captured member graph ({model})" in out and "wide graph (N=3)" in out
    assert "wide.linear.default" in out and "aten.linear.default" in out
    assert "fallbacks: 0" in out


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
    """A callable that counts its calls, takes ``sleep_s`` each and raises from call ``fail_at`` on.
    With ``clock`` (a FakeClock, support.py) it takes its time on that clock: the timings are then
    the same however busy the machine is; without, it sleeps."""

    def __init__(self, sleep_s: float = 0.0, fail_at: int | None = None, clock=None):
        self.calls, self.sleep_s, self.fail_at, self.clock = 0, sleep_s, fail_at, clock

    def __call__(self):
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at:
            raise RuntimeError(f"failed at call {self.calls}")
        if self.clock is not None:
            self.clock.t += self.sleep_s
        elif self.sleep_s:
            time.sleep(self.sleep_s)


def test_time_interleaved_one_positive_time_per_name_and_rounds_honoured(monkeypatch):
    """On a fake clock (calls of 0.1 ms): a call slowed by the machine during calibration must not
    cut the rounds (it did with the real clock: a 50 ms pause made 3 rounds of 1 call)."""
    from support import fake_clock

    clock = fake_clock(monkeypatch)
    fns = {"a": _Counted(1e-4, clock=clock), "b": _Counted(1e-4, clock=clock), "c": _Counted(2e-4, clock=clock)}
    ms = measure.time_interleaved(fns, min_run_time=0.003, rounds=7, warmup=2)
    assert list(ms) == ["a", "b", "c"]
    assert all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in ms.values())
    assert ms == pytest.approx({"a": 0.1, "b": 0.1, "c": 0.2})  # ms per call, as the clock said
    for name, f in fns.items():
        assert f.calls >= 2 + 1 + 7, (name, f.calls)  # warm-up, calibration, one block a round
    assert measure.time_interleaved({}, min_run_time=0.01) == {}
    with pytest.raises(ValueError, match="rounds"):
        measure.time_interleaved(fns, rounds=0)


def test_time_interleaved_orders_by_cost_and_rotates(monkeypatch):
    from support import fake_clock

    clock = fake_clock(monkeypatch)  # calls of 5 ms and 0.01 ms on a fake clock: no machine's noise

    def call(k: str, s: float) -> None:
        order.append(k)
        clock.t += s

    order = []
    fns = {k: (lambda k=k, s=s: call(k, s)) for k, s in (("slow", 0.005), ("fast", 1e-5), ("mid", 1e-5))}
    ms = measure.time_interleaved(fns, min_run_time=0.06, rounds=3, warmup=0)
    assert ms["slow"] > ms["fast"]
    assert ms["slow"] == pytest.approx(5.0)  # milliseconds, not seconds or microseconds
    # the rounds (runs of one callable = blocks) in the orders of Note [Interleaved timing], so
    # that no callable always follows the same one
    rounds = [k for one in timing._round_orders(list(fns), 3) for k in one]
    assert rounds == ["slow", "fast", "mid", "fast", "slow", "mid", "mid", "slow", "fast"]
    blocks = [k for i, k in enumerate(order) if i == 0 or order[i - 1] != k]
    timed = [k for i, k in enumerate(rounds) if i == 0 or rounds[i - 1] != k]  # mid, mid: one run
    assert blocks[-len(timed):] == timed
    assert {rounds[i - 1] for i in range(1, 9) if rounds[i] == "fast"} == {"slow", "mid"}


def test_time_interleaved_names_a_callable_that_raises():
    fns = {"ok": _Counted(), "bad": _Counted(fail_at=4)}
    with pytest.raises(measure.TimingError, match="bad: RuntimeError: failed at call 4") as e:
        measure.time_interleaved(fns, min_run_time=0.003, rounds=5)
    assert e.value.name == "bad" and isinstance(e.value.error, RuntimeError)
    assert e.value.__cause__ is e.value.error


def test_run_case_times_interleaved_and_drops_a_baseline_failing_while_timed():
    """A baseline that passes its check then fails while timed is left out (message in
    ``errors``); the wide contender and the other baselines are still timed."""
    models, x, W, bias = _population()
    calls = {"n": 0}
    loop = measure.loop_contender(models)

    def flaky(x):  # right for its first calls (the check, the warm-up), then fails
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("flaky baseline gave up")
        return loop.forward(x)

    recs = engine.run_case(
        models, x, [_wide_op(W, bias, "bmm", "bmm")],
        [measure.loop_contender(models), measure.Contender("flaky", flaky, loop.params, "members")],
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
        engine.run_case(models, x, [measure.Contender("flaky", flaky, [W, bias])],
                        [measure.loop_contender(models)], mode="inference",
                        base={"target": "linear", "dtype": "float32"}, min_run_time=0.002, machine={})


def test_time_with_baselines_keeps_wide_and_baseline_names_apart():
    """A wide callable and a baseline may share a name (e.g. strategy ``loop`` and baseline
    ``loop``): both are timed."""
    wide, base = _Counted(), _Counted()
    wide_ms, base_ms, errors = measure.time_with_baselines({"loop": wide}, {"loop": base},
                                                          min_run_time=0.002)
    assert wide_ms["loop"] > 0 and base_ms["loop"] > 0 and errors == {}
    assert wide.calls > 0 and base.calls > 0


# ---------------------------------------------------------------------------------- a user's model and its inputs

_USER_MODELS = '''
import torch
from torch import nn


class Bag(nn.Module):
    """Token ids in, one label per sequence out: the mean of their embeddings, then a head."""

    def __init__(self, vocab=40):
        super().__init__()
        self.embed = nn.Embedding(vocab, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, ids):
        return self.head(self.embed(ids).mean(1))


class Tagger(Bag):
    """Token ids and a mask in, one label per sequence out."""

    def __init__(self):
        super().__init__(vocab=30)
        self.proj = nn.Linear(8, 8)

    def forward(self, ids, mask):
        h = torch.relu(self.proj(self.embed(ids)))
        m = mask.unsqueeze(-1).to(h.dtype)
        return self.head((h * m).sum(1) / m.sum(1).clamp_min(1.0))


def noisy():
    """A factory (as ``make``) of a model that draws random numbers in training: dropout."""
    return nn.Sequential(nn.Linear(6, 4), nn.Dropout(0.5))


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 4)
        self.b = nn.Linear(3, 4)

    def forward(self, x, y, scale=None):
        out = self.a(x) + self.b(y)
        return out if scale is None else out * scale


def make():
    return Tagger()


def make_sample():
    return (torch.randint(0, 30, (3, 5)),), {"mask": torch.ones(3, 5, dtype=torch.bool)}


def not_a_sample():
    return 42
'''


@pytest.fixture
def user_file(tmp_path):
    f = tmp_path / "my_models.py"
    f.write_text(_USER_MODELS)
    return f


def test_test_command_embedding_model_with_integer_and_mask_inputs(user_file, capsys):
    """--input NAME:DTYPE:SHAPE: named inputs are keyword arguments; integer ids without a range
    are drawn from the vocabulary of the model's first nn.Embedding (said on stdout)."""
    assert cli.main(["test", f"{user_file}:make", "--input", "ids:int64:4,6", "--input", "mask:bool:4,6",
                     "-n", "2"]) == 0
    out = capsys.readouterr().out
    assert "values in [0, 30)" in out and "vocabulary of embed" in out
    assert "PASS  train/own" in out and "PASS  eval/shared" in out and "all 2 members match" in out
    # an explicit range and a constant mask
    assert cli.main(["test", f"{user_file}:make", "--input", "ids:long:2,3:5-10", "--input", "mask:bool:2,3:1",
                     "-n", "2"]) == 0
    assert "vocabulary" not in capsys.readouterr().out


def test_test_command_multi_input_model(user_file, capsys):
    """Unnamed inputs are positional in the order given; a named one is a keyword."""
    assert cli.main(["test", f"{user_file}:TwoInputs", "--input", "float32:5,6", "--input", "float:5,3",
                     "--input", "scale:float32:4:0.5-2", "-n", "3"]) == 0
    assert "all 3 members match" in capsys.readouterr().out


@pytest.mark.parametrize("sample", ["make_sample", "{file}:make_sample"])
def test_test_command_sample_factory(user_file, capsys, sample):
    """--sample FUNC (in the model's file) or FILE.py:FUNC returning (args, kwargs)."""
    assert cli.main(["test", f"{user_file}:make", "--sample", sample.format(file=user_file), "-n", "2"]) == 0
    assert "all 2 members match" in capsys.readouterr().out


@pytest.mark.parametrize("argv, says", [
    (["--sample", "not_a_sample"], "returned a int"),
    (["--sample", "nope"], "has no 'nope'"),
    ([], "give one member's input"),
])
def test_test_command_bad_sample_is_a_clear_error(user_file, capsys, argv, says):
    assert cli.main(["test", f"{user_file}:make", *argv]) == 2
    assert says in capsys.readouterr().err


def test_missing_model_file_is_a_clear_error(tmp_path, capsys):
    assert cli.main(["test", f"{tmp_path}/absent.py:make", "--shape", "2,3"]) == 2
    assert "absent.py" in capsys.readouterr().err
    assert cli.main(["test", "--input", "ids:int64:4"]) == 2  # an input without a model
    assert "give the model too" in capsys.readouterr().err


def test_analyze_embedding_model_progress_and_plot(user_file, tmp_path, capsys, monkeypatch):
    """analyze takes integer and mask inputs; progress is one line per stage off a terminal
    (CI=true), no bar redraws; --plot draws the speedup against N."""
    monkeypatch.setenv("CI", "true")
    png = tmp_path / "speedup.png"
    plot = ["--plot", str(png)] if importlib.util.find_spec("matplotlib") else []
    assert cli.main(["analyze", f"{user_file}:make", "--input", "ids:int64:3,5", "--input", "mask:bool:3,5:1",
                     "-n", "2", "--modes", "inference", "--repeats", "1", "--memory", "50MB", *plot]) == 0
    captured = capsys.readouterr()
    assert "one member's input ids=int64[3, 5], mask=bool[3, 5]" in captured.out
    assert "Recommendations" in captured.out
    assert "[1/" in captured.err and "compile N=2" in captured.err and "done in" in captured.err
    assert "\r" not in captured.err and "%|" not in captured.err
    if plot:
        assert png.stat().st_size > 0


class _FakeReport:
    def __str__(self):
        return "fake report"


def _fake_analyze(factory, sample, *, progress=None, **kwargs):
    if progress is not None:  # None with -q
        for i, stage in enumerate(["compile N=2", "time N=2 inference"]):
            progress(stage, i, 2)
        progress("done", 2, 2)
    return _FakeReport()


@pytest.mark.parametrize("interactive", [True, False])
def test_analyze_progress_bar_only_on_a_terminal(monkeypatch, capsys, interactive):
    analyze_mod = importlib.import_module("wide_compiler.analyze")

    monkeypatch.setattr(analyze_mod, "analyze", _fake_analyze)
    monkeypatch.setattr(cli_progress, "interactive", lambda stream=None: interactive)
    assert cli.main(["analyze", "mlp", "-n", "2"]) == 0
    captured = capsys.readouterr()
    assert "fake report" in captured.out
    if interactive:  # tqdm's bar, on stderr
        assert "stage" in captured.err and "[1/" not in captured.err
    else:
        assert "analyze mlp [1/2] compile N=2" in captured.err and "[2/2] time N=2 inference" in captured.err
    assert cli.main(["analyze", "mlp", "-n", "2", "-q"]) == 0
    assert capsys.readouterr().err == ""


def test_interactive_respects_ci(monkeypatch):
    class Tty:
        def isatty(self):
            return True

    monkeypatch.delenv("CI", raising=False)
    assert cli_progress.interactive(Tty())
    monkeypatch.setenv("CI", "true")
    assert not cli_progress.interactive(Tty())
    monkeypatch.setenv("CI", "false")
    assert cli_progress.interactive(Tty())
    assert not cli_progress.interactive(open(os.devnull, "w"))


def test_trace_on_a_users_file(user_file, capsys):
    assert cli.main(["trace", f"{user_file}:make", "--input", "ids:int64:4,6", "--input", "mask:bool:4,6",
                     "-n", "2"]) == 0
    out = capsys.readouterr().out
    assert "captured member graph (my_models.py:make)" in out and "wide graph (N=2)" in out
    assert "aten.embedding.default" in out and "wide.embedding.default" in out
    assert cli.main(["trace", "-m", f"{user_file}:TwoInputs", "--input", "float32:2,6", "--input", "float32:2,3",
                     "-n", "2"]) == 0
    assert "wide.linear.default" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["info", "test", "trace", "benchmark", "analyze"])
def test_every_command_help_has_a_description_and_an_example(command, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    usage, _, rest = out.partition("\n\n")
    description = rest.split("\n\n")[0]
    assert usage.startswith(f"usage: wide_compiler {command}")
    assert len(description.split()) >= 8, f"{command} --help has no description: {out[:300]}"
    assert f"python -m wide_compiler {command}" in out  # an example


def test_top_level_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    for command in ("info", "test", "trace", "benchmark", "analyze"):
        assert f"  {command} " in out
    assert "examples:" in out and "--input ids:int64" in out


@pytest.mark.parametrize("spec, bad_part", [
    ("ids:int65:4,16", "int65"),
    ("int65:4,16", "int65"),
    ("ids:int64:4,abc", "'abc'"),
    ("ids:int64:4,0", "size 0"),
    ("ids:int64:4,16:9-3", "'9-3'"),
    ("ids:int64:4,16:0.5-3", "'0.5-3'"),
    ("mask:bool:4:5", "'5'"),
    ("x:float32:4:lots", "'lots'"),
    ("float32", "expected [NAME:]DTYPE:SHAPE"),
    ("a:b:float32:4:1:2", "too many"),
])
def test_bad_input_spec_is_a_usage_error_naming_the_bad_part(spec, bad_part, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["test", "mlp", "--input", spec])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage: wide_compiler test" in err and "--input" in err and bad_part in err, err


@pytest.mark.parametrize("argv, says", [
    (["--input", "ids:int64:4", "--input", "ids:int64:4"], "'ids' is given twice"),
    (["--shape", "4,16", "--input", "float32:4,16"], "not allowed with argument"),
])
def test_conflicting_inputs_are_usage_errors(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["analyze", "mlp", *argv])
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_parse_input_and_make_inputs():
    s = cli.parse_input("ids:int64:4,16:0-1000")
    assert (s.name, s.dtype, s.shape, s.low, s.high, s.fill) == ("ids", "int64", (4, 16), 0, 1000, None)
    assert cli.parse_input("bf16:2x3").dtype == "bfloat16" and cli.parse_input("t:float32:()").shape == ()
    assert cli.parse_input("x:float32:2:-1.5--0.5").low == -1.5
    args, kwargs, notes = cli.make_inputs(
        [cli.parse_input(t) for t in ("float32:2,3:-1-1", "ids:int32:50", "t:float64:():7", "m:bool:9")],
        nn.Embedding(7, 2))
    assert args[0].dtype == torch.float32 and -1 <= args[0].min() and args[0].max() < 1
    assert kwargs["ids"].dtype == torch.int32 and 0 <= kwargs["ids"].min() and kwargs["ids"].max() < 7
    assert kwargs["t"].item() == 7.0 and kwargs["t"].dim() == 0 and kwargs["m"].dtype == torch.bool
    assert len(notes) == 1 and "[0, 7)" in notes[0]
    _, kwargs, notes = cli.make_inputs([cli.parse_input("ids:int64:50")], nn.Linear(2, 2))
    assert kwargs["ids"].max() < 2 and "no nn.Embedding" in notes[0]
    with pytest.raises(ValueError, match="do not fit uint8"):
        cli.make_inputs([cli.parse_input("uint8:4:0-1000")])


@pytest.mark.parametrize("command", [["analyze", "mlp"], ["benchmark", "linear", "--preset", "ci"]])
def test_plot_without_matplotlib_fails_before_the_work(command, monkeypatch, tmp_path, capsys):
    """--plot checks for matplotlib first: exit 2 with the install hint, nothing run."""
    analyze_mod = importlib.import_module("wide_compiler.analyze")
    from wide_compiler import bench

    def must_not_run(*args, **kwargs):
        raise AssertionError("the work ran before the matplotlib check")

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    monkeypatch.setattr(analyze_mod, "analyze", must_not_run)
    monkeypatch.setattr(bench, "run", must_not_run)
    monkeypatch.setattr(cli_models, "_load_model", must_not_run)
    png = tmp_path / "p.png"
    assert cli.main([*command, "--plot", str(png)]) == 2
    err = capsys.readouterr().err
    assert "--plot needs matplotlib" in err and "wide_compiler[plot]" in err and not png.exists()


def test_benchmark_plot_one_panel_per_target_and_mode(tmp_path):
    """20 series over 2 targets and 2 modes: drawn (distinct colours per setting, markers per
    baseline) without error."""
    pytest.importorskip("matplotlib")
    records = [{"target": t, "case": c, "n": n, "mode": m, "strategy": s, "batch": b,
                "speedup": {"loop": n / 4 + b, "vmap": 1.0 + n / 64}}
               for t in ("linear", "conv") for c in ("separate", "shared") for s in ("auto", "bmm", "loop")
               for b in (8, 32) for m in ("inference", "train") for n in (4, 16, 64)]
    png = tmp_path / "bench.png"
    cli.plot_speedups(records, str(png))
    assert png.stat().st_size > 0
    cli.plot_speedups([], str(tmp_path / "empty.png"))  # no records: a note, no crash


def test_readme_cli_commands_parse():
    """Every `python -m wide_compiler ...` line of the README and docs/ parses with today's parser."""
    import re
    import shlex
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    readme = "\n".join(p.read_text() for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))])
    blocks = re.findall(r"```(?:bash|sh|console)\n(.*?)```", readme, flags=re.S)
    lines = [line.split(" #")[0].strip() for b in blocks for line in b.splitlines()]
    commands = [shlex.split(line)[3:] for line in lines if line.startswith("python -m wide_compiler ")]
    assert len(commands) >= 6
    parser = cli.build_parser()
    for argv in commands:
        if argv[-1:] == ["--help"]:
            continue
        args = parser.parse_args(argv)
        assert callable(args.func), argv


# ---------------------------------------------------------------------------------- a quick start, usage errors

def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args, "-c", code], capture_output=True, text=True,
                          timeout=900,  # a hang guard
                          check=False, env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_help_imports_no_torch():
    """`--help` (and `import wide_compiler` alone) must not import torch: it answers at once (Note
    [A quick CLI]). Checked by what gets imported, not by a time."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "wide_compiler", "--help"],
                          capture_output=True, text=True, timeout=900, check=False)  # a hang guard
    assert proc.returncode == 0 and "usage: wide_compiler" in proc.stdout, proc.stderr
    imported = [line.rpartition("|")[2].strip() for line in proc.stderr.splitlines() if "|" in line]
    assert "wide_compiler.cli.parser" in imported  # the importtime lines are there
    assert not [m for m in imported if m == "torch" or m.startswith("torch.")], "--help imported torch"
    proc = _python("import sys, wide_compiler, wide_compiler.cli; print(sorted(m for m in sys.modules "
                   "if m.partition('.')[0] in ('torch', 'numpy')))")
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def test_info_imports_torch_and_the_core_only(info_run):
    status, out, modules = info_run  # the fresh process of test_info_lists_ops_and_build_info
    assert status == "0" and "wide::linear" in out, out
    assert modules == {"wide_compiler", "wide_compiler._version", "wide_compiler._C",
                       "wide_compiler.cli", "wide_compiler.cli.parser",
                       "wide_compiler.cli.inputs", "wide_compiler.cli.info"}


def test_lazy_root_keeps_the_api_and_the_ops():
    """The lazy root (Note [Lazy package root]): every public name, dir(), `wc.analyze` the function
    even after its module is imported, and torch.ops.wide registered whichever import comes first
    (torch, the root, a submodule; each case in a fresh process, torch.ops.wide.linear called after)."""
    checks = {  # (the API's checks in the first process: a fresh one each cost an import of torch)
        "import torch, wide_compiler as wc\nimport wide_compiler.analyze\nassert callable(wc.analyze) and "
        "wc.analyze.__module__ == 'wide_compiler.analyze'\nassert set(wc.__all__) <= set(dir(wc))\n"
        "assert all(getattr(wc, n) is not None for n in wc.__all__)\n"
        "from wide_compiler import WideModel, compile, cmake_prefix_path\n"
        "assert wc.fx.capture and wc.measure.Stopwatch": "",
        "import wide_compiler  # then torch (run() adds it)": "",
        "from wide_compiler.nn import WideLinear": "",
        "import wide_compiler.fx.capture": "",
    }
    code = "\n".join(f"run({c!r})" for c in checks)
    proc = _python("import subprocess, sys\n"
                   "def run(c):\n"
                   "    r = subprocess.run([sys.executable, '-c', c + '\\nimport torch\\n"
                   "torch.ops.wide.linear.default'], capture_output=True, text=True)\n"
                   "    assert r.returncode == 0, (c, r.stderr[-2000:])\n" + code)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_preset_choices_are_the_registrys():
    from wide_compiler import bench
    from wide_compiler.cli import parser

    assert set(parser.PRESETS) == set(bench.PRESET_NAMES)


def _usage_error(argv, capsys) -> str:
    """Run argv: it must end as argparse ends a usage error (exit 2, the command's usage line,
    `wide_compiler COMMAND: error: ...`), with no traceback; returns stderr."""
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"usage: wide_compiler {argv[0]}" in err and f"wide_compiler {argv[0]}: error:" in err, err
    assert "Traceback" not in err, err
    return err


def test_float_shape_on_an_embedding_model_suggests_int64_input(user_file, capsys, monkeypatch):
    analyze_mod = importlib.import_module("wide_compiler.analyze")
    monkeypatch.setattr(analyze_mod, "analyze", lambda *a, **k: pytest.fail("analyze ran on a bad input"))
    err = _usage_error(["analyze", f"{user_file}:Bag", "--shape", "8,24"], capsys)
    assert "--input int64:8,24" in err and "embed" in err and "[0, 40)" in err
    err = _usage_error(["test", f"{user_file}:Bag", "--shape", "8,24"], capsys)
    assert "--input int64:8,24" in err


@pytest.mark.parametrize("argv, says", [
    (["analyze", "{tmp}/absent.py:make", "--shape", "2,3"], "absent.py"),
    (["analyze", "{tmp}/my_models.py:Nope", "--shape", "2,3"], "has no 'Nope'"),
    (["test", "mpl", "--shape", "2,3"], "did you mean 'mlp'"),
    (["analyze", "mlp", "--shape", "2,x"], "'x' is not an integer size"),
    (["analyze", "mlp", "-n", "0"], "-n '0'"),
    (["analyze", "mlp", "--modes", "infer"], "--modes 'infer'"),
    (["analyze", "mlp", "--memory", "lots"], "--memory 'lots'"),
    (["analyze", "mlp", "--repeats", "0"], "--repeats"),
    (["trace", "{tmp}/my_models.py:Bag", "--input", "float32:2,3,4"], "does not run on one member's input"),
    (["test", "-n", "0"], "must be at least 1"),
    (["benchmark", "conv9d"], "unknown benchmark target 'conv9d'"),
])
def test_plain_mistakes_are_usage_errors(argv, says, user_file, capsys, monkeypatch):
    analyze_mod = importlib.import_module("wide_compiler.analyze")
    monkeypatch.setattr(analyze_mod, "analyze", lambda *a, **k: pytest.fail("analyze ran"))
    err = _usage_error([a.format(tmp=user_file.parent) for a in argv], capsys)
    assert says in err, err


def test_test_command_says_skipped_for_checks_that_did_not_run(user_file, capsys, monkeypatch):
    """A train graph whose draws the check cannot fix cannot match its members: its checks are
    SKIPPED, not PASS (here dropout's draw, made unfixable)."""
    draws = importlib.import_module("wide_compiler._equivalence.draws")
    monkeypatch.delitem(draws._HANDLERS, "bernoulli_")
    assert cli.main(["test", f"{user_file}:noisy", "--shape", "4,6", "-n", "2"]) == 0
    out = capsys.readouterr().out
    assert "SKIPPED  train/own: the train graph draws random numbers with aten.bernoulli_" in out
    assert "SKIPPED  train/shared" in out
    assert "PASS  train" not in out and "PASS  eval/own" in out
    assert "in the 2 checks that ran (2 skipped: train/own, train/shared)" in out


def test_lazy_root_pickles_by_reference():
    """A function that names the package (`wc`) is pickled with it by reference, as cloudpickle
    pickles any module (Ray Tune pickles its trainables so): the lazy root's type keeps that."""
    import pickle

    import wide_compiler as wc

    assert pickle.loads(pickle.dumps(wc)) is wc
    cloudpickle = pytest.importorskip("ray.cloudpickle")
    uses_wc = eval("lambda: wc.WideConfig", {"wc": wc})  # a global `wc`, as in a user's script
    assert cloudpickle.loads(cloudpickle.dumps(uses_wc))() is wc.WideConfig


@pytest.mark.parametrize(("argv", "options"), [([], None), (["--compile"], {}),
                                               (["--compile", "reduce-overhead"], {"mode": "reduce-overhead"})])
def test_benchmark_compile_takes_torch_compiles_mode(argv, options, monkeypatch):
    """`--compile [MODE]`: every contender under torch.compile, with MODE as its mode
    (reduce-overhead: CUDA graphs on a GPU for the wide model and the baselines alike)."""
    from wide_compiler import bench

    seen = []
    monkeypatch.setattr(bench, "run", lambda name, preset, progress=False, cases=None, on_job=None:
                        seen.append(engine.COMPILE_OPTIONS) or [])
    assert cli.main(["benchmark", "linear", "--preset", "ci", "--quiet", *argv]) == 0
    assert seen == [options]
