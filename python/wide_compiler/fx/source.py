"""Where a captured node or a running op comes from in the user's code, for error messages.

The user's source line is the innermost stack frame outside torch and wide_compiler (and, for a
frame found while torch runs, outside the standard library): :func:`source_line` reads it from
a captured node's ``stack_trace``, :func:`user_frame` and :func:`user_frame_and_module` from the
stack running now. Everything here is best effort and never raises: a message without its source
line still says what is wrong.
"""

from __future__ import annotations

import linecache
import os
import re
import sys
import traceback

import torch
from torch import nn

__all__ = ["is_user_file", "location", "module_path", "source_line", "user_frame", "user_frame_and_module"]

_TORCH_DIR = os.path.dirname(torch.__file__)
_OUR_DIR = os.path.dirname(os.path.dirname(__file__))
_STDLIB_DIR = os.path.dirname(os.__file__)


def is_user_file(filename: str, *, skip_stdlib: bool = False) -> bool:
    """Whether ``filename`` is the user's code: not torch's, not wide_compiler's, and with
    ``skip_stdlib=True`` not the standard library's either."""
    skipped = (_TORCH_DIR, _OUR_DIR, _STDLIB_DIR) if skip_stdlib else (_TORCH_DIR, _OUR_DIR)
    return not filename.startswith(skipped)


def location(filename: str, lineno: int | str, func: str, code: str | None = None) -> str:
    """``file:line in func: code``, the code read from the file when not given (left out when
    there is none).

    Example:
        >>> location("model.py", 12, "forward", "  return x * 2 ")
        'model.py:12 in forward: return x * 2'
    """
    code = (linecache.getline(filename, lineno) if code is None else code).strip()
    return f"{filename}:{lineno} in {func}" + (f": {code}" if code else "")


def source_line(node: torch.fx.Node) -> str:
    """The user's source line of a captured node: the innermost stack frame outside torch and
    wide_compiler, as ``file:line in func: code`` (``<no source line ...>`` when the trace has
    none: a file of torch or wide_compiler is never given as the user's line)."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)(?:\n(?!\s*File )\s*(.*))?', trace)
    if not frames:
        path = module_path(node)
        return f"<no source line recorded{f'; in module {path!r}' if path else ''}>"
    user = [f for f in frames if is_user_file(f[0])]
    if not user:  # torch's and wide_compiler's frames only (code made by exec, say): never name those as the user's
        path = module_path(node)
        return f"<no source line of the user's code recorded{f'; in module {path!r}' if path else ''}>"
    file, line, func, code = user[-1]
    return location(file, line, func, code)


def module_path(node: torch.fx.Node) -> str:
    """The dotted path of the innermost module that produced ``node`` ('' for the root)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return path if isinstance(path, str) else ""


def user_frame() -> str:
    """The user's source line running now (``<unknown>`` when the whole stack is torch's and
    wide_compiler's)."""
    frames = [f for f in traceback.extract_stack() if is_user_file(f.filename)]
    if not frames:
        return "<unknown>"
    f = frames[-1]
    return location(f.filename, f.lineno, f.name, f.line or "")


def user_frame_and_module() -> str:
    """The user's source line running now and the innermost module's class (for messages), as
    ``at file:line in func: code, in a Module``; parts not found are left out."""
    frame, module, user = sys._getframe(1), None, None
    while frame is not None:
        owner = frame.f_locals.get("self")
        if module is None and isinstance(owner, nn.Module):
            module = type(owner).__name__
        filename = frame.f_code.co_filename
        if user is None and is_user_file(filename, skip_stdlib=True):
            user = location(filename, frame.f_lineno, frame.f_code.co_name)
        if module is not None and user is not None:
            break
        frame = frame.f_back
    parts = ([f"at {user}"] if user else []) + ([f"in a {module}"] if module else [])
    return ", ".join(parts)


def assert_message(msg: str) -> str:
    """``msg`` cut to what ``torch._assert_async`` takes on every device: CUDA's refuses a message
    of 255 characters or more at every call, its condition true or not (every per-member random op
    failed so on an H200). Messages put the source line last, so a cut loses it first."""
    return msg if len(msg) < 255 else msg[:250] + " ..."
