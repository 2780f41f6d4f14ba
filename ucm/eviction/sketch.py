"""A count-min sketch of 4-bit counters with a doorkeeper: TinyLFU's frequency memory (Einziger et al.).

The doorkeeper (a small Bloom filter) absorbs each key's first sighting, so the long tail of one-hit
blocks never touches the counters. After `sample_size` recorded events every counter is halved and the
doorkeeper cleared, so popularity ages out. Hashing is xxh3 of the key's bytes, never Python's `hash`
(randomised per process), so estimates are identical across runs.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np
import xxhash

DEPTH = 4
MAX_COUNT = 15  # four bits


def key_bytes(key: Hashable) -> bytes:
    """Stable bytes for a key: block keys are bytes already; ints and strings get a fixed encoding."""
    if isinstance(key, bytes):
        return key
    if isinstance(key, int) and -(2**63) <= key < 2**63:
        return key.to_bytes(8, "little", signed=True)
    if isinstance(key, str):
        return key.encode("utf-8")
    return repr(key).encode("utf-8")


class FrequencySketch:
    def __init__(self, expected_entries: int) -> None:
        if expected_entries <= 0:
            raise ValueError(f"expected_entries must be positive, got {expected_entries}")
        # ~8 counters per expected entry keeps over-estimates rare; a power of two makes indexing a mask.
        self.width = 1 << max(6, (8 * expected_entries - 1).bit_length())
        self._mask = self.width - 1
        self._rows = [bytearray(self.width) for _ in range(DEPTH)]
        self._door = bytearray(self.width)
        self.sample_size = 10 * expected_entries
        self.additions = 0

    def _indices(self, key: Hashable) -> list[int]:
        h = xxhash.xxh3_64_intdigest(key_bytes(key))
        h1, h2 = h & 0xFFFFFFFF, (h >> 32) | 1
        return [(h1 + i * h2) & self._mask for i in range(DEPTH)]

    def estimate(self, key: Hashable) -> int:
        idx = self._indices(key)
        in_door = self._door[idx[0]] and self._door[idx[1]]
        return min(row[i] for row, i in zip(self._rows, idx)) + (1 if in_door else 0)

    def increment(self, key: Hashable) -> None:
        idx = self._indices(key)
        if not (self._door[idx[0]] and self._door[idx[1]]):
            self._door[idx[0]] = self._door[idx[1]] = 1
        else:
            # Conservative update: raise only the counters at the minimum (fewer over-estimates).
            low = min(row[i] for row, i in zip(self._rows, idx))
            if low < MAX_COUNT:
                for row, i in zip(self._rows, idx):
                    if row[i] == low:
                        row[i] = low + 1
        self.additions += 1
        if self.additions >= self.sample_size:
            self._age()

    def _age(self) -> None:
        for row in self._rows:
            view = np.frombuffer(row, dtype=np.uint8)
            np.right_shift(view, 1, out=view)
        self._door[:] = bytes(self.width)
        self.additions //= 2
