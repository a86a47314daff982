"""wide_compiler.optim optimizers against torch.optim, member by member (DESIGN §6).

The contract: N members with N different learning rates and weight decays, trained K steps
with ONE per-member optimizer over stacked [N, ...] parameters, end up with the weights,
buffers and optimizer state that torch.optim gives each member trained alone.

Tolerance: fp32, 1e-6 relative, element-wise OR to the tensor's scale (|got - want| <=
1e-6 * |want| + 1e-6 * max|want|), so an element near zero is held to 1e-6 of its tensor's
magnitude rather than of itself. The per-member
gradients are bit-identical to the reference's here (each member's forward runs the same ops on
views of the stacked tensors), so the only difference is the optimizer arithmetic: SGD is
bit-identical; Adam/AdamW/RMSprop/Adagrad differ by an ulp where ATen's fp32 sqrt (MKL VML, not
correctly rounded) and the kernel's IEEE sqrt disagree (Note [Fused per-member optimizer
kernels] in csrc/wide/optim/cpu/kernels_impl.h).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import wide_compiler as wc
from support import DEVICE, OpRecorder
from torch import nn
from torch.func import functional_call
from wide_compiler.testing import assert_members_close

N, STEPS = 8, 20
# On a GPU the fused step and torch.optim's CUDA kernels contract different multiply-adds (FMA):
# 20 RMSprop steps differed by 5.9e-7 of a 0.55 weight on an H200 (the CPU's bound is 1e-6 relative)
RTOL, ATOL = (1e-6 if DEVICE.type == "cpu" else 2e-6), 1e-7


def assert_rel(got, want, msg=""):
    """The contract tolerance (module docstring)."""
    atol = max(ATOL, RTOL * want.abs().max().item()) if want.numel() and want.is_floating_point() else 0
    torch.testing.assert_close(got, want, rtol=RTOL, atol=atol, msg=(lambda m: f"{msg}: {m}") if msg else None)
LRS = [1e-3 * (1.5 ** i) for i in range(N)]             # 8 different learning rates
WDS = [0.0, 1e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2]  # 8 different weight decays (one zero)

# (name, wide class, torch class, shared kwargs, per-member kwargs(i) -> dict)
CASES = [
    ("sgd", wc.optim.SGD, torch.optim.SGD, {}, lambda i: {}),
    ("sgd_momentum", wc.optim.SGD, torch.optim.SGD, {"momentum": 0.9}, lambda i: {}),
    ("sgd_nesterov", wc.optim.SGD, torch.optim.SGD, {"momentum": 0.9, "nesterov": True}, lambda i: {}),
    ("sgd_dampening_maximize", wc.optim.SGD, torch.optim.SGD, {"momentum": 0.5, "maximize": True},
     lambda i: {"dampening": 0.1 * (i % 3)}),
    ("sgd_mixed_momentum", wc.optim.SGD, torch.optim.SGD, {}, lambda i: {"momentum": [0.0, 0.9][i % 2]}),
    ("adam", wc.optim.Adam, torch.optim.Adam, {}, lambda i: {}),
    ("adam_amsgrad_betas", wc.optim.Adam, torch.optim.Adam, {"amsgrad": True},
     lambda i: {"betas": (0.8 + 0.01 * i, 0.99 + 0.001 * i), "eps": 10.0 ** (-8 + i % 3)}),
    ("adamw", wc.optim.AdamW, torch.optim.AdamW, {}, lambda i: {}),
    ("adamw_amsgrad", wc.optim.AdamW, torch.optim.AdamW, {"amsgrad": True}, lambda i: {}),
    ("adamw_maximize", wc.optim.AdamW, torch.optim.AdamW, {"maximize": True}, lambda i: {}),
    ("rmsprop", wc.optim.RMSprop, torch.optim.RMSprop, {}, lambda i: {}),
    ("rmsprop_centered_momentum", wc.optim.RMSprop, torch.optim.RMSprop, {"centered": True},
     lambda i: {"momentum": [0.0, 0.5, 0.9][i % 3], "alpha": 0.9 + 0.01 * i}),
    ("adagrad", wc.optim.Adagrad, torch.optim.Adagrad, {},
     lambda i: {"lr_decay": 0.01 * i, "initial_accumulator_value": 0.1 * i}),
]


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    # No bias before the BatchNorm (as usual): BN cancels it, so its gradient is pure rounding
    # noise (~1e-9) that Adam/RMSprop normalise into lr-sized steps of random sign; an ulp of
    # difference anywhere would then flip those steps and the comparison would test noise.
    return nn.Sequential(nn.Linear(6, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(),
                         nn.Dropout(0.0), nn.Linear(16, 3))


class Stacked:
    """N members of one model held as stacked [N, ...] parameters and buffers; member i runs
    the template on VIEWS [i] of them, so gradients and buffer updates land in the stacked
    tensors (the optimizer math is what is under test here, not the wide forward)."""

    def __init__(self, models):
        self.template = copy.deepcopy(models[0])
        self.params = {k: nn.Parameter(torch.stack([m.get_parameter(k).detach() for m in models]))
                       for k, _ in models[0].named_parameters()}
        self.buffers = {k: torch.stack([m.get_buffer(k).detach() for m in models])
                        for k, _ in models[0].named_buffers()}

    def member_loss(self, i, x, y):
        state = {**{k: v[i] for k, v in self.params.items()}, **{k: v[i] for k, v in self.buffers.items()}}
        return F.cross_entropy(functional_call(self.template, state, (x,)), y)


def per_member_kwargs(shared, per, lrs=LRS, wds=WDS):
    """The wide optimizer's kwargs (lists of N values) and member i's torch.optim kwargs."""
    members = [{"lr": lrs[i], "weight_decay": wds[i], **shared, **per(i)} for i in range(N)]
    wide = dict(shared)
    for key in members[0]:
        if key in shared:
            continue
        if key == "betas":
            wide[key] = ([m[key][0] for m in members], [m[key][1] for m in members])
        else:
            wide[key] = [m[key] for m in members]
    return wide, members


def data(step):
    g = torch.Generator(DEVICE).manual_seed(100 + step)
    return torch.randn(N, 10, 6, generator=g), torch.randint(0, 3, (N, 10), generator=g)


def assert_state_equal(wide_opt, ref_opts):
    for i, ref in enumerate(ref_opts):
        got, want = wide_opt.member_state_dict(i), ref.state_dict()
        assert got["state"].keys() == want["state"].keys(), f"member {i}: state params differ"
        for pid in want["state"]:
            w_st, g_st = want["state"][pid], got["state"][pid]
            assert set(g_st) == set(w_st), f"member {i} param {pid}: state keys {set(g_st)} != {set(w_st)}"
            for key, value in w_st.items():
                if isinstance(value, torch.Tensor):
                    assert_rel(g_st[key], value, f"member {i} param {pid} state {key}")
                else:
                    assert g_st[key] == value


@pytest.mark.parametrize("name,wide_cls,torch_cls,shared,per", CASES, ids=[c[0] for c in CASES])
def test_contract_matches_torch_optim_per_member(name, wide_cls, torch_cls, shared, per):
    models = [make_model(i) for i in range(N)]
    refs = [copy.deepcopy(m).train() for m in models]
    wide = Stacked(models)
    wide_kw, member_kw = per_member_kwargs(shared, per)
    opt = wide_cls(wide.params.values(), **wide_kw)
    ref_opts = [torch_cls(r.parameters(), **kw) for r, kw in zip(refs, member_kw)]

    for step in range(STEPS):
        x, y = data(step)
        opt.zero_grad()
        sum(wide.member_loss(i, x[i], y[i]) for i in range(N)).backward()
        opt.step()
        for i, (r, o) in enumerate(zip(refs, ref_opts)):
            o.zero_grad()
            F.cross_entropy(r(x[i]), y[i]).backward()
            o.step()

    for k, p in wide.params.items():
        for i, r in enumerate(refs):
            assert_rel(p[i].detach(), r.get_parameter(k).detach(), f"{name}: member {i} parameter {k}")
    for k, b in wide.buffers.items():
        for i, r in enumerate(refs):
            assert_rel(b[i], r.get_buffer(k), f"{name}: member {i} buffer {k}")
    assert_state_equal(opt, ref_opts)
    # the members really differ (a test that cannot fail is a defect)
    w = wide.params["0.weight"].detach()
    assert not torch.equal(w[0], w[-1])


@pytest.mark.parametrize("name,wide_cls,torch_cls,shared,per",
                         [c for c in CASES if c[0] in ("sgd_momentum", "adamw_amsgrad", "rmsprop_centered_momentum")],
                         ids=["sgd_momentum", "adamw_amsgrad", "rmsprop_centered_momentum"])
def test_compiled_wide_mlp_trains_like_separate_models(name, wide_cls, torch_cls, shared, per):
    """The same contract on a compiled WideModel (Linear + ReLU): the gradients now come from
    batched GEMMs, so weights agree to the suite's fp32 forward tolerance."""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)) for _ in range(N)]
    refs = [copy.deepcopy(m) for m in models]
    wide = wc.compile(models, torch.randn(4, 6), config=wc.WideConfig.fast())
    wide_kw, member_kw = per_member_kwargs(shared, per)
    opt = wide_cls(wide.parameters(), **wide_kw)
    ref_opts = [torch_cls(r.parameters(), **kw) for r, kw in zip(refs, member_kw)]
    for step in range(10):
        x, y = data(step)
        opt.zero_grad()
        wc.optim.member_losses(F.cross_entropy, wide(x), y).sum().backward()
        opt.step()
        for i, (r, o) in enumerate(zip(refs, ref_opts)):
            o.zero_grad()
            F.cross_entropy(r(x[i]), y[i]).backward()
            o.step()
    for name_, p in wide.named_parameters():
        assert_members_close(p.detach(), [r.get_parameter(name_).detach() for r in refs], what=name_)
    unfused = wide.unfuse()
    x, _ = data(99)
    for i in range(N):
        torch.testing.assert_close(unfused[i](x[i]), refs[i](x[i]), rtol=1e-5, atol=1e-5)


def test_any_parameter_with_member_dim_and_non_contiguous():
    """Parameters need not come from a WideModel, nor be contiguous."""
    base = torch.randn(5, 3, 4)
    p = nn.Parameter(base.permute(2, 0, 1))          # [4, 5, 3], non-contiguous
    assert not p.is_contiguous()
    lrs = [0.1, 0.2, 0.3, 0.4]
    opt = wc.optim.Adam([p], lr=lrs)
    refs = [nn.Parameter(p[i].detach().clone()) for i in range(4)]
    ref_opts = [torch.optim.Adam([r], lr=lr) for r, lr in zip(refs, lrs)]
    for _ in range(3):
        g = torch.randn(4, 5, 3)
        p.grad = g.permute(0, 2, 1).contiguous().permute(0, 2, 1)   # non-contiguous grad too
        opt.step()
        for i, (r, o) in enumerate(zip(refs, ref_opts)):
            r.grad = g[i].clone()
            o.step()
    for i in range(4):
        assert_rel(p[i].detach(), refs[i].detach())


def test_state_dict_roundtrip_and_member_state_dict_loads_into_torch():
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(N, 7))
    opt = wc.optim.AdamW([w], lr=LRS, weight_decay=WDS, amsgrad=True)
    for _ in range(3):
        w.grad = torch.randn(N, 7)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    w2 = nn.Parameter(w.detach().clone())
    opt2 = wc.optim.AdamW([w2], lr=0.5)
    opt2.load_state_dict(saved)
    assert opt2.param_groups[0]["lr"].tolist() == pytest.approx(LRS)
    for _ in range(2):
        g = torch.randn(N, 7)
        w.grad, w2.grad = g.clone(), g.clone()
        opt.step()
        opt2.step()
    assert torch.equal(w, w2)
    # member 3's state drives a plain torch.optim.AdamW to the same next step
    ref = nn.Parameter(w[3].detach().clone())
    ref_opt = torch.optim.AdamW([ref])
    ref_opt.load_state_dict(opt.member_state_dict(3))
    assert ref_opt.param_groups[0]["lr"] == pytest.approx(LRS[3])
    g = torch.randn(N, 7)
    w.grad, ref.grad = g, g[3].clone()
    opt.step()
    ref_opt.step()
    assert_rel(w[3].detach(), ref.detach())


# ------------------------------------------------------------------------- bad hyperparameters
@pytest.mark.parametrize("cls,kwargs,match", [
    (wc.optim.SGD, {"lr": [0.1] * (N - 1)}, "got 7 values but there are N=8"),
    (wc.optim.Adam, {"lr": torch.ones(N + 1)}, r"shape \[8\]"),
    (wc.optim.Adam, {"betas": (0.9, [0.99] * 3)}, "betas"),
    (wc.optim.AdamW, {"weight_decay": torch.ones(2, N)}, "weight_decay"),
    (wc.optim.RMSprop, {"momentum": [0.1] * 9}, "momentum"),
    (wc.optim.Adagrad, {"lr_decay": [0.0] * 2}, "lr_decay"),
    (wc.optim.SGD, {"lr": [-0.1] + [0.1] * (N - 1)}, "member 0"),
    (wc.optim.Adam, {"betas": ([0.9] * (N - 1) + [1.0], 0.999)}, "member 7"),
    (wc.optim.SGD, {"momentum": [0.9] * (N - 1) + [0.0], "nesterov": True}, "member 7"),
    (wc.optim.SGD, {"lr": float("nan")}, "finite"),
    (wc.optim.SGD, {"nesterov": 1}, "bool"),
])
def test_bad_hyperparameters_raise_clear_errors(cls, kwargs, match):
    w = nn.Parameter(torch.randn(N, 3))
    with pytest.raises((ValueError, TypeError), match=match):
        cls([w], **kwargs)


def test_bad_values_change_nothing():
    w = nn.Parameter(torch.randn(N, 3))
    opt = wc.optim.Adam([w], lr=LRS)
    w.grad = torch.randn(N, 3)
    opt.step()
    before_w = w.detach().clone()
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match="lr"):
        opt.set_member_hyperparameters(2, lr=-1.0)
    with pytest.raises(ValueError, match="not a per-member hyperparameter"):
        opt.set_member_hyperparameters(2, lr=0.5, momentum=0.9)
    with pytest.raises(IndexError):
        opt.set_member_hyperparameters(N, lr=0.5)
    bad = copy.deepcopy(before)
    bad["param_groups"][0]["lr"] = torch.ones(N - 1)
    with pytest.raises(ValueError, match="lr"):
        opt.load_state_dict(bad)
    bad = copy.deepcopy(before)
    bad["state"][0]["exp_avg"] = torch.zeros(N - 1, 3)
    with pytest.raises(ValueError, match="dim 0 = N = 8"):
        opt.load_state_dict(bad)
    # a parameter whose dim 0 is not N
    with pytest.raises(ValueError, match="N=8"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(N + 1, 2))]})
    # the op itself rejects a wrong-length hyperparameter before touching anything
    st = opt.state[w]
    with pytest.raises(RuntimeError, match=r"wide::adam_step: expected lr with one value per member"):
        torch.ops.wide.adam_step(w.detach(), w.grad, st["exp_avg"], st["exp_avg_sq"], None, st["step"],
                                 torch.ones(N - 1, dtype=torch.float64), *(torch.ones(1),) * 4)
    assert torch.equal(w.detach(), before_w)
    after = opt.state_dict()
    assert torch.equal(after["state"][0]["step"], before["state"][0]["step"])
    assert torch.equal(after["state"][0]["exp_avg"], before["state"][0]["exp_avg"])
    assert torch.equal(after["param_groups"][0]["lr"], before["param_groups"][0]["lr"])


def test_change_one_member_in_place_and_copy_member_state():
    w = nn.Parameter(torch.randn(4, 3))
    opt = wc.optim.SGD([w], lr=0.1, momentum=[0.0, 0.5, 0.9, 0.9])
    opt.set_member_hyperparameters(1, lr=0.3, momentum=0.7)
    assert opt.param_groups[0]["lr"].tolist() == pytest.approx([0.1, 0.3, 0.1, 0.1])
    assert opt.member_hyperparameters(1) == {"lr": pytest.approx(0.3), "momentum": pytest.approx(0.7),
                                             "dampening": 0.0, "weight_decay": 0.0, "nesterov": False,
                                             "maximize": False}
    w.grad = torch.randn(4, 3)
    opt.step()
    opt.copy_member_state(2, 0)
    buf = opt.state[w]["momentum_buffer"]
    assert torch.equal(buf[0], buf[2])
    assert opt.param_groups[0]["momentum"][0].item() == pytest.approx(0.9)
    opt.reset_member_state(1)
    assert torch.count_nonzero(buf[1]) == 0 and torch.count_nonzero(buf[2]) > 0


# ----------------------------------------------------------------------- the operators themselves
def sample_inputs(dtype=torch.float32, n=3, shape=(5, 7)):
    """(op, args, kwargs) for each fused step op: per-member hyperparameters [N] and shared [1]."""
    def t():
        return torch.randn(n, *shape, dtype=dtype)

    def hp(lo, hi):
        return torch.linspace(lo, hi, n, dtype=torch.float64)

    one = lambda v: torch.tensor([v], dtype=torch.float64)
    step = lambda: torch.zeros(n)
    sq = lambda: t().abs()
    yield ("sgd_step", (t(), t(), t(), hp(0.01, 0.1), hp(0, 0.01), hp(0.5, 0.9), one(0.0)),
           {"nesterov": True})
    yield ("sgd_step", (t(), t(), None, one(0.1), one(0.0), one(0.0), one(0.0)), {"maximize": True})
    yield ("adam_step", (t(), t(), t(), sq(), sq(), step(), hp(1e-3, 1e-2), one(0.9), hp(0.99, 0.999),
                         one(1e-8), hp(0, 0.1)), {"amsgrad": True, "decoupled_weight_decay": True})
    yield ("adam_step", (t(), t(), t(), sq(), None, step(), one(1e-3), one(0.9), one(0.999), one(1e-8),
                         one(0.0)), {})
    yield ("rmsprop_step", (t(), t(), sq() + 1, t() * 0.1, t(), step(), hp(1e-3, 1e-2), one(0.99),
                            one(1e-8), one(0.0), hp(0.0, 0.9)), {"centered": True})
    yield ("adagrad_step", (t(), t(), sq(), step(), hp(0.01, 0.1), hp(0, 0.1), one(0.0), one(1e-10)),
           {"maximize": True})


# opcheck of the step ops: test_op_db.py


@pytest.mark.parametrize("sample", list(sample_inputs()), ids=lambda s: s[0])
def test_steps_bump_the_version_of_every_tensor_they_write(sample):
    """Note [Optimizer steps bump version counters] (csrc/wide/optim/inplace.cpp): as for
    torch.optim's in-place updates, so autograd and version-keyed caches see the step."""
    op, args, kwargs = sample
    args = _clone(args)
    schema = getattr(torch.ops.wide, op).default._schema
    written = [a for a, arg in zip(args, schema.arguments)
               if isinstance(a, torch.Tensor) and arg.alias_info is not None and arg.alias_info.is_write]
    before = [t._version for t in written]
    getattr(torch.ops.wide, op)(*args, **kwargs)
    assert written and all(t._version > v for t, v in zip(written, before))
    read = [a for a, arg in zip(args, schema.arguments) if isinstance(a, torch.Tensor) and arg.alias_info is None]
    assert all(t._version == 0 for t in read)


def test_a_step_between_forward_and_backward_is_an_autograd_error():
    """Stepping a parameter its graph saved for backward raises, as it does with torch.optim,
    instead of giving gradients of weights that no longer exist."""
    w = nn.Parameter(torch.randn(N, 3, 3))
    opt = wc.optim.SGD([w], lr=0.1)
    w.grad = torch.ones_like(w)
    loss = (w * w).sum()  # saves w
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def _clone(args):
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.parametrize("isa", ["default", "avx2", "avx512"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_instruction_set_matches_the_composite(isa, dtype):
    """Each compiled kernel (all ISAs the CPU has) against the ATen composite (the fallback for
    other devices and dtypes), reached on CPU through a bfloat16-free path: we call the composite
    kernel on the CompositeExplicitAutograd key directly."""
    before = torch.ops.wide._optim_cpu_capability()
    try:
        torch.ops.wide._optim_cpu_capability(isa)
    except RuntimeError as e:
        pytest.skip(str(e))
    try:
        ks = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
        for op, args, kwargs in sample_inputs(dtype, n=4, shape=(3, 37)):
            a, b = _clone(args), _clone(args)
            opov = getattr(torch.ops.wide, op).default
            opov(*a, **kwargs)
            opov.redispatch(ks, *b, **kwargs)
            tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-12}
            for x, y in zip(a, b):
                if isinstance(x, torch.Tensor):
                    torch.testing.assert_close(x, y, **tol, msg=lambda m: f"{op} [{isa}]: {m}")
    finally:
        torch.ops.wide._optim_cpu_capability(before)


def test_low_precision_dtypes_use_the_composite():
    torch.manual_seed(0)
    lrs = [0.1, 0.01, 0.001]
    w = nn.Parameter(torch.randn(3, 8, dtype=torch.bfloat16))
    refs = [nn.Parameter(w[i].detach().clone()) for i in range(3)]
    opt = wc.optim.Adam([w], lr=lrs)
    ref_opts = [torch.optim.Adam([r], lr=lr) for r, lr in zip(refs, lrs)]
    for _ in range(3):
        g = torch.randn(3, 8, dtype=torch.bfloat16)
        w.grad = g
        opt.step()
        for i in range(3):
            refs[i].grad = g[i].clone()
            ref_opts[i].step()
    assert opt.state[w]["exp_avg"].dtype == torch.bfloat16
    for i in range(3):   # bf16 has 8 bits of mantissa
        torch.testing.assert_close(w[i].detach().float(), refs[i].detach().float(), rtol=2e-2, atol=2e-2)


def test_empty_and_single_member():
    w = nn.Parameter(torch.randn(1, 0, 3))
    opt = wc.optim.Adam([w])
    w.grad = torch.zeros(1, 0, 3)
    opt.step()
    assert opt.state[w]["step"].tolist() == [1.0]
    w = nn.Parameter(torch.randn(1, 5))
    ref = nn.Parameter(w[0].detach().clone())
    opt, ref_opt = wc.optim.RMSprop([w], lr=0.01), torch.optim.RMSprop([ref], lr=0.01)
    g = torch.randn(1, 5)
    w.grad, ref.grad = g, g[0].clone()
    opt.step()
    ref_opt.step()
    assert_rel(w[0].detach(), ref.detach())


def test_step_is_one_fused_op_per_parameter():
    ps = [nn.Parameter(torch.randn(4, 3, 2)), nn.Parameter(torch.randn(4, 5))]
    opt = wc.optim.AdamW(ps, lr=[0.1, 0.2, 0.3, 0.4])
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()                       # state created here
    with OpRecorder(full_names=True) as c:
        opt.step()
    assert c.ops == ["wide.adam_step.default"] * 2, c.ops


def test_member_methods_after_a_hand_assigned_hyperparameter():
    """The manual-schedule idiom (``group["lr"] = 0.5``) between steps: the member-level methods
    see the new value as every member's, as step() would."""
    w = torch.nn.Parameter(torch.ones(3, 2))
    opt = wc.optim.Adam([w], lr=[0.1, 0.2, 0.3])
    w.grad = torch.ones(3, 2)
    opt.step()
    opt.param_groups[0]["lr"] = 0.5
    assert opt.member_hyperparameters(1)["lr"] == 0.5
    opt.param_groups[0]["lr"] = 0.25
    opt.copy_member_state(0, 2)
    assert opt.param_groups[0]["lr"].tolist() == [0.25, 0.25, 0.25]
    opt.param_groups[0]["lr"] = 0.125
    opt.set_member_hyperparameters(0, lr=0.01)
    assert opt.param_groups[0]["lr"].tolist() == [0.01, 0.125, 0.125]
    opt.param_groups[0]["lr"] = 0.75
    assert opt.member_state_dict(2)["param_groups"][0]["lr"] == 0.75


def test_load_state_dict_twice():
    """torch's load adds 'differentiable' to defaults; a second load (accelerate's resume) must not
    take that for a group saved by another optimizer."""
    p = torch.nn.Parameter(torch.randn(3, 4))
    p.grad = torch.randn(3, 4)
    opt = wc.optim.Adam([p], lr=[1e-3, 2e-3, 3e-3])
    opt.step()
    for _ in range(2):
        opt.load_state_dict(opt.state_dict())
    opt.step()
    assert opt.state[p]["exp_avg"].shape == (3, 4)
