"""Built-in model families for the demo, ``python -m wide_compiler trace`` and the benchmarks.

Each entry is ``name -> (factory, sample_shape)``: ``factory()`` makes one member (own random
weights), ``sample_shape`` is one member's input shape.

>>> import torch
>>> from wide_compiler import zoo
>>> factory, shape = zoo.MODELS["mlp"]
>>> factory()(torch.randn(*shape)).shape
torch.Size([32, 10])
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

__all__ = ["MODELS", "MLP", "ResBlock", "ConvNet", "TinyTransformer"]


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
        self.encoder = nn.TransformerEncoderLayer(d, heads, 2 * d, dropout=0.0, batch_first=True)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        return self.head(self.encoder(x).mean(dim=1))


MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "mlp": (MLP, (32, 64)),
    "resblock": (ResBlock, (32, 64)),
    "convnet": (ConvNet, (8, 3, 16, 16)),
    "transformer": (TinyTransformer, (8, 12, 32)),
}
