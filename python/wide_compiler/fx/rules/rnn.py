"""Widen rules: recurrent layers and cells -> torch.ops.wide.rnn / wide.rnn_cell.

``nn.LSTM``/``nn.GRU``/``nn.RNN`` reach the graph as ``aten.lstm.input``/``gru.input``/
``rnn_tanh.input``/``rnn_relu.input`` with the member's flat weights (``_flat_weights`` order:
per layer, per direction, ``w_ih, w_hh[, b_ih, b_hh][, w_hr]``) and an always-batched input
(the module unsqueezes unbatched ones). The wide op runs ONE time loop for all N members (Note
[wide::rnn] in csrc/wide/ops/rnn.cpp): N-first input ``[N, T, B, I]``, stacked weights, states
``[N, L*D, B, H]``; a state every member shares (the zeros the module makes when none is given)
is expanded with stride 0. The cells (``lstm_cell``, ``gru_cell``, ``rnn_*_cell``) become
``wide.rnn_cell``, so hand-written time loops fuse too.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from ...ops import LOOP, WIDE_OPS
from ..table import rule
from ..context import TuneSpec, Wide, WidenContext, concrete_shape, member_rank
from ._autocast import BY_MODE

aten = torch.ops.aten
wide = torch.ops.wide
# Under torch.autocast (Note [wide autocast]), as ATen runs each mode: lower precision, and on the
# CPU ATen's own op per member, exact, but for an LSTM without projections (Note [Recurrent ops
# under CPU autocast] in csrc/wide/ops/autocast.cpp).
AUTOCAST = {"rnn": BY_MODE, "rnn_cell": BY_MODE}

_MODES = {aten.lstm.input: "LSTM", aten.gru.input: "GRU", aten.rnn_tanh.input: "RNN_TANH",
          aten.rnn_relu.input: "RNN_RELU", aten.lstm_cell.default: "LSTM", aten.gru_cell.default: "GRU",
          aten.rnn_tanh_cell.default: "RNN_TANH", aten.rnn_relu_cell.default: "RNN_RELU"}


def _wide_list(ctx: WidenContext, node: fx.Node, olds, what: str) -> list[fx.Node]:
    out = []
    for k, old in enumerate(olds):
        v = ctx.value(old)
        if not isinstance(old, fx.Node):
            raise ctx.fail(node, f"{what} {k} is not a tensor")
        out.append(ctx.as_wide(v, member_rank(old), node).node)
    return out


def _module_zeros(node: fx.Node, hx_old) -> bool:
    """Whether every state is the zeros the recurrent module makes itself when none is given (an
    ``aten.zeros`` of the input's dtype inside the module): the wide op is then given no state and
    makes the zeros itself, in the input's dtype at run time as the module does (the captured
    node keeps the sample's dtype: under autocast a bfloat16 input would meet float32 zeros)."""
    def owner(n: fx.Node):
        stack = n.meta.get("nn_module_stack")
        return next(reversed(stack)) if stack else None

    dtype = node.args[0].meta["val"].dtype
    return owner(node) is not None and all(
        isinstance(h, fx.Node) and h.target is aten.zeros.default and owner(h) == owner(node)
        and h.meta["val"].dtype == dtype for h in hx_old)


def _proj_size(params: list, num_layers: int, directions: int, has_biases: bool) -> int:
    """LSTM projections show up as a fifth (third without biases) weight per layer and direction."""
    per = len(params) // (num_layers * directions)
    return int(params[per - 1].meta["val"].shape[0]) if per == (5 if has_biases else 3) else 0


_RNN = WIDE_OPS["rnn"]
_STRATEGIES = _RNN.strategies


def _rnn_candidates(n: int, args: tuple, shapes: dict, opts: dict) -> dict:
    """Each strategy on random tensors of the sample shapes (states zero, as when none is given)."""
    x = torch.randn(n, *shapes["input"], **opts)
    params = [torch.randn(n, *s, **opts) for s in shapes["params"]]
    return {s: (lambda s=s: wide.rnn(x, [], params, *args, strategy=s)[0]) for s in _STRATEGIES}


@rule(aten.lstm.input, aten.gru.input, aten.rnn_tanh.input, aten.rnn_relu.input, strategies=_STRATEGIES)
def _rnn(ctx: WidenContext, node: fx.Node):
    a = ctx.schema_args(node)
    mode = _MODES[node.target]
    x_old = node.args[0]
    if member_rank(x_old) != 3:
        raise ctx.fail(node, f"expected a batched member input of 3 dims, got {member_rank(x_old)}")
    hx_old = node.args[1] if mode == "LSTM" else [node.args[1]]
    params_old = list(node.args[2])
    x = ctx.as_wide(a["input"], 3, node).node
    hx = [] if _module_zeros(node, hx_old) else _wide_list(ctx, node, hx_old, "state")
    params = _wide_list(ctx, node, params_old, "weight")
    directions = 2 if a["bidirectional"] else 1
    proj = _proj_size(params_old, a["num_layers"], directions, a["has_biases"]) if mode == "LSTM" else 0
    args = (mode, a["num_layers"], a["bidirectional"], a["batch_first"], a["dropout"], a["train"], a["has_biases"],
            proj)
    shapes = {"input": concrete_shape(x_old), "params": [concrete_shape(p) for p in params_old], "mode": mode,
              "layers": a["num_layers"], "bidirectional": a["bidirectional"], "batch_first": a["batch_first"]}
    # LSTMs default to ATen's op per member (oneDNN's fused LSTM kernel, members in parallel):
    # 1.2-1.4x the loop of modules where the fused time loop is 0.4-0.6x (`benchmark rnn`); GRUs
    # and plain RNNs to the fused time loop (1.5-2.4x). The tuner measures both within its budget.
    tune = TuneSpec(default=LOOP if mode == "LSTM" else _RNN.default, strategies=_STRATEGIES,
                    make=lambda n, opts: _rnn_candidates(n, args, shapes, opts))
    out = ctx.emit_wide(wide.rnn.default, (x, hx, params, *args), {"strategy": "auto"}, like=node,
                        shapes=shapes, tune=tune)
    output = ctx.emit(operator.getitem, (out, 0), like=node)
    states = ctx.emit(operator.getitem, (out, 1), like=node)
    ranks = [v.dim() for v in node.meta["val"]]
    items = [Wide(output, ranks[0])]
    for k in range(len(ranks) - 1):
        items.append(Wide(ctx.emit(operator.getitem, (states, k), like=node), ranks[k + 1]))
    return tuple(items)


@rule(aten.lstm_cell.default, aten.gru_cell.default, aten.rnn_tanh_cell.default, aten.rnn_relu_cell.default)
def _cell(ctx: WidenContext, node: fx.Node):
    a = ctx.schema_args(node)
    mode = _MODES[node.target]
    rank = member_rank(node.args[0])
    if rank != 2:
        raise ctx.fail(node, f"expected a batched member input [B, I], got {rank} dims")
    hx_old = node.args[1] if mode == "LSTM" else [node.args[1]]
    x = ctx.as_wide(a["input"], 2, node).node
    hx = [] if _module_zeros(node, hx_old) else _wide_list(ctx, node, hx_old, "state")
    w_ih, w_hh = (ctx.as_wide(a[k], 2, node).node for k in ("w_ih", "w_hh"))
    b_ih, b_hh = (ctx.as_wide(a[k], 1, node).node if a[k] is not None else None for k in ("b_ih", "b_hh"))
    out = ctx.emit_wide(wide.rnn_cell.default, (x, hx, w_ih, w_hh, b_ih, b_hh), {"mode": mode}, like=node,
                        shapes={"input": [str(s) for s in node.args[0].meta["val"].shape], "mode": mode})
    if mode == "LSTM":
        return tuple(Wide(ctx.emit(operator.getitem, (out, k), like=node, name=None), 2) for k in range(2))
    return Wide(ctx.emit(operator.getitem, (out, 0), like=node, name=node.name), 2)
