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

Records are :func:`.engine.make_record` records, mode ``train``, eager: ``strategy`` is
``fused:<ISA>``, the instruction set the fused optimizer kernels run with
(``torch.ops.wide._optim_cpu_capability()``); for ``train`` the compiled model's op strategies
are in ``strategies`` / ``chosen_strategy``. ``max_abs_err``: after the timed steps, every
member's optimizer state is loaded into its own ``torch.optim`` optimizer
(``WideOptimizer.member_state_dict``) and one more step (``optim``: the optimizer step on the same
gradients; ``train``: forward, loss, backward and step on the member's own batch) is taken by the
wide optimizer and by the N references; the largest difference of any member's parameters.
``batch`` is None for ``optim`` (no data), ``shape`` names the architecture.
"""
from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, stack_module_state

from .. import measure
from .. import optim as wopt
from . import engine
from .registry import Job, Preset, jobs_per_n, target

__all__ = ["OPTIM_PRESETS", "TRAIN_PRESETS", "cnn", "format_records", "mlp", "optim_jobs",
           "train_jobs"]

log = logging.getLogger(__name__)


def _presets(**grid: Any) -> dict[str, Preset]:
    """The presets of ``optim`` and ``train``: the Ns and timing, plus ``grid`` (what to run)."""
    return {"ci": Preset("N=4 (seconds)", 0.02, {"ns": (4,), **grid}),
            "quick": Preset("N in 8, 32, 128 (about a minute)", 0.3, {"ns": (8, 32, 128), **grid}),
            "full": Preset("N in 8, 32, 128, longer timings (minutes)", 1.0,
                           {"ns": (8, 32, 128), **grid})}


OPTIM_PRESETS = _presets(optimizers=("adam", "sgd_momentum"))
TRAIN_PRESETS = _presets(models=("mlp", "cnn"))

#: optimizer kind -> (wide optimizer, torch.optim optimizer, shared keyword arguments)
_OPTIMIZERS: dict[str, tuple[type, type, dict[str, Any]]] = {
    "adam": (wopt.Adam, torch.optim.Adam, {}),
    "sgd_momentum": (wopt.SGD, torch.optim.SGD, {"momentum": 0.9}),
}


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(32, 10))


#: model name -> (factory, one sample's shape, batch, ``shape`` of the record)
_MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], int, str]] = {
    "mlp": (mlp, (64,), 32, "64-128-128-10"),
    "cnn": (cnn, (3, 16, 16), 16, "3x16x16->16->32->10"),
}


def _lrs(n: int) -> list[float]:
    return torch.logspace(-4, -2, n).tolist()


def _fused_strategy() -> str:
    """``fused:<ISA>``: the instruction set of the fused optimizer kernels."""
    return f"fused:{torch.ops.wide._optim_cpu_capability()}"


def _references(wide: wopt.WideOptimizer, params: Sequence[torch.Tensor],
                make: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
                ) -> list[tuple[list[nn.Parameter], torch.optim.Optimizer]]:
    """Member ``i``'s parameters now (copies of ``p[i]``) and a torch.optim optimizer over them
    holding member ``i``'s state and hyperparameters (``member_state_dict``)."""
    refs = []
    for i in range(wide.n):
        ps = [nn.Parameter(p[i].detach().clone()) for p in params]
        opt = make(ps)
        opt.load_state_dict(wide.member_state_dict(i))
        refs.append((ps, opt))
    return refs


def _record(target_name: str, case: str, n: int, wide_fn: Callable[[], Any],
            baselines: dict[str, Callable[[], Any]], check: Callable[[], float], p: Preset,
            machine: dict[str, Any], *, batch: int | None, shape: str,
            errors: dict[str, str] | None = None, **extra: Any) -> dict[str, Any]:
    """Time ``wide_fn`` and every baseline, interleaved (:func:`wide_compiler.measure.time_with_baselines`: a
    failing baseline goes to ``errors``), then ``check()`` (the max abs error after the timed
    steps); one :func:`.engine.make_record`."""
    wide_ms, base_ms, errors = measure.time_with_baselines(
        {"wide": wide_fn}, baselines, min_run_time=p.min_run_time, errors=dict(errors or {}))
    return engine.make_record(
        base={"target": target_name, "case": case, "n": n, "batch": batch, "shape": shape,
              "dtype": "float32"},
        mode="train", strategy=_fused_strategy(), wide_ms=wide_ms["wide"], baseline_ms=base_ms,
        max_abs_err=check(), errors=errors, machine=machine, **extra)


# ------------------------------------------------------------------------------------ table
def format_records(records: Sequence[dict[str, Any]], *, header: bool = True) -> str:
    """One line per record: case, N, strategy, wide ms, max abs error, then each baseline's ms
    and the speedup of wide over it (many baselines: one column each would be too wide)."""
    cols = ("target", "case", "N", "strategy", "wide ms", "max err")
    rows = []
    for r in records:
        base = "  ".join(f"{k} {measure.fmt_ms(v)} ({measure.fmt_x(r['speedup'][k])})"
                         for k, v in r["baseline_ms"].items())
        err = r.get("max_abs_err")
        rows.append((str(r["target"]), str(r["case"]), str(r["n"]), str(r["strategy"]),
                     measure.fmt_ms(r["wide_ms"]), "-" if err is None else f"{err:.1e}", base))
    widths = [max([len(c)] + [len(row[i]) for row in rows]) for i, c in enumerate(cols)]
    right = {"N", "wide ms", "max err"}

    def line(cells: Sequence[str]) -> str:
        fixed = "  ".join(c.rjust(w) if name in right else c.ljust(w)
                          for c, w, name in zip(cells, widths, cols))
        return f"{fixed}  {cells[len(cols)]}".rstrip()

    body = [line((*cols, "baselines: ms (speedup of wide)")),
            line((*("-" * w for w in widths), ""))]
    body += [line(row) for row in rows]
    return engine.frame_table(records, body, header=header)


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


@target("optim", presets=OPTIM_PRESETS, formatter=format_records,
        description="the fused per-member optimizer step (Adam, SGD) vs torch.optim")
def optim_jobs(p: Preset) -> list[Job]:
    return jobs_per_n(_optim_job, p.grid["optimizers"], p, label="mlp/{}".format)


def _optim_job(kind: str, n: int, p: Preset, machine: dict[str, Any]) -> list[dict[str, Any]]:
    wide_cls, torch_cls, kwargs = _OPTIMIZERS[kind]
    make = functools.partial(torch_cls, **kwargs)
    torch.manual_seed(0)
    models = [mlp() for _ in range(n)]
    for m in models:  # every member its own gradients; the stacked ones hold the same values
        for q in m.parameters():
            q.grad = torch.randn_like(q) * 1e-3
    stacked = []
    for k, _ in models[0].named_parameters():
        s = nn.Parameter(torch.stack([m.get_parameter(k).detach() for m in models]))
        s.grad = torch.stack([m.get_parameter(k).grad for m in models])
        stacked.append(s)
    lrs = _lrs(n)
    wide = wide_cls(stacked, lr=lrs, **kwargs)
    groups = [{"params": list(m.parameters()), "lr": lr} for m, lr in zip(models, lrs)]
    baselines: dict[str, Callable[[], Any]] = {
        "groups": make(groups, foreach=False).step,
        "groups_foreach": make(groups, foreach=True).step,
    }
    errors = {}
    try:
        baselines["groups_fused"] = make(groups, fused=True).step
    except (RuntimeError, TypeError) as e:   # pragma: no cover (torch without a fused CPU kernel)
        errors["groups_fused"] = measure.error_text(e)
    separate = [make(list(m.parameters()), lr=lr) for m, lr in zip(models, lrs)]
    baselines["loop"] = lambda: [o.step() for o in separate]
    if kind == "adam":
        copies = [nn.Parameter(s.detach().clone()) for s in stacked]
        for c, s in zip(copies, stacked):
            c.grad = s.grad.clone()
        baselines["stacked_torch_ops"] = _stacked_torch_adam(copies, lrs)

    def check() -> float:  # one more step of the same gradients, wide and per member
        refs = _references(wide, stacked, make)
        for i, (ps, _) in enumerate(refs):
            for q, s in zip(ps, stacked):
                q.grad = s.grad[i].clone()
        wide.step()
        for _, opt in refs:
            opt.step()
        return measure.params_max_abs_err([ps for ps, _ in refs], stacked)

    return [_record("optim", f"mlp/{kind}", n, wide.step, baselines, check, p, machine,
                    batch=None, shape=_MODELS["mlp"][3], errors=errors)]


# --------------------------------------------------------------------------------- training step
@target("train", presets=TRAIN_PRESETS, formatter=format_records,
        description="a training step (MLP, CNN; wide optim) vs N models + torch.optim / vmap")
def train_jobs(p: Preset) -> list[Job]:
    return jobs_per_n(_train_job, p.grid["models"], p)


def _train_job(name: str, n: int, p: Preset, machine: dict[str, Any]) -> list[dict[str, Any]]:
    import wide_compiler as wc

    factory, shape, batch, arch = _MODELS[name]
    torch.manual_seed(0)
    models = [factory() for _ in range(n)]
    names = [k for k, _ in models[0].named_parameters()]
    x = torch.randn(n, batch, *shape)
    y = torch.randint(0, 10, (n, batch))
    lrs = _lrs(n)
    try:
        wide = wc.compile([copy.deepcopy(m) for m in models], torch.randn(batch, *shape),
                          config=wc.WideConfig.fast())
    except Exception as e:  # noqa: BLE001 (compile() may not widen every layer yet)
        log.info("compile() of %s failed (%s); using a torch.func forward", name, e)
        wide = None
    if wide is not None:
        case, forward = f"{name}/compile", wide
        params = measure.wide_params_in_member_order(wide, models[0])  # in `names` order
        extra: dict[str, Any] = {
            "strategies": dict(wide.strategies),
            "chosen_strategy": ", ".join(sorted(set(wide.strategies.values())))}
    else:
        case, extra = f"{name}/func+wide.optim", {}
        p_st, b_st = stack_module_state([copy.deepcopy(m) for m in models])
        params = [nn.Parameter(v.detach()) for v in p_st.values()]
        base = copy.deepcopy(models[0]).to("meta")

        def forward(x, params=params, base=base, b_st=b_st):
            def one(ps, bs, xi):
                return functional_call(base, (dict(zip(names, ps)), bs), (xi,))
            return torch.vmap(one)(params, b_st, x)
    opt = wopt.Adam(params, lr=lrs)

    def wide_step():
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
        out = torch.vmap(lambda ps, bs, xi: functional_call(vbase, (ps, bs), (xi,)))(vparams, b_st, x)
        F.cross_entropy(out.reshape(-1, 10), y.reshape(-1)).mul(n).backward()
        vopt.step()

    def check() -> float:  # one more training step, wide and per member from the same state
        refs = _references(opt, params, torch.optim.Adam)
        wide_step()
        for i, (ps, ref_opt) in enumerate(refs):
            ref_opt.zero_grad()
            out = functional_call(models[i], dict(zip(names, ps)), (x[i],))
            F.cross_entropy(out, y[i]).backward()
            ref_opt.step()
        return measure.params_max_abs_err([ps for ps, _ in refs], params)

    return [_record("train", case, n, wide_step, {"loop": loop_step, "vmap_one_lr": vmap_step},
                    check, p, machine, batch=batch, shape=arch, **extra)]
