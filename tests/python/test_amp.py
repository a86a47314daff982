"""wc.amp.GradScaler: one loss scale per member. Every member of a fused run must follow exactly
what its own torch.amp.GradScaler does for it trained alone: a member whose gradients overflow
skips its own step and backs off its own scale; the others step and grow."""

from __future__ import annotations

import copy
import logging

import contextlib

import pytest
import torch
import torch.nn.functional as F
from support import DEVICE

import wide_compiler as wc

N = 4


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def _assert_close(a: torch.Tensor, b: torch.Tensor, tol: float, what: str) -> None:
    assert a.shape == b.shape, what
    assert _rel(a, b) <= tol, f"{what}: relative difference {_rel(a, b):.3g} > {tol}"


def _mlp(dtype: torch.dtype) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to(dtype)


class HalfMLP(torch.nn.Module):
    """float32 parameters, float16 compute: the gradients flowing through the activations are
    float16 and overflow (to inf) once the scaled loss is large, as under autocast."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(3, 16), torch.nn.Linear(16, 1)

    def forward(self, x):
        h = torch.relu(F.linear(x.half(), self.a.weight.half(), self.a.bias.half()))
        return F.linear(h, self.b.weight.half(), self.b.bias.half()).float()


def _compare_members(wide, opt, refs, ref_opts, tol, step):
    for i, (m, o) in enumerate(zip(refs, ref_opts)):
        mine = wide.member_state_dict(i)
        for k, v in m.state_dict().items():
            _assert_close(mine[k], v, tol, f"step {step}, member {i}, {k}")
        if isinstance(opt, wc.optim.WideOptimizer):
            ms, rs = opt.member_state_dict(i)["state"], o.state_dict()["state"]
            for pid in set(ms) - set(rs):     # the member never stepped: its state is fresh (zeros)
                assert all(not torch.as_tensor(v).any() for v in ms[pid].values()), (step, i, pid)
            assert set(rs) <= set(ms), f"step {step}, member {i}: optimizer state keys"
            for pid in rs:
                assert sorted(ms[pid]) == sorted(rs[pid]), f"step {step}, member {i}, param {pid}"
                for k, v in rs[pid].items():
                    _assert_close(torch.as_tensor(ms[pid][k]).reshape(v.shape), v, tol,
                                  f"step {step}, member {i}, param {pid}, state {k}")
        else:     # torch.optim on the stacked parameters: member i's slice of the state
            for p, rp in zip(opt.param_groups[0]["params"], o.param_groups[0]["params"]):
                ref_state = o.state.get(rp, {})
                for k, mine_k in opt.state.get(p, {}).items():
                    if not isinstance(mine_k, torch.Tensor) or mine_k.dim() == 0:
                        continue  # a count shared by the members, which no update reads (amp.py)
                    if k in ref_state:
                        _assert_close(mine_k[i], ref_state[k], tol, f"step {step}, member {i}, state {k}")
                    else:  # the member never stepped: its slice is as the optimizer creates it
                        fresh = opt.param_groups[0]["lr"] if k == "step_size" else 0.0
                        assert torch.all(mine_k[i] == fresh), f"step {step}, member {i}, state {k}: not fresh"


def _run(make_model, dtype, make_opt, make_ref_opt, *, steps, init_scale, growth_interval,
         inject=None, tol, unscale_and_clip=False, autocast=None):
    """Train N members fused with wc.amp.GradScaler and each alone with torch.amp.GradScaler on
    the same data (on the suite's device; forwards under ``torch.autocast`` to the dtype
    ``autocast`` if given); compare every member after every step. Returns the per-step scales and
    skips."""
    def mixed():
        return torch.autocast(DEVICE.type, dtype=autocast) if autocast else contextlib.nullcontext()

    torch.manual_seed(0)
    models = [make_model() for _ in range(N)]
    refs = [copy.deepcopy(m) for m in models]
    wide = wc.compile(models, torch.randn(5, 3, dtype=dtype), config=wc.WideConfig.fast())
    opt = make_opt(list(wide.parameters()))
    ref_opts = [make_ref_opt(list(m.parameters()), i) for i, m in enumerate(refs)]
    scaler = wc.amp.GradScaler(init_scale=init_scale, growth_interval=growth_interval)
    ref_scalers = [torch.amp.GradScaler(DEVICE.type, init_scale=init_scale, growth_interval=growth_interval)
                   for _ in range(N)]
    g = torch.Generator(DEVICE).manual_seed(1)
    scales, skips = [], []
    for step in range(steps):
        x = torch.randn(N, 16, 3, generator=g, dtype=dtype, device=DEVICE)
        y = torch.randn(N, 16, 1, generator=g, dtype=dtype, device=DEVICE)
        if inject is not None:
            inject(step, x)
        with mixed():
            losses = wc.optim.member_losses(F.mse_loss, wide(x), y)
        opt.zero_grad()
        scaler.scale(losses).sum().backward()
        if unscale_and_clip:
            scaler.unscale_(opt)
            wc.optim.clip_grad_norm_(wide.parameters(), max_norm=0.5)
        scaler.step(opt)
        skips.append(scaler.found_inf(opt).tolist())
        scaler.update()
        for i in range(N):
            with mixed():
                loss = F.mse_loss(refs[i](x[i]), y[i])
            ref_opts[i].zero_grad()
            ref_scalers[i].scale(loss).backward()
            if unscale_and_clip:
                ref_scalers[i].unscale_(ref_opts[i])
                torch.nn.utils.clip_grad_norm_(refs[i].parameters(), max_norm=0.5)
            ref_scalers[i].step(ref_opts[i])
            ref_scalers[i].update()
        assert scaler.get_scale().tolist() == [s.get_scale() for s in ref_scalers], f"step {step}"
        assert scaler.get_growth_tracker().tolist() == [s._growth_tracker.item() for s in ref_scalers]
        _compare_members(wide, opt, refs, ref_opts, tol, step)
        scales.append(scaler.get_scale().tolist())
    return scales, skips


@pytest.mark.parametrize("K", [0, 7], ids=["first_step", "step_7"])
def test_member_2_overflows_alone_float64(K):
    """Member 2's input holds an inf at step K: its loss and gradients overflow, it skips
    that step and halves its scale; members 0, 1, 3 step and keep growing their scales. At the
    first step the optimizer state does not exist yet: member 2's starts as a fresh one."""

    def inject(step, x):
        if step == K:
            x[2, 0, 0] = float("inf")

    lrs = [1e-3, 3e-3, 1e-2, 3e-2]
    scales, skips = _run(
        lambda: _mlp(torch.float64), torch.float64,
        lambda ps: wc.optim.Adam(ps, lr=lrs, weight_decay=0.01),
        lambda ps, i: torch.optim.Adam(ps, lr=lrs[i], weight_decay=0.01),
        steps=30, init_scale=2.0 ** 10, growth_interval=3, inject=inject, tol=1e-12)
    assert skips[K] == [False, False, True, False]
    assert all(not any(s) for k, s in enumerate(skips) if k != K)
    before = scales[K - 1] if K else [2.0 ** 10] * N     # member 2 backed off
    assert scales[K][2] == before[2] / 2
    assert all(scales[K][i] in (before[i], 2 * before[i]) for i in (0, 1, 3))
    assert scales[-1][2] < scales[-1][0]


def test_member_skips_leave_params_and_state_untouched():
    torch.manual_seed(0)
    wide = wc.compile([_mlp(torch.float32) for _ in range(N)], torch.randn(5, 3),
                      config=wc.WideConfig.fast())
    opt = wc.optim.AdamW(wide.parameters(), lr=1e-2)
    scaler = wc.amp.GradScaler()
    x, y = torch.randn(N, 8, 3), torch.randn(N, 8, 1)
    for step in range(3):
        xs = x.clone()
        if step == 2:
            xs[2, 0, 0] = float("nan")
        before = [wide.member_state_dict(i) for i in range(N)]
        state_before = opt.member_state_dict(2)["state"]
        opt.zero_grad()
        scaler.scale(wc.optim.member_losses(F.mse_loss, wide(xs), y)).sum().backward()
        scaler.step(opt)
        scaler.update()
    after = [wide.member_state_dict(i) for i in range(N)]
    for k in after[2]:
        assert torch.equal(after[2][k], before[2][k])
        for i in (0, 1, 3):
            assert not torch.equal(after[i][k], before[i][k])
    state_after = opt.member_state_dict(2)["state"]
    for pid, st in state_before.items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(state_after[pid][k]), torch.as_tensor(v))
    assert scaler.get_scale().tolist() == [65536.0, 65536.0, 32768.0, 65536.0]


def test_float16_gradients_overflow_naturally():
    """float16 activations and activation gradients, a scale so large that the scaled float16
    gradients overflow: each member backs off on its own schedule, as its own torch scaler."""
    scales, skips = _run(
        HalfMLP, torch.float32,
        lambda ps: wc.optim.SGD(ps, lr=[0.01, 0.02, 0.05, 0.1], momentum=0.9),
        lambda ps, i: torch.optim.SGD(ps, lr=[0.01, 0.02, 0.05, 0.1][i], momentum=0.9),
        # bit for bit on the CPU; a GPU's batched and single float16 GEMMs round apart (1.8e-4 of a
        # momentum seen on an H200): there, to float16 rounding, as the autocast test below
        steps=24, init_scale=2.0 ** 20, growth_interval=2, tol=1e-6 if DEVICE.type == "cpu" else 2e-3,
        unscale_and_clip=True)
    n_skips = [sum(s[i] for s in skips) for i in range(N)]
    assert all(k >= 1 for k in n_skips), n_skips             # every member overflowed at least once
    assert any(sum(s) not in (0, N) for s in skips), skips    # ... and not all at the same steps


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_float16_autocast_each_member_with_its_own_scaler(optimizer):
    """The recipe of mixed precision on a GPU (the suite's device; CPU autocast has float16
    too): forwards under ``torch.autocast(float16)``, float32 losses, one scaler. A first scale so
    large that every member's float16 activation gradients overflow, then each backs off on its
    own; member 2's input holds an inf at step 9: every member follows its own
    ``torch.amp.GradScaler`` (same skips and scales, parameters to float16 rounding)."""
    lrs = [0.01, 0.02, 0.05, 0.1]
    make, make_ref = {
        "sgd": (lambda ps: wc.optim.SGD(ps, lr=lrs, momentum=0.9),
                lambda ps, i: torch.optim.SGD(ps, lr=lrs[i], momentum=0.9)),
        "adamw": (lambda ps: wc.optim.AdamW(ps, lr=[lr / 10 for lr in lrs]),
                  lambda ps, i: torch.optim.AdamW(ps, lr=lrs[i] / 10)),
    }[optimizer]
    scales, skips = _run(lambda: _mlp(torch.float32), torch.float32, make, make_ref, steps=16,
                         init_scale=2.0 ** 24, growth_interval=3, tol=2e-3, autocast=torch.float16,
                         inject=_overflow_at({9: [2]}))
    assert all(skips[0]), skips[0]                      # 2**24 overflows float16 for everyone
    assert skips[9][2] and not skips[9][0], skips[9]
    assert any(sum(s) not in (0, N) for s in skips), skips   # members back off at their own steps


def test_torch_optim_on_stacked_parameters():
    """torch.optim.SGD (momentum: per-element state) over the stacked parameters is exact too."""
    K = 5

    def inject(step, x):
        if step in (K, K + 4):
            x[2 if step == K else 0, 3, 1] = float("inf")

    _run(lambda: _mlp(torch.float64), torch.float64,
         lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3),
         lambda ps, i: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3),
         steps=16, init_scale=2.0 ** 8, growth_interval=4, inject=inject, tol=1e-12)


def _overflow_at(plan: dict[int, list[int]]):
    """An ``inject`` for :func:`_run`: at step k, the members ``plan[k]`` get an inf input."""
    def inject(step, x):
        for i in plan.get(step, []):
            x[i, 0, 0] = float("inf")
    return inject


TORCH_OPTIMIZERS = {  # torch.optim optimizers whose update reads only per-member state
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5, centered=True),
    "adadelta": lambda ps: torch.optim.Adadelta(ps, lr=0.5),
    "rprop": lambda ps: torch.optim.Rprop(ps, lr=1e-2),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1, initial_accumulator_value=0.1),
}


@pytest.mark.parametrize("name", sorted(TORCH_OPTIMIZERS))
def test_torch_optim_skips_one_member_exactly_from_the_first_step(name):
    """One member overflows at the very first step (no optimizer state yet: its slice of the new
    state must start as the optimizer starts it, Rprop's step sizes at lr), others later and two
    at once: every member matches its own torch.amp.GradScaler run, parameters and state."""
    make = TORCH_OPTIMIZERS[name]
    _, skips = _run(lambda: _mlp(torch.float64), torch.float64, make, lambda ps, i: make(ps),
                    steps=10, init_scale=2.0 ** 8, growth_interval=3, tol=1e-12,
                    inject=_overflow_at({0: [1], 4: [2], 6: [0, 3]}))
    assert skips[0] == [False, True, False, False] and skips[6] == [True, False, False, True]


def test_sgd_with_dampening_skips_exactly_once_its_buffers_exist():
    make = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, dampening=0.3)  # noqa: E731
    _run(lambda: _mlp(torch.float64), torch.float64, make, lambda ps, i: make(ps), steps=6,
         init_scale=2.0 ** 8, growth_interval=3, tol=1e-12, inject=_overflow_at({0: [0, 1, 2, 3], 3: [2]}))


def _fused(n: int = N):
    torch.manual_seed(0)
    return wc.compile([_mlp(torch.float64) for _ in range(n)], torch.randn(5, 3, dtype=torch.float64),
                      config=wc.WideConfig.fast())


def _scaled_backward(wide, scaler, opt, overflow: list[int]):
    x = torch.randn(N, 8, 3, dtype=torch.float64)
    for i in overflow:
        x[i, 0, 0] = float("inf")
    opt.zero_grad()
    scaler.scale(wide(x).pow(2).mean(dim=(1, 2))).sum().backward()


def _snapshot(wide, opt):
    params = {k: v.detach().clone() for k, v in wide.named_parameters()}
    state = {id(p): {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
             for p, st in opt.state.items()}
    return params, state


def _assert_unchanged(wide, opt, snap):
    params, state = snap
    for k, v in wide.named_parameters():
        assert torch.equal(v.detach(), params[k]), k
    assert {id(p) for p in opt.state if opt.state[p]} == {i for i, st in state.items() if st}
    for p, st in opt.state.items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(state[id(p)][k])), k


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.Adam(ps, lr=1e-2), lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    lambda ps: torch.optim.NAdam(ps, lr=1e-2), lambda ps: torch.optim.Adagrad(ps, lr=0.1, lr_decay=0.1),
], ids=["Adam", "AdamW", "NAdam", "Adagrad_lr_decay"])
@pytest.mark.parametrize("first", [True, False], ids=["first_step", "later_step"])
def test_shared_step_optimizer_refuses_to_skip_one_member_before_anything_changes(make, first, caplog):
    """torch.optim.Adam keeps one `step` for all members of a stacked parameter and reads it (bias
    correction): it cannot skip one member's step (issue 44: a member that overflowed on its first
    step ended 20% off its own run). The first step() warns; a step where only some members
    overflow raises, naming why, with parameters and optimizer state untouched (no state at all
    at the first step); steps where all or none overflow stay exact."""
    wide = _fused()
    opt = make(list(wide.parameters()))
    scaler = wc.amp.GradScaler(init_scale=2.0 ** 8)
    with caplog.at_level(logging.WARNING, logger="wide_compiler.amp"):
        if not first:
            for overflow in ([0, 1, 2, 3], []):   # all skip, then all step
                _scaled_backward(wide, scaler, opt, overflow)
                scaler.step(opt)
                scaler.update()
        _scaled_backward(wide, scaler, opt, [1])
        snap = _snapshot(wide, opt)
        grads = [p.grad.clone() for p in wide.parameters()]
        with pytest.raises(RuntimeError, match=r"member\(s\) \[1\] found inf.*shared by all members.*"
                                               r"Nothing was changed.*still scaled.*wide_compiler.optim"):
            scaler.step(opt)
    assert "cannot skip one member's step" in caplog.text
    _assert_unchanged(wide, opt, snap)  # at the first step: still no state (Adagrad makes its own at once)
    for p, g in zip(wide.parameters(), grads):  # not unscaled: as before step()
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0, equal_nan=True)
    # the scaler is as before step(): a retry with finite gradients unscales and steps them (it
    # raised again, from the refused step's record, before)
    opt.zero_grad()
    _scaled_backward(wide, scaler, opt, [])
    scaled = [p.grad.clone() for p in wide.parameters()]
    scaler.step(opt)
    inv = scaler.get_scale().double().reciprocal().float()
    for p, g in zip(wide.parameters(), scaled):
        torch.testing.assert_close(p.grad, g * inv.reshape(-1, *[1] * (g.dim() - 1)), rtol=0, atol=0)
    name, p0 = next(iter(wide.named_parameters()))
    assert not torch.equal(p0.detach(), snap[0][name])  # stepped


def test_sgd_with_dampening_refuses_to_skip_one_member_at_its_first_step():
    """torch.optim.SGD starts its buffer at the first gradient, undamped: with dampening a zero
    buffer for the skipped member would give another first step, so that step is refused."""
    wide = _fused()
    opt = torch.optim.SGD(wide.parameters(), lr=0.1, momentum=0.9, dampening=0.5)
    scaler = wc.amp.GradScaler()
    _scaled_backward(wide, scaler, opt, [3])
    snap = _snapshot(wide, opt)
    with pytest.raises(RuntimeError, match=r"member\(s\) \[3\].*dampening"):
        scaler.step(opt)
    _assert_unchanged(wide, opt, snap)
    assert not opt.state


def test_scale_shapes_and_bad_input():
    scaler = wc.amp.GradScaler(init_scale=[1.0, 2.0, 4.0])
    assert scaler.scale(torch.ones(3)).tolist() == [1.0, 2.0, 4.0]
    out = scaler.scale({"a": torch.ones(3, 2), "b": [torch.ones(3)]})
    assert out["a"].tolist() == [[1, 1], [2, 2], [4, 4]] and out["b"][0].tolist() == [1, 2, 4]
    with pytest.raises(ValueError, match="0-d tensor"):
        scaler.scale(torch.ones(3).sum())
    with pytest.raises(ValueError, match="N=3"):
        scaler.scale(torch.ones(4))
    with pytest.raises(ValueError, match="init_scale"):
        wc.amp.GradScaler(init_scale=[1.0, 2.0]).scale(torch.ones(3))
    w = torch.nn.Parameter(torch.ones(3, 2, dtype=torch.float16))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler.scale(w.float().sum(1)).sum().backward()
    with pytest.raises(ValueError, match="FP16"):
        scaler.unscale_(opt)
    v = torch.nn.Parameter(torch.ones(5, 2))
    v.grad = torch.ones(5, 2)
    with pytest.raises(ValueError, match="N=3"):
        scaler.unscale_(torch.optim.SGD([v], lr=0.1))


def test_unscale_twice_and_step_twice_refused():
    w = torch.nn.Parameter(torch.ones(2, 3))
    opt = wc.optim.SGD([w], lr=0.1)
    scaler = wc.amp.GradScaler()
    scaler.scale(w.sum(1)).sum().backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.step(opt)
    scaler.update()
    assert torch.allclose(w, torch.full((2, 3), 0.9))


def test_state_dict_round_trip_and_new_scale():
    w = torch.nn.Parameter(torch.ones(3, 2))
    opt = wc.optim.SGD([w], lr=0.1)
    scaler = wc.amp.GradScaler(init_scale=8.0, growth_interval=1)
    w.grad = None
    g = torch.tensor([1.0, float("inf"), 1.0])
    scaler.scale((w.sum(1) * g)).sum().backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale().tolist() == [16.0, 4.0, 16.0]
    sd = scaler.state_dict()
    other = wc.amp.GradScaler()
    other.load_state_dict(sd)
    assert other.get_scale().tolist() == [16.0, 4.0, 16.0] and other.get_growth_interval() == 1
    with pytest.raises(ValueError, match="N=2"):
        wc.amp.GradScaler(n=2).load_state_dict(sd)
    one = wc.amp.GradScaler(n=3)
    one.load_state_dict(torch.amp.GradScaler("cpu", init_scale=4.0).state_dict())
    assert one.get_scale().tolist() == [4.0, 4.0, 4.0]
    other.update(new_scale=[1.0, 2.0, 3.0])
    assert other.get_scale().tolist() == [1.0, 2.0, 3.0]


def test_disabled_is_a_pass_through():
    w = torch.nn.Parameter(torch.ones(2, 3))
    opt = wc.optim.SGD([w], lr=0.1)
    scaler = wc.amp.GradScaler(enabled=False)
    loss = w.sum(1)
    assert scaler.scale(loss) is loss
    loss.sum().backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 1.0 and scaler.state_dict() == {}


def test_two_optimizers_skip_separately():
    """As torch: each optimizer skips a member's step on ITS gradients' overflow; the member's
    scale backs off when any optimizer found one. An inf input overflows the first layer's
    gradients only, so member 2 skips optimizer A's step and takes optimizer B's."""
    torch.manual_seed(0)
    models = [_mlp(torch.float64) for _ in range(N)]
    refs = [copy.deepcopy(m) for m in models]
    wide = wc.compile(models, torch.randn(5, 3, dtype=torch.float64), config=wc.WideConfig.fast())
    named = dict(wide.named_parameters())          # the original names: 0.weight, ..., 2.bias
    first = [named["0.weight"], named["0.bias"]]
    rest = [named["2.weight"], named["2.bias"]]
    opt_a, opt_b = wc.optim.Adam(first, lr=1e-2), wc.optim.SGD(rest, lr=0.1, momentum=0.9)
    ref_a = [torch.optim.Adam(m[0].parameters(), lr=1e-2) for m in refs]
    ref_b = [torch.optim.SGD(m[2].parameters(), lr=0.1, momentum=0.9) for m in refs]
    scaler = wc.amp.GradScaler(init_scale=2.0 ** 8, growth_interval=3)
    ref_s = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=3) for _ in range(N)]
    g = torch.Generator(DEVICE).manual_seed(1)
    for step in range(12):
        x = torch.randn(N, 16, 3, generator=g, dtype=torch.float64)
        y = torch.randn(N, 16, 1, generator=g, dtype=torch.float64)
        if step == 4:
            x[2, 0, 0] = float("inf")
        losses = wc.optim.member_losses(F.mse_loss, wide(x), y)
        opt_a.zero_grad(); opt_b.zero_grad()
        scaler.scale(losses).sum().backward()
        scaler.step(opt_a); scaler.step(opt_b)
        if step == 4:
            assert scaler.found_inf(opt_a).tolist() == [False, False, True, False]
            assert not scaler.found_inf(opt_b).any()
        scaler.update()
        for i in range(N):
            ref_a[i].zero_grad(); ref_b[i].zero_grad()
            ref_s[i].scale(F.mse_loss(refs[i](x[i]), y[i])).backward()
            ref_s[i].step(ref_a[i]); ref_s[i].step(ref_b[i]); ref_s[i].update()
        assert scaler.get_scale().tolist() == [s.get_scale() for s in ref_s]
        for i in range(N):
            mine = wide.member_state_dict(i)
            for k, v in refs[i].state_dict().items():
                _assert_close(mine[k], v, 1e-12, f"step {step}, member {i}, {k}")
