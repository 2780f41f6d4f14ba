"""DENSITY: prefix-aware eviction by learned hit density, for KV blocks that are reused as chains.

1. Chains lose their tails first. Only *leaves* (blocks that no resident block names as its parent) are
   candidates, so a block that a deeper resident block depends on stays. A block whose parent left anyway
   (removed, found corrupt, or evicted while every leaf was pinned) is an *orphan*: a lookup that goes through
   this tier cannot reach it, so it goes first. It may still be reachable another way (its parent on disk, or
   in the engine's own prefix cache): an orphan that is read again, or whose parent comes back, is kept as
   any other block.
2. Which leaf goes is learned. Blocks are classed by how often they were hit (1, 2, 3+; counted across
   evictions, the model remembers ghosts) and, never hit, by where they sit: their depth in the chain (under 8,
   16, 32 blocks, or deeper) and whether the request that stored them continued an earlier one (the first hit
   block above them was hit once or twice: a follow-up turn) or not (a new prompt under a hot shared prefix, or
   none). The leaf with the lowest value per byte goes, its value being its class's Gittins index at its age
   (`ucm.eviction.reuse_model`). Within a class that is the oldest leaf, so before the model has data (every
   value 0) the order is LRU's over leaves.

Why these classes (measured on the tuning half of the conversation trace, benchmarks/trace_suite.py): a block
hit once is used again with probability 0.44, twice 0.56, three times or more 0.80, and the hot ones come back
sooner. Of never-hit blocks, what comes back is the tail of a conversation whose user sends another turn: of
first turns, 0.41 of those under 8 blocks and 0.24 of those over 48; of follow-ups 0.56 and 0.40. The depth and
lineage classes were chosen on that half alone; on the traces held out from it they took the share of the
LRU→MIN gap closed from 18.8% to 24.7% (docs/benchmarks.md, hit_rate_suite).

A chain is stored deepest block first, so a block's depth and lineage are known only once the block above it
arrives: blocks wait *unanchored* until then, and the arrival of the request's shallowest new block (whose parent
is resident, or who has none) anchors the chain below it in one pass, O(new blocks) per request.

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

DEPTHS = (8, 16, 32)  # never-hit blocks are classed by depth below these, in blocks
LINEAGES = 2  # ... and by whether they continued a request: 0 no (or under a hot shared prefix), 1 yes
NEVER_HIT_CLASSES = LINEAGES * (len(DEPTHS) + 1)
HIT_CLASSES = NEVER_HIT_CLASSES + 3  # then blocks hit 1, 2, and 3 or more times
_COMPACT_SLACK = 1024
GHOSTS_PER_BLOCK = 8  # the cap on the model's ghosts, per block the cache holds (module docstring)


@dataclass(slots=True)
class _Block:
    size: int
    hits: int
    ts: int  # the clock at its last use
    parent: Hashable | None  # as the tier named it; linked while resident here
    orphan: bool = False
    anchored: bool = False  # its depth and lineage are known: its parent was here and anchored when it came
    depth: int = 0
    lineage: int = 0

    @property
    def cls(self) -> int:
        if self.hits:
            return NEVER_HIT_CLASSES - 1 + min(self.hits, 3)
        return self.lineage * (len(DEPTHS) + 1) + sum(self.depth >= d for d in DEPTHS)

    def heritage(self) -> int:
        """The lineage a block stored right below this one gets: a continuation if this one was hit once or
        twice (a follow-up reached the end of its prefix here), none under a hot block (a shared prompt)."""
        if self.hits:
            return 1 if self.hits < 3 else 0
        return self.lineage


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
        # Unanchored blocks whose parent is not here: until the next block the tier hands over is not their parent
        # (then their chain starts with them, or above a block no longer held: depth 0, no lineage).
        self._tops: dict[Hashable, None] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._blocks

    def admit(self, key: Hashable, size: int) -> bool:
        check_size(size)
        return True

    def insert(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        check_size(size)
        self._settle(continuing=key)
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
        above = self._blocks.get(block.parent) if block.parent is not None else None
        if block.parent is None:
            block.anchored = True
        elif above is None:
            self._tops[key] = None  # its parent may be the next block the tier hands over
        elif above.anchored:
            block.anchored, block.depth, block.lineage = True, above.depth + 1, above.heritage()
        self._blocks[key] = block
        self.used_bytes += size
        if block.parent is not None:
            self._kids.setdefault(block.parent, set()).add(key)
        self._used(key, block)
        for kid in self._kids.get(key, ()):  # blocks that were waiting for this parent
            self._tops.pop(kid, None)
            self._adopt(kid)
        if block.anchored:
            self._anchor_below(key, block)

    def touch(self, key: Hashable) -> None:
        self._settle(continuing=None)
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

    def placement(self, key: Hashable) -> tuple[bool, int, int, int]:
        """(anchored, depth, lineage, class) of a tracked block (for tests and debugging)."""
        block = self._blocks[key]
        return block.anchored, block.depth, block.lineage, block.cls

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

    def _settle(self, continuing: Hashable | None) -> None:
        """Anchor the tops this operation does not continue (`continuing`: the key being inserted)."""
        if not self._tops:
            return
        for key in [k for k in self._tops if self._blocks[k].parent != continuing]:
            del self._tops[key]
            block = self._blocks[key]
            block.anchored = True  # depth 0, lineage 0: what it was classed as meanwhile
            self._anchor_below(key, block)

    def _anchor_below(self, key: Hashable, block: _Block) -> None:
        """Give the unanchored blocks below an anchored one their depth and lineage, reclassing their open starts
        and leaf entries; each block is anchored once, so a request's chain costs O(its blocks) in all."""
        assert self._model is not None, "a tracked block implies a model"
        stack = [(kid, block) for kid in self._kids.get(key, ())]
        while stack:
            kid_key, above = stack.pop()
            kid = self._blocks[kid_key]
            if kid.anchored:
                continue
            kid.anchored, kid.depth, kid.lineage = True, above.depth + 1, above.heritage()
            self._model.reclass(kid_key, kid.cls)
            self._push(kid_key, kid)
            stack.extend((grandkid, kid) for grandkid in self._kids.get(kid_key, ()))

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
        self._tops.pop(key, None)
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
