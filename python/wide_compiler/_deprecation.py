"""Old names kept as deprecated aliases: each warns once per process, then behaves as the new one."""

from __future__ import annotations

import warnings

__all__ = ["warn_renamed"]

_warned: set[str] = set()


def warn_renamed(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn (a ``DeprecationWarning``, the first time only) that ``old`` was renamed ``new``.

    Called by the alias itself: the default ``stacklevel`` points the warning at the alias's
    caller.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_renamed("f_old_example", "f_new_example", stacklevel=2)
        ...     warn_renamed("f_old_example", "f_new_example", stacklevel=2)   # once only
        >>> [str(w.message) for w in caught]
        ['f_old_example is deprecated: it was renamed f_new_example (same arguments)']
    """
    if old in _warned:
        return
    _warned.add(old)
    warnings.warn(f"{old} is deprecated: it was renamed {new} (same arguments)", DeprecationWarning,
                  stacklevel=stacklevel)
