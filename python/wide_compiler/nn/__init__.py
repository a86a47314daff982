"""Wide modules for people who build wide models by hand; ``compile()`` uses the same ops."""

from .activation import WidePReLU
from .conv import (
    WideConv1d,
    WideConv2d,
    WideConv3d,
    WideConvTranspose1d,
    WideConvTranspose2d,
    WideConvTranspose3d,
)
from .embedding import WideEmbedding, WideEmbeddingBag
from .linear import WideLinear
from .rnn import WideGRU, WideGRUCell, WideLSTM, WideLSTMCell, WideRNN, WideRNNCell
from .norm import (
    WideBatchNorm1d,
    WideBatchNorm2d,
    WideBatchNorm3d,
    WideGroupNorm,
    WideInstanceNorm1d,
    WideInstanceNorm2d,
    WideInstanceNorm3d,
    WideLayerNorm,
    WideRMSNorm,
)

__all__ = [
    "WideBatchNorm1d", "WideBatchNorm2d", "WideBatchNorm3d", "WideConv1d", "WideConv2d", "WideConv3d",
    "WideConvTranspose1d", "WideConvTranspose2d", "WideConvTranspose3d", "WideEmbedding",
    "WideEmbeddingBag", "WideGRU", "WideGRUCell", "WideGroupNorm", "WideInstanceNorm1d", "WideInstanceNorm2d",
    "WideInstanceNorm3d", "WideLSTM", "WideLSTMCell", "WideLayerNorm", "WideLinear", "WidePReLU", "WideRMSNorm",
    "WideRNN", "WideRNNCell",
]
