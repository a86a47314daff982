"""wc.amp.GradScaler: one loss scale per member. Every member of a fused run must follow exactly
what its own torch.amp.GradScaler does for it trained alone: a member whose gradients overflow
skips its own step and backs off its own scale; the others step and grow."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F

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
                for k, v in o.state.get(rp, {}).items():
                    mine_k = opt.state[p][k]
                    _assert_close(mine_k[i] if mine_k.dim() > 0 else mine_k, v, tol,
                                  f"step {step}, member {i}, state {k}")


def _run(make_model, dtype, make_opt, make_ref_opt, *, steps, init_scale, growth_interval,
         inject=None, tol, unscale_and_clip=False):
    """Train N members fused with wc.amp.GradScaler and each alone with torch.amp.GradScaler on
    the same data; compare every member after every step. Returns the per-step scales and skips."""
    torch.manual_seed(0)
    models = [make_model() for _ in range(N)]
    refs = [copy.deepcopy(m) for m in models]
    wide = wc.compile(models, torch.randn(5, 3, dtype=dtype), config=wc.WideConfig.fast())
    opt = make_opt(list(wide.parameters()))
    ref_opts = [make_ref_opt(list(m.parameters()), i) for i, m in enumerate(refs)]
    scaler = wc.amp.GradScaler(init_scale=init_scale, growth_interval=growth_interval)
    ref_scalers = [torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
                   for _ in range(N)]
    g = torch.Generator().manual_seed(1)
    scales, skips = [], []
    for step in range(steps):
        x = torch.randn(N, 16, 3, generator=g, dtype=dtype)
        y = torch.randn(N, 16, 1, generator=g, dtype=dtype)
        if inject is not None:
            inject(step, x)
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


def test_member_2_overflows_alone_float64():
    """Member 2's input holds an inf at step K: its loss and gradients overflow, it skips
    that step and halves its scale; members 0, 1, 3 step and keep growing their scales."""
    K = 7

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
    assert scales[K][2] == scales[K - 1][2] / 2          # member 2 backed off
    assert all(scales[K][i] in (scales[K - 1][i], 2 * scales[K - 1][i]) for i in (0, 1, 3))
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
        steps=24, init_scale=2.0 ** 20, growth_interval=2, tol=1e-6, unscale_and_clip=True)
    n_skips = [sum(s[i] for s in skips) for i in range(N)]
    assert all(k >= 1 for k in n_skips), n_skips             # every member overflowed at least once
    assert any(sum(s) not in (0, N) for s in skips), skips    # ... and not all at the same steps


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


def test_shared_optimizer_state_is_reported(caplog):
    torch.manual_seed(0)
    wide = wc.compile([torch.nn.Linear(3, 1) for _ in range(N)], torch.randn(5, 3),
                      config=wc.WideConfig.fast())
    opt = torch.optim.Adam(wide.parameters(), lr=1e-2)    # its `step` is one 0-d tensor
    scaler = wc.amp.GradScaler()
    for step in range(2):
        x = torch.randn(N, 8, 3)
        if step == 1:
            x[1] = float("inf")
        opt.zero_grad()
        scaler.scale(wide(x).pow(2).mean(dim=(1, 2))).sum().backward()
        with caplog.at_level(logging.WARNING, logger="wide_compiler.amp"):
            scaler.step(opt)
        scaler.update()
    assert "shared by all members" in caplog.text


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
    g = torch.Generator().manual_seed(1)
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
