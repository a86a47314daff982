"""Adversarial cases of compile() and of the wide model's input checks (issue 24): models a user
could write that the compiler either got wrong or refused unclearly.

* the member check never changes a user's parameters, Python state or random stream;
* per-member index tensors (a GCN's ``edge_index`` buffer) for index_select/index_add_/
  scatter_add_/scatter_reduce/gather/index_put_ are widened (a strict compile that succeeds runs),
  and the rank check's fake run stops a graph that would fail at its first call;
* ``forward(*args)`` / ``forward(x, **kwargs)`` compile;
* ``check_compile`` compares recurrent models in train mode when their dropout draws nothing;
* ``pack_padded_sequence`` and wrongly nested inputs get errors that say what, where and why.
"""
from __future__ import annotations

import dataclasses
import re
import threading
import warnings

import pytest
import torch
import wide_compiler as wc
from torch import nn
from wide_compiler import testing
from wide_compiler.fx.member_runs import check_run_members
from support import DEVICE, cpu_only

FAST = wc.WideConfig.fast()
N = 3
aten = torch.ops.aten


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- 1. the member check touches nothing of the user's -----------------------------------------
class _Critic(nn.Module):
    """A WGAN critic that clips its own weights in forward and counts its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 1)
        self.calls = 0
        self.history: list[int] = []

    def forward(self, x):
        with torch.no_grad():
            for p in self.parameters():
                p.clamp_(-0.05, 0.05)
        self.calls += 1
        self.history.append(x.shape[0])
        return self.fc2(torch.relu(self.fc1(x)))


def test_member_check_leaves_in_place_weight_clamps_and_call_counters_alone():
    torch.manual_seed(0)
    critics = [_Critic() for _ in range(N)]
    before = [_state(m) for m in critics]
    assert any((v.abs() > 0.05).any() for v in before[0].values())  # the clamp would change them
    wide = wc.compile(critics, torch.randn(5, 4), config=FAST)
    for m, s in zip(critics, before):
        assert _bit_identical(_state(m), s)  # the user's weights, untouched
        assert m.calls == 0 and m.history == []  # and their Python state
    # the wide model starts from the user's (unclamped) weights and clamps in its graph, as the
    # member's next call does
    x = torch.randn(N, 5, 4)
    out = wide(x)
    for i, m in enumerate(critics):
        torch.testing.assert_close(out[i], m(x[i]), rtol=1e-5, atol=1e-6)
        assert m.calls == 1


class _Uncopyable(_Critic):
    """A member that cannot be deep-copied (it holds a lock): the check runs it on clones of its
    tensors and puts its attributes back."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()

    def forward(self, x):
        self.scratch = 1  # an attribute made in forward is removed again
        return super().forward(x)


def test_member_check_of_an_uncopyable_member_restores_its_state():
    torch.manual_seed(0)
    models = [_Uncopyable() for _ in range(N)]
    before = [_state(m) for m in models]
    history = models[0].history
    check_run_members(models, (torch.randn(5, 4),), {})
    for m, s in zip(models, before):
        assert _bit_identical(_state(m), s)
        assert m.calls == 0 and m.history == [] and not hasattr(m, "scratch")
    assert models[0].history is history  # the same object, its contents restored


def test_member_check_leaves_the_random_stream_alone():
    models = [nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)) for _ in range(N)]
    torch.manual_seed(0)
    x = torch.randn(5, 4)
    state = torch.get_rng_state()
    check_run_members(models, (x,), {})
    assert torch.equal(torch.get_rng_state(), state)


# --- 2. per-member index tensors ---------------------------------------------------------------
class _GCN(nn.Module):
    """A graph convolution whose graph is a buffer: each member holds its own copy."""

    def __init__(self, seed: int, nodes: int = 10, edges: int = 20) -> None:
        super().__init__()
        g = torch.Generator(DEVICE).manual_seed(seed)
        self.register_buffer("edge_index", torch.randint(0, nodes, (2, edges), generator=g))
        self.lin = nn.Linear(8, 8)

    def forward(self, x):  # x [nodes, 8]
        src, dst = self.edge_index[0], self.edge_index[1]
        deg = torch.zeros(x.shape[0]).index_add_(0, dst, torch.ones(dst.shape[0])) + 1
        msg = self.lin(x).index_select(0, src)
        out = torch.zeros_like(x).index_add_(0, dst, msg)
        return out / deg.unsqueeze(-1)


def test_gcn_with_a_per_member_edge_index_buffer_compiles_strict_and_runs():
    torch.manual_seed(0)
    models = [_GCN(seed) for seed in range(N)]
    assert not torch.equal(models[0].edge_index, models[1].edge_index)
    wide, report = testing.check_compile(models, torch.randn(10, 8), config=FAST, strict=True)
    assert all(isinstance(r, testing.EquivalenceReport) for r in report.values()), report
    assert wide.fallbacks == []


class _Indexed(nn.Module):
    """One indexing op on a per-member index (a buffer), named by ``op``."""

    def __init__(self, seed: int, op: str) -> None:
        super().__init__()
        g = torch.Generator(DEVICE).manual_seed(seed)
        self.register_buffer("pos", torch.randperm(6, generator=g))  # distinct positions
        self.fc = nn.Linear(6, 6)
        self.op = op

    def forward(self, x):  # x [B, 6]
        h, pos = self.fc(x), self.pos
        idx = pos[:3].expand(h.shape[0], 3)
        if self.op == "index_select":
            return h.index_select(1, pos)
        if self.op == "index_add_":
            return h.clone().index_add_(1, pos[:3], h[:, :3])
        if self.op == "index_add_1d":  # a 1-D target: the index has the rank of self
            return torch.zeros(6).index_add_(0, pos, h[0]) * h
        if self.op == "index_copy":
            return h.index_copy(1, pos[:2], h[:, 4:])
        if self.op == "index_fill":
            return h.index_fill(1, pos[:2], -1.0)
        if self.op == "scatter_add":  # out of place, on a tensor every member shares
            return torch.zeros(h.shape[0], 6).scatter_add(1, idx, h[:, :3])
        if self.op == "scatter_reduce":
            return torch.zeros(h.shape[0], 6).scatter_reduce(1, idx, h[:, :3], "amax", include_self=False)
        if self.op == "gather":  # from a table every member shares
            return torch.linspace(0, 1, 6).expand(h.shape[0], 6).gather(1, idx) * h[:, :3]
        if self.op == "index_put_":
            out = torch.zeros(h.shape[0], 6)
            out[:, pos[:3]] = h[:, :3]
            return out
        if self.op == "index_put_accumulate":
            return torch.zeros(6).index_put_((pos % 2,), h[0], accumulate=True) * h
        if self.op == "index_put_mask":
            out = h.clone()
            out[h > 0] = 0.0
            return out
        raise AssertionError(self.op)


@pytest.mark.parametrize("op", [
    "index_select", "index_add_", "index_add_1d", "index_copy", "index_fill", "scatter_add", "scatter_reduce",
    "gather", "index_put_", "index_put_accumulate", "index_put_mask",
])
def test_per_member_index_ops_are_widened(op):
    torch.manual_seed(0)
    models = [_Indexed(seed, op) for seed in range(N)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fallback either
        wide, report = testing.check_compile(models, torch.randn(4, 6), config=FAST, strict=True)
    assert all(isinstance(r, testing.EquivalenceReport) for r in report.values()), report


def test_a_shared_position_list_on_a_1d_tensor_stays_shared():
    class Degree(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):  # x [5, 4]
            deg = torch.zeros(3).index_add_(0, torch.tensor([0, 1, 1, 2, 2]), self.fc(x)[:, 0])
            return deg.index_select(0, torch.tensor([2, 0]))

    torch.manual_seed(0)
    wide, report = testing.check_compile([Degree() for _ in range(N)], torch.randn(5, 4), config=FAST, strict=True)
    assert all(isinstance(r, testing.EquivalenceReport) for r in report.values()), report


@cpu_only  # out of range on CUDA is a device-side assert, which ends the process's CUDA context
def test_a_per_member_position_out_of_range_raises_and_reads_no_other_member():
    torch.manual_seed(0)
    models = [_Indexed(seed, "index_select") for seed in range(N)]
    wide = wc.compile(models, torch.randn(4, 6), config=FAST, strict=True)
    with torch.no_grad():
        wide.get_buffer("pos")[1, 0] = 6  # member 1's position 6 of a dim of 6: past its end
    with pytest.raises((IndexError, RuntimeError), match="out of"):
        wide(torch.randn(N, 4, 6))


def test_the_rank_checks_fake_run_stops_a_graph_that_would_fail_at_its_first_call(monkeypatch):
    """A rule that widens a position list like a same-rank index (the bug behind issue 24's
    GCN) makes a graph the fake run cannot execute: compile stops, naming the op and the line."""
    from wide_compiler.fx.table import RULES
    from wide_compiler.fx.widen import Wide

    def wrong(ctx, node):
        v = ctx.schema_args(node)
        index = ctx.as_wide(v["index"], 1, node).node  # [N, E]: not a list of positions
        out = ctx.emit(aten.index_add_.default, (v["self"].node, 1, index, ctx.as_wide(v["source"], 1, node).node),
                       like=node)
        return Wide(out, 1)

    monkeypatch.setitem(RULES, aten.index_add_.default, dataclasses.replace(RULES[aten.index_add_.default], fn=wrong))
    with pytest.raises(wc.UnsupportedOperationError) as e:
        wc.compile([_GCN(seed) for seed in range(N)], torch.randn(10, 8), config=FAST, strict=True)
    message = str(e.value)
    assert "index_add_" in message and "test_adversarial_compile.py" in message and "index_add_(0, dst" in message


# --- 3. forward(*args) and forward(x, **kwargs) ------------------------------------------------
class _VarArgs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, *inputs):
        return self.fc(inputs[0]) * inputs[1]


class _VarKwargs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, **options):
        return self.fc(x) * options["scale"] + options["shift"]


class _Both(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, *rest, **options):
        return self.fc(x) + sum(rest) + options.get("bias", 0)


@pytest.mark.parametrize("factory,args,kwargs", [
    (_VarArgs, 2, ()), (_VarKwargs, 1, ("scale", "shift")), (_Both, 3, ("bias",)),
], ids=["args", "kwargs", "args-and-kwargs"])
def test_variadic_forwards_compile(factory, args, kwargs):
    torch.manual_seed(0)
    sample = tuple(torch.randn(5, 4) for _ in range(args))
    sample_kwargs = {k: torch.randn(5, 4) for k in kwargs}
    models = [factory() for _ in range(N)]
    wide, report = testing.check_compile(models, sample, sample_kwargs=sample_kwargs, config=FAST)
    assert all(isinstance(r, testing.EquivalenceReport) for r in report.values()), report
    # and another batch size: the batch is dynamic
    xs = [torch.randn(N, 7, 4) for _ in range(args)]
    kw = {k: torch.randn(N, 7, 4) for k in kwargs}
    out = wide(*xs, **kw)
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m(*(x[i] for x in xs), **{k: v[i] for k, v in kw.items()}),
                                   rtol=1e-5, atol=1e-5)


def test_a_sample_that_does_not_fit_a_variadic_forward_says_so():
    class Positional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x, *rest):
            return self.fc(x)

    with pytest.raises(wc.WideCompileError, match=r"member 0 \(Positional\) cannot take the sample: its "
                                                  r"forward\(x, \*rest\).*'y'"):
        wc.compile([Positional() for _ in range(N)], torch.randn(5, 4), sample_kwargs={"y": torch.randn(5, 4)},
                   config=FAST)


# --- 4. recurrent models are compared in train mode when dropout draws nothing -----------------
class _Recurrent(nn.Module):
    def __init__(self, cls, layers: int, dropout: float) -> None:
        super().__init__()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns about dropout with one layer
            self.rnn = cls(4, 5, num_layers=layers, dropout=dropout, batch_first=True)
        self.fc = nn.Linear(5, 2)

    def forward(self, x):
        return self.fc(self.rnn(x)[0])


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU], ids=["lstm", "gru"])
@pytest.mark.parametrize("layers,dropout", [(2, 0.0), (1, 0.0), (1, 0.5)])
def test_check_compile_compares_deterministic_recurrent_models_in_train_mode(cls, layers, dropout):
    torch.manual_seed(0)
    models = [_Recurrent(cls, layers, dropout) for _ in range(N)]
    _, report = testing.check_compile(models, torch.randn(2, 6, 4), config=FAST, modes=("train",))
    assert isinstance(report["train/own"], testing.EquivalenceReport), report["train/own"]
    assert isinstance(report["train/shared"], testing.EquivalenceReport), report["train/shared"]


def test_check_compile_compares_recurrent_dropout_that_draws_with_fixed_draws():
    torch.manual_seed(0)
    x = torch.randn(2, 6, 4)
    drawing = [_Recurrent(nn.LSTM, 2, 0.5) for _ in range(N)]  # dropout between two layers
    _, report = testing.check_compile(drawing, x, config=FAST, modes=("train",), shared=False)
    assert not isinstance(report["train/own"], str)  # compared (Note [Fixed draws in the trust check])
    assert testing.random_ops(wc.compile(drawing, x, config=FAST)) == ["aten.lstm.input"]
    quiet = [_Recurrent(nn.LSTM, 2, 0.0) for _ in range(N)]
    assert testing.random_ops(wc.compile(quiet, x, config=FAST)) == []


# --- 5. pack_padded_sequence -----------------------------------------------------------------
class _Packed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(4, 5, batch_first=True)

    def forward(self, x, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.rnn(packed)
        return nn.utils.rnn.pad_packed_sequence(out, batch_first=True)[0]


def test_pack_padded_sequence_gets_a_clear_error():
    with pytest.raises(wc.WideCompileError) as e:
        # pack_padded_sequence takes its lengths on the CPU only, whatever the device of the data
        wc.compile([_Packed() for _ in range(N)], (torch.randn(3, 6, 4), torch.tensor([6, 4, 2], device="cpu")),
                   config=FAST)
    message = str(e.value)
    assert "PackedSequence" in message and "pack_padded_sequence" in message  # what
    assert "test_adversarial_compile.py" in message and "self.rnn(packed)" in message  # where
    assert "module 'rnn'" in message
    assert "Why:" in message and "What to do:" in message and "mask" in message


# --- 6. inputs nested unlike the sample --------------------------------------------------------
class _WithState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(4, 5, batch_first=True)

    def forward(self, x, state):
        return self.rnn(x, state)[0]


@pytest.fixture(scope="module")
def lstm_wide():
    torch.manual_seed(0)
    sample = (torch.randn(3, 6, 4), (torch.zeros(1, 3, 5), torch.zeros(1, 3, 5)))
    return wc.compile([_WithState() for _ in range(N)], sample, config=FAST)


def test_h0_alone_where_the_sample_had_h0_and_c0_names_the_expected_structure(lstm_wide):
    h0 = torch.zeros(N, 1, 3, 5)
    with pytest.raises(ValueError) as e:
        lstm_wide(torch.randn(N, 3, 6, 4), h0)
    message = str(e.value)
    assert re.search(r"positional input 1 is a tensor \[3, 1, 3, 5\], but in the sample it is a tuple of 2", message)
    assert "got 2 positional" not in message  # the old message contradicted itself


def test_a_list_of_member_tensors_where_the_sample_had_one_tensor_points_to_stack(lstm_wide):
    state = (torch.zeros(N, 1, 3, 5), torch.zeros(N, 1, 3, 5))
    with pytest.raises(ValueError, match=r"positional input 0 is a list of 3 .*in the sample it is a tensor "
                                         r"\[3, 6, 4\].*wide_compiler\.stack"):
        lstm_wide([torch.randn(3, 6, 4) for _ in range(N)], state)


def test_keywords_in_another_order_than_the_samples_are_accepted():
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x, a=None, b=None):
            return self.fc(x) * a - b

    torch.manual_seed(0)
    models = [Two() for _ in range(N)]
    sample = torch.randn(5, 4)
    wide = wc.compile(models, sample, sample_kwargs={"a": torch.randn(5, 4), "b": torch.randn(5, 4)}, config=FAST)
    x, a, b = (torch.randn(N, 5, 4) for _ in range(3))
    out = wide(x, b=b, a=a)
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m(x[i], a=a[i], b=b[i]), rtol=1e-5, atol=1e-5)


def test_compile_and_mode_switches_under_no_grad_tune_training_graphs():
    """A training graph's tuning runs backward: compiling (or switching to train mode) inside
    ``torch.no_grad()`` must not make it fail, and the result matches the members."""
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)) for _ in range(3)]
    x = torch.randn(4, 16)
    config = wc.WideConfig(tune=True, tune_budget_s=0.5, tune_repeats=2)
    with torch.no_grad():
        wide = wc.compile(members, x, config=config)  # members in train mode: a training graph
        wide.eval()
        wide.train()
    assert wide.training
    out = wide(x.expand(3, *x.shape))
    out.sum().backward()
    for i, m in enumerate(members):
        torch.testing.assert_close(out[i], m(x))
    assert wide.get_parameter("0.weight").grad is not None
