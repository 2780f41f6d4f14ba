"""Host-DRAM tier: committed blocks kept as Python buffers, bounded in bytes, ordered by a pluggable policy.

Not locked itself: the `Store` calls it only under its own lock. Payload buffers are immutable once here, so a
reader that took a reference keeps valid bytes even if the block is evicted meanwhile. The policy sees a
request's blocks deepest first (`ucm.chain_order`) and each block's parent key.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Mapping

from common.keys import BlockKey
from common.kv_events.events import MEDIUM_CPU
from ucm.api import TierStats
from ucm.chain_order import records_deepest_first
from ucm.eviction import EvictionPolicy
from ucm.record import BlockRecord
from ucm.tier_events import TierEvents

log = logging.getLogger("ucm.dram")


class DramTier:
    def __init__(
        self,
        capacity_bytes: int,
        policy: EvictionPolicy,
        can_evict: Callable[[Hashable], bool],
        on_evict: Callable[[BlockRecord, bool], None] | None = None,
        events: TierEvents | None = None,
    ) -> None:
        """`on_evict`: told each record evicted to make room, and whether a read found it here (under the caller's
        lock, so it must not block). `events`: told each block stored and dropped (medium CPU)."""
        if capacity_bytes <= 0:
            raise ValueError(f"DRAM capacity must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._policy = policy
        self._can_evict = can_evict
        self._on_evict = on_evict
        self._events = events
        self._blocks: dict[BlockKey, BlockRecord] = {}
        self._read: set[BlockKey] = set()  # resident blocks a get/get_many found (kept only for `on_evict`)
        self.stats = TierStats(capacity_bytes=capacity_bytes)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, key: BlockKey) -> BlockRecord | None:
        """The record (counted as a hit and a use) or None (a miss)."""
        record = self._blocks.get(key)
        if record is None:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        self._policy.touch(key)
        if self._on_evict is not None:
            self._read.add(key)
        return record

    def peek(self, key: BlockKey) -> BlockRecord | None:
        """The record if resident, without counting a hit or a use."""
        return self._blocks.get(key)

    def get_many(
        self, keys: list[BlockKey], fallback: Mapping[BlockKey, BlockRecord], use: bool = True
    ) -> list[BlockRecord | None]:
        """`get` for many keys at once (the load hot path), `keys` in chain order; a key absent here is looked
        up in `fallback` (blocks committed but evicted before reaching disk), which counts as a DRAM hit without
        a use. `use=False`: hits are counted but the policy is not told (another call of the same load did)."""
        blocks, stats = self._blocks, self.stats
        out: list[BlockRecord | None] = [blocks.get(key) for key in keys]
        if self._on_evict is not None:
            self._read.update(key for key, record in zip(keys, out) if record is not None)
        if use:
            touch = self._policy.touch
            for key, record in zip(reversed(keys), reversed(out)):  # deepest first: the root ends most recent
                if record is not None:
                    touch(key)
        if fallback:
            out = [record if record is not None else fallback.get(key) for key, record in zip(keys, out)]
        hits = len(out) - out.count(None)
        stats.hits += hits
        stats.misses += len(out) - hits
        return out

    def put_many(self, records: list[BlockRecord], reason: str) -> list[bool]:
        """`put` each record, deepest first; per record (in the given order), whether it was stored."""
        placed = {record.key: self.put(record, reason) for record in records_deepest_first(records)}
        return [placed[record.key] for record in records]

    def put(self, record: BlockRecord, reason: str) -> bool:
        """Insert `record`, evicting others if needed; False if it was not admitted or no room could be made."""
        key, size = record.key, record.nbytes
        if key in self._blocks:
            self._policy.touch(key)
            return True
        if size > self.capacity_bytes or not self._policy.admit(key, size):
            log.debug("dram: not admitting %s (%d bytes, %s)", key.hex(), size, reason)
            return False
        while self.stats.bytes_used + size > self.capacity_bytes:
            victim = self._policy.evict(self._can_evict)
            assert victim is None or isinstance(victim, bytes), "a tier's policy holds its BlockKeys"
            if victim is None:
                log.debug("dram: no room for %s (%d bytes): every resident block is pinned", key.hex(), size)
                return False
            dropped = self._blocks.pop(victim)
            self.stats.bytes_used -= dropped.nbytes
            self.stats.evictions += 1
            if self._events is not None:
                self._events.removed(MEDIUM_CPU, (victim,))
            if self._on_evict is not None:
                was_read = victim in self._read
                self._read.discard(victim)
                self._on_evict(dropped, was_read)
            log.debug(
                "dram: evicted %s (%d bytes, policy %s) to admit %s (%d bytes, %s): %d/%d bytes used",
                victim.hex(),
                dropped.nbytes,
                self._policy.name.value,
                key.hex(),
                size,
                reason,
                self.stats.bytes_used,
                self.capacity_bytes,
            )
        self._blocks[key] = record
        self._policy.insert(key, size, record.header.parent)
        self.stats.bytes_used += size
        self.stats.blocks = len(self._blocks)
        if self._events is not None:
            self._events.stored(MEDIUM_CPU, key, record.header.parent, record.header.token_ids)
        return True

    def remove(self, key: BlockKey, corrupt: bool = False) -> bool:
        """Drop a block: asked to, or (`corrupt`) because a read found its bytes wrong."""
        record = self._blocks.pop(key, None)
        if record is None:
            return False
        if corrupt:
            self.stats.corrupt_dropped += 1
        else:
            self.stats.removed += 1
        self._read.discard(key)
        self._policy.remove(key)
        if self._events is not None:
            self._events.removed(MEDIUM_CPU, (key,))
        self.stats.bytes_used -= record.nbytes
        self.stats.blocks = len(self._blocks)
        return True
