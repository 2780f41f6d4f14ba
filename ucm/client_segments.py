"""`ClientSegments`: a `StoreClient`'s shared-memory segments (ucm/shared_segment.py) and whether the daemon writes
into each: attached, refused (payloads from and into it go as frames), or not asked yet."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from ucm import store_wire as p
from ucm.shared_segment import SharedSegment, shm_available, sweep_dead_segments


class ClientSegments:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and shm_available()
        self._lock = threading.Lock()
        self._segments: list[SharedSegment] = []
        self._attached: dict[str, bool] = {}  # name -> attached (False: the daemon refused it); absent: not asked

    def new(self, nbytes: int) -> SharedSegment:
        """A fresh segment; the first one of this client also removes the segments of dead processes."""
        with self._lock:
            first = not self._segments
        if first:
            sweep_dead_segments()
        segment = SharedSegment(nbytes)
        with self._lock:
            self._segments.append(segment)
        return segment

    def attached(self, name: str) -> bool | None:
        with self._lock:
            return self._attached.get(name)

    def mark(self, name: str, attached: bool | None) -> None:
        """Record the daemon's answer; None forgets it (the daemon restarted or dropped the mapping)."""
        with self._lock:
            if attached is None:
                self._attached.pop(name, None)
            else:
                self._attached[name] = attached

    def ranges(self, views: Sequence[Sequence[memoryview]]) -> tuple[SharedSegment, p.ShmRanges] | None:
        """Where `views` (row after row) lie in one segment the daemon may map, if they all do."""
        first = views[0][0] if views and views[0] else None
        with self._lock:
            segment = next((s for s in self._segments if first is not None and s.offset_of(first) is not None), None)
            if segment is None or self._attached.get(segment.name) is False:
                return None
        offsets: list[int] = []
        for row in views:
            for view in row:
                off = segment.offset_of(view)
                if off is None:
                    return None
                offsets.append(off)
        return segment, p.ShmRanges(segment.name, offsets, [len(v) for row in views for v in row])

    def attached_names(self) -> list[str]:
        with self._lock:
            return [name for name, ok in self._attached.items() if ok]

    def unlink_all(self) -> None:
        """The names go now; the daemon keeps a mapping until it drops it."""
        with self._lock:
            segments = list(self._segments)
        for segment in segments:
            segment.unlink()
