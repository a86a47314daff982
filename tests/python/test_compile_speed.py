"""Compile speed (issue 45): tuning that pays for itself (Note [Tuning that pays for itself] in
tuning.py), no silent pauses (Note [No silent pauses] in measure/progress.py), recaptures logged
with their time, and the ``compile`` benchmark target. No assertion depends on the machine's
speed: the measuring clock is faked (Note [Fake clock]) and the members' forwards advance it.
"""
from __future__ import annotations

import io
import logging

import pytest
import torch
import wide_compiler as wc
from torch import nn
from wide_compiler import tuning
from wide_compiler.fx import compilation, member_runs
from wide_compiler.measure import Progress

from support import FakeClock, fake_clock

N = 3


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    return fake_clock(monkeypatch)


class Timed(nn.Module):
    """An MLP whose forward takes ``seconds`` on the fake clock (outside a capture)."""

    clock: FakeClock | None = None
    seconds = 0.0

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        if Timed.clock is not None and not isinstance(x, torch._subclasses.FakeTensor):
            Timed.clock.t += Timed.seconds
        return self.fc2(torch.relu(self.fc1(x)))


@pytest.fixture
def timed(clock, monkeypatch):
    monkeypatch.setattr(Timed, "clock", clock)
    return lambda seconds: monkeypatch.setattr(Timed, "seconds", seconds)


def members(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [Timed() for _ in range(N)]


def tuning_line(wide) -> str:
    return next(ln for ln in wide.summary().splitlines() if ln.startswith("tuning:"))


def defaults(wide) -> dict[str, str]:
    gm = wide._graph_for(wide.training).graph_module
    return {n.name: n.meta["wide_tune"].default for n in gm.graph.nodes if "wide_tune" in n.meta}


# --- Note [Tuning that pays for itself] ---------------------------------------------------------
def test_the_member_check_times_the_quickest_forward(timed):
    timed(0.25)
    assert member_runs.check_run_members(members(), (torch.randn(4, 6),), {}) == pytest.approx(0.25)


def test_a_graph_too_slow_to_tune_in_the_budget_measures_nothing(timed, monkeypatch, tmp_path, caplog):
    """A member's forward takes 1 s: the train graph of 3 runs ~9 s (forward and backward), so the
    20 runs a measured and checked graph costs do not fit in 5 s: nothing is measured (before,
    every op was measured until the budget ran out, and the check was cut short), the ops keep
    their defaults, no warning, and summary() says why."""
    timed(1.0)
    monkeypatch.setattr(tuning, "_hinted", False)
    measured = []
    original = tuning._measure
    monkeypatch.setattr(tuning, "_measure", lambda *a, **k: measured.append(1) or original(*a, **k))
    with caplog.at_level(logging.INFO, logger="wide_compiler"):
        wide = wc.compile(members(), torch.randn(4, 6), config=wc.WideConfig(tune_after_runs=0, cache_dir=str(tmp_path)))
    assert not measured
    assert wide.strategies == defaults(wide)
    line = tuning_line(wide)
    assert "0 measured, 0 cached, 2 left at default" in line, line
    assert "nothing measured: a run of this graph takes ~9000 ms" in line and "tune_budget_s=5" in line, line
    assert "model-level check: not needed" in line, line
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "tuning" in r.getMessage()]
    assert any("nothing measured" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("budget, checked", [(10.0, True), (5.0, False)])
def test_cached_picks_of_a_graph_too_slow_to_measure_are_checked_where_the_check_fits(
        timed, monkeypatch, tmp_path, budget, checked):
    """A train graph of ~0.9 s a run (forward 0.1 s, N=3): 20 runs do not fit in 10 s (nothing
    measured), but the check's 6 runs do, so cached picks that differ from the defaults are
    checked; in 5 s they do not, and the defaults are kept without running the graph."""
    timed(0.1)
    original = tuning.lookup
    monkeypatch.setattr(tuning, "lookup", lambda key, config: {"strategy": "loop", "timings_ms": None}
                        if '"op": "wide.linear"' in key else original(key, config))
    wide = wc.compile(members(), torch.randn(4, 6), config=wc.WideConfig(tune_after_runs=0, cache_dir=str(tmp_path), tune_budget_s=budget))
    line = tuning_line(wide)
    assert "0 measured, 2 cached" in line and "nothing measured" in line, line
    if checked:
        assert "model-level check: tuned set" in line, line
    else:
        assert "model-level check: not run: the graph is too slow to check in the tuning budget" in line, line
        assert wide.strategies == defaults(wide)


def test_the_budget_follows_the_graphs_run_time(timed, tmp_path):
    """A forward of 1 ms: the train graph runs ~9 ms, so the budget is 50 runs, 0.45 s, not 5 s."""
    timed(0.001)
    wide = wc.compile(members(), torch.randn(4, 6), config=wc.WideConfig(tune_after_runs=0, cache_dir=str(tmp_path)))
    assert "budget 0.45 s of 5 s: 50 runs of the graph" in tuning_line(wide), tuning_line(wide)
    budget = wide._graph_for(True).graph_module.meta["wide_tuning"]
    assert budget.seconds == pytest.approx(0.45) and budget.not_measured is None


def test_the_eval_graph_budget_follows_the_members_forward(timed, tmp_path):
    """The eval graph, compiled at .eval() without the members, uses the forward timed at the
    first compile: N runs of it (no backward)."""
    timed(0.001)
    wide = wc.compile(members(), torch.randn(4, 6), config=wc.WideConfig(tune_after_runs=0, cache_dir=str(tmp_path))).eval()
    assert "budget 0.15 s of 5 s" in tuning_line(wide), tuning_line(wide)


def test_no_limit_and_unknown_run_times_keep_the_budget(timed, tmp_path):
    timed(1.0)
    wide = wc.compile(members(), torch.randn(4, 6), config=wc.WideConfig(tune_after_runs=0, cache_dir=str(tmp_path), tune_budget_s=None))
    assert "(no limit)" in tuning_line(wide) and "nothing measured" not in tuning_line(wide)
    timed(0.0)  # a forward too quick for the clock: the run time is not known
    wide = wc.compile(members(1), torch.randn(4, 6), config=wc.WideConfig(tune_after_runs=0, cache_dir=str(tmp_path / "b")))
    assert "(budget 5 s)" in tuning_line(wide), tuning_line(wide)


def test_the_budget_give_up_warns_once_per_process(clock, monkeypatch, tmp_path, caplog):
    """Candidates of 1 s each and a 10 s budget: the first op is abandoned. The first give-up of
    the process is a WARNING with what to do; the next compile's is INFO."""
    original = tuning._timed_calls

    def slow(candidates, training):
        def run(fn):
            def call():
                fn()
                clock.t += 1.0
            return call
        return {k: run(f) for k, f in original(candidates, training).items()}

    monkeypatch.setattr(tuning, "_timed_calls", slow)
    monkeypatch.setattr(tuning, "_hinted", False)
    config = wc.WideConfig(tune_after_runs=0, cache_dir=str(tmp_path), tune_budget_s=10)
    with caplog.at_level(logging.INFO, logger="wide_compiler.tuning"):
        wc.compile(members(), torch.randn(4, 6), config=config)
        wc.compile(members(1), torch.randn(4, 6), config=config.replace(cache_dir=str(tmp_path / "b")))
    said = [r for r in caplog.records if "tuning budget of" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING, logging.INFO], [r.getMessage() for r in said]
    assert len(said[0].getMessage()) < 300, said[0].getMessage()


# --- Note [No silent pauses] --------------------------------------------------------------------
class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_silent_under_its_threshold(clock, caplog):
    stream = Tty()
    with caplog.at_level(logging.INFO, logger="wide_compiler.progress"), \
            Progress("compiling", after=2.0, stream=stream) as p:
        p.step("capture")
        clock.t += 1.9
        p.step("widen")
    assert stream.getvalue() == "" and not caplog.records and not p.reported


def test_progress_on_a_terminal_is_one_status_line_erased_at_the_end(clock):
    stream = Tty()
    with Progress("compiling the train graph", after=2.0, stream=stream) as p:
        p.step("capture")
        clock.t += 3.0
        p.step("widen")
    out = stream.getvalue()
    assert "compiling the train graph: widen (3 s)" in out and out.endswith("\r\x1b[K"), repr(out)
    assert "\n" not in out


def test_progress_elsewhere_logs_each_step_and_the_end(clock, caplog):
    with caplog.at_level(logging.INFO, logger="wide_compiler.progress"), \
            Progress("compiling", after=2.0, stream=io.StringIO()) as p:
        p.step("capture")
        clock.t += 2.5
        p.step("widen")
        clock.t += 1.0
        p.step("strategies")
        with Progress("inner", after=0.0) as inner:  # a nested stage joins the outer one
            inner.step("tile_members")
    said = [r.getMessage() for r in caplog.records]
    assert said[:3] == ["wide_compiler: compiling: widen (2.5 s so far)",
                        "wide_compiler: compiling: strategies (3.5 s so far)",
                        "wide_compiler: compiling: tile_members (3.5 s so far)"], said
    assert said[3].startswith("wide_compiler: compiling: done in 3.5 s (capture 2.5 s, widen 1.0 s"), said


def test_a_long_compile_says_what_it_is_doing(monkeypatch, caplog):
    monkeypatch.setattr(compilation, "PROGRESS_AFTER_S", 0.0)
    with caplog.at_level(logging.INFO, logger="wide_compiler.progress"):
        wc.compile(members(), torch.randn(4, 6), config=wc.WideConfig.fast())
    said = [r.getMessage() for r in caplog.records]
    assert "wide_compiler: compiling the train graph of Timed (N=3): capture" in " ".join(said), said
    assert any("done in" in s for s in said), said


# --- recaptures ----------------------------------------------------------------------------------
class Pooled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):  # [B, T, 4] -> [B, 3]
        return self.fc(x).mean(1)


def test_a_recapture_is_one_warning_with_the_dim_and_its_time(caplog):
    torch.manual_seed(0)
    models = [Pooled() for _ in range(N)]
    wide = wc.compile(models, torch.randn(2, 5, 4), config=wc.WideConfig.fast())
    with caplog.at_level(logging.WARNING, logger="wide_compiler"):
        wide(torch.randn(N, 2, 7, 4))
        wide(torch.randn(N, 2, 9, 4))
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 1, said
    assert ("recaptured the train graph with input 'x' dim 2 (this call: 7, captured: 5) dynamic in" in said[0]
            and said[0].endswith(" s")), said


# --- Note [Members run in place] (fx/member_runs.py) -------------------------------------------
class Counting(nn.Module):
    """A BatchNorm net in train mode (its running stats change when run) that counts its calls,
    and, when asked, rebinds a weight's ``.data`` or clamps its weights in place."""

    def __init__(self, rebind: bool = False, clamp: bool = False) -> None:
        super().__init__()
        self.fc, self.bn = nn.Linear(4, 6), nn.BatchNorm1d(6)
        self.calls, self.rebind, self.clamp = 0, rebind, clamp

    def forward(self, x):
        self.calls += 1
        if self.rebind:
            self.fc.weight.data = self.fc.weight.data * 0.5
        if self.clamp:
            with torch.no_grad():
                self.fc.weight.clamp_(-0.01, 0.01)
        return self.bn(self.fc(x))


def _copies(monkeypatch) -> list:
    made = []
    original = member_runs.copy.deepcopy
    monkeypatch.setattr(member_runs.copy, "deepcopy", lambda m, *a: made.append(m) or original(m, *a))
    return made


@pytest.mark.parametrize("rebind", [False, True])
def test_the_member_check_runs_members_in_place_and_leaves_them_as_they_were(monkeypatch, rebind):
    torch.manual_seed(0)
    models = [Counting(rebind=rebind) for _ in range(N)]
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in models]
    data = [m.fc.weight.data_ptr() for m in models]
    made = _copies(monkeypatch)
    assert member_runs.check_run_members(models, (torch.randn(5, 4),), {}) is not None
    assert not any(isinstance(m, Counting) for m in made)  # no copy of any member
    for m, state, ptr in zip(models, before, data):
        assert all(torch.equal(v, state[k]) for k, v in m.state_dict().items())  # running stats too
        assert m.calls == 0 and m.fc.weight.data_ptr() == ptr


def test_a_member_that_writes_its_weights_is_checked_on_a_copy(monkeypatch):
    torch.manual_seed(0)
    models = [Counting(clamp=True) for _ in range(N)]
    before = [m.fc.weight.detach().clone() for m in models]
    made = _copies(monkeypatch)
    member_runs.check_run_members(models, (torch.randn(5, 4),), {})
    assert sum(isinstance(m, Counting) for m in made) == N  # each member's write was refused before it ran, then run on a copy
    assert all(torch.equal(m.fc.weight, w) for m, w in zip(models, before)) and models[0].calls == 0


# --- benchmark compile ------------------------------------------------------------------------------
def test_the_compile_benchmark_measures_in_a_fresh_process(tmp_path):
    """The child process of ``benchmark compile`` (``python -m wide_compiler.bench._compile_child``)
    runs and answers in JSON (run as __main__, the target's own module registered it twice)."""
    from wide_compiler.bench import compile as target

    got = target._in_fresh_process("compile", "mlp", "tiny", 2, str(tmp_path), "fast")
    assert set(got) == {"train_s", "eval_s", "train_cpu_s", "eval_cpu_s", "max_abs_err"} and got["max_abs_err"] < 1e-5, got
    assert got["train_s"] > 0 and got["eval_s"] > 0


# --- Note [Rank check on meta tensors] (fx/widen.py) --------------------------------------------
def test_the_rank_check_accepts_a_good_graph_on_meta_tensors_without_the_fake_run(monkeypatch):
    from wide_compiler.fx import widen

    ran = []
    monkeypatch.setattr(widen, "_fake_run", lambda *args, **kwargs: ran.append(1))
    models = [nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 2))
              for _ in range(N)]
    wide = wc.compile(models, torch.randn(2, 3, 6, 6), config=wc.WideConfig.fast())
    assert not ran  # the meta run accepted the graph
    x = torch.randn(N, 2, 3, 6, 6)
    torch.testing.assert_close(wide(x), torch.stack([m(x[i]) for i, m in enumerate(models)]))


def test_a_graph_meta_tensors_cannot_run_goes_to_the_fake_run():
    """nonzero's output size depends on the values: the meta run stops (None), the fake run decides."""
    from torch import fx
    from wide_compiler.fx import widen

    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.ops.aten.nonzero.default, (x,)))
    gm = fx.GraphModule(nn.Module(), graph)
    x.meta["val"] = torch.empty(4)
    assert widen._meta_ranks(gm, [widen.GraphInput(kind="user", name="x", node=x)], 2) is None


class Positions(nn.Module):
    """Adds a learned embedding of positions made in forward (a creation op on the input's device)."""

    def __init__(self) -> None:
        super().__init__()
        self.pos, self.fc = nn.Embedding(16, 4), nn.Linear(4, 2)

    def forward(self, x):  # [B, T, 4]
        offset = torch.arange(x.shape[-1], device=x.device, dtype=x.dtype)  # [4], made on the CPU
        return self.fc(x + offset + self.pos(torch.arange(x.shape[1], device=x.device)))


def test_a_creation_op_on_the_inputs_device_runs_on_meta_tensors(monkeypatch):
    from wide_compiler.fx import widen

    ran = []
    monkeypatch.setattr(widen, "_fake_run", lambda *args, **kwargs: ran.append(1))
    torch.manual_seed(0)
    models = [Positions() for _ in range(N)]
    wide = wc.compile(models, torch.randn(2, 5, 4), config=wc.WideConfig.fast())
    assert not ran  # the meta run accepted the graph (the arange made on meta, not on the CPU)
    x = torch.randn(N, 2, 5, 4)
    torch.testing.assert_close(wide(x), torch.stack([m(x[i]) for i, m in enumerate(models)]))


# --- a warm compile (issue 45: at most 1 s for BERT-base) ---------------------------------------
class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn, self.out = nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)
        self.out.weight = nn.Parameter(self.out.weight.detach().clone())  # a plain Parameter

    def forward(self, x):
        return self.out(self.bn(self.fc(x)).relu())


def test_the_capture_copy_shares_member_0s_storage_and_leaves_member_0_as_it_was():
    """Note [The capture copy shares member 0's storage] (fx/compilation.py): the capture model and the
    wide model's template hold new tensor objects on member 0's storage (no clone); compiling and
    running both modes, and the capture of a new size, write nothing into member 0."""
    torch.manual_seed(0)
    members = [BNNet() for _ in range(N)]
    before = {k: v.clone() for k, v in members[0].state_dict().items()}
    objects = {k: v for k, v in [*members[0].named_parameters(), *members[0].named_buffers()]}
    wide = wc.compile(members, torch.randn(4, 6), config=wc.WideConfig.fast())
    capture_model = wide._capture_template[0]
    for name, t in [*capture_model.named_parameters(), *capture_model.named_buffers()]:
        assert t.data_ptr() == objects[name].data_ptr(), name  # shared storage (a clone before)
        assert t is not objects[name]  # but not the user's object
        assert type(t) is type(objects[name]) and t.requires_grad == objects[name].requires_grad
    for name, t in [*wide._template.named_parameters(), *wide._template.named_buffers()]:
        assert t.data_ptr() == objects[name].data_ptr(), name
    x = torch.randn(N, 4, 6)
    wide(x).sum().backward()
    wide.eval()
    wide(x)
    wide.train()
    wide(torch.randn(N, 7, 6))  # another batch size (dynamic)
    assert all(torch.equal(before[k], v) for k, v in members[0].state_dict().items())
    assert [m.training for m in members[0].modules()] == [True] * 4
    assert torch.equal(wide.member(0).fc.weight, members[0].fc.weight)


def test_the_keys_bytecode_scan_reads_what_dis_reads():
    """The compile cache key's scan of the globals a function reads (compile_cache._globals_read)
    walks the raw bytecode (8x faster than dis.get_instructions: most of a warm key's time); it
    gives dis's answer on every function of torch.nn, the zoo and the compiler."""
    import sys
    import types

    import wide_compiler.zoo  # noqa: F401 -- its functions are scanned
    from wide_compiler.fx import compile_cache

    codes: list = []

    def walk(code):
        codes.append(code)
        for c in code.co_consts:
            if isinstance(c, types.CodeType):
                walk(c)

    for name, module in list(sys.modules.items()):
        if not name.startswith(("torch.nn.modules", "wide_compiler")):
            continue
        for v in list(vars(module).values()):
            for f in [v, *vars(v).values()] if isinstance(v, type) else [v]:
                code = getattr(getattr(f, "__func__", f), "__code__", None)
                if isinstance(code, types.CodeType):
                    walk(code)
    codes = list(dict.fromkeys(codes))
    assert len(codes) > 1000
    if compile_cache._FAST_SCAN:
        assert [compile_cache._globals_read_fast(c) for c in codes] == [compile_cache._globals_read_dis(c)
                                                                          for c in codes]
    assert [compile_cache._globals_read(c) for c in codes[:200]] == [compile_cache._globals_read_dis(c)
                                                                       for c in codes[:200]]
