"""wide_compiler: run N models of one architecture as ONE wide model.

>>> import torch, wide_compiler as wc
>>> models = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
...           for _ in range(4)]
>>> wide = wc.compile(models, torch.randn(3, 8))
>>> wide(torch.randn(4, 3, 8)).shape
torch.Size([4, 3, 2])
"""

import os as _os

import torch  # noqa: F401  (loads libtorch before our core library)

from . import (
    _C,  # noqa: F401  (loads libwide: registers torch.ops.wide.*)
    amp,
    blocks,
    distributed,
    functional,
    nn,
    optim,
    testing,
)
from . import allocator
from .allocator import tune_cpu_allocator
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
from .padded import PaddedWideModel
from .registry import register
from .router import Tower, WideRouter

from ._version import __version__  # the one source of the version (pyproject.toml reads it too)

#: The CMake prefix of the installed C++ package (headers, libwide, WideCompilerConfig.cmake), for
#: ``cmake -DCMAKE_PREFIX_PATH=...`` and ``find_package(WideCompiler)``; like
#: ``torch.utils.cmake_prefix_path``, which it finds by itself (README: "The C++ API").
cmake_prefix_path = _os.path.join(_os.path.dirname(_C.__file__), "share", "cmake")

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
    "PaddedWideModel",
    "WideRouter",
    "allocator",
    "amp",
    "analyze",
    "blocks",
    "cmake_prefix_path",
    "compile",
    "distributed",
    "functional",
    "nn",
    "optim",
    "pack",
    "register",
    "stack",
    "testing",
    "tune_cpu_allocator",
    "unpack",
    "unstack",
]
