"""Memory for wide activations: the wide model's own caching allocator (on by default, scoped
to its calls; :func:`caching_scope`, :func:`cache_info`, :func:`empty_cache`,
:func:`set_cache_limit`) and the process-wide alternative :func:`tune_cpu_allocator`.

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
    (``LD_PRELOAD``) avoid it too. A WideModel avoids it by default without changing anything
    for the rest of the process: its calls (and a train graph's backward pass) run in a caching
    scope of its own allocator (Note [The wide caching allocator] in
    csrc/wide/memory/caching_allocator.cpp). The functions of :mod:`wide_compiler.functional`,
    which the hand-built modules of :mod:`wide_compiler.nn` call, do the same per call
    (:func:`cached`): measured on a 512->1024 Linear's training step at N=16, the op alone took
    18.6 ms against the loop's 12.1 ms with glibc's defaults, 10.1 ms with the thresholds raised.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, TypeVar

import torch

__all__ = ["CacheInfo", "cache_backward", "cache_info", "cached", "caching_scope", "empty_cache", "set_cache_limit",
           "tune_cpu_allocator"]

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


class CacheInfo(NamedTuple):
    """The wide caching allocator's state: bytes held free, bytes handed out and not yet returned,
    the limit on free bytes (by default twice the peak, at least 1 GiB, at most a sixteenth of the
    machine's memory), allocations served from the cache and from the system, and the most bytes
    handed out at once since :func:`empty_cache` (the peak)."""

    cached_bytes: int
    live_bytes: int
    limit_bytes: int
    hits: int
    misses: int
    peak_bytes: int


@contextlib.contextmanager
def caching_scope() -> Iterator[None]:
    """Run the block with CPU allocations of 64 KiB or more served by the wide caching allocator
    (this thread only; scopes nest). WideModel enters it around its own calls, so user code
    rarely needs it: an eager loop over a wide model's pieces, say.

    >>> import torch, wide_compiler as wc
    >>> with wc.allocator.caching_scope():
    ...     y = torch.ones(1 << 16) * 2  # 256 KiB, from the cache
    >>> del y
    >>> wc.allocator.cache_info().cached_bytes >= 1 << 18
    True
    """
    torch.ops.wide._caching_scope(True)
    try:
        yield
    finally:
        torch.ops.wide._caching_scope(False)


_scope = torch.ops.wide._caching_scope.default  # the op, not caching_scope(): ~1 us less per call
F = TypeVar("F", bound=Callable[..., Any])


class _BackwardScope:
    """One caching scope entered by a backward pre-hook. The engine's final callback leaves it
    when the pass succeeds; when a node or hook raises, the engine drops its final callbacks
    without running them, and dropping the last reference to this object (the graph task's
    destructor, on the thread that called backward, before the error reaches the caller) leaves
    it instead, so a failed backward pass never leaves the thread in a scope."""

    __slots__ = ("_thread", "_open")

    def __init__(self) -> None:
        _scope(True)
        self._thread = threading.get_ident()
        self._open = True

    def close(self) -> None:
        """Leave the scope, on the thread that entered it; elsewhere, leave that to ``__del__``
        (Note [A backward pass that ends on another thread])."""
        if self._open and threading.get_ident() == self._thread:  # a scope is per thread
            self._open = False
            _scope(False)

    def __del__(self) -> None:
        self.close()


# Note [A backward pass that ends on another thread]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The engine runs a graph task's final callbacks on whichever thread finished its last node: with
# CUDA nodes in the pass, that can be the device's worker thread, and leaving there a scope the
# calling thread entered failed ("left a caching scope that was not entered", seen on a GPU). So
# close() leaves only on the entering thread, and otherwise the graph task's release does
# (the calling thread holds the task until backward returns).


def _enter_backward_scope(_grad_outputs: Any) -> None:
    """A backward pre-hook of a wide output's node: the rest of this backward pass allocates from
    the wide cache (the engine runs CPU work on the calling thread), until its final callback or,
    when the pass fails, until the engine drops that callback (:class:`_BackwardScope`)."""
    torch.autograd.Variable._execution_engine.queue_callback(_BackwardScope().close)


def cache_backward(outs: Sequence[Any]) -> None:
    """Run the backward pass of the CPU tensors ``outs`` (those that need one) in a caching scope:
    one pre-hook per autograd node. Nothing when grad mode is off."""
    if not torch.is_grad_enabled():
        return
    seen = set()
    for o in outs:
        fn = o.grad_fn if isinstance(o, torch.Tensor) and o.device.type == "cpu" else None
        if fn is not None and id(fn) not in seen:
            seen.add(id(fn))
            fn.register_prehook(_enter_backward_scope)


def cached(fn: F) -> F:
    """Decorate a function of wide ops: each call runs in a caching scope, and so does the
    backward pass of the tensors it returns (a tensor or a tuple/list of them). Under
    ``torch.compile`` the function runs as it is (the compiled code allocates for itself).

    >>> import torch, wide_compiler as wc
    >>> double = wc.allocator.cached(lambda x: x * 2)
    >>> double(torch.ones(3)).tolist()
    [2.0, 2.0, 2.0]
    """
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        _scope(True)
        try:
            out = fn(*args, **kwargs)
        finally:
            _scope(False)
        cache_backward(out if isinstance(out, (tuple, list)) else (out,))
        return out

    return call  # type: ignore[return-value]


def cache_info() -> CacheInfo:
    """The wide caching allocator's statistics (:class:`CacheInfo`)."""
    return CacheInfo(*torch.ops.wide._cache_stats())


def empty_cache() -> None:
    """Return every free block of the wide caching allocator to the system (tensors alive are
    unaffected), as ``torch.cuda.empty_cache`` does for CUDA's, and restart its peak from the
    bytes in use now (the default limit follows the peak)."""
    torch.ops.wide._cache_control(-1, True)


def set_cache_limit(limit_bytes: int | None) -> None:
    """Keep at most ``limit_bytes`` free in the wide caching allocator; free blocks beyond it go
    back to the system. 0 turns caching off (every block is freed on release). ``None`` restores
    the default, which follows the working set: twice the most bytes handed out at once since the
    last :func:`empty_cache` (``cache_info().peak_bytes``), at least 1 GiB and at most a sixteenth
    of the machine's memory. A steady training or inference loop then keeps every block it needs
    (blocks are matched by size, so a loop holds more blocks than its peak: ResNet-18's training
    step at N=16 peaks at 895 MiB in use and settles at 1120 MiB of blocks). Whatever the limit,
    blocks not taken for 32 calls go back to the system.

    >>> import wide_compiler as wc
    >>> wc.allocator.set_cache_limit(1 << 30)
    >>> wc.allocator.cache_info().limit_bytes
    1073741824
    >>> wc.allocator.set_cache_limit(None)  # the default again
    >>> wc.allocator.cache_info().limit_bytes >= 1 << 30
    True
    """
    if limit_bytes is None:
        torch.ops.wide._cache_control(-1, False, working_set_limit=True)
        return
    if not isinstance(limit_bytes, int) or isinstance(limit_bytes, bool) or limit_bytes < 0:
        raise ValueError("wide_compiler.allocator.set_cache_limit: expected a byte count >= 0 or None, "
                         f"got {limit_bytes!r}")
    torch.ops.wide._cache_control(limit_bytes, False)
