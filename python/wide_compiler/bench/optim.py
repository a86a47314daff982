# ruff: noqa: B023  (closures are timed inside the iteration that defines them)
"""Benchmarks of training N members as one (DESIGN §6, §10).

Two targets:

* ``optim`` — the optimizer step alone, over the parameters of N MLPs
  (64-128-128-10 per member), every member with its own learning rate: the fused per-member
  ``wide_compiler.optim`` step on stacked ``[N, ...]`` tensors against ``torch.optim`` with N param
  groups (the only way to get per-member learning rates today) in its single-tensor (CPU
  default), ``foreach`` and ``fused`` variants, against N separate ``torch.optim`` optimizers
  stepped in a Python loop, and against the same update written with torch ops on the stacked
  tensors (per-member hyperparameters broadcast as ``[N, 1, ...]``).
* ``train`` — one full training step (forward, per-member loss, backward, Adam step) of an MLP
  and of a small CNN: the wide model (``compile()``; for the CNN, when ``compile()`` cannot widen
  it, a ``torch.func`` forward over the stacked parameters, reported as ``case``) with
  ``wide_compiler.optim.Adam`` against N separate models each with its own ``torch.optim.Adam``,
  and against ``torch.func.stack_module_state`` + ``functional_call`` + ``vmap`` with ONE
  ``torch.optim.Adam`` over the stacked parameters (one shared learning rate: it cannot give
  members their own).

Records: ``{"target", "case", "n", "optimizer", "dtype", "wide_ms", "baseline_ms": {...},
"speedup": {...}, "machine"}``; ``speedup[b] = baseline_ms[b] / wide_ms``.
"""
from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, stack_module_state

from .. import optim as wopt
from .engine import machine_info, time_ms

__all__ = ["PRESETS", "format_records", "run_optim", "run_train"]

log = logging.getLogger(__name__)

PRESETS: dict[str, dict[str, Any]] = {
    "ci": {"ns": (4,), "min_run_time": 0.02},
    "quick": {"ns": (8, 32, 128), "min_run_time": 0.3},
    "full": {"ns": (8, 32, 128), "min_run_time": 1.0},
}


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(32, 10))


def _lrs(n: int) -> list[float]:
    return torch.logspace(-4, -2, n).tolist()


# ------------------------------------------------------------------------------- optimizer step
def _stacked_torch_adam(params, lr, betas=(0.9, 0.999), eps=1e-8):
    """Adam with per-member lr written with torch ops on stacked tensors (no fused kernel)."""
    state = {p: {"step": 0, "m": torch.zeros_like(p), "v": torch.zeros_like(p)} for p in params}
    lr = torch.tensor(lr, dtype=torch.float32)

    @torch.no_grad()
    def step():
        for p in params:
            st = state[p]
            st["step"] += 1
            b1, b2 = betas
            st["m"].lerp_(p.grad, 1 - b1)
            st["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
            bc1, bc2 = 1 - b1 ** st["step"], 1 - b2 ** st["step"]
            denom = (st["v"].sqrt() / bc2 ** 0.5).add_(eps)
            step_size = (lr / bc1).view(-1, *([1] * (p.dim() - 1)))
            p.addcdiv_(st["m"] * step_size, denom, value=-1)
    return step


def run_optim(preset: str = "quick", *, progress: bool = False) -> list[dict[str, Any]]:
    cfg = PRESETS[preset]
    records = []
    for kind in ("adam", "sgd_momentum"):
        for n in cfg["ns"]:
            torch.manual_seed(0)
            models = [mlp() for _ in range(n)]
            stacked = [nn.Parameter(torch.stack([m.get_parameter(k).detach() for m in models]))
                       for k, _ in models[0].named_parameters()]
            for p in stacked:
                p.grad = torch.randn_like(p) * 1e-3
            for m, in zip(models):
                for p in m.parameters():
                    p.grad = torch.randn_like(p) * 1e-3
            lrs = _lrs(n)
            if kind == "adam":
                wide = wopt.Adam(stacked, lr=lrs)
                make = lambda groups, **kw: torch.optim.Adam(groups, **kw)
            else:
                wide = wopt.SGD(stacked, lr=lrs, momentum=0.9)
                make = lambda groups, **kw: torch.optim.SGD(groups, momentum=0.9, **kw)
            groups = [{"params": list(m.parameters()), "lr": lr} for m, lr in zip(models, lrs)]
            baselines: dict[str, Callable[[], Any]] = {
                "groups": make(groups, foreach=False).step,
                "groups_foreach": make(groups, foreach=True).step,
            }
            if kind == "adam" or hasattr(torch.optim.SGD, "fused"):
                try:
                    baselines["groups_fused"] = make(groups, fused=True).step
                except (RuntimeError, TypeError) as e:   # pragma: no cover
                    log.info("fused %s unavailable: %s", kind, e)
            separate = [make(list(m.parameters()), lr=lr) for m, lr in zip(models, lrs)]
            baselines["loop"] = lambda separate=separate: [o.step() for o in separate]
            if kind == "adam":
                baselines["stacked_torch_ops"] = _stacked_torch_adam(stacked_copy := [
                    nn.Parameter(p.detach().clone()) for p in stacked], lrs)
                for p, q in zip(stacked_copy, stacked):
                    p.grad = q.grad.clone()
            rec = _record("optim", f"mlp/{kind}", n, wide.step, baselines, cfg, progress)
            records.append(rec)
    return records


# --------------------------------------------------------------------------------- training step
def run_train(preset: str = "quick", *, progress: bool = False) -> list[dict[str, Any]]:
    import wide_compiler as wc

    cfg = PRESETS[preset]
    records = []
    for name, factory, shape, batch in (("mlp", mlp, (64,), 32), ("cnn", cnn, (3, 16, 16), 16)):
        for n in cfg["ns"]:
            torch.manual_seed(0)
            models = [factory() for _ in range(n)]
            x = torch.randn(n, batch, *shape)
            y = torch.randint(0, 10, (n, batch))
            lrs = _lrs(n)
            case = f"{name}/compile"
            try:
                wide = wc.compile([copy.deepcopy(m) for m in models], torch.randn(batch, *shape),
                                  config=wc.WideConfig.fast())
                forward = wide
                params = list(wide.parameters())
            except Exception as e:  # noqa: BLE001 (compile() may not widen every layer yet)
                log.info("compile() of %s failed (%s); using a torch.func forward", name, e)
                case = f"{name}/func+wide.optim"
                p_st, b_st = stack_module_state([copy.deepcopy(m) for m in models])
                params = [nn.Parameter(v.detach()) for v in p_st.values()]
                names = list(p_st)
                base = copy.deepcopy(models[0]).to("meta")

                def forward(x, params=params, names=names, base=base, b_st=b_st):
                    def one(ps, bs, xi):
                        return functional_call(base, (dict(zip(names, ps)), bs), (xi,))
                    return torch.vmap(one)(params, b_st, x)
            opt = wopt.Adam(params, lr=lrs)

            def wide_step(forward=forward, opt=opt):
                opt.zero_grad()
                wopt.member_losses(F.cross_entropy, forward(x), y).sum().backward()
                opt.step()

            sep = [copy.deepcopy(m) for m in models]
            sep_opts = [torch.optim.Adam(m.parameters(), lr=lr) for m, lr in zip(sep, lrs)]

            def loop_step():
                for i, (m, o) in enumerate(zip(sep, sep_opts)):
                    o.zero_grad()
                    F.cross_entropy(m(x[i]), y[i]).backward()
                    o.step()

            p_st, b_st = stack_module_state([copy.deepcopy(m) for m in models])
            vparams = {k: nn.Parameter(v.detach()) for k, v in p_st.items()}
            vbase = copy.deepcopy(models[0]).to("meta")
            vopt = torch.optim.Adam(vparams.values(), lr=lrs[0])

            def vmap_step():
                vopt.zero_grad()
                out = torch.vmap(lambda p, b, xi: functional_call(vbase, (p, b), (xi,)))(vparams, b_st, x)
                F.cross_entropy(out.reshape(-1, 10), y.reshape(-1)).mul(n).backward()
                vopt.step()

            rec = _record("train", case, n, wide_step, {"loop": loop_step, "vmap_one_lr": vmap_step},
                          cfg, progress)
            rec["batch"] = batch
            records.append(rec)
    return records


def _record(target, case, n, wide_fn, baselines, cfg, progress) -> dict[str, Any]:
    mrt = cfg["min_run_time"]
    wide_ms = time_ms(wide_fn, min_run_time=mrt)
    base_ms = {}
    for k, fn in baselines.items():
        base_ms[k] = time_ms(fn, min_run_time=mrt)
    rec = {"target": target, "case": case, "n": n, "dtype": "float32", "mode": "train",
           "wide_ms": wide_ms, "baseline_ms": base_ms,
           "speedup": {k: v / wide_ms for k, v in base_ms.items()}, "machine": machine_info()}
    if progress:
        log.warning("%s", format_records([rec], header=False))
    return rec


def format_records(records, *, header: bool = True) -> str:
    """One line per record: case, N, wide ms, then each baseline's ms and speedup."""
    lines = []
    if header:
        lines.append(f"{'target':6s} {'case':24s} {'N':>4s} {'wide ms':>9s}  baselines (ms, speedup of wide)")
    for r in records:
        base = "  ".join(f"{k} {v:.3f} ({r['speedup'][k]:.2f}x)" for k, v in r["baseline_ms"].items())
        lines.append(f"{r['target']:6s} {r['case']:24s} {r['n']:4d} {r['wide_ms']:9.3f}  {base}")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m wide_compiler.bench.optim [preset]
    import json
    import sys

    preset = sys.argv[1] if len(sys.argv) > 1 else "quick"
    recs = run_optim(preset) + run_train(preset)
    print(format_records(recs))
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as f:
            json.dump(recs, f, indent=1, default=str)
