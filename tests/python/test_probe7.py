"""Findings of the seventh independent probe (issue 44), each a test that failed before its fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import wide_compiler as wc
from support import DEVICE, LinearModel

FAST = wc.WideConfig.fast()
ALPHA = 1.7580993408473766  # ATen's alpha dropout constant


@pytest.mark.parametrize("cls,shape", [(nn.Dropout1d, (3, 7)), (nn.Dropout2d, (3, 5, 5)), (nn.Dropout3d, (3, 2, 2, 2)),
                                       (nn.AlphaDropout, (3, 5, 5)), (nn.FeatureAlphaDropout, (3, 5, 5))])
def test_channel_and_alpha_dropout_sweep_draws_each_members_own_rate(cls, shape):
    """P7-2: a ``p`` sweep of Dropout1d/2d/3d, AlphaDropout and FeatureAlphaDropout was refused (no
    per-member form of ``aten.feature_dropout``/``alpha_dropout``). Each member now draws its own
    mask at its own rate, with ATen's scale and shift; p = 0 is the member exactly, p = 1 zero."""
    torch.manual_seed(0)
    ps = (0.0, 0.3, 1.0, 0.7)
    models = [cls(p).double() for p in ps]
    wide = wc.compile(models, torch.randn(2, *shape, dtype=torch.float64), config=FAST)
    assert wide.fallbacks == []
    x = torch.randn(len(ps), 400, *shape, dtype=torch.float64, requires_grad=True)
    out = wide(x)
    out.sum().backward()
    grad = x.grad
    feature = cls in (nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.FeatureAlphaDropout)
    for i, p in enumerate(ps):
        q = 1 - p
        if p == 0:
            torch.testing.assert_close(out[i], x[i], rtol=0, atol=0)
            assert bool((grad[i] == 1).all())
            continue
        if p == 1:
            assert bool((out[i] == 0).all()) and bool((grad[i] == 0).all())
            continue
        kept = grad[i] != 0
        if cls in (nn.AlphaDropout, nn.FeatureAlphaDropout):
            a = 1 / ((ALPHA * ALPHA * p + 1) * q) ** 0.5
            torch.testing.assert_close(grad[i][kept], torch.full_like(grad[i][kept], a))
            expected = torch.where(kept, x[i] * a + ALPHA * a * p, torch.full_like(x[i], -ALPHA * a * q))
        else:
            torch.testing.assert_close(grad[i][kept], torch.full_like(grad[i][kept], 1 / q))
            expected = x[i] * grad[i]
        torch.testing.assert_close(out[i], expected.detach())
        if feature:  # one draw per (sample, channel): a plane is kept or dropped whole
            planes = kept.flatten(2)
            assert bool((planes.all(-1) | ~planes.any(-1)).all())
            rate = 1 - planes[..., 0].double().mean().item()
        else:
            rate = 1 - kept.double().mean().item()
        assert abs(rate - p) < 0.1, (i, p, rate)
    # the members' masks are drawn independently: two members at the same rate differ
    twins = wc.compile([cls(0.5).double() for _ in range(2)], torch.randn(2, *shape, dtype=torch.float64), config=FAST)
    y = twins(torch.ones(2, 400, *shape, dtype=torch.float64))
    assert not torch.equal(y[0], y[1])
    wide.eval()
    torch.testing.assert_close(wide(x.detach()), x.detach(), rtol=0, atol=0)


def test_scaler_refusing_a_dampened_first_step_of_wc_sgd_gives_advice_that_applies_to_it():
    """P7-3: wc.optim.SGD with dampening, one member overflowing at the first step: the refusal told
    the user to "use the wide_compiler.optim optimizer", which they were using. Its advice now is
    what works (dampening=0 is exact: test_probe6's _sgd_run), and nothing changed."""
    torch.manual_seed(0)
    wide = wc.compile([nn.Linear(4, 2) for _ in range(3)], torch.randn(5, 4), config=FAST)
    before = {k: v.clone() for k, v in wide.state_dict().items()}
    opt = wc.optim.SGD(wide.parameters(), lr=0.1, momentum=0.9, dampening=0.5)
    scaler = wc.amp.GradScaler()
    loss = wide(torch.randn(3, 5, 4)).square().mean((1, 2)) * torch.tensor([1.0, float("inf"), 1.0])
    scaler.scale(loss).sum().backward()
    with pytest.raises(RuntimeError, match=r"member\(s\) \[1\].*dampening") as err:
        scaler.step(opt)
    assert "Use the wide_compiler.optim optimizer" not in str(err.value)
    assert "use dampening=0, or one optimizer and one torch.amp.GradScaler per member" in str(err.value)
    assert all(torch.equal(v, before[k]) for k, v in wide.state_dict().items()) and not opt.state


class _Act(nn.Module):
    def forward(self, x):
        return torch.tanh(x)


class _WrongInTrain(nn.Module):
    """An injected defect: the wide form of _Act is off by 2x in train mode only."""

    @classmethod
    def from_modules(cls, modules):
        return cls()

    def forward(self, x):
        return torch.tanh(x) * (2.0 if self.training else 1.0)

    def unfuse(self):
        return [_Act()]


def _dropout_mlp(p: float) -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), _Act(), nn.Dropout(p), nn.Linear(16, 4))


def test_trust_check_compares_train_mode_of_a_graph_with_dropout_and_catches_a_train_only_defect(monkeypatch):
    """P7-4: check_compile skipped every train check of a graph with a random op, so a program wrong
    in train mode passed on any model with a Dropout (stock mobilenet_v2, efficientnet_b0). Train
    mode is now compared with every draw fixed on both sides: a correct dropout sweep passes in
    train mode (compared, not skipped), and the injected train-only defect fails it and validate."""
    torch.manual_seed(0)
    members = [_dropout_mlp(p) for p in (0.1, 0.3, 0.5)]
    _, report = wc.testing.check_compile(members, torch.randn(6, 8), config=FAST)
    assert sorted(report) == ["eval/own", "eval/shared", "train/own", "train/shared"]
    assert not any(isinstance(rep, str) for rep in report.values()), report
    from wide_compiler import registry

    monkeypatch.setitem(registry._REGISTRY, _Act, _WrongInTrain)  # wc.register(_Act), undone after
    with pytest.raises(AssertionError, match=r"^train/own output: member 0 differs"):
        wc.testing.check_compile(members, torch.randn(6, 8), config=FAST)
    with pytest.raises(wc.ValidationError, match=r"validate \(train mode"):
        wc.compile(members, torch.randn(6, 8), config=FAST, validate=True)
    assert all(m.training for m in members)  # the users' models stay as they were


def test_fixed_draws_agree_between_each_random_op_and_the_wide_forms_that_replace_it():
    """The fixed values are consistent: a Bernoulli(p) draw is 1 where p > 0 (what ``rand < p``
    gives with rand fixed at 0), uniform/normal/exponential draws sit at their low end or mean, so
    a per-member form that moves a standard draw gives the member's own fixed value; the check's
    own draws (an explicit generator) are untouched; an op with no fixed value is reported."""
    from wide_compiler._equivalence.draws import fixed_draws

    gen = torch.Generator(DEVICE).manual_seed(0)
    with fixed_draws() as unfixed:
        p = torch.tensor([0.0, 0.3, 1.0])
        assert torch.equal(torch.empty(3).bernoulli_(p), (torch.rand(3) < p).float())
        assert torch.equal(torch.bernoulli(p), torch.tensor([0.0, 1.0, 1.0]))
        assert torch.equal(torch.empty(2).uniform_(-2.0, 3.0), torch.empty(2).uniform_(0, 1) * 5.0 - 2.0)
        assert torch.equal(torch.empty(2).normal_(1.5, 2.0), torch.empty(2).normal_(0, 1) * 2.0 + 1.5)
        assert torch.equal(torch.empty(2).exponential_(4.0), torch.empty(2).exponential_(1.0) / 4.0)
        assert torch.equal(torch.nn.functional.dropout(torch.ones(3), 1.0, True), torch.zeros(3))
        assert torch.equal(torch.randperm(4), torch.arange(4))
        assert not torch.equal(torch.rand(8, generator=gen), torch.zeros(8))
        assert unfixed == set()
        torch.multinomial(torch.ones(3), 1)
    assert unfixed == {"aten.multinomial.default"}


# ---------------------------------------------------------------- P7-5 / P7-7: state in plain attributes
class _Counter(LinearModel):
    def __init__(self):
        super().__init__()
        self.step = 0

    def forward(self, x):
        self.step += 1  # a warm-up weight annealed per call
        return self.fc(x) * min(1.0, self.step / 10)


class _CarriedHidden(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(3, 5, batch_first=True)
        self.hidden = None

    def forward(self, x):
        y, h = self.rnn(x, self.hidden)
        self.hidden = h.detach()  # truncated BPTT: carried to the next chunk
        return y


class _Appends(LinearModel):
    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x):
        h = self.fc(x)
        self.seen.append(h.shape[0])
        return h * 0 if len(self.seen) > 2 else h


class _GrowsACache(LinearModel):
    """Writes only on a path the capture's call does not take (inputs longer than its cache, 8
    at first)."""

    fields = ("cached",)

    def forward(self, x):
        if x.shape[1] > self.cached:
            self.cached = x.shape[1]
        return self.fc(x) * self.cached


@pytest.mark.parametrize("cls,sample,says", [
    (_Counter, (5, 4), "self.step of the root (_Counter): 0 -> 1"),
    (_CarriedHidden, (2, 4, 3), "self.hidden of the root (_CarriedHidden): None -> a Tensor"),
    (_Appends, (5, 4), "self.seen of the root (_Appends): a list -> a list"),
])
def test_a_forward_writing_its_modules_python_attributes_is_refused(cls, sample, says):
    """P7-5, P7-7: a forward that keeps state in a plain attribute (a counter, a carried hidden
    state, a list) compiled, and the wide model ran the capture's value at every call: off from
    the second call on. Refused now, naming the attribute; the users' models are untouched."""
    torch.manual_seed(0)
    models = [cls() for _ in range(3)]
    before = [dict(vars(m)) for m in models]
    with pytest.raises(wc.WideCompileError, match="writes Python attributes of its modules") as err:
        wc.compile(models, torch.randn(*sample), config=FAST)
    assert says in str(err.value) and "register_buffer" in str(err.value)
    for m, b in zip(models, before):
        assert vars(m).keys() == b.keys() and all(vars(m)[k] is v for k, v in b.items())
        assert getattr(m, "step", 0) == 0 and getattr(m, "hidden", None) is None and getattr(m, "seen", []) == []


def test_a_write_on_a_path_a_later_call_takes_refuses_that_call():
    """The capture's call does not write: a call that would (a longer input) is refused, by the
    size guard the branch left or by the write the recapture sees, never run on the old value."""
    wide = wc.compile([_GrowsACache(8) for _ in range(2)], torch.randn(2, 6, 4), config=FAST)
    wide(torch.randn(2, 2, 6, 4))
    with pytest.raises((wc.WideCompileError, ValueError),
                       match=r"self.cached of the root \(_GrowsACache\): 8 -> 12|holds for sizes up to 8"):
        wide(torch.randn(2, 2, 12, 4))


class _BufferCounter(nn.Module):
    """The advice of the refusal: the counter as a registered buffer, updated in place."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("step", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.step.add_(1)
        return self.fc(x) * torch.clamp(self.step / 10, max=1.0)


def test_the_refusals_advice_a_buffer_counter_matches_the_members_call_after_call():
    import copy

    torch.manual_seed(0)
    models = [_BufferCounter().double() for _ in range(3)]
    refs = [copy.deepcopy(m) for m in models]
    wide = wc.compile(models, torch.randn(5, 4, dtype=torch.float64), config=FAST)
    for _ in range(4):
        x = torch.randn(3, 5, 4, dtype=torch.float64)
        out = wide(x)
        for i, r in enumerate(refs):
            torch.testing.assert_close(out[i], r(x[i]), rtol=0, atol=1e-12)
    assert [int(wide.member(i).step) for i in range(3)] == [4, 4, 4]


# ---------------------------------------------------------------- P7-9: numpy Generator objects
_RNG = __import__("numpy").random.default_rng(9)


class _NumpyLayerDrop(nn.Module):
    def __init__(self, held: bool = False):
        super().__init__()
        self.fc, self.fc2, self.p = nn.Linear(4, 4), nn.Linear(4, 4), 0.5
        self.rng = __import__("numpy").random.RandomState(0) if held else None

    def forward(self, x):
        h = self.fc(x)
        u = self.rng.random_sample() if self.rng is not None else _RNG.random()
        if self.training and u < self.p:
            return h
        return self.fc2(h)


@pytest.mark.parametrize("held", [False, True], ids=["global-Generator", "attribute-RandomState"])
def test_a_draw_from_a_numpy_generator_of_the_users_own_is_refused_in_training(held):
    """P7-9: LayerDrop on numpy's Generator API (a module global, or a RandomState the module
    holds) compiled with the capture's branch baked in: the wide model always (or never) dropped
    the layer, each member half the time. Such a draw is now refused in training like
    random.random(), naming the generator; the generator's state is the capture's draw further."""
    models = [_NumpyLayerDrop(held) for _ in range(3)]
    with pytest.raises(wc.WideCompileError, match=r"a draw from the numpy (Generator `_RNG` \(test_probe7\)|RandomState self.rng of "
                                                  r"the root) \(through its methods\)"):
        wc.compile(models, torch.randn(5, 4), config=FAST)


# ---------------------------------------------------------------- P7-12, P7-13: Lightning
def _lightning_member(step_body=None, hook=None):
    pl = pytest.importorskip("lightning.pytorch")

    class Member(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            return step_body(self, loss, batch_idx) if step_body else loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    if hook:
        setattr(Member, hook, lambda self, *args: None)
    return Member


@pytest.mark.parametrize("counter", ["global_step", "current_epoch"])
def test_a_lightning_step_reading_the_trainers_counters_is_refused(counter):
    """P7-12: a training_step with a warm-up weight on self.global_step (or self.current_epoch)
    was captured once with the counter at 0, and the fused fit never moved the weight (member
    weights 0.15-0.2 off the members trained alone). Refused at construction now."""
    from wide_compiler.integrations.lightning import WideLightningModule

    warm = _lightning_member(lambda self, loss, i: loss + min(1.0, (getattr(self, counter) + 1) / 4.0)
                             * self.net.weight.square().sum())
    with pytest.raises(ValueError, match=rf"reads self.{counter}, which the Trainer advances"):
        WideLightningModule([warm() for _ in range(2)], (torch.randn(8, 4), torch.randn(8, 1)))


def test_cli_trace_in_a_fresh_process_is_not_refused_for_sympys_import_time_draw():
    """P7-16: `python -m wide_compiler trace -m mlp` refused every model in a fresh process: the
    capture was the first thing to import sympy, whose import draws from a random.Random of its
    own, and that draw was taken for one of the member's forward."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "wide_compiler", "trace", "-m", "mlp"], capture_output=True,
                          text=True, timeout=300, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "captured member graph (mlp)" in done.stdout and "wide graph (N=4)" in done.stdout


class _InPlaceAttribute(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.decay = torch.ones(4)  # a plain tensor, not a buffer

    def forward(self, x):
        self.decay.mul_(0.5)
        return self.fc(x) * self.decay


class _Scratch(nn.Module):
    """Sets an attribute at the start of every call, then reads it: no state across calls."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.rows = None

    def forward(self, x):
        self.rows = x.shape[0]
        return self.fc(x) * 2 if self.rows > 1 else self.fc(x)


def test_a_plain_tensor_attribute_written_in_place_is_refused_and_scratch_state_is_not():
    """P7-7's variant: `self.decay.mul_(0.5)` on a plain tensor attribute was wrong from the first
    call. Refused; an attribute every call sets before it reads it (as transformers' Funnel does)
    still compiles and matches."""
    with pytest.raises(wc.WideCompileError, match=r"self.decay of the root \(_InPlaceAttribute\): a Tensor"):
        wc.compile([_InPlaceAttribute() for _ in range(2)], torch.randn(5, 4), config=FAST)
    models = [_Scratch().double() for _ in range(2)]
    wide = wc.compile(models, torch.randn(5, 4, dtype=torch.float64), config=FAST)
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    out = wide(x)
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m(x[i]), rtol=0, atol=1e-12)


def test_a_lightning_step_computing_with_batch_idx_is_refused_and_one_passing_it_on_is_not():
    """P7-12's batch_idx: it is 0 in the fused step, so a step computing with it is refused."""
    from wide_compiler.integrations.lightning import WideLightningModule

    batch = (torch.randn(8, 4), torch.randn(8, 1))
    every_other = _lightning_member(lambda self, loss, i: loss * (2.0 if i % 2 else 1.0))
    with pytest.raises(ValueError, match=r"reads batch_idx, which the Trainer advances"):
        WideLightningModule([every_other() for _ in range(2)], batch)
    untouched = _lightning_member(lambda self, loss, i: loss)
    WideLightningModule([untouched() for _ in range(2)], batch)


def test_lightning_member_hooks_the_fused_run_skips_are_refused_unless_said_to_be_skipped():
    """P7-13: a member's on_train_batch_end (WGAN weight clipping) was skipped with a one-line
    warning and the fused fit ended 0.4 off. Refused now; skip_member_hooks=True accepts it."""
    from wide_compiler.integrations.lightning import WideLightningModule

    batch = (torch.randn(8, 4), torch.randn(8, 1))
    hooked = _lightning_member(hook="on_train_batch_end")
    with pytest.raises(ValueError, match=r"overrides on_train_batch_end, which the fused run does not call"):
        WideLightningModule([hooked() for _ in range(2)], batch)
    with pytest.warns(UserWarning, match=r"overrides on_train_batch_end.*skip_member_hooks=True"):
        WideLightningModule([hooked() for _ in range(2)], batch, skip_member_hooks=True)


class _SqrtOfConstant(LinearModel):
    fields = ("s",)

    def forward(self, x):
        return self.fc(x) * __import__("math").sqrt(self.s)


def test_a_per_member_constant_written_through_data_is_checked_after_clear_caches():
    """P7-17: `_per_member.s` written through .data (invisible to version counters), then
    clear_caches() as documented: the next call ran member 0 with a value no graph was compiled
    for (2.2 off). clear_caches() now makes the next call check the constants by value."""
    wide = wc.compile([_SqrtOfConstant(s) for s in (0.25, 1.0, 4.0)], torch.randn(5, 4), config=FAST)
    x = torch.randn(3, 5, 4)
    wide(x)
    wide.get_buffer("_per_member.s").data[0] = 9.0
    wide.clear_caches()
    with pytest.raises(ValueError, match=r"member 0's per-member constants \(s = 9.0\) are not a configuration"):
        wide(x)


def test_compiled_members_are_fused_from_their_modules_and_scripted_or_lazy_ones_refused_clearly():
    """P7-14, P7-15: torch.compile'd members were refused as if an internal id were a per-member
    integer (advice about padding), scripted ones for their ScriptObject, and members with lazy
    modules crashed with torch's own error blaming load_state_dict."""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double() for _ in range(2)]
    wide = wc.compile([torch.compile(m) for m in models], torch.randn(5, 4, dtype=torch.float64), config=FAST)
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    for i, m in enumerate(models):
        torch.testing.assert_close(wide(x)[i], m(x[i]), rtol=0, atol=1e-12)
    with pytest.raises(TypeError, match=r"member 0 is a TorchScript module .*pass the nn.Module it was scripted from"):
        wc.compile([torch.jit.script(m) for m in models], torch.randn(5, 4, dtype=torch.float64), config=FAST)
    lazy = [nn.Sequential(nn.LazyLinear(8), nn.Tanh()) for _ in range(2)]
    with pytest.raises(ValueError, match=r"member 0 has lazy modules not yet initialised \(0.weight, 0.bias\): run each"):
        wc.compile(lazy, torch.randn(5, 4), config=FAST)


def test_swa_update_bn_of_a_wide_model_recomputes_every_members_statistics_as_torchs_does():
    """P7-8: torch.optim.swa_utils.update_bn finds no nn.BatchNorm in a wide model (its norms are
    stacked buffers) and silently did nothing (eval 0.5-1.2 off each member's own update_bn).
    wc.optim.swa_utils.update_bn gives each member torch's result, through an AveragedModel too."""
    import copy

    from torch.optim.swa_utils import AveragedModel
    from torch.optim.swa_utils import update_bn as torch_update_bn

    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2)).double()
              for _ in range(3)]
    refs = [copy.deepcopy(m) for m in models]
    wide = wc.compile(models, torch.randn(5, 4, dtype=torch.float64), config=FAST)
    swa = AveragedModel(wide)
    loader = [(torch.randn(3, 6, 4, dtype=torch.float64) * 3 + 1, torch.zeros(3)) for _ in range(3)]
    wc.optim.swa_utils.update_bn(loader, swa)
    for i, r in enumerate(refs):
        torch_update_bn([x[i] for x, _ in loader], r)
        for k, v in r.state_dict().items():
            torch.testing.assert_close(swa.module.member(i).state_dict()[k], v, rtol=0, atol=1e-12)
    with pytest.raises(TypeError, match="expected a WideModel"):
        wc.optim.swa_utils.update_bn(loader, refs[0])


def test_a_sample_that_does_not_fit_the_members_forward_is_said_so_with_the_members_own_class():
    """P7-6: nn.MultiheadAttention members given only the query were reported as export failing
    on an internal class (_SelfAttentionForm) with advice about data-dependent control flow."""
    models = [nn.MultiheadAttention(6, 2, batch_first=True) for _ in range(2)]
    with pytest.raises(wc.WideCompileError, match=r"member 0 \(MultiheadAttention\) cannot take the sample: its "
                                                  r"forward\(query.*missing a required argument: 'key'") as err:
        wc.compile(models, torch.randn(5, 4, 6), config=FAST)
    assert "_SelfAttentionForm" not in str(err.value) and "control flow" not in str(err.value)


@pytest.mark.parametrize("first", ["conv2d", "conv1d"])
def test_a_gradient_penalty_through_a_first_layer_conv_matches_the_members(first):
    """P7-10: torch.autograd.grad(..., create_graph=True) with respect to the parameters, through a
    wide Conv whose input needs no gradient (an input batch: a gradient penalty, a MAML inner
    step), raised "element 0 of the input tensors does not require grad" inside the wide op."""
    torch.manual_seed(0)
    conv, shape = {"conv2d": (nn.Conv2d, (3, 6, 6)), "conv1d": (nn.Conv1d, (3, 7))}[first]
    models = [nn.Sequential(conv(3, 4, 3), nn.Tanh()).double() for _ in range(2)]
    wide = wc.compile(models, torch.randn(2, *shape, dtype=torch.float64), config=FAST)
    x = torch.randn(2, 2, *shape, dtype=torch.float64)
    params = dict(wide.named_parameters())
    grads = torch.autograd.grad(wide(x).square().sum(), list(params.values()), create_graph=True)
    sum(g.square().sum() for g in grads).backward()
    for i, m in enumerate(models):
        own = dict(m.named_parameters())
        g = torch.autograd.grad(m(x[i]).square().sum(), list(own.values()), create_graph=True)
        sum(t.square().sum() for t in g).backward()
        for name, p in own.items():
            torch.testing.assert_close(params[name].grad[i], p.grad, rtol=1e-10, atol=1e-12)
