"""The command line's inputs as text: ``--shape`` and ``--input [NAME:]DTYPE:SHAPE[:VALUES]``
parsed into :class:`InputSpec` (no torch here: the parser uses this module; the tensors are made
in :mod:`wide_compiler.cli.models`), and :class:`UsageError`, a mistake in what the user typed.
"""
from __future__ import annotations

import argparse
import dataclasses
import re

__all__ = ["INPUT_HELP", "InputSpec", "UsageError", "parse_input", "parse_shape"]


class UsageError(Exception):
    """A mistake in the command line found while running a command (a model file that is not
    there, an input the model does not take): ``main`` prints it as argparse prints its own
    errors, the command's usage line then ``wide_compiler COMMAND: error: MESSAGE``, and exits 2,
    with no traceback (``-v`` adds the traceback of its cause)."""


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


def input_arg(text: str) -> InputSpec:
    """argparse ``type`` of ``--input``: a bad spec is a usage error (exit 2) naming the bad part."""
    try:
        return parse_input(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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
    parts = [p.strip() for p in re.split(r",|(?<=\d)\s*x\s*(?=\d)", text)]  # x only between sizes
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


def shape_arg(text: str) -> tuple[int, ...]:
    """argparse ``type`` of ``--shape``: a bad shape is a usage error (exit 2), not a traceback."""
    try:
        return parse_shape(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None

