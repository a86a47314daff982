"""wide_compiler.measure, the package's one measurement library: the timing loop on a fake clock
(medians, interleaving order, warm-up counts, the stop predicate), the contenders, and that
``import wide_compiler`` leaves the benchmarks unloaded."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from wide_compiler import measure
from wide_compiler.measure import timing

from support import USE_THE_API, FakeClock, fake_clock


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    return fake_clock(monkeypatch)


def recorder(clock: FakeClock, seconds: dict[str, list[float] | float], log: list[str]):
    """Callables that log their name and advance the clock (a list: one duration per call)."""
    calls = dict.fromkeys(seconds, 0)

    def make(name: str):
        def run() -> None:
            s = seconds[name]
            clock.t += s[calls[name] % len(s)] if isinstance(s, list) else s
            calls[name] += 1
            log.append(name)
        return run
    return {name: make(name) for name in seconds}


@pytest.fixture(scope="module")
def fresh_imports() -> list[str]:
    """One fresh interpreter for the two import checks below (a fresh one each cost an import of
    torch), in the order that keeps each check what it was alone: ``wide_compiler.measure`` first
    (then nothing else is loaded yet), the modules above it it loaded printed; then every public
    name used, the benchmark and framework modules loaded printed. Returns the two lines."""
    code = ("import sys, wide_compiler.measure\n"
            "print(sorted(m for m in sys.modules if m.split('.')[:2] in (['wide_compiler', 'bench'], "
            "['wide_compiler', 'cli'], ['wide_compiler', 'integrations'])))\n"
            + USE_THE_API
            + "print(sorted(m for m in sys.modules if m.startswith('wide_compiler.bench') or "
              "m.split('.')[0] in ('lightning', 'pytorch_lightning', 'optuna', 'ray', 'transformers')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    assert len(lines) == 2, out.stdout + out.stderr
    return lines


def test_import_wide_compiler_loads_no_benchmark_code(fresh_imports):
    """Nor Lightning, Optuna, Ray or transformers (test_lightning.py and test_optuna.py checked
    theirs each in a process of its own, on ``import wide_compiler`` alone, which imports nothing:
    here, once, with every public name used)."""
    assert fresh_imports[1] == "[]", fresh_imports


def test_measure_imports_nothing_above_it(fresh_imports):
    assert fresh_imports[0] == "[]", fresh_imports


def test_interleave_warmup_count_and_rotating_order(clock):
    log: list[str] = []
    fns = recorder(clock, {"a": 1.0, "b": 1.0, "c": 1.0}, log)
    r = measure.interleave(fns, 3, warmup=2)
    assert log[:6] == ["a", "a", "b", "b", "c", "c"]  # warm-up: each callable in turn
    # the order changes every round so that no callable keeps following the same one
    assert log[6:] == ["a", "b", "c", "b", "a", "c", "c", "a", "b"]
    assert r.complete and {k: len(v) for k, v in r.samples.items()} == {"a": 3, "b": 3, "c": 3}


@pytest.mark.parametrize("k", [2, 3, 4, 5, 6, 8])
def test_interleave_orders_change_every_callables_predecessor(k):
    """Note [Interleaved timing]: every round runs each callable once, and over three rounds no
    callable follows the same other one every time (the warm-up's last precedes the first round);
    with a rotation, reversed every other round, the first of 5 followed the last in all three."""
    names = list(range(k))
    orders = list(timing._round_orders(names, 3))
    assert all(sorted(order) == names for order in orders)
    before = [names[-1], *(x for order in orders for x in order)]
    preds = {name: [before[i] for i in range(len(before) - 1) if before[i + 1] == name] for name in names}
    for name, ps in preds.items():
        others = [p for p in ps if p != name]
        assert len(others) < 3 or len(set(others)) > 1, (name, ps, orders)


def test_interleave_fixed_order_blocks_setup_and_block_warmup(clock):
    log: list[str] = []
    fns = recorder(clock, {"a": 1.0, "b": 2.0}, log)
    r = measure.interleave(fns, 2, rotate=False, per_block=2, block_warmup=1,
                           setup=lambda name: log.append(f"setup {name}"))
    assert log == ["setup a", "a", "a", "a", "setup b", "b", "b", "b"] * 2
    assert r.samples == {"a": [1.0] * 4, "b": [2.0] * 4}  # block warm-ups not recorded


def test_interleave_samples_are_seconds_per_call_and_medians_in_ms(clock):
    log: list[str] = []
    fns = recorder(clock, {"a": [1.0, 5.0, 2.0, 9.0, 3.0, 4.0], "b": 0.5}, log)
    r = measure.interleave(fns, 3, calls={"a": 2, "b": 4})
    assert r.samples["a"] == [3.0, 5.5, 3.5]  # (1 + 5) / 2, (2 + 9) / 2, (3 + 4) / 2
    assert r.medians_ms() == {"a": 3500.0, "b": 500.0}


def test_interleave_stop_is_asked_after_every_call(clock):
    log: list[str] = []
    fns = recorder(clock, {"a": 1.0, "b": 1.0}, log)
    r = measure.interleave(fns, 5, warmup=1, stop=lambda: clock.t >= 4)
    assert not r.complete
    assert len(log) == 4 and r.samples == {"a": [1.0], "b": [1.0]}  # 2 warm-ups, then one call each


def test_interleave_names_a_callable_that_raises(clock):
    def bad() -> None:
        raise ValueError("no")

    with pytest.raises(measure.TimingError, match="bad: ValueError: no") as e:
        measure.interleave({"ok": lambda: None, "bad": bad}, 2)
    assert e.value.name == "bad" and isinstance(e.value.error, ValueError)
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        measure.interleave({"ok": lambda: None}, 0)


def test_time_interleaved_is_the_median_and_drops_failing_callables_when_asked(clock):
    log: list[str] = []
    fns = recorder(clock, {"slow": [1.0, 1.0, 1.0, 1.0, 1.0, 9.0, 1.0], "quick": 0.25}, log)
    ms = measure.time_interleaved(fns, min_run_time=3.0, rounds=3, warmup=1, min_rounds=3)
    assert ms == {"slow": 1000.0, "quick": 250.0}  # the 9 s outlier is not the median

    def broken() -> None:
        raise RuntimeError("broken")

    errors: dict = {}
    ms = measure.time_interleaved({"quick": fns["quick"], "broken": broken}, min_run_time=1.0,
                                  rounds=2, errors=errors)
    assert list(ms) == ["quick"] and errors == {"broken": "RuntimeError: broken"}


def test_time_interleaved_keeps_what_one_callable_leaves_behind_off_the_next(clock):
    """Note [Interleaved timing]: blocks of one call (slow callables) start with an untimed call,
    so a callable's first call after another one (whose heap it pays for: vmap's freed memory)
    is never the sample. Here "after" takes 3 s on its first call after "hog", 1 s otherwise; with
    3 rounds and 3 callables the order alone would put it after "hog" in most rounds."""
    log: list[str] = []
    last: list[str] = []

    def make(name: str, s: float):
        def run() -> None:
            clock.t += 3.0 if name == "after" and last and last[-1] == "hog" else s
            last.append(name)
            log.append(name)
        return run
    fns = {"after": make("after", 1.0), "other": make("other", 1.0), "hog": make("hog", 2.0)}
    ms = measure.time_interleaved(fns, min_run_time=3.0, rounds=3, warmup=1, min_rounds=3)
    assert ms == {"after": 1000.0, "other": 1000.0, "hog": 2000.0}, ms
    assert "hog" in log and log.count("after") > 3  # the untimed first calls of each block ran


def test_stopwatch_reads_the_measuring_clock(clock):
    sw = measure.Stopwatch()
    clock.t += 2.5
    assert sw.seconds == 2.5 and sw.ms == 2500.0


def test_contenders_agree_with_the_loop():
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()) for _ in range(3)]
    x = torch.randn(3, 2, 3, 8, 8)
    ref = measure.loop_contender(models)
    for mode in measure.MODES:
        want = measure.make_step(ref, x, mode)()
        for c in (measure.loop_contender(models, channels_last=True),
                  measure.vmap_contender(models, randomness="different")):
            got = measure.make_step(c, x, mode)()
            assert measure.max_abs_err(ref, want, c, got, 3, mode) < 1e-5, (c.name, mode)
    assert measure.loop_contender(models, channels_last=True).name == "loop_cl"


def test_max_abs_err_finds_one_members_gradient_and_names_it():
    """The train check compares every member's gradient (member by member, no stacked copies): a
    change in one element of member 2's gradient of one parameter is the error, and a gradient
    of another shape is refused naming member and parameter."""
    torch.manual_seed(0)
    models = [nn.Linear(4, 3) for _ in range(3)]
    x = torch.randn(3, 5, 4)
    ref, vm = measure.loop_contender(models), measure.vmap_contender(models)
    want = measure.make_step(ref, x, "train")()
    out, grads = measure.make_step(vm, x, "train")()
    assert measure.max_abs_err(ref, want, vm, (out, grads), 3, "train") < 1e-5
    bad = [g.clone() for g in grads]
    bad[1][2, 1] += 0.25  # member 2's bias gradient
    assert measure.max_abs_err(ref, want, vm, (out, bad), 3, "train") == pytest.approx(0.25, abs=1e-5)
    with pytest.raises(ValueError, match="member 0 gradient of parameter 0 of vmap"):
        measure.max_abs_err(ref, want, vm, (out, [grads[0][:, :2], grads[1]]), 3, "train")


def test_contenders_take_keyword_inputs():
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x, *, scale):
            return self.fc(x) * scale

    models = [Scaled() for _ in range(2)]
    xs = measure.CallInputs((torch.randn(2, 5, 4),), {"scale": torch.rand(2, 1)})
    ref = measure.loop_contender(models)
    want = measure.make_step(ref, xs, "inference")()
    v = measure.vmap_contender(models)
    assert measure.max_abs_err(ref, want, v, measure.make_step(v, xs, "inference")(), 2, "inference") < 1e-6


def test_old_engine_names_are_the_measure_ones():
    from wide_compiler.bench import engine

    for name in ("Contender", "MODES", "TimingError", "compiled", "compiled_loop_contender",
                 "contention_note", "fmt_ms", "fmt_x", "loop_contender", "machine_info", "make_step",
                 "max_abs_err", "params_max_abs_err", "peak_gflops", "stacked_params",
                 "time_interleaved", "time_with_baselines", "vmap_contender",
                 "wide_params_in_member_order"):
        assert getattr(engine, name) is getattr(measure, name), name
