"""Probe 9, P9-5: scheduler arguments that torch takes as one value per param group.

``torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[a, b])`` gives param group 0 ``a`` and group 1
``b``. ``wc.optim.lr_scheduler.OneCycleLR`` took the same list as one value per member when N was
the number of param groups (silently another schedule: the member given 0.5 on every group
diverged) and refused it otherwise, so per-group values (a smaller rate for a pretrained backbone)
could not be given at all. The same held for OneCycleLR's ``base_momentum``/``max_momentum`` and
ReduceLROnPlateau's ``min_lr``. Now a list keeps torch's per-group meaning (each group's entry a
float or N values), N values stay per member where that is the only reading, and a flat list that
reads both ways is refused with both spellings. Each case is compared member by member with
torch's own scheduler and optimizer on the member alone, in float64.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import wide_compiler as wc
from wide_compiler.optim import lr_scheduler as wls
from support import DEVICE

STEPS = 10


def _groups(params):
    """Two param groups: a "backbone" (``fc``) and a "head" (``out``)."""
    return [{"params": [p for n, p in params if n.startswith("fc")]},
            {"params": [p for n, p in params if n.startswith("out")]}]


def _stacked(n, seed=0):
    """Stacked ``[N, ...]`` parameters of N members of two layers, and each member's own copy."""
    g = torch.Generator(DEVICE).manual_seed(seed)
    wide = [("fc.weight", nn.Parameter(torch.randn(n, 4, 3, generator=g, dtype=torch.float64))),
            ("out.weight", nn.Parameter(torch.randn(n, 2, 4, generator=g, dtype=torch.float64)))]
    members = [[(name, nn.Parameter(p[i].detach().clone())) for name, p in wide] for i in range(n)]
    return wide, members


OPTIMIZERS = {"sgd": (wc.optim.SGD, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
              "adam": (wc.optim.Adam, torch.optim.Adam, {"lr": 0.01})}


def _train_against_torch(n, opt_name, wide_sched, member_sched, steps=STEPS, seed=0):
    """Train N stacked members with ``wide_sched(wide_opt)`` and each member alone with
    ``member_sched(torch_opt, i)`` on the same gradients; assert every group's learning rate,
    momentum (or beta1) and every parameter equal exactly, member by member, after every step."""
    wopt_cls, topt_cls, okw = OPTIMIZERS[opt_name]
    wide, members = _stacked(n, seed)
    wopt = wopt_cls(_groups(wide), **okw)
    topts = [topt_cls(_groups(m), **okw) for m in members]
    wsched = wide_sched(wopt)
    tscheds = [member_sched(o, i) for i, o in enumerate(topts)]
    g = torch.Generator(DEVICE).manual_seed(seed + 1)
    for step in range(steps):
        for name, p in wide:
            p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64)
        for i, m in enumerate(members):
            for (_, p), (_, wp) in zip(m, wide):
                p.grad = wp.grad[i].clone()
        wopt.step()
        wsched.step()
        for o, s in zip(topts, tscheds):
            o.step()
            s.step()
        for i, o in enumerate(topts):
            for k, (wg, tg) in enumerate(zip(wopt.param_groups, o.param_groups)):
                where = f"step {step}, member {i}, param group {k}"
                assert wg["lr"][i].item() == tg["lr"], where
                if "betas" in tg:
                    assert wg["betas"][0][i].item() == tg["betas"][0], where
                else:
                    assert wg["momentum"][i].item() == tg["momentum"], where
            for (name, p), (_, wp) in zip(members[i], wide):
                # the learning rates and momenta are exact; the fused C++ Adam step rounds apart
                # from torch's in the last bit or two
                torch.testing.assert_close(wp[i].detach(), p.detach(), rtol=1e-13, atol=1e-15,
                                           msg=f"step {step}, member {i}, {name}")
    return wopt


def test_onecycle_flat_list_of_n_values_with_n_param_groups_is_refused_with_both_spellings():
    """The probe's case: N=2 members, 2 param groups, ``max_lr=[0.5, 0.001]``. torch reads one
    max_lr per param group; wc read one per member (member 0 trained at 0.5 on every group).
    Both readings are possible, so it is refused, naming how to write each."""
    wide, _ = _stacked(2)
    opt = wc.optim.SGD(_groups(wide), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="ambiguous") as err:
        wls.OneCycleLR(opt, max_lr=[0.5, 0.001], total_steps=STEPS)
    text = str(err.value)
    assert "max_lr=[[0.5, 0.5], [0.001, 0.001]]" in text
    assert "max_lr=torch.tensor([0.5, 0.001], dtype=torch.float64)" in text
    assert "per param group" in text and "per member" in text
    with pytest.raises(ValueError, match="ambiguous"):
        wls.OneCycleLR(opt, max_lr=(0.5, 0.001), total_steps=STEPS)
    with pytest.raises(ValueError, match="ambiguous"):
        wls.OneCycleLR(opt, max_lr=0.5, base_momentum=[0.8, 0.85], total_steps=STEPS)
    with pytest.raises(ValueError, match="ambiguous"):
        wls.OneCycleLR(opt, max_lr=0.5, max_momentum=[0.9, 0.95], total_steps=STEPS)
    assert "initial_lr" not in opt.param_groups[0]                # nothing changed
    assert opt.param_groups[0]["lr"].tolist() == [0.1, 0.1]


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_onecycle_per_group_max_lr_as_n_values_each_trains_as_torch(opt_name):
    """The unambiguous per-group spelling of the probe's case: each group's entry N values."""
    _train_against_torch(
        2, opt_name,
        lambda o: wls.OneCycleLR(o, max_lr=[[0.5, 0.5], [0.001, 0.001]], total_steps=STEPS),
        lambda o, i: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=[0.5, 0.001], total_steps=STEPS))


def test_onecycle_per_member_max_lr_as_tensor_with_n_param_groups_trains_as_torch():
    """The per-member spelling with N == number of groups: a tensor of N values, every group."""
    lrs = [0.5, 0.001]
    _train_against_torch(
        2, "sgd",
        lambda o: wls.OneCycleLR(o, max_lr=torch.tensor(lrs, dtype=torch.float64), total_steps=STEPS),
        lambda o, i: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=lrs[i], total_steps=STEPS))


def test_onecycle_flat_per_group_list_with_n_not_the_number_of_groups_trains_as_torch():
    """N=3, 2 param groups, ``max_lr=(0.5, 0.01)``: was refused ("got 2 values but there are N=3
    members"); it is torch's per-group list, read so."""
    _train_against_torch(
        3, "sgd",
        lambda o: wls.OneCycleLR(o, max_lr=(0.5, 0.01), total_steps=STEPS),
        lambda o, i: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=(0.5, 0.01), total_steps=STEPS))


@pytest.mark.parametrize("three_phase,anneal", [(False, "cos"), (True, "linear")])
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_onecycle_per_group_per_member_values_train_as_torch(opt_name, three_phase, anneal):
    """Nested per-group-per-member values (was refused): group k of member i gets ``v[k][i]``,
    for max_lr, base_momentum and max_momentum, a group entry may be one float."""
    max_lr = [[0.5, 0.4, 0.3], 0.01]
    base_m = [0.8, [0.85, 0.7, 0.75]]
    max_m = ([0.95, 0.9, 0.99], 0.97)
    pick = lambda v, i: [e[i] if isinstance(e, list) else e for e in v]  # noqa: E731
    _train_against_torch(
        3, opt_name,
        lambda o: wls.OneCycleLR(o, max_lr=max_lr, base_momentum=base_m, max_momentum=max_m,
                                 total_steps=STEPS, three_phase=three_phase, anneal_strategy=anneal),
        lambda o, i: torch.optim.lr_scheduler.OneCycleLR(
            o, max_lr=pick(max_lr, i), base_momentum=pick(base_m, i), max_momentum=pick(max_m, i),
            total_steps=STEPS, three_phase=three_phase, anneal_strategy=anneal))


def test_onecycle_per_group_values_as_a_g_by_n_tensor_train_as_torch():
    v = torch.tensor([[0.5, 0.4, 0.3], [0.01, 0.02, 0.03]], dtype=torch.float64)
    _train_against_torch(
        3, "sgd",
        lambda o: wls.OneCycleLR(o, max_lr=v, total_steps=STEPS),
        lambda o, i: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=v[:, i].tolist(), total_steps=STEPS))


def test_onecycle_per_member_list_stays_per_member_where_n_is_not_the_number_of_groups():
    """Backward compatibility: N values (N != number of groups) are one per member, every group."""
    lrs = [0.5, 0.1, 0.01]
    _train_against_torch(
        3, "sgd",
        lambda o: wls.OneCycleLR(o, max_lr=lrs, total_steps=STEPS),
        lambda o, i: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=lrs[i], total_steps=STEPS))


def test_onecycle_three_phase_without_momentum_cycling():
    """three_phase with cycle_momentum=False read the (absent) momenta: AttributeError."""
    _train_against_torch(
        3, "sgd",
        lambda o: wls.OneCycleLR(o, max_lr=(0.5, 0.01), total_steps=STEPS, three_phase=True,
                                 cycle_momentum=False),
        lambda o, i: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=(0.5, 0.01), total_steps=STEPS,
                                                         three_phase=True, cycle_momentum=False))


def test_onecycle_wrong_lengths_name_both_readings():
    wide, _ = _stacked(3)
    opt = wc.optim.SGD(_groups(wide), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match=r"one per param group \(2.*one per member \(N=3\)"):
        wls.OneCycleLR(opt, max_lr=[0.1, 0.2, 0.3, 0.4], total_steps=STEPS)
    with pytest.raises(ValueError, match="one entry per param group.*has 2 param groups"):
        wls.OneCycleLR(opt, max_lr=[[0.1, 0.2, 0.3]], total_steps=STEPS)
    with pytest.raises(ValueError, match=r"param group 1.*got 2 values but there are N=3"):
        wls.OneCycleLR(opt, max_lr=[0.1, [0.1, 0.2]], total_steps=STEPS)
    with pytest.raises(ValueError, match=r"one row per param group"):
        wls.OneCycleLR(opt, max_lr=torch.ones(3, 3), total_steps=STEPS)


def test_onecycle_per_group_max_lr_on_a_compiled_wide_model():
    """The probe's script as it was: a compiled Linear-ReLU-Linear, named param groups, N=3 with
    torch's ``max_lr=[0.5, 0.001]``; every member's state after 4 steps equals torch's."""
    class PG(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.out = nn.Linear(6, 8), nn.Linear(8, 2)

        def forward(self, x):
            return self.out(F.relu(self.fc(x)))

    torch.manual_seed(0)
    n = 3
    members = [PG().double() for _ in range(n)]
    wide = wc.compile([PG().double() for _ in range(n)], torch.randn(4, 6, dtype=torch.float64),
                      config=wc.WideConfig.fast())
    for i, m in enumerate(members):
        wide.load_member_state_dict(i, m.state_dict())
    opt = wc.optim.SGD(_groups(list(wide.named_parameters())), lr=0.1)
    opts = [torch.optim.SGD(_groups(list(m.named_parameters())), lr=0.1) for m in members]
    sched = wls.OneCycleLR(opt, max_lr=[0.5, 0.001], total_steps=STEPS)
    scheds = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=[0.5, 0.001], total_steps=STEPS) for o in opts]
    for _ in range(4):
        x = torch.randn(n, 4, 6, dtype=torch.float64)
        opt.zero_grad()
        wide(x).square().sum().backward()
        opt.step()
        sched.step()
        for i, m in enumerate(members):
            opts[i].zero_grad()
            m(x[i]).square().sum().backward()
            opts[i].step()
            scheds[i].step()
    for i, m in enumerate(members):
        assert [g["lr"][i].item() for g in opt.param_groups] == [g["lr"] for g in opts[i].param_groups]
        for k, v in m.state_dict().items():
            torch.testing.assert_close(wide.member(i).state_dict()[k], v, rtol=1e-12, atol=1e-12)


def _plateau_against_torch(n, wide_min_lr, member_min_lr, factor=0.5):
    wide, members = _stacked(n)
    wopt = wc.optim.SGD(_groups(wide), lr=1.0)
    topts = [torch.optim.SGD(_groups(m), lr=1.0) for m in members]
    sched = wls.ReduceLROnPlateau(wopt, factor=factor, patience=0, min_lr=wide_min_lr)
    tscheds = [torch.optim.lr_scheduler.ReduceLROnPlateau(o, factor=factor, patience=0,
                                                          min_lr=member_min_lr(i))
               for i, o in enumerate(topts)]
    for epoch in range(12):
        metric = torch.full((n,), float(epoch))        # always worse: reduce every epoch
        sched.step(metric)
        for i, s in enumerate(tscheds):
            s.step(metric[i].item())
        for i, o in enumerate(topts):
            assert [g["lr"][i].item() for g in wopt.param_groups] == [g["lr"] for g in o.param_groups], \
                f"epoch {epoch}, member {i}"
    return wopt, sched


def test_plateau_flat_min_lr_list_with_n_param_groups_is_refused():
    wide, _ = _stacked(2)
    opt = wc.optim.SGD(_groups(wide), lr=1.0)
    with pytest.raises(ValueError, match="ambiguous") as err:
        wls.ReduceLROnPlateau(opt, min_lr=[0.1, 0.01])
    assert "min_lr=[[0.1, 0.1], [0.01, 0.01]]" in str(err.value)
    assert "min_lr=torch.tensor([0.1, 0.01], dtype=torch.float64)" in str(err.value)


def test_plateau_per_group_min_lr_reduces_as_torch():
    """N=3, 2 param groups, torch's ``min_lr=[0.1, 0.01]`` (was refused: "got 2 values")."""
    _plateau_against_torch(3, [0.1, 0.01], lambda i: [0.1, 0.01])


def test_plateau_per_group_per_member_min_lr_reduces_as_torch():
    v = [[0.1, 0.2, 0.05], 0.01]
    _plateau_against_torch(3, v, lambda i: [v[0][i], v[1]])
    _plateau_against_torch(2, [[0.1, 0.2], [0.01, 0.02]], lambda i: [[0.1, 0.2][i], [0.01, 0.02][i]])


def test_plateau_per_member_min_lr_stays_per_member():
    """Backward compatibility: a tensor of N values (and N values where N is not the number of
    groups) is one min_lr per member, every group."""
    _plateau_against_torch(2, torch.tensor([0.1, 0.01], dtype=torch.float64), lambda i: [0.1, 0.01][i])
    _plateau_against_torch(3, [0.1, 0.01, 0.2], lambda i: [0.1, 0.01, 0.2][i])


def test_plateau_param_group_added_later():
    """As torch: a min_lr given once covers a param group added later; one given per group is a
    RuntimeError at the next reduction."""
    for min_lr, ok in [(0.05, True), ([0.1, 0.01], False)]:
        wide, _ = _stacked(3)
        opt = wc.optim.SGD(_groups(wide), lr=1.0)
        sched = wls.ReduceLROnPlateau(opt, factor=0.5, patience=0, min_lr=min_lr)
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3, 2, dtype=torch.float64))]})
        sched.step(torch.zeros(3))
        if ok:
            sched.step(torch.ones(3))
            assert opt.param_groups[2]["lr"].tolist() == [0.5] * 3
        else:
            with pytest.raises(RuntimeError, match="3 param groups"):
                sched.step(torch.ones(3))


def test_plateau_state_saved_with_a_per_member_min_lr_still_loads():
    """A state_dict saved before min_lr was per group (``min_lr``: one tensor [N]) loads."""
    wide, _ = _stacked(3)
    opt = wc.optim.SGD(_groups(wide), lr=1.0)
    sched = wls.ReduceLROnPlateau(opt, factor=0.5, patience=0)
    old = {k: v for k, v in sched.state_dict().items() if k not in ("min_lrs", "default_min_lr")}
    old["min_lr"] = torch.tensor([0.9, 0.1, 0.1], dtype=torch.float64)
    sched.load_state_dict(old)
    sched.step(torch.zeros(3))
    sched.step(torch.ones(3))
    assert [g["lr"].tolist() for g in opt.param_groups] == [[0.9, 0.5, 0.5]] * 2


def test_optimizer_hyperparameters_have_no_per_group_list_reading():
    """torch's optimizers take no list as one value per param group (per-group values are param
    group dicts), so a list given to a wc optimizer is one value per member, unambiguously."""
    with pytest.raises((TypeError, ValueError)):
        torch.optim.SGD([{"params": [nn.Parameter(torch.zeros(2))]},
                         {"params": [nn.Parameter(torch.zeros(2))]}], lr=[0.1, 0.2])
    wide, _ = _stacked(2)
    opt = wc.optim.SGD(_groups(wide), lr=[0.1, 0.2])
    assert [g["lr"].tolist() for g in opt.param_groups] == [[0.1, 0.2], [0.1, 0.2]]
