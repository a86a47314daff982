"""WideLSTM / WideGRU / WideRNN and their cells over ``torch.ops.wide.rnn`` / ``wide.rnn_cell``."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from .. import functional as WF
from ..ops import WIDE_OPS
from ._common import check_members, check_strategy, stack_param

__all__ = ["WideGRU", "WideGRUCell", "WideLSTM", "WideLSTMCell", "WideRNN", "WideRNNCell"]


def _mode(module: nn.Module) -> str:
    if isinstance(module, (nn.LSTM, nn.LSTMCell)):
        return "LSTM"
    if isinstance(module, (nn.GRU, nn.GRUCell)):
        return "GRU"
    return "RNN_RELU" if module.nonlinearity == "relu" else "RNN_TANH"


class _WideRecurrent(nn.Module):
    """Stacked ``[N, ...]`` weights of N recurrent modules of one configuration, under the
    member's names (``weight_ih_l0``, ...), plus a meta template holding the hyperparameters."""

    _base: type[nn.Module]
    _attrs: tuple[str, ...]
    STRATEGIES: tuple[str, ...] = WIDE_OPS["rnn_cell"].choices  # one implementation: ("auto",)

    def __init__(self, modules: Sequence[nn.Module], *, strategy: str = "auto") -> None:
        super().__init__()
        self.strategy = check_strategy(self, strategy)
        self.n = len(modules)
        self.mode = _mode(modules[0])
        object.__setattr__(self, "_template", copy.deepcopy(modules[0]).to("meta"))
        self._names = [name for name, _ in modules[0].named_parameters()]
        for name in self._names:
            self.register_parameter(name, stack_param(modules, name))
        self.train(modules[0].training)

    @classmethod
    def from_modules(cls, modules: Sequence[nn.Module], *, strategy: str = "auto"):
        """Stack N modules of one configuration (weights copied); ``strategy``: one of
        ``STRATEGIES`` (recurrent modules: ``"fused"`` (= ``"auto"``: one time loop for all
        members) or ``"loop"`` (ATen's op per member); cells: ``"auto"``)."""
        check_strategy(cls, strategy)
        return cls(check_members(modules, cls._base, cls._attrs + ("training",), cls.__name__), strategy=strategy)

    def unfuse(self) -> list[nn.Module]:
        """N ordinary modules holding copies of the members' weights."""
        ref = getattr(self, self._names[0])
        out = []
        for i in range(self.n):
            m = copy.deepcopy(self._template).to_empty(device=ref.device).to(ref.dtype)
            with torch.no_grad():
                for name in self._names:
                    getattr(m, name).copy_(getattr(self, name)[i])
            if hasattr(m, "flatten_parameters"):
                m.flatten_parameters()
            out.append(m.train(self.training))
        return out

    def extra_repr(self) -> str:
        return f"n={self.n}, {self._template.extra_repr()}, strategy={self.strategy!r}"


class _WideRNNBase(_WideRecurrent):
    _attrs = ("mode", "input_size", "hidden_size", "num_layers", "bias", "batch_first", "dropout",
              "bidirectional", "proj_size")
    STRATEGIES = WIDE_OPS["rnn"].choices

    def forward(self, input, hx=None):
        """As the member's forward with a leading member dim on the input and the states
        (``h0``/``(h0, c0)`` ``[N, L*D, B, H]``); returns ``(output, h_n)`` or
        ``(output, (h_n, c_n))``."""
        if isinstance(input, nn.utils.rnn.PackedSequence):
            raise TypeError(f"{type(self).__name__}: PackedSequence inputs are not supported; pass a padded "
                            "N-first tensor (and mask the padded steps), or run the members separately")
        t = self._template
        states = [] if hx is None else (list(hx) if self.mode == "LSTM" else [hx])
        out, states = WF.rnn(input, states, [getattr(self, n) for n in self._names], self.mode, t.num_layers,
                             t.bidirectional, t.batch_first, float(t.dropout), self.training, t.bias,
                             getattr(t, "proj_size", 0), strategy=self.strategy)
        return out, (tuple(states) if self.mode == "LSTM" else states[0])


class WideLSTM(_WideRNNBase):
    """N ``nn.LSTM`` (every option: layers, bidirectional, batch_first, bias, dropout, proj_size)
    as ONE time loop for all members.

    Example:
        >>> import torch, wide_compiler as wc
        >>> lstms = [torch.nn.LSTM(4, 8, num_layers=2, bidirectional=True) for _ in range(3)]
        >>> wide = wc.nn.WideLSTM.from_modules(lstms)
        >>> x = torch.randn(3, 5, 2, 4)                      # [N, T, B, I]
        >>> out, (h, c) = wide(x)
        >>> torch.allclose(out[1], lstms[1](x[1])[0], atol=1e-5)
        True
    """

    _base = nn.LSTM


class WideGRU(_WideRNNBase):
    """N ``nn.GRU`` as one time loop (see :class:`WideLSTM`)."""

    _base = nn.GRU


class WideRNN(_WideRNNBase):
    """N ``nn.RNN`` (tanh or relu) as one time loop (see :class:`WideLSTM`)."""

    _base = nn.RNN
    _attrs = _WideRNNBase._attrs + ("nonlinearity",)


class _WideCell(_WideRecurrent):
    _attrs = ("input_size", "hidden_size", "bias")

    def forward(self, input, hx=None):
        """One step for every member: ``input`` ``[N, B, I]`` (``[N, I]`` unbatched), ``hx``
        ``[N, B, H]`` (or ``(h, c)`` for LSTM); None means zeros, as the member's cell."""
        t = self._template
        if hx is None:
            h = input.new_zeros(*input.shape[:-1], t.hidden_size)
            hx = (h, h) if self.mode == "LSTM" else h
        states = list(hx) if self.mode == "LSTM" else [hx]
        out = WF.rnn_cell(input, states, self.weight_ih, self.weight_hh, getattr(self, "bias_ih", None),
                          getattr(self, "bias_hh", None), mode=self.mode)
        return tuple(out) if self.mode == "LSTM" else out[0]


class WideLSTMCell(_WideCell):
    """N ``nn.LSTMCell`` as one op, so a hand-written time loop runs all members per step.

    Example:
        >>> import torch, wide_compiler as wc
        >>> cells = [torch.nn.LSTMCell(4, 6) for _ in range(3)]
        >>> wide = wc.nn.WideLSTMCell.from_modules(cells)
        >>> x = torch.randn(3, 2, 4)
        >>> h, c = wide(x)
        >>> torch.allclose(h[2], cells[2](x[2])[0], atol=1e-6)
        True
    """

    _base = nn.LSTMCell


class WideGRUCell(_WideCell):
    """N ``nn.GRUCell`` as one op."""

    _base = nn.GRUCell


class WideRNNCell(_WideCell):
    """N ``nn.RNNCell`` (tanh or relu) as one op."""

    _base = nn.RNNCell
    _attrs = _WideCell._attrs + ("nonlinearity",)
