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
