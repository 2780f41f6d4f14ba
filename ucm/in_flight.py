"""`InFlight`: committed blocks handed to the write-behind and not yet on disk, with their bytes counted.

They stay visible (loads serve them like DRAM) until the write lands; their bytes are part of what the store holds
outside its tiers (`StoreStats.transit_bytes`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from common.keys import BlockKey
from ucm.record import BlockRecord


class InFlight(Mapping[BlockKey, BlockRecord]):
    """Not locked itself: the store's lock guards it (`Store._lock`, `StoreTiers.lock`)."""

    def __init__(self) -> None:
        self._records: dict[BlockKey, BlockRecord] = {}
        self.nbytes = 0

    def __getitem__(self, key: BlockKey) -> BlockRecord:
        return self._records[key]

    def __iter__(self) -> Iterator[BlockKey]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def put(self, record: BlockRecord) -> None:
        self.pop(record.key)
        self._records[record.key] = record
        self.nbytes += record.nbytes

    def pop(self, key: BlockKey) -> BlockRecord | None:
        record = self._records.pop(key, None)
        if record is not None:
            self.nbytes -= record.nbytes
        return record
