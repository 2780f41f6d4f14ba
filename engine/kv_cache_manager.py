"""Which device blocks each sequence owns: prefix-cache matching, slot allocation, copy-on-write, freeing.

The scheduler talks only to this class; `BlockPool` below it knows nothing about requests."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from common.kv_events.events import KVEvent
from engine.block_pool import BlockPool, EvictedBlock, KVCacheBlock
from engine.kv_event_log import KVEventLog
from engine.request import Request


@dataclass(frozen=True)
class PrefixMatch:
    """Leading full blocks of a request found in the device prefix cache."""

    blocks: list[KVCacheBlock] = field(default_factory=list)
    num_tokens: int = 0


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        record_evictions: bool = False,
        record_events: bool = False,
    ) -> None:
        """`record_events`: the block pool logs vLLM's KV events (`take_events`, once per step)."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        events = KVEventLog(block_size) if record_events else None
        self.pool = BlockPool(num_blocks, enable_caching, record_evictions, events)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are registered in the prefix cache.
        self._num_cached_blocks: dict[str, int] = {}
        # Copy-on-write block copies (src, dst) the runner must apply before the next forward.
        self.pending_copies: list[tuple[int, int]] = []

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    # -- prefix cache -----------------------------------------------------------------------------------
    @property
    def cache_version(self) -> int:
        """Changes whenever the prefix cache does: `get_computed_blocks` answers the same until it changes."""
        return self.pool.cache_version

    def get_computed_blocks(self, request: Request) -> PrefixMatch:
        """Longest cached prefix, leaving at least one token to compute (its logits give the next token).

        Every block may hit, the last too: a block-aligned sequence found whole then computes only its last token,
        into a copy of the last block (allocate_slots), not that block's every token. On a repeated 2048-token
        prompt that is 1 row through the model instead of 16 (what the connector does for a store hit)."""
        if not self.enable_caching:
            return PrefixMatch()
        max_blocks = min(request.num_tokens // self.block_size, len(request.block_keys))
        hits: list[KVCacheBlock] = []
        for i in range(max_blocks):
            block = self.pool.lookup(request.block_keys[i], request.block_parent_key(i), request.block_token_ids(i))
            if block is None:
                break
            hits.append(block)
        return PrefixMatch(hits, min(len(hits) * self.block_size, request.num_tokens - 1) if hits else 0)

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's blocks that are now full and computed."""
        if not self.enable_caching:
            return
        blocks = self.req_blocks[request.request_id]
        start = self._num_cached_blocks.get(request.request_id, 0)
        end = min(request.num_computed_tokens // self.block_size, len(request.block_keys), len(blocks))
        for i in range(start, end):
            self.pool.cache_block(
                blocks[i], request.block_keys[i], request.block_parent_key(i), request.block_token_ids(i), first=i == 0
            )
        self._num_cached_blocks[request.request_id] = max(start, end)

    def uncache_from(self, request: Request, first_block: int) -> None:
        """Drop the prefix-cache keys of the request's blocks from `first_block` on (their KV is garbage)."""
        blocks = self.req_blocks.get(request.request_id, [])
        for block in blocks[first_block:]:
            self.pool.uncache(block)
        rid = request.request_id
        self._num_cached_blocks[rid] = min(self._num_cached_blocks.get(rid, 0), first_block)

    # -- allocation -----------------------------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        prefix: PrefixMatch | None = None,
        num_external_tokens: int = 0,
    ) -> list[int] | None:
        """Blocks for the request's computed tokens (its own, `prefix` hits and `num_external_tokens` the
        connector will load) plus `num_new_tokens` to compute. None (and nothing changes) if too few are free."""
        rid = request.request_id
        owned = self.req_blocks.get(rid, [])
        hits = prefix.blocks if prefix is not None else []
        assert not (owned and hits), f"{rid}: prefix hits for a request that already owns blocks"
        num_computed = request.num_computed_tokens + (prefix.num_tokens if prefix else 0)
        total = num_computed + num_external_tokens + num_new_tokens
        num_new_blocks = max(0, self.blocks_needed(total) - len(owned) - len(hits))
        cow_index = self._cow_index(owned + hits, num_computed) if num_new_tokens > 0 else None
        evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if num_new_blocks + (cow_index is not None) > self.pool.num_free_blocks - evictable_hits:
            return None
        self.pool.touch(hits)
        owned = owned + hits + self.pool.get_new_blocks(num_new_blocks)
        if cow_index is not None:
            src = owned[cow_index]
            (dst,) = self.pool.get_new_blocks(1)
            owned[cow_index] = dst
            self.pool.free_blocks([src])
            self.pending_copies.append((src.block_id, dst.block_id))
        self.req_blocks[rid] = owned
        if hits:
            self._num_cached_blocks[rid] = len(hits)
        return [b.block_id for b in owned]

    def _cow_index(self, blocks: list[KVCacheBlock], num_computed: int) -> int | None:
        """The next write lands inside a block that another sequence shares or the prefix cache holds (a whole
        hit whose last token is recomputed) → copy it first."""
        index = num_computed // self.block_size
        if num_computed % self.block_size and index < len(blocks):
            block = blocks[index]
            if block.ref_cnt > 1 or block.key is not None:
                return index
        return None

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent (copy-on-write on its first write)."""
        blocks = list(self.req_blocks[parent.request_id])
        self.pool.touch(blocks)
        self.req_blocks[child.request_id] = blocks
        self._num_cached_blocks[child.request_id] = self._num_cached_blocks.get(parent.request_id, 0)

    def free(self, request: Request) -> None:
        blocks = self.req_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        # Tail first: the end of a sequence is the least likely to be shared, so it is evicted first.
        self.pool.free_blocks(list(reversed(blocks)))

    def take_evicted(self) -> list[EvictedBlock]:
        return self.pool.take_evicted()

    def take_events(self) -> list[KVEvent]:
        return self.pool.take_events()

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    # -- invariants ---------------------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        refs = Counter(b.block_id for blocks in self.req_blocks.values() for b in blocks)
        self.pool.check_integrity(dict(refs))
