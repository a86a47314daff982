"""A digest of Python code that is the same in every process, for the compile cache's key (fx/cache_key.py)
and for the functions a guard keeps by name (fx/state_reads.py's ``FunctionRef``).

Not ``marshal.dumps(code)``: marshal marks an object referenced more than once (``FLAG_REF``), so
its bytes change with the references a process happens to hold, and they hold the file name and
line numbers, which do not change what the code computes. The digest is of the bytecode, names,
argument counts, flags and constants (a frozenset's by its sorted elements: it iterates in the
order of its strings' hashes, which differ by process), recursively into nested code objects.
"""

from __future__ import annotations

import functools
import hashlib
import types
from typing import Any

__all__ = ["Digest", "code_text", "constant"]


class Digest:
    """The SHA-256 of a sequence of tokens (their reprs), with a memo against cycles.

    >>> d = Digest(); d.add("a", 1); len(d.hexdigest())
    64
    """

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.seen: dict[int, int] = {}

    def add(self, *tokens: Any) -> None:
        self.parts.extend(map(repr, tokens))

    def hexdigest(self) -> str:
        return hashlib.sha256("\x1f".join(self.parts).encode()).hexdigest()


@functools.lru_cache(maxsize=8192)
def code_text(code: types.CodeType) -> str:
    """The digest of a code object and the code objects nested in it (its bytecode, constants,
    names), the same in every process.

    >>> def f(x): return x in {"a", "b"}
    >>> moved = f.__code__.replace(co_firstlineno=99)  # the same code elsewhere in a file
    >>> code_text(f.__code__) == code_text(moved), code_text(f.__code__) == code_text((lambda x: x).__code__)
    (True, False)
    """
    d = Digest()
    d.add("code", code.co_name, code.co_code, code.co_names, code.co_argcount, code.co_kwonlyargcount,
          code.co_flags)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            d.add(code_text(c))
        else:
            d.add(type(c).__name__, constant(c))
    return d.hexdigest()


def constant(c: Any) -> Any:
    """A code constant as a token that is the same in every process: a frozenset (``x in {"a",
    "b"}``) repr's in the order of its strings' hashes, which differ by process (PYTHONHASHSEED).

    >>> constant(frozenset({"b", "a"}))
    ('frozenset', ["'a'", "'b'"])
    """
    if isinstance(c, frozenset):
        return ("frozenset", sorted(repr(constant(x)) for x in c))
    if isinstance(c, tuple):
        return tuple(constant(x) for x in c)
    return c
