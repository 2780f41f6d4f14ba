"""The reuse bound (benchmarks/reuse_bound.py): the told-who-returns LRU and the follow-up census, on small
workloads whose answers are worked out by hand, and the oracle placed between LRU and MIN on a real trace."""

from __future__ import annotations

import pytest

from benchmarks.hit_rate import capacity_blocks
from benchmarks.reuse_bound import follow_ups, oracle_lru
from benchmarks.trace_suite import TraceName, load
from benchmarks.traces import default_trace_path, working_set
from ucm.eviction.belady import belady


def test_oracle_stores_only_blocks_read_again() -> None:
    # Capacity 2. Request [1, 2] is read again at the end; [3, 4] and [5, 6] never are. An LRU would have lost
    # [1, 2] to them; the oracle never stores them, so the last request hits both blocks.
    requests = [[1, 2], [3, 4], [5, 6], [1, 2]]
    assert oracle_lru(requests, 2) == 2


def test_oracle_hits_are_prefix_hits() -> None:
    requests = [[1, 2], [9, 2], [1, 2]]
    # Capacity 1: after [9, 2] only block 2 is held (9 is never read again, 1 was the least recent), so [1, 2]
    # misses at 1 and its held block 2 is no hit: a lookup stops at the first miss.
    assert oracle_lru(requests, 1) == 0
    # Capacity 3: [9, 2] misses at 9 (block 2 held but after the miss), [1, 2] hits both.
    assert oracle_lru(requests, 3) == 2
    with pytest.raises(ValueError, match="capacity"):
        oracle_lru(requests, 0)


def test_follow_ups_by_turn_and_length() -> None:
    requests = [
        [0, 1],  # conversation A, turn 0: followed
        [0, 2],  # conversation B, turn 0: never followed
        [0, 1, 3],  # A turn 1: followed
        [0],  # only the shared block: adds nothing of its own, so nothing can continue it
        [0, 1, 3, 4],  # A turn 2: the last
    ]
    fu = follow_ups(requests)
    assert [n for n, _ in fu.by_turn] == [3, 1, 1, 0]
    assert [p for _, p in fu.by_turn][:3] == pytest.approx([1 / 3, 1.0, 0.0])
    # 12 accesses, 5 distinct blocks: 7 re-read a block
    assert fu.stored_reused == pytest.approx(7 / 12)


@pytest.mark.skipif(not default_trace_path().is_file(), reason="../shared/data/traces not present")
def test_oracle_lies_between_lru_and_min_on_the_conversation_trace() -> None:
    blocks = load(TraceName.CONV_HOLDOUT).full_blocks()[:1500]
    cap = capacity_blocks(0.02, working_set(blocks))
    told = oracle_lru(blocks, cap)
    assert told <= belady(blocks, cap).prefix_hits, "no policy beats MIN"
    assert told > oracle_lru(blocks, max(1, cap // 4)), "more room, more hits"
