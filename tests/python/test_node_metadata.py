"""The metadata of wide nodes (Note [Node metadata] in fx/context.py): rules emit their wide ops
through ``WidenContext.emit_wide``, which derives ``wide_op`` from the target, fills the
strategy/layout defaults and refuses what the op table (wide_compiler/ops.py) says is wrong; and
every wide op of a compiled model carries the metadata its table row calls for."""
from __future__ import annotations

import pytest
import torch
import wide_compiler as wc
from torch import fx, nn
from wide_compiler.fx.context import TuneSpec, WidenContext
from wide_compiler.ops import WIDE_OPS, of_target

aten = torch.ops.aten
wide = torch.ops.wide


def _member_node() -> fx.Node:
    """A node of a member graph for ``like=`` (it lends its name and stack trace)."""
    g = fx.Graph()
    node = g.call_function(aten.relu.default, (g.placeholder("x"),))
    node.meta["stack_trace"] = 'File "model.py", line 7, in forward'
    return node


def _tune(default: str = "bmm", strategies: tuple = ()) -> TuneSpec:
    return TuneSpec(default=default, strategies=strategies, make=lambda n, opts: {})


def test_emit_wide_derives_the_op_and_fills_the_defaults():
    ctx = WidenContext(3)
    x, w = ctx.graph.placeholder("x"), ctx.graph.placeholder("w")
    shapes, tune, like = {"input": [2, 4], "weight": [5, 4], "bias": False}, _tune(), _member_node()
    node = ctx.emit_wide(wide.linear.default, (x, w, None), like=like, shapes=shapes, tune=tune)
    assert node.meta["wide_op"] == "wide.linear" == WIDE_OPS["linear"].qualname
    assert node.meta["wide_shapes"] is shapes  # the dict the tune's make closes over, not a copy
    assert node.meta["wide_tune"] is tune
    assert node.kwargs == {"strategy": "auto"}
    assert node.meta["wide_source"] == like.name and node.meta["stack_trace"] == like.meta["stack_trace"]
    norm = ctx.emit_wide(wide.group_norm.default, (x, 3, 2, None, None, 1e-5), like=like, shapes={"input": [2, 4]})
    assert norm.kwargs == {"packed_input": False} and norm.meta["wide_op"] == "wide.group_norm"
    assert "wide_tune" not in norm.meta
    region = ctx.emit_wide(print, (x,), like=like, op="region:r")
    assert region.meta["wide_op"] == "region:r" and "wide_shapes" not in region.meta


@pytest.mark.parametrize("call,match", [
    (lambda ctx, x: ctx.emit_wide(wide.to_nfirst.default, (x, 3), like=_member_node()), "a 'layout' op"),
    (lambda ctx, x: ctx.emit_wide(wide.linear.default, (x, x), like=_member_node(), shapes={"input": [1]}),
     "needs tune= and shapes="),
    (lambda ctx, x: ctx.emit_wide(wide.linear.default, (x, x), like=_member_node(), shapes={"weight": [1]},
                                  tune=_tune()), "'input' entry"),
    (lambda ctx, x: ctx.emit_wide(wide.linear.default, (x, x), like=_member_node(), shapes={"input": [1]},
                                  tune=_tune("grouped", ("grouped", "loop"))), "the op offers"),
    (lambda ctx, x: ctx.emit_wide(wide.linear.default, (x, x), {"strategy": "grouped"}, like=_member_node(),
                                  shapes={"input": [1]}, tune=_tune()), "strategy 'grouped' not in"),
    (lambda ctx, x: ctx.emit_wide(wide.rms_norm.default, (x, [4]), like=_member_node(), shapes={"input": [4]},
                                  tune=_tune()), "one implementation"),
    (lambda ctx, x: ctx.emit_wide(wide.linear.default, (x, x), like=_member_node(), shapes={"input": [1]},
                                  tune=_tune(), op="wide.conv"), "the target names 'wide.linear'"),
    (lambda ctx, x: ctx.emit_wide(print, (x,), like=_member_node()), "needs op="),
])
def test_emit_wide_refuses_what_the_op_table_forbids(call, match):
    ctx = WidenContext(3)
    with pytest.raises(ValueError, match=match):
        call(ctx, ctx.graph.placeholder("x"))


class _Net(nn.Module):
    """One of each kind of wide op a rule emits: packed (conv, batch norm, PReLU), N-first with
    strategies (linear, layer norm, LSTM) and without (embedding)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.act = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.PReLU(4)
        self.fc, self.ln = nn.Linear(4 * 4 * 4, 6), nn.LayerNorm(6)
        self.emb, self.lstm = nn.Embedding(5, 6), nn.LSTM(6, 3, batch_first=True)

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        h = self.ln(self.fc(self.act(self.bn(self.conv(x))).flatten(1)))
        return self.lstm(h.unsqueeze(1) + self.emb(idx))[0].sum(1)


@pytest.mark.filterwarnings("ignore:The tensor attributes self.lstm._flat_weights")  # export's, on nn.LSTM
def test_every_wide_op_of_a_compiled_model_carries_its_metadata():
    torch.manual_seed(0)
    members = [_Net() for _ in range(3)]
    wide_model = wc.compile(members, (torch.randn(2, 3, 4, 4), torch.randint(0, 5, (2, 1))),
                            config=wc.WideConfig.fast())
    gm = wide_model._graph_for(wide_model.training).graph_module
    seen = set()
    for node in gm.graph.nodes:
        info = of_target(node.target) if node.op == "call_function" else None
        if info is None or info.kind != "layer":
            assert "wide_tune" not in node.meta, node.name
            continue
        seen.add(info.name)
        assert node.meta["wide_op"] == info.qualname, node.name
        assert "input" in node.meta["wide_shapes"], node.name
        assert ("wide_tune" in node.meta) == bool(info.strategies), node.name
        if info.strategies:
            assert node.kwargs["strategy"] in info.strategies, node.name
            assert set(node.meta["wide_tune"].names) <= set(info.strategies), node.name
        assert ("packed_input" in node.kwargs) == info.packed_input, node.name
    assert seen == {"conv", "batch_norm", "prelu", "linear", "layer_norm", "embedding", "rnn"}
