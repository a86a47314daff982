"""Probe 19 of issue 44 (an independent re-run of the adversarial probe): each finding is a test
that failed before its fix. A dim op on a 0-d member value (Note [A dim op on a 0-d member value]
in fx/rules/reduction.py), and a conversion of a model whose capture template runs a registered
module opaquely (``BatchNorm(momentum=None)``)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import wide_compiler as wc

FAST = wc.WideConfig.fast()
D = torch.float64

ON_A_SCALAR = {  # the member's 0-d value s = h.sum() (or a full reduction over dims), then a dim op on it
    "sum.sum": lambda h: h.sum().sum(),
    "sum01.sum": lambda h: h.sum((0, 1)).sum(),
    "mean01.sum": lambda h: h.mean((0, 1)).sum(),
    "sum.sum(-1)": lambda h: h.sum().sum(-1),
    "sum.sum(0, keepdim)": lambda h: h.sum().sum(0, keepdim=True),
    "sum.mean": lambda h: h.sum().mean(),
    "sum.amax": lambda h: h.sum().amax(),
    "sum.max": lambda h: h.sum().max(),
    "sum.max(0)": lambda h: h.sum().max(0)[0],
    "sum.softmax(0)": lambda h: h.sum().softmax(0),
    "sum.logsumexp(0)": lambda h: h.sum().logsumexp(0),
    "sum.cumsum(0)": lambda h: h.sum().cumsum(0),
}


class _OnAScalar(nn.Module):
    def __init__(self, f) -> None:
        super().__init__()
        self.a, self.f = nn.Linear(8, 6), f

    def forward(self, x):
        h = self.a(x)
        return h + self.f(h)


@pytest.mark.parametrize("name", sorted(ON_A_SCALAR))
def test_a_dim_op_on_a_0d_member_value_is_per_member(name):
    """P19-1: ``h + h.sum().sum()``: the second sum reduced the wide [N] over all its dims (the
    members too) and compile stopped with an internal error; softmax(0) of it raised IndexError."""
    torch.manual_seed(0)
    models = [_OnAScalar(ON_A_SCALAR[name]).double() for _ in range(3)]
    wide = wc.compile(copy.deepcopy(models), torch.randn(5, 8, dtype=D), config=FAST)
    x = torch.randn(3, 5, 8, dtype=D, requires_grad=True)
    out = wide(x)
    out.sum().backward()
    for i, m in enumerate(models):
        xi = x[i].detach().requires_grad_()
        want = m(xi)
        want.sum().backward()
        torch.testing.assert_close(out[i], want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(x.grad[i], xi.grad, rtol=1e-12, atol=1e-12)


class _CumulativeNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn = nn.Linear(6, 8), nn.BatchNorm1d(8, momentum=None)

    def forward(self, x):
        return self.bn(self.fc(x))


@pytest.mark.parametrize("defer", [False, True])
def test_a_conversion_converts_the_registered_modules_the_capture_runs_opaquely(defer):
    """P19-2: after ``wide.double()`` of float32 members with ``BatchNorm1d(momentum=None)`` (kept
    whole, run opaquely during capture), every call was refused with export's "mixed dtype (CPU)":
    the opaque module's tensors stayed float32."""
    torch.manual_seed(0)
    models = [_CumulativeNorm() for _ in range(3)]
    wide = wc.compile(copy.deepcopy(models), torch.randn(4, 6), config=wc.WideConfig(tune=False, defer=defer))
    wide.double()
    refs = [copy.deepcopy(m).double() for m in models]
    for mode in ("train", "eval"):
        for m in [wide, *refs]:
            m.train(mode == "train")
        x = torch.randn(3, 4, 6, dtype=D)
        out = wide(x)
        for i, m in enumerate(refs):
            torch.testing.assert_close(out[i], m(x[i]), rtol=1e-10, atol=1e-10)


class _Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.calls, self.tag = nn.Linear(4, 3), 0, ("a", 1)

    def forward(self, x):
        self.calls += 1
        return self.fc(x) * self.calls


def test_a_deferred_members_changed_attributes_come_back_with_it():
    """P19-4: a deferred model runs our copies of the members; a forward that counts its calls in
    ``self.calls`` changed the copies', but member(i), unfuse() and write_back() gave the count at
    compile (0): the extracted member 4.29 off at its next call. They carry the copy's value."""
    torch.manual_seed(0)
    models = [_Counting() for _ in range(3)]
    refs = copy.deepcopy(models)
    wide = wc.compile(copy.deepcopy(models), torch.randn(2, 4), config=wc.WideConfig(tune=False, defer=True))
    wide.expect_calls(train_calls=3)
    for _ in range(3):
        x = torch.randn(3, 2, 4)
        out = wide(x)
        for i, m in enumerate(refs):
            torch.testing.assert_close(out[i], m(x[i]))
    back = copy.deepcopy(models)
    wide.write_back(back)
    x = torch.randn(2, 4)
    for i, m in enumerate(refs):
        assert wide.member(i).calls == wide.unfuse()[i].calls == back[i].calls == m.calls == 3
        assert back[i].tag == ("a", 1)
        torch.testing.assert_close(wide.member(i)(x), m(x))


class _Stateful(nn.Module):
    """A GRU carrying its hidden state across calls in a plain attribute (truncated BPTT)."""

    def __init__(self) -> None:
        super().__init__()
        self.gru, self.o, self.hidden = nn.GRU(4, 5, batch_first=True), nn.Linear(5, 2), None

    def forward(self, x):
        y, h = self.gru(x, self.hidden)
        self.hidden = h.detach()
        return self.o(y)


def test_a_deferred_members_hidden_state_tensor_comes_back_with_it():
    """P19-4, the tensor form: ``self.hidden`` came back as None from member(i) (0.061 off)."""
    torch.manual_seed(0)
    models = [_Stateful().double() for _ in range(3)]
    refs = copy.deepcopy(models)
    wide = wc.compile(copy.deepcopy(models), torch.randn(2, 3, 4, dtype=D),
                      config=wc.WideConfig(tune=False, defer=True))
    wide.expect_calls(train_calls=3)
    for _ in range(3):
        x = torch.randn(3, 2, 3, 4, dtype=D)
        out = wide(x)
        for i, m in enumerate(refs):
            torch.testing.assert_close(out[i], m(x[i]))
    x = torch.randn(2, 3, 4, dtype=D)
    for i, m in enumerate(refs):
        mine = wide.member(i)
        torch.testing.assert_close(mine.hidden, m.hidden)
        torch.testing.assert_close(mine(x), m(x))


class _CountsOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.calls = nn.Linear(4, 3), 0

    def forward(self, x):
        self.calls += 1  # feeds no output: accepted
        return self.a(x)


def test_a_counter_that_feeds_nothing_is_warned_of_at_compile():
    """Probe 20, P20-2: a call counter that feeds no output is accepted (the outputs are every
    member's), but the compiled graph does not run it: member(i) keeps the count at compile. The
    capture says so, naming the attribute (Note [State that feeds nothing])."""
    models = [_CountsOnly() for _ in range(2)]
    with pytest.warns(UserWarning, match=r"self.calls of the root \(_CountsOnly\): 0 -> 1.*hold their values at compile"):
        wide = wc.compile(models, torch.randn(2, 4), config=FAST)
    x = torch.randn(2, 2, 4)
    for i, m in enumerate(models):
        torch.testing.assert_close(wide(x)[i], m(x[i]))


_TENSOR_CONSTANT = {
    "mul": lambda h, t: h * torch.tensor(t),
    "div": lambda h, t: h / torch.tensor(t),
    "mul_": lambda h, t: h.clone().mul_(torch.tensor(t)),
    "mul float64": lambda h, t: h * torch.tensor(t, dtype=torch.float64),
    "left mul": lambda h, t: torch.tensor(t) * h,
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("form", sorted(_TENSOR_CONSTANT))
def test_a_per_member_0d_multiplier_is_used_unrounded_as_aten_does(form, dtype):
    """Probe 20, P20-7: ``h * torch.tensor(self.t)`` with t per member, in bfloat16/float16: ATen
    multiplies by the float32 0-d operand unrounded (its opmath) and rounds once; the wide model
    rounded t to the tensor's dtype first: 1 ulp off in a quarter of the values (Note [A 0-dim
    multiplier in opmath] in fx/rules/pointwise.py). Bit for bit now, values and input gradients."""
    f = _TENSOR_CONSTANT[form]

    class M(nn.Module):
        def __init__(self, t) -> None:
            super().__init__()
            self.w, self.t = nn.Parameter(torch.randn(5)), t

        def forward(self, x):
            return f(x * self.w, self.t)

    torch.manual_seed(0)
    models = [M(t).to(dtype) for t in (0.3001, 1.7003, 2.9999, 0.1234567)]
    wide = wc.compile(copy.deepcopy(models), torch.randn(4, 5).to(dtype), config=FAST)
    x = (4 * torch.randn(4, 16, 5)).to(dtype).requires_grad_()
    out = wide(x)
    out.float().sum().backward()
    for i, m in enumerate(models):
        xi = x[i].detach().requires_grad_()
        want = m(xi)
        want.float().sum().backward()
        assert out[i].dtype == want.dtype
        assert torch.equal(out[i], want), (out[i] - want).abs().max()
        assert torch.equal(x.grad[i], xi.grad)


class _CausalEncoder(nn.Module):
    def __init__(self, is_causal=None) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True, dropout=0.0)
        self.e, self.is_causal = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), is_causal

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.e(x, mask=mask) if self.is_causal is None else self.e(x, mask=mask, is_causal=self.is_causal)


def test_a_causal_mask_without_is_causal_is_refused_saying_the_one_word_fix():
    """Probe 20, P20-6: TransformerEncoder(x, mask=causal) checks the mask's values to decide
    whether it is causal, which export cannot trace: its raw data-dependent-guard error said
    nothing of that; the refusal names the check and the fix (is_causal=True), which compiles."""
    torch.manual_seed(0)
    members = [_CausalEncoder().eval() for _ in range(2)]
    with pytest.raises(wc.WideCompileError, match=r"(?s)_detect_is_causal_mask.*is_causal=True"):
        wc.compile(copy.deepcopy(members), torch.randn(2, 5, 8), config=FAST)
    fixed = [_CausalEncoder(is_causal=True).eval() for _ in range(2)]
    for m, src in zip(fixed, members):
        m.load_state_dict(src.state_dict())
    wide = wc.compile(copy.deepcopy(fixed), torch.randn(2, 5, 8), config=FAST)
    x = torch.randn(2, 2, 5, 8)
    for i, m in enumerate(members):
        torch.testing.assert_close(wide(x)[i], m(x[i]), rtol=1e-5, atol=1e-5)


class _MaxNormEmbedding(nn.Module):
    def __init__(self, d: int, norm_type: float = 2.0) -> None:
        super().__init__()
        self.e, self.o = nn.Embedding(9, d, max_norm=1.0, norm_type=norm_type), nn.Linear(d, 2)

    def forward(self, i):
        return self.o(self.e(i))


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0])
def test_a_max_norm_embedding_pads_its_swept_dim(norm_type):
    """Probe 20, P20-5: ``nn.Embedding(max_norm=...)`` with a swept embedding dim was refused as a
    write into the padding; a zero padding column adds nothing to a row's norm and is scaled to
    zero, so the renormalised tables, outputs and gradients are every member's, through steps."""
    torch.manual_seed(0)
    models = [_MaxNormEmbedding(d, norm_type).double() for d in (4, 8, 6)]
    for m in models:
        with torch.no_grad():
            m.e.weight.mul_(3)  # most rows above max_norm
    refs = copy.deepcopy(models)
    wide = wc.compile(copy.deepcopy(models), torch.randint(0, 9, (5, 3)), pad=True, config=FAST)
    opt = torch.optim.SGD(wide.parameters(), lr=0.1)
    ref_opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in refs]
    for _ in range(3):
        idx = torch.randint(0, 9, (3, 5, 3))
        outs = wide.member_outputs(wide(idx))
        opt.zero_grad()
        sum(o.square().sum() for o in outs).backward()
        opt.step()
        for i, (m, o) in enumerate(zip(refs, ref_opts)):
            out = m(idx[i])
            torch.testing.assert_close(outs[i], out, rtol=1e-12, atol=1e-12)
            o.zero_grad()
            out.square().sum().backward()
            o.step()
    for i, m in enumerate(refs):
        for k, v in m.state_dict().items():
            torch.testing.assert_close(wide.member_state_dict(i)[k], v, rtol=1e-12, atol=1e-12)
