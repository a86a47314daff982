"""Calls of a wide model that ran silently wrong or crashed, found by an independent probe (issue
44, probe 5: F14, F6, F4, F16). A graph runs only in the dtype it was captured in (F14); torch's
global module hooks do not run again on the wide model and its internal graph modules (F6); an
eager call is not taken for a torch.compile trace while another thread exports (F4); a model
compiled inside torch.inference_mode trains (F16). Each member is compared with itself run alone.
"""
from __future__ import annotations

import copy
import threading

import pytest
import torch
import wide_compiler as wc
from torch import nn

from support import LinearModel

FAST = wc.WideConfig.fast()


# ---------------------------------------------------------------- F14: .to(dtype) captures again
class DtypeBranch(LinearModel):
    """A forward whose program depends on the dtype: a branch, a tensor made in it, a cast."""

    def forward(self, x):
        h = self.fc(x.to(self.fc.weight.dtype))
        return h + (1.0 if x.dtype == torch.float64 else 2.0) + torch.zeros(4, dtype=x.dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_to_dtype_captures_the_graph_again(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    models = [DtypeBranch() for _ in range(2)]
    wide = wc.compile(models, torch.randn(5, 4), config=FAST)
    wide.to(dtype)
    assert all(p.dtype == torch.float32 for m in models for p in m.parameters())  # the user's members untouched
    refs = [copy.deepcopy(m).to(dtype) for m in models]
    x = torch.randn(2, 5, 4).to(dtype)
    out = wide(x)
    for i, m in enumerate(refs):
        want = m(x[i])
        assert out[i].dtype == want.dtype
        torch.testing.assert_close(out[i], want, atol=0, rtol=0)
    wide.float()  # and back: the float32 branch again (values rounded through the dtype)
    x = x.float()
    torch.testing.assert_close(wide(x)[1], refs[1].float()(x[1]), atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------- F6: torch's global module hooks
def test_global_forward_hooks_apply_once_and_the_wide_models_own_hooks_run() -> None:
    from torch.nn.modules.module import register_module_forward_hook

    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).double() for _ in range(2)]
    handle = register_module_forward_hook(lambda m, i, o: o * 2 if isinstance(o, torch.Tensor) else None)
    try:
        wide = wc.compile(models, torch.randn(5, 4, dtype=torch.float64), config=FAST)
        seen = []
        wide.register_forward_hook(lambda m, i, o: seen.append(type(m).__name__))
        x = torch.randn(2, 5, 4, dtype=torch.float64)
        out = wide(x)
        out.sum().backward()
        for i, m in enumerate(models):
            m(x[i]).sum().backward()
            torch.testing.assert_close(out[i], m(x[i]))
            torch.testing.assert_close(wide.get_parameter("0.weight").grad[i], m[0].weight.grad)
    finally:
        handle.remove()
    assert seen == ["WideModel"]  # a hook the user put on the wide model itself runs, once


# ---------------------------------------------------------------- F4: another thread's export
class ParityBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) * (2.0 if x.shape[1] % 2 else 1.0)


STARTED, GO = threading.Event(), threading.Event()


class Blocking(nn.Module):
    """A member whose capture (its forward traced with fake tensors) waits until told to go on."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if type(x) is not torch.Tensor:  # traced by torch.export, inside wide_compiler's compile
            STARTED.set()
            GO.wait(60)
        return self.fc(x)


def test_an_eager_call_captures_while_another_thread_compiles() -> None:
    torch.manual_seed(0)
    models = [ParityBranch() for _ in range(2)]
    wide = wc.compile(models, torch.randn(3, 3, 4), config=FAST)
    STARTED.clear(), GO.clear()
    other = threading.Thread(target=lambda: wc.compile([Blocking(), Blocking()], torch.randn(3, 4), config=FAST))
    other.start()
    timer = threading.Timer(1.0, GO.set)  # the other compile goes on a while later (any time will do)
    try:
        assert STARTED.wait(60)
        assert torch.compiler.is_compiling()  # torch's flag is process-wide while the other thread exports
        timer.start()
        x = torch.randn(2, 3, 4, 4)  # a new size in a dim the forward branches on: a new capture
        out = wide(x)  # waits for the other thread's compile, then captures: not taken for a traced call
    finally:
        GO.set()
        timer.cancel()
        other.join(60)
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m(x[i]))


# ---------------------------------------------------------------- F16: compiled inside inference_mode
def test_a_model_compiled_inside_inference_mode_trains() -> None:
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).double() for _ in range(2)]
    with torch.inference_mode():
        wide = wc.compile(models, torch.randn(5, 4, dtype=torch.float64), config=FAST)
        assert not torch.is_grad_enabled()
    assert not any(t.is_inference() for t in [*wide.parameters(), *wide.buffers()])
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    out = wide(x)
    out.sum().backward()
    for i, m in enumerate(models):
        want = m(x[i])
        want.sum().backward()
        torch.testing.assert_close(out[i], want)
        torch.testing.assert_close(wide.get_parameter("0.weight").grad[i], m[0].weight.grad)
