"""Recurrent models: nn.LSTM / nn.GRU / nn.RNN with every option and their cells, through
compile(strict=True) and as hand-built wide modules, member by member (wide_compiler.testing)."""
from __future__ import annotations

import pytest
import torch
import wide_compiler as wc
from torch import nn
from wide_compiler.testing import assert_members_close, check_compile, check_equivalence, make_members
from support import cpu_only

FAST = wc.WideConfig.fast()

# (module class, kwargs): every option appears at least once
CONFIGS = [
    (nn.LSTM, {}),
    (nn.LSTM, {"num_layers": 2, "bidirectional": True}),
    (nn.LSTM, {"batch_first": True, "bias": False}),
    (nn.LSTM, {"proj_size": 3, "num_layers": 2}),
    (nn.LSTM, {"proj_size": 2, "bidirectional": True, "batch_first": True}),
    (nn.GRU, {}),
    (nn.GRU, {"num_layers": 2, "bidirectional": True, "batch_first": True}),
    (nn.GRU, {"bias": False, "num_layers": 3}),
    (nn.RNN, {}),
    (nn.RNN, {"nonlinearity": "relu", "num_layers": 2, "bidirectional": True}),
    (nn.RNN, {"batch_first": True, "bias": False}),
]
IDS = [f"{cls.__name__}-{'-'.join(f'{k}={v}' for k, v in kw.items()) or 'default'}" for cls, kw in CONFIGS]


class Seq(nn.Module):
    """An RNN layer with a head, returning the output and the final states as torch does."""

    def __init__(self, cls, **kw):
        super().__init__()
        self.rnn = cls(4, 6, **kw)
        self.batch_first = kw.get("batch_first", False)

    def forward(self, x, h0=None):
        out, h = self.rnn(x, h0)
        return out * 2, h


def _sample(batch_first: bool, t: int = 5, b: int = 3) -> torch.Tensor:
    return torch.randn(b, t, 4) if batch_first else torch.randn(t, b, 4)


@pytest.mark.parametrize("cls,kw", CONFIGS, ids=IDS)
def test_rnn_layers_match_their_members(cls, kw):
    models = make_members(lambda: Seq(cls, **kw), 3)
    # own and shared inputs, train and eval, outputs, states, input and parameter gradients
    check_compile(models, _sample(kw.get("batch_first", False)), strict=True, config=FAST)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("cls,kw", CONFIGS, ids=IDS)
def test_captured_recurrent_values_have_the_layers_shapes(cls, kw, training):
    """The captured op's values are what the layer returns, whatever torch's decomposition gives on
    a device (torch 2.11's LSTM decomposition on CUDA made final states [L, 1, B, H], which the
    rank check refused): the capture takes them by shape (Note [Recurrent layers with a dynamic
    length])."""
    from wide_compiler.fx.capture import capture

    aten = torch.ops.aten
    model = Seq(cls, **kw).train(training)
    x = _sample(kw.get("batch_first", False))
    out, h = model(x)
    want = [list(t.shape) for t in (out, *(h if isinstance(h, tuple) else (h,)))]
    graph = capture(model, (x,)).graph
    node = next(n for n in graph.nodes if n.target in (aten.lstm.input, aten.gru.input, aten.rnn_tanh.input,
                                                         aten.rnn_relu.input))
    got = [[s.node.hint if isinstance(s, torch.SymInt) else s for s in v.shape] for v in node.meta["val"]]
    assert got == want


@pytest.mark.parametrize("cls,kw", [CONFIGS[1], CONFIGS[4], CONFIGS[6], CONFIGS[9]],
                         ids=[IDS[1], IDS[4], IDS[6], IDS[9]])
def test_initial_states_given(cls, kw):
    models = make_members(lambda: Seq(cls, **kw), 3)
    m = models[0].rnn
    d = 2 if m.bidirectional else 1
    h_out = m.proj_size or m.hidden_size
    h0 = torch.randn(m.num_layers * d, 3, h_out)
    sample = (_sample(m.batch_first), (h0, torch.randn(m.num_layers * d, 3, m.hidden_size)) if cls is nn.LSTM else h0)
    check_compile(models, sample, strict=True, config=FAST, modes=("train",))


def test_unbatched_member_inputs():
    models = make_members(lambda: Seq(nn.LSTM, num_layers=2), 3)
    check_compile(models, torch.randn(5, 4), strict=True, config=FAST, modes=("eval",))


def test_dropout_between_layers_draws_per_member():
    models = make_members(lambda: Seq(nn.GRU, num_layers=2, dropout=0.5), 3)
    wide = wc.compile(models, torch.randn(5, 3, 4), strict=True, config=FAST)
    x = torch.randn(5, 3, 4)
    out, _ = wide(x.expand(3, *x.shape))
    assert not torch.allclose(out[0], out[1])  # shared input, independent masks
    wide.eval()
    for m in models:
        m.eval()
    out, h = wide(x.expand(3, *x.shape))
    assert_members_close(out, [m(x)[0] for m in models])


class CellLoop(nn.Module):
    """A hand-written time loop over a cell (the seq2seq decoder pattern)."""

    def __init__(self, cls):
        super().__init__()
        self.cell = cls(4, 6)
        self.head = nn.Linear(6, 2)
        self.lstm = cls is nn.LSTMCell

    def forward(self, x):  # x [T, B, 4]
        state = None
        outs = []
        for t in range(x.shape[0]):
            state = self.cell(x[t], state)
            outs.append(self.head(state[0] if self.lstm else state))
        return torch.stack(outs)


@pytest.mark.parametrize("cls", [nn.LSTMCell, nn.GRUCell, nn.RNNCell])
def test_cell_loops_fuse(cls):
    models = make_members(lambda: CellLoop(cls), 3)
    wide, _ = check_compile(models, torch.randn(4, 2, 4), strict=True, config=FAST)
    assert "wide.rnn_cell" in wide.summary()


def test_relu_cell_and_unbatched_cell():
    models = make_members(lambda: nn.RNNCell(4, 5, nonlinearity="relu"), 3)
    check_compile(models, torch.randn(2, 4), strict=True, config=FAST)
    models = make_members(lambda: nn.GRUCell(4, 5), 3)
    check_compile(models, torch.randn(4), strict=True, config=FAST, modes=("eval",))


class Tagger(nn.Module):
    """A 2-layer bidirectional LSTM tagger: embedding -> LSTM -> per-step classifier."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.lstm = nn.LSTM(8, 12, num_layers=2, bidirectional=True, batch_first=True)
        self.out = nn.Linear(24, 5)

    def forward(self, tokens):
        h, _ = self.lstm(self.emb(tokens))
        return self.out(h).log_softmax(-1)


def test_lstm_tagger_trains_like_its_members():
    models = make_members(Tagger, 4)
    tokens = torch.randint(0, 20, (3, 7))
    wide, _ = check_compile(models, tokens, strict=True, config=FAST, shared=(True,))
    assert not wide.fallbacks


# --- hand-built modules ----------------------------------------------------------------------
@pytest.mark.parametrize("cls,kw", CONFIGS, ids=IDS)
def test_wide_modules_from_modules_and_unfuse(cls, kw):
    members = make_members(lambda: cls(4, 6, **kw), 3)
    wide_cls = {nn.LSTM: wc.nn.WideLSTM, nn.GRU: wc.nn.WideGRU, nn.RNN: wc.nn.WideRNN}[cls]
    wide = wide_cls.from_modules(members)
    x = [_sample(kw.get("batch_first", False)) for _ in range(3)]
    check_equivalence(wide, members, x)
    back = wide.unfuse()
    for m, b in zip(members, back):
        for (name, p), (_, q) in zip(m.named_parameters(), b.named_parameters()):
            assert torch.equal(p, q), name


@pytest.mark.parametrize("cls", [nn.LSTMCell, nn.GRUCell, nn.RNNCell])
def test_wide_cells(cls):
    members = make_members(lambda: cls(4, 6), 3)
    wide = {nn.LSTMCell: wc.nn.WideLSTMCell, nn.GRUCell: wc.nn.WideGRUCell, nn.RNNCell: wc.nn.WideRNNCell}[cls]
    check_equivalence(wide.from_modules(members), members, [torch.randn(2, 4) for _ in range(3)])


@pytest.mark.parametrize("cls,kw", CONFIGS + [(nn.LSTMCell, {}), (nn.GRUCell, {}), (nn.RNNCell, {})],
                         ids=IDS + ["LSTMCell", "GRUCell", "RNNCell"])
def test_batched_time_loop_hands_weights_gradients_in_their_layout(cls, kw):
    """The fused strategy's GEMMs give every stacked weight its gradient in the weight's own
    layout, summed over the time steps (Note [Linear weight gradient layout]): loss.backward()
    stores them without a copy; the gradients are the members' own."""
    torch.manual_seed(3)
    cell = cls in (nn.LSTMCell, nn.GRUCell, nn.RNNCell)
    members = make_members(lambda: cls(4, 6, **kw), 3)
    wide_cls = {nn.LSTM: wc.nn.WideLSTM, nn.GRU: wc.nn.WideGRU, nn.RNN: wc.nn.WideRNN, nn.LSTMCell: wc.nn.WideLSTMCell,
                nn.GRUCell: wc.nn.WideGRUCell, nn.RNNCell: wc.nn.WideRNNCell}[cls]
    wide = wide_cls.from_modules(members) if cell else wide_cls.from_modules(members, strategy="fused")
    xs = [torch.randn(2, 4) if cell else _sample(kw.get("batch_first", False)) for _ in range(3)]
    out = wide(torch.stack(xs))
    out = out[0] if isinstance(out, tuple) else out
    params = [(n, p) for n, p in wide.named_parameters()]
    grads = torch.autograd.grad(out.sum(), [p for _, p in params])
    for (name, p), g in zip(params, grads):
        assert g.stride() == p.stride(), (name, p.stride(), g.stride())
    for i, m in enumerate(members):
        y = m(xs[i])
        y = y[0] if isinstance(y, tuple) else y
        ref = torch.autograd.grad(y.sum(), list(m.parameters()))
        for (name, _), g, r in zip(params, grads, ref):
            torch.testing.assert_close(g[i], r, rtol=1e-4, atol=1e-5, msg=f"member {i} {name}")


# --- bad input ---------------------------------------------------------------------------------
def test_members_that_differ_are_refused_by_configuration():
    with pytest.raises(wc.ArchitectureMismatchError, match=r"member 1: (rnn\.)?batch_first is True, member 0 has False"):
        wc.compile([Seq(nn.GRU), Seq(nn.GRU, batch_first=True)], torch.randn(5, 3, 4), config=FAST)
    with pytest.raises(wc.ArchitectureMismatchError, match="member 1: expected LSTM, got GRU"):
        wc.nn.WideLSTM.from_modules([nn.LSTM(4, 6), nn.GRU(4, 6)])


def test_packed_sequences_get_a_clear_error():
    wide = wc.nn.WideGRU.from_modules([nn.GRU(4, 6) for _ in range(2)])
    packed = nn.utils.rnn.pack_padded_sequence(torch.randn(5, 2, 4), [5, 3])
    with pytest.raises(TypeError, match="PackedSequence inputs are not supported"):
        wide(packed)


def test_wrong_state_shapes_name_what_is_wrong():
    wide = wc.nn.WideLSTM.from_modules([nn.LSTM(4, 6) for _ in range(2)])
    x = torch.randn(2, 5, 3, 4)
    with pytest.raises(RuntimeError, match="wide::rnn"):
        wide(x, (torch.zeros(3, 1, 3, 6), torch.zeros(3, 1, 3, 6)))  # N=3 states for 2 members
    with pytest.raises(RuntimeError, match="wide::rnn"):
        wide(x.long())


@pytest.mark.parametrize("cls,kw", [CONFIGS[1], CONFIGS[4], CONFIGS[7], CONFIGS[9]],
                         ids=[IDS[1], IDS[4], IDS[7], IDS[9]])
def test_loop_strategy_matches_members(cls, kw):
    members = make_members(lambda: cls(4, 6, **kw), 3)
    wide_cls = {nn.LSTM: wc.nn.WideLSTM, nn.GRU: wc.nn.WideGRU, nn.RNN: wc.nn.WideRNN}[cls]
    check_equivalence(wide_cls.from_modules(members, strategy="loop"), members,
                      [_sample(kw.get("batch_first", False)) for _ in range(3)])
    with pytest.raises(ValueError, match="expected strategy in"):
        wide_cls.from_modules(members, strategy="winograd")


@pytest.mark.parametrize("strategy", ["fused", "loop"])
def test_compiled_with_a_forced_strategy(strategy):
    models = make_members(lambda: Seq(nn.LSTM, num_layers=2), 3)
    wide, _ = check_compile(models, _sample(False), strict=True, config=FAST.replace(strategy=strategy),
                            modes=("train",), shared=(False,))
    assert set(wide.strategies.values()) == {strategy}


class GRULanguageModel(nn.Module):
    """Seq-first GRU language model: tokens [T, B] -> next-token log-probabilities [T, B, V]."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, 8)
        self.gru = nn.GRU(8, 16, num_layers=2, dropout=0.0)
        self.head = nn.Linear(16, 30)

    def forward(self, tokens, h0):
        out, h = self.gru(self.emb(tokens), h0)
        return self.head(out).log_softmax(-1), h


class RNNClassifier(nn.Module):
    """nn.RNN classifier on the last step's hidden state."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.RNN(5, 12, batch_first=True, nonlinearity="relu")
        self.fc = nn.Linear(12, 3)

    def forward(self, x):
        _, h = self.rnn(x)
        return self.fc(h[-1])


def test_gru_language_model_with_initial_state():
    models = make_members(GRULanguageModel, 3)
    sample = (torch.randint(0, 30, (6, 2)), torch.randn(2, 2, 16))
    wide, _ = check_compile(models, sample, strict=True, config=FAST)
    assert "wide.rnn" in wide.summary()


def test_rnn_classifier():
    models = make_members(RNNClassifier, 4)
    check_compile(models, torch.randn(3, 7, 5), strict=True, config=FAST)


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
def test_loop_results_do_not_depend_on_the_thread_count(cls):
    """Note [Members in parallel] (csrc/wide/ops/rnn.cpp): the loop strategy runs member chunks
    on separate threads; outputs, input and parameter gradients are bit-identical with one thread
    and with two, and equal the members'."""
    members = make_members(lambda: cls(5, 7, num_layers=2, batch_first=True), 5)
    wide = wc.nn.WideLSTM if cls is nn.LSTM else wc.nn.WideGRU
    wide = wide.from_modules(members, strategy="loop")
    x = torch.randn(5, 3, 4, 5)
    threads = torch.get_num_threads()
    results = []
    try:
        for k in (1, 2):
            torch.set_num_threads(k)
            xg = x.clone().requires_grad_()
            out, _ = wide(xg)
            out.square().sum().backward()
            results.append((out.detach(), xg.grad, [p.grad.clone() for p in wide.parameters()]))
            wide.zero_grad()
    finally:
        torch.set_num_threads(threads)
    (o1, gx1, gp1), (o2, gx2, gp2) = results
    assert torch.equal(o1, o2) and torch.equal(gx1, gx2) and all(map(torch.equal, gp1, gp2))
    assert_members_close(o2, [m(x[i])[0] for i, m in enumerate(members)])


def test_loop_in_parallel_keeps_the_callers_grad_mode():
    """Workers run under the caller's thread-local state: no graph under no_grad or
    inference_mode, a graph otherwise."""
    members = make_members(lambda: nn.LSTM(3, 4, batch_first=True), 4)
    wide = wc.nn.WideLSTM.from_modules(members, strategy="loop")
    x = torch.randn(4, 2, 3, 3)
    with torch.no_grad():
        assert wide(x)[0].grad_fn is None
    with torch.inference_mode():
        assert wide(x)[0].is_inference()
    assert wide(x)[0].grad_fn is not None


@cpu_only  # members in parallel are CPU threads; on a GPU the loop runs in order, twice differentiable
def test_loop_in_parallel_gradients_of_states_and_higher_order_refused():
    """MembersInParallel (Note [Members in parallel]): gradcheck of input, initial states and
    parameters in float64 through the parallel backward; create_graph=True is a clear error."""
    torch.set_num_threads(2)
    members = [m.double() for m in make_members(lambda: nn.LSTM(3, 2, num_layers=2, batch_first=True), 3)]
    wide = wc.nn.WideLSTM.from_modules(members, strategy="loop")
    x = torch.randn(3, 2, 4, 3, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(3, 2, 2, 2, dtype=torch.float64, requires_grad=True)
    c0 = torch.randn(3, 2, 2, 2, dtype=torch.float64, requires_grad=True)

    def f(x, h0, c0):
        out, (h, c) = wide(x, (h0, c0))
        return out, h, c

    assert torch.autograd.gradcheck(f, (x, h0, c0))
    out, (h, c) = wide(x, (h0, c0))
    for i, m in enumerate(members):
        mo, (mh, mc) = m(x[i], (h0[i], c0[i]))
        torch.testing.assert_close(out[i], mo), torch.testing.assert_close(c[:, i] if c.dim() == 3 else c[i], mc)
    with pytest.raises(RuntimeError, match="not twice differentiable"):
        torch.autograd.grad(out.sum(), [x], create_graph=True)


@pytest.mark.parametrize("strategy", ["fused", "loop"])
def test_proj_size_not_below_hidden_size_is_refused_by_both_strategies(strategy):
    """nn.LSTM requires proj_size < hidden_size; the wide op says so for every strategy (the loop
    used to fail inside ATen with an unrelated message, the fused one to accept it)."""
    n, h, p = 2, 2, 2
    params = [torch.randn(n, 4 * h, 2), torch.randn(n, 4 * h, p), torch.randn(n, 4 * h), torch.randn(n, 4 * h),
              torch.randn(n, p, h)]
    with pytest.raises(RuntimeError, match="expected proj_size < hidden_size"):
        torch.ops.wide.rnn(torch.randn(n, 3, 1, 2), [], params, "LSTM", 1, False, False, 0.0, False, True, p,
                           strategy=strategy)
