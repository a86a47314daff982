"""Every ``torch.ops.wide`` operator, from one table (tests/python/op_db.py).

For each op of the database:

* ``test_opcheck`` -- ``torch.library.opcheck`` on every fixed sample (schema, autograd
  registration, fake tensor); ``test_aot_dispatch_dynamic`` too on the samples marked ``aot``;
* ``test_reference`` -- member i of the wide result equals the op's per-member reference on member
  i's slice: outputs, the tensors the op writes in place, and (differentiable ops) the gradient of
  every input and parameter (Note [How a member sees a wide argument] in op_db.py);
* ``test_gradcheck`` -- ``torch.autograd.gradcheck`` (and ``gradgradcheck`` where the op is twice
  differentiable), fast mode, in float64 on a small sample whose differentiable arguments are
  leaves (the one with the most of them);
* ``test_fuzz`` -- the reference comparison on configurations drawn from a seeded
  ``random.Random`` (shapes and hyperparameters), a few per op and dtype;
* ``test_every_schema_has_an_entry`` -- the schemas of csrc/wide/registration.cpp and the database
  name the same ops;
* ``test_the_library_table_*`` -- the library's table of the ops (wide_compiler/ops.py, Note [The
  wide op table]) names the same ops as the database, agrees with each schema (a ``strategy`` /
  ``packed_input`` argument exactly where it says), and every strategy it lists is accepted by
  the op;
* ``test_harness_catches_a_wrong_member`` -- each comparison above can fail.

A real bug gets a strict xfail in its op's ``OpInfo.xfail`` (test name -> reason) until it is fixed.

Sizes are small: the whole file runs in well under a minute on two cores
(``pytest tests/python/test_op_db.py --durations=10``).
"""
from __future__ import annotations

import os
import random
import re
from pathlib import Path

import pytest
import torch
from op_db import DEVICE, F32, F64, OP_DB, UTILITY_OPS, OpInfo, SampleInput
from wide_compiler.ops import WIDE_OPS
from wide_compiler.testing import tolerance

# The references' own torch.lstm with projections says it leaves oneDNN: not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")

REGISTRATION = Path(__file__).resolve().parents[2] / "csrc" / "wide" / "registration.cpp"
CHEAP_OPCHECKS = ("test_schema", "test_autograd_registration", "test_faketensor")
# per op and dtype; WIDE_OP_DB_FUZZ_SEEDS=200 for a long hunt
FUZZ_SEEDS = int(os.environ.get("WIDE_OP_DB_FUZZ_SEEDS", "4"))


@pytest.fixture(autouse=True)
def _cuda_numerics(request):
    """On a GPU (``WIDE_TEST_DEVICE=cuda``): float32 without TF32 (cuDNN's default for convs and
    RNNs rounds to 10-bit mantissas, so every float32 comparison would differ at ~1e-3), and no
    cuDNN for the recurrent and batch norm ops, whose references fail in it: cuDNN's RNN has no
    backward in eval mode and its batch norm backward fails without a weight (limits of PyTorch
    itself, that a plain model meets the same way)."""
    if DEVICE.type != "cuda":
        yield
        return
    no_cudnn = any(f"[{op}-" in request.node.name for op in ("rnn", "rnn_cell", "batch_norm"))
    with torch.backends.cudnn.flags(enabled=not no_cudnn, allow_tf32=False):
        yield


def _params(test: str, cases):
    """pytest params of (op, case) with the op's strict xfail for ``test`` attached."""
    out = []
    for op, case, cid in cases:
        marks = [pytest.mark.xfail(strict=True, reason=op.xfail[test])] if test in op.xfail else []
        out.append(pytest.param(op.name, case, id=f"{op.name}-{cid}", marks=marks))
    return out


with torch.device("cpu"):  # drawn as its tests draw them: no default device (DEVICE_AWARE_FILES)
    SAMPLES = [(op, k, s.desc) for op in OP_DB.values() for k, s in enumerate(op.samples())]


# --------------------------------------------------------------------------------------------
# Comparing a wide call with its members
# --------------------------------------------------------------------------------------------
def _flat(tree) -> list:
    """Tensors and Nones of a result tree, in order."""
    if isinstance(tree, (list, tuple)):
        return [x for t in tree for x in _flat(t)]
    return [tree]


def _tol(op: OpInfo, dtype: torch.dtype, kind: str) -> dict:
    return dict(op.tolerances.get((dtype, kind), tolerance(dtype, kind)))


def _close(op: OpInfo, got, want, dtype, kind: str, what: str) -> None:
    if want is None or got is None:
        assert got is None and want is None, f"{what}: got {type(got).__name__}, want {type(want).__name__}"
        return
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != member reference {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != member reference {want.dtype}"
    tol = _tol(op, dtype, kind)
    torch.testing.assert_close(got.detach(), want.detach(), **tol, equal_nan=True,
                               msg=lambda m: f"{what} differs from the member reference ({tol}):\n{m}")


def check_against_reference(op: OpInfo, s: SampleInput, seed: int = 0) -> None:
    """Member i of ``op(*s.args, **s.kwargs)`` equals ``op.reference`` on member i's arguments:
    outputs, written arguments after the call, and gradients of every leaf (module docstring)."""
    label = f"{op.name} [{s.desc}, N={s.n}]"
    dtype = next((t.dtype for t in _flat([*s.args, *s.kwargs.values()])
                  if isinstance(t, torch.Tensor) and t.is_floating_point()), F32)
    mutable = op.mutable
    members = [s.member_args(i, mutable) for i in range(s.n)]  # written args cloned before the call
    out = op.op(*s.args, **s.kwargs)
    refs = [op.reference(*a, **k) for a, k in members]
    for i in range(s.n):
        got, want = _flat(op.member_output(out, i, s)), _flat(refs[i])
        assert len(got) == len(want), f"{label}: member {i}: {len(got)} results, reference {len(want)}"
        for j, (g, w) in enumerate(zip(got, want)):
            _close(op, g, w, dtype, "output", f"{label}: output {j} of member {i}")
    for k, v in [*enumerate(s.args), *s.kwargs.items()]:
        if k in mutable and isinstance(v, torch.Tensor):
            for i in range(s.n):
                m = members[i][0][k] if isinstance(k, int) else members[i][1][k]
                _close(op, v[i], m, dtype, "buffer", f"{label}: argument {k} (written in place) of member {i}")
    if not op.differentiable:
        return
    leaves = s.leaves()
    outs = [t for t in _flat(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not leaves:
        return
    assert outs, f"{label}: inputs require grad, but no output has a graph"
    g = torch.Generator().manual_seed(seed)

    def cot_tree(tree):
        if isinstance(tree, (list, tuple)):
            return type(tree)(cot_tree(t) for t in tree)
        if isinstance(tree, torch.Tensor) and tree.requires_grad:
            return torch.randn(tree.shape, generator=g, dtype=tree.dtype).to(tree.device)
        return None
    cots = cot_tree(out)
    wide_grads = torch.autograd.grad(outs, leaves, [c for c in _flat(cots) if c is not None], allow_unused=True)
    ref_outs, ref_cots = [], []
    for i in range(s.n):
        for r, c in zip(_flat(refs[i]), _flat(op.member_output(cots, i, s))):
            if c is not None and r is not None and r.requires_grad:
                ref_outs.append(r)
                ref_cots.append(c)
    ref_grads = torch.autograd.grad(ref_outs, leaves, ref_cots, allow_unused=True)
    for j, (leaf, gw, gr) in enumerate(zip(leaves, wide_grads, ref_grads)):
        gw = torch.zeros_like(leaf) if gw is None else gw
        gr = torch.zeros_like(leaf) if gr is None else gr
        _close(op, gw, gr, dtype, "grad", f"{label}: gradient of leaf {j} {tuple(leaf.shape)}")


# --------------------------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,k", _params("opcheck", SAMPLES))
def test_opcheck(name, k):
    op = OP_DB[name]
    s = op.samples()[k]
    utils = CHEAP_OPCHECKS + (("test_aot_dispatch_dynamic",) if s.aot else ())
    result = torch.library.opcheck(op.op, s.args, s.kwargs, test_utils=utils)
    assert all(v == "SUCCESS" for v in result.values()), result


@pytest.mark.parametrize("name,k", _params("reference", SAMPLES))
def test_reference(name, k):
    op = OP_DB[name]
    check_against_reference(op, op.samples()[k])


GRADCHECK_MAX_NUMEL = 400
GRADCHECK = [(op, 0, "float64") for op in OP_DB.values() if op.differentiable and op.gradcheck]


@pytest.mark.parametrize("name,k", _params("gradcheck", GRADCHECK))
def test_gradcheck(name, k):
    op = OP_DB[name]
    usable = [s for s in op.sample_inputs(F64, True) if s.gradcheckable()]
    assert usable, f"{name}: no float64 sample whose differentiable arguments are all leaves"
    # the most differentiable arguments (weights and biases too, LSTM over RNN), then the smallest
    small = [u for u in usable if u.numel() <= GRADCHECK_MAX_NUMEL] or usable
    s = min(small, key=lambda u: (-len(u.grad_positions()), u.numel()))
    inputs = [s._at(p) for p in s.grad_positions()]

    def fn(*values):
        out = op.op(*s.with_grad_args(values), **s.kwargs)
        return tuple(t for t in _flat(out) if isinstance(t, torch.Tensor) and t.is_floating_point())
    # fast_mode: a random projection of the Jacobian instead of every column (conv's full
    # gradgradcheck alone takes ~15 s on two cores)
    assert torch.autograd.gradcheck(fn, inputs, fast_mode=True)
    if op.gradgradcheck:
        assert torch.autograd.gradgradcheck(fn, inputs, fast_mode=True)


FUZZ = [(op, (dtype, seed), f"{str(dtype).removeprefix('torch.')}-seed{seed}")
        for op in OP_DB.values() for dtype in op.dtypes for seed in range(FUZZ_SEEDS)]


@pytest.mark.parametrize("name,case", _params("fuzz", FUZZ))
def test_fuzz(name, case):
    dtype, seed = case
    op = OP_DB[name]
    rng = random.Random(f"{name}/{dtype}/{seed}")
    s = op.fuzz(rng, dtype)
    s.desc = f"fuzz {dtype} seed {seed}: {_describe(s)}"
    check_against_reference(op, s, seed)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward scales the gradient by 1.001."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        return g * 1.001


def test_harness_catches_a_wrong_member():
    """Each comparison of check_against_reference can fail: a wide result whose members are
    rotated, a gradient 0.1% off, a running statistic the op did not update as the member does."""
    import dataclasses

    import torch.nn.functional as F
    linear = OP_DB["linear"]
    sample = lambda: next(s for s in linear.sample_inputs(F64, True) if s.n >= 2)  # noqa: E731
    rotated = dataclasses.replace(linear, member_output=lambda out, i, s: out[(i + 1) % s.n])
    with pytest.raises(AssertionError, match="output 0 of member 0"):
        check_against_reference(rotated, sample())
    scaled = dataclasses.replace(linear, reference=lambda x, w, b=None, **kw: F.linear(x, _ScaleGrad.apply(w), b))
    with pytest.raises(AssertionError, match="gradient of leaf"):
        check_against_reference(scaled, sample())
    bn = OP_DB["batch_norm"]
    frozen = dataclasses.replace(bn, reference=lambda x, w, b, rm, rv, training, momentum, eps, **kw:
                                 F.batch_norm(x, rm, rv, w, b, training, 0.0, eps))
    with pytest.raises(AssertionError, match="written in place"):
        check_against_reference(frozen, next(iter(bn.sample_inputs(F64, True))))


def _describe(s: SampleInput) -> str:
    def one(v):
        if isinstance(v, torch.Tensor):
            return f"T{list(v.shape)}{'/' + 'x'.join(map(str, v.stride())) if not v.is_contiguous() else ''}"
        if isinstance(v, (list, tuple)) and v and isinstance(v[0], torch.Tensor):
            return "[" + ", ".join(one(t) for t in v) + "]"
        return repr(v)
    return ", ".join([one(a) for a in s.args] + [f"{k}={one(v)}" for k, v in s.kwargs.items()])


# --------------------------------------------------------------------------------------------
# The database covers the schemas
# --------------------------------------------------------------------------------------------
def schema_names() -> list[str]:
    """Every op name ``m.def("name(...``'d in csrc/wide/registration.cpp."""
    return re.findall(r'm\.def\(\s*"([A-Za-z_][A-Za-z0-9_]*)\s*\(', REGISTRATION.read_text())


def test_every_schema_has_an_entry():
    names = schema_names()
    assert len(names) >= 25, f"parsed only {names} from {REGISTRATION}"
    missing = [n for n in names if n not in OP_DB and n not in UTILITY_OPS]
    assert not missing, f"torch.ops.wide ops without an op_db entry (tests/python/op_db.py): {missing}"
    stale = sorted((set(OP_DB) | set(UTILITY_OPS)) - set(names))
    assert not stale, f"op_db entries for ops with no schema in {REGISTRATION.name}: {stale}"
    assert not set(OP_DB) & set(UTILITY_OPS)


def test_every_entry_has_samples_of_each_kind():
    for op in OP_DB.values():
        samples = op.samples()
        assert len(samples) >= 2 * len(op.dtypes), f"{op.name}: {len(samples)} samples"
        assert any(s.aot for s in samples), f"{op.name}: no sample runs test_aot_dispatch_dynamic"
        if op.differentiable:
            assert any(s.leaves() for s in samples), f"{op.name}: no sample requires grad"


def test_utility_ops_answer():
    assert isinstance(torch.ops.wide._build_info(), str)
    stats = torch.ops.wide._cache_stats()
    assert len(stats) == 6 and all(isinstance(v, int) for v in stats)
    assert torch.ops.wide._optim_cpu_capability() in ("default", "avx2", "avx512")


# --------------------------------------------------------------------------------------------
# The library's op table (wide_compiler/ops.py) agrees with the database and the schemas
# --------------------------------------------------------------------------------------------
def test_the_library_table_and_the_database_name_the_same_ops():
    assert sorted(WIDE_OPS) == sorted(OP_DB), (
        f"only in wide_compiler/ops.py: {sorted(set(WIDE_OPS) - set(OP_DB))}; "
        f"only in tests/python/op_db.py: {sorted(set(OP_DB) - set(WIDE_OPS))}")


@pytest.mark.parametrize("name", sorted(WIDE_OPS))
def test_the_library_table_matches_the_schema(name):
    info = WIDE_OPS[name]
    assert info.overload is OP_DB[name].op
    args = {a.name: a for a in info.overload._schema.arguments}
    assert ("strategy" in args) == bool(info.strategies), \
        f"{name}: the schema {'has' if 'strategy' in args else 'has no'} strategy argument, the table lists {info.strategies}"
    if info.strategies:
        assert args["strategy"].kwarg_only and args["strategy"].default_value == "auto"
    assert ("packed_input" in args) == info.packed_input, f"{name}: packed_input in the schema and the table differ"
    writes = any(a.alias_info is not None and a.alias_info.is_write for a in args.values())
    assert (info.result == "none") == (writes and not info.overload._schema.returns), name


@pytest.mark.parametrize("name", sorted(n for n, info in WIDE_OPS.items() if info.strategies))
def test_the_library_table_lists_only_strategies_the_op_accepts(name):
    op, info = OP_DB[name], WIDE_OPS[name]
    s = next(iter(op.sample_inputs(F32, False)))
    with torch.no_grad():
        for strategy in info.choices:
            out = op.op(*s.args, **{**s.kwargs, "strategy": strategy})
            assert all(torch.isfinite(t).all() for t in _flat(out) if isinstance(t, torch.Tensor)), strategy
        # the check can fail: an unknown name is refused, naming the valid ones
        with pytest.raises(RuntimeError, match="expected strategy .*" + ".*".join(map(re.escape, info.strategies))):
            op.op(*s.args, **{**s.kwargs, "strategy": "no_such_strategy"})
