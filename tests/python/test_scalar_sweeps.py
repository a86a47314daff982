"""Members that differ only in scalar hyperparameters fuse (Note [Per-member constants] in
fx/constants.py): dropout p, activation slopes, norm eps, a temperature or residual scale become
``[N]`` per-member values; a constant that changes the program is still refused by name."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
import wide_compiler as wc
from support import DEVICE, LinearModel, cpu_only
from torch import nn
from wide_compiler import testing

FAST = wc.WideConfig.fast()  # strict (no fallback) and every member traced


def _dropout_mlp(p: float) -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(p), nn.Linear(64, 8))


def _members(factory, values, seed=0):
    torch.manual_seed(seed)
    return [factory(v) for v in values]


# --- dropout p --------------------------------------------------------------------------------
P = [0, 0.1, 0.3, 0.5]


def test_a_dropout_p_sweep_compiles_without_fallback_and_matches_in_eval():
    models = _members(_dropout_mlp, P)
    wide = wc.compile(models, torch.randn(4, 16), config=FAST)
    assert wide.fallbacks == []
    assert wide.per_member_constants == {"2.p": [0.0, 0.1, 0.3, 0.5]}
    wide.eval()
    for m in models:
        m.eval()
    assert wide.fallbacks == []
    xs = torch.randn(4, 5, 16)
    testing.assert_members_close(wide(xs), [m(x) for m, x in zip(models, xs)])


def test_dropout_p_per_member_in_train_keep_rate_and_scale():
    """Dropout directly on the input, so kept elements are ``x / (1 - p_i)`` exactly and
    dropped ones 0: the mean keep rate per member is 1 - p_i within 1%."""
    models = [nn.Dropout(p) for p in P]
    wide = wc.compile(models, torch.randn(4, 16), config=FAST)
    assert wide.fallbacks == [] and wide.training
    x = torch.rand(len(P), 256, 512) + 0.5  # no zeros: a zero output means dropped
    y = wide(x)
    for i, p in enumerate(P):
        kept = y[i] != 0
        assert abs(kept.float().mean().item() - (1 - p)) < 0.01, (i, kept.float().mean())
        torch.testing.assert_close(y[i][kept], x[i][kept] / (1 - p), rtol=1e-6, atol=0)
    # the members draw independent masks
    xs = torch.ones(len(P), 64, 64)
    y = wide(xs)
    assert not torch.equal(y[2] != 0, y[3] != 0)


def test_dropout_p_sweep_trains_with_gradients_through_kept_elements():
    models = _members(_dropout_mlp, P)
    wide = wc.compile(models, torch.randn(4, 16), config=FAST)
    x = torch.randn(len(P), 32, 16, requires_grad=True)
    wide(x).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in wide.parameters())
    # member 0 has p = 0: no randomness, so its training output is its eval-free forward exactly
    y = wide(x)
    torch.testing.assert_close(y[0], models[0](x[0]), rtol=1e-5, atol=1e-5)


def test_native_dropout_and_functional_dropout_with_a_per_member_p():
    class F_Drop(LinearModel):
        linears, fields = {"fc": (8, 8)}, ("p",)

        def forward(self, x):
            return F.dropout(self.fc(x), self.p, self.training)

    models = _members(F_Drop, [0.0, 0.25, 0.75])
    wide = wc.compile(models, torch.randn(4, 8), config=FAST)
    assert wide.fallbacks == []
    y = wide(torch.randn(3, 4096, 8))
    for i, p in enumerate([0.0, 0.25, 0.75]):
        assert abs((y[i] != 0).float().mean().item() - (1 - p)) < 0.02


# --- activation slopes ------------------------------------------------------------------------
SLOPES = [0.01, 0.1, 0.2, 0.3]


def _leaky_mlp(slope: float) -> nn.Module:
    return nn.Sequential(nn.Linear(6, 12), nn.LeakyReLU(slope), nn.Linear(12, 3))


@pytest.mark.parametrize("training", [True, False])
def test_a_leaky_relu_slope_sweep_matches_members_outputs_and_gradients(training):
    models = [m.train(training) for m in _members(_leaky_mlp, SLOPES)]
    wide = wc.compile(models, torch.randn(4, 6), config=FAST)
    assert wide.fallbacks == []
    assert wide.per_member_constants == {"1.negative_slope": SLOPES}
    xs = torch.randn(len(SLOPES), 9, 6)
    testing.check_equivalence(wide, models, xs)


@pytest.mark.parametrize("make, attr", [
    (lambda v: nn.ELU(alpha=v), "alpha"),
    (lambda v: nn.CELU(alpha=v), "alpha"),
    (lambda v: nn.Softplus(beta=v), "beta"),
], ids=["elu", "celu", "softplus"])
def test_other_activation_constants_are_per_member(make, attr):
    values = [0.5, 1.0, 2.0]
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(5, 7), make(v), nn.Linear(7, 2)) for v in values]
    wide = wc.compile(models, torch.randn(4, 5), config=FAST)
    assert wide.fallbacks == []
    assert wide.per_member_constants == {f"1.{attr}": values}
    testing.check_equivalence(wide, models, torch.randn(3, 6, 5) * 4)


# --- user attributes: temperature, residual scale, offset ----------------------------------------
class Scaled(LinearModel):
    linears, fields = {"fc": (6, 6)}, ("temperature", "scale", "offset")

    def forward(self, x):
        h = x + self.fc(x) * self.scale  # a residual scale
        h = h - self.offset
        return torch.softmax(h / self.temperature, dim=-1) + (2 * self.scale)  # a value computed from one


def test_temperature_residual_scale_and_offset_attributes_are_per_member():
    values = [(1.0, 0.5, 0.0), (2.0, 1.0, 0.1), (0.5, 0.25, -0.3)]
    torch.manual_seed(0)
    models = [Scaled(*v) for v in values]
    wide = wc.compile(models, torch.randn(4, 6), config=FAST)
    assert wide.fallbacks == []
    assert wide.per_member_constants == {"temperature": [1.0, 2.0, 0.5], "scale": [0.5, 1.0, 0.25],
                                         "offset": [0.0, 0.1, -0.3]}
    testing.check_equivalence(wide, models, torch.randn(3, 5, 6))
    assert "per-member constants: " in wide.summary() and "temperature [1.0, 2.0, 0.5]" in wide.summary()


def test_the_member_check_reports_the_per_member_constants(caplog):
    models = _members(_leaky_mlp, [0.1, 0.2])
    with caplog.at_level(logging.INFO, logger="wide_compiler"):
        wide = wc.compile(models, torch.randn(4, 6), config=FAST)
    assert "per-member constants" in caplog.text and "1.negative_slope = [0.1, 0.2]" in caplog.text
    assert "aten.leaky_relu" in caplog.text
    assert "1.negative_slope [0.1, 0.2]" in wide.summary()


def test_members_that_agree_have_no_per_member_constants():
    models = _members(_leaky_mlp, [0.1, 0.1])
    wide = wc.compile(models, torch.randn(4, 6), config=FAST)
    assert wide.per_member_constants == {}
    assert not any("_per_member" in k for k in wide.state_dict())


# --- norm eps ----------------------------------------------------------------------------------
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_a_norm_eps_sweep(norm):
    eps = [1e-5, 1e-3, 1e-1]
    make = (lambda e: nn.LayerNorm(8, eps=e)) if norm == "layer" else (lambda e: nn.RMSNorm(8, eps=e))
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 8), make(e), nn.Linear(8, 2)) for e in eps]
    wide = wc.compile(models, torch.randn(4, 4), config=FAST)
    assert wide.fallbacks == []
    assert wide.per_member_constants == {"1.eps": eps}
    testing.check_equivalence(wide, models, torch.randn(3, 5, 4) * 0.05)  # small: eps matters


@cpu_only
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_a_norm_eps_sweep_under_autocast_returns_the_members_dtype(norm):
    """Under CPU autocast the norm gets a bfloat16 activation (a Linear's) with float32 weights:
    ATen computes in float32 and returns bfloat16; the per-member composite used to return
    float32 (it cast by the traced dtype, not the run's)."""
    eps = [1e-5, 1e-1]
    make = (lambda e: nn.LayerNorm(8, eps=e)) if norm == "layer" else (lambda e: nn.RMSNorm(8, eps=e))
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 8), make(e)) for e in eps]
    wide = wc.compile(models, torch.randn(4, 4), config=FAST)
    assert wide.per_member_constants == {"1.eps": eps}
    xs = torch.randn(2, 5, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = wide(xs)
        refs = [m(xs[i]) for i, m in enumerate(models)]
    assert out.dtype == refs[0].dtype == torch.bfloat16
    testing.assert_members_close(out, refs, torch.bfloat16)


def test_batch_norm_eps_that_differs_is_refused_naming_it():
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8, eps=e)) for e in (1e-5, 1e-3)]
    with pytest.raises(wc.ArchitectureMismatchError,
                       match=r"member 1: 1\.eps is 0\.001, member 0 has 1e-05, and they change argument\(s\) \['eps'\] "
                             r"of aten\.batch_norm.*no per-member form"):
        wc.compile(models, torch.randn(4, 4), config=FAST)


# --- what still changes the program is refused ---------------------------------------------------
class Sized(LinearModel):
    linears, fields = {"fc": (8, 8)}, ("k",)

    def forward(self, x):
        return self.fc(x)[..., : self.k]


class Branchy(nn.Module):
    def __init__(self, flag, scale=1.0):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.use_tanh, self.scale = flag, scale

    def forward(self, x):
        h = self.fc(x)
        return torch.tanh(h) if self.use_tanh else h * self.scale


class FloatBranch(LinearModel):
    fields = ("scale",)

    def forward(self, x):
        h = self.fc(x)
        return h if self.scale == 1.0 else h * self.scale


class FloatSize(LinearModel):
    linears, fields = {"fc": (8, 8)}, ("frac",)

    def forward(self, x):
        return self.fc(x)[..., : int(8 * self.frac)]


def test_an_int_used_as_a_size_is_refused_naming_it():
    with pytest.raises(wc.ArchitectureMismatchError, match=r"member 1: k is 5, member 0 has 4"):
        wc.compile([Sized(4), Sized(5)], torch.randn(3, 8), config=FAST)


def test_a_branch_flag_is_refused_naming_it():
    with pytest.raises(wc.ArchitectureMismatchError, match=r"member 1: use_tanh is False, member 0 has True"):
        wc.compile([Branchy(True), Branchy(False)], torch.randn(3, 4), config=FAST)


def test_a_float_that_picks_a_branch_is_refused_naming_it():
    with pytest.raises(wc.ArchitectureMismatchError,
                       match=r"member 2: scale is 2\.0, member 0 has 1\.0, and that changes the traced program"):
        wc.compile([FloatBranch(1.0), FloatBranch(1.0), FloatBranch(2.0)], torch.randn(3, 4), config=FAST)


def test_a_float_used_as_a_size_is_refused_naming_it():
    with pytest.raises(wc.ArchitectureMismatchError, match=r"member 1: frac is 0\.25, member 0 has 0\.5"):
        wc.compile([FloatSize(0.5), FloatSize(0.25)], torch.randn(3, 8), config=FAST)


# --- back to members, state, dtype ---------------------------------------------------------------
def test_unfuse_and_member_give_back_each_members_constants():
    models = _members(_dropout_mlp, P)
    wide = wc.compile(models, torch.randn(4, 16), config=FAST)
    back = wide.unfuse()
    assert [m[2].p for m in back] == P
    assert [type(m[2].p) for m in back] == [type(p) for p in P]  # the original values, exactly
    assert wide.member(3)[2].p == 0.5
    # the buffers are what the graph reads: a changed p is a changed member
    with torch.no_grad():
        wide.get_buffer("_per_member.2.p")[1] = 0.9
    assert wide.per_member_constants["2.p"][1] == 0.9
    assert wide.unfuse()[1][2].p == 0.9 and wide.member(1)[2].p == 0.9


def test_state_dict_and_to_float64_carry_the_per_member_constants():
    models = _members(_leaky_mlp, SLOPES)
    wide = wc.compile(models, torch.randn(4, 6), config=FAST)
    sd = wide.state_dict()
    assert torch.equal(sd["_per_member.1.negative_slope"], torch.tensor(SLOPES, dtype=torch.float64))
    other = wc.compile(_members(_leaky_mlp, [0.5] * 4, seed=1), torch.randn(4, 6), config=FAST)
    assert "_per_member.1.negative_slope" not in other.state_dict()
    unproved = wc.compile(_members(_leaky_mlp, [0.5, 0.6, 0.7, 0.8], seed=1), torch.randn(4, 6), config=FAST)
    before = {k: v.clone() for k, v in unproved.state_dict().items()}
    with pytest.raises(ValueError, match=r"member 0's per-member constants .* Nothing was loaded"):
        unproved.load_state_dict(sd)  # values it was never compiled for (Note [Per-member constants at the call])
    assert all(torch.equal(v, before[k]) for k, v in unproved.state_dict().items())
    wide2 = wc.compile(_members(_leaky_mlp, SLOPES[::-1], seed=1), torch.randn(4, 6), config=FAST)
    wide2.load_state_dict(sd)  # the same configurations in another order
    assert wide2.per_member_constants == {"1.negative_slope": SLOPES}
    testing.check_equivalence(wide2, models, torch.randn(4, 3, 6))
    wide.to(torch.float64)
    models64 = [m.double() for m in models]
    y = wide(torch.randn(4, 3, 6, dtype=torch.float64))
    assert y.dtype == torch.float64
    testing.check_equivalence(wide, models64, torch.randn(4, 3, 6, dtype=torch.float64))


class InRegion(LinearModel):
    fields = ("scale",)

    def forward(self, x):
        with torch.no_grad():
            h = self.fc(x) * self.scale
        return h + x


def test_a_constant_read_inside_a_region_is_refused_not_mixed_up():
    """Region bodies (no_grad, autocast) are compared whole: a constant there is refused by name."""
    with pytest.raises(wc.ArchitectureMismatchError, match=r"member 1: scale is 3\.0, member 0 has 1\.0.*region"):
        wc.compile([InRegion(1.0), InRegion(3.0)], torch.randn(3, 4), config=FAST)


@pytest.mark.parametrize("make", [lambda v: nn.Hardtanh(-v, v), lambda v: _Clamp(v)], ids=["hardtanh", "clamp"])
def test_per_member_bounds(make):
    values = [0.5, 1.0, 2.0]
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(5, 7), make(v), nn.Linear(7, 2)) for v in values]
    wide = wc.compile(models, torch.randn(4, 5), config=FAST)
    assert wide.fallbacks == [] and len(wide.per_member_constants) >= 1
    testing.check_equivalence(wide, models, torch.randn(3, 6, 5) * 3)


class _Clamp(nn.Module):
    def __init__(self, v):
        super().__init__()
        self.v = v

    def forward(self, x):
        return x.clamp(-self.v, self.v)


class Threshold(LinearModel):
    fields = ("p",)

    def forward(self, x):
        h = self.fc(x)
        return F.dropout(h, self.p, self.training) if self.p < 0.9 else h * 0.0


def test_many_members_trace_the_extremes_so_a_threshold_branch_is_found():
    ps = [0.1 + 0.05 * k for k in range(15)] + [0.95]  # 16 distinct values, the odd one last
    with pytest.raises(wc.ArchitectureMismatchError, match=r"member 15: p is 0\.95, member 0 has 0\.1"):
        wc.compile([Threshold(p) for p in ps], torch.randn(3, 4),
                   config=FAST.replace(run_members=False, trace_members=False))  # only the probes look


# --- per-member bounds follow ATen exactly (Note [Per-member bounds] in fx/rules/_constants.py) --
NAN, INF = float("nan"), float("inf")
# lo > hi, NaN bounds, infinite bounds, equal bounds
BOUNDS = [(-1.0, 1.0), (0.5, -0.5), (NAN, 1.0), (-1.0, NAN), (-INF, 0.25), (-0.25, INF), (0.0, 0.0)]
# F.hardtanh refuses lo > hi; the wide model refuses a NaN hardtanh bound (test_probe8_guards.py: ATen's
# own gradient there depends on the tensor's size)
ORDERED = [b for b in BOUNDS if not b[0] > b[1] and all(v == v for v in b)]


class _Bounded(nn.Module):
    def __init__(self, op: str, lo: float, hi: float):
        super().__init__()
        self.op, self.lo, self.hi = op, lo, hi

    def forward(self, x):
        if self.op == "clamp":
            return x.clamp(self.lo, self.hi)
        if self.op == "clamp_":
            return (x * 1.0).clamp_(self.lo, self.hi)
        if self.op == "clamp_min":
            return torch.clamp_min(x, self.lo)
        if self.op == "clamp_max":
            return x.clamp(max=self.hi)
        if self.op == "clamp_hi_shared":
            return x.clamp(self.lo, 0.75)
        if self.op == "hardtanh":
            return F.hardtanh(x, self.lo, self.hi)
        return F.hardtanh(x * 1.0, self.lo, self.hi, inplace=True)


def _bound_inputs(n: int) -> torch.Tensor:
    """Per member 64 float64 values (a multiple of every CPU vector width: ATen's hardtanh gradient
    at NaN differs between its vectorized loop and its scalar tail, Note [Per-member bounds]):
    every bound of BOUNDS exactly, NaN, +-inf, values between, then random ones."""
    special = sorted({v for b in BOUNDS for v in b if v == v}) + [NAN, INF, -INF, -2.0, -0.75, 0.1, 0.75, 2.0]
    g = torch.Generator(DEVICE).manual_seed(0)
    rows = []
    for i in range(n):
        head = torch.tensor(special, dtype=torch.float64).roll(i)
        rows.append(torch.cat([head, torch.randn(64 - len(special), generator=g, dtype=torch.float64) * 2]))
    return torch.stack(rows)


@pytest.mark.parametrize("op", ["clamp", "clamp_", "clamp_min", "clamp_max", "clamp_hi_shared", "hardtanh",
                                "hardtanh_"])
def test_per_member_bounds_follow_aten_exactly(op):
    """Each member's bounds (lo > hi, NaN, inf, lo == hi) give exactly what the member alone gives,
    outputs and input gradients, float64, NaN and inf inputs included."""
    bounds = ORDERED if op.startswith("hardtanh") else BOUNDS
    models = [_Bounded(op, lo, hi) for lo, hi in bounds]
    wide = wc.compile(models, torch.randn(64, dtype=torch.float64), config=FAST)
    assert wide.fallbacks == [] and wide.per_member_constants
    xs = _bound_inputs(len(models)).requires_grad_()
    out = wide(xs)
    cot = torch.randn(out.shape, generator=torch.Generator(DEVICE).manual_seed(1), dtype=torch.float64)
    (grad,) = torch.autograd.grad(out, xs, cot)
    for i, m in enumerate(models):
        x = xs[i].detach().clone().requires_grad_()
        ref = m(x)
        (ref_grad,) = torch.autograd.grad(ref, x, cot[i])
        torch.testing.assert_close(out[i], ref, rtol=0, atol=0, equal_nan=True, msg=lambda s: f"member {i} "
                                   f"{bounds[i]}: output: {s}")
        torch.testing.assert_close(grad[i], ref_grad, rtol=0, atol=0, equal_nan=True, msg=lambda s: f"member {i} "
                                   f"{bounds[i]}: input gradient: {s}")


class _Soft(nn.Module):
    def __init__(self, kind: str, v: float):
        super().__init__()
        self.kind, self.v = kind, v

    def forward(self, x):
        if self.kind == "softplus":
            return F.softplus(x, beta=self.v)
        if self.kind == "elu":
            return F.elu(x, alpha=self.v)
        return F.celu(x, alpha=self.v)


@pytest.mark.parametrize("kind", ["softplus", "elu", "celu"])
def test_per_member_activation_gradient_is_finite_where_the_other_branch_overflows(kind):
    """The branch ``where`` does not take overflows (exp of a large input): its zero gradient
    times inf used to give NaN gradients where ATen's are finite."""
    values = [1.0, 2.0] if kind != "celu" else [0.5, 2.0]
    models = [_Soft(kind, v) for v in values]
    wide = wc.compile(models, torch.randn(8), config=FAST)
    xs = torch.tensor([[-3.0, -0.5, 0.0, 0.5, 30.0, 100.0, 1000.0, -1000.0]] * 2).requires_grad_()
    out = wide(xs)
    (grad,) = torch.autograd.grad(out.sum(), xs)
    for i, m in enumerate(models):
        x = xs[i].detach().clone().requires_grad_()
        ref = m(x)
        (ref_grad,) = torch.autograd.grad(ref.sum(), x)
        torch.testing.assert_close(out[i], ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grad[i], ref_grad, rtol=1e-6, atol=1e-6)


def test_hardtanh_with_lo_above_hi_in_one_member_is_refused_as_alone():
    """F.hardtanh refuses min_val > max_val in Python; a member that would raise alone is refused
    by name at compile time, not clamped."""
    with pytest.raises(wc.ArchitectureMismatchError, match=r"member 1: .*min_val cannot be greater than max_val"):
        wc.compile([_Bounded("hardtanh", -1.0, 1.0), _Bounded("hardtanh", 0.5, -0.5)],
                   torch.randn(64, dtype=torch.float64), config=FAST)


@cpu_only  # emulates CUDA's kernels on the CPU; on a GPU the test above compares with them directly
def test_off_the_cpu_the_bounds_follow_cudas_kernels(monkeypatch):
    """Note [Per-member bounds]: CUDA's kernels differ from the CPU's at NaN (a GPU run, torch
    2.11): ``x.clamp(max=nan)`` is ``x`` there, with no gradient, and hardtanh's gradient passes at
    a NaN input. The forms ask the device at the call; answering as off the CPU, they give that."""
    from wide_compiler.fx.rules import _constants

    monkeypatch.setattr(_constants, "_off_the_cpu", lambda x: True)
    xs = _bound_inputs(2).requires_grad_()
    nan = xs.detach().isnan()
    wide = wc.compile([_Bounded("clamp_max", -1.0, hi) for hi in (1.0, NAN)], torch.randn(64, dtype=torch.float64),
                      config=FAST)
    out = wide(xs)
    (grad,) = torch.autograd.grad(out.sum(), xs)
    torch.testing.assert_close(out[0], xs[0].detach().clamp(max=1.0), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(out[1], xs[1].detach(), rtol=0, atol=0, equal_nan=True)
    assert grad[1].eq(0).all() and grad[0].eq((xs[0] <= 1.0).double()).all()
    wide = wc.compile([_Bounded("hardtanh", lo, hi) for lo, hi in ((-1.0, 1.0), (-0.5, 0.25))],
                      torch.randn(64, dtype=torch.float64), config=FAST)
    out = wide(xs)
    (grad,) = torch.autograd.grad(out.sum(), xs)
    assert grad[nan].eq(1).all() and out.detach()[nan].isnan().all()
    for i, (lo, hi) in enumerate(((-1.0, 1.0), (-0.5, 0.25))):
        x = xs[i].detach()
        inside = ((x > lo) & (x < hi)).double()
        torch.testing.assert_close(grad[i][~nan[i]], inside[~nan[i]], rtol=0, atol=0)
