"""`TierEvents`: what the store's tiers took in and dropped, as vLLM's KV events with the tier as `medium` (DRAM:
"CPU", disk: "STORAGE", common/kv_events/events.py), until the daemon publishes them (ucm/daemon.py).

Tiers call it under their own locks (the disk tier from the write-behind thread too), so it has its own lock and
never blocks. A tier announces a block once it can serve it: DRAM on insert, disk once its write landed; and a
removal for each block it evicts or drops. Blocks stored one after another along a chain are one BlockStored, as
the engine's event log groups them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from common.keys import BlockKey
from common.kv_events.events import BlockRemoved, BlockStored, KVEvent, block_stored


class TierEvents:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[KVEvent] = []

    def stored(self, medium: str, key: BlockKey, parent: BlockKey, token_ids: Iterable[int]) -> None:
        tokens = list(token_ids)
        with self._lock:
            last = self._events[-1] if self._events else None
            if isinstance(last, BlockStored) and last.medium == medium and last.block_hashes[-1] == parent:
                last.block_hashes.append(key)
                last.token_ids.extend(tokens)
                return
            self._events.append(block_stored([key], parent, tokens, len(tokens), medium))

    def removed(self, medium: str, keys: Iterable[BlockKey]) -> None:
        gone: list[bytes | int] = list(keys)
        if not gone:
            return
        with self._lock:
            last = self._events[-1] if self._events else None
            if isinstance(last, BlockRemoved) and last.medium == medium:
                last.block_hashes.extend(gone)
                return
            self._events.append(BlockRemoved(block_hashes=gone, medium=medium))

    def take(self) -> list[KVEvent]:
        with self._lock:
            out, self._events = self._events, []
        return out
