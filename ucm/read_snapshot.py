"""A read transaction of the disk tier shared by the reads of one moment, with each record looked up once.

The connector loads one layer per call, so without sharing, every layer of every block costs one LMDB lookup
of the whole record and one header parse. Each lookup of a record spanning many pages also costs py-lmdb's
page pre-fault of the WHOLE value (measured ~12 us for a 2 MiB record, 3x the copy of one 64 KiB layer).
A snapshot keeps each record's view and parsed header (`RecordLayout`) for the calls that follow, until it
expires, or until the tier writes or deletes anything (it is retired then, so no read sees an old view of a
key that was rewritten or dropped). Payload checksums are still verified on every read by the caller.

Views point into LMDB's map and are only valid while the transaction lives: readers hold a use count and the
transaction is aborted only when its snapshot is retired and unused.
"""

from __future__ import annotations

import threading
import time

import lmdb

from common.keys import BlockKey
from ucm.record import RecordError, RecordLayout

# Long enough to serve the per-layer calls of one load (they are issued together), short enough that an idle
# snapshot does not keep LMDB from reusing freed pages for long (writes retire it at once anyway).
SNAPSHOT_TTL_S = 0.25


class StoredRecord:
    """One record as read in a snapshot: its bytes (valid while the snapshot is held) and parsed header."""

    __slots__ = ("_layout", "matched", "view")

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self._layout: RecordLayout | RecordError | None = None
        self.matched: object = None  # the last caller's BlockRef found to match the header (set by the reader)

    def layout(self) -> RecordLayout:
        """The verified header (parsed on first use); raises RecordError (each time) if it is bad."""
        layout = self._layout
        if layout is None:
            try:
                layout = RecordLayout(self.view)
            except RecordError as exc:
                layout = exc
            self._layout = layout
        if isinstance(layout, RecordError):
            raise layout
        return layout


class Snapshot:
    __slots__ = ("_lock", "_records", "_txn", "born", "retired", "users")

    def __init__(self, env: lmdb.Environment) -> None:
        self._txn = env.begin(buffers=True)
        self._records: dict[BlockKey, StoredRecord] = {}
        self._lock = threading.Lock()  # one LMDB call at a time on this transaction
        self.users = 0
        self.born = time.monotonic()
        self.retired = False

    def get(self, key: BlockKey) -> StoredRecord | None:
        record = self._records.get(key)  # a dict read is atomic: the lock is only for looking up LMDB
        if record is not None:
            return record
        with self._lock:
            record = self._records.get(key)
            if record is None:
                view = self._txn.get(key)
                if view is None:
                    return None
                record = self._records[key] = StoredRecord(view)
            return record

    def close(self) -> None:
        self._records.clear()
        self._txn.abort()


class SnapshotHolder:
    """The current snapshot of one LMDB environment; `acquire`/`release` around every use."""

    def __init__(self, env: lmdb.Environment, ttl_s: float = SNAPSHOT_TTL_S) -> None:
        self._env = env
        self._ttl_s = ttl_s
        self._lock = threading.Lock()
        self._current: Snapshot | None = None

    def acquire(self) -> Snapshot:
        with self._lock:
            snap = self._current
            if snap is None or time.monotonic() - snap.born > self._ttl_s:
                if snap is not None:
                    self._retire(snap)
                snap = self._current = Snapshot(self._env)
            snap.users += 1
            return snap

    def release(self, snap: Snapshot) -> None:
        with self._lock:
            snap.users -= 1
            assert snap.users >= 0, "snapshot released more often than acquired"
            if snap.users == 0 and snap.retired:
                snap.close()

    def retire(self) -> None:
        """After a write or delete committed: later reads start from a fresh transaction."""
        with self._lock:
            if self._current is not None:
                self._retire(self._current)
                self._current = None

    def _retire(self, snap: Snapshot) -> None:
        snap.retired = True
        if snap.users == 0:
            snap.close()
