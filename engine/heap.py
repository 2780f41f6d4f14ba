"""Freed memory kept by the process's allocator (glibc), for the next step's activations to reuse.

A CPU step allocates its activations afresh, tens of MB a layer (Llama-1B at 1536 tokens: ~1 GB a step). glibc
serves allocations past its mmap threshold (128 KB, adapting up to 32 MB) with fresh mappings and returns freed
memory at the heap's top to the OS, so every step faulted its activations in again: 50-290 thousand minor faults a
prompt step of Llama-1B on the 2-core Xeon with AMX (1536-2048 tokens), each a page zeroed by the kernel. With
mmap off and no trimming, a step reuses what the last one freed: 0 faults, and the 1536-token step 1512-1740 ->
1453-1572 ms, 2048 tokens 2234-2504 -> 2013-2306 ms (environment variables alternated between runs). Set once the
model and KV cache are in place (their loading's temporaries already went back); the process then holds its peak
activation memory. vLLM's CPU guide asks for tcmalloc preloaded to the same end.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
NEVER_TRIM = 2**31 - 1  # mallopt takes an int: 2 GB of free heap top before any is returned


def retain_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory (module doc); False where the C library is not glibc's."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not (mallopt(M_MMAP_MAX, 0) and mallopt(M_TRIM_THRESHOLD, NEVER_TRIM)):
        return False
    logger.info("heap: freed memory kept for reuse (glibc mmap off, no trim): a step's activations fault in once")
    return True
