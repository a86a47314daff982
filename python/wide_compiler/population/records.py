"""What a population's members report: the per-member metrics a ``train_step`` returns, as floats,
and the members' records (the best one among them)."""

from __future__ import annotations

import copy
import hashlib
import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch

__all__: list[str] = []


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _sort_key(v: Any, mode: str) -> float:
    """Smaller is better, whatever the mode; NaN and missing values are the worst."""
    if not _finite(v):
        return math.inf
    return v if mode == "min" else -v


def _member_record(s: Mapping[str, Any], i: int, status: str) -> dict[str, Any]:
    """Slot ``i``'s member record; ``s``: a Population's ``vars()`` or its ``state_dict()``."""
    return {"id": s["member_ids"][i], "slot": i, "config": copy.deepcopy(s["configs"][i]),
            "seed": s["seeds"][i], "iterations": s["ages"][i], "status": status,
            "value": s["last"][i].get(s["metric"]), "metrics": dict(s["last"][i])}


def _best_of(s: Mapping[str, Any]) -> dict[str, Any] | None:
    """The best of the best finished member and the running members with a result (None if
    none has one); ``s``: a Population's ``vars()`` or its ``state_dict()``."""
    cands = [] if s["best"] is None else [s["best"]]
    cands += [_member_record(s, i, "running") for i in range(s["n"])
              if s["active"][i] and s["last"][i].get(s["metric"]) is not None]
    return min(cands, key=lambda r: _sort_key(r["value"], s["mode"]), default=None)


def _seed_of(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "little")


def _metric_number(name: str, k: int, v: Any, n: int) -> float:
    """Member ``k``'s value of metric ``name`` as a float; ``TypeError`` for anything but a real
    number (an int, a float, a bool, a numpy number, a one-element real tensor)."""
    if isinstance(v, torch.Tensor) and v.numel() == 1 and not v.is_complex():
        return float(v.detach().reshape(()).item())
    if isinstance(v, numbers.Real) and not isinstance(v, (str, bytes)):
        return float(v)
    if type(v).__module__ == "numpy" and getattr(v, "ndim", None) == 0 and v.dtype.kind in "biuf":
        return float(v)                                       # numpy bools, 0-d arrays
    text = repr(v)
    text = text if len(text) <= 40 else text[:37] + "..."
    raise TypeError(f"wide_compiler.integrations.ray: train_step returned metric {name!r} with a "
                    f"{type(v).__name__} ({text}) for member {k}; expected one real number per "
                    f"member ({n}: a tensor [N] or a list of N ints/floats)")


def _per_member(name: str, value: Any, n: int) -> list[float]:
    """Metric ``name`` as ``n`` floats, one per member: from a real tensor with ``n`` elements or
    a sequence of ``n`` real numbers. ``TypeError`` for other types (strings included, which
    would otherwise be read character by character), ``ValueError`` for another count."""
    where = f"wide_compiler.integrations.ray: train_step returned metric {name!r}"
    if isinstance(value, torch.Tensor):
        if value.is_complex():
            raise TypeError(f"{where} as a complex tensor ({value.dtype}); expected real values, "
                            f"one per member ({n})")
        values = value.detach().to("cpu", torch.float64).reshape(-1).tolist()
    elif isinstance(value, numbers.Number) or getattr(value, "ndim", None) == 0:
        raise ValueError(f"{where} = {value!r}, one number; expected one value per member ({n} "
                         f"values: a tensor [N] or a list)")
    elif isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__iter__"):
        text = repr(value)
        text = text if len(text) <= 40 else text[:37] + "..."
        raise TypeError(f"{where} as a {type(value).__name__} ({text}); expected one real number "
                        f"per member ({n}): a tensor [N] or a list of N ints/floats")
    else:
        values = [_metric_number(name, k, v, n) for k, v in enumerate(value)]
    if len(values) != n:
        raise ValueError(f"wide_compiler.integrations.ray: train_step returned {len(values)} values "
                         f"for {name!r}; expected one per member ({n})")
    return values

