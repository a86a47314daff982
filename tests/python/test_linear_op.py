"""torch.ops.wide.linear against N separate F.linear calls.

One `sample_inputs` generator (as in torchvision's test_ops.py and extension-cpp's
test_extension.py) feeds the correctness and gradient tests (opcheck: test_op_db.py). A sample
covers one point of strategy x bias x member-input rank x N x B x layout (contiguous / strided / member dim permuted /
shared, i.e. expanded) x dtype.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
import wide_compiler  # noqa: F401  (registers torch.ops.wide)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import OpRecorder, cpu_only
from wide_compiler.testing import assert_close, assert_members_close, tolerance

wide_linear = torch.ops.wide.linear

STRATEGIES = ("auto", "bmm", "bmm_t", "loop")
DTYPES = (torch.float32, torch.float64)
LAYOUTS = ("contiguous", "strided", "permuted", "shared")
# Member input shapes (before the feature dim) by member rank: rank 1 -> [I], 2 -> [B, I],
# 3 -> [B, S, I]. The wide input has one more dim (N first).
RANKS = (1, 2, 3)


@dataclass
class Sample:
    """One call of wide.linear with everything needed to check it."""

    name: str
    x: torch.Tensor            # the wide input passed to the op, [N, *lead, I]
    x_leaf: torch.Tensor       # the autograd leaf behind x ([*lead, I] for shared, else == x)
    weight: torch.Tensor       # [N, O, I] leaf
    bias: torch.Tensor | None  # [N, O] leaf or None
    strategy: str
    shared: bool

    @property
    def n(self) -> int:
        return self.weight.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    def args(self):
        return (self.x, self.weight, self.bias)

    def kwargs(self):
        return {"strategy": self.strategy}

    def member_input(self, i: int) -> torch.Tensor:
        return self.x_leaf if self.shared else self.x_leaf[i]


def make_wide_input(n: int, lead: tuple[int, ...], in_features: int, layout: str,
                    dtype: torch.dtype, requires_grad: bool):
    """Return (wide_input, leaf). For 'shared' the leaf is one member's input."""
    shape = (n, *lead, in_features)
    if layout == "contiguous":
        leaf = torch.randn(shape, dtype=dtype)
    elif layout == "strided":
        # Every other feature of a wider buffer: non-unit stride on the last dim.
        leaf = torch.randn(*shape[:-1], 2 * in_features, dtype=dtype)[..., ::2]
        assert not leaf.is_contiguous() or in_features == 1
    elif layout == "permuted":
        # Member dim is not the outermost in memory: [*lead, N, I] transposed.
        buf = torch.randn(*lead, n, in_features, dtype=dtype)
        leaf = buf.movedim(-2, 0)
        assert leaf.shape == shape
    elif layout == "shared":
        leaf = torch.randn(*lead, in_features, dtype=dtype)
    else:  # pragma: no cover
        raise AssertionError(layout)
    leaf = leaf.detach().requires_grad_(requires_grad)
    wide = leaf.expand(n, *leaf.shape) if layout == "shared" else leaf
    if layout == "shared" and n > 1:
        assert wide.stride(0) == 0
    return wide, leaf


def sample_inputs(*, strategies=STRATEGIES, biases=(True, False), ranks=RANKS, ns=(1, 3),
                  batches=(1, 4), layouts=LAYOUTS, dtypes=DTYPES, requires_grad=True,
                  in_features=5, out_features=7, seq=3):
    """Yield Samples over the product of the given axes (deterministic: seeds torch)."""
    torch.manual_seed(0)
    for strategy, bias, rank, n, b, layout, dtype in itertools.product(
            strategies, biases, ranks, ns, batches, layouts, dtypes):
        if rank == 1 and b != batches[0]:
            continue  # no batch dim at rank 1: one B value is enough
        lead = {1: (), 2: (b,), 3: (b, seq)}[rank]
        x, leaf = make_wide_input(n, lead, in_features, layout, dtype, requires_grad)
        w = torch.randn(n, out_features, in_features, dtype=dtype, requires_grad=requires_grad)
        bb = torch.randn(n, out_features, dtype=dtype, requires_grad=requires_grad) if bias else None
        name = (f"{strategy}-{'bias' if bias else 'nobias'}-rank{rank}-N{n}-B{b}-{layout}-"
                f"{str(dtype).removeprefix('torch.')}")
        yield Sample(name, x, leaf, w, bb, strategy, layout == "shared")


def reference(sample: Sample):
    """N separate F.linear calls, each on its own fresh leaves.

    Returns (outputs, x_grads, w_grads, b_grads, grad_outputs) where the grads are those of
    sum_i <out_i, g_i> for random cotangents g_i. For a shared input the x grad is the sum of the
    per-member grads (one leaf feeds all members).
    """
    outs, xg, wg, bg, gs = [], [], [], [], []
    for i in range(sample.n):
        x = sample.member_input(i).detach().clone().requires_grad_()
        w = sample.weight[i].detach().clone().requires_grad_()
        b = sample.bias[i].detach().clone().requires_grad_() if sample.bias is not None else None
        out = F.linear(x, w, b)
        g = torch.randn_like(out)
        (out * g).sum().backward()
        outs.append(out.detach())
        xg.append(x.grad)
        wg.append(w.grad)
        bg.append(b.grad if b is not None else None)
        gs.append(g)
    x_grad = torch.stack(xg).sum(0) if sample.shared else torch.stack(xg)
    return outs, x_grad, wg, bg, gs


def _ids(samples):
    return [s.name for s in samples]


ALL_SAMPLES = list(sample_inputs())


# ---------------------------------------------------------------------------------------------
# Forward and backward against N separate F.linear calls.
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sample", ALL_SAMPLES, ids=_ids(ALL_SAMPLES))
def test_forward_and_grads_match_separate_linears(sample: Sample):
    torch.manual_seed(0)
    ref_out, ref_xg, ref_wg, ref_bg, gs = reference(sample)

    out = wide_linear(*sample.args(), **sample.kwargs())
    o = sample.weight.shape[1]
    assert out.shape == (*sample.x.shape[:-1], o)
    assert out.dtype == sample.dtype
    assert_members_close(out, ref_out, sample.dtype, what=f"{sample.name} output")

    (out * torch.stack(gs)).sum().backward()
    assert sample.x_leaf.grad is not None
    assert sample.x_leaf.grad.shape == sample.x_leaf.shape
    if sample.shared:
        assert_close(sample.x_leaf.grad, ref_xg, kind="grad",
                     msg=f"{sample.name}: grad of the shared input (sum over members)")
    else:
        assert_members_close(sample.x_leaf.grad, list(ref_xg), kind="grad",
                             what=f"{sample.name} input grad")
    assert_members_close(sample.weight.grad, ref_wg, kind="grad", what=f"{sample.name} weight grad")
    if sample.bias is not None:
        assert_members_close(sample.bias.grad, ref_bg, kind="grad", what=f"{sample.name} bias grad")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_strategies_agree_with_each_other(layout, dtype):
    """auto, bmm and loop compute the same function (up to accumulation order)."""
    torch.manual_seed(1)
    n, lead, i, o = 4, (3, 2), 6, 5
    x, _ = make_wide_input(n, lead, i, layout, dtype, requires_grad=False)
    w = torch.randn(n, o, i, dtype=dtype)
    b = torch.randn(n, o, dtype=dtype)
    outs = {s: wide_linear(x, w, b, strategy=s) for s in STRATEGIES}
    for s in ("bmm", "loop"):
        assert_close(outs[s], outs["auto"], dtype, msg=f"strategy {s} vs auto ({layout})")


def test_default_strategy_is_auto_and_bias_defaults_to_none():
    torch.manual_seed(2)
    x, w = torch.randn(2, 3, 4), torch.randn(2, 5, 4)
    out = wide_linear(x, w)
    ref = torch.stack([F.linear(x[k], w[k]) for k in range(2)])
    assert_close(out, ref)
    assert_close(wide_linear(x, w, None, strategy="auto"), out)


def test_members_are_independent():
    """Changing member j's weight changes only member j's output."""
    torch.manual_seed(3)
    n = 4
    x, w, b = torch.randn(n, 3, 4), torch.randn(n, 5, 4), torch.randn(n, 5)
    for strategy in STRATEGIES:
        before = wide_linear(x, w, b, strategy=strategy)
        w2 = w.clone()
        w2[2] += 1.0
        after = wide_linear(x, w2, b, strategy=strategy)
        changed = [(after[k] - before[k]).abs().max().item() > 1e-3 for k in range(n)]
        assert changed == [False, False, True, False], (strategy, changed)


# ---------------------------------------------------------------------------------------------
# Which kernels each strategy runs (observed below autograd with a dispatch mode).
# ---------------------------------------------------------------------------------------------
def _record(*args, **kwargs):
    with OpRecorder() as rec:
        wide_linear(*args, **kwargs)
    return rec.ops


GEMMS = {"mm", "addmm", "mv", "addmv", "matmul"}
BATCHED = {"bmm", "baddbmm"}


@pytest.mark.parametrize("bias", [True, False])
def test_auto_on_expanded_input_never_materialises_copies(bias):
    """Note [wide::linear strategies]: a shared (expanded) input runs as ONE GEMM against the
    concatenated weights when a gradient is wanted, and as one batched GEMM over the expanded
    input as it is without one; neither copies the input."""
    torch.manual_seed(4)
    n, b, i, o = 5, 3, 4, 6
    x = torch.randn(b, i)
    w, bb = torch.randn(n, o, i), (torch.randn(n, o) if bias else None)
    ops = _record(x.expand(n, b, i), w.requires_grad_(), bb, strategy="auto")
    assert sum(op in GEMMS for op in ops) == 1, ops
    assert not BATCHED & set(ops), ops
    assert "clone" not in ops and "contiguous" not in ops, ops
    with torch.no_grad():
        ops = _record(x.expand(n, b, i), w, bb, strategy="auto")
    assert sum(op in BATCHED for op in ops) == 1, ops
    assert not GEMMS & set(ops), ops
    assert "clone" not in ops and "contiguous" not in ops, ops


def test_a_large_shared_layer_runs_batched_in_training_and_matches():
    """A member weight of 32K elements or more: the shared input runs through the batched GEMM in
    training too (Note [wide::linear strategies]); values and gradients match the members."""
    torch.manual_seed(6)
    n, b, i, o = 3, 4, 128, 256
    x = torch.randn(b, i, requires_grad=True)
    w, bb = torch.randn(n, o, i, requires_grad=True), torch.randn(n, o, requires_grad=True)
    ops = _record(x.expand(n, b, i), w, bb, strategy="auto")
    assert sum(op in BATCHED for op in ops) == 1 and not GEMMS & set(ops), ops
    y = wide_linear(x.expand(n, b, i), w, bb)
    y.square().sum().backward()
    ref = torch.stack([torch.nn.functional.linear(x, w[k], bb[k]) for k in range(n)])
    torch.testing.assert_close(y, ref)
    gx, gw = torch.autograd.grad(ref.square().sum(), (x, w))
    torch.testing.assert_close(x.grad, gx, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(w.grad, gw, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("bias", [True, False])
def test_bmm_strategy_runs_one_batched_gemm(bias):
    torch.manual_seed(5)
    n = 5
    x, w = torch.randn(n, 3, 4), torch.randn(n, 6, 4)
    bb = torch.randn(n, 6) if bias else None
    for strategy in ("auto", "bmm"):
        ops = _record(x, w, bb, strategy=strategy)
        assert sum(op in BATCHED for op in ops) == 1, (strategy, ops)
        assert not GEMMS & set(ops), (strategy, ops)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("bias", [True, False])
def test_backward_hands_parameters_gradients_in_their_own_layout(strategy, bias):
    """Note [Linear weight gradient layout]: the weight and bias gradients come with their
    parameters' strides, so .backward() stores them without a copy (AccumulateGrad would copy any
    other layout: the strides are checked on torch.autograd.grad's results); accumulating a
    second backward adds exactly the second gradient, as for nn.Linear."""
    torch.manual_seed(9)
    n, b, fin, fout = 4, 3, 5, 7
    x = torch.randn(n, b, fin, requires_grad=True)
    w = torch.randn(n, fout, fin, requires_grad=True)
    bb = torch.randn(n, fout, requires_grad=True) if bias else None
    g1, g2 = torch.randn(n, b, fout), torch.randn(n, b, fout)
    leaves = (w,) if bb is None else (w, bb)
    raw = torch.autograd.grad(wide_linear(x, w, bb, strategy=strategy), leaves, g1)
    for leaf, g in zip(leaves, raw):
        assert g.stride() == leaf.stride(), (strategy, g.stride())
    wide_linear(x, w, bb, strategy=strategy).backward(g1)
    first = w.grad.clone()
    wide_linear(x, w, bb, strategy=strategy).backward(g2)
    ref = torch.stack([F.linear(x[i], w[i], None if bb is None else bb[i]) for i in range(n)])
    gw = torch.autograd.grad(ref, w, g1 + g2, retain_graph=True)[0]
    torch.testing.assert_close(w.grad, gw)
    torch.testing.assert_close(first, torch.autograd.grad(ref, w, g1)[0])
    gx = torch.einsum("nbo,noi->nbi", g1 + g2, w.detach())
    torch.testing.assert_close(x.grad, gx)
    if bias:
        torch.testing.assert_close(bb.grad, (g1 + g2).sum(1))


@cpu_only
def test_bmm_training_gradient_layout_is_free_of_weight_copies():
    """The bmm strategy's backward runs two batched GEMMs and no copy of the weight or its gradient
    (the composite's transposed weight gradient cost one strided copy per step in AccumulateGrad)."""
    torch.manual_seed(10)
    x = torch.randn(3, 4, 6, requires_grad=True)
    w = torch.randn(3, 5, 6, requires_grad=True)
    with torch.profiler.profile() as prof:
        wide_linear(x, w, strategy="bmm").sum().backward()
    names = [e.name for e in prof.events()]
    assert names.count("aten::bmm") == 3, names  # forward, input and weight gradients
    assert "aten::copy_" not in names and "aten::clone" not in names, names
    assert w.grad.is_contiguous()


def test_bmm_training_double_backward_matches_separate_linears():
    """create_graph=True through the autograd function: second derivatives as nn.Linear's."""
    torch.manual_seed(11)
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
    bb = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)

    def second(f):
        y = f(x, w, bb)
        gx, gw = torch.autograd.grad((y ** 2).sum(), (x, w), create_graph=True)
        return torch.autograd.grad((gx ** 2).sum() + (gw ** 3).sum(), (x, w, bb))

    wide = second(lambda x, w, bb: wide_linear(x, w, bb, strategy="bmm"))
    ref = second(lambda x, w, bb: torch.stack([F.linear(x[i], w[i], bb[i]) for i in range(2)]))
    for a, r in zip(wide, ref):
        torch.testing.assert_close(a, r)


@pytest.mark.parametrize("rank", RANKS)
def test_loop_strategy_runs_one_gemm_per_member(rank):
    torch.manual_seed(6)
    n = 4
    lead = {1: (), 2: (3,), 3: (3, 2)}[rank]
    x, w, b = torch.randn(n, *lead, 4), torch.randn(n, 6, 4), torch.randn(n, 6)
    ops = _record(x, w, b, strategy="loop")
    assert sum(op in GEMMS for op in ops) == n, ops
    assert not BATCHED & set(ops), ops


# ---------------------------------------------------------------------------------------------
# torch.library.opcheck of wide.linear (every strategy x layout, with and without gradients, and
# test_aot_dispatch_dynamic per strategy) lives in test_op_db.py, with every other op's.
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------------------------
def _mlp_step(x, w1, b1, w2, strategy):
    h = torch.relu(wide_linear(x, w1, b1, strategy=strategy))
    return wide_linear(h, w2, None, strategy=strategy)


def _mlp_reference(x, w1, b1, w2):
    return torch.stack([F.linear(torch.relu(F.linear(x[k], w1[k], b1[k])), w2[k])
                        for k in range(w1.shape[0])])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_torch_compile_fullgraph_dynamic_batch_aot_eager(strategy):
    """fullgraph capture works, and one graph serves several batch sizes (no recompile)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(8)
    torch._dynamo.reset()
    n, i, h, o = 3, 4, 8, 2
    w1 = torch.randn(n, h, i, requires_grad=True)
    b1 = torch.randn(n, h, requires_grad=True)
    w2 = torch.randn(n, o, h, requires_grad=True)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_mlp_step, backend=counter, fullgraph=True)
    for batch in (5, 7, 2):
        x = torch.randn(n, batch, i)
        torch._dynamo.mark_dynamic(x, 1)
        out = compiled(x, w1, b1, w2, strategy)
        assert out.shape == (n, batch, o)
        assert_close(out, _mlp_reference(x, w1, b1, w2).detach())
        # Gradients flow through the compiled graph.
        w1.grad = None
        out.sum().backward()
        ref_w1 = w1.detach().clone().requires_grad_()
        _mlp_reference(x, ref_w1, b1.detach(), w2.detach()).sum().backward()
        assert_close(w1.grad, ref_w1.grad, kind="grad")
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames"


def test_torch_compile_fullgraph_inductor_dynamic_batch():
    torch.manual_seed(9)
    torch._dynamo.reset()
    n, i, h, o = 2, 4, 8, 3
    w1, b1, w2 = torch.randn(n, h, i), torch.randn(n, h), torch.randn(n, o, h)
    compiled = torch.compile(_mlp_step, fullgraph=True, dynamic=True)
    for batch in (3, 6):
        x = torch.randn(n, batch, i)
        assert_close(compiled(x, w1, b1, w2, "auto"), _mlp_reference(x, w1, b1, w2))
    # A shared (expanded) input through the compiled graph.
    x = torch.randn(4, i)
    xe = x.expand(n, 4, i)
    assert_close(compiled(xe, w1, b1, w2, "auto"), _mlp_reference(xe, w1, b1, w2))


def test_torch_export_captures_the_op_with_dynamic_batch():
    torch.manual_seed(10)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(2, 3, 4))
            self.b = torch.nn.Parameter(torch.randn(2, 3))

        def forward(self, x):
            return wide_linear(x, self.w, self.b, strategy="bmm")

    m = M()
    batch = torch.export.Dim("batch")
    ep = torch.export.export(m, (torch.randn(2, 5, 4),), dynamic_shapes=({1: batch},))
    targets = [node.target for node in ep.graph.nodes if node.op == "call_function"]
    assert torch.ops.wide.linear.default in targets, targets
    x = torch.randn(2, 9, 4)
    assert_close(ep.module()(x), m(x))


# ---------------------------------------------------------------------------------------------
# Errors: the op checks its arguments and says what it expected and what it got.
# ---------------------------------------------------------------------------------------------
def _good():
    return torch.randn(3, 2, 4), torch.randn(3, 5, 4), torch.randn(3, 5)


def test_error_bad_strategy():
    x, w, b = _good()
    with pytest.raises(RuntimeError, match=r"strategy 'auto', 'bmm', 'bmm_t' or 'loop', got 'fast'"):
        wide_linear(x, w, b, strategy="fast")


def test_error_weight_rank():
    x, w, b = _good()
    with pytest.raises(RuntimeError, match=r"expected weight of shape \[N, out, in\], got \[5, 4\]"):
        wide_linear(x, w[0], b)


def test_error_input_rank():
    _, w, b = _good()
    with pytest.raises(RuntimeError, match=r"at least 2 dims, got \[4\]"):
        wide_linear(torch.randn(4), w, b)


def test_error_member_count_mismatch():
    _, w, b = _good()
    with pytest.raises(RuntimeError, match=r"input has 2 members \(dim 0\) but weight has 3"):
        wide_linear(torch.randn(2, 2, 4), w, b)


def test_error_feature_mismatch():
    _, w, b = _good()
    with pytest.raises(RuntimeError, match=r"input features \(last dim\) 6 do not match weight "
                                           r"in_features 4"):
        wide_linear(torch.randn(3, 2, 6), w, b)


@pytest.mark.parametrize("bad_shape", [(3, 4), (2, 5), (3, 5, 1), (5,), (15,)])
def test_error_bad_bias_shape(bad_shape):
    x, w, _ = _good()
    with pytest.raises(RuntimeError, match=r"expected bias of shape \[N, out\] = \[3, 5\], got"):
        wide_linear(x, w, torch.randn(bad_shape))


def test_error_dtype_mismatch():
    x, w, b = _good()
    with pytest.raises(RuntimeError, match=r"same dtype, got Double and Float"):
        wide_linear(x.double(), w, b)
    with pytest.raises(RuntimeError, match=r"bias with the weight's dtype"):
        wide_linear(x, w, b.double())


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_errors_are_raised_for_every_strategy_and_shared_input(strategy):
    _, w, b = _good()
    x_shared = torch.randn(2, 6).expand(3, 2, 6)
    with pytest.raises(RuntimeError, match=r"do not match weight in_features"):
        wide_linear(x_shared, w, b, strategy=strategy)


# ---------------------------------------------------------------------------------------------
# Property test over random shapes.
# ---------------------------------------------------------------------------------------------


# no deadline and no too_slow health check: both time the examples, which a busy machine slows
@settings(deadline=None, max_examples=25, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 4),
    lead=st.lists(st.integers(1, 4), min_size=0, max_size=3),
    in_features=st.integers(1, 9),
    out_features=st.integers(1, 9),
    strategy=st.sampled_from(STRATEGIES),
    bias=st.booleans(),
    layout=st.sampled_from(LAYOUTS),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_property_random_shapes(n, lead, in_features, out_features, strategy, bias, layout,
                                dtype, seed):
    torch.manual_seed(seed)
    x, leaf = make_wide_input(n, tuple(lead), in_features, layout, dtype, requires_grad=True)
    w = torch.randn(n, out_features, in_features, dtype=dtype, requires_grad=True)
    b = torch.randn(n, out_features, dtype=dtype, requires_grad=True) if bias else None
    sample = Sample("hyp", x, leaf, w, b, strategy, layout == "shared")
    ref_out, ref_xg, ref_wg, ref_bg, gs = reference(sample)
    out = wide_linear(x, w, b, strategy=strategy)
    assert out.shape == (n, *lead, out_features)
    assert_members_close(out, ref_out, dtype)
    (out * torch.stack(gs)).sum().backward()
    if sample.shared:
        torch.testing.assert_close(leaf.grad, ref_xg, **tolerance(dtype, "grad"))
    else:
        assert_members_close(leaf.grad, list(ref_xg), kind="grad", what="input grad")
    assert_members_close(w.grad, ref_wg, kind="grad", what="weight grad")
    if b is not None:
        assert_members_close(b.grad, ref_bg, kind="grad", what="bias grad")
