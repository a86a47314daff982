"""Per-member LR schedules against torch.optim.lr_scheduler run on each member alone."""
from __future__ import annotations

import pytest
import torch
import wide_compiler as wc
from torch import nn
from wide_compiler.optim import lr_scheduler as wls

N, EPOCHS = 5, 30
LRS = [0.1, 0.05, 0.02, 0.01, 0.3]


def member(kw, i):
    return {k: (v[i] if isinstance(v, list) and k != "milestones" else v) for k, v in kw.items()}


# (name, wide scheduler, torch scheduler, kwargs with per-member lists, optimizer)
CASES = [
    ("step", wls.StepLR, torch.optim.lr_scheduler.StepLR, {"step_size": [1, 2, 3, 5, 7], "gamma": [0.5, 0.9, 0.1, 0.7, 0.95]}, "sgd"),
    ("multistep_shared", wls.MultiStepLR, torch.optim.lr_scheduler.MultiStepLR, {"milestones": [3, 10, 20], "gamma": [0.5, 0.9, 0.1, 0.7, 0.95]}, "sgd"),
    ("exponential", wls.ExponentialLR, torch.optim.lr_scheduler.ExponentialLR, {"gamma": [0.5, 0.9, 0.99, 0.7, 0.95]}, "adam"),
    ("cosine", wls.CosineAnnealingLR, torch.optim.lr_scheduler.CosineAnnealingLR, {"T_max": [5, 10, 30, 7, 12], "eta_min": [0.0, 1e-4, 1e-3, 0.0, 0.01]}, "adam"),
    ("linear_warmup", wls.LinearLR, torch.optim.lr_scheduler.LinearLR, {"start_factor": [0.1, 0.25, 0.5, 1.0, 0.01], "total_iters": [3, 5, 10, 4, 25]}, "adamw"),
    ("onecycle", wls.OneCycleLR, torch.optim.lr_scheduler.OneCycleLR, {"max_lr": [0.1, 0.5, 1.0, 0.05, 0.2], "total_steps": EPOCHS + 1, "pct_start": [0.3, 0.1, 0.5, 0.25, 0.4]}, "sgd"),
    ("onecycle_linear_3phase_adam", wls.OneCycleLR, torch.optim.lr_scheduler.OneCycleLR, {"max_lr": [0.1, 0.5, 1.0, 0.05, 0.2], "total_steps": EPOCHS + 1, "anneal_strategy": "linear", "three_phase": True, "div_factor": [25.0, 10.0, 5.0, 100.0, 2.0]}, "adam"),
]
OPTS = {"sgd": (wc.optim.SGD, torch.optim.SGD, {"momentum": 0.9}),
        "adam": (wc.optim.Adam, torch.optim.Adam, {}),
        "adamw": (wc.optim.AdamW, torch.optim.AdamW, {})}


@pytest.mark.parametrize("name,wide_cls,torch_cls,kw,opt", CASES, ids=[c[0] for c in CASES])
def test_schedule_and_training_match_torch_per_member(name, wide_cls, torch_cls, kw, opt):
    torch.manual_seed(0)
    wopt_cls, topt_cls, okw = OPTS[opt]
    w = nn.Parameter(torch.randn(N, 4))
    refs = [nn.Parameter(w[i].detach().clone()) for i in range(N)]
    wopt = wopt_cls([w], lr=LRS, **okw)
    topts = [topt_cls([r], lr=LRS[i], **okw) for i, r in enumerate(refs)]
    wsched = wide_cls(wopt, **kw)
    tscheds = [torch_cls(o, **member(kw, i)) for i, o in enumerate(topts)]
    for epoch in range(EPOCHS):
        g = torch.randn(N, 4)
        w.grad = g
        wopt.step()
        wsched.step()
        for i, (r, o, s) in enumerate(zip(refs, topts, tscheds)):
            r.grad = g[i].clone()
            o.step()
            s.step()
        lrs = wsched.get_last_lr()[0]
        for i, o in enumerate(topts):
            assert lrs[i].item() == pytest.approx(o.param_groups[0]["lr"], rel=1e-12, abs=1e-15), \
                f"{name}: epoch {epoch} member {i}"
            if "betas" in o.param_groups[0]:
                assert wopt.param_groups[0]["betas"][0][i].item() == pytest.approx(o.param_groups[0]["betas"][0], rel=1e-12)
            elif "momentum" in o.param_groups[0]:
                assert wopt.param_groups[0]["momentum"][i].item() == pytest.approx(o.param_groups[0]["momentum"], rel=1e-12)
    for i in range(N):
        torch.testing.assert_close(w[i].detach(), refs[i].detach(), rtol=1e-6, atol=1e-6)


def test_multistep_per_member_milestones():
    w = nn.Parameter(torch.zeros(3, 2))
    opt = wc.optim.SGD([w], lr=1.0)
    sched = wls.MultiStepLR(opt, milestones=[[1], [2, 3], []], gamma=0.5)
    seen = []
    for _ in range(4):
        opt.step()
        sched.step()
        seen.append(sched.get_last_lr()[0].tolist())
    assert seen == [[0.5, 1.0, 1.0], [0.5, 0.5, 1.0], [0.5, 0.25, 1.0], [0.5, 0.25, 1.0]]


@pytest.mark.parametrize("mode,threshold_mode", [("min", "rel"), ("max", "abs")])
def test_reduce_on_plateau_per_member_metrics(mode, threshold_mode):
    torch.manual_seed(0)
    w = nn.Parameter(torch.zeros(N, 2))
    opt = wc.optim.Adam([w], lr=LRS)
    kw = {"factor": [0.5, 0.1, 0.2, 0.9, 0.5], "patience": [0, 1, 2, 3, 1], "cooldown": [0, 1, 2, 0, 3],
          "min_lr": [0.0, 1e-3, 0.0, 0.005, 0.0], "threshold": 0.01}
    sched = wls.ReduceLROnPlateau(opt, mode=mode, threshold_mode=threshold_mode, **kw)
    topts = [torch.optim.Adam([nn.Parameter(torch.zeros(2))], lr=LRS[i]) for i in range(N)]
    tscheds = [torch.optim.lr_scheduler.ReduceLROnPlateau(o, mode=mode, threshold_mode=threshold_mode, **member(kw, i))
               for i, o in enumerate(topts)]
    metrics = torch.rand(40, N).cumsum(0) * torch.tensor([1, -1, 0.1, 0, 1]) + torch.rand(40, N)
    for m in metrics:
        sched.step(m)
        for i, s in enumerate(tscheds):
            s.step(m[i].item())
        got = opt.param_groups[0]["lr"].tolist()
        assert got == pytest.approx([o.param_groups[0]["lr"] for o in topts], rel=1e-12)
    assert len(set(opt.param_groups[0]["lr"].tolist())) > 1


def test_scheduler_argument_errors():
    w = nn.Parameter(torch.zeros(N, 2))
    opt = wc.optim.SGD([w], lr=0.1)
    with pytest.raises(ValueError, match="got 2 values but there are N=5"):
        wls.StepLR(opt, step_size=[1, 2])
    with pytest.raises(ValueError, match="member 1"):
        wls.StepLR(opt, step_size=[1, 0, 1, 1, 1])
    with pytest.raises(ValueError, match="3 milestone lists"):
        wls.MultiStepLR(opt, milestones=[[1], [2], [3]])
    with pytest.raises(TypeError, match="wide_compiler.optim"):
        wls.StepLR(torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1), step_size=1)
    assert opt.param_groups[0]["lr"].tolist() == [0.1] * N     # nothing changed
    sched = wls.ReduceLROnPlateau(opt)
    with pytest.raises(ValueError, match="metrics"):
        sched.step([1.0, 2.0])


def _lrs_after_steps(make, metrics: bool) -> list[list[float]]:
    w = nn.Parameter(torch.zeros(N, 2, device="cpu"))
    opt = wc.optim.SGD([w], lr=LRS, momentum=0.9)
    sched = make(opt)
    seen = []
    for step in range(6):
        opt.step()
        sched.step(torch.tensor([step % 3, -step, 1.0, step, 0.5], device="cpu")) if metrics else sched.step()
        seen.append(opt.param_groups[0]["lr"].tolist())
    return seen


@pytest.mark.parametrize("name", [c[0] for c in CASES] + ["plateau"])
def test_schedules_keep_their_state_on_the_cpu_under_another_default_device(name):
    """Per-member schedule state lives on the CPU, beside the optimizer's per-member
    hyperparameters, whatever ``torch.set_default_device`` says: a GPU run under a CUDA default
    device mixed devices in OneCycleLR and ReduceLROnPlateau. The meta device stands in for it."""
    if name == "plateau":
        make, metrics = (lambda opt: wls.ReduceLROnPlateau(opt, patience=[0, 1, 2, 0, 1], factor=0.5)), True
    else:
        _, wide_cls, _, kw, _ = next(c for c in CASES if c[0] == name)
        make, metrics = (lambda opt: wide_cls(opt, **kw)), False
    expected = _lrs_after_steps(make, metrics)
    with torch.device("meta"):
        assert _lrs_after_steps(make, metrics) == expected


def test_a_state_made_under_another_default_device_loads_onto_the_cpu():
    """A plateau state whose tensors were made elsewhere (a GPU run's test built its old-style
    min_lr under a CUDA default device) loads onto the CPU and steps (meta stands in)."""
    w = nn.Parameter(torch.zeros(N, 2, device="cpu"))
    opt = wc.optim.SGD([w], lr=1.0)
    sched = wls.ReduceLROnPlateau(opt, factor=0.5, patience=0)
    state = sched.state_dict()
    state["best"] = state["best"].to("meta")
    state["min_lrs"] = [t.to("meta") for t in state["min_lrs"]]
    with pytest.raises(NotImplementedError):  # meta tensors cannot become CPU ones: the load moved them
        sched.load_state_dict(state)
    state = sched.state_dict()
    with torch.device("meta"):
        sched.load_state_dict({**state, "best": torch.full((N,), 1.0, device="cpu")})
        sched.step(torch.zeros(N, device="cpu"))
    assert all(t.device.type == "cpu" for t in (sched.best, *sched.min_lrs))
