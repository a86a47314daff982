"""Findings P8-8, P8-9, P8-10 and P8-11 of the eighth independent probe (issue 44): a global module
hook that records through a helper, torch.optim optimizers whose update mixes members, analyze on
an output holding a non-tensor, a member stored in another memory layout. Each test failed before
its fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.modules import module as torch_module

import wide_compiler as wc
from wide_compiler.errors import UnsupportedOperationError
from support import cpu_only

FAST = wc.WideConfig.fast()


def _mlp():
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))


def _record(table, out):  # a helper of the user's that writes into the table it is handed
    table.setdefault("acts", []).append(out)


class _Recorder:  # records through _record: the hook's own code writes nothing
    def __init__(self):
        self.items = {}

    def __call__(self, module, args, out):
        if isinstance(module, nn.Linear):
            _record(self.items, out)


class _Scale:  # a counter that changes the output (P8-10 b)
    def __init__(self):
        self.n = 0

    def __call__(self, module, args, out):
        if isinstance(module, nn.Linear):
            self.n += 1
            return out * self.n


@pytest.mark.parametrize("when", ["after compiling", "before compiling"])
def test_stateful_global_hook_is_refused_before_it_runs(when):
    """P8-10: torch's global forward hook, a callable object keeping state (through a helper of the
    user's, or a counter), is refused before the capture runs it: the recorder holds no FakeTensor
    and the counter did not move. Before, the capture ran the helper's hook on fake tensors (two
    FakeTensors left in the recorder) and later wide calls recorded nothing."""
    torch.manual_seed(0)
    members = [_mlp() for _ in range(2)]
    x = torch.randn(2, 3, 4)
    for hook in (_Recorder(), _Scale()):
        wide = wc.compile(members, torch.randn(3, 4), config=FAST) if when == "after compiling" else None
        handle = torch_module.register_module_forward_hook(hook)
        try:
            with pytest.raises((ValueError, wc.WideCompileError), match="writes into state outside it"):
                if wide is None:
                    wc.compile(members, torch.randn(3, 4), config=FAST)
                else:
                    wide(x)
        finally:
            handle.remove()
        assert getattr(hook, "items", {}) == {} and getattr(hook, "n", 0) == 0


class _Sneaky:  # a write the code read cannot follow (through getattr)
    def __init__(self):
        self.items = []

    def __call__(self, module, args, out):
        if isinstance(module, nn.Linear):
            getattr(self, "items").append(out)


def test_hook_that_kept_a_fake_tensor_is_refused():
    """P8-10, the net behind the code read: a global hook whose write the code read cannot see is
    refused after the capture, naming where it kept the placeholder tensor, and the wide model is
    not built from that capture. Before, the call went on and the wide model ran without it."""
    torch.manual_seed(0)
    members = [_mlp() for _ in range(2)]
    wide = wc.compile(members, torch.randn(3, 4), config=FAST)
    hook = _Sneaky()
    handle = torch_module.register_module_forward_hook(hook)
    try:
        with pytest.raises(ValueError, match=r"kept a placeholder tensor of the capture in self\.items\[0\]"):
            wide(torch.randn(2, 3, 4))
    finally:
        handle.remove()


def test_global_hook_calling_a_pure_helper_still_compiles():
    """A global hook calling a helper that only computes (no write) is captured as before."""
    def double(out):
        return out * 2

    def hook(module, args, out):
        return double(out) if isinstance(module, nn.Linear) else None

    torch.manual_seed(0)
    members = [_mlp() for _ in range(2)]
    handle = torch_module.register_module_forward_hook(hook)
    try:
        wide = wc.compile(members, torch.randn(3, 4), config=FAST)
        x = torch.randn(2, 3, 4)
        torch.testing.assert_close(wide(x), torch.stack([m(x[i]) for i, m in enumerate(members)]))
    finally:
        handle.remove()


@pytest.mark.parametrize("name", ["Adafactor", "LBFGS"])
def test_torch_optim_that_mixes_members_is_refused(name):
    """P8-9: torch.optim.Adafactor (factors a stacked [N, O] bias over N) and LBFGS (one line search
    and history for all members) over a wide model's parameters are refused at their first step,
    before anything changes; over a plain model they step as usual, and Adam over the wide model
    is not refused. Before, members ended 0.013 (Adafactor) and 0.5 (LBFGS) off their own runs."""
    torch.manual_seed(0)
    members = [_mlp() for _ in range(2)]
    wide = wc.compile(members, torch.randn(3, 4), config=FAST)
    make = (lambda ps: torch.optim.LBFGS(ps, lr=0.5, max_iter=2)) if name == "LBFGS" else \
        (lambda ps: torch.optim.Adafactor(ps, lr=0.01))
    x, y = torch.randn(2, 3, 4), torch.randn(2, 3, 2)

    def closure(model, xs, ys, opt):
        def run():
            opt.zero_grad()
            loss = ((model(xs) - ys) ** 2).sum()
            loss.backward()
            return loss
        return run

    opt = make(list(wide.parameters()))
    before = [p.detach().clone() for p in wide.parameters()]
    with pytest.raises(UnsupportedOperationError, match=f"torch.optim.{name} .*mix"):
        if name == "LBFGS":
            opt.step(closure(wide, x, y, opt))
        else:
            closure(wide, x, y, opt)()
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, wide.parameters()))
    plain = make(list(members[0].parameters()))  # a member alone: not a wide model's parameters
    plain.step(closure(members[0], x[0], y[0], plain))
    adam = torch.optim.Adam(wide.parameters(), lr=0.01)
    closure(wide, x, y, adam)()
    adam.step()


class _WithCount(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return {"h": self.fc(x), "n": x.shape[0]}


def test_analyze_skips_a_non_tensor_output():
    """P8-11: analyze on a model whose output holds an int: the int is compared for equality, not
    summed or indexed. Before, analyze's own loss raised "'int' object has no attribute 'sum'",
    reported as the wide model failing."""
    from wide_compiler import measure
    from wide_compiler.analyze import _contenders
    from wide_compiler.measure import contenders

    torch.manual_seed(0)
    members = [_WithCount() for _ in range(2)]
    wide = wc.compile(members, torch.randn(3, 4), config=FAST)
    found = _contenders(wide, members)
    xs = analyze_inputs((torch.randn(3, 4),), 2)
    for mode in ("inference", "train"):
        got = measure.make_step(found["wide"], xs, mode)()
        want = measure.make_step(found["loop"], xs, mode)()
        assert contenders.max_abs_err(found["loop"], want, found["wide"], got, 2, mode) < 1e-5
    with pytest.raises(ValueError, match="non-tensor outputs"):  # an int that differs is a difference
        bad = ({"h": got[0]["h"], "n": 4}, got[1])
        contenders.max_abs_err(found["loop"], want, found["wide"], bad, 2, "train")


def analyze_inputs(sample, n):
    from wide_compiler.analyze import _wide_inputs

    return _wide_inputs(sample, n)


def _conv_members(n=3):
    torch.manual_seed(0)
    return [nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(36, 2)).double() for _ in range(n)]


@cpu_only  # the suite's CUDA convs (cuDNN off) return contiguous outputs: one program for both layouts
def test_member_in_another_memory_layout_is_named(cache_dir):
    """P8-8: a member converted to channels_last runs another program (Flatten copies where member
    0's views): the refusal names the parameter's strides and layout, not a Python constant; and the
    compile cache key holds the strides, so a warm cache (from contiguous members) gives the same
    refusal. Before, the message blamed a Python constant, and a warm cache compiled the members."""
    sample = torch.randn(2, 2, 5, 5, dtype=torch.float64)
    wc.compile(_conv_members(), sample, config=FAST)  # contiguous members: an entry of the cache
    members = _conv_members()
    members[1] = members[1].to(memory_format=torch.channels_last)
    with pytest.raises(wc.ArchitectureMismatchError) as e:
        wc.compile(members, sample, config=FAST)
    message = str(e.value)
    assert "'0.weight' is stored in strides (18, 1, 6, 2) (channels_last)" in message
    assert "Python constant" not in message
