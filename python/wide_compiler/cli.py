"""Command line: ``python -m wide_compiler {info,test,trace,benchmark,analyze}`` (console script
``wide_compiler``). ``python -m wide_compiler COMMAND --help`` explains each.

Examples::

    python -m wide_compiler info
    python -m wide_compiler test
    python -m wide_compiler test path/to/model.py:make_model --shape 32,64
    python -m wide_compiler test lm.py:make --input ids:int64:4,16 --input mask:bool:4,16
    python -m wide_compiler analyze convnet -n 4,16 --memory 8GB --plot speedup.png
    python -m wide_compiler trace -m transformer
    python -m wide_compiler trace my_model.py:make --sample my_model.py:make_sample
    python -m wide_compiler benchmark linear --preset quick --json bench-results/linear.json

A user's model is ``path/to/file.py:factory``; its input is ``--shape`` (one float tensor),
``--input [NAME:]DTYPE:SHAPE[:VALUES]`` (repeatable: positional when unnamed, keyword when
named) or ``--sample FILE.py:FUNC`` (see :data:`INPUT_HELP`).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import platform
import re
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["build_parser", "main"]


# ---------------------------------------------------------------------------------- info

def _registered_ops() -> list[tuple[str, list[str], list[str]]]:
    """(name, schemas, dispatch keys with a kernel) of every ``wide::`` operator."""
    import torch

    keys = ("CompositeImplicitAutograd", "CompositeExplicitAutograd", "CPU", "CUDA", "Meta",
            "Autograd", "AutogradCPU")
    out = []
    for name in sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("wide::")):
        schemas = []
        packet = getattr(torch.ops.wide, name.split("::", 1)[1], None)
        if packet is not None:
            for ov in packet.overloads():
                schemas.append(str(getattr(packet, ov)._schema))
        has = [k for k in keys if torch._C._dispatch_has_kernel_for_dispatch_key(name, k)]
        out.append((name, schemas, has))
    return out


def cmd_info(args: argparse.Namespace) -> int:
    import torch

    import wide_compiler as wc

    print(f"wide_compiler {getattr(wc, '__version__', 'unknown')}  "
          f"({Path(wc.__file__).parent})")
    print(f"torch {torch.__version__}  (debug={torch.version.debug}, "
          f"cuda={torch.version.cuda or 'none'})")
    print(f"python {platform.python_version()}  ({sys.executable})")
    print(f"platform {platform.platform()}")
    print(f"threads: {torch.get_num_threads()} intra-op, {torch.get_num_interop_threads()} "
          f"inter-op")
    print(f"cpu capability (torch kernels): {torch.backends.cpu.get_cpu_capability()}")
    print(f"mkldnn: {torch.backends.mkldnn.is_available()}, mkl: {torch.backends.mkl.is_available()}"
          f", openmp: {torch.backends.openmp.is_available()}")
    print()
    print("C++ core (torch.ops.wide._build_info()):")
    try:
        info = torch.ops.wide._build_info()
    except Exception as e:  # noqa: BLE001 (the library did not load: say so, keep going)
        print(f"  unavailable: {type(e).__name__}: {e}")
    else:
        for line in info.rstrip().splitlines():
            print(f"  {line}")
    print()
    ops = _registered_ops()
    print(f"registered operators ({len(ops)}):")
    for name, schemas, keys in ops:
        print(f"  {name}  [{', '.join(keys) or 'no kernel'}]")
        for s in schemas:
            print(f"    {s}")
    return 0


# ---------------------------------------------------------------------------------- test

class _Checks:
    """Runs named checks, prints one PASS/FAIL line each, remembers failures."""

    def __init__(self, verbose: bool) -> None:
        self.verbose = verbose
        self.failed: list[str] = []
        self.count = 0

    def run(self, name: str, fn: Callable[[], str | None]) -> Any:
        from .measure import Stopwatch

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

    from . import testing

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
    from .zoo import mlp_stack  # deferred: the zoo imports torch.nn

    return mlp_stack((16, 32, 32, 4), seed=seed)


def _compare_population(models: Sequence[Any], wide: Any, x: Any, *, shared: bool = False) -> float:
    """Every member's outputs, input and parameter gradients and buffers against the wide
    model's (:func:`wide_compiler.testing.check_equivalence`, raises on a difference); returns
    the max error. ``x``: the N-first input, or one member's input with ``shared``."""
    from . import testing

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


def cmd_test(args: argparse.Namespace) -> int:
    import torch

    import wide_compiler as wc

    if getattr(args, "model", None):
        return _test_model(args)
    given = [o for o, v in (("--shape", args.shape), ("--input", args.input), ("--sample", args.sample)) if v]
    if given:
        print(f"wide_compiler test: {given[0]} is one member's input of a MODEL; give the model too, "
              "e.g. test my_model.py:make --shape 32,64 (without MODEL: the self-check)", file=sys.stderr)
        return 2

    print(f"wide_compiler {getattr(wc, '__version__', 'unknown')}, torch {torch.__version__}, "
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
    eval mode (outputs, input and parameter gradients, buffers) with ``testing.check_compile``."""
    import wide_compiler as wc

    got = _model_and_sample(args, "test", args.n)
    if got is None:
        return 2
    _, models, sample = got
    try:
        wide, report = wc.testing.check_compile(models, sample.args, sample_kwargs=sample.kwargs or None,
                                                strict=args.strict, config=wc.WideConfig.fast())
    except (AssertionError, wc.WideCompileError, ValueError) as e:
        print(f"FAIL  {args.model}: {type(e).__name__}: {e}")
        return 1
    for key, rep in report.items():
        print(f"PASS  {key}: {rep}")
    for fb in wide.fallbacks:
        print(f"note  per-member fallback: {fb['op']} at {fb['source']}")
    print(f"{args.model}: all {args.n} members match their own models")
    return 0


# ---------------------------------------------------------------------------------- a user's model and its inputs

_DTYPES = {  # --input spelling -> torch dtype name
    "float32": "float32", "float": "float32", "f32": "float32",
    "float64": "float64", "double": "float64", "f64": "float64",
    "float16": "float16", "half": "float16", "f16": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "int64": "int64", "long": "int64", "int32": "int32", "int": "int32",
    "int16": "int16", "int8": "int8", "uint8": "uint8", "bool": "bool",
}
_INPUT_FORM = "[NAME:]DTYPE:SHAPE[:VALUES], e.g. ids:int64:4,16:0-1000 or float32:8,3,32,32"
_NUMBER = r"-?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"

INPUT_HELP = f"""\
inputs (give one of --shape, --input, --sample; built-in models have their own sample):
  --shape SHAPE          one float32 input of that shape (the simple form): --shape 32,64
  --input {_INPUT_FORM.split(', e.g.')[0]}
                         one input of that dtype and shape, repeatable: unnamed inputs are
                         positional in the order given, named ones keyword arguments.
                         DTYPE: float32 (float), float64 (double), float16 (half), bfloat16
                         (bf16), int64 (long), int32 (int), int16, int8, uint8, bool.
                         SHAPE: sizes like 4,16 or 4x16; () for a 0-dim tensor.
                         VALUES: LOW-HIGH draws uniformly from [LOW, HIGH),
                         one number V fills the tensor with V. Without VALUES: floats are
                         standard normal, bools random, integers in [0, V) where V is the
                         num_embeddings of the model's first nn.Embedding (its vocabulary),
                         else [0, 2). Values are drawn with a fixed seed.
  --sample FILE.py:FUNC  a zero-argument function returning one member's input: a tensor, a
                         tuple of positional inputs, a dict of keyword inputs, or a pair
                         (tuple, dict); FUNC alone looks in the model's file, MODULE:FUNC
                         imports a module.
  Each member of the check (test) or of the timing (analyze) gets its own perturbed copy of the
  float inputs; integer and bool inputs (indices, masks) are the same for every member."""


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """One member's input given on the command line (``--input [NAME:]DTYPE:SHAPE[:VALUES]``,
    see :func:`parse_input`): ``name`` is None for a positional input; ``low``/``high`` a
    half-open range of values, ``fill`` one value for every element (neither: the default)."""

    text: str
    name: str | None
    dtype: str
    shape: tuple[int, ...]
    low: float | None = None
    high: float | None = None
    fill: float | None = None

    def describe(self) -> str:
        """``ids=int64[4, 16]`` (keyword) or ``float32[8, 3]`` (positional)."""
        return f"{self.name + '=' if self.name else ''}{self.dtype}{list(self.shape)}"


def parse_input(text: str) -> InputSpec:
    """``--input``: ``[NAME:]DTYPE:SHAPE[:VALUES]``. Raises ValueError naming the bad part.

    >>> parse_input("ids:int64:4,16:0-1000")
    InputSpec(text='ids:int64:4,16:0-1000', name='ids', dtype='int64', shape=(4, 16), low=0.0, high=1000.0, fill=None)
    >>> parse_input("float:8x3").describe(), parse_input("mask:bool:4,16:1").fill
    ('float32[8, 3]', 1.0)
    >>> parse_input("ids:int65:4,16")
    Traceback (most recent call last):
    ...
    ValueError: 'ids:int65:4,16': unknown dtype 'int65' (expected one of bfloat16, bool, float16, float32, float64, int16, int32, int64, int8, uint8)
    """
    parts = text.split(":")
    known = ", ".join(sorted(set(_DTYPES.values())))

    def bad(why: str) -> ValueError:
        return ValueError(f"{text!r}: {why}")

    if len(parts) < 2:
        raise bad(f"expected {_INPUT_FORM}")
    name = None
    if parts[0].strip().lower() not in _DTYPES:
        head = parts[0].strip()
        if len(parts) == 2 or not head.isidentifier():  # DTYPE:SHAPE with a bad DTYPE
            raise bad(f"unknown dtype {head!r} (expected one of {known})")
        name, parts = head, parts[1:]
    if len(parts) > 3:
        raise bad(f"too many ':' parts (expected {_INPUT_FORM})")
    dtype = parts[0].strip().lower()
    if dtype not in _DTYPES:
        raise bad(f"unknown dtype {parts[0].strip()!r} (expected one of {known})")
    dtype = _DTYPES[dtype]
    if parts[1].strip() in ("()", "[]"):
        shape: tuple[int, ...] = ()
    else:
        try:
            shape = parse_shape(parts[1])
        except ValueError as e:
            raise bad(f"shape {e}") from None
    spec = InputSpec(text, name, dtype, shape)
    if len(parts) < 3:
        return spec
    values = parts[2].strip()
    integral = dtype.startswith(("int", "uint")) or dtype == "bool"
    if m := re.fullmatch(rf"({_NUMBER})\s*-\s*({_NUMBER})", values):
        low, high = float(m[1]), float(m[2])
        if not low < high:
            raise bad(f"empty range {values!r} (expected LOW-HIGH with LOW < HIGH; values are drawn "
                      f"from [LOW, HIGH))")
        if integral and not (low.is_integer() and high.is_integer()):
            raise bad(f"range {values!r} of a {dtype} input must be integers")
        if dtype == "bool" and not (0 <= low and high <= 2):
            raise bad(f"range {values!r} of a bool input must lie in 0-2 (False=0, True=1)")
        return dataclasses.replace(spec, low=low, high=high)
    if re.fullmatch(_NUMBER, values):
        fill = float(values)
        if integral and not fill.is_integer():
            raise bad(f"value {values!r} of a {dtype} input must be an integer")
        if dtype == "bool" and fill not in (0.0, 1.0):
            raise bad(f"value {values!r} of a bool input must be 0 or 1")
        return dataclasses.replace(spec, fill=fill)
    raise bad(f"values {values!r}: expected LOW-HIGH (a range, e.g. 0-1000) or one number (a fill value)")


def _input_arg(text: str) -> InputSpec:
    """argparse ``type`` of ``--input``: a bad spec is a usage error (exit 2) naming the bad part."""
    try:
        return parse_input(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _first_embedding(model: Any) -> tuple[str, int] | None:
    """(module path, num_embeddings) of the model's first ``nn.Embedding``/``nn.EmbeddingBag``."""
    from torch import nn

    for path, m in model.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
            return path or type(model).__name__, m.num_embeddings
    return None


def make_inputs(specs: Sequence[InputSpec], model: Any = None, *, seed: int = 0
                ) -> tuple[tuple, dict[str, Any], list[str]]:
    """One member's sample from ``--input`` specs: ``(args, kwargs, notes)``; ``notes`` say which
    value ranges were chosen by default. Integer inputs without a range are drawn from
    ``[0, num_embeddings)`` of ``model``'s first embedding (its vocabulary), else ``[0, 2)``.

    >>> args, kwargs, notes = make_inputs([parse_input("float32:2,3"), parse_input("m:bool:2:1")])
    >>> args[0].shape, kwargs["m"].tolist(), notes
    (torch.Size([2, 3]), [True, True], [])
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    emb = _first_embedding(model) if model is not None else None
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    notes: list[str] = []
    for s in specs:
        dtype = getattr(torch, s.dtype)
        if s.fill is not None:
            t = torch.full(s.shape, s.fill, dtype=dtype)
        elif dtype.is_floating_point:
            if s.low is None:
                t = torch.randn(s.shape, generator=gen).to(dtype)
            else:
                t = (torch.rand(s.shape, generator=gen) * (s.high - s.low) + s.low).to(dtype)
        else:
            low, high = (s.low, s.high) if s.low is not None else (0, 2)
            if s.low is None and dtype != torch.bool:
                if emb is not None:
                    high = emb[1]
                    why = f"the vocabulary of {emb[0]}, the model's first embedding"
                else:
                    why = "the default: " + ("the model has no nn.Embedding" if model is not None else "no model")
                notes.append(f"{s.describe()}: values in [0, {high}) ({why}; give a range with "
                             f"{s.name + ':' if s.name else ''}{s.dtype}:{','.join(map(str, s.shape)) or '()'}:LOW-HIGH)")
            info = torch.iinfo(dtype) if dtype != torch.bool else None
            if info is not None and (low < info.min or high - 1 > info.max):
                raise ValueError(f"{s.text!r}: values [{int(low)}, {int(high)}) do not fit {s.dtype} "
                                 f"([{info.min}, {info.max}])")
            t = torch.randint(int(low), int(high), s.shape, generator=gen).to(dtype)
        if s.name is None:
            args.append(t)
        else:
            kwargs[s.name] = t
    return tuple(args), kwargs, notes


@dataclasses.dataclass
class _Loaded:
    """A model given on the command line: ``factory`` makes one member; ``sample_shape`` is a
    built-in model's own input shape; ``module`` the user's file or module (for ``--sample FUNC``)."""

    spec: str
    factory: Callable[[], Any]
    sample_shape: tuple[int, ...] | None = None
    module: Any = None

    @property
    def label(self) -> str:
        return self.spec if self.module is None else f"{Path(self.spec.rpartition(':')[0]).name}:{self.spec.rpartition(':')[2]}"


@dataclasses.dataclass
class Sample:
    """One member's input: positional ``args``, keyword ``kwargs``, and what to tell the user."""

    args: tuple
    kwargs: dict[str, Any]
    notes: list[str] = dataclasses.field(default_factory=list)

    def describe(self) -> str:
        """``float32[8, 16], mask=bool[8, 16]``."""
        from .analyze import _describe

        return ", ".join([_describe(a) for a in self.args] + [f"{k}={_describe(v)}" for k, v in self.kwargs.items()])


def _import(where: str, modules: dict[str, Any]) -> Any:
    """The module of ``where``: a ``.py`` file (imported fresh, once per command) or an importable
    module name (the current directory is searched too)."""
    if where in modules:
        return modules[where]
    file = Path(where)
    if where.endswith(".py") or file.is_file() or "/" in where or "\\" in where:
        if not file.is_file():
            raise FileNotFoundError(f"no file {where!r}")
        from .analyze import _import_file

        module = _import_file(file)
    else:
        import importlib

        if "" not in sys.path and str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))
        module = importlib.import_module(where)
    modules[where] = module
    return module


def _load_callable(spec: str, what: str, modules: dict[str, Any], default: Any = None) -> Callable[..., Any]:
    """``FILE.py:NAME`` or ``MODULE:NAME`` (or ``NAME`` in module ``default``) -> that callable."""
    where, sep, name = spec.rpartition(":")
    if not name or (sep and not where) or (not sep and default is None):
        raise ValueError(f"{what} {spec!r}: expected path/to/file.py:NAME or module:NAME")
    module = _import(where, modules) if sep else default
    if not hasattr(module, name):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise AttributeError(f"{what} {spec!r}: {getattr(module, '__file__', where)} has no {name!r} "
                             f"(its callables: {', '.join(found) or 'none'})")
    obj = getattr(module, name)
    if not callable(obj):
        raise TypeError(f"{what} {spec!r} is a {type(obj).__name__}, expected a zero-argument callable")
    return obj


def _load_model(spec: str, modules: dict[str, Any] | None = None) -> _Loaded:
    """MODEL of ``test``/``analyze``/``trace``: a built-in model name or ``path/to/file.py:factory``
    (``module:factory`` works too): a zero-argument callable (an ``nn.Module`` class works)
    returning one member."""
    from . import zoo

    if spec in zoo.MODELS:
        factory, shape = zoo.MODELS[spec]
        return _Loaded(spec, factory, tuple(shape))
    modules = {} if modules is None else modules
    factory = _load_callable(spec, "model", modules)
    return _Loaded(spec, factory, None, modules[spec.rpartition(":")[0]])


def _normalise_sample(value: Any, spec: str) -> Sample:
    """What a ``--sample`` function returned -> a :class:`Sample`."""
    import torch

    if isinstance(value, torch.Tensor):
        return Sample((value,), {})
    if isinstance(value, dict):
        return Sample((), dict(value))
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], (tuple, list)) \
            and isinstance(value[1], dict):
        return Sample(tuple(value[0]), dict(value[1]))
    if isinstance(value, (tuple, list)):
        return Sample(tuple(value), {})
    raise TypeError(f"--sample {spec}: returned a {type(value).__name__}; expected a tensor, a tuple of "
                    "positional inputs, a dict of keyword inputs, or a pair (tuple, dict)")


def _sample_for(args: argparse.Namespace, loaded: _Loaded, member: Callable[[], Any], command: str
                ) -> Sample | None:
    """One member's input from ``--sample``, ``--input`` or ``--shape`` (or a built-in model's
    own shape); None after printing what to give, when there is none. Notes are printed.
    ``member()`` gives a member, asked for only when an integer input needs the vocabulary."""
    import torch

    if getattr(args, "sample", None):
        modules = {} if loaded.module is None else {loaded.spec.rpartition(":")[0]: loaded.module}
        fn = _load_callable(args.sample, "--sample", modules, default=loaded.module)
        sample = _normalise_sample(fn(), args.sample)
    elif getattr(args, "input", None):
        needs_vocab = any(i.dtype.startswith(("int", "uint")) and i.low is None and i.fill is None
                          for i in args.input)
        xs, kw, notes = make_inputs(args.input, member() if needs_vocab else None)
        sample = Sample(xs, kw, notes)
    else:
        shape = args.shape or loaded.sample_shape
        if shape is None:
            print(f"wide_compiler {command}: {args.model}: give one member's input: --shape 32,64 (one "
                  f"float input), --input NAME:DTYPE:SHAPE (repeatable, e.g. --input ids:int64:4,16) or "
                  f"--sample FILE.py:FUNC (see {command} --help)", file=sys.stderr)
            return None
        sample = Sample((torch.randn(*shape, generator=torch.Generator().manual_seed(0)),), {})
    for note in sample.notes:
        print(f"note  {note}")
    return sample


def _model_and_sample(args: argparse.Namespace, command: str, n: int
                      ) -> tuple[_Loaded, list[Any], Sample] | None:
    """MODEL, ``n`` members of it (seeded) and one member's input; None after printing why not
    (a file or name that is not there, a sample function that fails: exit 2, no traceback
    unless -v)."""
    import torch

    try:
        loaded = _load_model(args.model)
        torch.manual_seed(0)
        models = [loaded.factory() for _ in range(n)]
        sample = _sample_for(args, loaded, (lambda: models[0]) if models else loaded.factory, command)
    except (OSError, ImportError, AttributeError, TypeError, ValueError, SyntaxError) as e:
        print(f"wide_compiler {command}: {type(e).__name__}: {e}", file=sys.stderr)
        if getattr(args, "verbose", False):
            traceback.print_exc()
        return None
    return None if sample is None else (loaded, models, sample)


def parse_shape(text: str) -> tuple[int, ...]:
    """``--shape``: one member's input shape as positive sizes separated by ``,`` or ``x``
    (``32,64``, ``32x64``). Raises ValueError naming the bad part.

    >>> parse_shape("32,64"), parse_shape("4x8x8")
    ((32, 64), (4, 8, 8))
    >>> parse_shape("4,abc")
    Traceback (most recent call last):
    ...
    ValueError: '4,abc': 'abc' is not an integer size (expected positive sizes like 32,64)
    """
    parts = [p.strip() for p in text.replace("x", ",").split(",")]
    if not text.strip() or not any(parts):
        raise ValueError(f"{text!r}: no sizes (expected positive sizes like 32,64)")
    sizes = []
    for part in parts:
        if not part:
            raise ValueError(f"{text!r}: an empty size (expected positive sizes like 32,64)")
        try:
            size = int(part)
        except ValueError:
            raise ValueError(f"{text!r}: {part!r} is not an integer size (expected positive sizes "
                             f"like 32,64)") from None
        if size < 1:
            raise ValueError(f"{text!r}: size {size} must be at least 1 (expected positive sizes like 32,64)")
        sizes.append(size)
    return tuple(sizes)


def _shape_arg(text: str) -> tuple[int, ...]:
    """argparse ``type`` of ``--shape``: a bad shape is a usage error (exit 2), not a traceback."""
    try:
        return parse_shape(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None



def _interactive(stream: Any = None) -> bool:
    """Whether to draw progress bars: ``stream`` (stderr) is a terminal and ``CI`` is not set
    (``CI=true`` on GitHub Actions, GitLab and most others). Elsewhere: one log line a stage."""
    import os

    stream = sys.stderr if stream is None else stream
    ci = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")
    try:
        return bool(stream.isatty()) and not ci
    except (AttributeError, ValueError):  # a closed or fake stream
        return False


class _Progress:
    """``analyze``'s ``progress(stage, done, total)`` callback: a tqdm bar on stderr where that is
    a terminal (:func:`_interactive`), one line per stage with the elapsed time elsewhere (a CI
    log gets no bar redraws)."""

    def __init__(self, desc: str, *, bar: bool | None = None) -> None:
        self.desc = desc
        self.use_bar = _interactive() if bar is None else bar
        self.bar: Any = None
        from .measure import Stopwatch

        self.clock = Stopwatch()

    def __call__(self, stage: str, done: int, total: int) -> None:
        elapsed = self.clock.seconds
        if self.use_bar:
            if self.bar is None:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=total, desc=self.desc, unit="stage", leave=False, file=sys.stderr)
            self.bar.update(done - self.bar.n)
            self.bar.set_postfix_str(stage)
            if done >= total:
                self.close()
        elif done >= total:
            print(f"{self.desc}: done in {elapsed:.1f} s", file=sys.stderr, flush=True)
        else:
            print(f"{self.desc} [{done + 1}/{total}] {stage} ({elapsed:.1f} s)", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _need_matplotlib(option: str = "--plot") -> bool:
    """True when matplotlib imports; else says how to get it on stderr (checked before the work)."""
    import importlib

    try:
        importlib.import_module("matplotlib")
    except ImportError:
        print(f"error: {option} needs matplotlib: pip install 'wide_compiler[plot]' (or pip install "
              "matplotlib); nothing was run", file=sys.stderr)
        return False
    return True


def cmd_analyze(args: argparse.Namespace) -> int:
    """``python -m wide_compiler analyze MODEL``: print the report; ``--json``/``--markdown``/``--plot``
    also write it to files."""
    import wide_compiler as wc
    from .analyze import analyze, plot

    if args.plot and not _need_matplotlib():  # before minutes of work, not after
        return 2
    try:
        ns = [int(k) for k in str(args.n).split(",") if k.strip()]
    except ValueError:
        print(f"wide_compiler analyze: -n {args.n!r}: expected sizes like 4,16", file=sys.stderr)
        return 2
    got = _model_and_sample(args, "analyze", 0)
    if got is None:
        return 2
    loaded, _, sample = got
    progress = None if args.quiet else _Progress(f"analyze {loaded.label}")
    try:
        report = analyze(loaded.factory, sample.args, sample_kwargs=sample.kwargs or None, n=ns,
                         memory=args.memory, modes=[m.strip() for m in args.modes.split(",") if m.strip()],
                         repeats=args.repeats, config=getattr(wc.WideConfig, args.config)(),
                         progress=progress)
    finally:
        if progress is not None:
            progress.close()
    print(report)
    if args.json:
        Path(args.json).write_text(report.to_json())
    if args.markdown:
        Path(args.markdown).write_text(report.to_markdown())
    if args.plot:
        plot(report, args.plot)
        print(f"wrote {args.plot}")
    return 0


# ---------------------------------------------------------------------------------- benchmark

def _benchmark_targets() -> str:
    """The registered benchmark targets, one line each with its description, and the presets."""
    from . import bench

    width = max(map(len, bench.TARGETS))
    lines = ["targets:"] + [f"  {name.ljust(width)}  {t.description}"
                            for name, t in bench.TARGETS.items()]
    lines.append("presets: ci (smoke run, seconds), quick (headline cases, default), "
                 "full (grid, minutes)")
    return "\n".join(lines)


def cmd_benchmark(args: argparse.Namespace) -> int:
    import torch

    from . import bench

    if args.list:  # machine-readable: one target name a line (the Makefile's `make bench`)
        print("\n".join(bench.TARGETS))
        return 0
    if args.target is None:
        print("usage: python -m wide_compiler benchmark TARGET|all [--preset ci|quick|full] "
              "[--json FILE] [--save] [--top K] [--plot FILE.png] [--compile]\n")
        print(_benchmark_targets())
        return 0
    targets = list(bench.TARGETS) if args.target == "all" else [args.target]
    for name in targets:
        if name not in bench.TARGETS:
            print(f"error: unknown benchmark target {name!r}; expected one of "
                  f"{', '.join(bench.TARGETS)} or all", file=sys.stderr)
            return 2
        if args.preset not in bench.TARGETS[name].presets:
            print(f"error: target {name!r} has no preset {args.preset!r}; "
                  f"expected one of {', '.join(bench.TARGETS[name].presets)}", file=sys.stderr)
            return 2
    if args.device != "cpu":
        if not torch.cuda.is_available():
            print(f"error: --device {args.device}, but this torch sees no CUDA device "
                  f"(torch {torch.__version__}, cuda={torch.version.cuda or 'none'})", file=sys.stderr)
            return 2
        unable = [n for n in targets if args.device not in bench.TARGETS[n].devices]
        if unable and args.target != "all":
            print(f"error: target {args.target!r} runs on {', '.join(bench.TARGETS[args.target].devices)} only",
                  file=sys.stderr)
            return 2
        if unable:
            print(f"note: on {args.device}, skipping the CPU-only targets {', '.join(unable)}", file=sys.stderr)
            targets = [n for n in targets if n not in unable]
    if args.plot and not _need_matplotlib():
        return 2
    if args.tuned_allocator:  # the same process-wide setting for every contender
        from .allocator import tune_cpu_allocator

        tune_cpu_allocator()
    records = []
    bar = not args.quiet and _interactive()  # a CI log gets one line per target instead
    for name in targets:
        if not args.quiet and not bar:
            print(f"benchmark {name}/{args.preset} ...", file=sys.stderr, flush=True)
        with (bench.engine.compile_all() if args.compile else contextlib.nullcontext(),
              bench.engine.on_device(args.device)):
            try:
                recs = bench.run(name, args.preset, progress=bar, cases=args.case)
            except ValueError as e:
                if not str(e).startswith(f"benchmark {name}/"):
                    raise
                print(f"error: {e}", file=sys.stderr)
                return 2
        records += recs
        if not args.quiet:
            print(bench.format_records(name, top_records(recs, args.top) if args.top else recs))
    paths = [Path(args.json)] if args.json else []
    if args.save:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        paths.append(Path("bench-results") / f"{args.target}-{args.preset}-{stamp}.json")
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            json.dump(_finite(records), f, indent=1, default=str, allow_nan=False)
            f.write("\n")
        if not args.quiet:
            print(f"wrote {len(records)} records to {path}")
    if args.plot:
        plot_speedups(records, args.plot)
        if not args.quiet:
            print(f"wrote {args.plot}")
    return 0


def _best_speedup(record: dict) -> float:
    """A record's speedup over its best (fastest) baseline; -inf when it has none."""
    speedups = [v for v in (record.get("speedup") or {}).values() if isinstance(v, (int, float))]
    return min(speedups) if speedups else -math.inf


def top_records(records: Sequence[dict], k: int) -> list[dict]:
    """The ``k`` records with the largest speedup over their best baseline, best first.

    >>> recs = [{"speedup": {"loop": 3.0, "vmap": 1.5}}, {"speedup": {"loop": 2.0}}, {"speedup": {}}]
    >>> [min(r["speedup"].values(), default=None) for r in top_records(recs, 2)]
    [2.0, 1.5]
    """
    return sorted(records, key=_best_speedup, reverse=True)[:k]


_NOT_A_SERIES = frozenset({"target", "mode", "case", "strategy", "n", "preset", "timing", "chosen_strategy",
                           "path"})


def _series_fields(record: dict) -> tuple[tuple[str, Any], ...]:
    """What tells a record's series apart besides case and strategy: its other settings (string,
    integer and boolean fields such as batch or in_features; floats are measurements)."""
    return tuple(sorted((k, v) for k, v in record.items() if k not in _NOT_A_SERIES
                        and isinstance(v, (str, int, bool)) and not isinstance(v, float)))


def plot_speedups(records: Sequence[dict], path: str) -> None:
    """Speedup of wide over each baseline against N (log-scaled), a dashed line at 1x: one panel
    per target and mode; in a panel one colour per setting (case, strategy, and sizes where the
    target has several) and one marker and line style per baseline, so no two series look alike.
    Written to ``path`` (matplotlib: the ``plot`` extra)."""
    from .analyze import _pyplot

    plt = _pyplot()
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter

    panels: dict[tuple[str, str], dict[tuple, list[tuple[int, float]]]] = {}
    for r in records:
        for baseline, x in (r.get("speedup") or {}).items():
            if isinstance(x, (int, float)) and math.isfinite(x) and r.get("n"):
                key = (str(r.get("target") or "?"), str(r.get("mode") or ""))
                setting = (str(r.get("case") or ""), str(r.get("strategy") or ""), _series_fields(r))
                panels.setdefault(key, {}).setdefault((setting, str(baseline)), []).append((int(r["n"]), float(x)))
    targets = list(dict.fromkeys(t for t, _ in panels))
    modes = sorted({m for _, m in panels}, key=lambda m: (m not in ("inference", "train"), m))
    if not panels:
        targets, modes = ["no records with a speedup"], [""]
    fig, axes = plt.subplots(len(targets), len(modes), figsize=(8.5 * len(modes), 3.8 * len(targets)),
                             squeeze=False)
    styles = [("o", "-"), ("s", "--"), ("^", ":"), ("D", "-."), ("v", (0, (5, 1))), ("P", (0, (1, 1)))]
    for row, target in enumerate(targets):
        for col, mode in enumerate(modes):
            ax = axes[row][col]
            series = panels.get((target, mode))
            ax.set_title(f"{target} ({mode})" if mode else target, fontsize=10)
            if not series:
                ax.text(0.5, 0.5, "no records", ha="center", va="center", transform=ax.transAxes)
                ax.set_axis_off()
                continue
            settings = list(dict.fromkeys(setting for setting, _ in sorted(series)))
            baselines = sorted({b for _, b in series})
            # only the fields that differ between this panel's series go into the labels
            varying = {k for k in {k for s in settings for k, _ in s[2]}
                       if len({dict(s[2]).get(k) for s in settings}) > 1}
            colours = _palette(plt, len(settings))
            for (setting, baseline), points in sorted(series.items()):
                points.sort()
                marker, dash = styles[baselines.index(baseline) % len(styles)]
                ax.plot([p[0] for p in points], [p[1] for p in points], marker=marker, linestyle=dash,
                        color=colours[settings.index(setting)])
            ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
            ax.set_xscale("log", base=2)
            ns = sorted({p[0] for pts in series.values() for p in pts})
            ax.set_xticks(ns, [str(k) for k in ns])
            ys = [p[1] for pts in series.values() for p in pts]
            if min(ys) > 0 and max(ys) / min(ys) > 20:  # 0.5x beside 200x: a log axis keeps both readable
                ax.set_yscale("log")
                ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.set_xlabel("N (members)")
            ax.set_ylabel("speedup (baseline ms / wide ms)")
            # one legend entry per colour (the setting) and one per marker (the baseline)
            handles = [Line2D([], [], color=colours[i], linewidth=2,
                              label=" ".join(p for p in (case, strategy, *[f"{k}={v}" for k, v in fields
                                                                           if k in varying]) if p) or target)
                       for i, (case, strategy, fields) in enumerate(settings)]
            handles += [Line2D([], [], color="black", marker=styles[i % len(styles)][0],
                               linestyle=styles[i % len(styles)][1], label=f"vs {b}")
                        for i, b in enumerate(baselines)]
            ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                      borderaxespad=0.0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _palette(plt: Any, k: int) -> list[Any]:
    """``k`` distinct colours: tab10, tab20, then evenly spaced on a continuous map."""
    if k <= 10:
        return [plt.get_cmap("tab10")(i) for i in range(k)]
    if k <= 20:
        return [plt.get_cmap("tab20")(i) for i in range(k)]
    cmap = plt.get_cmap("turbo")
    return [cmap(i / (k - 1)) for i in range(k)]


def _finite(o: Any) -> Any:
    """Records with NaN/inf floats replaced by None: the file stays strict JSON."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


# ---------------------------------------------------------------------------------- trace

def _side_by_side(left: str, right: str, titles: tuple[str, str], cut: int = 72) -> str:
    def clip(line: str) -> str:
        return line if len(line) <= cut else line[: cut - 3] + "..."

    a, b = [clip(x) for x in left.splitlines()], [clip(x) for x in right.splitlines()]
    width = max([len(titles[0])] + [len(line) for line in a])
    rows = [f"{titles[0].ljust(width)} | {titles[1]}", f"{'-' * width}-+-{'-' * len(titles[1])}"]
    for i in range(max(len(a), len(b))):
        rows.append(f"{(a[i] if i < len(a) else '').ljust(width)} | {b[i] if i < len(b) else ''}")
    return "\n".join(rows)


def _graph_lines(graph: Any) -> str:
    """One line per call node: ``name = target(args)``, placeholders and output included."""
    lines = []
    for node in graph.nodes:
        if node.op == "placeholder":
            lines.append(f"{node.name} = input")
        elif node.op == "output":
            lines.append(f"return {node.args[0]}")
        else:
            target = getattr(node.target, "__name__", str(node.target))
            ns = getattr(node.target, "namespace", "")
            args = ", ".join([str(a) for a in node.args] + [f"{k}={v}" for k, v in node.kwargs.items()])
            lines.append(f"{node.name} = {ns + '.' if ns else ''}{target}({args})")
    return "\n".join(lines)


def cmd_trace(args: argparse.Namespace) -> int:
    """``trace MODEL``: the captured member graph beside the wide graph, then the compile report."""
    import wide_compiler as wc
    from wide_compiler.fx.capture import capture

    spec = args.model or args.model_opt
    if not spec:
        print("wide_compiler trace: give a model: a built-in one (mlp, resblock, convnet, transformer) "
              "or path/to/file.py:factory with its input (see trace --help)", file=sys.stderr)
        return 2
    args.model = spec
    got = _model_and_sample(args, "trace", args.n)
    if got is None:
        return 2
    loaded, models, sample = got
    ep = capture(models[0], sample.args, sample.kwargs)
    wide = wc.compile(models, sample.args, sample_kwargs=sample.kwargs or None, config=wc.WideConfig.fast())
    wide_graph = wide._graph_for(wide.training).graph_module.graph
    print(_side_by_side(_graph_lines(ep.graph), _graph_lines(wide_graph),
                        (f"captured member graph ({loaded.label})", f"wide graph (N={args.n})")))
    print()
    print(wide.report())
    return 0


# ---------------------------------------------------------------------------------- main

_DESCRIPTION = """\
Fuse N models of one architecture into one wide model, check it member by member, and measure
what it buys on this machine.

commands:
  info       versions, threads, CPU ISA, the C++ build and every registered wide:: operator
  test       the self-check of this install, or N members of YOUR model checked one by one
  trace      a model's captured graph beside its wide graph, and the compile report
  benchmark  time wide ops and models against the loop, vmap and torch.compile (JSON records)
  analyze    compile, time, profile and size N members of YOUR model: what fusing buys

Each command has its own help: python -m wide_compiler COMMAND --help"""

_EPILOG = """\
examples:
  python -m wide_compiler info
  python -m wide_compiler test
  python -m wide_compiler test my_model.py:make --input ids:int64:4,16 --input mask:bool:4,16
  python -m wide_compiler trace -m transformer
  python -m wide_compiler benchmark linear --preset quick --json bench-results/linear.json
  python -m wide_compiler analyze my_model.py:make --shape 8,3,32,32 -n 4,16 --plot speedup.png"""


class _AppendInput(argparse.Action):
    """``--input``, repeatable; a keyword name given twice is a usage error."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        items = list(getattr(namespace, self.dest, None) or [])
        if values.name and any(i.name == values.name for i in items):
            raise argparse.ArgumentError(self, f"{values.text!r}: input {values.name!r} is given twice")
        setattr(namespace, self.dest, [*items, values])


def _inputs_parent() -> argparse.ArgumentParser:
    """``--shape``/``--input``/``--sample``, shared by test, analyze and trace."""
    p = argparse.ArgumentParser(add_help=False)
    x = p.add_mutually_exclusive_group()
    x.add_argument("--shape", type=_shape_arg, metavar="SHAPE",
                   help="one float32 input of this shape, e.g. 32,64 (built-in models: their own)")
    x.add_argument("--input", type=_input_arg, action=_AppendInput, metavar="[NAME:]DTYPE:SHAPE[:VALUES]",
                   help="one input, repeatable: positional when unnamed, a keyword when named "
                        "(e.g. ids:int64:4,16:0-1000, mask:bool:4,16)")
    x.add_argument("--sample", metavar="FILE.py:FUNC",
                   help="a function of yours returning one member's input (tensor, tuple, dict or "
                        "(tuple, dict)); FUNC alone: in the model's file")
    return p


def _wrap(text: str, width: int = 88) -> str:
    """Each line of ``text`` filled to ``width`` columns (help kept raw: examples keep their lines)."""
    import textwrap

    return "\n".join(textwrap.fill(line, width) if line else "" for line in text.split("\n"))


def build_parser() -> argparse.ArgumentParser:
    from . import bench

    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="wide_compiler", description=_DESCRIPTION, epilog=_EPILOG,
                                     formatter_class=raw)
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log INFO messages (and tracebacks of failed checks)")
    # -v is accepted before or after the command (SUPPRESS: a subcommand's default must not
    # overwrite a -v given before it).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="log INFO messages (and tracebacks of failed checks)")
    inputs = _inputs_parent()
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    model_help = ("a built-in model (mlp, resblock, convnet, transformer) or path/to/file.py:factory "
                  "(module:factory works too): a zero-argument callable, or an nn.Module class, "
                  "returning one member")

    p = sub.add_parser(
        "info", parents=[common], formatter_class=raw,
        help="versions, threads, CPU ISA, C++ build, registered ops",
        description=_wrap("Print what this install runs on: wide_compiler, torch, Python and platform "
                    "versions, torch's threads and CPU capability, the C++ core's build info "
                    "(compiler, ISA, OpenMP) and every registered wide:: operator with its schema "
                    "and dispatch keys. Attach it to bug reports."),
        epilog="example:\n  python -m wide_compiler info")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser(
        "test", parents=[common, inputs], formatter_class=raw,
        help="quick self-check on this machine, or check a model of yours member by member "
             "(PASS/FAIL, exit 0/1)",
        description=_wrap("Without MODEL: a self-check of this install (the wide ops against PyTorch, "
                    "opcheck, compile, unfuse), one PASS/FAIL line each.\nWith MODEL: compile N "
                    "members of your model and check every member in train and eval mode, on its "
                    "own input and on a shared one (outputs, input and parameter gradients, "
                    "buffers: wide_compiler.testing.check_compile). Exit 0 when all pass, 1 when "
                    "one fails, 2 for a usage error."),
        epilog="examples:\n"
               "  python -m wide_compiler test\n"
               "  python -m wide_compiler test my_model.py:make --shape 32,64\n"
               "  python -m wide_compiler test lm.py:make --input ids:int64:4,16 --input mask:bool:4,16:1\n"
               "  python -m wide_compiler test lm.py:make --sample lm.py:make_sample -n 4\n\n" + INPUT_HELP)
    p.add_argument("model", nargs="?", metavar="MODEL", help=model_help + "; without: the self-check")
    p.add_argument("-n", type=int, default=3, help="members to check (default 3)")
    p.add_argument("--strict", action="store_true", help="refuse per-member fallbacks")
    p.set_defaults(func=cmd_test)

    p = sub.add_parser(
        "trace", parents=[common, inputs], formatter_class=raw,
        help="a model's captured graph and wide graph side by side",
        description=_wrap("Capture one member with torch.export, compile N members, and print the "
                    "captured member graph beside the wide graph (one line per node), then the "
                    "compile report: each wide op with its strategy, fallbacks, layout conversions."),
        epilog="examples:\n"
               "  python -m wide_compiler trace -m transformer\n"
               "  python -m wide_compiler trace my_model.py:make --shape 8,16 -n 2\n"
               "  python -m wide_compiler trace lm.py:make --input ids:int64:4,16\n\n" + INPUT_HELP)
    p.add_argument("model", nargs="?", metavar="MODEL", help=model_help)
    p.add_argument("-m", "--model", dest="model_opt", metavar="MODEL", help="the same as MODEL")
    p.add_argument("-n", type=int, default=4, help="number of members (default 4)")
    p.set_defaults(func=cmd_trace)

    all_presets = sorted({name for t in bench.TARGETS.values() for name in t.presets})
    p = sub.add_parser("benchmark", parents=[common], help="time wide ops against loop / vmap / torch.compile",
                       description="Time the wide model against the baselines; print a table "
                                   "and optionally write JSON records.\nWithout a target: the "
                                   "list of targets.",
                       epilog=_benchmark_targets() + "\n\nexamples:\n"
                              "  python -m wide_compiler benchmark linear --preset ci\n"
                              "  python -m wide_compiler benchmark all --preset quick --save --plot speedup.png",
                       formatter_class=raw)
    # Checked by cmd_benchmark (not `choices`): no target lists the targets, exit 0.
    p.add_argument("target", nargs="?", metavar="TARGET",
                   help=f"what to benchmark: {', '.join(bench.TARGETS)}, or all")
    p.add_argument("--list", action="store_true",
                   help="print the target names, one a line, and exit")
    p.add_argument("--preset", default="quick", choices=all_presets,
                   help="ci: tiny smoke run; quick: the headline case (default); full: the grid")
    p.add_argument("--json", metavar="FILE", help="write the records (a JSON list) to FILE")
    p.add_argument("--compile", action="store_true",
                   help="run the wide model and every baseline under torch.compile (targets on the "
                        "shared engine: all but optim and train), checked against the eager loop")
    p.add_argument("--save", action="store_true",
                   help="also write them to bench-results/TARGET-PRESET-YYYYmmdd-HHMMSS.json")
    p.add_argument("--top", type=int, metavar="K",
                   help="print only the K records with the largest speedup over their best baseline")
    p.add_argument("--plot", metavar="FILE.png",
                   help="draw speedup vs N per baseline to FILE.png, one panel per target and mode "
                        "(needs matplotlib: pip install 'wide_compiler[plot]')")
    p.add_argument("--case", action="append", metavar="NAME",
                   help="run only this case of the target (repeatable; 'resnet18' or 'resnet18 N=4'): "
                        "one process per case bounds memory when the models are large")
    p.add_argument("--tuned-allocator", action="store_true",
                   help="call wc.tune_cpu_allocator() first (raises glibc's malloc thresholds for "
                        "the whole process, every contender alike; by default nothing process-wide "
                        "changes); records say which in 'allocator'")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where the members, their inputs and every contender run (the targets "
                        "built on whole models and linear; records say the device)")
    p.add_argument("-q", "--quiet", action="store_true", help="no table, no progress bar")
    p.set_defaults(func=cmd_benchmark)

    p = sub.add_parser(
        "analyze", parents=[common, inputs], formatter_class=raw,
        help="compile, time, profile and size N members of a model",
        description=_wrap("Report what fusing N members of a model buys on this machine: wide ops and "
                    "fallbacks, speed vs loop and vmap, per-op profile, memory and the largest N "
                    "that fits, recommendations. Takes about a minute (progress on stderr: a bar "
                    "in a terminal, one line per stage in CI or a pipe)."),
        epilog="examples:\n"
               "  python -m wide_compiler analyze convnet -n 4,16 --memory 8GB\n"
               "  python -m wide_compiler analyze my_model.py:make --shape 8,3,32,32 --plot speedup.png\n"
               "  python -m wide_compiler analyze lm.py:make --input ids:int64:8,32 --modes inference\n\n"
               + INPUT_HELP)
    p.add_argument("model", metavar="MODEL", help=model_help)
    p.add_argument("-n", default="4,16", help="population sizes, comma-separated (default 4,16)")
    p.add_argument("--modes", default="inference,train", help="inference,train (default both)")
    p.add_argument("--memory", help="memory budget for the largest-N search, e.g. 8GB (default: MemAvailable)")
    p.add_argument("--repeats", type=int, default=7, help="interleaved timing repeats (default 7)")
    p.add_argument("--config", default="fast", choices=("fast", "default", "safe"),
                   help="WideConfig preset to compile with (default fast: heuristic strategies; "
                        "default: strategies measured at compile time)")
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON to FILE")
    p.add_argument("--markdown", metavar="FILE", help="also write the report as Markdown to FILE")
    p.add_argument("--plot", metavar="FILE.png",
                   help="draw the speedup over loop and vmap against N, a panel per mode (needs "
                        "matplotlib, checked first: pip install 'wide_compiler[plot]')")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(func=cmd_analyze)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m wide_compiler`` and the ``wide_compiler`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except BrokenPipeError:  # `... | head`: the reader left; say nothing more
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
