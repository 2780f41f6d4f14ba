"""The daemon's attached shared-memory segments (ucm/shared_segment.py), per client, a bounded number in all.

A segment belongs to the client that attached it: a load from another client naming it is refused, so one
tenant cannot make the daemon write into another's staging memory. Past `max_segments` the least recently used
mapping is dropped; a load naming it then gets NO_SEGMENT and its client attaches it again. Each attach also drops
the mappings whose file is gone: a client unlinks its segments when it drops them or closes, and the next client
to start unlinks those of dead processes, so a killed client's memory is not held until the table is full.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from ucm import store_wire as p
from ucm.refusal import Refused
from ucm.shared_segment import MappedSegment


class SegmentTable:
    def __init__(self, max_segments: int, max_segment_bytes: int) -> None:
        assert max_segments > 0 and max_segment_bytes > 0, "segment limits are positive"
        self.max_segments = max_segments
        self.max_segment_bytes = max_segment_bytes
        self._lock = threading.Lock()
        self._segments: OrderedDict[tuple[str, str], MappedSegment] = OrderedDict()

    def attach(self, client: str, name: str, nbytes: int, token: bytes) -> None:
        if nbytes > self.max_segment_bytes:
            raise Refused(p.ErrorCode.TOO_LARGE, f"segment of {nbytes} bytes > {self.max_segment_bytes}")
        segment = MappedSegment(name, nbytes, token)  # ValueError: not attachable (BAD_REQUEST)
        with self._lock:
            for gone in [k for k, s in self._segments.items() if not s.exists()]:
                del self._segments[gone]
            self._segments[(client, name)] = segment
            self._segments.move_to_end((client, name))
            while len(self._segments) > self.max_segments:
                self._segments.popitem(last=False)

    def get(self, client: str, name: str) -> MappedSegment:
        with self._lock:
            segment = self._segments.get((client, name))
            if segment is None:
                raise Refused(p.ErrorCode.NO_SEGMENT, f"segment {name[:80]} is not attached by this client")
            self._segments.move_to_end((client, name))
            return segment

    def detach(self, client: str, name: str) -> None:
        with self._lock:
            self._segments.pop((client, name), None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._segments)
