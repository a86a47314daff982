"""Dynamic sizes by default (issue 26): a model compiled on one sample takes every size its members
take. The batch is dynamic at capture; a new size in another dim (a sequence length, an image
size) captures that mode's graph again with the dim dynamic, once, and logs it; a size the
forward fixes gets an error naming it. And a wrong sample gets member 0's own PyTorch error.
"""
from __future__ import annotations

import logging

import pytest
import torch
import wide_compiler as wc
from support import DEVICE, run_in_threads
from torch import nn
from wide_compiler import testing

FAST = wc.WideConfig.fast()
N = 3
LENGTHS = (8, 5, 12, 19)  # the sample's, one shorter, one longer, and one over twice the sample's


def _recaptures(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "capturing the" in r.getMessage()]


def _check_lengths(wide, models, make_input, lengths=LENGTHS, grads=True):
    """Compile once, call at every length, in train and eval: each member as it computes alone."""
    for training in (True, False):
        for k, t in enumerate(lengths):
            inputs = [make_input(t, seed=100 * k + i) for i in range(N)]
            testing.check_equivalence(wide, models, inputs, training=training, grads=grads and training)


# --- sequence models ---------------------------------------------------------------------------
class TokenEncoder(nn.Module):
    """nn.Embedding + nn.TransformerEncoder + mean over the sequence + a head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)  # the sizes: one layer's ops
        self.head = nn.Linear(16, 3)

    def forward(self, ids):
        return self.head(self.enc(self.emb(ids)).mean(1))


def _ids(t: int, seed: int = 0, b: int = 4) -> torch.Tensor:
    return torch.randint(0, 50, (b, t), generator=torch.Generator(DEVICE).manual_seed(seed))


def test_transformer_encoder_takes_every_sequence_length(caplog):
    torch.manual_seed(0)
    models = [TokenEncoder() for _ in range(N)]
    wide = wc.compile(models, _ids(8), config=FAST)
    assert "ids [B, 8]" in wide.summary()
    with caplog.at_level(logging.INFO, logger="wide_compiler"):
        _check_lengths(wide, models, _ids)
    # one recapture, for the one new dynamic dim, in train mode; the eval graph, captured later,
    # takes the dim dynamic from the start
    got = _recaptures(caplog)
    assert len(got) == 1, got
    assert "input 'ids' dim 2 is 5" in got[0] and "train graph" in got[0], got
    summary = wide.summary()
    assert "ids [B, *]" in summary, summary
    assert "ids dim 1 (since a call with size 5)" in summary, summary
    assert "ids dim 0 (batch)" in summary, summary


def _tiny_berts(layers: int) -> list:
    """N small BertModels (vocabulary 64, width 32, no dropout), seeded; skips without transformers."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                     num_attention_heads=4, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return [transformers.BertModel(config) for _ in range(N)]


def test_bert_encoder_takes_every_sequence_length(caplog):
    models = _tiny_berts(layers=2)
    ids = lambda t, seed=0: torch.randint(3, 64, (2, t), generator=torch.Generator(DEVICE).manual_seed(seed))  # noqa: E731
    wide = wc.compile(models, ids(8), config=FAST)
    with caplog.at_level(logging.INFO, logger="wide_compiler"):
        _check_lengths(wide, models, ids)
    assert len(_recaptures(caplog)) == 1, _recaptures(caplog)


class GRUClassifier(nn.Module):
    def __init__(self, rnn: type[nn.RNNBase] = nn.GRU, **kw):
        super().__init__()
        self.rnn = rnn(6, 12, batch_first=True, **kw)
        self.head = nn.Linear(12 * (2 if kw.get("bidirectional") else 1), 3)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


def _seq(t: int, seed: int = 0, b: int = 4) -> torch.Tensor:
    return torch.randn(b, t, 6, generator=torch.Generator(DEVICE).manual_seed(seed))


@pytest.mark.parametrize("rnn, kw", [(nn.GRU, {}), (nn.LSTM, {"num_layers": 2}),
                                     (nn.GRU, {"bidirectional": True}), (nn.RNN, {})],
                         ids=["gru", "lstm-2-layers", "gru-bidirectional", "rnn"])
def test_recurrent_classifier_takes_every_sequence_length(rnn, kw, caplog):
    torch.manual_seed(0)
    models = [GRUClassifier(rnn, **kw) for _ in range(N)]
    wide = wc.compile(models, _seq(8), config=FAST)
    with caplog.at_level(logging.INFO, logger="wide_compiler"):
        _check_lengths(wide, models, _seq)
    assert len(_recaptures(caplog)) == 1, _recaptures(caplog)
    assert "x dim 1 (since a call with size 5)" in wide.summary()


class FullyConvolutional(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.MaxPool2d(2), nn.Conv2d(8, 4, 1))

    def forward(self, x):
        return self.body(x)


def test_fully_convolutional_net_takes_other_image_sizes(caplog):
    torch.manual_seed(0)
    models = [FullyConvolutional() for _ in range(N)]
    wide = wc.compile(models, torch.randn(2, 3, 16, 16), config=FAST)
    img = lambda hw, seed=0: torch.randn(2, 3, *hw, generator=torch.Generator(DEVICE).manual_seed(seed))  # noqa: E731
    with caplog.at_level(logging.INFO, logger="wide_compiler"):
        _check_lengths(wide, models, img, lengths=((16, 16), (24, 20), (10, 30)))
    got = _recaptures(caplog)
    assert len(got) == 2, got  # H and W, at one recapture
    summary = wide.summary()
    assert "x dim 2 (since a call with size 24)" in summary and "x dim 3 (since a call with size 20)" in summary


# --- sizes the forward fixes -------------------------------------------------------------------
class LinearOverTime(nn.Module):
    """Mixes the time steps with a Linear over T: T is part of the architecture."""

    def __init__(self):
        super().__init__()
        self.mix = nn.Linear(8, 4)  # LINEAR OVER T

    def forward(self, x):  # x [B, C, T]
        return self.mix(x.relu())


def test_a_length_the_forward_fixes_gets_a_clear_error_once(caplog):
    models = [LinearOverTime() for _ in range(N)]
    wide = wc.compile(models, torch.randn(4, 3, 8), config=FAST)
    with caplog.at_level(logging.INFO, logger="wide_compiler"):
        for _ in range(2):
            with pytest.raises(ValueError) as info:
                wide(torch.randn(N, 4, 3, 12))
            msg = str(info.value)
            assert "its dim 3 (dim 2 of one member's input) is 12" in msg, msg
            assert msg.startswith("wide_compiler: input 'x' has shape [3, 4, 3, 12]; "
                                  "expected N-first [3, B, 3, 8]"), msg
            assert "fixed at capture to 8" in msg and "each member takes only 8 there too" in msg, msg
            assert "LINEAR OVER T" in msg or "self.mix(x.relu())" in msg, msg  # where export fixed it
    assert len(_recaptures(caplog)) == 1, _recaptures(caplog)  # the second call does not try again
    # the other dims still vary, and the model still works
    xs = torch.randn(N, 5, 3, 8)
    testing.assert_members_close(wide(xs), [m(x) for m, x in zip(models, xs)])
    # a member dim count or rank that is wrong is still the input error it was
    with pytest.raises(ValueError, match=r"expected N-first \[3, B, 3, 8\]"):
        wide(torch.randn(N + 1, 4, 3, 8))


def test_explicit_dynamic_shapes_are_kept_as_given():
    models = [TokenEncoder() for _ in range(N)]
    wide = wc.compile(models, _ids(8), config=FAST, dynamic_shapes=({0: torch.export.Dim.AUTO},))
    assert "set by compile(dynamic_shapes=...)" in wide.summary()
    with pytest.raises(ValueError, match=r"expected N-first \[3, B, 8\]"):
        wide(torch.stack([_ids(12)] * N))


def test_recapture_from_two_threads_builds_one_graph(caplog):
    torch.manual_seed(0)
    models = [TokenEncoder().eval() for _ in range(N)]
    wide = wc.compile(models, _ids(8), config=FAST)
    ids = torch.stack([_ids(11, seed=i) for i in range(N)])
    outs = [None, None]

    def call(k):
        with torch.no_grad():
            outs[k] = wide(ids)

    with caplog.at_level(logging.INFO, logger="wide_compiler"):
        errors = run_in_threads(call, 2)
    assert not errors, errors
    assert len(_recaptures(caplog)) == 1, _recaptures(caplog)
    with torch.no_grad():
        testing.assert_members_close(outs[0], [m(x) for m, x in zip(models, ids)])
    torch.testing.assert_close(outs[0], outs[1])


def test_compiled_wide_model_recaptures_before_the_compiled_call():
    models = [GRUClassifier() for _ in range(N)]
    wide = wc.compile(models, _seq(8), config=FAST, compile_model=True,
                      compile_options={"backend": "eager"})
    xs = torch.stack([_seq(13, seed=i) for i in range(N)])
    testing.assert_members_close(wide(xs), [m(x) for m, x in zip(models, xs)])


def test_a_wide_model_copy_and_pickle_keep_the_dynamic_dims():
    import copy
    import pickle

    models = [GRUClassifier() for _ in range(N)]
    wide = wc.compile(models, _seq(8), config=FAST)
    xs = torch.stack([_seq(13, seed=i) for i in range(N)])
    wide(xs)
    for other in (copy.deepcopy(wide), pickle.loads(pickle.dumps(wide))):
        assert "x [B, *, 6]" in other.summary()
        testing.assert_members_close(other(xs), [m(x) for m, x in zip(models, xs)])


# --- errors at the sample ----------------------------------------------------------------------
def test_a_sample_with_the_member_dim_gets_the_members_own_error():
    models = [GRUClassifier() for _ in range(N)]
    with pytest.raises(wc.WideCompileError) as info:
        wc.compile(models, torch.randn(N, 4, 8, 6), config=FAST)  # N-first, not one member's
    msg = str(info.value)
    assert msg.startswith("wide_compiler: member 0 (GRUClassifier) fails on the sample (a float32 tensor "
                          "[3, 4, 8, 6])"), msg
    assert "Expected input to be 2D or 3D, got 4D" in msg, msg  # PyTorch's own words
    assert "ONE member's input, without the member dim N" in msg, msg
    assert "Its dim 0 is 3, the number of members" in msg, msg
    assert "s77" not in msg and "torch.cond" not in msg, msg
    assert isinstance(info.value.__cause__, ValueError)  # the member's own exception, chained


def test_a_sample_with_a_wrong_feature_size_gets_the_members_own_error():
    models = [nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 2)) for _ in range(N)]
    with pytest.raises(wc.WideCompileError) as info:
        wc.compile(models, torch.randn(4, 12), config=FAST)
    msg = str(info.value)
    assert "mat1 and mat2 shapes cannot be multiplied (4x12 and 16x8)" in msg, msg  # real sizes
    assert "ONE member's input" in msg and "Its dim 0" not in msg, msg
    assert "torch.export" not in msg and "s77" not in msg, msg


def test_the_sample_check_leaves_the_members_as_they_were():
    from wide_compiler.fx.capture import check_sample

    models = [nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5)) for _ in range(N)]
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in models]
    x = torch.randn(5, 4)
    state = torch.random.get_rng_state()
    check_sample(models[0], (x,), {}, N)  # train mode: BatchNorm updates, dropout draws
    assert torch.equal(state, torch.random.get_rng_state())
    wc.compile(models, x, config=FAST)
    for m, b in zip(models, before):
        for k, v in m.state_dict().items():
            assert torch.equal(v, b[k]), k


class BranchOnLength(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):  # x [B, T, 4]
        if x.shape[1] > 10:
            return self.fc(x).mean(1) * 2
        return self.fc(x).mean(1)


def test_a_branch_on_the_length_is_never_run_for_the_other_branch():
    models = [BranchOnLength() for _ in range(N)]
    wide = wc.compile(models, torch.randn(2, 8, 4), config=FAST)
    for t in (9, 3):  # the recaptured graph holds for lengths up to 10
        xs = torch.randn(N, 2, t, 4)
        testing.assert_members_close(wide(xs), [m(x) for m, x in zip(models, xs)])
    assert "sizes up to 10" in wide.summary()
    with pytest.raises(ValueError, match=r"input 'x' dim 2 is 12, but the captured graph holds for sizes up to 10"):
        wide(torch.randn(N, 2, 12, 4))


def test_keyword_inputs_of_one_length_are_captured_together(caplog):
    models = [m.eval() for m in _tiny_berts(layers=1)]
    ids = torch.randint(3, 64, (2, 8))
    wide = wc.compile(models, ids, sample_kwargs={"attention_mask": torch.ones(2, 8, dtype=torch.long)},
                      config=FAST)
    ids = torch.randint(3, 64, (N, 2, 13))
    mask = torch.ones(N, 2, 13, dtype=torch.long)
    mask[:, 1, 9:] = 0
    with caplog.at_level(logging.INFO, logger="wide_compiler"), torch.no_grad():
        out = wide(ids, attention_mask=mask).last_hidden_state
        want = [m(i, attention_mask=k).last_hidden_state for m, i, k in zip(models, ids, mask)]
    testing.assert_members_close(out, want)
    got = _recaptures(caplog)
    assert len(got) == 2 and "'input_ids' dim 2" in got[0] and "'attention_mask' dim 2" in got[1], got
