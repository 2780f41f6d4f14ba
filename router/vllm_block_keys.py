"""`Rechain`: a KV event publisher's own block hashes turned into chained keys the router can compute from a prompt.

vLLM 0.32 names a block by its own hash (sha256 of the parent's hash, the block's tokens and extra keys, chained
from a `NONE_HASH` that is random per process unless PYTHONHASHSEED is set: vllm/v1/core/kv_cache_utils.py), and
the store daemon names the blocks the UCMConnector saved by the plugin's keys (chained from a root that includes
vLLM's version and attention ISA: connector/vllm/key_scope.py). The router can compute neither from a prompt. But
every BlockStored carries its blocks' token ids and its parent's hash, so the index re-keys each block as
`chain_key(our key of its parent, its tokens)`, chained from `VLLM_ROOT` (common/keys.py's hash), and keeps the
publisher's hash -> our key map to translate BlockRemoved. `prompt_keys` gives a prompt's keys in the same chain.

A block whose parent the map does not hold starts a chain at `VLLM_ROOT`: that is the store's first block of a
prompt (its parent is the plugin's root, which no event announces), and vLLM's (parent None). A child announced
after its parent left would be keyed as a first block too; both sides evict children before parents (vLLM frees a
request's blocks tail first, the store hands deepest first to its policies: ucm/chain_order.py), so it is rare and
only costs a routing guess, never a wrong answer. The re-keying ignores what vLLM's hash adds to the tokens (LoRA,
`cache_salt`, multimodal inputs): the router serves one model, and a guess across salts is again only a guess.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import xxhash

from common.keys import BlockKey, block_keys, chain_key
from common.kv_events.events import MEDIUM_GPU, BlockHash, BlockRemoved, BlockStored, KVEvent

VLLM_ROOT: BlockKey = xxhash.xxh3_128_digest(b"ucm-router/vllm-events-root")


def prompt_keys(token_ids: Sequence[int], block_size: int) -> list[BlockKey]:
    """The re-keyed chain of a prompt's full blocks (what `Rechain` makes of the same blocks' events)."""
    return block_keys(VLLM_ROOT, token_ids, block_size)


class Rechain:
    """One publisher's hash -> our key map, per medium (a medium's removal leaves the others' copies)."""

    def __init__(self) -> None:
        self._ours: dict[str, dict[BlockHash, BlockKey]] = {}  # medium -> publisher hash -> our key
        self._count: dict[str, Counter[BlockKey]] = {}  # medium -> our key -> publisher hashes naming it

    def event(self, event: KVEvent) -> KVEvent | None:
        """The event with our keys; None when nothing of it is left to apply (blocks already held under another of
        the publisher's hashes, or removals of blocks another hash still holds)."""
        if isinstance(event, BlockStored):
            return self._stored(event)
        if isinstance(event, BlockRemoved):
            return self._removed(event)
        self._ours.clear()  # AllBlocksCleared
        self._count.clear()
        return event

    def _parent(self, parent: BlockHash | None) -> BlockKey:
        if parent is not None:
            for ours in self._ours.values():
                key = ours.get(parent)
                if key is not None:
                    return key
        return VLLM_ROOT

    def _stored(self, event: BlockStored) -> BlockStored | None:
        medium = event.medium or MEDIUM_GPU
        ours = self._ours.setdefault(medium, {})
        count = self._count.setdefault(medium, Counter())
        size = event.block_size
        key = self._parent(event.parent_block_hash)
        new: list[BlockHash] = []
        for i, theirs in enumerate(event.block_hashes):
            tokens = event.token_ids[i * size : (i + 1) * size]
            if size <= 0 or len(tokens) < size:
                break  # a malformed event: its blocks past the tokens it carries cannot be keyed
            key = chain_key(key, tokens)
            if theirs in ours:
                continue  # announced again (vLLM re-announces a block it stores twice): already counted
            ours[theirs] = key
            count[key] += 1
            if count[key] == 1:
                new.append(key)
        if not new:
            return None
        return BlockStored(
            block_hashes=new,
            parent_block_hash=None,
            token_ids=[],
            block_size=size,
            lora_id=None,
            medium=event.medium,
            lora_name=None,
        )

    def _removed(self, event: BlockRemoved) -> BlockRemoved | None:
        medium = event.medium or MEDIUM_GPU
        ours = self._ours.get(medium, {})
        count = self._count.get(medium, Counter())
        gone: list[BlockHash] = []
        for theirs in event.block_hashes:
            key = ours.pop(theirs, None)
            if key is None:
                continue
            count[key] -= 1
            if count[key] <= 0:
                del count[key]
                gone.append(key)
        return BlockRemoved(block_hashes=gone, medium=event.medium) if gone else None
