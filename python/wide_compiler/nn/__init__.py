"""Wide modules for people who build wide models by hand; ``compile()`` uses the same ops."""

from .linear import WideLinear

__all__ = ["WideLinear"]
