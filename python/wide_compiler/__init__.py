"""wide_compiler (bootstrap)."""
import torch
from . import _C  # noqa: F401  (registers torch.ops.wide)
