"""Bit rot on purpose: flip bytes of chosen stored blocks in the store's LMDB file while the daemon is down.

The bytes are flipped in `data.mdb` itself (not through an LMDB write), inside a block's payload, where only
the store's per-layer checksum can notice; LMDB's own pages stay intact. A block is chosen by the token ids it
holds (the record header names them), so a caller picks "blocks 1 and 3 of this prompt" without key math.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import lmdb

from ucm.record import RecordError, decode_header

_PROBE_BYTES = 64  # a slice this long from a payload's middle is unique in the file in practice


def _probe(value: bytes, payload_at: int) -> bytes:
    """A slice of the payload varied enough to occur nowhere else in the file (not a run of zeros)."""
    for at in range(payload_at + (len(value) - payload_at) // 2, len(value) - _PROBE_BYTES, 997):
        probe = bytes(value[at : at + _PROBE_BYTES])
        if len(set(probe)) >= _PROBE_BYTES // 2:
            return probe
    raise AssertionError("no varied slice in the block's payload")


def flip_blocks(db_dir: str | Path, token_blocks: Sequence[Sequence[int]]) -> list[bytes]:
    """Flip one byte in the stored payload of each block whose token ids are in `token_blocks`; returns the
    keys of the blocks flipped. The daemon must not be running."""
    db_dir = Path(db_dir)
    wanted = {tuple(block) for block in token_blocks}
    targets: list[tuple[bytes, bytes]] = []  # (key, probe slice)
    env = lmdb.open(str(db_dir), readonly=True, lock=False)
    try:
        with env.begin() as txn:
            for key, value in txn.cursor():
                try:
                    header, offset = decode_header(value)
                except (RecordError, ValueError):
                    continue
                if header.token_ids in wanted:
                    targets.append((bytes(key), _probe(value, offset)))
    finally:
        env.close()
    data_file = db_dir / "data.mdb"
    raw = bytearray(data_file.read_bytes())
    flipped = []
    for key, probe in targets:
        at = raw.find(probe)
        hits = 0
        while at >= 0:  # every copy: a freed page may still hold an old one
            raw[at + _PROBE_BYTES // 2] ^= 0x5A
            hits += 1
            at = raw.find(probe, at + 1)
        assert 1 <= hits <= 2, f"block {key.hex()}: its payload slice occurs {hits} times in {data_file}"
        flipped.append(key)
    data_file.write_bytes(bytes(raw))
    return flipped
