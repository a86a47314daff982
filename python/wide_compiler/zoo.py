"""The model zoo: every built-in model of the package, in one place.

The CLI (``trace``, ``analyze``, ``test``), the demo (examples/demo.py), ``analyze``'s examples
and the benchmarks (:mod:`wide_compiler.bench.vision_models` adds sizes and inputs to the models
here) all build their models from this module; nothing defines a model twice.

- :data:`MODELS`: the families ``trace`` and ``analyze`` offer by name, ``name -> (factory,
  sample_shape)``: ``factory()`` makes one member (own random weights), ``sample_shape`` is one
  member's input shape (:class:`MLP`, :class:`ResBlock`, :class:`ConvNet`,
  :class:`TinyTransformer`);
- :func:`mlp_stack`: Linear layers with ReLU / GELU between them (the CLI's self-test and the
  demo);
- :func:`spirals`: the examples' built-in data (three interleaved spirals, 2-d points and labels);
- the benchmark families: :class:`ResNetTiny`, :class:`ResNet18` (with :class:`BasicBlock`),
  :func:`mobilenet`, :func:`dcgan_g`, :func:`dcgan_d`, :func:`audio1d`, :class:`Tabular` and
  :func:`encoder_layer`.

>>> import torch
>>> from wide_compiler import zoo
>>> factory, shape = zoo.MODELS["mlp"]
>>> factory()(torch.randn(*shape)).shape
torch.Size([32, 10])
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MODELS", "MLP", "ResBlock", "ConvNet", "TinyTransformer", "mlp_stack", "encoder_layer",
           "BasicBlock", "ResNetTiny", "ResNet18", "mobilenet", "dcgan_g", "dcgan_d", "audio1d", "Tabular",
           "spirals"]


class MLP(nn.Module):
    """Linear/GELU stack: the shape of most RL critics and tabular ensembles."""

    def __init__(self, d_in: int = 64, hidden: int = 128, d_out: int = 10, depth: int = 2) -> None:
        super().__init__()
        dims = [d_in] + [hidden] * depth
        layers: list[nn.Module] = []
        for a, b in zip(dims, dims[1:]):
            layers += [nn.Linear(a, b), nn.GELU()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(dims[-1], d_out)

    def forward(self, x):
        return self.head(self.body(x))


def mlp_stack(sizes: Sequence[int] = (16, 32, 32, 4), *, seed: int | None = None) -> nn.Sequential:
    """``nn.Sequential`` of Linear layers ``sizes[0] -> sizes[1] -> ...``, with ReLU and GELU
    alternating between them (ReLU first); initialised from ``seed`` when given
    (``torch.manual_seed``).

    >>> mlp_stack((4, 8, 8, 2), seed=0)
    Sequential(
      (0): Linear(in_features=4, out_features=8, bias=True)
      (1): ReLU()
      (2): Linear(in_features=8, out_features=8, bias=True)
      (3): GELU(approximate='none')
      (4): Linear(in_features=8, out_features=2, bias=True)
    )
    """
    if seed is not None:
        torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for k, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(a, b))
        if k < len(sizes) - 2:
            layers.append(nn.GELU() if k % 2 else nn.ReLU())
    return nn.Sequential(*layers)


class ResBlock(nn.Module):
    """A pre-norm residual MLP block with a softmax head: residuals, LayerNorm, glue ops."""

    def __init__(self, d: int = 64, hidden: int = 128, classes: int = 10) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        x = x + self.fc2(self.fc1(self.norm(x)).relu())
        return self.head(x).log_softmax(dim=-1)


class ConvNet(nn.Module):
    """A small CNN: conv/BatchNorm/ReLU/max-pool blocks, adaptive pool, flatten, linear."""

    def __init__(self, channels: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.BatchNorm2d(2 * channels), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.fc = nn.Linear(2 * channels, classes)

    def forward(self, x):
        return self.fc(self.features(x).flatten(1))


class TinyTransformer(nn.Module):
    """One transformer encoder layer (self-attention, LayerNorm, MLP) and a mean-pooled head."""

    def __init__(self, d: int = 32, heads: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.encoder = encoder_layer(d, heads, 2 * d)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        return self.head(self.encoder(x).mean(dim=1))


def encoder_layer(d_model: int = 16, nhead: int = 2, dim_feedforward: int = 32) -> nn.Module:
    """``nn.TransformerEncoderLayer`` (batch first, no dropout): tokens ``[T, d_model]``."""
    return nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward, dropout=0.0, batch_first=True)


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


MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "mlp": (MLP, (32, 64)),
    "resblock": (ResBlock, (32, 64)),
    "convnet": (ConvNet, (8, 3, 16, 16)),
    "transformer": (TinyTransformer, (8, 12, 32)),
}


def spirals(n: int, *, classes: int = 3, noise: float = 0.15, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` points of ``classes`` interleaved spirals (``[n, 2]`` floats) and their labels
    (``[n]`` int64), drawn from their own generator seeded by ``seed``: the built-in data of the
    examples (a small task a width or learning-rate sweep can tell apart).

    >>> x, y = spirals(5, seed=1)
    >>> tuple(x.shape), tuple(y.shape), y.dtype, torch.equal(spirals(5, seed=1)[0], x)
    ((5, 2), (5,), torch.int64, True)
    """
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(0, classes, (n,), generator=g, device=g.device)
    r = torch.rand(n, generator=g, device=g.device)
    theta = 4 * r + k * (2 * math.pi / classes) + noise * torch.randn(n, generator=g, device=g.device)
    return torch.stack([r * torch.cos(theta), r * torch.sin(theta)], dim=1), k
