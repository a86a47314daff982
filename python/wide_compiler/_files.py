"""Writing files safely (checkpoints, exported programs): atomic replace through a temporary
file with an unpredictable name, created exclusively, so a file or symlink planted in the target
directory is never written through; errors name the path and why."""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

__all__ = ["atomic_write", "ensure_directory"]


def _umask() -> int:
    """The process's umask, read without changing it where Linux allows (``/proc``)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # elsewhere: set and restore (the only portable way to read it)
    os.umask(mask)
    return mask


def _os_error(e: OSError, message: str, path: Path) -> OSError:
    """An ``OSError`` of ``e``'s kind (``PermissionError``, ``NotADirectoryError``...) saying
    ``message``, with ``path`` as its filename."""
    code = e.errno if e.errno is not None else errno.EIO
    reason = e.strerror or str(e)
    return OSError(code, f"{message} ({reason})", str(path))


def ensure_directory(path: str | os.PathLike, what: str) -> Path:
    """``path`` as a directory, created (with its parents) when missing; an ``OSError`` naming
    ``what`` and the path when it is a file, or cannot be created."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, f"{what}: {path} exists and is not a directory; "
                                 f"give a directory for the checkpoint", str(path))
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _os_error(e, f"{what}: cannot create the directory {path}", path) from e
    return path


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], Any], what: str) -> Path:
    """Write the file ``path`` atomically: ``write(f)`` fills a new temporary file in the same
    directory, which then replaces ``path`` (``os.replace``). The temporary file has an
    unpredictable name and is created exclusively (``tempfile.mkstemp``: never an existing file,
    never through a symlink), so nothing planted beside ``path`` is written to; a symlink AT
    ``path`` is replaced, not followed. The file gets the usual permissions (``0o666`` less the
    umask) and is flushed to disk before the rename. On failure the temporary file is removed,
    ``path`` is left as it was, and an ``OSError`` names ``what``, the path and the reason.

    Returns ``path``.
    """
    path = Path(path)
    parent = path.parent
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, f"{what}: cannot write {path}: it is a directory; give "
                                f"a file path", str(path))
    if not parent.exists():
        raise FileNotFoundError(errno.ENOENT, f"{what}: cannot write {path}: its directory {parent} "
                                f"does not exist", str(path))
    if not parent.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, f"{what}: cannot write {path}: {parent} is not a "
                                 f"directory", str(path))
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent)
    except OSError as e:
        raise _os_error(e, f"{what}: cannot write {path}: cannot create a file in {parent}", path) from e
    tmp = Path(tmp_name)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            fd = -1  # owned by f now
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if fd >= 0:
            os.close(fd)
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise _os_error(e, f"{what}: writing {path} failed", path) from e
        raise
    return path
