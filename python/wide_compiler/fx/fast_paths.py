"""torch's inference fast paths that a capture does not follow (probe 5 F20), warned about once.

Note [TransformerEncoder's nested-tensor fast path]
    In eval mode under ``torch.no_grad()`` (and ``torch.backends.mha.get_fastpath_enabled()``),
    ``nn.TransformerEncoder`` built with ``enable_nested_tensor=True`` (torch's default) and given a
    ``src_key_padding_mask`` runs its layers on a nested tensor of the valid positions and returns
    0.0 at every padded position. torch decides this at each call from global state; the capture
    traces the ordinary (slow) path, so the wide model returns the slow path's values at padded
    positions. Valid positions agree, as do all positions with gradients enabled or in training. A
    loss or a mean over every position (padded ones included) then differs from the member's. The
    warning is logged once per process; what to do: mask the padded positions of the output
    (``out.masked_fill(mask[..., None], 0)``), or build the encoder with
    ``enable_nested_tensor=False`` so the members run the slow path too.
"""

from __future__ import annotations

import logging

from torch import nn

__all__ = ["warn_nested_tensor_fast_path"]

log = logging.getLogger("wide_compiler")
_warned: list[bool] = []


def warn_nested_tensor_fast_path(model: nn.Module) -> None:
    """Log once (per process) where ``model`` holds an ``nn.TransformerEncoder`` that may take
    torch's nested-tensor fast path (Note [TransformerEncoder's nested-tensor fast path]).

    >>> warn_nested_tensor_fast_path(nn.Linear(2, 2))  # nothing to say
    """
    if _warned:
        return
    for path, m in model.named_modules():
        if isinstance(m, nn.TransformerEncoder) and getattr(m, "use_nested_tensor", False):
            _warned.append(True)
            log.warning(
                "wide_compiler: the members' %s is an nn.TransformerEncoder with enable_nested_tensor=True: "
                "in eval under torch.no_grad() with a src_key_padding_mask, each member alone takes torch's "
                "nested-tensor fast path and returns 0.0 at padded positions, where the wide model returns "
                "the ordinary path's values (valid positions agree). Mask padded positions of the output, or "
                "build the encoder with enable_nested_tensor=False (Note [TransformerEncoder's nested-tensor "
                "fast path] in wide_compiler/fx/fast_paths.py)", path or "model")
            return
