"""The device KV block pool: free list, reference counts and the prefix cache (key → block).

Lazy eviction: a block whose last user frees it goes to the back of the free queue but keeps its key, so a
later request with the same prefix can take it back (a hit). `get_new_blocks` takes blocks from the front
(least recently freed first) and only then drops their keys. A hit is served only if the stored parent key
and token ids match too, so a hash collision can never hand back the wrong KV.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from common.keys import BlockKey
from common.kv_events.events import KVEvent
from engine.kv_event_log import KVEventLog


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    # Set while the block is in the prefix cache: its key, its parent's key and the tokens it holds.
    key: BlockKey | None = None
    parent_key: BlockKey | None = None
    token_ids: tuple[int, ...] | None = None
    reused: bool = False  # another user took the cached block (a prefix hit or a fork) since it was cached

    def __repr__(self) -> str:
        cached = self.key.hex()[:8] if self.key is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, key={cached})"


@dataclass(frozen=True)
class EvictedBlock:
    """A prefix-cache block whose slot was handed to new work: what it held, for a write-back save."""

    block_id: int
    key: BlockKey
    parent_key: BlockKey
    token_ids: tuple[int, ...]
    reused: bool = False  # a prefix hit (or a fork) took it while it was cached


@dataclass(frozen=True)
class BlockPoolStats:
    num_blocks: int
    num_free: int  # ref_cnt == 0 (includes cached-but-free blocks)
    num_cached: int  # blocks holding a prefix-cache key (free or in use)
    num_used: int  # ref_cnt > 0


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        record_evictions: bool = False,
        events: KVEventLog | None = None,
    ) -> None:
        """`record_evictions`: keep what every cached block reused by `get_new_blocks` held, until
        `take_evicted` (a write-back connector saves them before the step overwrites them). `events`: log every key
        entering and leaving the prefix cache as vLLM's KV events, until `take_events`."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # Free blocks in eviction order (front = evicted first). OrderedDict: O(1) removal on a cache hit.
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockKey, KVCacheBlock] = {}
        # Bumped whenever a key enters or leaves the prefix cache: a prefix match made at one version holds
        # until the next (lookups read nothing else), so callers may keep it that long.
        self.cache_version = 0
        self.record_evictions = record_evictions
        self._evicted: list[EvictedBlock] = []
        self.events = events

    # -- allocation ---------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} blocks, only {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            assert block.ref_cnt == 0, f"free block {block} has references"
            if self.record_evictions and block.key is not None:
                assert block.parent_key is not None and block.token_ids is not None, f"{block} cached half-way"
                evicted = EvictedBlock(block.block_id, block.key, block.parent_key, block.token_ids, block.reused)
                self._evicted.append(evicted)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on blocks (prefix-cache hits or forks), pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1
            block.reused |= block.key is not None

    def free_blocks(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference each; pass blocks in eviction order (callers pass a request's tail first)."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    # -- prefix cache ---------------------------------------------------------------------------------------
    def lookup(self, key: BlockKey, parent_key: BlockKey, token_ids: tuple[int, ...]) -> KVCacheBlock | None:
        if not self.enable_caching:
            return None
        block = self._cached.get(key)
        if block is None or block.parent_key != parent_key or block.token_ids != token_ids:
            return None
        return block

    def cache_block(
        self,
        block: KVCacheBlock,
        key: BlockKey,
        parent_key: BlockKey,
        token_ids: tuple[int, ...],
        first: bool = False,
    ) -> bool:
        """Register a full, computed block. False (and nothing changes) if the key is already cached:
        the duplicate then stays uncached and is simply reused once freed. `first`: the sequence's first block (its
        parent is the namespace root, which its BlockStored event leaves out, as vLLM does)."""
        if not self.enable_caching:
            return False
        assert block.ref_cnt > 0, f"caching unreferenced {block}"
        if block.key is not None:
            assert block.key == key, f"{block} re-cached under a different key"
            return True
        if key in self._cached:
            return False
        block.key, block.parent_key, block.token_ids = key, parent_key, token_ids
        self._cached[key] = block
        self.cache_version += 1
        if self.events is not None:
            self.events.stored(key, None if first else parent_key, token_ids)
        return True

    def take_evicted(self) -> list[EvictedBlock]:
        """The cached blocks reused since the last call, in eviction order (only with record_evictions)."""
        out, self._evicted = self._evicted, []
        return out

    def uncache(self, block: KVCacheBlock) -> None:
        """Forget a block's key (e.g. its KV failed to load and holds garbage)."""
        self._evict(block)

    def take_events(self) -> list[KVEvent]:
        """The KV events since the last call (none without an event log)."""
        return self.events.take() if self.events is not None else []

    def _evict(self, block: KVCacheBlock, announce: bool = True) -> None:
        if block.key is not None:
            if self._cached.get(block.key) is block:
                del self._cached[block.key]
                if announce and self.events is not None:
                    self.events.removed(block.key)
            block.key = block.parent_key = block.token_ids = None
            block.reused = False
            self.cache_version += 1

    def reset_prefix_cache(self) -> None:
        for block in list(self._cached.values()):
            self._evict(block, announce=False)
        if self.events is not None:
            self.events.cleared()

    # -- invariants -------------------------------------------------------------------------------------------
    def stats(self) -> BlockPoolStats:
        used = sum(1 for b in self.blocks if b.ref_cnt > 0)
        return BlockPoolStats(self.num_blocks, len(self._free), len(self._cached), used)

    def check_integrity(self, expected_refs: dict[int, int] | None = None) -> None:
        """free + used == total, free blocks have no references, the cache map points at blocks holding
        that key; with `expected_refs` (block id → references held by live requests), ref counts match."""
        used = [b for b in self.blocks if b.ref_cnt > 0]
        assert all(b.ref_cnt >= 0 for b in self.blocks), "negative ref count"
        assert len(self._free) + len(used) == self.num_blocks, (
            f"free {len(self._free)} + used {len(used)} != total {self.num_blocks}"
        )
        for bid, block in self._free.items():
            assert block.block_id == bid and block.ref_cnt == 0, f"free queue holds {block}"
        cached_free = sum(1 for b in self._free.values() if b.key is not None)
        cached_used = sum(1 for b in used if b.key is not None)
        empty = len(self._free) - cached_free
        # The three disjoint states of a block: free and empty, free but still cached (evictable), in use.
        assert empty + cached_free + len(used) == self.num_blocks, (
            f"free {empty} + cached {cached_free} + used {len(used)} != total {self.num_blocks}"
        )
        assert cached_free + cached_used == len(self._cached), (
            f"cached free {cached_free} + cached used {cached_used} != cache map {len(self._cached)}"
        )
        for key, block in self._cached.items():
            assert block.key == key, f"cache map key mismatch for {block}"
        if expected_refs is not None:
            for block in self.blocks:
                want = expected_refs.get(block.block_id, 0)
                assert block.ref_cnt == want, f"{block}: ref_cnt {block.ref_cnt}, live requests hold {want}"
