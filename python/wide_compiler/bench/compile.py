"""``benchmark compile``: how long :func:`wide_compiler.compile` takes, cold and warm, beside
``torch.export`` of one member (issue 45; DESIGN §5, §10).

Per model (the standard ResNet-18 of the benchmark zoo, DenseNet-121 (:func:`densenet121`,
torchvision's layout), a BERT-like encoder from ``transformers`` (skipped without it) and a small
MLP), N members with the default :class:`~wide_compiler.WideConfig`, three fresh Python processes
(so nothing cached in memory helps; the import of torch and wide_compiler is not counted):

- ``export``: ``torch.export`` of member 0 in train mode, then in eval mode (non-strict, batch
  dim dynamic: what the compile captures);
- ``cold``: ``wc.compile`` (the train graph) then ``wide.eval()`` (the eval graph), with a new,
  empty cache directory;
- ``warm``: the same in a new process with the cold run's cache directory (the strategy cache,
  and the compile cache where there is one).

One record per model and config (``WideConfig()`` and ``WideConfig.fast()``, in ``config``):
``wide_ms`` the cold compile (train + eval graphs), ``baseline_ms``
``{"export": train + eval export of one member}``, and the parts: ``cold_train_s``,
``cold_eval_s``, ``warm_s`` (``warm_train_s``, ``warm_eval_s``), ``export_train_s``,
``export_eval_s``, ``cold_vs_export`` (the issue's target: at most 1.5), ``cold_cpu_vs_export``
(the same in CPU time of the processes: what a busy machine's wall clock cannot show), ``max_abs_err`` the
warm model's train-mode outputs against the members'. The ``ci`` preset (a smoke run) runs the
three in this process instead, at toy widths.

Example::

    >>> from wide_compiler import bench
    >>> sorted(bench.TARGETS["compile"].presets)
    ['ci', 'full', 'quick']
"""
from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from .. import measure
from . import engine
from .registry import Job, Preset, target

__all__ = ["DenseNet", "compile_times", "densenet121", "make_case"]

log = logging.getLogger(__name__)


class _DenseLayer(nn.Module):
    """BN-ReLU-1x1 conv (to ``bn_size * growth`` channels), BN-ReLU-3x3 conv (to ``growth``),
    concatenated to its input."""

    def __init__(self, cin: int, growth: int, bn_size: int) -> None:
        super().__init__()
        self.norm1, self.conv1 = nn.BatchNorm2d(cin), nn.Conv2d(cin, bn_size * growth, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(bn_size * growth)
        self.conv2 = nn.Conv2d(bn_size * growth, growth, 3, padding=1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv1(F.relu(self.norm1(x)))
        return torch.cat([x, self.conv2(F.relu(self.norm2(y)))], 1)


class DenseNet(nn.Module):
    """DenseNet-BC (torchvision's layout, written here: no torchvision needed): a 7x7 stride-2
    stem conv with BatchNorm, ReLU and 3x3 max pool; dense blocks of ``blocks`` layers each
    adding ``growth`` channels, separated by transitions (BN-ReLU-1x1 conv halving the channels,
    2x2 average pool); a final BatchNorm, ReLU, global average pool and a linear head."""

    def __init__(self, blocks: tuple[int, ...] = (6, 12, 24, 16), growth: int = 32, stem: int = 64,
                 bn_size: int = 4, classes: int = 1000) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, stem, 7, 2, 3, bias=False), nn.BatchNorm2d(stem),
                                   nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
        c = stem
        for k, count in enumerate(blocks):
            for _ in range(count):
                layers.append(_DenseLayer(c, growth, bn_size))
                c += growth
            if k < len(blocks) - 1:
                layers += [nn.BatchNorm2d(c), nn.ReLU(inplace=True), nn.Conv2d(c, c // 2, 1, bias=False),
                           nn.AvgPool2d(2, 2)]
                c //= 2
        layers += [nn.BatchNorm2d(c), nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1), nn.Flatten(1)]
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def densenet121(**kwargs) -> DenseNet:
    """DenseNet-121: blocks of 6, 12, 24 and 16 layers, growth 32 (8M parameters).

    >>> sum(p.numel() for p in densenet121().parameters())
    7978856
    """
    return DenseNet((6, 12, 24, 16), **kwargs)


# --- the target ----------------------------------------------------------------------------------
PRESETS = {
    "ci": Preset("toy widths, N=2, in this process (a smoke run: seconds)", 0.01,
                 {"ns": (2,), "size": "tiny", "models": ("mlp", "resnet18"), "fresh": False}),
    "quick": Preset("resnet18, densenet121, bert (4 layers of 256), bert-base, mlp at N=4, default and fast() "
                    "configs, fresh processes (minutes)", 0.5,
                    {"ns": (4,), "size": "real", "models": ("resnet18", "densenet121", "bert", "bert-base", "mlp"),
                     "configs": ("default", "fast"), "fresh": True}),
    "full": Preset("the quick models at N=4 and 16 (many minutes)", 0.5,
                   {"ns": (4, 16), "size": "real", "models": ("resnet18", "densenet121", "bert", "bert-base", "mlp"),
                    "configs": ("default", "fast"), "fresh": True}),
}


def make_case(name: str, size: str, n: int) -> tuple[list[nn.Module], tuple]:
    """N members of model ``name`` (``size``: ``"real"`` or ``"tiny"``) and one member's sample,
    seeded. ``bert`` needs ``transformers`` (ImportError without it)."""
    from ..zoo import ResNet18

    torch.manual_seed(0)
    tiny = size == "tiny"
    if name == "mlp":
        width = 16 if tiny else 256
        make = lambda: nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width),  # noqa: E731
                                     nn.ReLU(), nn.Linear(width, 10))
        return [make() for _ in range(n)], (torch.randn(32, 64),)
    if name == "resnet18":
        return [ResNet18(width=8 if tiny else 64, classes=10 if tiny else 1000) for _ in range(n)], \
            (torch.randn(2 if tiny else 8, 3, 32 if tiny else 64, 32 if tiny else 64),)
    if name == "densenet121":
        kw = dict(blocks=(2, 2), growth=4, stem=8, classes=10) if tiny else {}
        return [DenseNet(**kw) if tiny else densenet121() for _ in range(n)], \
            (torch.randn(2 if tiny else 8, 3, 32 if tiny else 64, 32 if tiny else 64),)
    if name in ("bert", "bert-base"):
        import transformers

        if name == "bert-base":  # BertConfig()'s own widths (12 layers of 768, vocabulary 30522)
            cfg = transformers.BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        else:
            cfg = transformers.BertConfig(
                vocab_size=1000, hidden_size=32 if tiny else 256, num_hidden_layers=2 if tiny else 4,
                num_attention_heads=4, intermediate_size=64 if tiny else 1024, max_position_embeddings=128,
                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        return [_Pooled(transformers.BertModel(cfg)) for _ in range(n)], (torch.randint(0, 1000, (4, 64)),)
    raise ValueError(f"benchmark compile: unknown model {name!r}; expected mlp, resnet18, densenet121, bert or "
                     "bert-base")


class _Pooled(nn.Module):
    """A transformers encoder returning its pooled output (every parameter gets a gradient)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids).pooler_output


def compile_times(what: str, name: str, size: str, n: int, cache_dir: str,
                  config: str = "default") -> dict[str, float]:
    """Seconds of one measurement in this process: ``what="export"`` times ``torch.export`` of
    member 0 in train then eval mode; ``"compile"`` times ``wc.compile`` (train graph) then
    ``.eval()`` (eval graph) with ``config`` (``"default"``: ``WideConfig()``, ``"fast"``:
    ``WideConfig.fast()``) and the cache in ``cache_dir``, and the train-mode outputs' largest
    difference from the members' (``max_abs_err``)."""
    import wide_compiler as wc

    members, sample = make_case(name, size, n)
    if what == "export":
        from torch.export import Dim, export

        dims = tuple({0: Dim.AUTO} for _ in sample)
        out = {}
        for mode in ("train", "eval"):
            model = members[0].train(mode == "train")
            watch, cpu = measure.Stopwatch(), time.process_time()
            export(model, sample, dynamic_shapes=dims, strict=False)
            out[f"{mode}_s"], out[f"{mode}_cpu_s"] = watch.seconds, time.process_time() - cpu
        return out
    config = (wc.WideConfig.fast() if config == "fast" else wc.WideConfig()).replace(cache_dir=cache_dir)
    watch, cpu = measure.Stopwatch(), time.process_time()
    wide = wc.compile(members, *sample, config=config)
    train_s, train_cpu_s = watch.seconds, time.process_time() - cpu
    watch.restart()
    cpu = time.process_time()
    wide.eval()
    eval_s, eval_cpu_s = watch.seconds, time.process_time() - cpu
    wide.train()
    with torch.no_grad():
        got = wide(*(x.unsqueeze(0).expand(n, *x.shape) for x in sample))
        want = torch.stack([m(*sample) for m in members])
    return {"train_s": train_s, "eval_s": eval_s, "train_cpu_s": train_cpu_s, "eval_cpu_s": eval_cpu_s,
            "max_abs_err": float((got - want).abs().max())}


def _in_fresh_process(what: str, name: str, size: str, n: int, cache_dir: str,
                      config: str = "default") -> dict[str, float]:
    """:func:`compile_times` in a new Python process (``python -m wide_compiler.bench._compile_child``)."""
    arg = json.dumps({"what": what, "name": name, "size": size, "n": n, "cache_dir": cache_dir, "config": config})
    env = dict(os.environ, WIDE_COMPILER_CACHE_DIR=cache_dir)
    done = subprocess.run([sys.executable, "-m", "wide_compiler.bench._compile_child", arg], capture_output=True,
                          text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"benchmark compile: the {what} process of {name} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _run(name: str, n: int, p: Preset, machine: Mapping[str, Any]) -> list[dict[str, Any]]:
    size = p.grid["size"]
    try:
        make_case(name, size, 1)
    except ImportError as e:
        log.warning("benchmark compile: %s skipped (%s)", name, e)
        return []
    measure_one = _in_fresh_process if p.grid["fresh"] else compile_times
    records = []
    with tempfile.TemporaryDirectory(prefix="wide_compile_bench_") as cache:
        exported = measure_one("export", name, size, n, os.path.join(cache, "export"))
        export_s = exported["train_s"] + exported["eval_s"]
        _, sample = make_case(name, size, 1)
        base = {"target": "compile", "case": name, "n": n, "batch": int(sample[0].shape[0]),
                "dtype": "float32", "shapes": {"sample": list(sample[0].shape)}}
        for config in p.grid.get("configs", ("default",)):
            where = os.path.join(cache, config)
            cold = measure_one("compile", name, size, n, where, config)
            warm = measure_one("compile", name, size, n, where, config)
            cold_s, warm_s = cold["train_s"] + cold["eval_s"], warm["train_s"] + warm["eval_s"]
            records.append(engine.make_record(
                base=base, mode="train", strategy="auto" if config == "default" else config,
                wide_ms=1e3 * cold_s, baseline_ms={"export": 1e3 * export_s},
                max_abs_err=max(cold["max_abs_err"], warm["max_abs_err"]), machine=machine,
                timing="fresh process" if p.grid["fresh"] else "in process", config=config,
                cold_train_s=cold["train_s"], cold_eval_s=cold["eval_s"], warm_s=warm_s,
                warm_train_s=warm["train_s"], warm_eval_s=warm["eval_s"], export_train_s=exported["train_s"],
                export_eval_s=exported["eval_s"], cold_vs_export=cold_s / export_s,
                cold_cpu_vs_export=(cold["train_cpu_s"] + cold["eval_cpu_s"])
                / max(exported["train_cpu_s"] + exported["eval_cpu_s"], 1e-9)))
    return records


def _format(records) -> str:
    """One row per model: cold and warm compile seconds beside torch.export's."""
    rows = [("model", "N", "config", "export s (train+eval)", "cold s (train+eval)", "cold/export", "CPU time",
             "warm s")]
    for r in records:
        rows.append((r["case"], str(r["n"]), r["config"], f"{r['export_train_s']:.2f}+{r['export_eval_s']:.2f}",
                     f"{r['cold_train_s']:.2f}+{r['cold_eval_s']:.2f}", f"{r['cold_vs_export']:.2f}x",
                     f"{r['cold_cpu_vs_export']:.2f}x",
                     f"{r['warm_s']:.2f}"))
    widths = [max(len(row[k]) for row in rows) for k in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows)


@target("compile", presets=PRESETS, formatter=_format,
        description="cold and warm wc.compile (train + eval graphs) vs torch.export of one member")
def compile_jobs(p: Preset) -> list[Job]:
    return [Job(f"{name} N={n}", functools.partial(_run, name, n, p)) for name in p.grid["models"]
            for n in p.grid["ns"]]
