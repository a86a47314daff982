"""A model named on the command line and one member's input for it: ``MODEL`` (a built-in model
of :mod:`wide_compiler.zoo`, ``path/to/file.py:factory`` or ``module:factory``) and ``--shape``,
``--input`` or ``--sample`` made into tensors, for ``test``, ``trace`` and ``analyze``.

A mistake here (a file or name that is not there, an input the model does not take) is a
:class:`~wide_compiler.cli.inputs.UsageError`, found before the command's work starts.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .inputs import InputSpec, UsageError, parse_input  # noqa: F401  (parse_input: the doctest)

__all__ = ["Sample", "make_inputs", "model_and_sample"]


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
                t = torch.randn(s.shape, generator=gen, device=gen.device).to(dtype)
            else:
                t = (torch.rand(s.shape, generator=gen, device=gen.device) * (s.high - s.low) + s.low).to(dtype)
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
            t = torch.randint(int(low), int(high), s.shape, generator=gen, device=gen.device).to(dtype)
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
        from ..analyze import _describe

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
        from ..analyze import _import_file

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
    from .. import zoo

    if spec in zoo.MODELS:
        factory, shape = zoo.MODELS[spec]
        return _Loaded(spec, factory, tuple(shape))
    if ":" not in spec:
        import difflib

        close = difflib.get_close_matches(spec, zoo.MODELS, n=1)
        raise UsageError(f"MODEL {spec!r} is neither a built-in model ({', '.join(zoo.MODELS)})"
                         + (f"; did you mean {close[0]!r}?" if close else "")
                         + " nor path/to/file.py:factory (module:factory works too)")
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
                ) -> Sample:
    """One member's input from ``--sample``, ``--input`` or ``--shape`` (or a built-in model's
    own shape); a UsageError saying what to give when there is none. Notes are printed.
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
            raise UsageError(f"{args.model}: give one member's input: --shape 32,64 (one float input), "
                             f"--input NAME:DTYPE:SHAPE (repeatable, e.g. --input ids:int64:4,16) or "
                             f"--sample FILE.py:FUNC (see {command} --help)")
        sample = Sample((torch.randn(*shape, generator=torch.Generator().manual_seed(0), device="cpu"),), {})
    for note in sample.notes:
        print(f"note  {note}")
    return sample


def model_and_sample(args: argparse.Namespace, command: str, n: int
                     ) -> tuple[_Loaded, list[Any], Sample]:
    """MODEL, ``n`` members of it (seeded) and one member's input, checked to run on one member
    (:func:`_check_member_runs`); a :class:`UsageError` when the user's command is wrong (a file
    or name that is not there, a sample function that fails, an input the model does not take)."""
    import torch

    try:
        loaded = _load_model(args.model)
        torch.manual_seed(0)
        models = [loaded.factory() for _ in range(n)]
        probe = models[0] if models else None

        def member() -> Any:  # one member, made once, without moving the global RNG
            nonlocal probe
            if probe is None:
                with torch.random.fork_rng():
                    probe = loaded.factory()
            return probe

        sample = _sample_for(args, loaded, member, command)
    except UsageError:
        raise
    except (OSError, ImportError, AttributeError, TypeError, ValueError, SyntaxError) as e:
        raise UsageError(f"{type(e).__name__}: {e}") from e
    _check_member_runs(loaded, member(), sample, from_shape=not (args.input or args.sample))
    return loaded, models, sample


def _check_member_runs(loaded: _Loaded, member: Any, sample: Sample, *, from_shape: bool) -> None:
    """Run one member on the sample (in eval mode for the call, its modules' modes restored after;
    no grad; the RNG left as it was): a model that does not take this input is a UsageError before
    minutes of work, naming the input to give instead (``--input int64:SHAPE`` where a float
    ``--shape`` meets an embedding)."""
    import torch

    modes = [(m, m.training) for m in member.modules()] if hasattr(member, "modules") else []
    for m, _ in modes:
        m.training = False
    try:
        with torch.no_grad(), torch.random.fork_rng():
            member(*sample.args, **sample.kwargs)
    except Exception as e:  # noqa: BLE001 (any failure of the user's model on this input is reported)
        what = f"{loaded.label} does not run on one member's input {sample.describe()}: {type(e).__name__}: " \
               f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        emb = _first_embedding(member) if hasattr(member, "named_modules") else None
        if from_shape and emb is not None and len(sample.args) == 1 and not sample.kwargs:
            shape = ",".join(map(str, sample.args[0].shape))
            raise UsageError(f"{what}\nits first nn.Embedding ({emb[0]}) takes integer indices: give "
                             f"--input int64:{shape} (values in [0, {emb[1]}), its vocabulary; "
                             f"--input int64:{shape}:LOW-HIGH for a range) instead of --shape {shape}") from e
        raise UsageError(f"{what}\ngive the input it takes: --shape SHAPE (one float input), --input "
                         "[NAME:]DTYPE:SHAPE[:VALUES] (repeatable) or --sample FILE.py:FUNC") from e
    finally:
        for m, training in modes:
            m.training = training
