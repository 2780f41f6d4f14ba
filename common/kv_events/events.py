"""The KV cache events, declared as vLLM 0.32 declares them (vllm/distributed/kv_events.py), so that either side's
msgspec decoder reads the other's bytes.

On the wire (msgpack):
    batch   [ts, events, data_parallel_rank]                 array_like; a rank of None is left out
    event   {"type": "BlockStored", "block_hashes": [...], ...}
            a map tagged by its class name, fields in declaration order, optional fields at their default left out

vLLM before 0.11 sent each event as a positional array, `["BlockStored", block_hashes, parent_block_hash, ...]`;
`codec.py` reads both. Field order and names below are vLLM's: a field is only ever appended, never moved.

Block hashes are our chained block keys (`common.keys`: 16 bytes, msgpack bin). vLLM 0.32 types them
`bytes | int` (ExternalBlockHash); its engine sends ints or bytes depending on its hash function.

`medium` names the tier that holds (or dropped) the blocks, in vLLM's words:

    our tier                                   medium     vLLM's meaning
    device (a node's paged KV cache)           "GPU"      the engine's own KV cache (vLLM's CPU backend says GPU too)
    store DRAM tier (ucm `Tier.DRAM`)          "CPU"      host-memory offload (vLLM's CPU offloading connector)
    store disk tier (ucm `Tier.DISK`, LMDB)    "STORAGE"  file-system / object offload
"""

from __future__ import annotations

from typing import Any

import msgspec

BlockHash = bytes | int  # vLLM's ExternalBlockHash: our keys are bytes; vLLM's engine may send ints

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"

# Our tier names (a node's device cache; `ucm.api.Tier` values) -> vLLM's medium strings.
DEVICE_TIER = "device"
TIER_MEDIUM: dict[str, str] = {DEVICE_TIER: MEDIUM_GPU, "dram": MEDIUM_CPU, "disk": MEDIUM_STORAGE}


def medium_of(tier: str) -> str:
    """vLLM's medium string for one of our tiers ("device", "dram", "disk"); ValueError for another name."""
    try:
        return TIER_MEDIUM[tier]
    except KeyError:
        raise ValueError(f"no KV event medium for tier {tier!r} (known: {', '.join(TIER_MEDIUM)})") from None


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float  # time.time() when the batch was made
    events: list[Any]
    data_parallel_rank: int | None = None  # the publisher fills in its rank (ours: 0)


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the three events; tagged by class name under the key "type"."""


class BlockStored(KVCacheEvent):
    """Blocks that entered `medium`: `block_hashes` chain, each the child of the one before it, the first a child of
    `parent_block_hash` (None: the first block of a prompt); `token_ids` are all their tokens, block after block."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None  # vLLM keeps it for old consumers; we serve no LoRA: None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks that left `medium` (evicted, reused for other tokens, or found unusable)."""

    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """The publisher's cache was reset: forget every block it announced."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
EVENT_TYPES: dict[str, type[KVEvent]] = {cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared)}


class KVEventBatch(EventBatch):
    events: list[KVEvent]


def block_stored(
    keys: list[bytes], parent: bytes | None, token_ids: list[int], block_size: int, medium: str = MEDIUM_GPU
) -> BlockStored:
    """A BlockStored with the fields we fill (no LoRA, no extra keys)."""
    return BlockStored(
        block_hashes=list(keys),
        parent_block_hash=parent,
        token_ids=token_ids,
        block_size=block_size,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )
