"""The fixed tolerances: per dtype and kind of result, the ``rtol``/``atol`` within which a wide
result must match its member's (justified in :mod:`wide_compiler.testing`'s docstring,
"Tolerances"). Integer and bool results are exact."""

from __future__ import annotations

import torch

__all__ = ["TOLERANCES", "tolerance"]


KINDS = ("output", "grad", "buffer")


def _by_kind(output: float, grad_rtol: float, grad_atol: float) -> dict[str, dict[str, float]]:
    """One dtype's row of TOLERANCES: outputs and buffers within rtol = atol = ``output``,
    gradients within their own rtol/atol."""
    return {"output": {"rtol": output, "atol": output},
            "grad": {"rtol": grad_rtol, "atol": grad_atol},
            "buffer": {"rtol": output, "atol": output}}


# dtype -> kind -> rtol/atol. The justification is wide_compiler.testing's docstring ("Tolerances").
TOLERANCES: dict[torch.dtype, dict[str, dict[str, float]]] = {
    torch.float32: _by_kind(1e-5, grad_rtol=1e-5, grad_atol=1e-4),
    torch.float64: _by_kind(1e-10, grad_rtol=1e-10, grad_atol=1e-10),
    torch.bfloat16: _by_kind(1.6e-2, grad_rtol=3.2e-2, grad_atol=3.2e-2),
    torch.float16: _by_kind(2e-3, grad_rtol=4e-3, grad_atol=4e-3),
}


_EXACT = {"rtol": 0.0, "atol": 0.0}
_REAL_OF_COMPLEX = {torch.complex64: torch.float32, torch.complex128: torch.float64,
                    torch.complex32: torch.float16}


def tolerance(dtype: torch.dtype, kind: str = "output") -> dict[str, float]:
    """``dict(rtol=, atol=)`` for comparing a wide result with its members in ``dtype``.

    ``kind``: ``"output"`` (forward outputs), ``"grad"`` (input and parameter gradients) or
    ``"buffer"`` (buffers after a call: running statistics). Integer and bool dtypes are exact;
    complex dtypes use their real dtype's tolerance; other floating dtypes (float8) use
    bfloat16's.

    >>> import torch
    >>> from wide_compiler.testing import tolerance
    >>> tolerance(torch.float32)
    {'rtol': 1e-05, 'atol': 1e-05}
    >>> tolerance(torch.float32, "grad")
    {'rtol': 1e-05, 'atol': 0.0001}
    >>> tolerance(torch.int64)
    {'rtol': 0.0, 'atol': 0.0}
    """
    if kind not in KINDS:
        raise ValueError(f"wide_compiler.testing.tolerance: kind must be one of {KINDS}, got {kind!r}")
    dtype = _REAL_OF_COMPLEX.get(dtype, dtype)
    if not dtype.is_floating_point:
        return dict(_EXACT)
    return dict(TOLERANCES.get(dtype, TOLERANCES[torch.bfloat16])[kind])


def _tol_for(t: torch.Tensor, dtype: torch.dtype | None, kind: str) -> dict[str, float]:
    """The looser of the tolerances of the compute dtype ``dtype`` and of ``t``'s own dtype (a
    float32 model may return a float64 sum of float32 values: float32 rounding applies)."""
    own = tolerance(t.dtype, kind)
    if dtype is None or not (t.is_floating_point() or t.is_complex()):
        return own
    other = tolerance(dtype, kind)
    return {k: max(own[k], other[k]) for k in own}

