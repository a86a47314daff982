"""Code written for WideCompiler 0.x: the channel-packed calling convention, and the layout
helpers refusing a tensor of the other layout instead of splitting the wrong dim."""
from __future__ import annotations

import pytest
import torch
import wide_compiler as wc
from support import StackedScalar
from torch import nn

FAST = wc.WideConfig.fast()


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))

    def forward(self, x):
        return self.net(x)


def test_seed_quick_start_packed_in_packed_out():
    """The 0.x quick start: ``out = wide(pack(inputs)); outs = unpack(out, n)``, through ``.packed``."""
    n = 100
    models = [MLP() for _ in range(n)]
    wide = wc.compile(models, torch.randn(8, 64), config=FAST)
    inputs = [torch.randn(8, 64) for _ in range(n)]
    out = wide.packed(wc.pack(inputs))
    assert out.shape == (8, n * 10)
    outs = wc.unpack(out, n=n)
    for o, m, x in zip(outs, models, inputs):
        torch.testing.assert_close(o, m(x), rtol=1e-5, atol=1e-5)


def test_seed_quick_starts_run_unchanged():
    """0.2-0.7 quick starts, only the import line kept: ``wide(pack(inputs))`` + ``unpack``, ``n=100``
    from one model, the WideBuilder chain."""
    import wide_compiler

    models = [MLP() for _ in range(100)]
    sample_input = torch.randn(8, 64)
    wide = wide_compiler.compile(models, sample_input)
    inputs = [torch.randn(8, 64) for _ in range(100)]
    packed = wide_compiler.pack(inputs)
    outputs = wide_compiler.unpack(wide(packed), n=100)
    for o, m, x in zip(outputs, models, inputs):
        torch.testing.assert_close(o, m(x), rtol=1e-5, atol=1e-5)

    wide = wide_compiler.compile(MLP(), sample_input, n=100)  # N copies with their own weights
    assert wide(sample_input.expand(100, 8, 64)).shape == (100, 8, 10)

    wide = (wide_compiler.WideBuilder(models[:4])
            .with_sample(sample_input)
            .with_config(wide_compiler.WideConfig.fast())
            .validate()
            .build())
    outs = wide_compiler.unpack(wide(wide_compiler.pack(inputs[:4])), n=4)
    torch.testing.assert_close(outs[2], models[2](inputs[2]), rtol=1e-5, atol=1e-5)


def test_packed_view_conv_and_rank_one_outputs():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)

        def forward(self, x):
            y = self.conv(x)
            return y, y.mean(dim=(0, 2, 3)), y.sum()

    models = [Net() for _ in range(3)]
    wide = wc.compile(models, torch.randn(2, 3, 5, 5), config=FAST)
    xs = [torch.randn(2, 3, 5, 5) for _ in models]
    y, per_channel, total = wide.packed(wc.pack(xs))
    assert y.shape == (2, 12, 5, 5) and per_channel.shape == (12,) and total.shape == (3,)
    for i, (m, x) in enumerate(zip(models, xs)):
        ry, rc, rt = m(x)
        torch.testing.assert_close(wc.unpack(y, 3)[i], ry, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(per_channel[4 * i:4 * i + 4], rc, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(total[i], rt, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="divisible by N=3"):
        wide.packed(torch.randn(2, 4, 5, 5))


def test_unpack_refuses_an_n_first_output_instead_of_splitting_the_wrong_dim():
    models = [MLP() for _ in range(4)]
    wide = wc.compile(models, torch.randn(8, 64), config=FAST)
    out = wide(torch.randn(4, 8, 64))  # N-first [4, 8, 10]: dim 1 (8) is divisible by 4
    with pytest.raises(ValueError, match=r"N-first .*unstack"):
        wc.unpack(out, n=4)
    assert len(wc.unstack(out)) == 4
    untagged = out + 0  # an op drops the tag; dim 0 == n is still refused as ambiguous
    with pytest.raises(ValueError, match="assume_packed=True"):
        wc.unpack(untagged, n=4)
    assert len(wc.unpack(untagged, n=4, assume_packed=True)) == 4
    with pytest.raises(ValueError, match="channel-packed.*unpack"):
        wc.unstack(wc.pack([torch.randn(4, 3)] * 4))


def test_packed_view_shares_parameters_and_mode():
    models = [MLP() for _ in range(2)]
    wide = wc.compile(models, torch.randn(8, 64), config=FAST)
    view = wide.packed
    assert {id(p) for p in view.parameters()} == {id(p) for p in wide.parameters()}
    view.eval()
    assert not wide.training


def test_register_by_class_name_as_in_0x():
    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.s = nn.Parameter(torch.rand(()))

        def forward(self, x):
            return x * self.s if self.s > 0.5 else x  # data-dependent: export cannot trace it

    from wide_compiler import registry

    @wc.register("Gate")
    class WideGate(StackedScalar):
        def forward(self, x):
            s = self.per_member(x)
            return torch.where(s > 0.5, x * s, x)

        def unfuse(self):
            return []

    try:
        models = [nn.Sequential(nn.Linear(3, 3), Gate()) for _ in range(3)]
        wide = wc.compile(models, torch.randn(2, 3), config=FAST)
        x = torch.randn(3, 2, 3)
        for i, m in enumerate(models):
            torch.testing.assert_close(wide(x)[i], m(x[i]), rtol=1e-5, atol=1e-5)
    finally:
        registry._REGISTRY.pop("Gate", None)
    with pytest.raises(TypeError, match="nn.Module subclass or its class name"):
        wc.register("not a name")


@pytest.mark.parametrize("field,points_to", [("compile", "compile_model=True"), ("compile_mode", "compile_options"),
                                             ("validate_rtol", "rtol="), ("debug", "WideConfig.debug()")])
def test_seed_config_fields_name_their_new_home(field, points_to):
    with pytest.raises(TypeError, match=f"{field!r} is a WideCompiler 0.x field, now .*{points_to}".replace("(", r"\(")
                       .replace(")", r"\)")):
        wc.WideConfig(**{field: True})
    assert wc.WideConfig(rtol=1e-3).replace(atol=1e-4).rtol == 1e-3  # ordinary fields still work


# --- batch dims found, not assumed -----------------------------------------------------------------
class SeqFirstAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2)  # batch_first=False: [T, B, E]

    def forward(self, x):
        return self.attn(x, x, x, need_weights=False)[0]


class SeqFirstGRU(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(8, 6, num_layers=2)

    def forward(self, x):
        out, h = self.rnn(x)
        return out, h


class SeqFirstTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0), 1,
                                         enable_nested_tensor=False)

    def forward(self, x):
        return self.enc(x)


class BroadcastTable(nn.Module):
    """Flux-style: a RoPE-like table ``pe [1, T, D]`` broadcast over the batch."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, pe):
        h = self.fc(x)
        return (h.view(*h.shape[:-1], 4, 2) * pe.view(*pe.shape[:-1], 4, 2)).flatten(-2)


@pytest.mark.parametrize("factory", [SeqFirstAttention, SeqFirstGRU, SeqFirstTransformer],
                         ids=["mha", "gru", "transformer"])
def test_sequence_first_inputs_take_any_batch(factory):
    torch.manual_seed(0)
    models = [factory().eval() for _ in range(3)]
    wide = wc.compile(models, torch.randn(5, 2, 8), config=FAST)  # [T=5, B=2, E]
    sizes = [(5, 2), (5, 3), (5, 1), (5, 6)]  # [T, B]: other batches
    if factory is not SeqFirstGRU:  # attention also takes other lengths (the RNN op fixes T)
        sizes += [(7, 1), (4, 6)]
    for t, b in sizes:
        x = torch.randn(3, t, b, 8)
        out = wide(x)
        for i, m in enumerate(models):
            ref = m(x[i])
            got = tuple(o[i] for o in out) if isinstance(out, tuple) else out[i]
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_a_broadcast_side_input_stays_size_one():
    models = [BroadcastTable() for _ in range(3)]
    wide = wc.compile(models, (torch.randn(2, 5, 8), torch.randn(1, 5, 8)), config=FAST)
    for b in (1, 2, 4):
        x, pe = torch.randn(3, b, 5, 8), torch.randn(1, 5, 8)
        out = wide(x, pe.expand(3, 1, 5, 8))
        for i, m in enumerate(models):
            torch.testing.assert_close(out[i], m(x[i], pe), rtol=1e-5, atol=1e-5)


def test_seed_flux_block_quick_start():
    """0.7's block quick start (sizes scaled down), import line changed: head_dim and rope= are
    accepted; the blocks themselves follow Flux (README: Coming from WideCompiler 0.x). The one
    line that cannot run as written is the double-stream call: 0.x took (txt, img, ...), Flux
    (img, txt, ...), so a positional pair is refused rather than run with the streams swapped,
    and the streams are named instead (which means the same under both conventions)."""
    from wide_compiler.blocks import WideDoubleStreamBlock, WideJointAttention

    n = 2
    txt = torch.randn(n, 4, 6, 32)   # [N, B, L, hidden_size] text
    img = torch.randn(n, 4, 10, 32)  # [N, B, S, hidden_size] image
    vec = torch.randn(n, 4, 32)      # [N, B, emb_size] conditioning
    joint_attn = WideJointAttention(n=n, hidden_size=32, num_heads=4, head_dim=8)
    txt_out, img_out = joint_attn(txt, img, rope=None)
    assert txt_out.shape == txt.shape and img_out.shape == img.shape
    block = WideDoubleStreamBlock(n=n, hidden_size=32, num_heads=4, head_dim=8)
    with pytest.raises(TypeError, match=r"pass the two streams by keyword.*\(img, txt, \.\.\.\) while "
                                        r"WideCompiler 0\.x's took \(txt, img, \.\.\.\)"):
        block(txt, img, vec, rope=None)  # 0.7's call, as written
    img_out, txt_out = block(txt=txt, img=img, vec=vec, rope=None)
    assert txt_out.shape == txt.shape and img_out.shape == img.shape
    members = block.unfuse()
    ref = members[1](img[1], txt[1], vec[1])  # the member block is Flux's: (img, txt, ...) -> (img, txt)
    torch.testing.assert_close(img_out[1], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(txt_out[1], ref[1], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="head_dim=16, but hidden_size 32 / num_heads 4 is 8"):
        WideDoubleStreamBlock(n=n, hidden_size=32, num_heads=4, head_dim=16)


class WithMask(nn.Module):
    """A per-sample 1-D input (a mask, labels, timesteps) beside the batch."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x, mask):
        return self.fc(x) * mask[:, None]


def test_a_one_dim_input_as_long_as_the_batch_is_dynamic_too():
    models = [WithMask() for _ in range(3)]
    wide = wc.compile(models, (torch.randn(4, 6), torch.ones(4)), config=FAST)
    assert "mask [B]" in wide.summary()
    for b in (2, 7):
        x, mask = torch.randn(3, b, 6), (torch.rand(3, b) > 0.5).float()
        out = wide(x, mask)
        for i, m in enumerate(models):
            torch.testing.assert_close(out[i], m(x[i], mask[i]), rtol=1e-5, atol=1e-5)
