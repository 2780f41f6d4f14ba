"""Shared-prefix groups of waiting sequences and their tokens per sequence (the CACHE_AWARE admission order)."""

from __future__ import annotations

import pytest

from common.keys import KeyNamespace, chain_key, root_key
from engine.prefix_groups import Waiting, shared_blocks, tokens_per_sequence

BS = 4
ROOT = root_key(KeyNamespace("test-model", "float32", BS))


def keys(tokens: list[int]) -> list:
    out = []
    for i in range(len(tokens) // BS):
        out.append(chain_key(out[-1] if out else ROOT, tokens[i * BS : (i + 1) * BS]))
    return out


def waiting(rid: str, tokens: list[int], computed: int = 0) -> Waiting:
    return Waiting(rid, keys(tokens), len(tokens), computed)


def test_shared_blocks_counts_the_common_leading_blocks():
    base = list(range(1, 25))  # 6 blocks
    for diverge in range(0, 25):
        other = base[:diverge] + [999] + base[diverge + 1 :]
        assert shared_blocks(keys(base), keys(other)) == diverge // BS, diverge
    assert shared_blocks(keys(base), keys(base)) == 6
    assert shared_blocks(keys(base), keys(base[:9])) == 2, "a shorter sequence shares at most its full blocks"
    assert shared_blocks([], keys(base)) == 0


def test_a_group_costs_its_leader_whole_and_its_followers_their_own_tokens():
    shared = list(range(1, 9))  # 2 blocks
    cost = tokens_per_sequence(
        [
            waiting("lead", shared + [20, 21, 22, 23]),
            waiting("f1", shared + [30, 31, 32, 33]),
            waiting("f2", shared + [40, 41]),  # 10 tokens: its last block is partial
            waiting("alone", [7, 7, 7, 7, 7, 7, 7]),
        ],
        BS,
    )
    assert cost == {"lead": (12 + 4 + 2) / 3, "f1": 6.0, "f2": 6.0, "alone": 7.0}


def test_what_is_cached_counts_and_a_follower_always_computes_a_token():
    shared = list(range(1, 9))
    # The leader has its first block cached; the follower is all shared (it still computes its last token).
    cost = tokens_per_sequence(
        [waiting("lead", shared + [20, 21, 22, 23], computed=4), waiting("f", shared, computed=4)], BS
    )
    assert cost == {"lead": (8 + 1) / 2, "f": (8 + 1) / 2}
    # A sequence with only a partial block left to compute is a group of its own.
    assert tokens_per_sequence([waiting("p", shared + [5, 6], computed=8)], BS) == {"p": 2}


def test_bad_block_size_is_a_value_error():
    with pytest.raises(ValueError, match="block_size"):
        tokens_per_sequence([], 0)
