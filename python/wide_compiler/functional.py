"""Functional wide ops: ``torch.nn.functional`` for N members at once.

Every function takes N-first activations ``[N, B, ...]`` (a shared input is ``x.expand(N, ...)``)
and stacked per-member parameters ``[N, ...]``, returns N-first results, and calls
``torch.ops.wide.*``. This is the one place where each op's arguments are normalised
(``padding='same'``, padding modes, unbatched members, BatchNorm's ``momentum=None``, embedding
bag modes): the hand-built modules of :mod:`wide_compiler.nn` call these functions (each call,
and its backward pass, in the wide caching allocator: :func:`wide_compiler.allocator.cached`), and the widen
rules (fx/rules/) use the same argument helpers when they rewrite a captured graph. What each
op's ``strategy`` accepts (and its layouts) is described once in :mod:`wide_compiler.ops`.

Example:
    >>> import torch
    >>> import wide_compiler.functional as WF
    >>> convs = [torch.nn.Conv2d(3, 4, 3, padding="same") for _ in range(2)]
    >>> w, b = torch.stack([c.weight for c in convs]), torch.stack([c.bias for c in convs])
    >>> x = torch.randn(2, 5, 3, 8, 8)
    >>> y = WF.conv(x, w, b, padding="same")
    >>> torch.allclose(y[1], convs[1](x[1]), atol=1e-5)
    True
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn import functional as F

from .allocator import cached

__all__ = ["EMBEDDING_BAG_MODES", "batch_norm", "batch_norm_factor", "conv", "conv_padding", "conv_transpose",
           "embedding", "embedding_bag", "group_norm", "instance_norm", "layer_norm", "linear", "prelu",
           "rms_norm", "rnn", "rnn_cell", "same_padding", "spatial_list"]

wide = torch.ops.wide
EMBEDDING_BAG_MODES = {"sum": 0, "mean": 1, "max": 2}


# --- argument helpers (shared with the widen rules) ------------------------------------------
def spatial_list(v: int | Sequence[int], d: int) -> list:
    """An int or a 1- or d-element list as a d-element list."""
    if isinstance(v, (list, tuple)):
        v = list(v)
        return v * d if len(v) == 1 else v
    return [v] * d


def same_padding(kernel: Sequence[int], dilation: Sequence[int], stride: Sequence[int]) -> list[int]:
    """padding='same' as one value per dim, or (left, right) per dim in F.pad order (last dim
    first) when some total padding is odd (even kernels): the extra pad goes right, as in ATen."""
    if any(s != 1 for s in stride):
        raise ValueError("padding='same' is not supported for strided convolutions")
    totals = [dl * (k - 1) for k, dl in zip(kernel, dilation)]
    if all(t % 2 == 0 for t in totals):
        return [t // 2 for t in totals]
    out: list[int] = []
    for t in reversed(totals):
        out += [t // 2, t - t // 2]
    return out


def conv_padding(padding: str | int | Sequence[int], kernel: Sequence[int], dilation: int | Sequence[int],
                 stride: int | Sequence[int]) -> list[int]:
    """A convolution's ``padding`` (int, list, ``'valid'`` or ``'same'``) as the explicit list
    ``wide.conv`` takes."""
    d = len(kernel)
    if not isinstance(padding, str):
        return spatial_list(padding, d)
    if padding == "valid":
        return [0] * d
    if padding == "same":
        return same_padding(list(kernel), spatial_list(dilation, d), spatial_list(stride, d))
    raise ValueError(f"unknown padding {padding!r}; expected an int, a list, 'valid' or 'same'")


def batch_norm_factor(momentum: float | None, num_batches_tracked: torch.Tensor | None) -> float:
    """The running-stat update factor of a BatchNorm step (after ``num_batches_tracked`` was
    incremented): ``momentum``, or ``1/num_batches_tracked`` for a cumulative average
    (``momentum=None``), which needs every member to have seen as many batches."""
    if momentum is not None:
        return momentum
    if num_batches_tracked is None:
        return 0.0
    if not bool((num_batches_tracked == num_batches_tracked[0]).all()):
        raise ValueError("batch_norm: momentum=None (cumulative average) needs every member to have seen "
                         f"the same number of batches, got {num_batches_tracked.tolist()}")
    return 1.0 / float(num_batches_tracked[0])


def _batched(x: torch.Tensor, d: int, what: str) -> tuple[torch.Tensor, bool]:
    """A member input of ``d + 1`` dims (unbatched) gets a batch dim of 1; ``d + 2`` is batched."""
    if x.dim() not in (d + 2, d + 3):
        raise ValueError(f"{what}: expected N-first input [N, B, C, *] with {d + 3} dims "
                         f"(or {d + 2} for unbatched members), got {list(x.shape)}")
    unbatched = x.dim() == d + 2
    return (x.unsqueeze(1) if unbatched else x), unbatched


def _nfirst(y: torch.Tensor, n: int, unbatched: bool = False) -> torch.Tensor:
    out = wide.to_nfirst(y, n)
    return out.squeeze(1) if unbatched else out


# --- ops -------------------------------------------------------------------------------------
@cached
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           strategy: str = "auto") -> torch.Tensor:
    """N ``F.linear``: ``x [N, B, *, in]``, ``weight [N, out, in]``, ``bias [N, out]``."""
    return wide.linear(x, weight, bias, strategy=strategy)


@cached
def conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         stride: int | Sequence[int] = 1, padding: str | int | Sequence[int] = 0,
         dilation: int | Sequence[int] = 1, groups: int = 1, *, padding_mode: str = "zeros",
         strategy: str = "auto") -> torch.Tensor:
    """N ``F.conv{1,2,3}d`` (the dimension is the weight's); ``padding_mode`` as ``nn.Conv*``."""
    n, d = weight.shape[0], weight.dim() - 3
    x, unbatched = _batched(x, d, "wide conv")
    kernel = list(weight.shape[3:])
    if padding_mode != "zeros":
        pads = conv_padding(padding, kernel, dilation, stride)
        pads = pads if len(pads) == 2 * d else [p for v in reversed(pads) for p in (v, v)]
        x = F.pad(x.flatten(0, 1), pads, mode=padding_mode).unflatten(0, (n, -1))
        padding = 0
    y = wide.conv(x, weight, bias, spatial_list(stride, d), conv_padding(padding, kernel, dilation, stride),
                  spatial_list(dilation, d), groups, strategy=strategy)
    return _nfirst(y, n, unbatched)


@cached
def conv_transpose(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   stride: int | Sequence[int] = 1, padding: int | Sequence[int] = 0,
                   output_padding: int | Sequence[int] = 0, groups: int = 1,
                   dilation: int | Sequence[int] = 1, *, strategy: str = "auto") -> torch.Tensor:
    """N ``F.conv_transpose{1,2,3}d``."""
    n, d = weight.shape[0], weight.dim() - 3
    x, unbatched = _batched(x, d, "wide conv_transpose")
    y = wide.conv_transpose(x, weight, bias, spatial_list(stride, d), spatial_list(padding, d),
                            spatial_list(output_padding, d), groups, spatial_list(dilation, d), strategy=strategy)
    return _nfirst(y, n, unbatched)


@cached
def batch_norm(x: torch.Tensor, running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
               weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, training: bool = False,
               momentum: float = 0.1, eps: float = 1e-5) -> torch.Tensor:
    """N ``F.batch_norm`` over ``[N, B, C, *]``; running stats ``[N, C]`` updated in place."""
    y = wide.batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps)
    return _nfirst(y, x.shape[0])


@cached
def instance_norm(x: torch.Tensor, running_mean: torch.Tensor | None = None,
                  running_var: torch.Tensor | None = None, weight: torch.Tensor | None = None,
                  bias: torch.Tensor | None = None, use_input_stats: bool = True, momentum: float = 0.1,
                  eps: float = 1e-5, *, spatial: int | None = None) -> torch.Tensor:
    """N ``F.instance_norm``; ``spatial`` (the module's 1/2/3) also accepts unbatched members."""
    n = x.shape[0]
    x, unbatched = _batched(x, spatial, "wide instance_norm") if spatial is not None else (x, False)
    y = wide.instance_norm(x, weight, bias, running_mean, running_var, use_input_stats, momentum, eps)
    return _nfirst(y, n, unbatched)


@cached
def group_norm(x: torch.Tensor, num_groups: int, weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """N ``F.group_norm`` (num_groups per member) over ``[N, B, C, *]``, N-first in and out."""
    return wide.group_norm_nfirst(x, num_groups, weight, bias, eps)


@cached
def layer_norm(x: torch.Tensor, normalized_shape: Sequence[int], weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float = 1e-5, *, strategy: str = "auto") -> torch.Tensor:
    """N ``F.layer_norm``; ``weight``/``bias`` ``[N, *normalized_shape]``."""
    return wide.layer_norm(x, list(normalized_shape), weight, bias, eps, strategy=strategy)


@cached
def rms_norm(x: torch.Tensor, normalized_shape: Sequence[int], weight: torch.Tensor | None = None,
             eps: float | None = None) -> torch.Tensor:
    """N ``F.rms_norm``."""
    return wide.rms_norm(x, list(normalized_shape), weight, eps)


@cached
def prelu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """N ``F.prelu``: ``weight [N, 1]`` or ``[N, C]``; a 1-d member input has one channel."""
    unbatched = x.dim() == 2
    if unbatched and weight.shape[1] != 1:
        raise ValueError(f"prelu: a 1-d member input has one channel, so a member needs 1 slope "
                         f"(as in F.prelu), got {weight.shape[1]}")
    if x.dim() < 2:
        raise ValueError(f"prelu: expected N-first input with at least 2 dims, got {list(x.shape)}")
    y = wide.prelu(x.unsqueeze(1) if unbatched else x, weight)
    return _nfirst(y, x.shape[0], unbatched)


def _padding_idx(padding_idx: int | None, weight: torch.Tensor) -> int:
    """``padding_idx`` as ``F.embedding`` reads it (negative: counted from the end), as the op's
    index, or -1 for none."""
    if padding_idx is None:
        return -1
    v = weight.shape[1]
    if not -v <= padding_idx < v:
        raise ValueError(f"padding_idx must be within [-{v}, {v}) for tables of {v} rows, got {padding_idx}")
    return padding_idx + v if padding_idx < 0 else padding_idx


@cached
def embedding(indices: torch.Tensor, weight: torch.Tensor, padding_idx: int | None = None,
              max_norm: float | None = None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
              sparse: bool = False) -> torch.Tensor:
    """N ``F.embedding``: tables ``[N, V, D]``, indices ``[N, *]`` (or shared, expanded)."""
    if sparse:
        raise ValueError("embedding: sparse=True gradients are not supported by the wide form")
    if max_norm is not None:
        with torch.no_grad():
            wide.embedding_renorm_(weight.detach(), indices, max_norm, norm_type)
    return wide.embedding(weight, indices, _padding_idx(padding_idx, weight), scale_grad_by_freq, False)


@cached
def embedding_bag(input: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor | None = None,
                  max_norm: float | None = None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                  mode: str = "mean", sparse: bool = False, per_sample_weights: torch.Tensor | None = None,
                  include_last_offset: bool = False, padding_idx: int | None = None) -> torch.Tensor:
    """N ``F.embedding_bag``: input ``[N, B, L]``, or ``[N, T]`` with offsets ``[N, B]`` / shared ``[B]``."""
    if sparse:
        raise ValueError("embedding_bag: sparse=True gradients are not supported by the wide form")
    if mode not in EMBEDDING_BAG_MODES:
        raise ValueError(f"embedding_bag: expected mode in {sorted(EMBEDDING_BAG_MODES)}, got {mode!r}")
    if max_norm is not None:
        with torch.no_grad():
            wide.embedding_renorm_(weight.detach(), input, max_norm, norm_type)
    return wide.embedding_bag(weight, input, offsets, scale_grad_by_freq, EMBEDDING_BAG_MODES[mode], False,
                              per_sample_weights, include_last_offset, _padding_idx(padding_idx, weight))


@cached
def rnn(input: torch.Tensor, hx: Sequence[torch.Tensor], params: Sequence[torch.Tensor], mode: str,
        num_layers: int = 1, bidirectional: bool = False, batch_first: bool = False, dropout: float = 0.0,
        train: bool = False, has_biases: bool = True, proj_size: int = 0, *,
        strategy: str = "auto") -> tuple[torch.Tensor, list[torch.Tensor]]:
    """N ``nn.LSTM``/``GRU``/``RNN`` (``mode`` ``"LSTM"``, ``"GRU"``, ``"RNN_TANH"``, ``"RNN_RELU"``) in one
    time loop. ``input`` ``[N, T, B, I]`` (``[N, B, T, I]`` batch-first, ``[N, T, I]`` for unbatched
    members); ``hx`` ``[h0]`` or ``[h0, c0]`` each ``[N, L*D, B, H]`` (``[N, L*D, H]`` unbatched), or
    empty for zeros; ``params`` the stacked ``_flat_weights``. Returns ``(output, [h_n(, c_n)])``.
    ``strategy``: ``"fused"`` (= ``"auto"``: one time loop for all members) or ``"loop"``
    (ATen's recurrent op, e.g. oneDNN's fused LSTM, per member)."""
    unbatched = input.dim() == 3
    if unbatched:
        input = input.unsqueeze(1 if batch_first else 2)
        hx = [h.unsqueeze(2) for h in hx]
    out, states = wide.rnn(input, list(hx), list(params), mode, num_layers, bidirectional, batch_first, dropout,
                           train, has_biases, proj_size, strategy=strategy)
    if unbatched:
        out, states = out.squeeze(1 if batch_first else 2), [h.squeeze(2) for h in states]
    return out, list(states)


@cached
def rnn_cell(input: torch.Tensor, hx: Sequence[torch.Tensor], w_ih: torch.Tensor, w_hh: torch.Tensor,
             b_ih: torch.Tensor | None = None, b_hh: torch.Tensor | None = None, *, mode: str) -> list[torch.Tensor]:
    """One step of N ``nn.LSTMCell``/``GRUCell``/``RNNCell``: ``input`` ``[N, B, I]`` (``[N, I]``
    unbatched), ``hx`` ``[h]`` or ``[h, c]``; returns ``[h']`` or ``[h', c']``."""
    unbatched = input.dim() == 2
    if unbatched:
        input, hx = input.unsqueeze(1), [h.unsqueeze(1) for h in hx]
    out = wide.rnn_cell(input, list(hx), w_ih, w_hh, b_ih, b_hh, mode=mode)
    return [h.squeeze(1) for h in out] if unbatched else list(out)
