"""Random ops in training, per member (Note [Random ops per member] in fx/rules/randomness.py).

Stochastic depth / drop path in the three ways real code writes it (torchvision: ``torch.empty``
+ ``bernoulli_``; timm: ``new_empty`` + ``bernoulli_``; Hugging Face: ``keep + torch.rand`` then
``floor``), dropout inside HF EfficientNet and HF ConvNeXt train fused, each member drawing its
own numbers:

* deterministic ends (drop everything / keep everything) match the members exactly;
* every member's keep rate (or mean) is its own, within a 5-sigma binomial (normal) bound;
* members draw independently (their masks differ);
* given the masks the wide model drew, each member computes exactly what the wide model computes
  (outputs, input and parameter gradients, K training steps): the draws of the wide model are
  recorded by a dispatch mode and replayed into every member run alone (``_Record``/``_Replay``).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import wide_compiler as wc
from torch import nn
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode
from wide_compiler import testing
from wide_compiler.errors import ArchitectureMismatchError

FAST = wc.WideConfig.fast()  # strict: a fallback would be an error
aten = torch.ops.aten


# --- the drop-path functions, as each library writes them (our own code) ----------------------
def _bernoulli_drop(x: torch.Tensor, p: float, training: bool, empty) -> torch.Tensor:
    """``x`` times a mask drawn by ``bernoulli_(1 - p)`` into ``empty(x)`` (the tensor each library
    makes its own way), the kept values scaled by 1 / (1 - p)."""
    if not training or p == 0.0:
        return x
    keep = 1.0 - p
    mask = empty(x).bernoulli_(keep)
    if keep > 0.0:
        mask.div_(keep)
    return x * mask


def stochastic_depth(x: torch.Tensor, p: float, training: bool, mode: str = "row") -> torch.Tensor:
    """torchvision's semantics: drop whole rows (or the whole batch) with probability p, scale the
    kept ones by 1 / (1 - p); the mask from ``torch.empty``."""
    def empty(t: torch.Tensor) -> torch.Tensor:
        shape = [t.shape[0]] + [1] * (t.ndim - 1) if mode == "row" else [1] * t.ndim
        return torch.empty(shape, dtype=t.dtype, device=t.device)

    return _bernoulli_drop(x, p, training, empty)


def drop_path(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """timm's semantics: ``new_empty`` + ``bernoulli_(keep)``, scaled by keep."""
    return _bernoulli_drop(x, p, training, lambda t: t.new_empty((t.shape[0],) + (1,) * (t.ndim - 1)))


def hf_drop_path(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Hugging Face's semantics: ``floor(keep + rand)``."""
    if p == 0.0 or not training:
        return x
    keep = 1 - p
    mask = keep + torch.rand((x.shape[0],) + (1,) * (x.ndim - 1), dtype=x.dtype, device=x.device)
    mask.floor_()
    return x.div(keep) * mask


DROPS = {"torchvision": stochastic_depth, "timm": drop_path, "hf": hf_drop_path}


class Residual(nn.Module):
    """``x + drop(fc(x))``: a residual block with stochastic depth of rate ``p``."""

    def __init__(self, p: float, kind: str, width: int = 6) -> None:
        super().__init__()
        self.fc, self.p, self.kind = nn.Linear(width, width), p, kind

    def forward(self, x):
        return x + DROPS[self.kind](self.fc(x), self.p, self.training)


class ConvBlock(nn.Module):
    """An MBConv-like block: conv, batch norm, SiLU, then stochastic depth on the residual."""

    def __init__(self, p: float, kind: str = "torchvision") -> None:
        super().__init__()
        self.conv, self.bn, self.p, self.kind = nn.Conv2d(3, 3, 3, padding=1), nn.BatchNorm2d(3), p, kind

    def forward(self, x):
        return x + DROPS[self.kind](torch.nn.functional.silu(self.bn(self.conv(x))), self.p, self.training)


def _members(make, values, seed=0):
    torch.manual_seed(seed)
    return [make(v) for v in values]


# --- record the wide model's draws, replay them into each member ------------------------------
# The ops that hand out the random numbers of these models on CPU: bernoulli_ (stochastic depth,
# and dropout's CPU path), rand (HF drop path), exponential_ (Gumbel noise). A member alone draws
# the same op, one member's slice of the wide draw ([N, ...] -> [...]).
_DRAWN = (aten.bernoulli_.float, aten.bernoulli_.Tensor, aten.rand.default, aten.exponential_.default)


class _Record(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.draws: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _DRAWN:
            self.draws.append(out.detach().clone())
        return out


class _Replay(TorchDispatchMode):
    """Member ``i`` gets slice ``i`` of each recorded draw, in order."""

    def __init__(self, draws: list[torch.Tensor], i: int) -> None:
        super().__init__()
        self.draws, self.i = list(draws), i

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in _DRAWN:
            return func(*args, **(kwargs or {}))
        assert self.draws, f"member {self.i} draws more often than the wide model ({func})"
        value = self.draws.pop(0)[self.i]
        assert value.shape == (args[0].shape if func is not aten.rand.default else tuple(args[0])), func
        return args[0].copy_(value) if func is not aten.rand.default else value.clone()


def _replay_check(wide, models, xs, steps: int = 1, lr: float = 0.1) -> int:
    """Train ``steps`` SGD steps fused, recording the wide draws; train each member alone with its
    slice of those draws replayed; outputs, input gradients of the first step and the parameters
    after every step must match. Returns how many random draws the wide model made per step."""
    wide_opt = torch.optim.SGD(wide.parameters(), lr=lr)
    member_opts = [torch.optim.SGD(m.parameters(), lr=lr) for m in models]
    per_step = None
    for step in range(steps):
        x = xs.clone().requires_grad_(True)
        with _Record() as rec:
            y = wide(x)
        per_step = len(rec.draws)
        cot = torch.randn_like(y)
        (y * cot).sum().backward()
        wide_opt.step()
        wide_opt.zero_grad()
        for i, (m, opt) in enumerate(zip(models, member_opts)):
            xi = xs[i].clone().requires_grad_(True)
            with _Replay(rec.draws, i) as rp:
                yi = m(xi)
            assert not rp.draws, f"member {i} drew {len(rp.draws)} times less than the wide model"
            (yi * cot[i]).sum().backward()
            opt.step()
            opt.zero_grad()
            assert_close(y[i], yi, rtol=1e-5, atol=1e-5, msg=lambda s: f"step {step} member {i} output: {s}")
            assert_close(x.grad[i], xi.grad, rtol=1e-5, atol=1e-5,
                         msg=lambda s: f"step {step} member {i} input grad: {s}")
        unfused = wide.unfuse()
        for i, m in enumerate(models):
            for (name, p), q in zip(m.named_parameters(), unfused[i].parameters()):
                assert_close(q, p, rtol=1e-5, atol=1e-5, msg=lambda s: f"step {step} member {i} {name}: {s}")
    return per_step


# --- stochastic depth trains fused -------------------------------------------------------------
@pytest.mark.parametrize("kind", ["torchvision", "timm", "hf"])
def test_drop_path_with_a_per_member_rate_trains_fused_and_matches_members_given_the_masks(kind):
    """Before: torchvision's and timm's forms failed to compile (``cannot widen
    aten.bernoulli_.float``); a rate sweep had no per-member form for bernoulli_."""
    rates = [0.1, 0.4, 0.7]
    models = _members(lambda p: Residual(p, kind), rates)
    wide = wc.compile(models, torch.randn(5, 6), config=FAST)
    assert wide.fallbacks == []
    assert wide.per_member_constants == {"p": rates}
    op = "aten.rand.default" if kind == "hf" else "aten.bernoulli_.float"
    assert testing.random_ops(wide) == [op]
    torch.manual_seed(1)
    assert _replay_check(wide, models, torch.randn(3, 16, 6), steps=2) == 1


def test_stochastic_depth_in_a_conv_block_with_batch_norm_trains_fused():
    models = _members(lambda p: ConvBlock(p), [0.2, 0.5])
    wide = wc.compile(models, torch.randn(4, 3, 6, 6), config=FAST)
    assert wide.fallbacks == []
    torch.manual_seed(2)
    _replay_check(wide, models, torch.randn(2, 8, 3, 6, 6), steps=2)
    for m, b in zip(models, wide.unfuse()):  # running stats too
        assert_close(b.bn.running_mean, m.bn.running_mean)
        assert_close(b.bn.running_var, m.bn.running_var)


@pytest.mark.parametrize("kind", ["torchvision", "timm"])
@pytest.mark.parametrize("p", [0.0, 1.0])
def test_drop_nothing_and_drop_everything_match_members_exactly(kind, p):
    """p = 0 keeps every row (no draw), p = 1 drops every row (bernoulli_(0)): deterministic, so
    the train outputs and gradients are compared value by value (and check_compile does it)."""
    models = _members(lambda _: Residual(p, kind), range(3))
    wide, report = testing.check_compile(models, torch.randn(5, 6), config=FAST, modes=("train",))
    assert testing.random_ops(wide) == []
    assert not isinstance(report["train/own"], str), report
    xs = torch.randn(3, 5, 6)
    y = wide(xs)
    if p == 1.0:  # every residual branch dropped: y = x exactly
        assert torch.equal(y, xs)


def test_a_per_member_keep_probability_at_0_and_1_is_exact_for_those_members():
    """One bernoulli_ with keep = 0, 0.5, 1 per member (no Python branch on it): members 0 and 2
    are deterministic and exact; member 1 keeps about half of the rows."""

    class Mask(nn.Module):
        def __init__(self, keep):
            super().__init__()
            self.keep, self.w = keep, nn.Parameter(torch.randn(6))

        def forward(self, x):
            return x * self.w * x.new_empty(x.shape[0], 1).bernoulli_(self.keep)

    models = _members(Mask, [0.0, 0.5, 1.0])
    wide = wc.compile(models, torch.randn(4, 6), config=FAST)
    assert wide.fallbacks == [] and wide.per_member_constants == {"keep": [0.0, 0.5, 1.0]}
    xs = torch.randn(3, 2000, 6)
    y = wide(xs)
    assert torch.equal(y[0], torch.zeros_like(y[0]))
    assert torch.equal(y[2], models[2](xs[2]))
    kept = (y[1] != 0).all(-1).sum().item()
    assert abs(kept - 1000) <= 5 * math.sqrt(2000 * 0.25), kept


def test_a_rate_sweep_that_changes_the_program_is_refused_by_name():
    """torchvision's form branches on ``survival > 0``: a member with p = 1 runs another program."""
    models = _members(lambda p: Residual(p, "torchvision"), [0.5, 1.0])
    with pytest.raises(ArchitectureMismatchError, match=r"member 1: p is 1\.0, member 0 has 0\.5"):
        wc.compile(models, torch.randn(4, 6), config=FAST)


@pytest.mark.parametrize("hard", [False, True])
def test_gumbel_softmax_with_a_per_member_temperature_matches_members_given_the_noise(hard):
    """``F.gumbel_softmax`` (HF Wav2Vec2's quantizer, Phi-MoE's router): ``exponential_`` noise on
    ``empty_like``, a per-member ``tau``; ``hard=True`` adds a one-hot straight-through."""

    class Gumbel(nn.Module):
        def __init__(self, tau):
            super().__init__()
            self.fc, self.tau = nn.Linear(4, 5), tau

        def forward(self, x):
            return torch.nn.functional.gumbel_softmax(self.fc(x), tau=self.tau, hard=hard)

    models = _members(Gumbel, [0.5, 1.0, 2.0])
    wide = wc.compile(models, torch.randn(4, 4), config=FAST)
    assert wide.fallbacks == [] and wide.per_member_constants == {"tau": [0.5, 1.0, 2.0]}
    assert testing.random_ops(wide) == ["aten.exponential_.default"]
    torch.manual_seed(8)
    assert _replay_check(wide, models, torch.randn(3, 16, 4), steps=2) == 1


# --- keep rates in distribution, members independent -------------------------------------------
def _within(count: float, n: int, q: float) -> bool:
    """A binomial count within 5 sigma of its mean (exact at q = 0 or 1)."""
    return abs(count - n * q) <= 5 * math.sqrt(n * q * (1 - q)) + 1e-9


@pytest.mark.parametrize("kind", ["torchvision", "timm", "hf"])
def test_keep_rates_are_each_members_own_and_members_draw_independently(kind):
    rates = [0.1, 0.5, 0.8, 0.5]  # members 1 and 3: same rate, still their own masks
    models = _members(lambda p: Residual(p, kind, width=3), rates)
    for m in models:
        nn.init.zeros_(m.fc.weight), nn.init.ones_(m.fc.bias)  # the branch is 1 everywhere
    wide = wc.compile(models, torch.randn(4, 3), config=FAST)
    torch.manual_seed(3)
    rows = 4000
    with torch.no_grad():
        y = wide(torch.zeros(len(rates), rows, 3))  # y = mask / keep per row
    kept = y[..., 0] != 0
    for i, p in enumerate(rates):
        assert _within(kept[i].sum().item(), rows, 1 - p), (i, p, kept[i].float().mean())
        assert_close(y[i][kept[i]], torch.full_like(y[i][kept[i]], 1 / (1 - p)))
    assert not torch.equal(kept[1], kept[3])
    # one row per member decides for the whole row (the mask is per sample, not per element)
    assert ((y != 0).all(-1) | (y == 0).all(-1)).all()


def test_batch_mode_stochastic_depth_draws_once_per_member():
    """torchvision's mode='batch': one draw for the whole batch ([1, 1] shared shape), one per member."""

    class Batch(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return stochastic_depth(x * self.w, 0.5, self.training, mode="batch")

    wide = wc.compile([Batch() for _ in range(4)], torch.randn(4, 3), config=FAST)
    draws = 400
    with torch.no_grad():
        y = torch.stack([wide(torch.ones(4, 8, 3)) for _ in range(draws)])  # [draws, N, B, 3]
    whole = (y != 0).all(-1).all(-1)  # [draws, N]: every row kept, or none
    assert (whole | (y == 0).all(-1).all(-1)).all()
    for i in range(4):
        assert _within(whole[:, i].sum().item(), draws, 0.5)
    assert not torch.equal(whole[:, 0], whole[:, 1])


def test_gradients_are_the_mask_scaled_and_independent_of_x():
    """``d/dx sum(stochastic_depth(x * w))`` is ``w / keep`` on kept rows and 0 on dropped ones."""

    class Scaled(nn.Module):
        def __init__(self, p):
            super().__init__()
            self.p, self.w = p, nn.Parameter(torch.rand(4) + 0.5)

        def forward(self, x):
            return stochastic_depth(x * self.w, self.p, self.training)

    rates = [0.25, 0.6]
    models = _members(Scaled, rates)
    wide = wc.compile(models, torch.randn(4, 4), config=FAST)
    x = (torch.rand(2, 64, 4) + 1).requires_grad_(True)  # no zeros: a zero output row is a dropped row
    y = wide(x)
    y.sum().backward()
    w = wide.unfuse()
    for i, p in enumerate(rates):
        kept = (y[i] != 0).all(-1)
        assert 0 < kept.sum() < 64
        expect = torch.where(kept[:, None], w[i].w.detach() / (1 - p), torch.zeros(4))
        assert_close(x.grad[i], expect)
        assert_close(wide.w.grad[i], (x[i].detach() * kept[:, None] / (1 - p)).sum(0))


# --- every random op with a per-member argument ------------------------------------------------
class _Draws(nn.Module):
    """One member's draws of each random op, with a per-member argument ``a`` (and ``b``)."""

    def __init__(self, op: str, a: float, b: float) -> None:
        super().__init__()
        self.op, self.a, self.b = op, a, b
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, x):
        h = x * self.w
        if self.op == "bernoulli.p":
            return torch.bernoulli(h, self.a)
        if self.op == "bernoulli_":
            return torch.empty_like(h).bernoulli_(self.a)
        if self.op == "uniform_":
            return torch.empty_like(h).uniform_(self.a, self.b)
        if self.op == "normal_":
            return torch.empty_like(h).normal_(self.a, self.b)
        if self.op == "exponential_":
            return torch.empty_like(h).exponential_(self.a)
        if self.op == "normal":
            return torch.normal(self.a, self.b, (x.shape[0], 4))
        raise AssertionError(self.op)


# (op, per-member (a, b), mean(a, b), variance(a, b))
_OPS = [
    ("bernoulli.p", [(0.1, 0), (0.6, 0), (0.9, 0)], lambda a, b: a, lambda a, b: a * (1 - a)),
    ("bernoulli_", [(0.1, 0), (0.6, 0), (0.9, 0)], lambda a, b: a, lambda a, b: a * (1 - a)),
    ("uniform_", [(-1.0, 1.0), (2.0, 2.5), (0.9, 1.1)], lambda a, b: (a + b) / 2, lambda a, b: (b - a) ** 2 / 12),
    ("normal_", [(0.0, 1.0), (5.0, 0.1), (-3.0, 2.0)], lambda a, b: a, lambda a, b: b * b),
    ("exponential_", [(0.5, 0), (2.0, 0), (8.0, 0)], lambda a, b: 1 / a, lambda a, b: 1 / (a * a)),
    ("normal", [(0.0, 1.0), (5.0, 0.1), (-3.0, 2.0)], lambda a, b: a, lambda a, b: b * b),
]


@pytest.mark.parametrize("op, params, mean, var", _OPS, ids=[o[0] for o in _OPS])
def test_each_random_op_takes_a_per_member_argument(op, params, mean, var):
    models = [_Draws(op, a, b) for a, b in params]
    wide = wc.compile(models, torch.randn(4, 4), config=FAST)
    assert wide.fallbacks == [] and wide.per_member_constants
    assert testing.random_ops(wide)
    torch.manual_seed(4)
    with torch.no_grad():
        y = wide(torch.ones(len(params), 2500, 4)).flatten(1)  # 10,000 draws per member
    for i, (a, b) in enumerate(params):
        m, v = mean(a, b), var(a, b)
        got = y[i].double().mean().item()
        assert abs(got - m) <= 5 * math.sqrt(v / y.shape[1]), (i, a, b, got, m)
        if op == "uniform_":
            assert (y[i] >= a).all() and (y[i] <= b).all()
        if op == "exponential_":
            assert (y[i] >= 0).all()
        if op.startswith("bernoulli"):
            assert ((y[i] == 0) | (y[i] == 1)).all()
    assert not torch.equal(y[0], y[1])


@pytest.mark.parametrize("op, bad", [("bernoulli_", (1.5, 0)), ("uniform_", (1.0, 0.5)), ("normal_", (0.0, -1.0)),
                                     ("exponential_", (-2.0, 0))])
def test_a_bad_per_member_argument_fails_as_the_member_does(op, bad):
    """ATen refuses these arguments when the member runs; the wide model refuses them too, at the
    call (not silently drawing something else): a configuration never compiled is refused before
    the graph runs (Note [Per-member constants at the call]), naming the member and its values."""
    models = [_Draws(op, 0.5, 1.0), _Draws(op, 0.6, 1.2)]  # a and b per member
    wide = wc.compile(models, torch.randn(4, 4), config=FAST)
    wide(torch.ones(2, 4, 4))  # fine as compiled
    buffers = dict(wide.named_buffers())
    with torch.no_grad():  # as a load_state_dict of bad values would
        for k, v in zip(("a", "b"), bad):
            if f"_per_member.{k}" in buffers and v != 0:
                buffers[f"_per_member.{k}"][1] = v
    with pytest.raises(ValueError, match=r"member 1's per-member constants .* are not a configuration"):
        wide(torch.ones(2, 4, 4))


def test_random_fills_into_a_shared_tensor_made_in_forward_get_a_member_dim():
    """``torch.empty(2).uniform_(-s, s)``: a jitter drawn once per call, with no batch dim (as a
    RoPE augmentation does); every member draws its own."""

    class Jitter(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(2))

        def forward(self, x):
            return x * self.w + torch.empty(2).uniform_(-1.0, 1.0)

    wide = wc.compile([Jitter() for _ in range(3)], torch.randn(8, 2), config=FAST)
    assert wide.fallbacks == []
    assert testing.random_ops(wide) == ["aten.uniform_.default"]
    x = torch.randn(3, 64, 2)
    with torch.no_grad():
        shift = wide(x) - x
    for i in range(3):
        assert (shift[i] - shift[i, :1]).abs().max() < 1e-5  # one draw per member, all rows
        assert (shift[i].abs() <= 1).all()
    assert not torch.equal(shift[0, 0], shift[1, 0]) and not torch.equal(shift[1, 0], shift[2, 0])


# --- under torch.compile --------------------------------------------------------------------
def test_per_member_stochastic_depth_under_torch_compile_fullgraph():
    torch._dynamo.reset()
    rates = [0.2, 0.7]
    models = _members(lambda p: Residual(p, "torchvision", width=3), rates)
    for m in models:
        nn.init.zeros_(m.fc.weight), nn.init.ones_(m.fc.bias)
    wide = wc.compile(models, torch.randn(4, 3), config=FAST)
    compiled = torch.compile(wide, fullgraph=True, backend="aot_eager")
    rows = 3000
    with torch.no_grad():
        y = compiled(torch.zeros(2, rows, 3))
    kept = y[..., 0] != 0
    for i, p in enumerate(rates):
        assert _within(kept[i].sum().item(), rows, 1 - p)
        assert_close(y[i][kept[i]], torch.full_like(y[i][kept[i]], 1 / (1 - p)))


# --- Hugging Face models ------------------------------------------------------------------------
class _Logits(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(pixel_values=x).logits


def _convnext(depths, hidden, rate):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.ConvNextConfig(num_channels=3, hidden_sizes=hidden, depths=depths, num_stages=len(depths),
                                      drop_path_rate=rate,
                                      num_labels=3, image_size=32, patch_size=4)
    return _Logits(transformers.ConvNextForImageClassification(cfg))


def test_hf_convnext_with_a_per_member_drop_path_rate_matches_members_given_the_masks():
    """Members built from one config, each layer's drop_prob then set per member (a config that
    differs between members is refused by the member check)."""
    models = _members(lambda _: _convnext([2, 2], [8, 16], 0.1), range(2))
    paths = [n for n, m in models[0].named_modules() if type(m).__name__ == "ConvNextDropPath"]
    assert len(paths) == 3  # the first layer's rate is 0: an Identity
    for i, m in enumerate(models):
        for k, path in enumerate(paths):
            m.get_submodule(path).drop_prob = 0.1 * (i + 1) * (k + 1) / 3
    wide = wc.compile(models, torch.randn(2, 3, 16, 16), config=FAST)
    assert wide.fallbacks == [] and len(wide.per_member_constants) == 3
    torch.manual_seed(5)
    assert _replay_check(wide, models, torch.randn(2, 4, 3, 16, 16), steps=2) == 3


def test_hf_efficientnet_drop_connect_is_elementwise_dropout_and_trains_fused():
    """HF EfficientNet's ``drop_connect_rate`` is an ``nn.Dropout`` per block (elementwise, not
    per-sample stochastic depth), which draws in train mode; the layout plan runs it on
    channel-packed tensors, so the draws are not replayed here (the dropout rule's own tests check
    its masks): a few steps train fused, every member moves, and afterwards the wide model is
    still each member's own model (eval, value by value)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.EfficientNetConfig(
        num_channels=3, image_size=32, width_coefficient=0.25, depth_coefficient=1.0, hidden_dim=320,
        kernel_sizes=(3, 3), in_channels=(32, 16), out_channels=(16, 24), strides=(1, 1), num_block_repeats=(1, 2),
        expand_ratios=(1, 6), drop_connect_rate=0.3, dropout_rate=0.2, num_labels=3)
    models = _members(lambda _: _Logits(transformers.EfficientNetForImageClassification(cfg)), range(2))
    wide = wc.compile(models, torch.randn(2, 3, 16, 16), config=FAST)
    assert wide.fallbacks == []
    assert testing.random_ops(wide) == ["aten.dropout.default"]
    before = [p.detach().clone() for p in wide.parameters()]
    opt = torch.optim.SGD(wide.parameters(), lr=0.05)
    torch.manual_seed(6)
    xs = torch.randn(2, 4, 3, 16, 16)
    for _ in range(2):
        loss = wide(xs).square().mean(dim=(1, 2)).sum()
        assert torch.isfinite(loss)
        loss.backward()
        opt.step()
        opt.zero_grad()
    for i in range(2):  # every member trained
        assert any(not torch.equal(b[i], p[i].detach()) for b, p in zip(before, wide.parameters()))
    wide.eval()
    members = [m.eval() for m in wide.unfuse()]
    testing.assert_members_close(wide(xs), [m(x) for m, x in zip(members, xs)])


def test_hf_convnext_tiny_like_with_drop_path_trains_fused():
    """ConvNeXt-T's depths (3, 3, 9, 3) at small widths, drop_path_rate = 0.1, N = 2: three SGD
    steps fused equal each member's own three steps under the same masks."""
    models = _members(lambda _: _convnext([3, 3, 9, 3], [8, 16, 32, 64], 0.1), range(2))
    wide = wc.compile(models, torch.randn(2, 3, 32, 32), config=FAST)
    assert wide.fallbacks == [] and testing.random_ops(wide) == ["aten.rand.default"]
    torch.manual_seed(7)
    assert _replay_check(wide, models, torch.randn(2, 2, 3, 32, 32), steps=3) == 17


@pytest.mark.parametrize("functional", [False, True], ids=["nn.Dropout", "F.dropout"])
def test_in_place_dropout_with_a_per_member_rate(functional):
    """``nn.Dropout(p, inplace=True)`` (``aten.dropout_``, whose input is named ``self``) with p per
    member fuses as the out-of-place form does (it crashed with an internal KeyError): p = 0 and
    p = 1 exact, p = 0.5 keeps about half, eval exact."""

    class Net(nn.Module):
        def __init__(self, p):
            super().__init__()
            self.fc, self.p, self.drop = nn.Linear(6, 6), p, nn.Dropout(p, inplace=True)

        def forward(self, x):
            h = self.fc(x).relu()
            return F.dropout(h, self.p, self.training, inplace=True) if functional else self.drop(h)

    models = _members(Net, [0.0, 0.5, 1.0])
    wide = wc.compile(models, torch.randn(4, 6), config=FAST)
    assert wide.fallbacks == []
    xs = torch.randn(3, 2000, 6)
    y = wide(xs)
    torch.testing.assert_close(y[0], models[0](xs[0]), rtol=0, atol=0)
    assert torch.equal(y[2], torch.zeros_like(y[2]))
    h = models[1].fc(xs[1]).relu()
    kept = ((y[1] != 0) & (h != 0)).sum().item() / (h != 0).sum().item()
    assert abs(kept - 0.5) < 0.05, kept
    wide.eval()
    for m in models:
        m.eval()
    y = wide(xs)
    for i, m in enumerate(models):
        torch.testing.assert_close(y[i], m(xs[i]), rtol=0, atol=0)
