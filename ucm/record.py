"""The byte format of one stored block, identical in DRAM (header + per-layer buffers) and on disk (joined).

    fixed   "<4sHHII16s16s": magic b"UCMB", format version, num_layers, num_tokens, committed_s, key, parent
    tokens  num_tokens x u32 little-endian
    sizes   num_layers x u64   payload bytes of each layer (that layer's K then V, laid out by the caller)
    sums    num_layers x u64   xxh3-64 of each layer's payload
    hsum    u64                xxh3-64 of every header byte before it
    payload layer 0 ‖ layer 1 ‖ ...

`committed_s` (Unix seconds) lets a reopened disk tier rebuild its recency order.
The header repeats the key, parent and token ids so that a read can refuse a block whose key collided
with the caller's (DESIGN.md §3), and every payload carries its own checksum so a flipped bit is a miss.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from common.keys import KEY_NBYTES, BlockKey
from ucm.api import BlockRef

MAGIC = b"UCMB"
FORMAT_VERSION = 1
_FIXED = struct.Struct("<4sHHII16s16s")
_U64 = struct.Struct("<Q")
MAX_LAYERS = 4096
MAX_TOKENS = 1 << 20

Buffer = bytes | bytearray | memoryview


class RecordError(ValueError):
    """The bytes are not a well-formed block record (truncated, wrong magic, bad header checksum...)."""


class RecordMismatch(RecordError):
    """A well-formed record of another block (same key, different parent or token ids: a collision)."""


def checksum(payload: Buffer) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def as_bytes_view(data: object) -> memoryview:
    """A flat byte view of any C-contiguous buffer (bytes, bytearray, numpy array, memoryview)."""
    view = memoryview(data)  # type: ignore[arg-type]
    if not view.c_contiguous:
        raise ValueError("payload buffers must be C-contiguous")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


@dataclass(frozen=True)
class RecordHeader:
    key: BlockKey
    parent: BlockKey
    token_ids: tuple[int, ...]
    payload_sizes: tuple[int, ...]
    checksums: tuple[int, ...]
    committed_s: int = 0

    def __post_init__(self) -> None:
        if len(self.key) != KEY_NBYTES or len(self.parent) != KEY_NBYTES:
            raise ValueError(f"key and parent must be {KEY_NBYTES} bytes")
        if len(self.payload_sizes) != len(self.checksums) or not 0 < len(self.payload_sizes) <= MAX_LAYERS:
            raise ValueError(f"need 1..{MAX_LAYERS} layers with one checksum each")
        if len(self.token_ids) > MAX_TOKENS:
            raise ValueError(f"at most {MAX_TOKENS} tokens per block")

    @property
    def num_layers(self) -> int:
        return len(self.payload_sizes)

    def matches(self, ref: BlockRef) -> bool:
        """Whether this block is really the one the caller means, not just one with the same key."""
        return self.key == ref.key and self.parent == ref.parent and self.token_ids == tuple(ref.token_ids)

    def encode(self) -> bytes:
        n = self.num_layers
        body = b"".join(
            (
                _FIXED.pack(MAGIC, FORMAT_VERSION, n, len(self.token_ids), self.committed_s, self.key, self.parent),
                np.asarray(self.token_ids, dtype="<u4").tobytes(),
                np.asarray(self.payload_sizes, dtype="<u8").tobytes(),
                np.asarray(self.checksums, dtype="<u8").tobytes(),
            )
        )
        return body + _U64.pack(checksum(body))


def header_nbytes(num_tokens: int, num_layers: int) -> int:
    return _FIXED.size + 4 * num_tokens + 16 * num_layers + _U64.size


def _verified_header(view: memoryview) -> tuple[int, int, int, bytes, bytes, int]:
    """The fixed header fields of the record in `view`, checked along with the header's own checksum:
    (num_layers, num_tokens, committed_s, key, parent, offset of layer 0's payload)."""
    if len(view) < _FIXED.size:
        raise RecordError(f"record truncated: {len(view)} bytes")
    magic, version, num_layers, num_tokens, committed_s, key, parent = _FIXED.unpack_from(view, 0)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise RecordError(f"bad magic/version {magic!r}/{version}")
    if not 0 < num_layers <= MAX_LAYERS or num_tokens > MAX_TOKENS:
        raise RecordError(f"implausible header: {num_layers} layers, {num_tokens} tokens")
    end = header_nbytes(num_tokens, num_layers)
    if len(view) < end:
        raise RecordError(f"header truncated: {len(view)} < {end} bytes")
    (stored_sum,) = _U64.unpack_from(view, end - _U64.size)
    if checksum(view[: end - _U64.size]) != stored_sum:
        raise RecordError("header checksum mismatch")
    return num_layers, num_tokens, committed_s, key, parent, end


def decode_header(buf: Buffer) -> tuple[RecordHeader, int]:
    """Parse and validate the header at the start of `buf`; returns it and the offset of layer 0's payload."""
    view = as_bytes_view(buf)
    num_layers, num_tokens, committed_s, key, parent, end = _verified_header(view)
    offset = _FIXED.size
    tokens = np.frombuffer(view, dtype="<u4", count=num_tokens, offset=offset)
    offset += 4 * num_tokens
    sizes = np.frombuffer(view, dtype="<u8", count=num_layers, offset=offset)
    sums = np.frombuffer(view, dtype="<u8", count=num_layers, offset=offset + 8 * num_layers)
    header = RecordHeader(
        key=bytes(key),
        parent=bytes(parent),
        token_ids=tuple(tokens.tolist()),
        payload_sizes=tuple(sizes.tolist()),
        checksums=tuple(sums.tolist()),
        committed_s=committed_s,
    )
    return header, end


class BlockRecord:
    """One committed block: its header plus one payload buffer per layer (read-only by convention)."""

    __slots__ = ("header", "header_bytes", "payloads")

    def __init__(self, header: RecordHeader, payloads: Sequence[Buffer], header_bytes: bytes | None = None) -> None:
        assert len(payloads) == header.num_layers, "one payload per layer"
        self.header = header
        self.header_bytes = header.encode() if header_bytes is None else header_bytes
        self.payloads = list(payloads)

    @classmethod
    def build(cls, ref: BlockRef, payloads: Sequence[Buffer], checksums: Sequence[int]) -> BlockRecord:
        sizes = tuple(len(as_bytes_view(p)) for p in payloads)
        tokens = tuple(int(t) for t in ref.token_ids)
        header = RecordHeader(ref.key, ref.parent, tokens, sizes, tuple(checksums), int(time.time()) & 0xFFFFFFFF)
        return cls(header, payloads)

    @property
    def key(self) -> BlockKey:
        return self.header.key

    @property
    def nbytes(self) -> int:
        return len(self.header_bytes) + sum(self.header.payload_sizes)

    def verify_layer(self, layer: int) -> bool:
        return checksum(self.payloads[layer]) == self.header.checksums[layer]

    def encode(self) -> bytes:
        return b"".join([self.header_bytes, *self.payloads])


def decode_record(buf: Buffer) -> BlockRecord:
    """A record whose payloads are views into `buf` (no copy); checksums are verified per layer by the reader."""
    view = as_bytes_view(buf)
    header, offset = decode_header(view)
    total = offset + sum(header.payload_sizes)
    if len(view) != total:
        raise RecordError(f"record length {len(view)} != {total} announced by its header")
    payloads = []
    for size in header.payload_sizes:
        payloads.append(view[offset : offset + size])
        offset += size
    return BlockRecord(header, payloads, bytes(view[: offset - sum(header.payload_sizes)]))


class RecordLayout:
    """The verified header of one encoded record, parsed once so that reading a layer is a slice and a checksum.

    The disk tier keeps it with the record's view for a moment, so a load asking for one layer at a time does
    not re-parse (and re-hash) the header for each layer; every payload is still verified on each read.
    """

    __slots__ = ("key", "num_layers", "offsets", "parent", "sizes", "sums", "token_ids")

    def __init__(self, view: memoryview) -> None:
        num_layers, num_tokens, _, key, parent, end = _verified_header(view)
        sizes_at = _FIXED.size + 4 * num_tokens
        self.key, self.parent, self.num_layers = bytes(key), bytes(parent), num_layers
        self.token_ids = struct.unpack_from(f"<{num_tokens}I", view, _FIXED.size)
        self.sizes = struct.unpack_from(f"<{num_layers}Q", view, sizes_at)
        self.sums = struct.unpack_from(f"<{num_layers}Q", view, sizes_at + 8 * num_layers)
        offsets, at = [], end
        for size in self.sizes:
            offsets.append(at)
            at += size
        if len(view) != at:
            raise RecordError(f"record length {len(view)} != {at} announced by its header")
        self.offsets = tuple(offsets)

    def check(self, ref: BlockRef) -> None:
        """Raise RecordMismatch unless this record is `ref`'s block (not just one with the same key)."""
        if self.key != ref.key or self.parent != ref.parent or self.token_ids != tuple(ref.token_ids):
            raise RecordMismatch("key, parent or token ids differ from the caller's (hash collision or stale entry)")

    def payload(self, view: memoryview, layer: int) -> memoryview:
        """`layer`'s payload in `view` (the record this layout was parsed from), checksum verified."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} outside the block's {self.num_layers}")
        start = self.offsets[layer]
        payload = view[start : start + self.sizes[layer]]
        if xxhash.xxh3_64_intdigest(payload) != self.sums[layer]:
            raise RecordError(f"checksum mismatch in layer {layer}")
        return payload


def read_layers(buf: Buffer, ref: BlockRef, layers: Sequence[int]) -> list[memoryview]:
    """Verified views of `layers` of the encoded record in `buf`, if it is `ref`'s block.

    Parses only what it needs and checksums only the requested payloads. Raises RecordMismatch for another
    block, RecordError for bad bytes, ValueError for a layer the block does not have.
    """
    view = as_bytes_view(buf)
    layout = RecordLayout(view)
    layout.check(ref)
    return [layout.payload(view, layer) for layer in layers]


def committed_seconds(buf: Buffer) -> int:
    """The commit time stamped in a record's header (0 if unreadable); for ordering only, not verified."""
    view = as_bytes_view(buf)
    if len(view) < _FIXED.size:
        return 0
    return int(_FIXED.unpack_from(view, 0)[4])


def stated_parent(buf: Buffer) -> BlockKey | None:
    """The parent key a record's header names (None if unreadable); for eviction order only, not verified."""
    view = as_bytes_view(buf)
    if len(view) < _FIXED.size:
        return None
    return bytes(_FIXED.unpack_from(view, 0)[6])
