"""Keep freed heap memory in the process instead of handing it back to the OS after every eviction.

The store frees and reallocates payload buffers all the time (eviction, promotion). With glibc's default
trim and mmap thresholds each fresh buffer is first-touch page-faulted again, which on virtual machines
costs more than the copy itself (measured: 0.2-0.8 GB/s for a first dump vs 3-6 GB/s warm). Only the
process owner should call this (the daemon does; an embedding engine may).

It also keeps the process to one malloc arena. With glibc's per-thread arenas, a buffer freed in one thread's arena
is not reused by another, and each arena keeps its own high-water mark: in a colocated soak (docs/history/benchmarks.json,
"Soak") the daemon held 23 MiB free in two arenas beside its 64 MiB DRAM tier. With one arena the free part was
8 MiB at the same load, and `benchmarks.store_bandwidth` measured the same bandwidths (promotion from disk in process
2x faster: its buffers are no longer fresh pages).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("ucm.malloc")
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


def retain_freed_memory(threshold_bytes: int = 1 << 30) -> bool:
    """Raise glibc's trim/mmap thresholds and keep one arena; False (and nothing changed) where that is not glibc.
    Call it before the process starts threads: arenas already made stay."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        log.debug("mallopt not available; leaving the allocator alone")
        return False
    # M_MMAP_THRESHOLD is capped by glibc (32 MiB on 64-bit); a larger value is refused, so clamp it.
    ok = (
        bool(mallopt(_M_TRIM_THRESHOLD, threshold_bytes))
        and bool(mallopt(_M_MMAP_THRESHOLD, min(threshold_bytes, 32 << 20)))
        and bool(mallopt(_M_ARENA_MAX, 1))
    )
    log.debug("mallopt thresholds raised, one arena: %s", ok)
    return ok
