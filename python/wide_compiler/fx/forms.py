"""Capture forms: equivalent forwards of PyTorch modules whose own forward captures into a graph
that widens badly. Applied to the capture template only (a copy; the user's modules are never
touched), before ``torch.export``. When to write one: Note [Capture special cases] in capture.py.

Note [Batch-first self-attention capture form]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``nn.MultiheadAttention`` computes in sequence-first layout ``[T, B, E]`` (a batch-first input is
transposed first) and splits the packed in-projection with ``unflatten/unsqueeze/transpose/
squeeze/contiguous`` and per-head ``view/transpose`` steps. Widened, the member's batch is dim 1
or 2 of an N-first tensor, and every one of those steps becomes a copy of the wide activation:
six per call for an encoder layer, more time than the attention itself. For plain self-attention
(query, key and value the same tensor, no masks, no attention weights asked for, the packed
projection, no bias_k/bias_v or zero attention) the same math in batch-first layout is
``linear -> unflatten -> permute -> SDPA -> transpose -> linear``: with N folded into the batch
the only copy left is the one the member pays too (heads back into the embedding). Every other
call falls through to ``nn.MultiheadAttention.forward`` itself, so the form is exact by
construction; ``TransformerEncoderLayer``/``DecoderLayer`` self-attention takes the fast form.

Note [Attention weights with dropout in training]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With ``need_weights=True`` (the default of ``mha(x, x, x)``) torch computes the weights itself and
drops them only ``if dropout_p > 0.0``: a member with ``dropout=0.0`` traces a program without the
dropout node, one with ``dropout=0.1`` a program with it, so a dropout sweep that includes 0 could
not be proved one program (Note [Per-member constants] in fx/constants.py). In training, the form
computes plain self-attention's weights in batch-first layout (``softmax(q / sqrt(head_dim) @
k^T)``, as torch does) and always calls ``F.dropout(weights, self.dropout)``; ATen's dropout with
``p = 0`` returns its input, so a member's values are torch's for every rate, and every rate
traces the same program (its ``p`` a per-member argument of ``aten.dropout``). The returned
weights are the dropped ones, averaged over heads when ``average_attn_weights``, as torch returns
them. Eval keeps torch's own forward for these calls.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["apply_capture_forms"]


class _SelfAttentionForm(nn.MultiheadAttention):
    """``nn.MultiheadAttention`` with a batch-first forward for plain self-attention; see Note
    [Batch-first self-attention capture form]. Only ever made by swapping ``__class__``."""

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        # need_weights: in training only (Note [Attention weights with dropout in training])
        if not (query is key and key is value and (not need_weights or self.training) and key_padding_mask is None
                and attn_mask is None and not is_causal and query.dim() == 3):
            return super().forward(query, key, value, key_padding_mask, need_weights, attn_mask,
                                   average_attn_weights, is_causal)
        x = query if self.batch_first else query.transpose(0, 1)  # [B, T, E]
        qkv = F.linear(x, self.in_proj_weight, self.in_proj_bias)
        q, k, v = qkv.unflatten(-1, (3, self.num_heads, self.head_dim)).permute(2, 0, 3, 1, 4).unbind(0)
        weights = None
        if need_weights:
            weights = torch.matmul(q * math.sqrt(1.0 / self.head_dim), k.transpose(-2, -1)).softmax(-1)
            weights = F.dropout(weights, p=self.dropout)  # always: Note [Attention weights with dropout in training]
            out = torch.matmul(weights, v)
            if average_attn_weights:
                weights = weights.mean(dim=1)
        else:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        out = F.linear(out.transpose(1, 2).flatten(2), self.out_proj.weight, self.out_proj.bias)
        return (out if self.batch_first else out.transpose(0, 1)), weights


def _eligible(m: nn.Module) -> bool:
    return (type(m) is nn.MultiheadAttention and m._qkv_same_embed_dim and m.bias_k is None
            and not m.add_zero_attn)


def apply_capture_forms(model: nn.Module) -> nn.Module:
    """Swap, IN PLACE, the class of every eligible submodule of ``model`` (a copy made for
    capture) for its capture form; returns ``model``. Parameters, buffers and names are kept."""
    for m in model.modules():
        if _eligible(m):
            m.__class__ = _SelfAttentionForm
    return model
