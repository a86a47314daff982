"""Mixed precision: under ``torch.autocast`` a wide model returns what each member returns under the
same autocast, dtype included, in inference and training (Note [wide autocast] in
csrc/wide/ops/autocast.cpp); each wide op's autocast kernel casts as ATen's autocast casts the op it
replaces. Values are compared with the bfloat16 tolerances of :mod:`wide_compiler.testing`."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from support import DEVICE, OpRecorder, cpu_only
from torch import nn
from torch.library import opcheck
from torch.utils._pytree import tree_flatten

import wide_compiler as wc
from wide_compiler.testing import assert_members_close, assert_trees_members_close, make_members

wide = torch.ops.wide
BF16 = torch.bfloat16
N = 3
FAST = wc.WideConfig.fast()
# PyTorch's own LSTM under CPU autocast needs oneDNN's bfloat16 support: without it (an AVX2 AMD
# EPYC, torch 2.13) a float32 input raises "could not create a primitive descriptor for the LSTM
# forward propagation primitive" and a bfloat16 one with float32 states comes back float32, so
# those cases have no reference there (the wide op runs them)
NO_BF16_LSTM = not torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _skip_without_bf16_lstm(float32_input: bool, state_given: bool) -> None:
    if NO_BF16_LSTM and (float32_input or state_given):
        pytest.skip("PyTorch's own LSTM under CPU autocast fails on this CPU (no oneDNN bfloat16)")


def autocast(device: str = DEVICE.type, dtype: torch.dtype = BF16):
    """Autocast on the suite's device (bfloat16 by default: CPU autocast's, and CUDA's other
    dtype; the CUDA section below runs float16)."""
    return torch.autocast(device, dtype=dtype)


# --------------------------------------------------------------------------------------------
# Compiled models: an MLP, a conv net with BatchNorm, a transformer encoder
# --------------------------------------------------------------------------------------------
def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))


def encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


MODELS = {"mlp": (mlp, (4, 16)), "cnn": (cnn, (2, 3, 16, 16)), "encoder": (encoder, (2, 5, 16))}


class _FastPathOff:
    """nn.TransformerEncoderLayer's inference fast path (eval, no grad) checks autocast with
    torch.is_autocast_enabled(), which reads CUDA's state only, so under CPU autocast members take
    it and return bfloat16 where the standard path (and so the captured program) returns float32
    (pytorch/pytorch#191796, fixed upstream after 2.13): the reference runs the standard path."""
    def __enter__(self):
        self.before = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)

    def __exit__(self, *exc):
        torch.backends.mha.set_fastpath_enabled(self.before)


def _params(module: nn.Module) -> dict[str, torch.Tensor]:
    return dict(module.named_parameters())


@pytest.mark.parametrize("mode", ["eval", "no_grad", "train"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_compiled_model_matches_members_under_autocast(name, mode):
    factory, shape = MODELS[name]
    members = make_members(factory, N)
    for m in members:
        m.train(mode == "train")
    model = wc.compile(members, torch.randn(shape), config=FAST)
    xs = torch.randn(N, *shape)
    grad = torch.no_grad() if mode == "no_grad" else contextlib.nullcontext()
    with grad, autocast():
        out = model(xs)
        with _FastPathOff() if (name, mode) == ("encoder", "no_grad") else contextlib.nullcontext():
            refs = [m(xs[i]) for i, m in enumerate(members)]
    assert out.dtype == refs[0].dtype, (out.dtype, refs[0].dtype)
    assert_members_close(out, refs, BF16)
    if mode != "train":
        return
    # Gradients: one cotangent per member; the members' BatchNorm buffers moved as the wide ones.
    cot = torch.randn(refs[0].shape) / refs[0].numel()
    (out.float() * cot).sum().backward()
    for i, m in enumerate(members):
        (refs[i].float() * cot).sum().backward()
    wide_params = _params(model)
    for pname, p in _params(members[0]).items():
        assert_members_close(wide_params[pname].grad, [_params(m)[pname].grad for m in members], BF16,
                             kind="grad", what=f"{pname}.grad")
    wide_buffers = dict(model.named_buffers())
    for bname, b in members[0].named_buffers():
        if b.is_floating_point():
            assert_members_close(wide_buffers[bname], [dict(m.named_buffers())[bname] for m in members], BF16,
                                 kind="buffer", what=bname)


class _Recurrent(nn.Module):
    """A projection into a recurrent layer (the layer gets a bfloat16 input under autocast) whose
    module makes its own zero state, or a state the forward makes (float32, as written)."""

    def __init__(self, kind: str, own_state: bool = False):
        super().__init__()
        self.kind, self.own_state = kind, own_state
        self.proj = nn.Linear(6, 8)
        self.rnn = getattr(nn, kind)(8, 5, **({} if kind.endswith("Cell") else {"batch_first": True}))

    def forward(self, x):
        h = self.proj(x)
        if self.kind.endswith("Cell"):
            out = self.rnn(h)
            return out if isinstance(out, tuple) else (out,)
        state = torch.zeros(1, x.shape[0], 5) if self.own_state else None
        out, state = self.rnn(h, state)
        return (out, *state) if isinstance(state, tuple) else (out, state)


RECURRENT = {"gru": ("GRU", False, (2, 4, 6)), "gru_given_state": ("GRU", True, (2, 4, 6)),
             "lstm": ("LSTM", False, (2, 4, 6)), "rnn": ("RNN", False, (2, 4, 6)),
             "lstm_cell": ("LSTMCell", False, (2, 6)), "gru_cell": ("GRUCell", False, (2, 6))}


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("name", sorted(RECURRENT))
def test_compiled_recurrent_models_under_autocast(name, mode):
    """ATen's CPU GRU and LSTM/GRU cells keep their state's dtype: zeros the module makes have the
    input's dtype (bfloat16 after an autocast layer), a float32 state given keeps them float32."""
    kind, own_state, shape = RECURRENT[name]
    members = make_members(lambda: _Recurrent(kind, own_state), N)
    for m in members:
        m.train(mode == "train")
    model = wc.compile(members, torch.randn(shape), config=FAST)
    xs = torch.randn(N, *shape)
    with autocast():
        out = model(xs)
        refs = [m(xs[i]) for i, m in enumerate(members)]
    assert [t.dtype for t in out] == [t.dtype for t in refs[0]]
    assert_trees_members_close(out, refs, BF16)


_FLOAT32_STATE = {"gru": lambda: nn.GRU(4, 6, batch_first=True), "gru_2_layers_bidirectional":
                  lambda: nn.GRU(4, 6, num_layers=2, bidirectional=True), "gru_cell": lambda: nn.GRUCell(4, 6),
                  "lstm_cell": lambda: nn.LSTMCell(4, 6),
                  # ATen's composite LSTM (oneDNN has no projections): probe 11, P11-2, 3.7e-3 off before
                  "lstm_projections": lambda: nn.LSTM(4, 6, proj_size=3, batch_first=True),
                  "lstm_projections_2_layers": lambda: nn.LSTM(4, 6, num_layers=2, proj_size=3),
                  # a step's rounding in 40-50% of the elements before (probe 11, P11-2 addendum)
                  "rnn": lambda: nn.RNN(4, 6, batch_first=True),
                  "rnn_relu_2_layers": lambda: nn.RNN(4, 6, num_layers=2, nonlinearity="relu"),
                  "rnn_cell": lambda: nn.RNNCell(4, 6)}


@cpu_only
@pytest.mark.parametrize("input_dtype", [torch.float32, BF16], ids=["f32_input", "bf16_input"])
@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("name", sorted(_FLOAT32_STATE))
def test_recurrent_ops_under_cpu_autocast_are_the_members_bit_for_bit(name, mode, input_dtype):
    """Note [Recurrent ops under CPU autocast] (csrc/wide/ops/autocast.cpp): ATen's CPU GRU,
    Elman RNNs, LSTM with projections and cells compute their gates in bfloat16 and carry a state
    of its own dtype; the wide model returns the members' values exactly, and their input and
    weight gradients (independent probes, P10-1: the wide kernel run in float32 was 5e-3 off;
    weight gradients summed over time steps in float32 instead of the members' bfloat16 were 1e-2
    off; P11-2: an LSTM with projections 3.7e-3; Elman RNNs a step's rounding)."""
    shape = (2, 5, 4) if "cell" not in name else (2, 4)
    members = make_members(_FLOAT32_STATE[name], 2)
    for m in members:
        m.train(mode == "train")
    wide = wc.compile(members, torch.randn(shape), config=FAST).train(mode == "train")
    xs = (torch.randn(2, *shape) * 3).to(input_dtype).requires_grad_()
    leaves = [x.detach().clone().requires_grad_() for x in xs]
    with autocast():
        outs = tree_flatten(wide(xs))[0]  # the output and every final state
        refs = [tree_flatten(m(x))[0] for m, x in zip(members, leaves)]
    assert [t.dtype for t in outs] == [t.dtype for t in refs[0]]
    sum(t.float().sum() for t in outs).backward()
    sum(t.float().sum() for ref in refs for t in ref).backward()
    for i, (m, ref) in enumerate(zip(members, refs)):
        for k, (got, want) in enumerate(zip(outs, ref)):
            assert torch.equal(got[i], want), (i, k, (got[i].float() - want.float()).abs().max())
        assert torch.equal(xs.grad[i], leaves[i].grad)
        for pname, p in m.named_parameters():
            assert torch.equal(wide.get_parameter(pname).grad[i], p.grad), (pname, i)


def test_default_config_conv_net_returns_members_dtype():
    """The measured strategies (the default config) under autocast, eval graph with its folds."""
    members = make_members(cnn, N)
    for m in members:
        m.eval()
    model = wc.compile(members, torch.randn(2, 3, 16, 16))
    xs = torch.randn(N, 2, 3, 16, 16)
    with torch.no_grad(), autocast():
        out = model(xs)
        refs = [m(xs[i]) for i, m in enumerate(members)]
    assert out.dtype == refs[0].dtype == BF16
    assert_members_close(out, refs, BF16)


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_training_steps_under_autocast_match_members(name):
    """SGD on the wide model with a bfloat16 autocast forward ends where per-member SGD ends."""
    factory, shape = MODELS[name]
    members = make_members(factory, N)
    model = wc.compile(members, torch.randn(shape), config=FAST)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in members]
    classes = 4 if name == "mlp" else 5
    for step in range(3):
        xs = torch.randn(N, *shape)
        ys = torch.randint(0, classes, (N, shape[0]))
        with autocast():
            out = model(xs)
            loss = wc.optim.member_losses(F.cross_entropy, out, ys).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        for i, m in enumerate(members):
            with autocast():
                member_loss = F.cross_entropy(m(xs[i]), ys[i])
            opts[i].zero_grad()
            member_loss.backward()
            opts[i].step()
    wide_params = _params(model)
    for pname in _params(members[0]):
        assert_members_close(wide_params[pname], [_params(m)[pname] for m in members], BF16,
                             kind="grad", what=pname)


@cpu_only
def test_autocast_inside_forward_is_kept():
    """An autocast region captured inside a member's forward runs as it does in the member."""

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 3)

        def forward(self, x):
            with torch.autocast("cpu", dtype=BF16):
                h = torch.relu(self.a(x))
            return self.b(h.float()), h

    members = make_members(Mixed, N)
    model = wc.compile(members, torch.randn(4, 8), config=FAST)
    xs = torch.randn(N, 4, 8)
    out = model(xs)
    refs = [m(xs[i]) for i, m in enumerate(members)]
    assert [t.dtype for t in out] == [torch.float32, BF16]
    assert_trees_members_close(out, refs, BF16)


# Note [A dtype the forward reads] (fx/export_watch.py): each form reads the dtype of a Linear's
# output, float32 at capture and bfloat16 under autocast; before, the graph kept float32 (or the
# branch float32 took) and member 0 was 0.002 to 2.4 off, silently
DTYPE_READS = {
    "dtype": lambda h, x: h * torch.arange(1, 5, dtype=h.dtype, device=h.device),
    "to(other)": lambda h, x: h + x.to(h),
    "new_tensor": lambda h, x: h * h.new_tensor([1.0, 2.0, 3.0, 4.0]),
    "branch": lambda h, x: h * 2 if h.dtype == BF16 else h,
    "element_size": lambda h, x: h * h.element_size(),
    "itemsize": lambda h, x: h * h.itemsize,
    "nbytes": lambda h, x: h * h[0, 0].nbytes,
    "type()": lambda h, x: h * 2 if h.type().endswith("BFloat16Tensor") else h,
    "finfo": lambda h, x: h + torch.finfo(h.dtype).eps * 1000,
}


class _ReadsADtype(nn.Module):
    def __init__(self, read):
        super().__init__()
        self.lin, self.read = nn.Linear(4, 4), read

    def forward(self, x):
        return self.read(self.lin(x), x)


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("read", sorted(DTYPE_READS))
def test_a_dtype_the_forward_reads_follows_autocast(read, mode):
    """Note [A dtype the forward reads]: a graph captured outside autocast is captured again under
    it, where the forward reads the dtype the member reads: outputs (dtype included) and gradients
    are the members', in calls in and out of autocast in turn."""
    members = make_members(lambda: _ReadsADtype(DTYPE_READS[read]), N)
    model = wc.compile(members, torch.randn(3, 4), config=FAST).train(mode == "train")
    for m in members:
        m.train(mode == "train")
    for enabled in (False, True, False, True):
        xs = torch.randn(N, 3, 4, requires_grad=True)
        with torch.autocast(DEVICE.type, dtype=BF16, enabled=enabled):
            out = model(xs)
            refs = [m(xs[i]) for i, m in enumerate(members)]
        assert out.dtype == refs[0].dtype, (enabled, out.dtype, refs[0].dtype)
        assert_members_close(out, refs, out.dtype)
        if mode == "train":
            (g,) = torch.autograd.grad(out.float().sum(), xs)
            for i, r in enumerate(refs):
                (gi,) = torch.autograd.grad(r.float().sum(), xs)
                assert_members_close(g[i:i + 1], [gi[i]], BF16 if enabled else torch.float32, kind="grad")


def test_a_dtype_the_forward_reads_under_torch_compile_fullgraph():
    """The autocast guard a dtype read adds is read as a constant under torch.compile (Dynamo
    cannot trace ``torch.is_autocast_enabled("cpu")``: fullgraph=True failed on such forwards), and
    Dynamo traces again when the autocast state changes: the compiled model takes the graph
    captured (eagerly) for each state."""
    members = make_members(lambda: _ReadsADtype(DTYPE_READS["dtype"]), N)
    model = wc.compile(members, torch.randn(3, 4), config=FAST)
    xs = torch.randn(N, 3, 4)
    for enabled in (False, True):  # each state's graph captured outside torch.compile
        with torch.autocast(DEVICE.type, dtype=BF16, enabled=enabled):
            model(xs)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    for enabled in (False, True, False):
        with torch.autocast(DEVICE.type, dtype=BF16, enabled=enabled):
            out = compiled(xs)
            refs = [m(xs[i]) for i, m in enumerate(members)]
        assert out.dtype == refs[0].dtype
        assert_members_close(out, refs, out.dtype)


def test_a_padded_model_that_reads_a_dtype_refuses_autocast_naming_the_read():
    """A padded model does not capture again: under autocast it refuses, saying that a dtype
    read counts, rather than run the dtype of capture time."""
    members = [_Widths(h) for h in (4, 6)]
    model = wc.compile(members, torch.randn(3, 4), config=FAST, pad=True)
    xs = torch.randn(2, 3, 4)
    model(xs)  # outside autocast: runs
    with torch.autocast(DEVICE.type, dtype=BF16), pytest.raises(ValueError, match="or a tensor's dtype, which autocast changes"):
        model(xs)


class _Widths(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.lin = nn.Linear(4, h)

    def forward(self, x):
        h = self.lin(x)
        return h * torch.tensor(2.0, dtype=h.dtype, device=h.device)


# --------------------------------------------------------------------------------------------
# Hand-built wide modules (wc.nn)
# --------------------------------------------------------------------------------------------
def _seq_cells():
    return [
        ("WideLinear", lambda: nn.Linear(6, 5), (4, 6)),
        ("WideConv2d", lambda: nn.Conv2d(3, 4, 3, padding=1), (2, 3, 6, 6)),
        ("WideConvTranspose2d", lambda: nn.ConvTranspose2d(3, 4, 3), (2, 3, 5, 5)),
        ("WideBatchNorm2d", lambda: nn.BatchNorm2d(3), (2, 3, 4, 4)),
        ("WideGroupNorm", lambda: nn.GroupNorm(2, 4), (2, 4, 5)),
        ("WideInstanceNorm1d", lambda: nn.InstanceNorm1d(4, affine=True), (2, 4, 5)),
        ("WideLayerNorm", lambda: nn.LayerNorm(6), (2, 3, 6)),
        ("WideRMSNorm", lambda: nn.RMSNorm(6), (2, 3, 6)),
        ("WidePReLU", lambda: nn.PReLU(3), (2, 3, 5)),
        ("WideLSTM", lambda: nn.LSTM(6, 5, num_layers=2, batch_first=True), (2, 4, 6)),
        ("WideLSTM:proj", lambda: nn.LSTM(6, 5, num_layers=2, proj_size=3), (4, 2, 6)),  # no oneDNN in ATen
        ("WideGRU", lambda: nn.GRU(6, 5, bidirectional=True), (4, 2, 6)),
        ("WideRNN", lambda: nn.RNN(6, 5), (4, 2, 6)),
        ("WideLSTMCell", lambda: nn.LSTMCell(6, 5), (2, 6)),
        ("WideGRUCell", lambda: nn.GRUCell(6, 5), (2, 6)),
        ("WideRNNCell", lambda: nn.RNNCell(6, 5), (2, 6)),
    ]


@pytest.mark.parametrize("bf16_input", [False, True], ids=["f32_input", "bf16_input"])
@pytest.mark.parametrize("cls,factory,shape", _seq_cells(), ids=[c[0] for c in _seq_cells()])
def test_hand_built_modules_under_autocast(cls, factory, shape, bf16_input):
    if cls == "WideLSTM":
        _skip_without_bf16_lstm(not bf16_input, False)
    members = make_members(factory, N)
    module = getattr(wc.nn, cls.split(":")[0]).from_modules(members)
    xs = torch.randn(N, *shape, dtype=BF16 if bf16_input else torch.float32)
    with autocast():
        out = module(xs)
        refs = [m(xs[i]) for i, m in enumerate(members)]
    assert_trees_members_close(out, refs, BF16)
    # Gradients (one cotangent per output leaf) reach the float32 parameters as the members'.
    leaves = tree_flatten(out)[0]
    cots = [torch.randn(t.shape[1:]) / t[0].numel() for t in leaves]
    sum((t.float() * c).sum() for t, c in zip(leaves, cots)).backward()
    for i, m in enumerate(members):
        sum((t.float() * c).sum() for t, c in zip(tree_flatten(refs[i])[0], cots)).backward()
    wide_params = _params(module)
    for pname in _params(members[0]):
        assert wide_params[pname].grad.dtype == torch.float32
        assert_members_close(wide_params[pname].grad, [_params(m)[pname].grad for m in members], BF16,
                             kind="grad", what=f"{cls}.{pname}.grad")


def test_hand_built_embedding_and_attention_under_autocast():
    embs = make_members(lambda: nn.Embedding(10, 6), N)
    idx = torch.randint(0, 10, (N, 2, 5))
    with autocast():
        out = wc.nn.WideEmbedding.from_modules(embs)(idx)
        refs = [m(idx[i]) for i, m in enumerate(embs)]
    assert out.dtype == refs[0].dtype == torch.float32  # ATen does not cast embeddings
    assert_members_close(out, refs, BF16)

    mhas = make_members(lambda: nn.MultiheadAttention(8, 2, batch_first=True), N)
    module = wc.nn.WideMultiheadAttention.from_modules(mhas)
    x, mask, kpm = torch.randn(N, 2, 5, 8), torch.randn(5, 5), torch.rand(2, 5) > 0.7
    for need_weights in (False, True):
        for masks in ({}, {"attn_mask": mask, "key_padding_mask": kpm}):
            with autocast():
                out, weights = module(x, x, x, need_weights=need_weights, **masks)
                refs = [m(x[i], x[i], x[i], need_weights=need_weights, **masks) for i, m in enumerate(mhas)]
            assert out.dtype == refs[0][0].dtype == BF16
            assert_members_close(out, [r[0] for r in refs], BF16)
            if need_weights:  # the attention weights too (a float mask is added in the scores' dtype)
                assert_members_close(weights, [r[1] for r in refs], BF16, what="weights")


# --------------------------------------------------------------------------------------------
# Each op's autocast kernel, called through torch.ops.wide, against the ATen op it replaces
# --------------------------------------------------------------------------------------------
def _stack(members, name):
    return torch.stack([getattr(m, name).detach() for m in members])


def _nfirst(y):
    return wide.to_nfirst(y, N)


def _op_cases():
    """(name, wide call, member call i -> reference) over inputs of activation dtype ``act``."""
    cases = {}

    def case(fn):
        cases[fn.__name__] = fn
        return fn

    @case
    def linear(act):
        ms = make_members(lambda: nn.Linear(6, 5), N)
        x = torch.randn(N, 4, 6, dtype=act)
        return (lambda: wide.linear(x, _stack(ms, "weight"), _stack(ms, "bias")),
                lambda i: ms[i](x[i]))

    @case
    def conv(act):
        ms = make_members(lambda: nn.Conv2d(3, 4, 3, padding=1), N)
        x = torch.randn(N, 2, 3, 5, 5, dtype=act)
        return (lambda: _nfirst(wide.conv(x, _stack(ms, "weight"), _stack(ms, "bias"), [1, 1], [1, 1], [1, 1], 1)),
                lambda i: ms[i](x[i]))

    @case
    def conv_transpose(act):
        ms = make_members(lambda: nn.ConvTranspose1d(3, 4, 3, stride=2), N)
        x = torch.randn(N, 2, 3, 5, dtype=act)
        return (lambda: _nfirst(wide.conv_transpose(x, _stack(ms, "weight"), _stack(ms, "bias"), [2], [0], [0], 1,
                                                    [1])),
                lambda i: ms[i](x[i]))

    @case
    def prelu(act):
        ms = make_members(lambda: nn.PReLU(3, init=0.1), N)
        for k, m in enumerate(ms):
            m.weight.data.add_(0.1 * k)
        x = torch.randn(N, 2, 3, 4, dtype=act)
        return (lambda: _nfirst(wide.prelu(x, _stack(ms, "weight"))), lambda i: ms[i](x[i]))

    @case
    def batch_norm(act):
        ms = make_members(lambda: nn.BatchNorm1d(3), N)
        for m in ms:
            m.weight.data.uniform_(0.5, 1.5)
        rm, rv = torch.zeros(N, 3), torch.ones(N, 3)
        x = torch.randn(N, 4, 3, 5, dtype=act)
        return (lambda: _nfirst(wide.batch_norm(x, _stack(ms, "weight"), _stack(ms, "bias"), rm, rv, True, 0.1,
                                                1e-5)),
                lambda i: ms[i](x[i]))

    @case
    def instance_norm(act):
        ms = make_members(lambda: nn.InstanceNorm1d(3, affine=True), N)
        x = torch.randn(N, 4, 3, 5, dtype=act)
        return (lambda: _nfirst(wide.instance_norm(x, _stack(ms, "weight"), _stack(ms, "bias"), None, None, True,
                                                   0.1, 1e-5)),
                lambda i: ms[i](x[i]))

    @case
    def group_norm(act):
        ms = make_members(lambda: nn.GroupNorm(2, 4), N)
        x = torch.randn(N, 2, 4, 5, dtype=act)
        return (lambda: _nfirst(wide.group_norm(x, N, 2, _stack(ms, "weight"), _stack(ms, "bias"), 1e-5)),
                lambda i: ms[i](x[i]))

    def nfirst_group_norm(op):  # group_norm_nfirst and its kernel, fused_group_norm: N-first in and out
        def build(act):
            ms = make_members(lambda: nn.GroupNorm(2, 4), N)
            x = torch.randn(N, 2, 4, 5, dtype=act)
            return (lambda: op(x, 2, _stack(ms, "weight"), _stack(ms, "bias"), 1e-5), lambda i: ms[i](x[i]))
        return build

    cases["group_norm_nfirst"] = nfirst_group_norm(wide.group_norm_nfirst)
    cases["fused_group_norm"] = nfirst_group_norm(wide.fused_group_norm)

    @case
    def layer_norm(act):
        ms = make_members(lambda: nn.LayerNorm(6), N)
        x = torch.randn(N, 2, 3, 6, dtype=act)
        return (lambda: wide.layer_norm(x, [6], _stack(ms, "weight"), _stack(ms, "bias"), 1e-5),
                lambda i: ms[i](x[i]))

    @case
    def rms_norm(act):
        ms = make_members(lambda: nn.RMSNorm(6), N)
        x = torch.randn(N, 2, 3, 6, dtype=act)
        return (lambda: wide.rms_norm(x, [6], _stack(ms, "weight")), lambda i: ms[i](x[i]))

    @case
    def add_layer_norm(act):
        # A bfloat16 sublayer output plus the float32 residual: the member's sum is float32.
        ms = make_members(lambda: nn.LayerNorm(6), N)
        x, r = torch.randn(N, 2, 6, dtype=act), torch.randn(N, 2, 6)
        return (lambda: wide.add_layer_norm(x, r, [6], _stack(ms, "weight"), _stack(ms, "bias"), 1e-5),
                lambda i: ms[i](x[i] + r[i]))

    @case
    def fused_norm(act):
        ms = make_members(lambda: nn.LayerNorm(6), N)
        x, r = torch.randn(N, 2, 6, dtype=act), torch.randn(N, 2, 6, dtype=act)
        return (lambda: wide.fused_norm(x, r, 6, _stack(ms, "weight"), _stack(ms, "bias"), 1e-5),
                lambda i: ms[i](x[i] + r[i]))

    @case
    def attention(act):
        q, k, v = (torch.randn(N * 2, 2, 5, 4, dtype=act) for _ in range(3))
        return (lambda: wide.attention(q, k, v).unflatten(0, (N, 2)),
                lambda i: F.scaled_dot_product_attention(q[2 * i:2 * i + 2], k[2 * i:2 * i + 2], v[2 * i:2 * i + 2]))

    @case
    def small_attention(act):
        q, k, v = (torch.randn(N * 2, 2, 5, 4, dtype=act) for _ in range(3))
        return (lambda: wide.small_attention(q, k, v).unflatten(0, (N, 2)),
                lambda i: F.scaled_dot_product_attention(q[2 * i:2 * i + 2], k[2 * i:2 * i + 2], v[2 * i:2 * i + 2]))

    @case
    def embedding(act):
        ms = make_members(lambda: nn.Embedding(10, 4), N)
        idx = torch.randint(0, 10, (N, 2, 3))
        return (lambda: wide.embedding(_stack(ms, "weight"), idx), lambda i: ms[i](idx[i]))

    @case
    def embedding_bag(act):
        ms = make_members(lambda: nn.EmbeddingBag(10, 4), N)
        idx = torch.randint(0, 10, (N, 2, 3))
        return (lambda: wide.embedding_bag(_stack(ms, "weight"), idx, mode=1), lambda i: ms[i](idx[i]))  # mean

    def recurrent(mode, given_state):
        def build(act):
            ms = make_members(lambda: getattr(nn, mode)(6, 5), N)
            params = [torch.stack([m._flat_weights[k].detach() for m in ms]) for k in range(len(ms[0]._flat_weights))]
            x = torch.randn(N, 4, 2, 6, dtype=act)
            h0 = torch.randn(N, 1, 2, 5)
            hx = ([h0, torch.randn(N, 1, 2, 5)] if mode == "LSTM" else [h0]) if given_state else []
            wide_mode = {"RNN": "RNN_TANH"}.get(mode, mode)

            def member(i):
                state = None
                if given_state:
                    state = (hx[0][i], hx[1][i]) if mode == "LSTM" else hx[0][i]
                return ms[i](x[i], state)

            return (lambda: wide.rnn(x, hx, params, wide_mode, 1, False, False, 0.0, False, True), member)
        return build

    def cell(mode, given_state):
        def build(act):
            ms = make_members(lambda: getattr(nn, mode + "Cell")(6, 5), N)
            x = torch.randn(N, 2, 6, dtype=act)
            hx = ([torch.randn(N, 2, 5) for _ in range(2 if mode == "LSTM" else 1)]) if given_state else []
            wide_mode = {"RNN": "RNN_TANH"}.get(mode, mode)

            def member(i):
                state = None
                if given_state:
                    state = (hx[0][i], hx[1][i]) if mode == "LSTM" else hx[0][i]
                out = ms[i](x[i], state)
                return list(out) if isinstance(out, tuple) else [out]

            return (lambda: wide.rnn_cell(x, hx, _stack(ms, "weight_ih"), _stack(ms, "weight_hh"),
                                          _stack(ms, "bias_ih"), _stack(ms, "bias_hh"), mode=wide_mode), member)
        return build

    for mode in ("LSTM", "GRU", "RNN"):
        for given in (False, True):
            suffix = "_state" if given else ""
            cases[f"rnn_{mode.lower()}{suffix}"] = recurrent(mode, given)
            cases[f"rnn_cell_{mode.lower()}{suffix}"] = cell(mode, given)
    return cases


OP_CASES = _op_cases()


def _per_member(wide_out, refs):
    """Member-major references regrouped to the wide op's structure (tensor, tuple or list)."""
    if isinstance(wide_out, torch.Tensor):
        return refs
    if isinstance(wide_out, tuple) and isinstance(wide_out[1], list):  # wide.rnn: (output, [h_n(, c_n)])
        return [(r[0], list(r[1]) if isinstance(r[1], tuple) else [r[1]]) for r in refs]
    return refs


@pytest.mark.parametrize("act", [torch.float32, BF16], ids=["f32_activation", "bf16_activation"])
@pytest.mark.parametrize("name", sorted(OP_CASES))
def test_op_autocast_kernel_matches_aten(name, act):
    """Under CPU autocast each wide op returns the dtype (and values) of the ATen op it replaces,
    for a float32 input and for a bfloat16 one (the output of an earlier autocast op)."""
    if name.startswith("rnn_lstm"):
        _skip_without_bf16_lstm(act is torch.float32, name.endswith("_state"))
    torch.manual_seed(0)
    wide_call, member_call = OP_CASES[name](act)
    with torch.no_grad(), autocast():
        out = wide_call()
        refs = _per_member(out, [member_call(i) for i in range(N)])
    if isinstance(out, torch.Tensor):
        assert out.dtype == refs[0].dtype, (out.dtype, refs[0].dtype)
    assert_trees_members_close(out, refs, BF16)


def test_shared_input_is_cast_once_and_keeps_the_one_gemm_path():
    """A stride-0 (expanded) input is cast once and expanded again: in a training step
    wide::linear still runs its shared-input GEMM (addmm); without a gradient its batched GEMM
    reads the cast input expanded (Note [wide::linear strategies]), never N materialised copies."""

    x, w, b = torch.randn(2, 6), torch.randn(N, 5, 6, requires_grad=True), torch.randn(N, 5)
    with autocast(), OpRecorder() as rec:
        y = wide.linear(x.expand(N, 2, 6), w, b)
    assert "addmm" in rec.ops and "baddbmm" not in rec.ops, rec.ops
    assert y.dtype == BF16
    with torch.no_grad(), autocast(), OpRecorder() as rec:
        wide.linear(x.expand(N, 2, 6), w, b)
    assert rec.ops.count("baddbmm") == 1 and not {"clone", "contiguous"} & set(rec.ops), rec.ops
    with autocast():
        refs = [F.linear(x, w[i], b[i]) for i in range(N)]
    assert_members_close(y, refs, BF16)

    members = make_members(mlp, N)
    model = wc.compile(members, torch.randn(4, 16), config=FAST)
    x = torch.randn(4, 16)
    with autocast():
        out = model(x.expand(N, 4, 16))
        refs = [m(x) for m in members]
    assert_members_close(out, refs, BF16)


def test_batch_norm_running_stats_stay_float32_under_autocast():
    rm, rv = torch.zeros(N, 3), torch.ones(N, 3)
    x = torch.randn(N, 4, 3, 5)
    w, b = torch.ones(N, 3, requires_grad=True), torch.zeros(N, 3, requires_grad=True)
    with autocast():
        h = wide.linear(x.transpose(2, 3), torch.eye(3).expand(N, 3, 3).contiguous()).transpose(2, 3)  # bf16
        y = wide.batch_norm(h, w, b, rm, rv, True, 0.5, 1e-5)
    assert h.dtype == y.dtype == BF16
    assert rm.dtype == rv.dtype == torch.float32
    ref = nn.BatchNorm1d(3, momentum=0.5)
    for i in range(N):
        ref.reset_running_stats()
        with autocast():
            ref(h[i].detach())
        torch.testing.assert_close(rm[i], ref.running_mean, rtol=1e-2, atol=1e-2)
    y.float().sum().backward()
    assert w.grad is not None and w.grad.dtype == torch.float32


def test_outside_autocast_nothing_is_cast():
    x, w = torch.randn(N, 2, 4), torch.randn(N, 3, 4)
    assert wide.linear(x, w).dtype == torch.float32
    with torch.autocast("cpu", dtype=BF16, enabled=False):
        assert wide.linear(x, w).dtype == torch.float32
    with autocast():
        assert wide.linear(x.double(), w.double()).dtype == torch.float64  # float64 is never cast


# --------------------------------------------------------------------------------------------
# opcheck of the ops with autocast kernels (schema, fake tensors, autograd registration) UNDER
# autocast; opcheck outside autocast is test_op_db.py's, for every op
# --------------------------------------------------------------------------------------------
def _opcheck_samples():
    x4, w = torch.randn(N, 2, 3, 5, 5), torch.randn(N, 4, 3, 3, 3, requires_grad=True)
    yield "linear", wide.linear.default, (torch.randn(N, 2, 4), torch.randn(N, 3, 4, requires_grad=True),
                                          torch.randn(N, 3)), {}
    yield "conv", wide.conv.default, (x4, w, None, [1, 1], [1, 1], [1, 1], 1), {}
    yield "prelu", wide.prelu.default, (torch.randn(N, 2, 3, 4), torch.rand(N, 3)), {}
    yield "layer_norm", wide.layer_norm.default, (torch.randn(N, 2, 6), [6], torch.randn(N, 6), torch.randn(N, 6)), {}
    yield "rms_norm", wide.rms_norm.default, (torch.randn(N, 2, 6), [6], torch.randn(N, 6)), {}
    yield "group_norm", wide.group_norm.default, (torch.randn(N, 2, 4, 5), N, 2, torch.randn(N, 4),
                                                  torch.randn(N, 4)), {}
    yield "batch_norm", wide.batch_norm.default, (torch.randn(N, 4, 3, 5), torch.randn(N, 3), torch.randn(N, 3),
                                                  torch.zeros(N, 3), torch.ones(N, 3), True, 0.1, 1e-5), {}
    yield "add_layer_norm", wide.add_layer_norm.default, (torch.randn(N, 2, 6), torch.randn(N, 2, 6), [6],
                                                          torch.randn(N, 6), torch.randn(N, 6)), {}
    yield "rnn_cell", wide.rnn_cell.default, (torch.randn(N, 2, 6), [], torch.randn(N, 15, 6),
                                              torch.randn(N, 15, 5), torch.randn(N, 15), torch.randn(N, 15)), \
        {"mode": "GRU"}


_OPCHECK = list(_opcheck_samples())


@pytest.mark.parametrize("name,op,args,kwargs", _OPCHECK, ids=[s[0] for s in _OPCHECK])
def test_opcheck_under_autocast(name, op, args, kwargs):
    with autocast():
        opcheck(op, args, kwargs, test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


# --------------------------------------------------------------------------------------------
# CUDA (float16): ATen's CUDA lists differ (norms in float32, every recurrent op in float16)
# --------------------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["linear", "conv", "layer_norm", "group_norm", "batch_norm", "add_layer_norm",
                                  "rnn_lstm", "rnn_gru", "rnn_cell_lstm_state", "attention"])
def test_cuda_op_autocast_matches_aten(name):
    torch.manual_seed(0)
    with torch.device("cuda"):
        wide_call, member_call = OP_CASES[name](torch.float32)
        with torch.no_grad(), autocast("cuda", torch.float16):
            out = wide_call()
            refs = _per_member(out, [member_call(i) for i in range(N)])
    if isinstance(out, torch.Tensor):
        assert out.dtype == refs[0].dtype, (out.dtype, refs[0].dtype)
    assert_trees_members_close(out, refs, torch.float16, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_compiled_mlp_under_autocast():
    members = [m.cuda() for m in make_members(mlp, N)]
    model = wc.compile(members, torch.randn(4, 16, device="cuda"), config=FAST)
    xs = torch.randn(N, 4, 16, device="cuda")
    with autocast("cuda", torch.float16):
        out = model(xs)
        refs = [m(xs[i]) for i, m in enumerate(members)]
    assert out.dtype == refs[0].dtype == torch.float16
    assert_members_close(out, refs, torch.float16, rtol=2e-2, atol=2e-2)
