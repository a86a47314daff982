"""wide_compiler.analyze: the report's fields, JSON/Markdown, fallbacks, memory search, factories.

Speed numbers are only checked for being finite and positive (the machine is shared)."""
from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from torch import nn
from wide_compiler import testing, zoo
from support import cpu_only
from wide_compiler.analyze import (
    AnalysisReport,
    _max_n,
    analyze,
    load_factory,
    parse_bytes,
)

FAST = {"repeats": 2, "block_s": 0.005, "memory": "200MB"}


@pytest.fixture(scope="module")
def mlp_report() -> AnalysisReport:
    torch.manual_seed(0)
    return analyze(lambda: zoo.MLP(16, 32, 4), torch.randn(8, 16), n=(2, 4), **FAST)


@pytest.fixture(scope="module")
def cnn_report() -> AnalysisReport:
    torch.manual_seed(0)
    return analyze(lambda: zoo.ConvNet(channels=4), torch.randn(2, 3, 8, 8), n=(2, 4), **FAST)


class _Erfinv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.special.erfinv(torch.tanh(self.fc(x)) * 0.5)  # no widen rule: fallback


def _positive(v) -> bool:
    return isinstance(v, float) and math.isfinite(v) and v > 0


@pytest.mark.parametrize("which", ["mlp", "cnn"])
def test_report_fields(which, mlp_report, cnn_report):
    r = mlp_report if which == "mlp" else cnn_report
    assert r.ns == [2, 4] and r.modes == ["inference", "train"]
    assert {(s["n"], s["mode"]) for s in r.speed} == {(n, m) for n in (2, 4) for m in ("inference", "train")}
    for s in r.speed:
        assert _positive(s["ms"]["wide"]) and _positive(s["ms"]["loop"])
        assert _positive(s["speedup"]["loop"]) and _positive(s["samples_per_s_per_member"]["wide"])
        assert "vmap" in s["ms"] or "vmap" in s["errors"]  # vmap measured, or why it failed
        if s["mode"] == "inference":  # the timed wide model computes what the members compute
            assert s["max_abs_err_vs_loop"] <= 10 * testing.tolerance(torch.float32)["atol"]
    assert r.compile["wide_ops"] and all(o["strategy"] for o in r.compile["wide_ops"])
    assert r.compile["fallbacks"] == []
    assert [run["mode"] for run in r.profile["runs"]] == ["inference", "train"]
    assert all(run["wide"] and run["loop"] for run in r.profile["runs"])
    mem = r.memory
    assert mem["param_bytes_per_member"] > 0 and mem["activation_bytes_per_member"] > 0
    assert mem["adam_bytes_per_member"] == 2 * mem["param_bytes_per_member"]
    assert mem["max_n_train"] >= 1 and mem["budget_bytes"] == 200_000_000
    assert r.recommendations
    text = str(r)
    for section in ("Compile", "Speed", "Where the time goes", "Memory", "Recommendations"):
        assert section in text


def test_cnn_ops_and_vmap_train(cnn_report):
    ops = {o["op"] for o in cnn_report.compile["wide_ops"]}
    assert any("conv" in o for o in ops), ops
    assert cnn_report.compile["layout_conversions"]  # N-first -> packed before the first conv
    assert "layout conversions" in str(cnn_report)
    train = [s for s in cnn_report.speed if s["mode"] == "train"]
    # vmap of BatchNorm in train mode updates running stats in place: recorded either way
    assert all(_positive(s["ms"]["vmap"]) or s["errors"]["vmap"] for s in train)


def test_json_roundtrip_and_markdown(mlp_report):
    data = json.loads(mlp_report.to_json())
    assert set(data) >= {"model", "ns", "compile", "speed", "profile", "memory", "recommendations", "machine"}
    assert data["speed"][0]["ms"]["wide"] > 0
    md = mlp_report.to_markdown()
    assert "| N | mode | wide ms |" in md and "|---|" in md
    assert md.startswith("# wide_compiler analyze: MLP")


def test_fallback_shows_source_line_and_fix():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = analyze(_Erfinv(), torch.randn(4, 8), n=(2,), modes=("inference",), **FAST)
    fbs = r.compile["fallbacks"]
    assert fbs and "erfinv" in fbs[0]["op"]
    assert "test_analyze.py" in fbs[0]["source"] and "erfinv" in fbs[0]["source"]
    assert "@wc.register" in fbs[0]["fix"]
    assert "erfinv" in str(r) and any(rec["kind"] == "fallback" for rec in r.recommendations)


def test_memory_search_small_budget():
    assert parse_bytes("200MB") == 200_000_000 and parse_bytes("1GiB") == 2**30
    with pytest.raises(ValueError, match="8GB"):
        parse_bytes("lots")
    n, tried = _max_n(10.0, 100.0, 1000.0)
    assert n == 9 and tried[:4] == [1, 2, 4, 8]
    assert _max_n(0.0, 100.0, 50.0)[0] == 0
    r = analyze(lambda: zoo.MLP(64, 256, 10), torch.randn(64, 64), n=(1,), modes=("train",),
                repeats=1, block_s=0.005, memory="200MB", memory_ns=(1, 2))
    mem = r.memory
    assert 1 <= mem["max_n_train"] < 10**6
    fixed = mem["activation_fixed_bytes"]
    assert fixed + mem["max_n_train"] * mem["train_bytes_per_member"] <= 200_000_000
    assert fixed + (mem["max_n_train"] + 1) * mem["train_bytes_per_member"] > 200_000_000
    assert "LINEARLY" in mem["method"]


@cpu_only
def test_load_factory_and_cli(tmp_path, capsys):
    f = tmp_path / "my_model.py"
    f.write_text("import torch\n\ndef make():\n    return torch.nn.Sequential(torch.nn.Linear(6, 5), "
                 "torch.nn.ReLU(), torch.nn.Linear(5, 2))\n")
    factory = load_factory(f"{f}:make")
    assert isinstance(factory(), nn.Sequential)
    with pytest.raises(AttributeError, match="nope"):
        load_factory(f"{f}:nope")
    with pytest.raises(ValueError):
        load_factory("no_colon_here")

    from wide_compiler import cli

    parser = cli.build_parser()
    out_json = tmp_path / "r.json"
    args = parser.parse_args(["analyze", f"{f}:make", "--shape", "3,6", "-n", "2", "--modes", "inference",
                              "--repeats", "1", "--memory", "50MB", "--json", str(out_json)])
    assert args.func(args) == 0
    assert "Recommendations" in capsys.readouterr().out
    assert json.loads(out_json.read_text())["ns"] == [2]


def test_plot(mlp_report, tmp_path):
    from wide_compiler.analyze import plot

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="matplotlib"):
            plot(mlp_report, str(tmp_path / "p.png"))
    else:
        plot(mlp_report, str(tmp_path / "p.png"))
        assert (tmp_path / "p.png").stat().st_size > 0


class _LSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(4, 6, batch_first=True)

    def forward(self, x):
        return self.rnn(x)[0]


def test_vmap_failure_is_recorded():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = analyze(_LSTM, torch.randn(3, 5, 4), n=(2,), modes=("inference",), **FAST)
    s = r.speed[0]
    assert "vmap" not in s["ms"] and "lstm" in s["errors"]["vmap"]
    assert _positive(s["ms"]["wide"]) and "vmap failed (inference)" in str(r)


def test_bad_arguments():
    with pytest.raises(ValueError, match="modes"):
        analyze(lambda: nn.Linear(2, 2), torch.randn(1, 2), n=(1,), modes=("fast",))
    with pytest.raises(ValueError, match="N >= 1"):
        analyze(lambda: nn.Linear(2, 2), torch.randn(1, 2), n=(0,))
    with pytest.raises(TypeError, match="factory returned"):
        analyze(lambda: 3, torch.randn(1, 2), n=(1,))


class _PostNorm(nn.Module):
    """x + fc(x), then LayerNorm: the eval graph fuses the add into the norm (one renamed node)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.norm(x + self.fc(x)))


def test_compile_table_has_one_row_per_op():
    """Each op of the model is one row with its strategy in both graphs, even where the eval
    graph's rewrite renamed its node (`add_layer_norm` there, `layer_norm` in the train graph)."""
    import wide_compiler as wc
    from wide_compiler.analyze import _compile_info

    torch.manual_seed(0)
    wide = wc.compile([_PostNorm() for _ in range(2)], torch.randn(3, 8), config=wc.WideConfig.fast())
    info = _compile_info(wide, 0.0, ["inference", "train"])
    rows = [(o["module"], o["op"]) for o in info["wide_ops"]]
    assert sorted(rows) == sorted({("fc", "wide.linear"), ("norm", "wide.layer_norm"), ("head", "wide.linear")})
    for o in info["wide_ops"]:
        assert set(o["strategy"]) == {"eval", "train"}, o
        assert o["input"] != "-", o


def _report_with_speedups(inference: list[float], train: list[float]) -> AnalysisReport:
    ns = [2, 4, 8][: len(inference)]
    speed = [{"n": n, "mode": mode, "speedup": {"loop": x, "vmap": x / 2}}
             for mode, xs in (("inference", inference), ("train", train)) for n, x in zip(ns, xs)]
    return AnalysisReport(model="M", input_shapes=[[2, 3]], ns=ns, modes=["inference", "train"], repeats=1,
                          config="fast", compile={}, speed=speed, profile={}, memory={},
                          recommendations=[], machine={}, inputs=["float32[2, 3]"])


def test_plot_gives_each_panel_its_own_y_axis_and_clips_nothing():
    """Training speedups 10x the inference ones: each panel's y axis holds all of its points
    (the labels above them too), whichever panel is drawn first."""
    pytest.importorskip("matplotlib")
    from wide_compiler.analyze import _pyplot, _speedup_figure

    plt = _pyplot()
    for inference, train in (([1.1, 1.5, 2.0], [12.0, 25.0, 40.0]), ([30.0, 50.0, 80.0], [0.5, 0.8, 1.2])):
        fig = _speedup_figure(plt, _report_with_speedups(inference, train))
        try:
            axes = fig.axes
            assert [ax.get_title() for ax in axes] == ["inference", "train"]
            for ax, ys in zip(axes, (inference, train)):
                bottom, top = ax.get_ylim()
                assert bottom <= 0 and top >= 1.1 * max(ys), (ax.get_title(), ax.get_ylim(), ys)
                assert top <= 2 * max(max(ys), 1.0)  # its own scale, not the other panel's
                assert ax.get_shared_y_axes().get_siblings(ax) == [ax]
        finally:
            plt.close(fig)


def test_profile_writes_no_kineto_lines_to_stderr():
    """torch.profiler's kineto writes `USDT ... profiler_start/stop` at every profile (Note
    [Profiler noise]); analyze's profiles write nothing."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    code = ("import torch\nfrom wide_compiler.analyze import _profile\n"
            "rows = _profile(lambda: torch.ones(64, 64) @ torch.ones(64, 64), calls=2, top=3, rounds=2)\n"
            "assert rows and rows[0]['ms'] >= 0, rows\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=900, env=env)  # a hang guard
    assert proc.returncode == 0, proc.stderr
    assert "USDT" not in proc.stderr and "profiler_start" not in proc.stderr, proc.stderr
