"""The compiler's infrastructure: the rule table (fx/table.py), the pass pipeline
(fx/pipeline.py), the functional layer, the opaque-module registry and concurrent compiles."""
from __future__ import annotations

import gc
import pickle
import pkgutil

import pytest
import torch
import wide_compiler as wc
import wide_compiler.functional as WF
from support import DEVICE, cpu_only, run_in_threads
from torch import nn
from wide_compiler import registry, testing
from wide_compiler.fx import rules, table
from wide_compiler.fx.pipeline import PASSES, Compilation, Pass, run_pipeline

aten = torch.ops.aten
wide = torch.ops.wide
FAST = wc.WideConfig.fast()


# --- the rule table --------------------------------------------------------------------------
def test_resolver_raises_on_an_unknown_name():
    assert table.aten_op("relu") is aten.relu.default
    assert table.aten_op("add.Tensor") is aten.add.Tensor
    with pytest.raises(ValueError, match="no ATen op 'logsigmoid'"):
        table.aten_op("logsigmoid")
    with pytest.raises(ValueError, match="no ATen op 'add.Nope'"):
        table.aten_op("add.Nope")


def test_registering_an_op_twice_raises_and_keeps_the_first_rule():
    before = table.RULES[aten.relu.default]
    with pytest.raises(ValueError, match=r"already has a widen rule \(pointwise\._pointwise\)"):
        table.rule(aten.relu.default)(lambda ctx, node: None)
    assert table.RULES[aten.relu.default] is before


def test_rule_options_are_checked():
    with pytest.raises(ValueError, match="unknown rule layout 'sideways'"):
        table.rule(layout="sideways")
    with pytest.raises(ValueError, match="names its wide ops with packed="):
        table.rule(layout="packed")
    with pytest.raises(ValueError, match="names its wide ops with packed="):
        table.rule(packed=wide.conv.default)


def test_the_table_knows_what_the_layout_plan_and_config_need():
    assert table.packed_ops() == {wide.conv.default, wide.conv_transpose.default, wide.batch_norm.default,
                                  wide.instance_norm.default, wide.group_norm.default, wide.prelu.default}
    assert {"loop", "bmm", "bmm_t", "grouped", "fused"} <= table.strategy_names()
    assert table.RULES[aten.max_pool2d.default].layout == "fold"
    assert table.RULES[aten.dropout.default].layout == "elementwise"
    assert table.RULES[aten.channel_shuffle.default].layout == "nfirst"  # would mix members when packed
    # tagged pointwise ops without a row share the pointwise rule
    assert aten.atan.default not in table.RULES
    assert table.find_rule(aten.atan.default).family == "pointwise"
    assert table.find_rule(aten.nonzero.default) is None


def test_every_family_file_is_discovered_and_registers_rows():
    families = {e.family for e in table.RULES.values()}
    files = {m.name for m in pkgutil.iter_modules(rules.__path__) if not m.name.startswith("_")}
    assert files == families, f"files without rows: {files - families}; rows from elsewhere: {families - files}"


def test_an_unknown_strategy_name_is_refused_by_the_config():
    with pytest.raises(ValueError, match="WideConfig.strategy: expected one of"):
        wc.WideConfig(strategy="nonsense")
    assert wc.WideConfig(strategy="bmm_t").strategy == "bmm_t"


# --- the pipeline ----------------------------------------------------------------------------
def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_pipeline_runs_the_named_passes_in_order():
    models = [_mlp() for _ in range(3)]
    c = run_pipeline(Compilation(models[0], ((torch.randn(5, 4),), {}), 3, FAST, members=models))
    eval_rewrites = ["fold_batch_norms", "channels_last", "pool_before_relu", "fuse_residual_norms",
                     "relu_in_place", "attention_kernel"]
    assert [p.name for p in PASSES] == [
        "check_members", "capture", "check_programs", "widen", "fold_linear_batch_norms", "layout", *eval_rewrites,
        "strategies", "stack_state", "check_tuning", "tile_members"]
    eval_rewrites.append("fold_linear_batch_norms")
    # a training graph skips the eval rewrites (their `when`), an eval graph runs them all
    assert [name for name, _ in c.log] == [p.name for p in PASSES if p.name not in eval_rewrites]
    # with the members given, the state is stacked: ONE [N, ...] tensor per member tensor
    assert sorted(c.state.parameters) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    torch.testing.assert_close(c.state.parameters["2.weight"][1], models[1][2].weight)
    wide_model = wc.WideModel._from_compilation(c)
    assert wide_model.get_parameter("0.weight") is c.state.parameters["0.weight"]
    linears = c.wide.graph_module.graph.find_nodes(op="call_function", target=wide.linear.default)
    assert [n.kwargs["strategy"] for n in linears] == ["bmm", "bmm"]
    assert c.layout == {"conversions": 0, "packed_ops": 0}
    for m in models:
        m.eval()
    c = run_pipeline(Compilation(models[0], ((torch.randn(5, 4),), {}), 3, FAST, members=models))
    assert [name for name, _ in c.log] == [p.name for p in PASSES]
    relus = c.wide.graph_module.graph.find_nodes(op="call_function", target=torch.ops.aten.relu_.default)
    assert len(relus) == 1  # relu_in_place ran on the eval graph


def test_a_pass_whose_input_is_missing_is_refused():
    models = [_mlp() for _ in range(2)]
    widen_only = [p for p in PASSES if p.name == "widen"]
    with pytest.raises(AssertionError, match=r"pass 'widen': needs ep"):
        run_pipeline(Compilation(models[0], ((torch.randn(5, 4),), {}), 2, FAST), widen_only)


def test_a_custom_pass_list_can_stop_early_and_add_passes():
    seen = []
    models = [_mlp() for _ in range(2)]
    passes = [*PASSES[:4], Pass("count", lambda c: seen.append(len(c.wide.graph_module.graph.nodes)), ("wide",))]
    c = run_pipeline(Compilation(models[0], ((torch.randn(5, 4),), {}), 2, FAST), passes)
    assert c.layout is None and seen and seen[0] > 0


def test_the_member_check_runs_before_anything_is_stacked():
    models = [_mlp(), nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))]
    with pytest.raises(wc.ArchitectureMismatchError, match=r"member 1: type of 1 is 'Tanh', member 0 has 'ReLU'"):
        wc.compile(models, torch.randn(3, 4), config=FAST)


def test_compiles_from_several_threads_all_succeed():
    sets = [[_mlp() for _ in range(3)] for _ in range(3)]
    results = [None] * 3

    def work(k):
        results[k] = wc.compile(sets[k], torch.randn(4, 4), config=FAST)

    errors = run_in_threads(work, 3)
    assert not errors, errors
    for k, wide_model in enumerate(results):
        xs = torch.randn(3, 4, 4)
        testing.assert_members_close(wide_model(xs), [m(x) for m, x in zip(sets[k], xs)])


def test_threads_calling_the_first_forward_at_once_compile_the_graph_once():
    models = [nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2)) for _ in range(3)]
    # an unpickled model has no graph yet: the first forwards of all threads race to build it
    wide_model = pickle.loads(pickle.dumps(wc.compile(models, torch.randn(4, 4), config=FAST))).eval()
    assert not wide_model._graphs
    for m in models:
        m.eval()
    xs = torch.randn(3, 4, 4)
    outs = []
    errors = run_in_threads(lambda _: outs.append(wide_model(xs)), 4)
    assert not errors, errors
    for out in outs:
        testing.assert_members_close(out, [m(x) for m, x in zip(models, xs)])
    assert set(wide_model._graphs) == {False}


# --- the opaque registry ---------------------------------------------------------------------
class _Flip(nn.Module):
    def forward(self, x):
        return x if x.sum() > 0 else -x  # data-dependent: kept opaque through capture


@wc.register(_Flip)
class _WideFlip(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.n = n

    @classmethod
    def from_modules(cls, modules):
        return cls(len(modules))

    def forward(self, x):  # x [N, ...]: each member's own sign
        positive = x.flatten(1).sum(1) > 0
        return torch.where(positive.view(-1, *([1] * (x.dim() - 1))), x, -x)

    def unfuse(self):
        return [_Flip() for _ in range(self.n)]


def test_registered_modules_are_not_kept_alive_after_the_wide_model_is_gone():
    gc.collect()
    before = len(registry._OPAQUE)
    models = [nn.Sequential(nn.Linear(3, 3), _Flip()) for _ in range(3)]
    wide_model = wc.compile(models, torch.randn(2, 3), config=FAST)
    copy_ = __import__("copy").deepcopy(wide_model)
    wide_model.eval()(torch.randn(3, 2, 3))  # a lazy capture of the eval graph still works
    del wide_model
    gc.collect()
    copy_.eval()(torch.randn(3, 2, 3))  # ... and in a copy whose original is gone
    del copy_
    gc.collect()
    assert len(registry._OPAQUE) == before


# --- the functional layer --------------------------------------------------------------------
@pytest.mark.parametrize("padding_mode", ["zeros", "reflect", "circular"])
@pytest.mark.parametrize("padding", ["same", "valid", 1])
def test_functional_conv_normalises_padding_like_nn_conv(padding, padding_mode):
    torch.manual_seed(0)
    convs = [nn.Conv2d(3, 4, (2, 3), padding=padding, padding_mode=padding_mode) for _ in range(3)]
    w, b = torch.stack([c.weight for c in convs]), torch.stack([c.bias for c in convs])
    x = torch.randn(3, 2, 3, 7, 6)
    y = WF.conv(x, w, b, padding=padding, padding_mode=padding_mode)
    testing.assert_members_close(y, [c(xi) for c, xi in zip(convs, x)])
    unbatched = WF.conv(x[:, 0], w, b, padding=padding, padding_mode=padding_mode)
    testing.assert_members_close(unbatched, [c(xi[0]) for c, xi in zip(convs, x)])


def test_functional_argument_errors():
    with pytest.raises(ValueError, match="padding='same' is not supported for strided"):
        WF.conv_padding("same", [3, 3], 1, 2)
    with pytest.raises(ValueError, match="unknown padding 'full'"):
        WF.conv_padding("full", [3], 1, 1)
    with pytest.raises(ValueError, match="needs every member to have seen the same number of batches"):
        WF.batch_norm_factor(None, torch.tensor([2, 3]))
    assert WF.batch_norm_factor(None, torch.tensor([4, 4])) == 0.25
    assert WF.batch_norm_factor(0.3, None) == 0.3
    with pytest.raises(ValueError, match="a member needs 1 slope"):
        WF.prelu(torch.randn(2, 5), torch.rand(2, 5))
    with pytest.raises(ValueError, match="expected mode in"):
        WF.embedding_bag(torch.zeros(2, 3, 4, dtype=torch.long), torch.randn(2, 5, 3), mode="median")
    with pytest.raises(ValueError, match="sparse=True"):
        WF.embedding(torch.zeros(2, 3, dtype=torch.long), torch.randn(2, 5, 3), sparse=True)


class _MaskFromShape(torch.nn.Module):
    """``torch.ones(B, S).type_as(h)``: a mask shared by every member (funnel-style)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        mask = torch.ones(x.shape[0], 4).type_as(h)
        return h * mask


def test_a_rule_that_mislabels_a_shared_value_stops_the_compile(monkeypatch):
    """The rank check after widen: a rule returning a shared value labelled per member (what the
    old type_as rule did) would broadcast silently whenever the batch equals N; compile refuses."""
    import dataclasses

    from wide_compiler.fx.rules.pointwise import _pointwise
    from wide_compiler.fx.table import RULES

    op = torch.ops.aten.type_as.default
    monkeypatch.setitem(RULES, op, dataclasses.replace(RULES[op], fn=_pointwise))
    models = [_MaskFromShape() for _ in range(2)]
    with pytest.raises(wc.UnsupportedOperationError, match=r"internal error: aten.type_as.default .* rank 2 .* rank 3"):
        wc.compile(models, torch.randn(2, 4), config=wc.WideConfig.fast())
    monkeypatch.undo()
    wide = wc.compile(models, torch.randn(2, 4), config=wc.WideConfig.fast())  # the real rule
    x = torch.randn(2, 2, 4)
    torch.testing.assert_close(wide(x), torch.stack([m(x[i]) for i, m in enumerate(models)]))



class _ConvBN(nn.Module):
    """conv-BN-ReLU-maxpool, a conv read twice (not folded) and a BN without running stats."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.conv3, self.bn3 = nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8, track_running_stats=False)

    def forward(self, x):
        h = nn.functional.max_pool2d(torch.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        c2 = self.conv2(h)
        return self.bn3(self.conv3(self.bn2(c2) + c2))


def _trained_members(n):
    models = testing.make_members(_ConvBN, n)
    for m in models:  # running statistics and affine parameters away from their defaults
        with torch.no_grad():
            for bn in (m.bn1, m.bn2):
                bn.running_mean.uniform_(-1, 1), bn.running_var.uniform_(0.5, 2), bn.weight.uniform_(0.5, 2)
                bn.bias.uniform_(-1, 1)
    return models


@cpu_only  # the CPU's strategy table (CUDA prefers channels-last convolutions)
def test_a_lone_conv_stays_channels_first_in_eval():
    """rewrite_channels_last (fx/eval_rewrites.py) leaves a graph with a single conv alone: nothing
    downstream gains from channels-last, and the N-first output would cost a transposing copy."""
    models = testing.make_members(lambda: nn.Conv2d(8, 4, 3, padding=1), 3)
    wide, _ = testing.check_compile(models, torch.randn(2, 8, 16, 16), modes=("eval",), config=FAST)
    convs = wide._graph_for(False).graph_module.graph.find_nodes(op="call_function", target=torch.ops.wide.conv.default)
    assert [n.kwargs["strategy"] for n in convs] == ["grouped"]


def test_eval_graph_folds_batch_norm_into_its_conv_and_pools_channels_last():
    """Note [Folding BatchNorm into the conv] and [Channels-last max pooling] (fx/fold.py, fx/eval_rewrites.py): only
    bn1 is folded (conv2 is read twice, bn3 has no running statistics); outputs, input and
    parameter gradients match the members in eval mode, under no_grad too, and the outputs are
    contiguous."""
    from wide_compiler.fx.eval_rewrites import channels_last_max_pool2d

    models = [m.eval() for m in _trained_members(3)]
    wide, _ = testing.check_compile(models, torch.randn(4, 3, 16, 16), modes=("eval",), config=FAST, strict=True)
    nodes = list(wide._graph_for(False).graph_module.graph.nodes)
    assert sum(n.target is torch.ops.wide.batch_norm.default for n in nodes) == 2  # bn2, bn3 kept
    assert any(n.target is channels_last_max_pool2d for n in nodes)
    # the 16x16 conv runs channels-last, the convs on the pooled 8x8 planes channels-first (the
    # 1x1 one as the per-member loop: Note [Pointwise convs in eval graphs])
    convs = [n for n in nodes if n.target is torch.ops.wide.conv.default]
    if DEVICE.type == "cpu":  # the CPU's defaults (a GPU runs cuDNN's channels-last grouped convs)
        assert [n.kwargs["strategy"] for n in convs] == ["grouped_cl", "grouped", "loop"]
    train_nodes = wide._graph_for(True).graph_module.graph.nodes  # training normalises by batch stats
    assert sum(n.target is torch.ops.wide.batch_norm.default for n in train_nodes) == 3
    x = torch.randn(3, 4, 3, 16, 16)
    with torch.no_grad():
        out = wide(x)
    assert out.is_contiguous()
    testing.assert_members_close(out, [m(x[i]) for i, m in enumerate(models)])


class _Bottleneck(nn.Module):
    """1x1 reduce, 3x3, 1x1 expand: ResNet-50's bottleneck at a toy width."""

    def __init__(self):
        super().__init__()
        self.reduce, self.mid, self.expand = nn.Conv2d(32, 16, 1), nn.Conv2d(16, 16, 3, padding=1), nn.Conv2d(16, 64, 1)

    def forward(self, x):
        return self.expand(torch.relu(self.mid(torch.relu(self.reduce(x)))))


@cpu_only  # the CPU's conv strategy defaults (a GPU's is cuDNN's grouped conv)
@pytest.mark.parametrize("size", [8, 16])
def test_eval_pointwise_convs_default_to_the_loop_on_small_planes(size):
    """Note [Pointwise convs in eval graphs]: on planes under 16x16 an eval graph's 1x1 convs
    default to the per-member loop and its 3x3 conv stays channels-first grouped; from 16x16 on
    all run channels-last; the train graph keeps channels-first grouped. Members match in both
    modes (outputs, input and parameter gradients)."""
    models = testing.make_members(_Bottleneck, 3)
    config = wc.WideConfig(tune=False)
    wide, _ = testing.check_compile(models, torch.randn(2, 32, size, size), modes=("eval", "train"), config=config)

    def strategies(training):
        return [n.kwargs["strategy"] for n in wide._graph_for(training).graph_module.graph.find_nodes(
            op="call_function", target=torch.ops.wide.conv.default)]

    assert strategies(False) == (["loop", "grouped", "loop"] if size < 16 else ["grouped_cl"] * 3)
    assert strategies(True) == ["grouped"] * 3


class _Pointwise(nn.Module):
    """Pointwise convs of 8.4M, 0.5M and (stride 2) 2.1M multiply-adds per member at batch 2,
    16x16, and a 3x3 conv."""

    def __init__(self):
        super().__init__()
        self.big, self.narrow = nn.Conv2d(128, 128, 1), nn.Conv2d(128, 8, 1)
        self.mid, self.strided = nn.Conv2d(8, 128, 3, padding=1), nn.Conv2d(128, 128, 1, stride=2)

    def forward(self, x):
        return self.strided(torch.relu(self.mid(torch.relu(self.narrow(torch.relu(self.big(x)))))))


@cpu_only  # the CPU's conv strategy defaults (a GPU's is cuDNN's grouped conv)
def test_large_pointwise_convs_default_to_the_loop():
    """Note [Pointwise conv default]: a train graph's pointwise conv of 8M multiply-adds per
    member or more (output plane after its stride) defaults to the loop, smaller ones and the
    3x3 conv to channels-first grouped; members match in training (outputs, input and
    parameter gradients, with per-member and with shared inputs)."""
    models = testing.make_members(_Pointwise, 3)
    wide, _ = testing.check_compile(models, torch.randn(2, 128, 16, 16), modes=("train",),
                                    config=wc.WideConfig(tune=False))
    strategies = [n.kwargs["strategy"] for n in wide._graph_for(True).graph_module.graph.find_nodes(
        op="call_function", target=torch.ops.wide.conv.default)]
    assert strategies == ["loop", "grouped", "grouped", "grouped"]


def test_folded_eval_graph_follows_later_changes_to_the_batch_norm():
    """The fold follows the live parameters and buffers (more in test_fold_cache.py)."""
    models = [m.eval() for m in _trained_members(2)]
    wide = wc.compile(models, torch.randn(4, 3, 8, 8), config=FAST).eval()
    with torch.no_grad():
        wide.get_buffer("bn1.running_var").mul_(3.0)
        wide.get_parameter("bn1.bias").add_(0.5)
    refs = wide.unfuse()
    x = torch.randn(2, 4, 3, 8, 8)
    with torch.no_grad():
        testing.assert_members_close(wide(x), [m.eval()(x[i]) for i, m in enumerate(refs)])


def test_folded_eval_graph_under_torch_compile_fullgraph():
    models = [m.eval() for m in _trained_members(2)]
    wide = wc.compile(models, torch.randn(4, 3, 8, 8), config=FAST).eval()
    compiled = torch.compile(wide, fullgraph=True, backend="eager")
    x = torch.randn(2, 4, 3, 8, 8)
    with torch.no_grad():
        testing.assert_members_close(compiled(x), [m(x[i]) for i, m in enumerate(models)])


class _ReluPool(nn.Module):
    """ReLU before 1-d and 2-d max pools (the second ReLU also feeds a skip: not moved)."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv1d(2, 8, 3, padding=1), nn.Conv2d(1, 8, 3, padding=1)

    def forward(self, x):
        a = nn.functional.max_pool1d(torch.relu(self.c1(x)), 2)
        h = torch.relu(self.c2(a.unsqueeze(1)))
        return nn.functional.max_pool2d(h, 2) + nn.functional.max_pool2d(h, 2, ceil_mode=True)


def test_eval_graph_pools_before_relu():
    """Note [Max pool before ReLU] (fx/eval_rewrites.py): relu(max_pool(x)) replaces max_pool(relu(x)) when
    the pool is the ReLU's only reader; members agree in eval (grads included), eager, under
    no_grad with negative, tied and NaN inputs, and under torch.compile."""
    models = [m.eval() for m in testing.make_members(_ReluPool, 3)]
    x = torch.randn(3, 2, 2, 8)
    x[0, 0, 0, :4] = -1.0  # ties among negatives (all zero after the ReLU)
    x[1, 1, 1, 3] = float("nan")
    wide, _ = testing.check_compile(models, x[0], modes=("eval",), config=FAST)
    graph = wide._graph_for(False).graph_module.graph
    relus = [n for n in graph.nodes if n.target is torch.ops.aten.relu.default]
    moved = [n for n in relus if n.args[0].target is torch.ops.aten.max_pool1d.default]
    assert len(moved) == 1 and len(relus) == 2  # the shared ReLU stays before its two pools
    with torch.no_grad():
        want = [m(x[i]) for i, m in enumerate(models)]
        testing.assert_members_close(wide(x), want, equal_nan=True)
        testing.assert_members_close(torch.compile(wide, fullgraph=True)(x), want, equal_nan=True)


@cpu_only  # the CPU's conv strategy defaults (a GPU's is cuDNN's grouped conv)
def test_model_level_tuning_check_keeps_one_of_the_two_and_leaves_no_trace(monkeypatch, caplog):
    """Note [Model-level tuning check] (fx/model_check.py): when the per-op tuner changes a strategy, the
    whole graph is timed both ways and one of the two sets is kept (which one is the machine's
    call: not asserted); buffers come back as they were and no ``.grad`` is written. The
    measuring clock stands still (Note [Fake clock]): however busy the machine, the tuning budget
    never runs out before the check has run (it did on a busy machine, and the line never came)."""
    import logging

    from wide_compiler import tuning
    from wide_compiler.measure import timing

    monkeypatch.setattr(timing, "_clock", lambda: 0.0)
    monkeypatch.setattr(tuning, "measure_strategy", lambda op, key, make, default, config, names, **kw:
                        tuning.Choice("loop", None, "measured: forced by the test", "measured"))
    models = _trained_members(2)  # train mode: BatchNorm updates its running stats when run
    before = [{k: v.clone() for k, v in m.named_buffers()} for m in models]
    with caplog.at_level(logging.INFO, logger="wide_compiler.model"):
        wide = wc.compile(models, torch.randn(4, 3, 8, 8), config=wc.WideConfig(cache=False))
    assert "model-level check: tuned set" in caplog.text and "keeping the" in caplog.text
    chosen = set(wide.strategies.values())
    assert chosen in ({"loop"}, {"grouped", "grouped_cl"}), chosen  # defaults: grouped_cl for the RGB conv
    for i, m in enumerate(models):  # the wide buffers are the members' initial ones
        for name, b in before[i].items():
            torch.testing.assert_close(wide.get_buffer(name)[i], b)
    assert all(p.grad is None for p in wide.parameters())
    testing.check_equivalence(wide, models, torch.randn(2, 4, 3, 8, 8), buffers=True)


class _MLPBN(nn.Module):
    """Linear (no bias) -> BatchNorm1d -> ReLU twice (the second Linear also read by a skip:
    not folded), then a BatchNorm1d over a 3-d input after a Linear (its channels are not the
    Linear's features: not folded)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.bn1 = nn.Linear(6, 8, bias=False), nn.BatchNorm1d(8)
        self.fc2, self.bn2 = nn.Linear(8, 8, bias=False), nn.BatchNorm1d(8)
        self.fc3, self.bn3 = nn.Linear(5, 5), nn.BatchNorm1d(8)

    def forward(self, x):
        h = torch.relu(self.bn1(self.fc1(x)))
        g = self.fc2(h)
        h = torch.relu(self.bn2(g)) + g
        return self.bn3(self.fc3(h.unsqueeze(-1).expand(-1, -1, 5)))


def test_eval_graph_folds_batch_norm1d_into_its_linear():
    """Note [Folding BatchNorm into the conv] for a Linear: only bn1 is folded (fc2 is read
    twice; bn3 normalises a 3-d input whose channels are not fc3's features); the folded graph
    has no layout conversion for it; outputs, input and parameter gradients match the members
    in eval mode, and the fold follows later changes to the BatchNorm."""
    models = testing.make_members(_MLPBN, 3)
    for m in models:
        with torch.no_grad():
            for bn in (m.bn1, m.bn2, m.bn3):
                bn.running_mean.uniform_(-1, 1), bn.running_var.uniform_(0.5, 2), bn.weight.uniform_(0.5, 2)
                bn.bias.uniform_(-1, 1)
        m.eval()
    wide, _ = testing.check_compile(models, torch.randn(4, 6), modes=("eval",), config=FAST, strict=True)
    nodes = list(wide._graph_for(False).graph_module.graph.nodes)
    assert sum(n.target is torch.ops.wide.batch_norm.default for n in nodes) == 2
    fc1 = next(n for n in nodes if n.target is torch.ops.wide.linear.default)
    assert fc1.meta.get("wide_folded") and all(u.target is not torch.ops.wide.to_packed.default for u in fc1.users)
    assert sum(n.target is torch.ops.wide.batch_norm.default for n in wide._graph_for(True).graph_module.graph.nodes) == 3
    with torch.no_grad():
        wide.get_buffer("bn1.running_var").mul_(3.0)
        wide.get_parameter("bn1.weight").add_(0.5)
    refs = wide.unfuse()
    x = torch.randn(3, 7, 6)
    with torch.no_grad():
        testing.assert_members_close(wide(x), [m.eval()(x[i]) for i, m in enumerate(refs)])
