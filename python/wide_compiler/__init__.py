"""wide_compiler: run N models of one architecture as ONE wide model.

>>> import torch, wide_compiler as wc
>>> models = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
...           for _ in range(4)]
>>> wide = wc.compile(models, torch.randn(3, 8))
>>> wide(torch.randn(4, 3, 8)).shape
torch.Size([4, 3, 2])
"""

import torch  # noqa: F401  (loads libtorch before our core library)

from . import (
    _C,  # noqa: F401  (loads libwide: registers torch.ops.wide.*)
    blocks,
    functional,
    nn,
    optim,
    testing,
)
from .analyze import AnalysisReport, analyze
from .api import WideBuilder, compile, pack, stack, unpack, unstack
from .config import WideConfig
from .errors import (
    ArchitectureMismatchError,
    UnsupportedOperationError,
    ValidationError,
    WideCompileError,
)
from .model import WideModel
from .registry import register
from .router import Tower, WideRouter

__version__ = "0.1.0"

__all__ = [
    "AnalysisReport",
    "ArchitectureMismatchError",
    "Tower",
    "UnsupportedOperationError",
    "ValidationError",
    "WideBuilder",
    "WideCompileError",
    "WideConfig",
    "WideModel",
    "WideRouter",
    "analyze",
    "blocks",
    "compile",
    "functional",
    "nn",
    "optim",
    "pack",
    "register",
    "stack",
    "testing",
    "unpack",
    "unstack",
]
