"""WideMultiheadAttention: N ``nn.MultiheadAttention`` as one module. The projections run on
``torch.ops.wide.linear``; attention is ONE SDPA (or, for the weights, one batched matmul/softmax)
with the member dim folded into the batch: ``[N, B, H, L, hd] -> [N*B, H, L, hd]``."""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .. import functional as WF
from ._common import check_members, check_strategy, stack_param, unstack_member
from .linear import WideLinear

__all__ = ["WideMultiheadAttention"]

_TENSORS = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias", "bias_k",
            "bias_v", "out_proj.weight", "out_proj.bias")
_ATTRS = ("embed_dim", "kdim", "vdim", "num_heads", "head_dim", "dropout", "batch_first", "add_zero_attn",
          "_qkv_same_embed_dim")


class WideMultiheadAttention(nn.Module):
    """N ``nn.MultiheadAttention`` (every option: kdim/vdim, bias, add_bias_kv, add_zero_attn,
    dropout, batch_first) evaluated as one attention over ``N*B`` sequences.

    ``forward(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
    average_attn_weights=True, is_causal=False)`` is the member's with a leading member dim:

    * ``query`` ``[N, B, L, E]`` if ``batch_first`` else ``[N, L, B, E]``; unbatched members
      ``[N, L, E]``; ``key``/``value`` likewise (a shared input is ``x.expand(N, ...)``; passing the
      same tensor as query, key and value takes the packed self-attention projection, as torch).
    * ``key_padding_mask``: per member ``[N, B, S]`` (unbatched ``[N, S]``), or one shared by all
      members in the member's shape ``[B, S]`` (``[S]``); bool (True = ignore) or float (added).
    * ``attn_mask``: shared ``[L, S]``; per member ``[N, L, S]`` or ``[N, 1, L, S]``; or per member
      in the member's 3-D form ``[N, B*num_heads, L, S]`` (unbatched ``[N, num_heads, L, S]``;
      expand a shared 3-D mask to this). A member's own 3-D form ``[B*num_heads, L, S]`` is NOT
      accepted unexpanded: a 3-D mask is read as per member, and refused as ambiguous when N
      equals ``B*num_heads``. Bool or float, as the member's.
    * ``is_causal``: a hint that ``attn_mask`` is causal, exactly as the member treats it.

    Returns ``(attn_output, attn_weights)`` N-first as each member returns them: output in the
    query's layout, weights ``[N, B, L, S]`` (``[N, B, H, L, S]`` with
    ``average_attn_weights=False``; no B for unbatched members) or None when ``need_weights`` is
    False. Dropout (training only) draws independently for every member. ``strategy`` is the
    ``wide::linear`` strategy of the projections: ``"auto"``, ``"bmm"``, ``"bmm_t"`` or ``"loop"``.

    Example:
        >>> import torch, wide_compiler as wc
        >>> mhas = [torch.nn.MultiheadAttention(8, 2, batch_first=True) for _ in range(3)]
        >>> wide = wc.nn.WideMultiheadAttention.from_modules(mhas)
        >>> x = torch.randn(3, 4, 5, 8)                              # [N, B, L, E]
        >>> out, w = wide(x, x, x)
        >>> out.shape, w.shape
        (torch.Size([3, 4, 5, 8]), torch.Size([3, 4, 5, 5]))
        >>> ref_out, ref_w = mhas[1](x[1], x[1], x[1])
        >>> torch.allclose(out[1], ref_out, atol=1e-5), torch.allclose(w[1], ref_w, atol=1e-6)
        (True, True)
        >>> torch.equal(wide.unfuse()[2].in_proj_weight, mhas[2].in_proj_weight)
        True
    """

    STRATEGIES = WideLinear.STRATEGIES  # the projections run on wide::linear

    def __init__(self, n: int, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: int | None = None,
                 vdim: int | None = None, batch_first: bool = False, *, strategy: str = "auto", device=None,
                 dtype=None) -> None:
        super().__init__()
        check_strategy(self, strategy)
        if n < 1:
            raise ValueError(f"WideMultiheadAttention: expected n >= 1 members, got {n}")
        self._load([nn.MultiheadAttention(embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim, vdim,
                                          batch_first, device=device, dtype=dtype) for _ in range(n)], strategy)

    def _load(self, members: Sequence[nn.MultiheadAttention], strategy: str) -> None:
        t = members[0]
        self.n, self.strategy = len(members), strategy
        for a in _ATTRS:
            setattr(self, a, getattr(t, a))
        object.__setattr__(self, "_template", copy.deepcopy(t).to("meta"))  # hyperparameters, for unfuse
        for name in t._parameters:  # the member's names and order (None where unused)
            self.register_parameter(name, stack_param(members, name))
        if "bias_k" not in t._parameters:
            self.bias_k = self.bias_v = None
        self.out_proj = WideLinear.from_modules([m.out_proj for m in members], strategy=strategy)
        self.train(t.training)

    @classmethod
    def from_modules(cls, modules: Sequence[nn.MultiheadAttention], *,
                     strategy: str = "auto") -> WideMultiheadAttention:
        """Stack N ``nn.MultiheadAttention`` of one configuration (weights copied)."""
        check_strategy(cls, strategy)
        modules = check_members(modules, nn.MultiheadAttention, _ATTRS + _TENSORS + ("training",), cls.__name__)
        t = modules[0]
        wide = cls(len(modules), t.embed_dim, t.num_heads, t.dropout, t.in_proj_bias is not None, t.bias_k is not None,
                   t.add_zero_attn, t.kdim, t.vdim, t.batch_first, strategy=strategy, device="meta")
        wide._load(modules, strategy)
        return wide

    def unfuse(self) -> list[nn.MultiheadAttention]:
        """N ordinary ``nn.MultiheadAttention`` holding copies of the members' weights."""
        ref = self.out_proj.weight
        names = [name for name, _ in self._template.named_parameters()]
        out = []
        for i in range(self.n):
            m = copy.deepcopy(self._template).to_empty(device=ref.device).to(ref.dtype)
            unstack_member(m, self, i, names)
            out.append(m.train(self.training))
        return out

    def _mask(self, mask: torch.Tensor, forms: dict, what: str) -> torch.Tensor:
        """``mask`` as a ``[N|1, B|1, H|1, L|1, S]`` tensor, from the first of ``forms`` (accepted
        shape -> shape to view it as) its shape matches; a ValueError listing them otherwise."""
        for shape, as5 in forms.items():
            if tuple(mask.shape) == shape:
                return mask.reshape(as5)
        raise ValueError(f"WideMultiheadAttention: expected {what} of shape "
                         f"{' or '.join(str(list(s)) for s in forms)}, got {list(mask.shape)}")

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        n, h, hd, e = self.n, self.num_heads, self.head_dim, self.embed_dim
        batched = query.dim() == 4
        layout = ("[N, B, L, E]" if self.batch_first else "[N, L, B, E]") if batched else "[N, L, E]"
        for what, t, f in (("query", query, e), ("key", key, self.kdim), ("value", value, self.vdim)):
            if t.dim() != (4 if batched else 3) or t.shape[0] != n or t.shape[-1] != f:
                raise ValueError(f"WideMultiheadAttention: expected an N-first {what} {layout} (N={n} members, "
                                 f"{f} features; query of 4 dims, or 3 for unbatched members), got "
                                 f"{list(t.shape)} with query {list(query.shape)}")
        self_attn, kv_same = query is key and key is value, key is value

        def batch_first(t: torch.Tensor) -> torch.Tensor:  # -> [N, B, L, E]
            return (t if self.batch_first else t.transpose(1, 2)) if batched else t.unsqueeze(1)

        q, k, v = batch_first(query), batch_first(key), batch_first(value)
        b, l, s = q.shape[1], q.shape[2], k.shape[2]
        if k.shape[1] != b or v.shape[1:3] != k.shape[1:3]:
            raise ValueError(f"WideMultiheadAttention: key and value must share one batch size (the query's) and "
                             f"one sequence length; got query {list(query.shape)}, key {list(key.shape)}, value "
                             f"{list(value.shape)} ({layout})")

        # Masks exactly as the member reads them (F.multi_head_attention_forward), N-first.
        kpm = F._canonical_mask(mask=key_padding_mask, mask_name="key_padding_mask",
                                other_type=F._none_or_dtype(attn_mask), other_name="attn_mask",
                                target_type=query.dtype)
        if is_causal and attn_mask is None:
            raise RuntimeError("WideMultiheadAttention: need attn_mask if specifying the is_causal hint "
                               "(as nn.MultiheadAttention)")
        if is_causal and kpm is None and not need_weights:
            attn_mask = None  # SDPA's own causal mask
        else:
            attn_mask = F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="",
                                          target_type=query.dtype, check_other=False)
            is_causal = is_causal and kpm is None
        mask = None
        if attn_mask is not None:
            if attn_mask.dim() == 3 and n > 1 and attn_mask.shape[0] == n == b * h:
                raise ValueError(
                    f"WideMultiheadAttention: a 3-D attn_mask of {n} = N = batch*num_heads masks is ambiguous "
                    f"(per member [N, L, S], or one member's [B*num_heads, L, S]); pass a per-member mask as "
                    f"[N, 1, L, S], or a member's 3-D mask expanded to [N, B*num_heads, L, S]")
            mask = self._mask(attn_mask, {(l, s): (1, 1, 1, l, s), (n, l, s): (n, 1, 1, l, s),
                                          (n, 1, l, s): (n, 1, 1, l, s), (n, b * h, l, s): (n, b, h, l, s)},
                              "attn_mask")
        if kpm is not None:
            member = (b, s) if batched else (s,)
            kpm = self._mask(kpm, {member: (1, b, 1, 1, s), (n, *member): (n, b, 1, 1, s)}, "key_padding_mask")

        # Projections (wide::linear), with torch's packing of the in-projection.
        lin = lambda x, w, bias: WF.linear(x, w, bias, strategy=self.strategy)
        w, bias = self.in_proj_weight, self.in_proj_bias
        bq, bk, bv = (None,) * 3 if bias is None else bias.chunk(3, dim=-1)
        if not self._qkv_same_embed_dim:
            q, k, v = lin(q, self.q_proj_weight, bq), lin(k, self.k_proj_weight, bk), lin(v, self.v_proj_weight, bv)
        elif self_attn:
            q, k, v = lin(q, w, bias).chunk(3, dim=-1)
        elif kv_same:
            q = lin(q, w[:, :e], bq)
            k, v = lin(k, w[:, e:], None if bias is None else bias[:, e:]).chunk(2, dim=-1)
        else:
            wq, wk, wv = w.chunk(3, dim=1)
            q, k, v = lin(q, wq, bq), lin(k, wk, bk), lin(v, wv, bv)
        extra = 0
        if self.bias_k is not None:
            k = torch.cat([k, self.bias_k.expand(n, b, 1, e)], dim=2)
            v = torch.cat([v, self.bias_v.expand(n, b, 1, e)], dim=2)
            extra += 1

        def heads(t: torch.Tensor) -> torch.Tensor:  # [N, B, S, E] -> [N*B, H, S, hd]
            return t.unflatten(-1, (h, hd)).transpose(2, 3).flatten(0, 1)

        q, k, v = heads(q), heads(k), heads(v)
        if self.add_zero_attn:
            zeros = k.new_zeros(n * b, h, 1, hd)
            k, v = torch.cat([k, zeros], dim=2), torch.cat([v, zeros], dim=2)
            extra += 1
        mask, kpm = ((None if m is None else F.pad(m, (0, extra))) for m in (mask, kpm))
        if kpm is not None:
            mask = kpm if mask is None else mask + kpm
        if mask is not None:  # fold the member dim into the batch: [N*B|1, H|1, L|1, S]
            mask = mask[0] if mask.shape[:2] == (1, 1) else mask.expand(n, b, *mask.shape[2:]).flatten(0, 1)

        p = self.dropout if self.training else 0.0
        weights = None
        if need_weights:
            scores = (q * math.sqrt(1.0 / hd)) @ k.transpose(-2, -1)
            # The mask in the scores' dtype, as torch's baddbmm(mask, q, k^T) adds it (under autocast
            # the scores are lower precision and the weights stay so).
            weights = torch.softmax(scores if mask is None else scores + mask.to(scores.dtype), dim=-1)
            if p > 0.0:
                weights = F.dropout(weights, p)
            out = weights @ v
            weights = weights.unflatten(0, (n, b))
            weights = weights.mean(dim=2) if average_attn_weights else weights
            weights = weights if batched else weights.squeeze(1)
        else:
            out = torch.ops.wide.attention(q, k, v, mask, p, is_causal)  # SDPA; small-sequence kernel without grad
        out = self.out_proj(out.transpose(1, 2).reshape(n, b, l, e))
        if not batched:
            return out.squeeze(1), weights
        return (out if self.batch_first else out.transpose(1, 2)), weights

    def extra_repr(self) -> str:
        t = self._template
        return (f"n={self.n}, embed_dim={self.embed_dim}, num_heads={self.num_heads}, dropout={self.dropout}, "
                f"bias={self.in_proj_bias is not None}, add_bias_kv={self.bias_k is not None}, "
                f"add_zero_attn={self.add_zero_attn}, kdim={t.kdim}, vdim={t.vdim}, batch_first={self.batch_first}, "
                f"strategy={self.strategy!r}")
