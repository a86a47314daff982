"""Adversarial cases (issue 24) for the fused optimizer steps, the wide embedding ops, the strategy
cache, the CLI's ``--shape`` and the double-stream block's argument order: inputs nobody here
wrote, each of which was silently wrong, a traceback or an unclear error before, and is now
correct or a clear error naming what, where and why."""
from __future__ import annotations

import json
import logging
import re

import pytest
import torch
import wide_compiler as wc
from torch import nn
from wide_compiler import blocks as wb
from wide_compiler import cli, tuning
from support import cpu_only


# --- fused optimizer steps: no aliasing between what a step writes and anything else ------------
N, D = 3, 5


def _hp(value: float) -> torch.Tensor:
    return torch.full((N,), value)


def _step_call(op: str, alias: tuple[str, str] | None = None, device: str = "cpu", **over):
    """(the op, its keyword arguments), fresh tensors; ``alias=(a, b)``: argument a := argument b."""
    r = lambda: torch.randn(N, D, device=device)  # noqa: E731
    z = lambda: torch.zeros(N, D, device=device)  # noqa: E731
    if op == "sgd_step":
        kw = dict(param=r(), grad=r(), momentum_buffer=z(), lr=_hp(0.1), weight_decay=_hp(0.0),
                  momentum=_hp(0.9), dampening=_hp(0.0))
    elif op == "adam_step":
        kw = dict(param=r(), grad=r(), exp_avg=z(), exp_avg_sq=z(), max_exp_avg_sq=z(), step=torch.zeros(N),
                  lr=_hp(0.1), beta1=_hp(0.9), beta2=_hp(0.999), eps=_hp(1e-8), weight_decay=_hp(0.0),
                  amsgrad=True)
    elif op == "rmsprop_step":
        kw = dict(param=r(), grad=r(), square_avg=z(), grad_avg=z(), momentum_buffer=z(), step=torch.zeros(N),
                  lr=_hp(0.01), alpha=_hp(0.99), eps=_hp(1e-8), weight_decay=_hp(0.0), momentum=_hp(0.9),
                  centered=True)
    else:
        kw = dict(param=r(), grad=r(), state_sum=z(), step=torch.zeros(N), lr=_hp(0.1), lr_decay=_hp(0.0),
                  weight_decay=_hp(0.0), eps=_hp(1e-10))
    for k in ("lr", "weight_decay", "momentum", "dampening", "beta1", "beta2", "eps", "alpha", "lr_decay"):
        if k in kw:
            kw[k] = kw[k].to(device)
    if "step" in kw:
        kw["step"] = kw["step"].to(device)
    kw.update(over)
    if alias is not None:
        kw[alias[0]] = kw[alias[1]]
    return getattr(torch.ops.wide, op), kw


# op -> its (written argument, the argument it is made the same tensor as) pairs
_ALIASED = {
    "adam_step": [("exp_avg_sq", "exp_avg"),  # the case
                  ("exp_avg", "param"), ("grad", "param"), ("max_exp_avg_sq", "exp_avg_sq"), ("exp_avg", "grad")],
    "sgd_step": [("momentum_buffer", "grad"), ("momentum_buffer", "param"), ("grad", "param")],
    "rmsprop_step": [("grad_avg", "square_avg"), ("momentum_buffer", "square_avg"), ("square_avg", "grad")],
    "adagrad_step": [("state_sum", "param"), ("state_sum", "grad")],
}
ALIASES = [(op, a, b) for op, pairs in _ALIASED.items() for a, b in pairs]  # (op, written, made the same as)


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize(("op", "a", "b"), ALIASES)
def test_step_refuses_a_written_tensor_passed_twice(op, a, b, device):
    """adam_step(exp_avg=m, exp_avg_sq=m) ran and gave a silently wrong update; now every pair
    (a tensor the step writes, any other argument) is refused naming both, before anything changes
    (the meta kernel too, so traced code fails the same way)."""
    fn, kw = _step_call(op, (a, b), device)
    before = {k: v.clone() for k, v in kw.items() if isinstance(v, torch.Tensor) and device == "cpu"}
    names = "|".join((rf"{a} shares memory with {b}", rf"{b} shares memory with {a}"))
    with pytest.raises(RuntimeError, match=rf"wide::{op}: ({names}) \(the same tensor\).*pass separate tensors"):
        fn(**kw)
    for k, v in before.items():
        assert torch.equal(kw[k], v), f"{k} changed although the call was refused"


@pytest.mark.parametrize("op", ["adam_step", "rmsprop_step"])
def test_step_refuses_step_counter_shared_with_a_hyperparameter(op):
    fn, kw = _step_call(op)
    kw["lr"] = kw["step"]
    with pytest.raises(RuntimeError, match=rf"wide::{op}: step shares memory with lr"):
        fn(**kw)


@cpu_only
def test_adam_step_refuses_partially_overlapping_state():
    """Two views of one buffer that share some elements (not the same tensor) are caught too."""
    buf = torch.zeros(N, D + 1)
    fn, kw = _step_call("adam_step", exp_avg=buf[:, :D], exp_avg_sq=buf[:, 1:])
    with pytest.raises(RuntimeError, match=r"wide::adam_step: exp_avg shares memory with exp_avg_sq; "):
        fn(**kw)


@cpu_only
def test_step_refuses_an_expanded_parameter():
    """A stride-0 (expanded) parameter would be written once per member into the same memory."""
    fn, kw = _step_call("sgd_step", param=torch.randn(1, D).expand(N, D))
    with pytest.raises(RuntimeError, match=r"wide::sgd_step: param has elements that share memory .*"
                                           r"strides \[0, 1\]"):
        fn(**kw)


@cpu_only
def test_step_accepts_state_interleaved_in_one_buffer():
    """Views of one buffer that never touch the same element are fine (told apart exactly), and so
    is an expanded gradient (read only): the result is that of separate tensors."""
    torch.manual_seed(0)
    fn, ref = _step_call("adam_step")
    buf = torch.zeros(N, 3, D)
    kw = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in ref.items()}
    kw.update(exp_avg=buf[:, 0], exp_avg_sq=buf[:, 1], max_exp_avg_sq=buf[:, 2])
    fn(**ref)
    fn(**kw)
    for k in ("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        torch.testing.assert_close(kw[k], ref[k], rtol=0, atol=0)
    g = torch.randn(1, D)
    fn, kw = _step_call("sgd_step", grad=g.expand(N, D))
    fn(**kw)


# --- wide embeddings --------------------------------------------------------------------------
def test_embedding_renorm_strided_table_checks_indices():
    """A non-contiguous (transposed) table took the per-member path, where index -1 silently
    renormalised the member's last row; it is now the IndexError of the contiguous path, naming
    the member and its index, and nothing is changed."""
    n, v, d = 3, 5, 4
    w = (5 * torch.randn(n, d, v)).transpose(1, 2)
    assert not w.is_contiguous()
    before = w.clone()
    idx = torch.tensor([[0, 1], [2, 3], [4, -1]])
    with pytest.raises(IndexError, match=r"wide::embedding_renorm_: index -1 of member 2 is not in the "
                                         r"valid range \[0, 5\)"):
        torch.ops.wide.embedding_renorm_(w, idx, 1.0, 2.0)
    assert torch.equal(w, before)
    with pytest.raises(IndexError, match=r"index 5 of member 1"):
        torch.ops.wide.embedding_renorm_(w, torch.tensor([[0], [5], [1]]), 1.0, 2.0)
    # Valid indices on the strided table: each member as torch's own renorm on its table.
    good = torch.tensor([[0, 4], [2, 2], [1, 3]])
    torch.ops.wide.embedding_renorm_(w, good, 1.0, 2.0)
    for k in range(n):
        ref = before[k].clone()
        torch.embedding_renorm_(ref, good[k], 1.0, 2.0)
        torch.testing.assert_close(w[k], ref, rtol=0, atol=0)


def test_embedding_renorm_refuses_an_expanded_table():
    """One [V, D] table expanded to N members: renorm in place would scale a row once per member."""
    base = 5 * torch.randn(1, 4, 3)
    with pytest.raises(RuntimeError, match=r"wide::embedding_renorm_: the weight's elements share memory.*"
                                           r"strides \[0, 3, 1\]"):
        torch.ops.wide.embedding_renorm_(base.expand(3, 4, 3), torch.tensor([[0], [1], [2]]), 1.0, 2.0)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_embedding_int32_indices_past_two_to_the_31(dtype):
    """N*V >= 2^31 rows: member 2's row 2*V + i does not fit in int32 (it wrapped negative and the
    lookup failed, or read the wrong row). The offsets are int64 now. (The table is one row
    expanded, stride 0, so it costs no memory; embedding_bag, which shares the offsets, makes its
    table contiguous, so it is not tried at this size.)"""
    n, v = 3, 2 ** 30
    w = torch.tensor([[7.0, 8.0]]).view(1, 1, 2).expand(n, v, 2)
    idx = torch.tensor([[5], [v - 1], [3]], dtype=dtype)
    out = torch.ops.wide.embedding(w, idx)
    assert out.shape == (3, 1, 2) and out.eq(torch.tensor([7.0, 8.0])).all()
    with pytest.raises(IndexError, match=rf"index {v} of member 2 is not in the valid range"):
        torch.ops.wide.embedding(w, torch.tensor([[0], [1], [v]], dtype=dtype))


# --- the strategy cache: an odd file is ignored with a log line, never a crash -----------------
def _cache_path(config: wc.WideConfig):
    path = config.resolved_cache_dir() / "strategies.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


TUNED = wc.WideConfig(tune=True, cache=True, tune_repeats=1, tune_after_runs=0)  # measured at compile


@pytest.fixture
def steady_clock(monkeypatch):
    """Every op measured within the tuning budget, however busy the machine (support.py)."""
    from support import steady_measuring_clock

    steady_measuring_clock(monkeypatch)


@pytest.mark.parametrize("nesting", ["[", '{"k": '])
def test_deeply_nested_strategy_cache_is_ignored(nesting, caplog, steady_clock):
    """Valid JSON nested deeper than the parser recurses raised RecursionError out of compile()."""
    depth = 100_000
    closing = {"[": "]", '{"k": ': "}"}[nesting]
    _cache_path(TUNED).write_text(nesting * depth + "1" + closing * depth)
    models = [_MLP() for _ in range(2)]
    with caplog.at_level(logging.WARNING, logger="wide_compiler.tuning"):
        wide = wc.compile(models, torch.randn(4, 6), config=TUNED)
    assert wide(torch.randn(2, 4, 6)).shape == (2, 4, 3)
    assert any("ignoring the strategy cache" in r.getMessage() and "RecursionError" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    json.loads(_cache_path(TUNED).read_text())  # rewritten with the new measurements


def test_strategy_cache_entries_are_validated(caplog, steady_clock):
    """An entry whose timings_ms is a string (or whose strategy is not one) was returned as it was
    and broke summary(); bad entries are dropped with one log line and measured again."""
    models = [_MLP() for _ in range(2)]
    wc.compile(models, torch.randn(4, 6), config=TUNED)  # fills the cache
    path = _cache_path(TUNED)
    data = json.loads(path.read_text())
    assert data
    for i, key in enumerate(data):
        data[key] = ({"strategy": data[key]["strategy"], "timings_ms": "fast"} if i % 2 == 0
                     else {"strategy": 3, "timings_ms": {"bmm": "x"}})
    path.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="wide_compiler.tuning"):
        wide = wc.compile(models, torch.randn(4, 6), config=TUNED)
    text = wide.summary()
    assert "ms" in text and "fast" not in text
    warned = [r.getMessage() for r in caplog.records if "invalid entr" in r.getMessage()]
    assert len(warned) == 1, warned  # one line per version of the file, not one per op
    assert f"has {len(data)} invalid entr" in warned[0] and "must be" in warned[0], warned
    assert all(tuning._valid_entry(v) is None for v in json.loads(path.read_text()).values())


@pytest.mark.parametrize("timings", ["fast", {"bmm": "1"}, {"bmm": -1.0}, {"bmm": True}, [1.0]])
def test_measure_strategy_never_returns_bad_cached_timings(timings):
    path = _cache_path(TUNED)
    names = ("bmm", "loop")
    key = tuning.cache_key("linear", x=[1], strategies=sorted(names))
    path.write_text(json.dumps({key: {"strategy": "loop", "timings_ms": timings}}))
    calls = []
    make = lambda: {s: (lambda s=s: calls.append(s)) for s in names}  # noqa: E731
    choice = tuning.measure_strategy("linear", {"x": [1]}, make, "bmm", TUNED, names)
    assert calls, "a bad entry must be measured again"
    assert isinstance(choice.timings_ms, dict) and set(choice.timings_ms) == set(names) and choice.strategy in names


# --- CLI --shape --------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["test", "analyze"])
@pytest.mark.parametrize(("shape", "message"), [
    ("4,abc", r"'4,abc': 'abc' is not an integer size"),
    ("-1", r"'-1': size -1 must be at least 1"),
    ("0,8", r"'0,8': size 0 must be at least 1"),
    ("4,,8", r"'4,,8': an empty size"),
])
def test_cli_bad_shape_is_a_usage_error(command, shape, message, capsys):
    """`--shape 4,abc` and `--shape -1` ended in tracebacks (int() / torch.randn); now argparse's
    usage error: exit status 2, the option and the bad part named."""
    with pytest.raises(SystemExit) as e:
        cli.main([command, "mlp", f"--shape={shape}"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --shape:" in err and re.search(message, err), err


def test_cli_good_shape_parses(capsys):
    assert cli.parse_shape("32,64") == (32, 64) and cli.parse_shape(" 4 x 8 ") == (4, 8)
    # parsed: mlp takes 64 features, so the command's own usage error names the input [2, 7]
    assert cli.main(["test", "mlp", "--shape=2,7"]) == 2
    assert "does not run on one member's input float32[2, 7]" in capsys.readouterr().err


# --- the double-stream block: no silent swap of the streams ------------------------------------
def test_double_stream_block_refuses_a_positional_stream_pair():
    """WideCompiler 0.x's WideDoubleStreamBlock took (txt, img, ...); this one follows Flux's
    (img, txt, ...). A 0.x call passed positionally ran with the streams' roles swapped and no
    error. Now the pair must be named; named, it means the same under both conventions."""
    torch.manual_seed(0)
    wide = wb.WideDoubleStreamBlock(2, hidden_size=16, num_heads=2)
    members = wide.unfuse()
    img, txt, vec = torch.randn(2, 1, 5, 16), torch.randn(2, 1, 3, 16), torch.randn(2, 1, 16)
    with pytest.raises(TypeError, match=r"WideDoubleStreamBlock: pass the two streams by keyword, e\.g\. "
                                        r"block\(img=img, txt=txt, vec=vec, pe=pe\)"):
        wide(txt, img, vec)  # a 0.x call
    with pytest.raises(TypeError, match="0.x's took"):
        wide(img, txt, vec, rope=None)
    img_out, txt_out = wide(txt=txt, img=img, vec=vec)
    ref = members[1](img[1], txt[1], vec[1])
    torch.testing.assert_close(img_out[1], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(txt_out[1], ref[1], rtol=1e-5, atol=1e-5)
    same = wide(img, txt=txt, vec=vec)  # img alone positionally is unambiguous
    torch.testing.assert_close(same[0], img_out, rtol=0, atol=0)
