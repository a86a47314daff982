"""Patterns real models use (transformers, timm, diffusers): no_grad/autocast regions (rotary
embeddings), dropout of a shared value, BatchNorm with a cumulative average, tied parameters;
member by member with wide_compiler.testing."""
from __future__ import annotations

import pytest
import torch
import wide_compiler as wc
from torch import nn
from wide_compiler.testing import assert_members_close, check_compile, make_members
from support import DEVICE

FAST = wc.WideConfig.fast()


class Rotary(nn.Module):
    """The transformers pattern: a @torch.no_grad() rotary table and an autocast-disabled block."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("inv_freq", torch.rand(4))

    @torch.no_grad()
    def table(self, x):
        return torch.outer(x[:, 0], self.inv_freq).cos()

    def forward(self, x):
        h = self.fc(x)
        with torch.autocast("cpu", enabled=False):
            h2 = h.float() * 2
        return h2[..., :4] * self.table(x) + h[..., 4:]


def test_no_grad_and_disabled_autocast_regions_match_members():
    models = make_members(Rotary, 3)
    wide, _ = check_compile(models, torch.randn(5, 8), strict=True, config=FAST)
    assert not wide.fallbacks
    assert "region:" in wide.summary()


class GradOnlyOutside(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner, self.outer = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            frozen = self.inner(x)
        with torch.set_grad_enabled(True):
            live = self.outer(x)
        return frozen * live


def test_no_gradient_flows_through_a_no_grad_region():
    models = make_members(GradOnlyOutside, 3)
    wide, _ = check_compile(models, torch.randn(3, 4), strict=True, config=FAST)
    wide.zero_grad(set_to_none=True)
    wide(torch.randn(3, 3, 4)).sum().backward()
    assert wide.get_parameter("inner.weight").grad is None
    assert wide.get_parameter("outer.weight").grad is not None


class Bf16Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x):
        h = torch.relu(self.a(x))
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            y = self.b(h)
            with torch.no_grad():
                scale = y.detach().abs().mean(-1, keepdim=True) + 1
        return y / scale


def test_autocast_region_keeps_its_dtypes_and_nested_regions_work():
    models = make_members(Bf16Block, 3)
    wide = wc.compile(models, torch.randn(4, 6), strict=True, config=FAST)
    xs = torch.randn(3, 4, 6)
    out = wide(xs)
    refs = [m(x) for m, x in zip(models, xs)]
    assert out.dtype == refs[0].dtype == torch.bfloat16
    assert_members_close(out, refs)


def test_regions_run_under_torch_compile_fullgraph():
    models = make_members(Rotary, 3)
    wide = wc.compile(models, torch.randn(5, 8), strict=True, config=FAST)
    compiled = torch.compile(wide, fullgraph=True, backend="eager")
    xs = torch.randn(3, 5, 8)
    assert_members_close(compiled(xs), [m(x) for m, x in zip(models, xs)])


class SharedDropout(nn.Module):
    """XLNet/Funnel pattern: dropout of a term computed from shapes only (shared by all members)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        pos = torch.arange(x.shape[-1], dtype=torch.float32).sin() + 2.0
        return self.fc(x) + self.drop(pos)


def test_random_op_on_a_shared_value_draws_per_member():
    models = make_members(SharedDropout, 3)
    wide = wc.compile(models, torch.randn(4, 6), strict=True, config=FAST)
    x = torch.randn(4, 6)
    out = wide(x.expand(3, *x.shape)) - torch.stack([m.fc(x) for m in models])
    pos = torch.arange(6, dtype=torch.float32).sin() + 2.0
    assert set(torch.unique(torch.round(out / pos, decimals=4)).tolist()) <= {0.0, 2.0}  # dropped or scaled
    assert not torch.equal(out[0], out[1])  # independent masks
    wide.eval()
    for m in models:
        m.eval()
    check_compile(models, torch.randn(4, 6), strict=True, config=FAST, modes=("eval",))


def test_batch_norm_with_a_cumulative_average_trains_and_evaluates_like_its_members():
    """momentum=None: export cannot trace 1/float(num_batches_tracked); the module is kept whole
    and run by WideBatchNorm, in train and eval mode, with running stats per member."""
    def make():
        return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6, momentum=None), nn.ReLU(), nn.Linear(6, 2))

    models = make_members(make, 3)
    wide, _ = check_compile(models, torch.randn(5, 4), strict=True, config=FAST)
    xs = torch.randn(3, 5, 4)
    for _ in range(3):  # the cumulative average over several steps
        wide(xs)
        for m, x in zip(models, xs):
            m(x)
    for name, b in wide.named_buffers():
        assert_members_close(b, [m.get_buffer(name) for m in models], kind="buffer", what=name)
    back = wide.unfuse()
    assert back[1][1].momentum is None and int(back[1][1].num_batches_tracked) == 3


class TiedLM(nn.Module):
    """An LM whose head shares the embedding's weight (and T5/BART's `shared` pattern)."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Embedding(10, 6)
        self.encoder = nn.Module()
        self.encoder.embed_tokens = self.shared
        self.mix = nn.Linear(6, 6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.shared.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.encoder.embed_tokens(tokens))))


def test_tied_parameters_stay_tied_everywhere():
    models = make_members(TiedLM, 3)
    wide, _ = check_compile(models, torch.randint(0, 10, (2, 5)), strict=True, config=FAST, shared=(True,))
    # one stacked parameter under every alias, as in the member
    assert wide.get_parameter("head.weight") is wide.get_parameter("shared.weight")
    assert wide.get_parameter("encoder.embed_tokens.weight") is wide.get_parameter("shared.weight")
    assert [n for n, _ in wide.named_parameters()] == [n for n, _ in models[0].named_parameters()]
    assert set(wide.state_dict()) == set(models[0].state_dict())
    opt = wc.optim.SGD(wide.parameters(), lr=0.1)
    wide(torch.randint(0, 10, (3, 2, 5))).sum().backward()
    opt.step()
    back = wide.unfuse()
    assert back[1].head.weight is back[1].shared.weight is back[1].encoder.embed_tokens.weight
    assert torch.equal(back[1].head.weight, wide.get_parameter("shared.weight")[1])
    assert torch.equal(wide.member(2).head.weight, wide.get_parameter("head.weight")[2])
    wide.write_back(models)
    assert models[0].head.weight is models[0].shared.weight
    assert torch.equal(models[0].shared.weight, wide.get_parameter("shared.weight")[0])


def _parametrized():
    from torch.nn.utils.parametrizations import spectral_norm, weight_norm

    return nn.Sequential(weight_norm(nn.Conv1d(3, 4, 3)), nn.ReLU(), nn.Flatten(),
                         weight_norm(nn.Linear(4 * 6, 5), dim=None), spectral_norm(nn.Linear(5, 2)))


def test_weight_norm_and_spectral_norm_parametrizations():
    """The classes are created per instance (ParametrizedConv1d): compared by the original class
    and the parametrization modules; the wide parameters are original0/original1 and spectral
    norm's power-iteration vectors are per-member buffers."""
    models = make_members(_parametrized, 3)
    wide, _ = check_compile(models, torch.randn(2, 3, 8), strict=True, config=FAST)
    assert "0.parametrizations.weight.original0" in dict(wide.named_parameters())
    xs = torch.randn(3, 2, 3, 8)
    wide.eval()
    back = wide.unfuse()
    for b, x, o in zip(back, xs, wide(xs)):
        assert torch.nn.utils.parametrize.is_parametrized(b[0])
        assert_members_close(o.unsqueeze(0), [b.eval()(x)])
    other = _parametrized()
    other[0] = nn.Conv1d(3, 4, 3)  # not parametrized: a different program
    with pytest.raises(wc.ArchitectureMismatchError, match="member 2"):
        wc.compile([*make_members(_parametrized, 2), other], torch.randn(2, 3, 8), config=FAST)


class SharedInplaceDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        pos = torch.ones(4)  # made in forward: shared until the in-place random write
        nn.functional.dropout(pos, 0.5, training=self.training, inplace=True)
        return self.fc(x) + pos


def test_in_place_dropout_of_a_shared_tensor_draws_per_member():
    models = make_members(SharedInplaceDropout, 3)
    wide = wc.compile(models, torch.randn(2, 4), strict=True, config=FAST)
    x = torch.randn(2, 4)
    noise = wide(x.expand(3, *x.shape)) - torch.stack([m.fc(x) for m in models])
    assert set(torch.unique(noise.round(decimals=4)).tolist()) <= {0.0, 2.0}
    assert not torch.equal(noise[0], noise[1])  # each member its own mask


class DropoutInRegion(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            noise = nn.functional.dropout(torch.ones_like(x), 0.5, training=self.training)
        return self.fc(x) * noise


def test_random_ops_inside_regions_are_known_to_validate():
    from wide_compiler.testing import random_ops

    models = make_members(DropoutInRegion, 3)
    wide = wc.compile(models, torch.randn(2, 4), config=FAST, validate=True)  # compared in eval mode
    assert random_ops(wide) == ["aten.dropout.default"]
    assert random_ops(wide, training=False) == []  # dropout(train=False) draws nothing


class ZeroDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = nn.functional.dropout(self.fc(x), 0.0, training=True)
        return nn.functional.scaled_dot_product_attention(h[:, None], h[:, None], h[:, None], dropout_p=0.0)


def test_zero_probability_dropout_is_compared_in_train_mode():
    """transformers' tiny configs set every dropout to 0: train mode is then deterministic and
    must be checked member by member, not skipped."""
    from wide_compiler.testing import random_ops

    models = make_members(ZeroDropout, 3)
    wide, report = check_compile(models, torch.randn(2, 4), strict=True, config=FAST)
    assert random_ops(wide) == []
    assert not isinstance(report["train/own"], str) and report["train/own"]["param_grad"] is not None


class EndOfText(nn.Module):
    """CLIP's pooled output: the hidden state at each sequence's argmax token (a per-member index)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)

    def forward(self, ids):
        h = self.emb(ids)
        return h[torch.arange(h.shape[0]), ids.argmax(dim=-1)]


class RelativeBias(nn.Module):
    """Swin's relative-position bias: a table indexed by an integer buffer (per member once stacked)."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(9, 2))
        self.register_buffer("index", torch.randint(0, 9, (4, 4)))

    def forward(self, x):
        bias = self.table[self.index.view(-1)].view(4, 4, 2).permute(2, 0, 1)
        return x + bias


class Indexing(nn.Module):
    """Advanced indices: per member after leading slices, shared ones split by a slice, a shared mask."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x, i):
        h = self.fc(x)                                   # [B, S, 6]
        mask = torch.tensor([True, False, True, True, False, True])
        return (h[:, i], h[:, :, i], h[:, i, i], h[torch.tensor([0, 1]), :, torch.tensor([2, 3])],
                h[..., mask], h[i.clamp(max=1)])


@pytest.mark.parametrize("factory,sample", [
    (EndOfText, (torch.tensor([[3, 9, 1], [4, 2, 15]]),)),
    (RelativeBias, (torch.randn(2, 2, 4, 4),)),
    (Indexing, (torch.randn(2, 5, 6), torch.tensor([[4, 0], [2, 3]]))),
], ids=["end_of_text", "relative_bias", "mixed"])
def test_advanced_indices_per_member_and_split_by_slices(factory, sample):
    models = make_members(factory, 3)
    if factory is RelativeBias:  # the members' index buffers differ: each reads its own
        for k, m in enumerate(models):
            m.index.copy_(torch.randint(0, 9, (4, 4), generator=torch.Generator(DEVICE).manual_seed(k)))
    inputs = None
    if factory is not RelativeBias:  # integer inputs: a different index per member
        g = torch.Generator(DEVICE).manual_seed(1)
        inputs = [tuple(torch.randint(0, 2 if t.dim() == 2 and factory is Indexing else 16, t.shape, generator=g)
                        if t.dtype == torch.long else t + k for t in sample) for k in range(3)]
    wide, _ = check_compile(models, sample, inputs=inputs, strict=True, config=FAST)
    assert not wide.fallbacks
