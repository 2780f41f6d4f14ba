"""Shared-memory staging: a client's staging memory that a store daemon on the same host writes loads into and
copies dumps out of.

Over a socket a load costs the daemon's send, the kernel's two copies and the client's copy out of the received
frame (about 1.3 GB/s on loopback on a 2-core host), and with CURVE both ends encrypt or decrypt every KV byte. A
daemon on the same host can instead copy each payload once, straight between its DRAM tier and the client's
staging rows, and answer with a small reply.

The client creates the segment: a file `/dev/shm/ucm-seg-<pid>-<32 hex>`, mode 0600, opened O_EXCL, whose first
`HEADER_NBYTES` hold a random token. It asks the daemon to attach it (`AttachShm` names the segment, its size and
the token); the daemon opens it without following links, checks that it is a regular file of that size owned by
its own user, and that the token in the file is the token in the message, which proves the asking client can read
the file (a client elsewhere, or one that only listed /dev/shm, cannot). Payloads are read and written only at
offsets past the header and inside the declared size. The file stays while its client lives, so that a restarted daemon
can attach it again; the client unlinks it when it drops the segment, and removes the files of dead processes
(the pid in the name) when it creates one, so a killed client leaks its segments only until the next one starts.
The daemon's mapping keeps the memory until it detaches (or forgets it: it holds a bounded number).
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import stat
import sys
import weakref
from pathlib import Path

import numpy as np

SHM_DIR = Path("/dev/shm")
# Linux 5.14's MADV_POPULATE_WRITE (Python 3.11 lacks the name): fault every page in now, not on the first load.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23 if sys.platform == "linux" else None)
HEADER_NBYTES = 4096  # the token, padded to a page so payloads start page-aligned
TOKEN_NBYTES = 16
_NAME = re.compile(r"ucm-seg-([0-9]{1,10})-[0-9a-f]{32}")


def shm_available() -> bool:
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def check_name(name: str) -> None:
    if not _NAME.fullmatch(name):
        raise ValueError(f"segment name {name[:80]!r} is not ucm-seg-<pid>-<32 hex digits>")


def sweep_dead_segments() -> int:
    """Unlink the segments of processes that no longer exist; how many went."""
    removed = 0
    for path in SHM_DIR.glob("ucm-seg-*"):
        match = _NAME.fullmatch(path.name)
        if match is None:
            continue
        try:
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
            removed += 1
        except (PermissionError, OverflowError):  # alive under another user, or no such pid at all
            continue
    return removed


class SharedSegment:
    """The client's side: a mapped file in /dev/shm whose bytes past the header it hands out as staging."""

    def __init__(self, nbytes: int) -> None:
        if nbytes <= 0:
            raise ValueError(f"segment size must be positive, got {nbytes}")
        self.name = f"ucm-seg-{os.getpid()}-{secrets.token_hex(16)}"
        self.token = secrets.token_bytes(TOKEN_NBYTES)
        self.nbytes = HEADER_NBYTES + nbytes
        self.path = SHM_DIR / self.name
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, self.nbytes)
            self._map = mmap.mmap(fd, self.nbytes)
            if _MADV_POPULATE_WRITE is not None:
                try:
                    self._map.madvise(_MADV_POPULATE_WRITE)
                except OSError:  # an older kernel: the first load faults the pages in instead
                    pass
        except BaseException:
            self.path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._map, np.uint8)
        self.array[:TOKEN_NBYTES] = np.frombuffer(self.token, np.uint8)
        self.base = int(self.array.ctypes.data)
        self._finalizer = weakref.finalize(self, self.path.unlink, missing_ok=True)

    def payload(self) -> memoryview:
        """The bytes past the header: the staging memory."""
        return self.array[HEADER_NBYTES:].data

    def offset_of(self, view: memoryview) -> int | None:
        """Where `view` starts in the segment, if all of it lies inside the payload area."""
        start = int(np.frombuffer(view, np.uint8).ctypes.data) - self.base
        if start >= HEADER_NBYTES and start + view.nbytes <= self.nbytes:
            return start
        return None

    def unlink(self) -> None:
        """Remove the name (also done when the segment is collected); the memory lives on while this process or
        the daemon still maps it."""
        self._finalizer()


class MappedSegment:
    """The daemon's side: a client's segment, checked and mapped read-write."""

    def __init__(self, name: str, nbytes: int, token: bytes) -> None:
        check_name(name)
        if nbytes <= HEADER_NBYTES:
            raise ValueError(f"segment of {nbytes} bytes has no room past its {HEADER_NBYTES}-byte header")
        try:
            fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:
            raise ValueError(f"cannot open segment {name}: {exc.strerror} (is the client on another host?)") from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise ValueError(f"segment {name} is not a regular file of this daemon's user")
            if st.st_size != nbytes:
                raise ValueError(f"segment {name} has {st.st_size} bytes, the request says {nbytes}")
            # The client populated the pages: map them all now rather than fault them in during loads.
            mapped = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        self.array = np.frombuffer(mapped, np.uint8)
        if not secrets.compare_digest(self.array[:TOKEN_NBYTES].tobytes(), token):
            raise ValueError(f"segment {name}: the token does not match the file's")
        self.name = name
        self.nbytes = nbytes

    def exists(self) -> bool:
        """Whether the client still has the file (it unlinks it when it drops the segment)."""
        return (SHM_DIR / self.name).exists()

    def views(self, offsets: list[int], lengths: list[int]) -> list[memoryview]:
        """Writable views at `offsets`; ValueError if any falls in the header or past the end."""
        if len(offsets) != len(lengths):
            raise ValueError(f"{len(offsets)} offsets but {len(lengths)} lengths")
        out: list[memoryview] = []
        for off, n in zip(offsets, lengths):
            if off < HEADER_NBYTES or n < 0 or off + n > self.nbytes:
                raise ValueError(f"segment range [{off}, {off + n}) outside [{HEADER_NBYTES}, {self.nbytes})")
            out.append(self.array[off : off + n].data)
        return out
