"""Keep freed heap memory in the process instead of handing it back to the OS after every eviction.

The store frees and reallocates payload buffers all the time (eviction, promotion). With glibc's default
trim and mmap thresholds each fresh buffer is first-touch page-faulted again, which on virtual machines
costs more than the copy itself (measured: 0.2-0.8 GB/s for a first dump vs 3-6 GB/s warm). Only the
process owner should call this (the daemon does; an embedding engine may).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("ucm.malloc")
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def retain_freed_memory(threshold_bytes: int = 1 << 30) -> bool:
    """Raise glibc's trim/mmap thresholds; False (and nothing changed) where that is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        log.debug("mallopt not available; leaving the allocator alone")
        return False
    # M_MMAP_THRESHOLD is capped by glibc (32 MiB on 64-bit); a larger value is refused, so clamp it.
    ok = bool(mallopt(_M_TRIM_THRESHOLD, threshold_bytes)) and bool(
        mallopt(_M_MMAP_THRESHOLD, min(threshold_bytes, 32 << 20))
    )
    log.debug("mallopt thresholds raised: %s", ok)
    return ok
