"""Whole models on a CUDA device: compile, every member checked, training, torch.compile, unfuse.

The op-level suite runs on a GPU with ``WIDE_TEST_DEVICE=cuda pytest tests/python/test_op_db.py``
(the op database moves every sample there). This file checks what the op database cannot: whole
models compiled from members that live on the GPU, in train and eval mode, a training run with a
fused optimizer against each member's own ``torch.optim`` run, ``torch.compile(fullgraph=True)``
of the wide model, and members coming back out on the GPU. Skipped without CUDA.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import wide_compiler as wc
from torch import nn
from wide_compiler import zoo
from wide_compiler.testing import assert_members_close, check_equivalence, make_members

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

N = 3
FAST = wc.WideConfig.fast()


class LSTMNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(6, 12, num_layers=2, batch_first=True)
        self.head = nn.Linear(12, 3)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


@pytest.fixture(autouse=True)
def _no_tf32(request):
    """Exactness is checked in true float32: cuDNN's default TF32 (10-bit mantissas in convs and
    RNNs) makes a grouped conv and N separate convs differ at ~1e-3, the wide model and the loop
    alike (README, 'On CUDA'). cuDNN's RNN has no backward in eval mode, for the members' own
    LSTM as for any PyTorch model: the eval LSTM check runs without cuDNN."""
    with torch.backends.cudnn.flags(enabled="lstm-eval" not in request.node.name, allow_tf32=False):
        yield


# name -> (factory, one member's input shape)
MODELS = {
    **{name: (factory, shape) for name, (factory, shape) in zoo.MODELS.items()},
    "resnet_tiny": (lambda: zoo.ResNetTiny(width=8), (2, 3, 32, 32)),
    "mobilenet": (lambda: zoo.mobilenet(width=8), (2, 3, 32, 32)),
    "encoder_layer": (lambda: zoo.encoder_layer(16, 2, 32), (2, 7, 16)),
    "lstm": (LSTMNet, (4, 5, 6)),
}


def _members(name: str, dtype=torch.float32) -> tuple[list[nn.Module], list[torch.Tensor]]:
    factory, shape = MODELS[name]
    models = [m.to("cuda", dtype) for m in make_members(factory, N)]
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(shape, generator=g, dtype=dtype).to("cuda") for _ in range(N)]
    return models, xs


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", list(MODELS))
def test_every_member_matches_its_model_on_cuda(name, training):
    models, xs = _members(name)
    for m in models:
        m.train(training)
    wide = wc.compile(models, xs[0], config=FAST)
    assert all(p.is_cuda for p in wide.parameters()), "the wide model left the GPU"
    out = check_equivalence(wide, models, xs, training=training).wide_output
    assert out.is_cuda


def test_the_default_config_tunes_on_cuda():
    """The default compile measures strategies on the GPU (timings synchronize) and stays exact."""
    models, xs = _members("convnet")
    wide = wc.compile(models, xs[0])
    assert wide.strategies, "nothing was tuned"
    check_equivalence(wide, models, xs)


@pytest.mark.parametrize("name", ["mlp", "convnet", "transformer"])
def test_training_with_a_fused_optimizer_matches_each_member_on_cuda(name):
    """20 steps of wc.optim.AdamW (a learning rate and a weight decay per member) against each
    member's own torch.optim.AdamW: parameters and buffers after every step's update."""
    models, xs = _members(name, torch.float64)
    refs = [copy.deepcopy(m).train() for m in models]
    wide = wc.compile(models, xs[0], config=FAST).train()
    lrs, wds = [1e-3 * (i + 1) for i in range(N)], [0.01 * i for i in range(N)]
    opt = wc.optim.AdamW(wide.parameters(), lr=lrs, weight_decay=wds)
    ref_opts = [torch.optim.AdamW(r.parameters(), lr=lr, weight_decay=wd) for r, lr, wd in zip(refs, lrs, wds)]
    x = torch.stack(xs)
    for _ in range(20):
        opt.zero_grad()
        y = wide(x)
        y.square().mean(dim=tuple(range(1, y.dim()))).sum().backward()
        opt.step()
        for r, o, xi in zip(refs, ref_opts, xs):
            o.zero_grad()
            r(xi).square().mean().backward()
            o.step()
    for pname, p in wide.named_parameters():
        assert p.is_cuda
        assert_members_close(p.detach(), [r.get_parameter(pname).detach() for r in refs], what=pname)
    for bname, b in wide.named_buffers():
        assert_members_close(b, [r.get_buffer(bname) for r in refs], what=bname)
    # the members really differ after training (a check that cannot fail is no check)
    first = next(iter(wide.parameters())).detach()
    assert not torch.equal(first[0], first[1])


@pytest.mark.parametrize("name", ["mlp", "convnet"])
def test_torch_compile_fullgraph_on_cuda(name):
    models, xs = _members(name)
    wide = wc.compile([m.eval() for m in models], xs[0], config=FAST)
    x = torch.stack(xs)
    with torch.no_grad():
        eager = wide(x)
        compiled = torch.compile(wide, fullgraph=True)(x)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)


def test_unfused_members_come_back_on_cuda_and_match():
    models, xs = _members("resblock")
    wide = wc.compile(models, xs[0], config=FAST)
    for i, member in enumerate(wide.unfuse()):
        assert all(p.is_cuda for p in member.parameters())
        torch.testing.assert_close(member(xs[i]), models[i](xs[i]), rtol=1e-5, atol=1e-5)


def test_members_on_different_devices_are_refused():
    models, xs = _members("mlp")
    models[1] = models[1].cpu()
    with pytest.raises(Exception, match=r"(?i)device|cuda|cpu"):
        wc.compile(models, xs[0], config=FAST)


def test_a_loss_per_member_on_cuda():
    models, xs = _members("mlp")
    wide = wc.compile(models, xs[0], config=FAST)
    out = wide(torch.stack(xs))
    losses = wc.optim.member_losses(F.mse_loss, out, torch.zeros_like(out))
    assert losses.shape == (N,) and losses.is_cuda
    want = torch.stack([F.mse_loss(m(x), torch.zeros_like(m(x))) for m, x in zip(models, xs)])
    torch.testing.assert_close(losses, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["mlp", "convnet"])
def test_cuda_graphs_through_reduce_overhead_match_each_member(name):
    """CUDA graphs for small members (issue 47): ``torch.compile(wide, mode="reduce-overhead")``
    records the wide model's graphs as CUDA graphs (inputs copied into static buffers, the graph
    replayed). Five training steps with SGD between them and a fresh input each call, then eval
    calls: every output, and the parameters after, match each member's own eager run. The MLP's
    training graph is replayed as a CUDA graph (no cudagraph skip); the conv net's BatchNorm
    updates its running statistics, which may keep inductor from graphing that one."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    models, xs = _members(name)
    refs = [copy.deepcopy(m).train() for m in models]
    wide = wc.compile(models, xs[0], config=FAST).train()
    graphed = torch.compile(wide, mode="reduce-overhead", fullgraph=True)
    lrs = [0.01 * (i + 1) for i in range(N)]
    opt = wc.optim.SGD(wide.parameters(), lr=lrs, momentum=0.9)
    ref_opts = [torch.optim.SGD(r.parameters(), lr=lr, momentum=0.9) for r, lr in zip(refs, lrs)]
    g = torch.Generator("cuda").manual_seed(2)
    for _ in range(5):
        x = torch.randn(N, *xs[0].shape, device="cuda", generator=g)
        opt.zero_grad()
        y = graphed(x)
        want = [r(xi) for r, xi in zip(refs, x)]
        assert_members_close(y.detach(), [w.detach() for w in want], kind="grad")  # trained weights differ by rounding
        y.square().mean(dim=tuple(range(1, y.dim()))).sum().backward()
        opt.step()
        for o in ref_opts:
            o.zero_grad()
        sum(w.square().mean() for w in want).backward()  # each member's loss reaches its own weights only
        for o in ref_opts:
            o.step()
    for pname, p in wide.named_parameters():
        assert_members_close(p.detach(), [r.get_parameter(pname).detach() for r in refs], kind="grad", what=pname)
    if name == "mlp":
        assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    wide.eval()
    for r in refs:
        r.eval()
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(N, *xs[0].shape, device="cuda", generator=g)
            assert_members_close(graphed(x), [r(xi) for r, xi in zip(refs, x)], kind="grad")
