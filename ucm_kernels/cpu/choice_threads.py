"""The thread count the CPU kernel choices are made for: the host's, whatever a process or a step runs on.

Each kernel gives a row the same bits on 1 thread or many (tests/engine/test_thread_count_bits.py), but two kernels
do not give each other's bits, and a choice made per thread count differed: on the 2-core Xeon with AMX, SmolLM2's
576x576 generated rows took the AMX kernel at 2 threads and the 4-bit one at 1, so an engine on 1 thread (a node of a
split on a small host, `--threads 1`) and one on 2 gave different greedy text, and KV a 1-thread prefill node stored
was not what a 2-thread decode node would compute. So every choice (calibration_store's cache files, the memos) is
keyed by and measured at one count per host: the CPUs this process may run on.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch


def choice_threads() -> int:
    """The thread count a kernel choice is keyed by and measured at: the CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@contextlib.contextmanager
def measuring_at(threads: int) -> Iterator[None]:
    """torch's thread count set to `threads` for a measurement, the caller's restored after (a step the governor
    put on fewer threads may be the first to need a choice)."""
    before = torch.get_num_threads()
    if before != threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
