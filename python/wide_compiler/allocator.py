"""glibc malloc settings for wide activations: :func:`tune_cpu_allocator`.

Note [Page faults on wide activations]
    PyTorch's CPU tensors come from glibc's malloc. A block above the mmap threshold (128 KiB
    at start, raised by glibc as large blocks are freed, up to 32 MiB) is mapped fresh on every
    allocation and unmapped on free, and the heap's free top is returned to the kernel above the
    trim threshold, so a tensor of a few MiB pays a page fault per 4 KiB page on every call. A
    member's activations are small enough to be recycled from the heap; the wide model's are N
    times larger and can cross those thresholds. Measured on the transformer encoder layer
    (N=16, d=64, T=32, B=8, inference, 2 threads): the same process alternated between 3.8 and
    7.4 ms per call depending on the allocator's state, and stayed at 3.8-5 ms with the
    thresholds raised (the loop of members: about 6 ms either way). jemalloc or tcmalloc
    (``LD_PRELOAD``) avoid it too.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

__all__ = ["tune_cpu_allocator"]

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
_applied: tuple[int, int] | None = None


def tune_cpu_allocator(mmap_threshold: int = 1 << 30, trim_threshold: int = 1 << 30) -> bool:
    """Raise glibc's mmap and trim thresholds for THIS process so that large tensors are
    recycled from the heap instead of being mapped (and page-faulted) on every call; see Note
    [Page faults on wide activations]. Process-wide (every allocation of the process is affected;
    freed memory is kept for reuse up to ``trim_threshold`` instead of returned to the kernel), so
    it is never done implicitly: call it once at start-up. Returns ``True`` when applied,
    ``False`` where the C library is not glibc (nothing changes; jemalloc or tcmalloc via
    ``LD_PRELOAD`` are the alternatives there). Same as ``MALLOC_MMAP_THRESHOLD_`` and
    ``MALLOC_TRIM_THRESHOLD_`` in the environment.

    >>> import wide_compiler as wc
    >>> wc.tune_cpu_allocator() in (True, False)
    True
    """
    global _applied
    if _applied == (mmap_threshold, trim_threshold):
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        log.info("wide_compiler.tune_cpu_allocator: no glibc mallopt here; allocator unchanged")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not (mallopt(_M_MMAP_THRESHOLD, mmap_threshold) and mallopt(_M_TRIM_THRESHOLD, trim_threshold)):
        log.warning("wide_compiler.tune_cpu_allocator: mallopt refused the thresholds (%d, %d)",
                    mmap_threshold, trim_threshold)
        return False
    _applied = (mmap_threshold, trim_threshold)
    log.info("wide_compiler: glibc mmap/trim thresholds set to %d/%d bytes", mmap_threshold, trim_threshold)
    return True
