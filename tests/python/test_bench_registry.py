"""The benchmark registry (``bench.registry``): every target, its presets, its records.

Every registered target is checked the same way, so a new target is covered without editing
this file: its presets, its jobs, and the DESIGN §10 fields of the records of its first ``ci``
case. The ``optim`` and ``train`` targets are also run on a small grid of their own. No assertion
depends on timing: times are checked for being finite and positive.
"""
from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from wide_compiler import bench, cli
from wide_compiler import measure
from wide_compiler.bench import engine, optim, registry
from support import VISION_CI_TARGETS, check_design_fields

# ---------------------------------------------------------------------------------- registry

def test_registry_is_read_only_and_has_every_target():
    assert isinstance(bench.TARGETS, types.MappingProxyType)
    with pytest.raises(TypeError):
        bench.TARGETS["x"] = None  # type: ignore[index]
    assert {"linear", "conv", "norm", "pool", "embedding", "models", "optim", "train", "rnn", "router",
            "attention", "dropout"} <= set(bench.TARGETS)


@pytest.mark.parametrize("name", list(bench.TARGETS))
def test_every_target_has_ci_quick_full(name):
    spec = bench.TARGETS[name]
    assert spec.name == name and spec.description and callable(spec.formatter)
    assert set(bench.PRESET_NAMES) <= set(spec.presets)
    for preset_name, preset in spec.presets.items():
        assert isinstance(preset, bench.Preset) and preset.description, preset_name
        assert preset.min_run_time > 0 and isinstance(preset.grid, dict), preset_name
        jobs = spec.jobs(preset)  # building the jobs runs nothing
        assert jobs and all(isinstance(j, bench.Job) and j.label for j in jobs), preset_name
    assert spec.presets["ci"].min_run_time <= spec.presets["quick"].min_run_time


def test_unknown_target_or_preset_is_a_clear_error():
    with pytest.raises(ValueError, match="conv9d.*linear"):
        bench.run("conv9d", "ci")
    with pytest.raises(ValueError, match="huge.*ci"):
        bench.run("linear", "huge")
    with pytest.raises(ValueError, match="conv9d"):
        bench.format_records("conv9d", [])


_PRESETS = {name: bench.Preset(f"{name} test", 0.001) for name in bench.PRESET_NAMES}


def test_target_decorator_checks_presets_and_names():
    with pytest.raises(ValueError, match="full"):
        bench.target("t_missing", presets={"ci": _PRESETS["ci"], "quick": _PRESETS["quick"]},
                     description="x")
    with pytest.raises(TypeError, match="ci"):
        bench.target("t_wrong", presets={**_PRESETS, "ci": {"ns": (4,)}}, description="x")
    with pytest.raises(ValueError, match="twice"):
        bench.target("linear", presets=_PRESETS, description="x")(lambda p: [])
    assert "t_missing" not in bench.TARGETS and "t_wrong" not in bench.TARGETS


@pytest.fixture
def toy_target():
    """A new target is one decorated function: here a tiny wide linear against the loop."""
    from torch import nn

    def run_one(n: int, p: bench.Preset, machine: dict) -> list[dict]:
        torch.manual_seed(0)
        models = [nn.Linear(4, 3) for _ in range(n)]
        W, b = measure.stacked_params(models)
        wide = measure.Contender("bmm", lambda x: torch.ops.wide.linear(x, W, b, strategy="bmm"), [W, b])
        return engine.run_case(models, torch.randn(n, 2, 4), [wide], [measure.loop_contender(models)],
                               mode="inference", base={"target": "toy", "batch": 2, "dtype": "float32"},
                               min_run_time=p.min_run_time, machine=machine)

    presets = {k: dataclasses.replace(v, grid={"ns": (2, 3)}) for k, v in _PRESETS.items()}

    @bench.target("toy", presets=presets, description="a test target")
    def toy(p: bench.Preset) -> list[bench.Job]:
        return [bench.Job(f"N={n}", lambda machine, n=n: run_one(n, p, machine)) for n in p.grid["ns"]]

    yield toy
    registry._REGISTRY.pop("toy")


def test_new_target_runs_lists_and_prints(toy_target, capsys):
    records = bench.run("toy", "ci")
    assert [r["n"] for r in records] == [2, 3]
    for r in records:
        check_design_fields(r, "toy", "ci")
    assert bench.format_records("toy", records).count("\ntoy ") == 2  # default: engine.format_table
    assert cli.main(["benchmark", "--list"]) == 0  # no edit anywhere else: `make bench` runs it
    assert "toy" in capsys.readouterr().out.split()
    custom = bench.run("toy", bench.Preset("one N", 0.001, {"ns": (5,)}))
    assert [(r["n"], r["preset"]) for r in custom] == [(5, "custom")]


def test_a_record_not_built_by_make_record_is_refused(monkeypatch):
    spec = bench.TARGETS["linear"]
    bad = dataclasses.replace(spec, jobs=lambda p: [bench.Job("bad", lambda machine: [{"target": "linear"}])])
    monkeypatch.setitem(registry._REGISTRY, "linear", bad)
    with pytest.raises(RuntimeError, match="make_record"):
        bench.run("linear", "ci")


# ---------------------------------------------------------------------------------- records

#: Targets whose records are checked by check_design_fields elsewhere: the whole ``ci`` runs of
#: test_bench_vision.py, and real's first ``ci`` case (ResNet-18), which the --case test below runs.
CHECKED_ELSEWHERE = (*VISION_CI_TARGETS, "real")


def _fused_integration_runs_in_this_process(monkeypatch) -> None:
    """``integrations``' fused runs (cold, then warm from the cold run's compile cache) in this
    process, by the child's own ``one_run`` (test_lightning.py checks that it trains as the
    sequential run does); its sequential run stays a fresh process, so the record still comes
    through the child script and its JSON. Each fresh process imports torch and Lightning: three of
    them were most of this case's time."""
    from wide_compiler.bench import _integrations_child as child
    from wide_compiler.bench import integrations

    fresh = integrations._fresh

    def run(framework, fused, n, steps, weights, cache_dir):
        if not fused:
            return fresh(framework, fused, n, steps, weights, cache_dir)
        with pytest.MonkeyPatch.context() as env:  # the fresh process's environment (_fresh)
            env.setenv("WIDE_COMPILER_CACHE_DIR", cache_dir)
            env.delenv("WIDE_COMPILE_CACHE", raising=False)
            return child.one_run(framework, fused, n, steps, weights)

    monkeypatch.setattr(integrations, "_fresh", run)


@pytest.mark.parametrize("name", [t for t in bench.TARGETS if t not in CHECKED_ELSEWHERE])
def test_first_ci_case_of_every_target_has_the_design_fields(name, monkeypatch, tmp_path):
    """Every target's first ``ci`` case only: seconds per target (a new target is covered here
    without editing this file). The targets of CHECKED_ELSEWHERE are not run twice; linear's
    whole ``ci`` run is also in test_cli.py."""
    monkeypatch.setenv("WIDE_COMPILER_CACHE_DIR", str(tmp_path))
    if name == "integrations":
        _fused_integration_runs_in_this_process(monkeypatch)
    spec = bench.TARGETS[name]
    monkeypatch.setitem(registry._REGISTRY, name,
                        dataclasses.replace(spec, jobs=lambda p: list(spec.jobs(p))[:1]))
    records = bench.run(name, "ci")
    assert records
    for r in records:
        check_design_fields(r, name, "ci")
    table = bench.format_records(name, records)
    assert all(r["case"] in table for r in records)


def test_optim_records_compare_with_torch_optim():
    p = dataclasses.replace(optim.OPTIM_PRESETS["ci"], grid={"ns": (3,), "optimizers": ("adam", "sgd_momentum")})
    records = bench.run("optim", p)
    assert [r["case"] for r in records] == ["mlp/adam", "mlp/sgd_momentum"]
    for r in records:
        check_design_fields(r, "optim", "custom")
        assert r["strategy"] == f"fused:{torch.ops.wide._optim_cpu_capability()}"
        assert r["max_abs_err"] < 1e-5 and r["batch"] is None and r["mode"] == "train"
        assert {"groups", "groups_foreach", "loop"} <= set(r["baseline_ms"])
    assert "stacked_torch_ops" in records[0]["baseline_ms"]


def test_train_records_compare_with_separate_models():
    p = dataclasses.replace(optim.TRAIN_PRESETS["ci"], grid={"ns": (2,), "models": ("mlp", "cnn")})
    records = bench.run("train", p)
    assert [r["case"].split("/")[0] for r in records] == ["mlp", "cnn"]
    for r in records:
        check_design_fields(r, "train", "custom")
        assert r["strategy"].startswith("fused:") and r["max_abs_err"] < 1e-5
        assert set(r["baseline_ms"]) == {"loop", "vmap_one_lr"}
        if r["case"].endswith("/compile"):
            assert r["strategies"] and r["chosen_strategy"]


def test_optimizer_check_detects_a_wrong_member():
    """The check behind ``max_abs_err``: one step from the same state, wide and per member."""
    import wide_compiler as wc

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(3, 5))
    w.grad = torch.randn(3, 5)
    opt = wc.optim.Adam([w], lr=[1e-3, 1e-2, 1e-1])
    for _ in range(3):
        opt.step()
    refs = optim._references(opt, [w], torch.optim.Adam)
    for i, (ps, _) in enumerate(refs):
        ps[0].grad = w.grad[i].clone()
    refs[1][1].param_groups[0]["lr"] = 0.5  # member 1's reference steps differently
    opt.step()
    for _, ref in refs:
        ref.step()
    errs = [measure.params_max_abs_err([refs[i][0]], [w[i:i + 1]]) for i in range(3)]
    assert errs[0] < 1e-6 and errs[2] < 1e-6 and errs[1] > 0.1


def test_cases_filter_runs_only_the_named_cases_and_names_the_known_ones():
    """``benchmark TARGET --case NAME``: the real-size target's ResNet-18 at toy width, alone; a
    name that matches nothing lists the cases."""
    records = bench.run("real", "ci", cases=["resnet18"])
    assert [j.label for j in bench.TARGETS["real"].jobs(bench.TARGETS["real"].presets["ci"])][0] == "resnet18 N=2"
    assert {r["case"] for r in records} == {"resnet18"} and {r["mode"] for r in records} == {"inference", "train"}
    for r in records:
        check_design_fields(r, "real", "ci")  # real's first ci case (CHECKED_ELSEWHERE)
        assert {"loop", "loop_cl", "vmap"} <= set(r["baseline_ms"]), r["errors"]
        assert r["max_abs_err"] < 1e-3, r
    with pytest.raises(ValueError, match="no case matches.*resnet18 N=2"):
        bench.run("real", "ci", cases=["resnet19"])
