"""DENSITY: prefix-aware eviction by learned hit density, for KV blocks that are reused as chains.

1. Chains lose their tails first. Only *leaves* (blocks that no resident block names as its parent) are
   candidates, so a block that a deeper resident block depends on stays. A block whose parent left anyway
   (removed, found corrupt, or evicted while every leaf was pinned) is an *orphan*: a lookup that goes through
   this tier cannot reach it, so it goes first. It may still be reachable another way (its parent on disk, or
   in the engine's own prefix cache): an orphan that is read again, or whose parent comes back, is kept as
   any other block.
2. Which leaf goes is learned. Blocks are classed by how often they were hit (0, 1, 2, 3+; counted across
   evictions, the model remembers ghosts), and the leaf with the lowest value per byte goes, its value being
   its class's Gittins index at its age (`ucm.eviction.reuse_model`). Within a class that is the oldest leaf,
   so before the model has data (every value 0) the order is LRU's over leaves.

Why hit counts (measured on the sampled Mooncake conversation trace, docs/benchmarks.md): a block never hit
since it was stored is used again with probability 0.26, one hit once 0.44, twice 0.56, three times or more
0.80, and the hot ones come back sooner (a median 857 new blocks later, against 1,952). Depth, position in
the request, and first request against continuation separate far less (0.16 to 0.40).

Costs: O(log n) per operation (two heaps per class, stale entries skipped lazily and compacted). Memory is
O(resident blocks): per block its record, at most 2 × (2n + 1024) heap entries, and at most `GHOSTS_PER_BLOCK`
(8) ghosts per block that fits (n, or the capacity at the first block's size if more), least recently used
dropped first. Measured with tracemalloc (16-byte keys, a scan of 8-block chains, 20,000 resident): ~1.05 KB
per resident block, ~0.35-0.48 KB per ghost (key included), so ≤ ~4.9 KB per block in all, 1.4% of a 360 KiB
block (a 20 GiB tier of them: 57k blocks, ≤ 460k ghosts, ~280 MB). Why 8: unbounded, ghosts reached 13 per
block (Mooncake at 1%; the horizon allows ~16); capped at 8 the hit rates of docs/benchmarks.md move by -0.46
to +0.23 points (noise of which blocks keep their class), capped at 4 Mooncake at 1% lost 1.4 and RAG at 2% 2.3.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from ucm.eviction.base import PolicyName, check_capacity, check_size
from ucm.eviction.reuse_model import ReuseModel

HIT_CLASSES = 4  # classes 0, 1, 2 hits, and 3 or more
_COMPACT_SLACK = 1024
GHOSTS_PER_BLOCK = 8  # the cap on the model's ghosts, per block the cache holds (module docstring)


@dataclass(slots=True)
class _Block:
    size: int
    hits: int
    ts: int  # the clock at its last use
    parent: Hashable | None  # as the tier named it; linked while resident here
    orphan: bool = False

    @property
    def cls(self) -> int:
        return min(self.hits, HIT_CLASSES - 1)


class DensityPolicy:
    name = PolicyName.DENSITY

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = check_capacity(capacity_bytes)
        self.used_bytes = 0
        self._blocks: dict[Hashable, _Block] = {}
        # parent key -> resident blocks naming it: its children if it is resident, else blocks waiting for it.
        self._kids: dict[Hashable, set[Hashable]] = {}
        self._orphans: OrderedDict[Hashable, None] = OrderedDict()
        # Leaves per class, as (ts, seq, key), oldest first and newest first (-ts): a class's value is a curve over
        # age that mostly falls or, where reuse comes at a typical age, first rises, so its lowest point among
        # the leaves is nearly always at the oldest or at the newest one. Stale entries are skipped lazily.
        self._oldest: list[list[tuple[int, int, Hashable]]] = [[] for _ in range(HIT_CLASSES)]
        self._newest: list[list[tuple[int, int, Hashable]]] = [[] for _ in range(HIT_CLASSES)]
        self._seq = itertools.count()  # ties never compare keys
        self._now = 0  # one tick per insert or touch
        self._model: ReuseModel | None = None  # sized from the first block

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._blocks

    def admit(self, key: Hashable, size: int) -> bool:
        check_size(size)
        return True

    def insert(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        check_size(size)
        block = self._blocks.get(key)
        if block is not None:  # a rewrite of a block we hold: a use with the new size
            self.used_bytes += size - block.size
            block.size = size
            self.touch(key)
            return
        if self._model is None:
            self._model = ReuseModel(HIT_CLASSES, max(1, self.capacity_bytes // max(size, 1)))
        self._now += 1
        earlier = self._model.end(key, self._now)  # a ghost: back within the horizon
        block = _Block(size, 0 if earlier is None else earlier + 1, self._now, None if parent == key else parent)
        self._blocks[key] = block
        self.used_bytes += size
        if block.parent is not None:
            self._kids.setdefault(block.parent, set()).add(key)
        for kid in self._kids.get(key, ()):  # blocks that were waiting for this parent
            self._adopt(kid)
        self._used(key, block)

    def touch(self, key: Hashable) -> None:
        block = self._blocks.get(key)
        if block is None:
            return
        assert self._model is not None, "a tracked block implies a model"
        self._now += 1
        self._model.end(key, self._now)
        block.hits += 1
        block.ts = self._now
        self._adopt(key)  # read again: reachable after all
        self._used(key, block)

    def remove(self, key: Hashable) -> None:
        if key in self._blocks:
            self._drop(key)
        if self._model is not None:
            self._model.forget(key)

    def evicted(self, key: Hashable) -> None:
        """Another policy (Adaptive's leader) evicted `key`: drop it as an eviction, so that the model keeps
        following it as a ghost and learns from its fate, unlike `remove`."""
        if key in self._blocks:
            self._evicted(key)

    def evict(self, can_evict: Callable[[Hashable], bool]) -> Hashable | None:
        victim = next((key for key in self._orphans if can_evict(key)), None)
        if victim is None:
            victim = self._cheapest_leaf(can_evict)
        if victim is None:  # every leaf is pinned: take any block, oldest first
            victim = min((k for k in self._blocks if can_evict(k)), key=lambda k: self._blocks[k].ts, default=None)
            if victim is None:
                return None
        self._evicted(victim)
        return victim

    def ghosts(self) -> int:
        """Evicted keys the model still follows (for tests and debugging)."""
        return 0 if self._model is None else self._model.ghosts

    def heap_entries(self) -> int:
        """Entries in the leaf heaps, stale ones included (for tests and debugging)."""
        return sum(map(len, self._oldest)) + sum(map(len, self._newest))

    def orphans(self) -> list[Hashable]:
        """Blocks whose parent left this tier, next victim first (for tests and debugging)."""
        return list(self._orphans)

    def hits(self, key: Hashable) -> int:
        """Hits of a tracked block, counting those before it was last evicted (for tests and debugging)."""
        return self._blocks[key].hits

    # -- internals -----------------------------------------------------------------------------------

    def _used(self, key: Hashable, block: _Block) -> None:
        assert self._model is not None, "a tracked block implies a model"
        self._model.start(key, block.cls, block.hits, self._now)
        self._push(key, block)
        self._model.advance(self._now)
        # Both heaps: reads drain the stale entries at the top only, so the newest-first heaps would keep
        # every older stale entry (one per use) forever.
        stale_bound = 2 * len(self._blocks) + _COMPACT_SLACK
        if sum(map(len, self._oldest)) > stale_bound or sum(map(len, self._newest)) > stale_bound:
            self._compact()

    def _evicted(self, key: Hashable) -> None:
        self._drop(key)
        assert self._model is not None, "a tracked block implies a model"
        # Proportional to the resident blocks, or to the blocks that fit at the first block's size, so that
        # a cache emptied by evictions (or by removes) still remembers what it just held.
        self._model.left(key, self._now, GHOSTS_PER_BLOCK * max(len(self._blocks), self._model.entries))

    def _is_leaf(self, key: Hashable, block: _Block) -> bool:
        return not block.orphan and not self._kids.get(key)

    def _push(self, key: Hashable, block: _Block) -> None:
        if self._is_leaf(key, block):
            seq = next(self._seq)
            heapq.heappush(self._oldest[block.cls], (block.ts, seq, key))
            heapq.heappush(self._newest[block.cls], (-block.ts, seq, key))

    def _valid(self, cls: int, ts: int, key: Hashable) -> bool:
        block = self._blocks.get(key)
        return block is not None and block.ts == ts and block.cls == cls and self._is_leaf(key, block)

    def _adopt(self, key: Hashable) -> None:
        block = self._blocks[key]
        if block.orphan:
            block.orphan = False
            del self._orphans[key]
            self._push(key, block)

    def _cheapest_leaf(self, can_evict: Callable[[Hashable], bool]) -> Hashable | None:
        best: tuple[float, int, Hashable] | None = None  # (value per byte, ts, key)
        for cls in range(HIT_CLASSES):
            for heap, sign in ((self._oldest[cls], 1), (self._newest[cls], -1)):
                found = self._top(cls, heap, sign, can_evict)
                if found is not None:
                    assert self._model is not None, "a tracked block implies a model"
                    ts, key = found
                    value = self._model.value(cls, self._now - ts) / max(self._blocks[key].size, 1)
                    if best is None or (value, ts) < best[:2]:
                        best = (value, ts, key)
        return None if best is None else best[2]

    def _top(
        self, cls: int, heap: list[tuple[int, int, Hashable]], sign: int, can_evict: Callable[[Hashable], bool]
    ) -> tuple[int, Hashable] | None:
        """(ts, key) of the first valid, evictable entry of `heap`, left in place; stale entries are dropped."""
        pinned = []
        found = None
        while heap:
            signed_ts, _, key = heap[0]
            if not self._valid(cls, sign * signed_ts, key):
                heapq.heappop(heap)
            elif not can_evict(key):
                pinned.append(heapq.heappop(heap))
            else:
                found = (sign * signed_ts, key)
                break
        for item in pinned:
            heapq.heappush(heap, item)
        return found

    def _drop(self, key: Hashable) -> None:
        block = self._blocks.pop(key)
        self.used_bytes -= block.size
        if block.orphan:
            del self._orphans[key]
        if block.parent is not None:
            siblings = self._kids[block.parent]
            siblings.discard(key)
            if not siblings:
                del self._kids[block.parent]
                parent = self._blocks.get(block.parent)
                if parent is not None:
                    self._push(block.parent, parent)  # a leaf now: a candidate again
        for kid in self._kids.get(key, ()):  # they stay named as waiting, in case this block comes back
            child = self._blocks[kid]
            if not child.orphan:
                child.orphan = True
                self._orphans[kid] = None

    def _compact(self) -> None:
        self._oldest = [[] for _ in range(HIT_CLASSES)]
        self._newest = [[] for _ in range(HIT_CLASSES)]
        for key, block in self._blocks.items():
            if self._is_leaf(key, block):
                seq = next(self._seq)
                self._oldest[block.cls].append((block.ts, seq, key))
                self._newest[block.cls].append((-block.ts, seq, key))
        for heap in self._oldest + self._newest:
            heapq.heapify(heap)
