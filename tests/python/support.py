"""Helpers shared by several test files (imported as ``from support import ...``, as op_db is):
an op recorder below autograd, running a function on several threads at once, the base of the
small models of Linear layers that most tests define, the base of hand-written wide forms
(``wc.register``) of a module with one scalar parameter, a steady measuring clock for tests
that compile with tuning on, and the check of a benchmark record's fields."""
from __future__ import annotations

import itertools
import json
import math
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from wide_compiler.testing import assert_members_close

#: The device the suite runs on: ``WIDE_TEST_DEVICE=cuda`` makes it the default device of every
#: test (Note [The device-generic suite] in conftest.py).
DEVICE = torch.device(os.environ.get("WIDE_TEST_DEVICE", "cpu"))
#: A test of what only the CPU has (a C++ CPU kernel, thread counts, the CPU's autocast lists).
cpu_only = pytest.mark.cpu_only


def _aminmax_has_a_derivative() -> bool:
    x = torch.ones(2, device=DEVICE, requires_grad=True)
    try:
        torch.aminmax(x)[0].backward()
    except RuntimeError:  # "derivative for aten::aminmax is not implemented" (CUDA, torch 2.11)
        return False
    return True


#: Whether this torch differentiates ``torch.aminmax`` on the suite's device (torch 2.11's CUDA
#: build does not: a member's own backward fails, so a test has nothing to compare with).
AMINMAX_HAS_A_DERIVATIVE = _aminmax_has_a_derivative()


def aminmax_operand(h: torch.Tensor) -> torch.Tensor:
    """``h``, detached where torch has no derivative of ``aminmax`` (AMINMAX_HAS_A_DERIVATIVE):
    the rule is still run, its gradient not asked for."""
    return h if AMINMAX_HAS_A_DERIVATIVE else h.detach()


class FakeClock:
    """A clock that moves only when a test sets ``t`` (Note [Fake clock] in measure/timing.py)."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def fake_clock(monkeypatch) -> FakeClock:
    """Install a :class:`FakeClock` as the clock every measurement reads; returns it."""
    from wide_compiler.measure import timing

    fake = FakeClock()
    monkeypatch.setattr(timing, "_clock", fake)
    return fake


def steady_measuring_clock(monkeypatch, step_s: float = 1e-4) -> None:
    """Replace the clock every measurement reads (Note [Fake clock] in
    wide_compiler/measure/timing.py) with one that advances ``step_s`` per reading: a tuned compile
    then sees every candidate take the same time (the margin keeps the default strategy) and its
    budget lasts the same number of readings however busy the machine is."""
    from wide_compiler.measure import timing

    readings = itertools.count()
    monkeypatch.setattr(timing, "_clock", lambda: next(readings) * step_s)


#: Code for a fresh interpreter (``python -c``): import the package and touch every public name.
#: The package root is lazy (Note [Lazy package root]): ``import wide_compiler`` alone imports
#: nothing, so a check of what the library imports must first use what a user uses.
USE_THE_API = "import sys, wide_compiler as wc\nfor name in wc.__all__: getattr(wc, name)\n"


#: The benchmark targets whose whole ``ci`` preset test_bench_vision.py runs and checks.
VISION_CI_TARGETS = ("conv", "norm", "pool", "embedding", "models", "attention", "dropout")


def check_design_fields(r: dict, target: str, preset: str) -> None:
    """The fields DESIGN §10 asks of every benchmark record (and those the engine adds); the
    model's error below 1e-3 (float32 against the members)."""
    from wide_compiler import measure
    from wide_compiler.bench import engine

    what = f"{target}/{r.get('case')}/{r.get('mode')}/{r.get('strategy')}"
    assert set(engine.RECORD_KEYS) <= set(r), (what, set(engine.RECORD_KEYS) - set(r))
    assert r["target"] == target and r["preset"] == preset, what
    assert isinstance(r["n"], int) and r["n"] >= 1, what
    assert r["batch"] is None or (isinstance(r["batch"], int) and r["batch"] >= 1), what
    assert r["dtype"] == "float32", what
    assert r["mode"] in measure.MODES and r["execution"] in ("eager", "compiled"), what
    assert isinstance(r["strategy"], str) and r["strategy"], what
    assert math.isfinite(r["wide_ms"]) and r["wide_ms"] > 0, what
    assert r["baseline_ms"] and set(r["speedup"]) == set(r["baseline_ms"]), (what, r["errors"])
    for name, ms in r["baseline_ms"].items():
        assert math.isfinite(ms) and ms > 0, (what, name)
        assert math.isfinite(r["speedup"][name]) and r["speedup"][name] > 0, (what, name)
    assert isinstance(r["max_abs_err"], float) and 0 <= r["max_abs_err"] < 1e-3, (what, r["max_abs_err"])
    assert isinstance(r["errors"], dict) and isinstance(r["baseline_max_abs_err"], dict), what
    m = r["machine"]
    assert m["threads"] >= 1 and m["cpu_capability"] and "load_avg_end" in m, what
    json.dumps(r, default=str, allow_nan=False)


class OpRecorder(TorchDispatchMode):
    """Records the aten/wide ops that run below autograd while it is active, in ``ops``: their
    packet names (``"addmm"``), or with ``full_names`` the whole overload (``"wide.adam_step.default"``).
    Profiler bookkeeping ops are left out."""

    def __init__(self, full_names: bool = False):
        super().__init__()
        self.full_names = full_names
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not str(func).startswith("profiler."):
            self.ops.append(str(func) if self.full_names else func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


class LinearModel(nn.Module):
    """The shape of most small test models: Linear layers, declared in ``linears`` as
    name -> (in features, out features) (by default one, ``fc``), which the subclass's
    ``forward``, the code under test, uses. The constructor's arguments become the attributes
    named in ``fields`` (the per-member constants a test varies). ``forward`` stays in the
    subclass: errors name the line of the user's forward that holds an op."""

    linears: dict[str, tuple[int, int]] = {"fc": (4, 4)}
    fields: tuple[str, ...] = ()

    def __init__(self, *values) -> None:
        super().__init__()
        for name, (in_features, out_features) in self.linears.items():
            setattr(self, name, nn.Linear(in_features, out_features))
        if len(values) != len(self.fields):
            raise TypeError(f"{type(self).__name__} takes {self.fields}, got {len(values)} values")
        for name, value in zip(self.fields, values):
            setattr(self, name, value)


class Call(nn.Module):
    """A module whose forward is ``fn(x)``: a plain function (``F.relu``, ``torch.tanh``) as a
    module, or a module (a convolution) as the submodule ``fn`` of a model."""

    def __init__(self, fn: Callable) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


class StackedScalar(nn.Module):
    """The wide form of N modules whose one parameter is a scalar ``s``: here ``s`` is theirs
    stacked, ``[N]``. Subclasses write ``forward`` (:meth:`per_member` views ``s`` to broadcast
    against an N-first input) and ``unfuse``."""

    def __init__(self, s: torch.Tensor) -> None:
        super().__init__()
        self.s = nn.Parameter(s)

    @classmethod
    def from_modules(cls, modules):
        return cls(torch.stack([m.s.detach() for m in modules]))

    def per_member(self, x: torch.Tensor) -> torch.Tensor:
        return self.s.view(-1, *([1] * (x.dim() - 1)))


def assert_members_trained_alike(wide: nn.Module, models: list[nn.Module], xs, targets, **sgd) -> None:
    """Train each member alone, ``torch.optim.SGD(**sgd)`` on ``F.mse_loss``, one step per N-first
    batch of ``xs``/``targets`` (its own slice): its parameters must then equal its slice of
    ``wide``'s, which the caller trained on the same batches."""
    for i, m in enumerate(models):
        opt = torch.optim.SGD(m.parameters(), **sgd)
        for x, t in zip(xs, targets):
            opt.zero_grad()
            F.mse_loss(m(x[i]), t[i]).backward()
            opt.step()
    for name, p in wide.named_parameters():
        assert_members_close(p.detach(), [m.get_parameter(name).detach() for m in models],
                             what=f"{name} after {len(xs)} SGD steps")


def all_to_eval(wide: nn.Module, models: list[nn.Module]) -> None:
    """Put ``wide`` and every member in eval mode, so that a test compares the wide model's eval
    graph with the members' own eval forward."""
    wide.eval()
    for m in models:
        m.eval()


def run_in_threads(fn: Callable[[int], object], n: int) -> list[Exception]:
    """Call ``fn(k)`` for k in range(n), each on its own thread, all started before any is joined;
    returns the exceptions they raised (empty when every call succeeded). The threads make their
    tensors on the caller's default device (it is per thread: Note [The device-generic suite])."""
    errors: list[Exception] = []
    device = torch.get_default_device()

    def call(k: int) -> None:
        try:
            torch.set_default_device(device)
            fn(k)
        except Exception as e:  # noqa: BLE001 (returned to the test, which asserts on it)
            errors.append(e)

    threads = [threading.Thread(target=call, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def cache_entries(cache_dir: Path) -> list[Path]:
    """The compile cache's entries in ``cache_dir`` (the ``cache_dir`` fixture of conftest.py)."""
    folder = cache_dir / "compiled"
    return sorted(folder.iterdir()) if folder.exists() else []


def from_cache(compile_again: Callable[[], Any]) -> Any:
    """``compile_again()`` with the pipeline's capture replaced by a failure: what it returns was
    read from the compile cache (its guards as unpickled), or the test fails."""
    import pytest

    from wide_compiler.fx import pipeline

    def captured(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("captured: the compile cache missed")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline, "capture", captured)
        return compile_again()


# The guard tests (test_guards_reach*.py): n float64 members of a module class, compiled on a [2, 4]
# sample; every call of the wide model is compared, member by member, with the member run alone.
def compile_float64(cls: type[nn.Module], n: int) -> tuple[nn.Module, list[nn.Module]]:
    """``n`` members ``cls().double()`` (seed 0) and their wide model (``WideConfig.fast()``)."""
    import wide_compiler as wc

    torch.manual_seed(0)
    members = [cls().double() for _ in range(n)]
    return wc.compile(members, torch.randn(2, 4, dtype=torch.float64), config=wc.WideConfig.fast()), members


def float64_input(n: int) -> torch.Tensor:
    """A wide input ``[n, 2, 4]`` for :func:`compile_float64`'s models."""
    return torch.randn(n, 2, 4, dtype=torch.float64)


def assert_each_member(wide: nn.Module, members: list[nn.Module], x: torch.Tensor) -> None:
    """``wide(x)[i]`` equals ``members[i](x[i])`` to 1e-12, for every member."""
    out = wide(x)
    for i, m in enumerate(members):
        torch.testing.assert_close(out[i], m(x[i]), rtol=1e-12, atol=1e-12, msg=lambda s, i=i: f"member {i}: {s}")


def check_change(cls: type[nn.Module], change: Callable[[Any], object], monkeypatch: Any, n: int) -> None:
    """Compile ``n`` members of ``cls``, check a call, apply ``change(monkeypatch)`` (state their
    code reads, changed after compiling) and check the same call again."""
    wide, members = compile_float64(cls, n)
    x = float64_input(n)
    assert_each_member(wide, members, x)
    change(monkeypatch)
    assert_each_member(wide, members, x)


def set_global(module: Any, name: str, value: Any) -> Callable[[Any], None]:
    """A change for :func:`check_change`: the global ``name`` of ``module`` set to ``value``."""
    return lambda mp: mp.setattr(module, name, value)


def router_with_refs(towers: dict[str, nn.Module]) -> tuple[Any, dict[str, nn.Module]]:
    """A ``WideRouter`` (``WideConfig.fast()``) over ``towers``, discovered, and independent
    reference copies of the towers (test_router*.py)."""
    import copy

    import wide_compiler as wc
    from wide_compiler.router import WideRouter

    refs = {name: copy.deepcopy(t) for name, t in towers.items()}
    router = WideRouter(config=wc.WideConfig.fast())
    for name, t in towers.items():
        router.attach(name, t)
    router.discover_towers()
    return router, refs
