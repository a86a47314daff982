"""Wide modules for people who build wide models by hand; ``compile()`` uses the same ops."""

from .activation import WidePReLU
from .attention import WideMultiheadAttention
from .conv import (
    WideConv1d,
    WideConv2d,
    WideConv3d,
    WideConvTranspose1d,
    WideConvTranspose2d,
    WideConvTranspose3d,
)
from .dropout import WideDropout, WideDropout1d, WideDropout2d, WideDropout3d
from .embedding import WideEmbedding, WideEmbeddingBag
from .linear import WideLinear
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
from .pooling import (
    WideAdaptiveAvgPool1d,
    WideAdaptiveAvgPool2d,
    WideAdaptiveAvgPool3d,
    WideAdaptiveMaxPool1d,
    WideAdaptiveMaxPool2d,
    WideAdaptiveMaxPool3d,
)
from .rnn import WideGRU, WideGRUCell, WideLSTM, WideLSTMCell, WideRNN, WideRNNCell

__all__ = [
    "WideAdaptiveAvgPool1d", "WideAdaptiveAvgPool2d", "WideAdaptiveAvgPool3d", "WideAdaptiveMaxPool1d",
    "WideAdaptiveMaxPool2d", "WideAdaptiveMaxPool3d", "WideBatchNorm1d", "WideBatchNorm2d", "WideBatchNorm3d",
    "WideConv1d", "WideConv2d", "WideConv3d", "WideConvTranspose1d", "WideConvTranspose2d",
    "WideConvTranspose3d", "WideDropout", "WideDropout1d", "WideDropout2d", "WideDropout3d", "WideEmbedding",
    "WideEmbeddingBag", "WideGRU", "WideGRUCell", "WideGroupNorm", "WideInstanceNorm1d", "WideInstanceNorm2d",
    "WideInstanceNorm3d", "WideLSTM", "WideLSTMCell", "WideLayerNorm", "WideLinear", "WideMultiheadAttention",
    "WidePReLU", "WideRMSNorm", "WideRNN", "WideRNNCell",
]
