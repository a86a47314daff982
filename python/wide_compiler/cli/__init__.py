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
named) or ``--sample FILE.py:FUNC`` (see :data:`~wide_compiler.cli.inputs.INPUT_HELP`).

The package: :mod:`.parser` (the parser and ``main``, Note [A quick CLI]), :mod:`.inputs` (the
input options as text), :mod:`.models` (a model and its input as tensors), :mod:`.progress`,
and one module per command: :mod:`.info`, :mod:`.check` (``test``), :mod:`.trace`,
:mod:`.benchmark`, :mod:`.analyze`.
"""
from __future__ import annotations

import importlib

from .inputs import INPUT_HELP, InputSpec, UsageError, parse_input, parse_shape
from .parser import build_parser, main

__all__ = ["INPUT_HELP", "InputSpec", "UsageError", "build_parser", "main", "make_inputs",
           "parse_input", "parse_shape", "plot_speedups", "top_records"]

#: Names of the command modules, imported on first use (they import torch).
_LAZY = {"make_inputs": "models", "plot_speedups": "benchmark", "top_records": "benchmark"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
