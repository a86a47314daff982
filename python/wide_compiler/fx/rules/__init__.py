"""Widen rule families, one per file; importing this package fills ``widen.RULES``.

A new family is a new file here plus one import line below."""

from . import creation, linear, matmul, pointwise, reduction, registered, shape, spatial  # noqa: F401
from . import conv, embedding, norm, pooling  # noqa: F401  (vision and tabular ops)
