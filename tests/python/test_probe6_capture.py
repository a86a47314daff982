"""Found by an independent probe (issue 44, probe 6): what a member's forward does that
torch.export does not capture, each silently wrong before and refused (train) or warned (eval)
now, naming what and where (Note [Autograd contexts export drops] in fx/export_watch.py, Note
[Hooks on a member's parameters] in fx/member_checks.py).

F11 reentrant activation checkpointing, F13 a ``torch.inference_mode()`` block, F12
``saved_tensors_hooks``, F5 Python/numpy random draws (LayerDrop), F6 hooks on the members'
parameters. The advised replacements compile and match the members.
"""
from __future__ import annotations

import copy
import logging
import random
from random import random as imported_random

import numpy as np
import pytest
import torch
import wide_compiler as wc
from torch import nn
from torch.utils.checkpoint import checkpoint
from wide_compiler.errors import UnsupportedOperationError

FAST = wc.WideConfig.fast()
D = torch.float64


def _members(cls, n=2, train=True, **kw):
    torch.manual_seed(0)
    return [cls(**kw).to(D).train(train) for _ in range(n)]


def _sample():
    return torch.randn(3, 4, dtype=D)


def _same_as_members(wide, members):
    """Outputs and parameter gradients of the wide model equal each member's own (float64)."""
    x = torch.randn(len(members), 3, 4, dtype=D)
    refs = [copy.deepcopy(m) for m in members]
    out = wide(x)
    out.square().sum().backward()
    for i, r in enumerate(refs):
        o = r(x[i])
        torch.testing.assert_close(out[i], o)
        if wide.training:
            o.square().sum().backward()
            for name, p in r.named_parameters():
                g = wide.get_parameter(name).grad
                assert (g is None) == (p.grad is None), name
                if g is not None:
                    torch.testing.assert_close(g[i], p.grad, msg=name)


# -- F11: reentrant checkpointing ------------------------------------------------------------------
class Ckpt(nn.Module):
    def __init__(self, reentrant: bool = True) -> None:
        super().__init__()
        self.b = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
        self.o = nn.Linear(4, 2)
        self.reentrant = reentrant

    def forward(self, x):
        return self.o(checkpoint(self.b, x, use_reentrant=self.reentrant) + x)


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
def test_reentrant_checkpoint_is_refused_in_train_naming_the_line():
    ms = _members(Ckpt)
    before = [copy.deepcopy(m.state_dict()) for m in ms]
    with pytest.raises(wc.WideCompileError, match=r"(?s)reentrant checkpointing.*test_probe6_capture.py:\d+ in "
                                                  r"forward.*no gradient through the block.*use_reentrant=False"):
        wc.compile(ms, _sample(), config=FAST)
    for m, sd in zip(ms, before):  # nothing of the user's changed
        assert all(torch.equal(v, sd[k]) for k, v in m.state_dict().items())


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
def test_reentrant_checkpoint_eval_graph_compiles_with_a_warning(caplog):
    ms = _members(Ckpt, train=False)
    with caplog.at_level(logging.WARNING, logger="wide_compiler"):
        wide = wc.compile(ms, _sample(), config=FAST)
    assert "reentrant checkpointing" in caplog.text
    with torch.no_grad():
        x = torch.randn(2, 3, 4, dtype=D)
        out = wide(x)
        for i, m in enumerate(ms):
            torch.testing.assert_close(out[i], m(x[i]))


# -- F13: inference_mode ---------------------------------------------------------------------------
class Inference(nn.Module):
    def __init__(self, how: str = "with") -> None:
        super().__init__()
        self.t, self.s = nn.Linear(4, 4), nn.Linear(4, 4)
        self.how = how

    @torch.inference_mode()
    def _frozen(self, x):
        return self.t(x)

    def forward(self, x):
        if self.how == "with":
            with torch.inference_mode():
                t = self.t(x)
        elif self.how == "decorator":
            t = self._frozen(x)
        else:
            with torch.no_grad():
                t = self.t(x)
        return self.s(x) * t.clone()


@pytest.mark.parametrize("how", ["with", "decorator"])
def test_inference_mode_block_is_refused_in_train(how):
    ms = _members(Inference, how=how)
    with pytest.raises(wc.WideCompileError, match=r"(?s)torch.inference_mode\(\) block at .*test_probe6_capture.py"
                                                  r".*torch.no_grad\(\)"):
        wc.compile(ms, _sample(), config=FAST)


# -- F12: saved_tensors_hooks ----------------------------------------------------------------------
class SavedHooks(nn.Module):
    def __init__(self, own: bool = True) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)
        self.own = own

    def forward(self, x):
        if not self.own:
            with torch.autograd.graph.save_on_cpu():
                return self.l(x).square()

        def pack(t):
            return t

        def unpack(t):
            return t * 2  # lossy activation compression changes what backward sees

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return self.l(x).square()


def test_saved_tensors_hooks_of_the_users_are_refused_in_train():
    with pytest.raises(wc.WideCompileError, match=r"(?s)saved_tensors_hooks with hooks of its own.*pack, "
                                                  r".*unpack\).*test_probe6_capture.py.*what its unpack hook returns"):
        wc.compile(_members(SavedHooks), _sample(), config=FAST)


# -- F5: Python / numpy random draws -----------------------------------------------------------------
class LayerDrop(nn.Module):
    def __init__(self, how: str = "random") -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)
        self.p = 0.5
        self.how = how
        self.rng = random.Random(0)

    def forward(self, x):
        if self.how == "random":
            u = random.random()
        elif self.how == "numpy":
            u = float(np.random.rand())
        elif self.how == "imported":
            u = imported_random()
        elif self.how == "instance":
            u = self.rng.random()
        elif self.how == "eval_only_draw":  # HF MusicGen: drawn always, used only when training
            u = random.uniform(0, 1)
            if self.training and u < self.p:
                return x
            return x + self.l(x)
        else:  # the advice: a torch draw kept a tensor, per member and per call
            keep = (torch.rand((), dtype=x.dtype) >= self.p).to(x.dtype)
            return x + keep * self.l(x)
        if self.training and u < self.p:
            return x
        return x + self.l(x)


@pytest.mark.parametrize("how,where", [("random", r"random.random\(\) at .*test_probe6_capture.py:\d+"),
                                       ("numpy", r"numpy.random.rand\(\) at .*test_probe6_capture.py:\d+"),
                                       ("imported", r"not through a module attribute"),
                                       ("instance", r"Random.random\(\) at .*test_probe6_capture.py:\d+")])
def test_python_random_draw_in_train_is_refused(how, where):
    random.seed(0)
    np.random.seed(0)
    with pytest.raises(wc.WideCompileError, match=rf"(?s)a draw from .*{where}.*would be fixed in the graph"
                                                  r".*torch.rand"):
        wc.compile(_members(LayerDrop, how=how), _sample(), config=FAST)


def test_python_random_draw_in_eval_warns_and_compiles(caplog):
    ms = _members(LayerDrop, train=False, how="eval_only_draw")
    with caplog.at_level(logging.WARNING, logger="wide_compiler"):
        wide = wc.compile(ms, _sample(), config=FAST)
    assert "a draw from Python's random module" in caplog.text and "random.uniform()" in caplog.text
    x = torch.randn(2, 3, 4, dtype=D)
    with torch.no_grad():
        out = wide(x)
        for i, m in enumerate(ms):
            torch.testing.assert_close(out[i], m(x[i]))


def test_torch_draw_the_advice_compiles_and_draws_per_call():
    ms = _members(LayerDrop, how="torch")
    wide = wc.compile(ms, _sample(), config=FAST)
    x = torch.randn(2, 3, 4, dtype=D)
    torch.manual_seed(1)
    outs = {tuple(wide(x)[:, 0, 0].detach().tolist()) for _ in range(16)}
    assert len(outs) > 1  # not one draw baked in


# -- F6: hooks on the members' parameters ------------------------------------------------------------
def _mlp():
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).to(D)


def test_gradient_hook_on_a_members_parameter_is_refused_naming_it():
    torch.manual_seed(0)
    ms = [_mlp() for _ in range(3)]
    ms[1][2].bias.register_hook(lambda g: g.clamp(-0.01, 0.01))
    with pytest.raises(wc.WideCompileError, match=r"(?s)member 1's parameter '2.bias' has a gradient hook "
                                                  r"\(Tensor.register_hook\).*<lambda> at .*test_probe6_capture.py"
                                                  r".*register the hook on the wide model's parameter"):
        wc.compile(ms, _sample(), config=FAST)


def test_post_accumulate_grad_hook_is_refused():
    torch.manual_seed(0)
    ms = [_mlp() for _ in range(2)]
    for m in ms:
        m[0].weight.register_post_accumulate_grad_hook(lambda p: p.grad.mul_(0))
    with pytest.raises(wc.WideCompileError, match=r"member 0's parameter '0.weight' has a post-accumulate-grad hook"):
        wc.compile(ms, _sample(), config=FAST)


def test_parameter_hook_in_eval_warns_and_train_is_refused(caplog):
    torch.manual_seed(0)
    ms = [_mlp().eval() for _ in range(2)]
    for m in ms:
        m[0].weight.register_hook(lambda g: g * 0)
    with caplog.at_level(logging.WARNING, logger="wide_compiler"):
        wide = wc.compile(ms, _sample(), config=FAST)
    assert "member 0's parameter '0.weight' has a gradient hook" in caplog.text
    x = torch.randn(2, 3, 4, dtype=D)
    torch.testing.assert_close(wide(x)[1], ms[1](x[1]))
    for _ in range(2):  # the train graph would drop the hooks: refused, the model left in eval
        with pytest.raises(UnsupportedOperationError, match=r"member 0's parameter '0.weight' has a gradient hook"):
            wide.train()
        assert not wide.training
    torch.testing.assert_close(wide(x)[0], ms[0](x[0]))


# -- the advised forms: each trains exactly ----------------------------------------------------------
@pytest.mark.parametrize(("cls", "kwargs", "no_grad_through"), [
    (Ckpt, {"reentrant": False}, None),
    (Inference, {"how": "no_grad"}, "t.weight"),  # as for each member: no gradient through the block
    (SavedHooks, {"own": False}, None),
], ids=["non-reentrant checkpoint", "no_grad block", "save_on_cpu (torch's own hooks)"])
def test_the_advised_form_trains_exactly(cls, kwargs, no_grad_through):
    ms = _members(cls, **kwargs)
    wide = wc.compile(ms, _sample(), config=FAST)
    _same_as_members(wide, ms)
    if no_grad_through is not None:
        assert wide.get_parameter(no_grad_through).grad is None
