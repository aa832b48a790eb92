"""Keep freed memory in the process instead of handing it back to the OS after every array.

Analysing a run allocates and frees a few hundred arrays of ~1 MB (one float per gap). With
glibc's defaults each of them is a fresh `mmap`: every 4 KiB page of it faults on first
touch and is unmapped again on free, so on a 112 k-gap run about 40% of the wall time of
`analyze(load(path))` is page faults, not arithmetic (bench/bench_fleet.py shows both).
Raising the mmap and trim thresholds lets those arrays reuse the heap. The process then keeps
up to `trim_threshold_bytes` of freed memory; arrays larger than `mmap_threshold_bytes`
still map and unmap on their own.

Only the command line (analysis commands, their worker processes and Ray tasks) calls
this; importing tracekit never changes the allocator of an engine being recorded.
"""

from __future__ import annotations

import ctypes
import functools
import sys

# mallopt parameters (glibc malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

#: Arrays up to this size come from the heap (a 1.3 M-gap run has 10 MB columns).
MMAP_THRESHOLD_BYTES = 64 << 20
#: Freed heap kept for reuse before it is returned to the OS.
TRIM_THRESHOLD_BYTES = 256 << 20

_done: list[bool] = []


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc, loaded once (None: not there). Each `ctypes.CDLL` makes a class of its own,
    a reference cycle: loaded at every slice, that was garbage for the cyclic collector."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def set_malloc_thresholds(mmap_threshold_bytes: int, trim_threshold_bytes: int) -> bool:
    """Set glibc's mmap and trim thresholds (fixed from then on). False where there is no
    glibc `mallopt` (other platforms, musl): nothing changes."""
    try:
        mallopt = _libc().mallopt  # type: ignore[union-attr]
    except AttributeError:  # no glibc (None), or no mallopt in it
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold_bytes)) and bool(
        mallopt(_M_TRIM_THRESHOLD, trim_threshold_bytes)
    )


def keep_freed_memory(
    mmap_threshold_bytes: int = MMAP_THRESHOLD_BYTES,
    trim_threshold_bytes: int = TRIM_THRESHOLD_BYTES,
) -> bool:
    """Tune glibc's malloc for array-heavy analysis (once per process). Returns whether it
    applied: False on other C libraries and platforms, where nothing changes."""
    if not _done:
        _done.append(set_malloc_thresholds(mmap_threshold_bytes, trim_threshold_bytes))
    return _done[0]


def give_back_freed_memory() -> bool:
    """Hand the heap's free pages back to the OS now (glibc's `malloc_trim`): between the
    phases of a long run's reading, where what one phase freed lies in holes between what
    lives on (a run's request names, its index), which the trim threshold never returns.
    False where there is no glibc (nothing done)."""
    try:
        trim = _libc().malloc_trim  # type: ignore[union-attr]
    except AttributeError:
        return False
    return bool(trim(0))
