"""``python -m wide_compiler test``: the self-check of this install (the wide ops against
PyTorch, opcheck, compile, unfuse), one PASS/FAIL line each; ``test MODEL``: N members of the
user's model compiled and checked one by one (``wide_compiler.testing.check_compile``).
"""
from __future__ import annotations

import argparse
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from .inputs import UsageError
from .models import model_and_sample

__all__ = ["run"]


class _Checks:
    """Runs named checks, prints one PASS/FAIL line each, remembers failures."""

    def __init__(self, verbose: bool) -> None:
        self.verbose = verbose
        self.failed: list[str] = []
        self.count = 0

    def run(self, name: str, fn: Callable[[], str | None]) -> Any:
        from ..measure import Stopwatch

        self.count += 1
        sw = Stopwatch()
        try:
            detail = fn()
        except Exception as e:  # noqa: BLE001 (a failed check is a FAIL line, not a crash)
            self.failed.append(name)
            print(f"FAIL  {name}: {type(e).__name__}: {e}", flush=True)
            if self.verbose:
                traceback.print_exc()
            return None
        ms = sw.ms
        print(f"PASS  {name}{f'  ({detail})' if detail else ''}  [{ms:.0f} ms]", flush=True)
        return detail


def _max_err(a: Any, b: Any) -> float:
    return (a.detach().double() - b.detach().double()).abs().max().item()


def _check_close(what: str, err: float, tol: float) -> None:
    if not err <= tol:  # also catches NaN
        raise AssertionError(f"{what}: max abs err {err:.3g} > {tol:g}")


def _test_op() -> str:
    import torch
    import torch.nn.functional as F

    from .. import testing

    torch.manual_seed(0)
    n, b, i, o = 5, 3, 7, 4
    w = torch.randn(n, o, i, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(n, o, dtype=torch.float64, requires_grad=True)
    xs = {"separate": torch.randn(n, b, i, dtype=torch.float64),
          "shared": torch.randn(b, i, dtype=torch.float64).expand(n, b, i),
          "non-contiguous": torch.randn(n, i, b, dtype=torch.float64).transpose(1, 2)}
    worst = 0.0
    for xname, x in xs.items():
        for strategy in ("auto", "bmm", "bmm_t", "loop"):
            out = torch.ops.wide.linear(x, w, bias, strategy=strategy)
            gw, gb = torch.autograd.grad(out.square().sum(), (w, bias))
            refs = [F.linear(x[k], w[k], bias[k]) for k in range(n)]
            ref_grads = [torch.autograd.grad(r.square().sum(), (w, bias)) for r in refs]
            where = f"{xname} input, strategy={strategy}"
            testing.assert_members_close(out, refs, what=f"{where} output")
            testing.assert_members_close(gw, [g[0][k] for k, g in enumerate(ref_grads)], kind="grad",
                                         what=f"{where} weight grad")
            testing.assert_members_close(gb, [g[1][k] for k, g in enumerate(ref_grads)], kind="grad",
                                         what=f"{where} bias grad")
            worst = max(worst, testing.max_member_error(out, refs))
    return f"3 inputs x 4 strategies x {n} members (float64), max err {worst:.1e}"


def _test_opcheck() -> str:
    import torch
    from torch.library import opcheck

    torch.manual_seed(0)
    w = torch.randn(3, 4, 5, requires_grad=True)
    b = torch.randn(3, 4, requires_grad=True)
    samples = [((torch.randn(3, 2, 5, requires_grad=True), w, b), {"strategy": "bmm"}),
               ((torch.randn(3, 2, 5), w, None), {"strategy": "loop"}),
               ((torch.randn(2, 5).expand(3, 2, 5), w, b), {})]
    for args, kwargs in samples:
        result = opcheck(torch.ops.wide.linear.default, args, kwargs)
        bad = {k: v for k, v in result.items() if v != "SUCCESS"}
        if bad:
            raise AssertionError(f"opcheck(wide::linear, strategy={kwargs.get('strategy')}): {bad}")
    return f"{len(samples)} samples: schema, autograd registration, fake tensor, aot dispatch"


def _test_wide_linear() -> str:
    import torch
    from torch import nn

    import wide_compiler as wc

    torch.manual_seed(0)
    layers = [nn.Linear(6, 3) for _ in range(4)]
    wide = wc.nn.WideLinear.from_modules(layers)
    report = wc.testing.check_equivalence(wide, layers, torch.randn(4, 2, 6))
    back = wide.unfuse()
    for k, (a, m) in enumerate(zip(layers, back)):
        if type(m) is not nn.Linear or not (torch.equal(a.weight, m.weight)
                                            and torch.equal(a.bias, m.bias)):
            raise AssertionError(f"member {k}: unfuse() did not give back the same nn.Linear")
    return f"from_modules -> forward (outputs, gradients) -> unfuse, max err {report.max_error():.1e}"


def _mlp(seed: int) -> Any:
    """One self-test member, 16 -> 32 -> 32 -> 4 (:func:`wide_compiler.zoo.mlp_stack`)."""
    from ..zoo import mlp_stack  # deferred: the zoo imports torch.nn

    return mlp_stack((16, 32, 32, 4), seed=seed)


def _compare_population(models: Sequence[Any], wide: Any, x: Any, *, shared: bool = False) -> float:
    """Every member's outputs, input and parameter gradients and buffers against the wide
    model's (:func:`wide_compiler.testing.check_equivalence`, raises on a difference); returns
    the max error. ``x``: the N-first input, or one member's input with ``shared``."""
    from .. import testing

    return testing.check_equivalence(wide, models, x, shared=shared).max_error()


def _test_compile() -> str:
    import torch

    import wide_compiler as wc

    n = 8
    models = [_mlp(seed) for seed in range(n)]
    x = torch.randn(n, 5, 16)
    wide = wc.compile(models, x[0], config=wc.WideConfig.fast())
    if wide.n != n:
        raise AssertionError(f"WideModel.n is {wide.n}, expected {n}")
    err = _compare_population(models, wide, x)
    err_s = _compare_population(models, wide, torch.randn(5, 16), shared=True)
    return f"{n} MLPs 16->32->32->4, outputs + gradients, max err {max(err, err_s):.1e}"


def _test_compile_strategies() -> str:
    import torch

    import wide_compiler as wc

    n = 4
    models = [_mlp(100 + seed) for seed in range(n)]
    x = torch.randn(n, 3, 16)
    worst = 0.0
    for strategy in ("bmm", "loop"):
        wide = wc.compile(models, x[0], config=wc.WideConfig(strategy=strategy, tune=False))
        chosen = set(wide.strategies.values())
        if chosen != {strategy}:
            raise AssertionError(f"strategy={strategy!r} forced, got {wide.strategies}")
        worst = max(worst, _compare_population(models, wide, x))
    return f"forced bmm and loop, max err {worst:.1e}"


def _test_check_compile() -> str:
    import torch
    from torch import nn

    import wide_compiler as wc

    torch.manual_seed(300)
    models = [nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2)) for _ in range(3)]
    _, report = wc.testing.check_compile(models, torch.randn(2, 3, 6, 6), config=wc.WideConfig.fast())
    worst = max(r.max_error() for r in report.values())
    return (f"{len(report)} checks (train/eval x own/shared input): outputs, gradients, running "
            f"stats, max err {worst:.1e}")


def _test_unfuse() -> str:
    import torch

    import wide_compiler as wc

    n = 4
    models = [_mlp(200 + seed) for seed in range(n)]
    x = torch.randn(n, 3, 16)
    wide = wc.compile(models, x[0], config=wc.WideConfig.fast())
    back = wide.unfuse()
    if len(back) != n:
        raise AssertionError(f"unfuse() returned {len(back)} modules, expected {n}")
    worst = 0.0
    for k, (a, b) in enumerate(zip(models, back)):
        if type(a) is not type(b):
            raise AssertionError(f"member {k}: unfuse() gave {type(b).__name__}, "
                                 f"expected {type(a).__name__}")
        e = _max_err(a(x[k]), b(x[k]))
        _check_close(f"member {k} after unfuse", e, 0.0)
        worst = max(worst, e)
    sd = wide.state_dict()
    for name, p in models[0].named_parameters():
        if name not in sd or tuple(sd[name].shape) != (n, *p.shape):
            raise AssertionError(f"state_dict()[{name!r}]: expected shape {(n, *p.shape)}, "
                                 f"got {tuple(sd[name].shape) if name in sd else 'no such key'}")
    return "unfuse() and state_dict() give back every member exactly"


def run(args: argparse.Namespace) -> int:
    """``test``: the self-check of this install; ``test MODEL``: :func:`_test_model`."""
    if getattr(args, "model", None):
        return _test_model(args)
    given = [o for o, v in (("--shape", args.shape), ("--input", args.input), ("--sample", args.sample)) if v]
    if given:
        raise UsageError(f"{given[0]} is one member's input of a MODEL; give the model too, e.g. test "
                         "my_model.py:make --shape 32,64 (without MODEL: the self-check)")
    import torch

    import wide_compiler as wc

    print(f"wide_compiler {wc.__version__}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}")
    checks = _Checks(args.verbose)
    checks.run("wide::linear registered", lambda: str(torch.ops.wide.linear.default._schema))
    checks.run("wide::linear matches F.linear per member (outputs, gradients)", _test_op)
    checks.run("torch.library.opcheck(wide::linear)", _test_opcheck)
    checks.run("WideLinear round trip", _test_wide_linear)
    checks.run("compile(): MLP population vs every member", _test_compile)
    checks.run("compile(): forced strategies", _test_compile_strategies)
    checks.run("testing.check_compile(): CNN with BatchNorm, train and eval", _test_check_compile)
    checks.run("WideModel.unfuse() round trip", _test_unfuse)
    if checks.failed:
        print(f"{len(checks.failed)} of {checks.count} checks FAILED")
        return 1
    print(f"all {checks.count} checks passed")
    return 0


def _test_model(args: argparse.Namespace) -> int:
    """``test MODEL``: compile N members of the user's model and check every member in train and
    eval mode (outputs, input and parameter gradients, buffers) with ``testing.check_compile``.
    A check that did not run (the train graph draws random numbers) is a SKIPPED line, and the
    last line says how many were skipped."""
    import wide_compiler as wc

    _, models, sample = model_and_sample(args, "test", args.n)
    try:
        wide, report = wc.testing.check_compile(models, sample.args, sample_kwargs=sample.kwargs or None,
                                                strict=args.strict, config=wc.WideConfig.fast())
    except (AssertionError, wc.WideCompileError, ValueError) as e:
        print(f"FAIL  {args.model}: {type(e).__name__}: {e}")
        return 1
    skipped = [key for key, rep in report.items() if isinstance(rep, str)]
    for key, rep in report.items():
        if key in skipped:  # check_compile says why, as "skipped: ..."
            print(f"SKIPPED  {key}: {rep.removeprefix('skipped: ')}")
        else:
            print(f"PASS  {key}: {rep}")
    for fb in wide.fallbacks:
        print(f"note  per-member fallback: {fb['op']} at {fb['source']}")
    ran = len(report) - len(skipped)
    print(f"{args.model}: all {args.n} members match their own models in the {ran} checks that ran"
          + (f" ({len(skipped)} skipped: {', '.join(skipped)})" if skipped else ""))
    return 0
