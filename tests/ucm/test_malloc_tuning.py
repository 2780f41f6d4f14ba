"""`retain_freed_memory` keeps a process to one glibc malloc arena, whatever threads allocate (real glibc, checked
with its own `malloc_stats`); without it, threads get arenas of their own."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PROGRAM = """
import ctypes, sys, threading
from ucm.malloc_tuning import retain_freed_memory
if sys.argv[1] == "tuned":
    assert retain_freed_memory()
def work():
    kept = [bytearray(200_000) for _ in range(50)]  # under the mmap threshold: served by an arena
    del kept[::2]
threads = [threading.Thread(target=work) for _ in range(4)]
for t in threads: t.start()
for t in threads: t.join()
ctypes.CDLL("libc.so.6").malloc_stats()  # to stderr
"""


def arenas(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return out.stderr.count("Arena ")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's arenas")
def test_one_arena_for_every_thread() -> None:
    assert arenas("default") > 1, "threads got no arenas of their own: this check could not fail"
    assert arenas("tuned") == 1
