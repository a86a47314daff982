"""Found by an independent probe (issue 44, probe 6), each compared with the members run alone.
F3: a value that is 0-dim in each member keeps its place in torch's type promotion in the wide
graph, where it is ``[N]`` (Note [A member's 0-dim operands keep their place in type promotion],
fx/rules/pointwise.py): the dtype and the values are the member's, with and without autocast.
"""
from __future__ import annotations

import pytest
import torch
import wide_compiler as wc
from torch import nn
from support import cpu_only

FAST = wc.WideConfig.fast()


class ZeroDim(nn.Module):
    """A pointwise op mixing a per-member 0-dim value with a tensor with dims."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(4, 4)
        self.w = nn.Parameter(torch.randn(4, 4) * 0.5)

    def forward(self, x):
        h = self.lin(x)
        k = self.kind
        if k == "add":
            return h.float() + x.sum()
        if k == "mul_mean":
            return h.float() * x.mean()
        if k == "lower_dtype":
            return h.to(torch.bfloat16) + x.float().sum()
        if k == "where":
            return torch.where(x > 0, h.float(), x.sum())
        if k == "maximum":
            return torch.maximum(h.float(), x.max())
        if k == "compare":  # compared in the member's float32: ties where float64 would not tie
            return h.float() > (x.sum() * 1e-3)
        if k == "int_dims":
            return (x > 0).long() + x.sum()
        if k == "bool_scalar":
            return x.argmax(-1) * (x.sum() > 0)
        if k == "inplace":
            return h.float().add_(x.sum())
        if k == "norm":
            return h / h.norm()
        if k == "mm":
            return torch.mm(self.w, self.w) + x.sum()
        raise ValueError(k)


def _check(kind: str, dtype: torch.dtype, autocast: bool, train: bool) -> None:
    torch.manual_seed(0)
    models = [ZeroDim(kind).to(dtype).train(train) for _ in range(3)]
    wide = wc.compile(models, torch.randn(2, 3, 4, dtype=dtype), config=FAST).train(train)
    x = torch.randn(3, 2, 3, 4, dtype=dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = wide(x)
        refs = [m(x[i]) for i, m in enumerate(models)]
    # exact, but for the whole-tensor norm: the wide reduction adds in another order (last bits)
    tol = {} if kind != "norm" else dict(atol=1e-12, rtol=1e-12) if not autocast else dict(atol=0, rtol=8e-3)
    for i, ref in enumerate(refs):
        assert out[i].dtype == ref.dtype, (kind, i, out[i].dtype, ref.dtype)
        torch.testing.assert_close(out[i], ref, **(tol or dict(atol=0, rtol=0)))


@pytest.mark.parametrize("kind", ["add", "mul_mean", "lower_dtype", "where", "maximum", "compare", "int_dims",
                                  "bool_scalar", "inplace", "norm", "mm"])
def test_a_per_member_zero_dim_operand_promotes_as_in_the_member(kind: str) -> None:
    _check(kind, torch.float64, autocast=False, train=True)


@cpu_only
@pytest.mark.parametrize("kind", ["mm", "norm", "add"])
@pytest.mark.parametrize("train", [False, True])
def test_under_autocast_the_dtype_is_the_members(kind: str, train: bool) -> None:
    _check(kind, torch.float32, autocast=True, train=train)


# ---------------------------------------------------------------- F4: wc.optim.SGD's first step
def _sgd_run(dampening: list[float], overflow_step: int, steps: int = 3):
    """wc.optim.SGD (per-member dampening) and wc.amp.GradScaler against each member's own
    torch.optim.SGD and torch.amp.GradScaler; member 1 overflows at ``overflow_step``."""
    import copy

    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double() for _ in range(3)]
    refs = [copy.deepcopy(m) for m in models]
    wide = wc.compile(models, torch.randn(5, 4, dtype=torch.float64), config=FAST)
    opt = wc.optim.SGD(wide.parameters(), lr=1e-2, momentum=0.9, dampening=dampening)
    scaler = wc.amp.GradScaler(init_scale=256.0)
    ref_opts = [torch.optim.SGD(r.parameters(), lr=1e-2, momentum=0.9, dampening=d) for r, d in zip(refs, dampening)]
    ref_scalers = [torch.amp.GradScaler("cpu", init_scale=256.0) for _ in refs]
    xs = torch.randn(steps, 3, 5, 4, dtype=torch.float64)
    for t in range(steps):
        x = xs[t].clone()
        if t == overflow_step:
            x[1, 0, 0] = float("inf")
        opt.zero_grad()
        scaler.scale(wide(x).square().mean(dim=(1, 2))).sum().backward()
        scaler.step(opt)
        scaler.update()
        for i, (r, o, s) in enumerate(zip(refs, ref_opts, ref_scalers)):
            o.zero_grad()
            s.scale(r(x[i]).square().mean()).backward()
            s.step(o)
            s.update()
    for i, r in enumerate(refs):
        for k, v in r.state_dict().items():
            torch.testing.assert_close(wide.member(i).state_dict()[k], v, atol=1e-12, rtol=0)


def test_wc_sgd_refuses_to_skip_a_dampening_members_first_step() -> None:
    with pytest.raises(RuntimeError, match=r"member\(s\) \[1\].*dampening"):
        _sgd_run([0.3, 0.3, 0.3], overflow_step=0)


def test_wc_sgd_skips_exactly_where_the_skipped_member_does_not_dampen_or_its_buffer_exists() -> None:
    _sgd_run([0.3, 0.0, 0.3], overflow_step=0)  # only the skipped member's dampening counts
    _sgd_run([0.3, 0.3, 0.3], overflow_step=1)  # buffers exist: skipping keeps the member's


# ---------------------------------------------------------------- F1: writes into the padding
@pytest.mark.parametrize("write", ["explore", "reinit"])
def test_a_padded_models_parameters_written_by_hand_keep_the_padding_zero(write: str) -> None:
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, h), nn.Tanh(), nn.Linear(h, 2)).double() for h in (3, 6)]
    wide = wc.compile(models, torch.randn(5, 4, dtype=torch.float64), pad=True, config=FAST)
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    for _ in range(2):  # a second write after a call
        with torch.no_grad():
            for p in wide.parameters():
                if write == "explore":  # population-based training's perturbation of every weight
                    p.add_(0.1 * torch.randn_like(p))
                else:
                    nn.init.normal_(p)
        out = wide(x)
        for i in range(2):
            torch.testing.assert_close(out[i], wide.member(i)(x[i]), atol=1e-12, rtol=0)
            torch.testing.assert_close(out[i], wide.unfuse()[i](x[i]), atol=1e-12, rtol=0)
