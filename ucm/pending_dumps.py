"""`PendingDumps`: blocks being dumped layer by layer, invisible until committed with every layer present, with
their bytes counted (part of what the store holds outside its tiers, `StoreStats.transit_bytes`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from common.keys import BlockKey
from ucm.api import BlockRef


@dataclass
class PendingBlock:
    ref: BlockRef
    payloads: list[bytes | None]
    checksums: list[int]
    created: float

    def nbytes(self) -> int:
        return sum(len(p) for p in self.payloads if p is not None)


class PendingDumps:
    """Not locked itself: the store's lock guards it (`Store._lock`)."""

    def __init__(self) -> None:
        self._blocks: dict[BlockKey, PendingBlock] = {}
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __iter__(self) -> Iterator[PendingBlock]:
        return iter(self._blocks.values())

    def get_or_start(self, ref: BlockRef, num_layers: int, now: float) -> PendingBlock:
        pending = self._blocks.get(ref.key)
        if pending is None:
            pending = self._blocks[ref.key] = PendingBlock(ref, [None] * num_layers, [0] * num_layers, now)
        return pending

    def set_layer(self, pending: PendingBlock, layer: int, payload: bytes, digest: int) -> None:
        old = pending.payloads[layer]
        self.nbytes += len(payload) - (0 if old is None else len(old))
        pending.payloads[layer] = payload
        pending.checksums[layer] = digest

    def pop(self, key: BlockKey) -> PendingBlock | None:
        pending = self._blocks.pop(key, None)
        if pending is not None:
            self.nbytes -= pending.nbytes()
        return pending
