"""Wide norms (BatchNorm, InstanceNorm, GroupNorm, LayerNorm, RMSNorm) and PReLU against N separate
modules: outputs, input/parameter grads and running stats, train and eval (opcheck: test_op_db.py)."""
from __future__ import annotations

import pytest
import torch
import wide_compiler as wc
import torch.nn.functional as F
from torch import nn
from wide_compiler.testing import assert_members_close, check_equivalence, make_members
from support import DEVICE, cpu_only

FAST = wc.WideConfig.fast()  # no strategy timing: these tests check values, not speed


def _members(make, n=3, dtype=torch.float32):
    torch.manual_seed(0)
    ms = [make().to(dtype) for _ in range(n)]
    with torch.no_grad():  # distinct affine params and running stats per member
        for i, m in enumerate(ms):
            for p in m.parameters():
                p.add_(torch.randn_like(p) * 0.3)
            for name, b in m.named_buffers():
                if b.is_floating_point():
                    b.add_(torch.rand_like(b) * 0.5)
    return ms


BN = [
    (nn.BatchNorm1d, wc.nn.WideBatchNorm1d, (2, 4)),
    (nn.BatchNorm1d, wc.nn.WideBatchNorm1d, (2, 4, 5)),
    (nn.BatchNorm2d, wc.nn.WideBatchNorm2d, (2, 4, 3, 3)),
    (nn.BatchNorm3d, wc.nn.WideBatchNorm3d, (2, 4, 2, 3, 2)),
    # 16 or more values per (sample, channel): the training kernel (Note [Batch norm training kernel])
    (nn.BatchNorm1d, wc.nn.WideBatchNorm1d, (2, 4, 17)),
    (nn.BatchNorm2d, wc.nn.WideBatchNorm2d, (2, 4, 4, 5)),
]


@pytest.mark.parametrize("base,wcls,shape", BN, ids=["bn1d-2d", "bn1d-3d", "bn2d", "bn3d", "bn1d-kernel", "bn2d-kernel"])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("track", [True, False])
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_module(base, wcls, shape, affine, track, momentum, training):
    models = [m.train(training) for m in _members(lambda: base(4, affine=affine, track_running_stats=track,
                                                                momentum=momentum))]
    wide = wcls.from_modules(models).train(training)
    x = torch.randn(3, *shape)
    check_equivalence(wide, models, x)  # outputs, grads, and the running stats after the call


@pytest.mark.parametrize("d,shape", [(1, (2, 3, 6)), (2, (2, 3, 4, 5)), (3, (2, 3, 2, 3, 4)), (1, (3, 6))])
@pytest.mark.parametrize("affine,track", [(True, True), (False, False), (True, False)])
@pytest.mark.parametrize("training", [True, False])
def test_instance_norm_module(d, shape, affine, track, training):
    base = {1: nn.InstanceNorm1d, 2: nn.InstanceNorm2d, 3: nn.InstanceNorm3d}[d]
    wcls = {1: wc.nn.WideInstanceNorm1d, 2: wc.nn.WideInstanceNorm2d, 3: wc.nn.WideInstanceNorm3d}[d]
    models = [m.train(training) for m in _members(lambda: base(3, affine=affine, track_running_stats=track))]
    wide = wcls.from_modules(models).train(training)
    check_equivalence(wide, models, torch.randn(3, *shape))


@pytest.mark.parametrize("groups,affine,shape", [(2, True, (2, 6, 5)), (3, False, (1, 6, 2, 3)), (6, True, (2, 6))])
def test_group_norm_module(groups, affine, shape):
    models = _members(lambda: nn.GroupNorm(groups, 6, affine=affine))
    wide = wc.nn.WideGroupNorm.from_modules(models)
    check_equivalence(wide, models, torch.randn(3, *shape))


@pytest.mark.parametrize("ns,affine,bias", [([5], True, True), ([3, 5], True, False), ([5], False, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_layer_norm_module(ns, affine, bias, dtype):
    models = _members(lambda: nn.LayerNorm(ns, elementwise_affine=affine, bias=bias), dtype=dtype)
    wide = wc.nn.WideLayerNorm.from_modules(models)
    check_equivalence(wide, models, torch.randn(3, 2, 3, 5, dtype=dtype), dtype=dtype)


@pytest.mark.parametrize("ns,affine,eps", [([5], True, None), ([3, 5], True, 1e-3), ([5], False, None)])
def test_rms_norm_module(ns, affine, eps):
    models = _members(lambda: nn.RMSNorm(ns, eps=eps, elementwise_affine=affine))
    wide = wc.nn.WideRMSNorm.from_modules(models)
    check_equivalence(wide, models, torch.randn(3, 2, 3, 5))


@pytest.mark.parametrize("num_parameters,shape", [(1, (2, 4, 5)), (4, (2, 4, 5)), (4, (2, 4)), (1, (4,))])
def test_prelu_module(num_parameters, shape):
    models = _members(lambda: nn.PReLU(num_parameters))
    wide = wc.nn.WidePReLU.from_modules(models)
    check_equivalence(wide, models, torch.randn(3, *shape))
    assert [torch.equal(a.weight, b.weight) for a, b in zip(models, wide.unfuse())] == [True] * 3


def test_prelu_1d_input_with_channel_slopes_is_rejected_like_pytorch():
    wide = wc.nn.WidePReLU.from_modules([nn.PReLU(4) for _ in range(2)])
    with pytest.raises(ValueError, match="1-d member input"):
        wide(torch.randn(2, 4))


def test_norm_unfuse_round_trip():
    models = _members(lambda: nn.BatchNorm2d(4))
    wide = wc.nn.WideBatchNorm2d.from_modules(models)
    wide(torch.randn(3, 2, 4, 3, 3))
    for i, m in enumerate(wide.unfuse()):
        assert isinstance(m, nn.BatchNorm2d)
        assert torch.equal(m.running_mean, wide.running_mean[i]) and int(m.num_batches_tracked) == 1


# opcheck of the norm ops, prelu, add_layer_norm and fused_norm(_backward): test_op_db.py


def test_batch_norm_noncontiguous_running_stats_written_back():
    rm, rv = torch.zeros(3, 2).t(), torch.ones(3, 2).t()
    x = torch.randn(2, 5, 3)
    torch.ops.wide.batch_norm(x, None, None, rm, rv, True, 0.5, 1e-5)
    ref = [nn.BatchNorm1d(3, affine=False, momentum=0.5) for _ in range(2)]
    for i, m in enumerate(ref):
        m(x[i])
        torch.testing.assert_close(rm[i], m.running_mean)
        torch.testing.assert_close(rv[i], m.running_var)


@pytest.mark.parametrize("training", [True, False])
def test_compile_norm_net_buffers_after_train_step(training):
    def make():
        return nn.Sequential(nn.Conv1d(3, 4, 3), nn.BatchNorm1d(4), nn.GroupNorm(2, 4), nn.InstanceNorm1d(4, affine=True,
                             track_running_stats=True), nn.PReLU(4), nn.LayerNorm([4, 6]), nn.RMSNorm(6))
    models = [m.train(training) for m in _members(make)]
    wide = wc.compile(models, torch.randn(2, 3, 8), strict=True, config=FAST)
    wide.train(training)
    x = torch.randn(3, 2, 3, 8)
    check_equivalence(wide, models, x)  # every buffer compared after the call
    assert not wide.fallbacks


class _PostNorm(nn.Module):
    """Two post-norm residual blocks (LayerNorm of a sum only the norm reads) and an RMSNorm."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 6), nn.Linear(6, 6)
        self.n1, self.n2, self.rms = nn.LayerNorm(6), nn.LayerNorm(6, bias=False), nn.RMSNorm(6)

    def forward(self, x):
        h = self.n1(x + self.fc1(x))
        h = self.n2(self.fc2(h) + h)
        return self.rms(h) + h


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_eval_residual_norms_fuse_and_match_members(grad):
    """The eval graph reads the residual sums inside the norms (wide.add_layer_norm); without a
    gradient that is the one-pass kernel (wide.fused_norm), with one the composite: both match
    the members, and the input gradient too."""
    models = make_members(_PostNorm, 3)
    for m in models:
        with torch.no_grad():
            for p in m.parameters():
                p.uniform_(-2, 2)  # members' affines far from the identity
    wide = wc.compile(models, torch.randn(4, 6), config=FAST).eval()
    ops = [n.target for n in wide._graph_for(False).graph_module.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.wide.add_layer_norm.default) == 2
    x = torch.randn(3, 5, 6) * torch.tensor([1.0, 10.0, 100.0]).view(3, 1, 1)
    xs = [x[i].clone().requires_grad_(grad) for i in range(3)]
    xw = x.clone().requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        out = wide(xw)
        refs = [m.eval()(xi) for m, xi in zip(models, xs)]
    assert out.requires_grad == grad
    assert_members_close(out, refs)
    if grad:
        out.sum().backward()
        torch.stack(refs).sum().backward()
        assert_members_close(xw.grad, [xi.grad for xi in xs])


def test_fused_norm_kernel_under_inference_mode_and_torch_compile():
    models = make_members(_PostNorm, 2)
    wide = wc.compile(models, torch.randn(4, 6), config=FAST).eval()
    x = torch.randn(2, 3, 6)
    with torch.inference_mode():
        want = [m.eval()(x[i]) for i, m in enumerate(models)]
        assert_members_close(wide(x), want)
    compiled = torch.compile(wide, fullgraph=True)
    with torch.no_grad():
        assert_members_close(compiled(x), want)


def test_eval_relu_after_linear_runs_in_place_and_keeps_gradients():
    models = make_members(lambda: nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), 3)
    wide = wc.compile(models, torch.randn(5, 4), config=FAST).eval()
    ops = [n.target for n in wide._graph_for(False).graph_module.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.relu_.default in ops and torch.ops.aten.relu.default not in ops
    x = torch.randn(3, 5, 4, requires_grad=True)
    xs = [x[i].detach().clone().requires_grad_() for i in range(3)]
    out = wide(x)
    refs = [m.eval()(xi) for m, xi in zip(models, xs)]
    assert_members_close(out, refs)
    out.sum().backward()
    torch.stack(refs).sum().backward()
    assert_members_close(x.grad, [xi.grad for xi in xs])
    assert_members_close(wide.get_parameter("0.weight").grad, [m[0].weight.grad for m in models])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_fused_norm_gradients_match_members(dtype, rms, residual):
    """With a gradient wanted, wide.fused_norm is the kernel with its own backward
    (wide.fused_norm_backward): input, residual, weight and bias gradients per member, members
    on very different scales, against each member's own F.layer_norm / F.rms_norm."""
    g = torch.Generator(DEVICE).manual_seed(1)
    n, d = 4, 37  # d across vector widths (tails)
    x = (torch.randn(n, 3, 5, d, generator=g, dtype=dtype)
         * torch.tensor([1e-2, 1.0, 30.0, 1e3], dtype=dtype).view(n, 1, 1, 1)).requires_grad_()
    res = torch.randn(n, 3, 5, d, generator=g, dtype=dtype).requires_grad_() if residual else None
    w = torch.randn(n, d, generator=g, dtype=dtype).requires_grad_()
    b = None if rms else torch.randn(n, d, generator=g, dtype=dtype).requires_grad_()
    out = torch.ops.wide.fused_norm(x, res, d, w, b, 1e-5, rms)
    grad = torch.randn(out.shape, generator=g, dtype=dtype)
    inputs = [t for t in (x, res, w, b) if t is not None]
    got = torch.autograd.grad(out, inputs, grad)
    s = x + res if residual else x
    ref = torch.stack([F.rms_norm(s[i], (d,), w[i], 1e-5) if rms else F.layer_norm(s[i], (d,), w[i], b[i], 1e-5)
                       for i in range(n)])
    want = torch.autograd.grad(ref, inputs, grad)
    tol = {torch.float32: 2e-4, torch.float64: 1e-10}[dtype]
    for name, a, e in zip(["input", "residual", "weight", "bias"] if residual else ["input", "weight", "bias"], got, want):
        torch.testing.assert_close(a, e, atol=tol, rtol=tol, msg=lambda m, name=name: f"{name}: {m}")


def test_fused_norm_gradcheck_and_double_backward():
    g = torch.Generator(DEVICE).manual_seed(2)
    c = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_()  # noqa: E731
    x, r, w, b = c(2, 3, 5), c(2, 3, 5), c(2, 5), c(2, 5)
    fn = lambda x, r, w, b: torch.ops.wide.fused_norm(x, r, 5, w, b, 1e-5, False)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, r, w, b))
    assert torch.autograd.gradgradcheck(fn, (x, r, w, b))  # create_graph: the formula in ATen ops
    rms = lambda x, w: torch.ops.wide.fused_norm(x, None, 5, w, None, 1e-6, True)  # noqa: E731
    assert torch.autograd.gradcheck(rms, (x, w)) and torch.autograd.gradgradcheck(rms, (x, w))


def test_fused_norm_nan_member_and_partial_grads():
    """A NaN in one member's input stays in that member's gradients; asking only for the weight's
    gradient works (the others are not computed)."""
    x = torch.randn(3, 4, 8)
    x[1, 2, 3] = float("nan")
    x.requires_grad_()
    w = torch.randn(3, 8, requires_grad=True)
    b = torch.randn(3, 8)
    out = torch.ops.wide.fused_norm(x, None, 8, w, b, 1e-5, False)
    gx, gw = torch.autograd.grad((out * torch.randn_like(out)).nan_to_num().sum(), [x, w])
    assert gx[1, 2].isnan().all() and not gx[[0, 2]].isnan().any() and not gx[1, [0, 1, 3]].isnan().any()
    assert not gw[[0, 2]].isnan().any()
    (gw_only,) = torch.autograd.grad(torch.ops.wide.fused_norm(x.detach(), None, 8, w, None, 1e-5, False).sum(), [w])
    assert gw_only.shape == w.shape


def _bn_args(n=3, b=4, c=5, spatial=(6, 7), dtype=torch.float32, seed=0):
    g = torch.Generator(DEVICE).manual_seed(seed)
    x = torch.randn(n, b, c, *spatial, generator=g, dtype=dtype) * 3 + 1
    w, bias = torch.rand(n, c, generator=g, dtype=dtype) + 0.5, torch.randn(n, c, generator=g, dtype=dtype)
    rm, rv = torch.randn(n, c, generator=g, dtype=dtype), torch.rand(n, c, generator=g, dtype=dtype) + 0.5
    return x, w, bias, rm, rv


def _bn_members(x, w, b, rm, rv, momentum=0.1, eps=1e-5):
    """Each member's F.batch_norm in training: outputs (N-first) and its updated running stats."""
    rm, rv = rm.clone(), rv.clone()
    ys = [F.batch_norm(x[i], rm[i], rv[i], w[i], b[i], True, momentum, eps) for i in range(x.shape[0])]
    return torch.stack(ys), rm, rv


@cpu_only
def test_batch_norm_training_takes_the_kernel_and_matches_members():
    """Note [Batch norm training kernel]: wide.batch_norm in training on a contiguous CPU input
    with 16+ values per (sample, channel) runs wide::fused_batch_norm and its backward (the
    profiler sees them, not aten::native_batch_norm); outputs, every gradient and the running
    stats match the members, and the stats' version counters move (cached eval folds see them)."""
    x, w, b, rm, rv = _bn_args()
    leaves = [t.requires_grad_() for t in (x, w, b)]
    want_y, want_rm, want_rv = _bn_members(x, w, b, rm, rv)
    versions = rm._version, rv._version
    with torch.profiler.profile() as prof:
        y = torch.ops.wide.batch_norm(x, w, b, rm, rv, True, 0.1, 1e-5)
        dy = torch.randn_like(y)
        got = torch.autograd.grad(y, leaves, dy)
    names = {e.name for e in prof.events()}
    assert {"wide::fused_batch_norm", "wide::fused_batch_norm_backward"} <= names
    assert "aten::native_batch_norm" not in names and "aten::native_batch_norm_backward" not in names
    n, c = x.shape[0], x.shape[2]
    torch.testing.assert_close(y, want_y.transpose(0, 1).reshape(y.shape))  # packed [B, N*C, *]
    want = torch.autograd.grad(want_y, leaves, dy.unflatten(1, (n, c)).transpose(0, 1))
    for g, wg in zip(got, want):
        torch.testing.assert_close(g, wg)
    torch.testing.assert_close(rm, want_rm)
    torch.testing.assert_close(rv, want_rv)
    assert rm._version > versions[0] and rv._version > versions[1]


@pytest.mark.parametrize("case", ["nan-member", "constant-channel", "no-affine-no-stats", "threads"])
def test_batch_norm_training_kernel_adversarial(case):
    """The kernel on inputs that break naive ones: a NaN in one member stays in that member (its
    output and running stats; the others match their members); a constant channel (variance 0)
    normalises to the bias as ATen's does (up to the rounding 1/sqrt(eps) magnifies); no affine and no running stats; and 1 and 2 threads give
    the same bits."""
    x, w, b, rm, rv = _bn_args(seed=1)
    if case == "nan-member":
        x[1, 2, 3, 0, 0] = float("nan")
    if case == "constant-channel":
        x[0, :, 1] = 2.5
    if case == "no-affine-no-stats":
        w = b = rm = rv = None
    if case == "threads":
        before = torch.get_num_threads()
        try:
            outs = []
            for threads in (1, 2):
                torch.set_num_threads(threads)
                outs.append(torch.ops.wide.batch_norm(x, w, b, rm.clone(), rv.clone(), True, 0.1, 1e-5))
        finally:
            torch.set_num_threads(before)
        assert torch.equal(outs[0], outs[1])
        return
    got_rm, got_rv = (rm.clone(), rv.clone()) if rm is not None else (None, None)
    y = torch.ops.wide.batch_norm(x, w, b, got_rm, got_rv, True, 0.1, 1e-5)
    y = y.unflatten(1, (x.shape[0], x.shape[2])).transpose(0, 1)  # N-first
    for i in range(x.shape[0]):
        member = [t[i] if t is not None else None for t in (rm, rv)]
        member = [t.clone() if t is not None else None for t in member]
        want = F.batch_norm(x[i], *member, w[i] if w is not None else None, b[i] if b is not None else None,
                            True, 0.1, 1e-5)
        # constant channel: ATen's mean is off by float rounding, which 1/sqrt(eps) magnifies
        tol = dict(atol=2e-4, rtol=0) if case == "constant-channel" else {}
        torch.testing.assert_close(y[i], want, equal_nan=True, **tol)
        if rm is not None:
            torch.testing.assert_close(got_rm[i], member[0], equal_nan=True)
            torch.testing.assert_close(got_rv[i], member[1], equal_nan=True)
    if case == "nan-member":
        assert y[1, :, 3].isnan().all() and not y[[0, 2]].isnan().any() and not y[1, :, [0, 1, 2, 4]].isnan().any()
        assert got_rm[1, 3].isnan() and got_rm.isnan().sum() == 1
    if case == "constant-channel":
        # y = x * scale + (bias - mean * scale), ATen's form: bias up to the rounding of mean * scale
        torch.testing.assert_close(y[0, :, 1], b[0, 1].expand_as(y[0, :, 1]), atol=2e-4, rtol=0)


def test_batch_norm_training_kernel_gradcheck():
    """The kernel's forward and backward (and, under create_graph, ATen's differentiable backward
    with the kernel's statistics) against finite differences in float64."""
    x, w, b, rm, rv = _bn_args(n=2, b=2, c=2, spatial=(4, 5), dtype=torch.float64, seed=2)
    fn = lambda x, w, b: torch.ops.wide.batch_norm(x, w, b, rm.clone(), rv.clone(), True, 0.1, 1e-5)  # noqa: E731
    inputs = [t.requires_grad_() for t in (x, w, b)]
    assert torch.autograd.gradcheck(fn, inputs)
    assert torch.autograd.gradgradcheck(fn, inputs)


@pytest.mark.parametrize("op", ["batch_norm", "layer_norm", "group_norm_nfirst"])
def test_norm_kernels_leave_forward_mode_ad_to_aten(op):
    """The norms' CPU kernels (BatchNorm in training, the fused LayerNorm, the N-first GroupNorm)
    have no forward derivative; with a forward-mode tangent (torch.func.jvp) the norms take
    ATen's ops instead, and the tangent is each member's own."""
    g = torch.Generator(DEVICE).manual_seed(0)
    x, t = torch.randn(2, 3, 4, 5, 5, generator=g), torch.randn(2, 3, 4, 5, 5, generator=g)
    w, b = torch.rand(2, 4, generator=g) + 0.5, torch.randn(2, 4, generator=g)
    if op == "batch_norm":  # 25 values per (sample, channel): the kernel's size
        def wide(x):
            y = torch.ops.wide.batch_norm(x, w, b, None, None, True, 0.1, 1e-5)
            return y.unflatten(1, (2, 4)).transpose(0, 1)  # packed -> N-first

        def member(i, x):
            return F.batch_norm(x, None, None, w[i], b[i], True, 0.1, 1e-5)
    elif op == "layer_norm":
        def wide(x):
            return torch.ops.wide.layer_norm(x, [5], w[:, :1].expand(2, 5), None, 1e-5)

        def member(i, x):
            return F.layer_norm(x, [5], w[i, :1].expand(5), None, 1e-5)
    else:
        def wide(x):
            return torch.ops.wide.group_norm_nfirst(x, 2, w, b, 1e-5)

        def member(i, x):
            return F.group_norm(x, 2, w[i], b[i], 1e-5)
    _, tangent = torch.func.jvp(wide, (x,), (t,))
    for i in range(2):
        _, want = torch.func.jvp(lambda xi, i=i: member(i, xi), (x[i],), (t[i],))
        torch.testing.assert_close(tangent[i], want)


@cpu_only
def test_layer_norm_training_takes_the_kernel():
    """wide.layer_norm with a gradient wanted runs wide.fused_norm and its backward kernel on the
    CPU (strategy fused/auto), and the per-member loop with strategy loop."""
    x = torch.randn(4, 6, 16, requires_grad=True)
    w, b = torch.randn(4, 16, requires_grad=True), torch.randn(4, 16, requires_grad=True)

    def names(strategy):
        with torch.profiler.profile() as prof:
            torch.ops.wide.layer_norm(x, [16], w, b, 1e-5, strategy=strategy).sum().backward()
        return {e.name for e in prof.events()}
    assert {"wide::fused_norm", "wide::fused_norm_backward"} <= names("fused")
    assert "wide::fused_norm_backward" not in names("loop")


@cpu_only
@pytest.mark.parametrize("layout", ["nfirst", "packed_cl"])
def test_instance_norm_without_running_stats_runs_group_norm_and_matches_members(layout):
    """Note [wide norms]: InstanceNorm with instance statistics and no running statistics runs as
    ATen's CPU group_norm with a group per channel (the profiler sees it, not instance_norm's
    batch_norm); outputs and gradients match the members, NaN stays in its member, a bias
    without a weight keeps instance_norm (PyTorch's group_norm backward fails there), and with
    running statistics instance_norm runs and updates them."""
    from torch.profiler import profile

    n, c = 3, 4
    ms = _members(lambda: nn.InstanceNorm2d(c, affine=True), n)
    w = torch.stack([m.weight.detach() for m in ms]).requires_grad_()
    b = torch.stack([m.bias.detach() for m in ms]).requires_grad_()
    x = torch.randn(n, 2, c, 5, 6)
    x[1, 0, 2, 3, 3] = float("nan")
    arg = x if layout == "nfirst" else torch.ops.wide.to_packed(x).contiguous(memory_format=torch.channels_last)
    arg = arg.detach().requires_grad_()
    with profile() as p:
        y = torch.ops.wide.instance_norm(arg, w, b, None, None, True, 0.1, 1e-5, packed_input=layout != "nfirst")
    names = {e.key for e in p.key_averages()}
    assert "aten::native_group_norm" in names and "aten::instance_norm" not in names, names
    want = [m(x[i]) for i, m in enumerate(ms)]
    got = torch.stack([y[:, i * c:(i + 1) * c] for i in range(n)])  # the result is packed
    assert_members_close(got, want, equal_nan=True)
    assert got[1].isnan().any() and not got[0].isnan().any() and not got[2].isnan().any()
    g = torch.randn_like(got).nan_to_num()
    got.backward(g, inputs=[w, b])
    for i in (0, 2):  # member 1's gradients are NaN, as its own
        wg, bg = torch.autograd.grad(ms[i](x[i]), [ms[i].weight, ms[i].bias], g[i])
        torch.testing.assert_close(w.grad[i], wg, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(b.grad[i], bg, rtol=1e-4, atol=1e-5)
    assert w.grad[1].isnan().any()
    with profile() as p:  # a bias without a weight, and running statistics: instance_norm
        torch.ops.wide.instance_norm(x, None, b, None, None, True, 0.1, 1e-5)
        rm, rv = torch.zeros(n, c), torch.ones(n, c)
        torch.ops.wide.instance_norm(x.nan_to_num(), w, b, rm, rv, True, 0.1, 1e-5)
    assert sum(e.count for e in p.key_averages() if e.key == "aten::instance_norm") == 2
    assert not torch.equal(rm, torch.zeros(n, c)) and rv.isfinite().all()


@pytest.mark.parametrize("op", ["group_norm", "instance_norm"])
def test_channels_last_norm_parameter_gradients_alone(op):
    """ATen 2.13's CPU group_norm backward crashes for a channels-last input when only the
    weight/bias gradients are wanted; the wide GroupNorm (and InstanceNorm, which runs it)
    gives them, equal to the members'."""
    n, c = 2, 4
    x = torch.randn(n, 3, c, 5, 5)
    packed = torch.ops.wide.to_packed(x).contiguous(memory_format=torch.channels_last)
    w, b = torch.rand(n, c, requires_grad=True), torch.randn(n, c, requires_grad=True)
    if op == "group_norm":
        y = torch.ops.wide.group_norm(packed, n, 2, w, b, 1e-5, packed_input=True)
        ref = [F.group_norm(x[i], 2, w[i], b[i]) for i in range(n)]
    else:
        y = torch.ops.wide.instance_norm(packed, w, b, None, None, True, 0.1, 1e-5, packed_input=True)
        ref = [F.instance_norm(x[i], weight=w[i], bias=b[i]) for i in range(n)]
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, [w, b], g)
    want = torch.autograd.grad(ref, [w, b], [g[:, i * c:(i + 1) * c] for i in range(n)])
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)


def _call_targets(wide, training: bool) -> list:
    return [n.target for n in wide._graph_for(training).graph_module.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("make,sample", [
    (lambda: nn.GroupNorm(2, 6), (2, 6, 5, 4)),
    (lambda: nn.GroupNorm(3, 6, affine=False), (1, 6, 7)),
    (lambda: nn.GroupNorm(1, 6), (3, 6)),
], ids=["gn-2d", "gn-no-affine-B1-1d", "gn-one-group-0d"])
def test_group_norm_between_nfirst_ops_runs_without_layout_change(make, sample):
    """Note [N-first group norm kernel]: a GroupNorm whose input and readers are N-first runs as
    wide.group_norm_nfirst in both graphs: no packed op and no layout conversion; members match
    in train and eval, gradients too."""
    models = _members(make)
    wide, _ = wc.testing.check_compile(models, torch.randn(*sample), config=FAST)
    for training in (False, True):
        targets = _call_targets(wide, training)
        assert torch.ops.wide.group_norm_nfirst.default in targets, targets
        assert torch.ops.wide.to_nfirst.default not in targets and torch.ops.wide.to_packed.default not in targets
        nodes = wide._graph_for(training).graph_module.graph.nodes
        assert not [n for n in nodes if n.meta.get("wide_layout_conversion")]


def test_group_norm_between_packed_ops_stays_packed():
    """A GroupNorm between convs keeps the channel-packed chain (wide.group_norm, packed input)."""
    def make():
        return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.GroupNorm(3, 6), nn.ReLU(), nn.Conv2d(6, 4, 1))
    models = _members(make)
    wide, _ = wc.testing.check_compile(models, torch.randn(2, 3, 5, 5), config=FAST)
    targets = _call_targets(wide, False)
    assert torch.ops.wide.group_norm.default in targets and torch.ops.wide.group_norm_nfirst.default not in targets


def test_nfirst_group_norm_nan_member_inference_mode_and_torch_compile():
    """The kernel keeps a NaN in its member (and its group), runs under inference_mode, and the
    wide model runs under torch.compile(fullgraph=True) with the same values."""
    models = _members(lambda: nn.GroupNorm(2, 4))
    wide = wc.compile(models, torch.randn(2, 4, 3, 3), config=FAST).eval()
    x = torch.randn(3, 2, 4, 3, 3)
    x[1, 0, 0, 1, 1] = float("nan")
    with torch.inference_mode():
        out = wide(x)
    want = [m(x[i]) for i, m in enumerate(models)]
    assert_members_close(out, want, equal_nan=True)
    assert out[1, 0, :2].isnan().all() and not out[1, 0, 2:].isnan().any() and not out[1, 1].isnan().any()
    assert not out[0].isnan().any() and not out[2].isnan().any()
    compiled = torch.compile(wide, fullgraph=True)
    with torch.no_grad():
        assert_members_close(compiled(x.nan_to_num()), [m(x[i].nan_to_num()) for i, m in enumerate(models)])


def test_group_norm_nfirst_errors_and_grad_path():
    """Bad groups and one value per group raise as PyTorch's checks; with a gradient wanted the op
    is differentiable (the packed group_norm) and agrees with the kernel's values."""
    x = torch.randn(2, 3, 6, 4)
    w, b = torch.rand(2, 6) + 0.5, torch.randn(2, 6)
    with pytest.raises(RuntimeError, match="divisible by num_groups=4"):
        torch.ops.wide.group_norm_nfirst(x, 4, w, b)
    with pytest.raises(RuntimeError, match="more than 1 value per channel"):
        torch.ops.wide.group_norm_nfirst(torch.randn(2, 1, 6), 6)
    fast = torch.ops.wide.group_norm_nfirst(x, 3, w, b)
    wg = w.clone().requires_grad_()
    slow = torch.ops.wide.group_norm_nfirst(x, 3, wg, b)
    torch.testing.assert_close(slow, fast, rtol=1e-5, atol=1e-5)
    (gw,) = torch.autograd.grad(slow.sum(), [wg])
    want = torch.stack([torch.autograd.grad(F.group_norm(x[i], 3, wg[i], b[i]).sum(), [wg])[0][i] for i in range(2)])
    torch.testing.assert_close(gw, want)
