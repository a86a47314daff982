"""Exceptions raised by wide_compiler. Every message says what was expected, what was found, and
where (member index, graph node, module path, source line)."""

__all__ = [
    "ArchitectureMismatchError",
    "UnsupportedOperationError",
    "ValidationError",
    "WideCompileError",
]


class WideCompileError(RuntimeError):
    """A model could not be turned into a wide model."""


class ArchitectureMismatchError(ValueError):
    """Members are not the same program: module tree, types, hyperparameters, parameter shapes,
    dtypes, devices or constants differ. The message names the member and the first difference,
    e.g. ``member 3: fc1.out_features is 256, member 0 has 128``."""


class UnsupportedOperationError(WideCompileError):
    """An operation of the captured graph has no wide form (yet). The message names the ATen op,
    the graph node, the module path and the user's source line."""


class ValidationError(WideCompileError):
    """``validate=True`` found a member whose wide output differs from its own model's."""
