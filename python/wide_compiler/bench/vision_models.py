"""Whole models for ``benchmark models`` (DESIGN §10): the vision, audio and tabular families the
widen pass covers, a transformer encoder layer and the Flux double/single-stream blocks of
:mod:`wide_compiler.blocks` (also timed as their hand-built wide blocks), each at a few sizes.

Each entry of :data:`MODELS` is a :class:`ModelSpec`: ``make(size)`` builds one member (its own
random init), ``inputs(lead, size, generator)`` builds that member's inputs with leading dims
``lead`` (``(B,)`` for one member's sample, ``(N, B)`` for the N-first wide input). ``size`` is
``"tiny"`` (the shapes of tests/python/test_vision_models.py, for smoke runs) or ``"small"``
(moderate shapes for timing). The architectures follow the ones the tests compile (the tests keep
their own copies).

>>> import torch
>>> from wide_compiler.bench.vision_models import MODELS
>>> spec = MODELS["resnet"]
>>> m = spec.make("tiny")
>>> (x,) = spec.inputs((2,), "tiny", torch.Generator().manual_seed(0))
>>> m(x).shape
torch.Size([2, 5])
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MODELS", "SIZES", "BasicBlock", "ModelSpec", "ResNet18", "ResNetTiny", "Tabular", "audio1d",
           "dcgan_d", "dcgan_g", "mobilenet", "transformer"]

SIZES = ("tiny", "small")


class BasicBlock(nn.Module):
    """ResNet basic block: conv-BN-ReLU-conv-BN plus the (projected) shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class ResNetTiny(nn.Module):
    """ResNet-18-style: stem conv/BN/ReLU/max-pool, basic blocks, global pool, linear head."""

    def __init__(self, width: int = 8, classes: int = 5, blocks: int = 2, pool: bool = True) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU(inplace=True), *([nn.MaxPool2d(3, 2, 1)] if pool else []))
        layers, c = [BasicBlock(width, width, 1)], width
        for _ in range(blocks - 1):
            layers.append(BasicBlock(c, 2 * c, 2))
            c *= 2
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, classes)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.layers(self.stem(x))), 1))


class ResNet18(nn.Module):
    """The standard ResNet-18 (torchvision's layout, written here: no torchvision needed): a 7x7
    stride-2 stem with BatchNorm, ReLU and 3x3 max pool, four stages of two basic blocks at
    ``width``, 2, 4 and 8 times ``width`` channels (64-512 for the real model), global average
    pool, linear head. ``width`` below 64 gives the same architecture at a toy width."""

    def __init__(self, width: int = 64, classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        c, stages = width, []
        for k in range(4):
            cout = width << k
            stages.append(nn.Sequential(BasicBlock(c, cout, 1 if k == 0 else 2), BasicBlock(cout, cout, 1)))
            c = cout
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def mobilenet(width: int = 8, classes: int = 4) -> nn.Module:
    """MobileNet-style: strided stem, depthwise-separable blocks (depthwise 3x3 + pointwise 1x1,
    BN, ReLU6), global pool, linear head."""
    def dw(cin: int, cout: int, s: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(cin, cin, 3, s, 1, groups=cin, bias=False), nn.BatchNorm2d(cin),
                             nn.ReLU6(), nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout),
                             nn.ReLU6())
    w = width
    return nn.Sequential(nn.Conv2d(3, w, 3, 2, 1), nn.BatchNorm2d(w), nn.ReLU6(), dw(w, 2 * w, 1),
                         dw(2 * w, 2 * w, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.0),
                         nn.Linear(2 * w, classes))


def dcgan_g(nz: int = 6, ngf: int = 4, img: int = 16) -> nn.Module:
    """DCGAN generator: noise ``[nz, 1, 1]`` -> transposed convs with BN/ReLU -> Tanh image
    ``[3, img, img]`` (img a power of two >= 8)."""
    ups = int(math.log2(img)) - 2  # 1 -> 4, then doubling
    c = ngf * 2 ** (ups - 1)
    layers: list[nn.Module] = [nn.ConvTranspose2d(nz, c, 4, 1, 0, bias=False), nn.BatchNorm2d(c),
                               nn.ReLU(True)]
    for _ in range(ups - 1):
        layers += [nn.ConvTranspose2d(c, c // 2, 4, 2, 1, bias=False), nn.BatchNorm2d(c // 2),
                   nn.ReLU(True)]
        c //= 2
    layers += [nn.ConvTranspose2d(c, 3, 4, 2, 1, bias=False), nn.Tanh()]
    return nn.Sequential(*layers)


def dcgan_d(ndf: int = 8, img: int = 16) -> nn.Module:
    """DCGAN discriminator: strided 4x4 convs with BN/LeakyReLU down to 4x4, a 4x4 conv to one
    logit, Sigmoid."""
    layers: list[nn.Module] = [nn.Conv2d(3, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True)]
    c, s = ndf, img // 2
    while s > 4:
        layers += [nn.Conv2d(c, 2 * c, 4, 2, 1, bias=False), nn.BatchNorm2d(2 * c),
                   nn.LeakyReLU(0.2, inplace=True)]
        c, s = 2 * c, s // 2
    layers += [nn.Conv2d(c, 1, 4, 1, 0, bias=False), nn.Flatten(), nn.Sigmoid()]
    return nn.Sequential(*layers)


def audio1d(channels: int = 8, classes: int = 3) -> nn.Module:
    """1-D audio classifier on a waveform ``[1, L]``: strided conv, BN, pool, 'same' reflect-padded
    conv, GroupNorm, GELU, channel dropout, global pool, linear head."""
    c = channels
    return nn.Sequential(nn.Conv1d(1, c, 9, stride=2, padding=4), nn.BatchNorm1d(c), nn.ReLU(),
                         nn.MaxPool1d(2), nn.Conv1d(c, c, 5, padding="same", padding_mode="reflect"),
                         nn.GroupNorm(2, c), nn.GELU(), nn.Dropout1d(0.0), nn.AdaptiveAvgPool1d(1),
                         nn.Flatten(), nn.Linear(c, classes))


class Tabular(nn.Module):
    """Tabular model: one embedding per categorical column, concatenated with the numeric
    features, then an MLP with BatchNorm1d. Inputs: ``idx [B, len(cards)]`` (int64) and
    ``num [B, n_num]``."""

    def __init__(self, cards: tuple[int, ...] = (10, 10), dim: int = 4, n_num: int = 3,
                 hidden: int = 8, out: int = 1) -> None:
        super().__init__()
        self.cards = tuple(cards)
        self.embs = nn.ModuleList(nn.Embedding(c, dim) for c in cards)
        self.mlp = nn.Sequential(nn.Linear(dim * len(cards) + n_num, hidden), nn.BatchNorm1d(hidden),
                                 nn.ReLU(), nn.Dropout(0.0), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, out))

    def forward(self, idx, num):
        cols = [e(idx[:, j]) for j, e in enumerate(self.embs)]
        return self.mlp(torch.cat([*cols, num], dim=1))


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One model family: ``make(size)`` -> one member; ``inputs(lead, size, g)`` -> its inputs
    (a tuple) with leading dims ``lead``; ``batch[size]`` is the batch of the benchmark.
    ``module(members, strategy)``: a hand-built wide form of the members, timed next to
    ``wc.compile`` (once per entry of ``module_strategies``); None: none. ``channels_last``: the members also run as a
    channels-last loop (what a user of a conv net would try first)."""

    name: str
    make: Callable[[str], nn.Module]
    inputs: Callable[[tuple[int, ...], str, torch.Generator], tuple[torch.Tensor, ...]]
    batch: dict[str, int]
    description: str = ""
    module: Callable[[list[nn.Module], str], nn.Module] | None = None
    module_strategies: tuple[str, ...] = ("",)
    channels_last: bool = False  # image input: the channels-last loop is a baseline too


def _image(c: int, hw: dict[str, int]):
    def inputs(lead, size, g):
        return (torch.randn(*lead, c, hw[size], hw[size], generator=g),)
    return inputs


_TAB = {"tiny": {"cards": (10, 10), "dim": 4, "n_num": 3, "hidden": 8},
        "small": {"cards": (100, 50, 20, 10), "dim": 16, "n_num": 8, "hidden": 64}}


def _tab_inputs(lead, size, g):
    cfg = _TAB[size]
    idx = torch.stack([torch.randint(0, c, lead, generator=g) for c in cfg["cards"]], dim=-1)
    return idx, torch.randn(*lead, cfg["n_num"], generator=g)


def _audio_inputs(lead, size, g):
    return (torch.randn(*lead, 1, {"tiny": 64, "small": 1024}[size], generator=g),)


def _spec(name: str, factory: Callable[..., nn.Module], kwargs: dict[str, dict], inputs,
          batch: dict[str, int], description: str, **more) -> ModelSpec:
    return ModelSpec(name, lambda size: factory(**kwargs[size]), inputs, batch, description, **more)


def transformer(d_model: int = 16, nhead: int = 2, dim_feedforward: int = 32) -> nn.Module:
    """``nn.TransformerEncoderLayer`` (batch first, no dropout): tokens ``[T, d_model]``."""
    return nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward, dropout=0.0, batch_first=True)


#: transformer: d_model, heads, feed-forward width and tokens T per size (the issue's reference
#: case "TransformerEncoderLayer d=64, T=32" is ``small``).
_TRANSFORMER = {"tiny": {"d_model": 16, "nhead": 2, "dim_feedforward": 32},
                "small": {"d_model": 64, "nhead": 4, "dim_feedforward": 256}}
_TOKENS = {"tiny": 8, "small": 32}


def _transformer_inputs(lead, size, g):
    return (torch.randn(*lead, _TOKENS[size], _TRANSFORMER[size]["d_model"], generator=g),)


#: Flux blocks: hidden size, heads, image and text tokens per size.
_FLUX = {"tiny": {"hidden_size": 16, "num_heads": 2, "img": 4, "txt": 4},
         "small": {"hidden_size": 64, "num_heads": 4, "img": 16, "txt": 8}}


def _flux_block(kind: str) -> Callable[..., nn.Module]:
    def make(hidden_size: int, num_heads: int, img: int, txt: int) -> nn.Module:
        from .. import blocks

        cls = blocks.DoubleStreamBlock if kind == "double" else blocks.SingleStreamBlock
        return cls(hidden_size=hidden_size, num_heads=num_heads)
    return make


def _flux_inputs(kind: str):
    """A member's Flux inputs with leading dims ``lead``: ``(img, txt, vec, pe)`` (double) or
    ``(x, vec, pe)`` (single, x = the joint sequence), ``pe`` the rotary table
    ``[*lead, 1, T, head_dim/2, 2, 2]`` of each member at random positions (as Flux's
    ``EmbedND``)."""
    def inputs(lead, size, g):
        from ..blocks import rope

        c = _FLUX[size]
        d, t = c["hidden_size"], c["img"] + c["txt"]
        pe = rope(10 * torch.rand(*lead, t, generator=g), d // c["num_heads"]).unsqueeze(-5)
        vec = torch.randn(*lead, d, generator=g)
        if kind == "double":
            return (torch.randn(*lead, c["img"], d, generator=g),
                    torch.randn(*lead, c["txt"], d, generator=g), vec, pe)
        return torch.randn(*lead, t, d, generator=g), vec, pe
    return inputs


@functools.cache
def _flux_double_positional() -> type[nn.Module]:
    """``WideDoubleStreamBlock`` called as the bench calls every contender, positionally in the
    member's (Flux's) order ``(img, txt, vec, pe)``: the block itself wants its streams by
    keyword (Note [double-stream argument order] in wide_compiler/blocks.py)."""
    from .. import blocks

    class FluxOrderWideDoubleStreamBlock(blocks.WideDoubleStreamBlock):
        def __call__(self, img, txt, vec, pe=None):
            return super().__call__(img=img, txt=txt, vec=vec, pe=pe)

    return FluxOrderWideDoubleStreamBlock


def _flux_module(kind: str) -> Callable[[list[nn.Module], str], nn.Module]:
    """The hand-built wide block (``wide_compiler.blocks.Wide*StreamBlock``) with ``strategy``."""
    def build(models: list[nn.Module], strategy: str) -> nn.Module:
        from .. import blocks

        cls = _flux_double_positional() if kind == "double" else blocks.WideSingleStreamBlock
        return cls.from_modules(models, strategy=strategy)
    return build


MODELS: dict[str, ModelSpec] = {s.name: s for s in (
    _spec("resnet", ResNetTiny,
          {"tiny": {"width": 8, "classes": 5}, "small": {"width": 16, "classes": 10}},
          _image(3, {"tiny": 16, "small": 32}), {"tiny": 2, "small": 8},
          "ResNet-18-style, 2 basic blocks (width 8 / 16), 16x16 / 32x32 images", channels_last=True),
    _spec("resnet_nopool", ResNetTiny,
          {"tiny": {"width": 8, "classes": 5, "pool": False}, "small": {"width": 16, "classes": 10, "pool": False}},
          _image(3, {"tiny": 16, "small": 32}), {"tiny": 2, "small": 8},
          "the ResNet-style net without its stem max pool (16/32 channels at 32x32 and 16x16)",
          channels_last=True),
    _spec("resnet18", ResNet18, {"tiny": {"width": 8, "classes": 10}, "small": {}},
          _image(3, {"tiny": 64, "small": 64}), {"tiny": 2, "small": 8},
          "the standard ResNet-18 at its real widths (64-512 channels, 1000 classes), 64x64 images; "
          "width 8 for tiny", channels_last=True),
    _spec("mobilenet", mobilenet, {"tiny": {"width": 8}, "small": {"width": 16, "classes": 10}},
          _image(3, {"tiny": 16, "small": 32}), {"tiny": 2, "small": 8},
          "MobileNet-style depthwise-separable blocks (width 8 / 16)", channels_last=True),
    _spec("dcgan_g", dcgan_g,
          {"tiny": {"nz": 6, "ngf": 4, "img": 16}, "small": {"nz": 32, "ngf": 16, "img": 32}},
          lambda lead, size, g: (torch.randn(*lead, {"tiny": 6, "small": 32}[size], 1, 1,
                                             generator=g),),
          {"tiny": 2, "small": 8}, "DCGAN generator, 16x16 / 32x32 output"),
    _spec("dcgan_d", dcgan_d, {"tiny": {"ndf": 8, "img": 16}, "small": {"ndf": 16, "img": 32}},
          _image(3, {"tiny": 16, "small": 32}), {"tiny": 2, "small": 8},
          "DCGAN discriminator, 16x16 / 32x32 input", channels_last=True),
    _spec("audio1d", audio1d, {"tiny": {"channels": 8}, "small": {"channels": 32, "classes": 10}},
          _audio_inputs, {"tiny": 2, "small": 8}, "1-D conv audio classifier, 64 / 1024 samples"),
    _spec("tabular", Tabular, _TAB, _tab_inputs, {"tiny": 4, "small": 64},
          "embeddings per categorical column + MLP with BatchNorm1d"),
    _spec("transformer", transformer, _TRANSFORMER, _transformer_inputs, {"tiny": 2, "small": 8},
          "nn.TransformerEncoderLayer d=16 / 64, 2 / 4 heads, T=8 / 32, batch first"),
    *(_spec(f"flux_{kind}", _flux_block(kind), _FLUX, _flux_inputs(kind), {"tiny": 2, "small": 4},
            f"Flux {kind}-stream block (wide_compiler.blocks), hidden 16 / 64, 2 / 4 heads, "
            "4+4 / 16+8 image+text tokens, rope table per member",
            module=_flux_module(kind), module_strategies=("auto",))
      for kind in ("double", "single")),
)}
