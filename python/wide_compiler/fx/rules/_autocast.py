"""ATen's autocast lists, read from the dispatcher, for the widen rules whose wide form is built of
ops that autocast treats otherwise than the member's op (Note [Autocast parity of widened ops] in
fx/rules/matmul.py). Not a rule-table module (hence the leading ``_``).

It also names the autocast policies a wide op follows. Each rules file that emits a wide op states
that op's policy beside its rule, in a module-level ``AUTOCAST = {"op name": POLICY}`` (Note [wide
autocast] in csrc/wide/ops/autocast.cpp implements them; tests/python/test_rule_coverage.py fails
for a wide op that no rules file states, and checks each statement against the dispatcher's
autocast registrations and the op's behaviour)."""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["listed", "AsATenOp", "NormResult", "at_least_float32", "POLICIES", "LOWER", "ACTIVATION",
           "FLOAT32_ON_CUDA", "BY_MODE", "NOT_CAST"]

# The autocast policies of the wide ops (Note [wide autocast]): what the op's autocast kernel does,
# following the ATen op it replaces.
LOWER = "lower precision"  # every floating argument cast to the autocast dtype (linear, conv, SDPA)
ACTIVATION = "activation dtype"  # ATen does not cast; computed in float32, returned in the input's dtype
FLOAT32_ON_CUDA = "activation dtype on CPU, float32 on CUDA"  # ATen's CUDA fp32 list (layer/group/rms norm)
# recurrent ops (Note [Recurrent ops under CPU autocast] in csrc/wide/ops/autocast.cpp)
BY_MODE = "lower precision; on CPU ATen's own op per member, but for an LSTM without projections"
NOT_CAST = "not cast"  # no autocast kernel: the op runs on its arguments as they are (embedding, layout)
POLICIES = (LOWER, ACTIVATION, FLOAT32_ON_CUDA, BY_MODE, NOT_CAST)

# the dispatch key of each device type's autocast
_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA", "xpu": "AutocastXPU", "mps": "AutocastMPS",
         "hpu": "AutocastHPU", "xla": "AutocastXLA", "mtia": "AutocastMTIA", "maia": "AutocastMAIA",
         "ipu": "AutocastIPU"}


@functools.cache
def autocast_ops(device_type: str) -> frozenset[str]:
    """The ops ATen's autocast casts on ``device_type`` (``"aten::mv"``, ``"aten::conv2d.padding"``):
    those with a kernel registered for the device's autocast dispatch key; every other op falls
    through it and runs on its arguments as they are."""
    key = _KEYS.get(device_type, "AutocastPrivateUse1")
    try:
        return frozenset(torch._C._dispatch_get_registrations_for_dispatch_key(key))
    except RuntimeError:  # a key this build does not know
        return frozenset()


def listed(op: str, device_type: str) -> bool:
    """Whether ATen's autocast on ``device_type`` casts the arguments of ``op`` (``"aten::mv"``)."""
    return op in autocast_ops(device_type)


def _eligible(t: Any, device: str) -> bool:
    """ATen's autocast casts a tensor that is floating, not float64, and on the device."""
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64 \
        and t.device.type == device


def _promote_type(args: tuple, device: str) -> torch.dtype:
    """The dtype ATen's "promote" policy casts ``args`` to (``at::autocast::promote_type``): from
    the autocast dtype, float32 as soon as a float32 argument (or two different lower ones) meet."""
    current = torch.get_autocast_dtype(device)
    for a in args:
        if _eligible(a, device) and a.dtype != current:
            current = torch.float32
    return current


class AsATenOp:
    """``fn`` (the wide form's op) run as ATen's autocast runs the member's op ``member_op``:
    where ATen's autocast for the arguments' device does not list ``member_op``, ``fn`` runs with
    that autocast off, on the arguments as they are; where it lists it with the ``policy`` the
    caller names (ATen's, for every device that lists the op), ``"lower"``: ``fn`` runs as it is
    (the caller's promise: autocast casts ``fn``'s arguments to lower precision too);
    ``"promote"``: the floating arguments are cast to their widest dtype and ``fn`` runs with
    autocast off."""

    def __init__(self, fn: Any, member_op: str, policy: str) -> None:
        if policy not in ("lower", "promote"):
            raise ValueError(f"AsATenOp: policy must be 'lower' or 'promote', got {policy!r}")
        self.fn, self.member_op, self.policy = fn, member_op, policy
        label = f"{getattr(fn, '__name__', 'op')}_as_{member_op}"
        self.__name__ = self.__qualname__ = "".join(c if c.isalnum() else "_" for c in label)
        self.__module__ = __name__

    def __call__(self, *args: Any) -> Any:
        device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), None)
        if device is None or not torch.is_autocast_enabled(device):
            return self.fn(*args)
        if listed(self.member_op, device):
            if self.policy == "lower":
                return self.fn(*args)
            to = _promote_type(args, device)
            args = tuple(a.to(to) if _eligible(a, device) else a for a in args)
        with torch.autocast(device, enabled=False):
            return self.fn(*args)

    def __repr__(self) -> str:
        return f"<{self.__name__} ({self.policy} where listed)>"


def at_least_float32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32 when it is a lower-precision float (a norm's compute dtype, as ATen's
    kernels compute), else as it is (float32, float64)."""
    return t.float() if t.is_floating_point() and t.element_size() < 4 else t


class NormResult:
    """A norm's result ``y`` (computed in float32 at least) in the dtype ATen gives the member's
    ``member_op`` on the input ``x``: float32 where the device's autocast is on and lists the op
    (its float32 policy: CUDA's ``layer_norm``/``rms_norm``), else ``x``'s dtype (ATen's CPU
    norms take a lower-precision input with float32 parameters and return the input's dtype)."""

    def __init__(self, member_op: str) -> None:
        self.member_op = member_op
        self.__name__ = self.__qualname__ = "norm_result_as_" + "".join(c if c.isalnum() else "_" for c in member_op)
        self.__module__ = __name__

    def __call__(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        listed_here = torch.is_autocast_enabled(device) and listed(self.member_op, device) and _eligible(x, device)
        dtype = torch.float32 if listed_here else x.dtype
        return y if y.dtype == dtype else y.to(dtype)

    def __repr__(self) -> str:
        return f"<{self.__name__}>"
