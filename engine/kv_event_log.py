"""The device prefix cache's KV events since the last engine step, in vLLM's structs (common/kv_events/events.py):
what `BlockPool` cached (BlockStored), dropped (BlockRemoved) and reset (AllBlocksCleared), medium "GPU".

Blocks cached one after another along one chain are one BlockStored (vLLM sends one per request and step), removals
in a row one BlockRemoved; a reset makes everything before it moot, so the log then holds AllBlocksCleared alone.
The node publishes `take()` once per engine step.
"""

from __future__ import annotations

from common.keys import BlockKey
from common.kv_events.events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, block_stored


class KVEventLog:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[KVEvent] = []

    def stored(self, key: BlockKey, parent: BlockKey | None, token_ids: tuple[int, ...]) -> None:
        """A block entered the prefix cache; `parent` None for a prompt's first block (vLLM's convention)."""
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockStored) and parent is not None and last.block_hashes[-1] == parent:
            last.block_hashes.append(key)
            last.token_ids.extend(token_ids)
            return
        self._events.append(block_stored([key], parent, list(token_ids), self.block_size))

    def removed(self, key: BlockKey) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(key)
            return
        self._events.append(BlockRemoved(block_hashes=[key], medium=MEDIUM_GPU))

    def cleared(self) -> None:
        self._events = [AllBlocksCleared()]

    def take(self) -> list[KVEvent]:
        out, self._events = self._events, []
        return out
