"""Widen rule families, one per file; importing this package fills ``widen.RULES``.

A new family is a new file here plus one import line below."""

from . import (  # noqa: F401  # noqa: F401  (vision and tabular ops)
    conv,
    creation,
    embedding,
    linear,
    matmul,
    norm,
    pointwise,
    pooling,
    reduction,
    registered,
    shape,
    spatial,
)
