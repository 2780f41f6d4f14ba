"""The disk tier's write-behind worker: commits hand it records and return at once (DESIGN.md §4).

A bounded queue gives back-pressure (a commit waits only when the disk has fallen `maxsize` blocks behind);
the worker drains whatever is queued into one LMDB transaction, so one fsync covers many blocks.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence

from common.keys import BlockKey
from ucm.disk_tier import DiskTier
from ucm.record import BlockRecord

log = logging.getLogger("ucm.write_behind")
_BATCH = 1024
_BATCH_BYTES = 64 << 20
_LINGER_S = 0.002
_STOP = None


class WriteBehind:
    def __init__(
        self,
        disk: DiskTier,
        maxsize: int,
        on_written: Callable[[Sequence[BlockRecord], Sequence[BlockKey]], None],
    ) -> None:
        self._disk = disk
        self._on_written = on_written
        self._queue: queue.Queue[BlockRecord | None] = queue.Queue(maxsize=maxsize)
        self._thread = threading.Thread(target=self._run, name="ucm-write-behind", daemon=True)
        self._thread.start()

    def submit(self, records: Sequence[BlockRecord]) -> None:
        for record in records:
            self._queue.put(record)

    def offer(self, record: BlockRecord) -> bool:
        """Queue one record without waiting (callers holding a lock the worker takes); False if the queue is full."""
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            return False
        return True

    def queued(self) -> int:
        return self._queue.qsize()

    def flush(self) -> None:
        """Return once everything submitted so far is on disk (or was refused by the disk tier)."""
        self._queue.join()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            batch: list[BlockRecord] = []
            stop = first is _STOP
            if first is not None:
                batch.append(first)
            nbytes = sum(r.nbytes for r in batch)
            while not stop and len(batch) < _BATCH and nbytes < _BATCH_BYTES:
                try:  # linger a moment: a commit usually brings many blocks, and each transaction costs an fsync
                    item = self._queue.get(timeout=_LINGER_S)
                except queue.Empty:
                    break
                if item is _STOP:
                    stop = True
                else:
                    batch.append(item)
                    nbytes += item.nbytes
            try:
                if batch:
                    written = self._disk.write(batch)
                    self._on_written(batch, written)
            except Exception:  # the worker must survive one bad batch; the blocks stay DRAM-only
                log.exception("write-behind: batch of %d blocks failed", len(batch))
                self._on_written(batch, [])
            finally:
                for _ in range(len(batch) + (1 if stop else 0)):
                    self._queue.task_done()
            if stop:
                return
