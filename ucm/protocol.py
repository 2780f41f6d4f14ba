"""Wire messages between `StoreClient` and the store daemon (ZeroMQ DEALER ↔ ROUTER).

A request is one msgpack frame holding a tagged msgspec Struct, followed by raw KV frames where the message
says so (never pickle). Every request carries a `req_id` echoed by its reply so a client can skip a late
reply to a request it already gave up on.

    Dump     + one frame per block: that block's payload for `layer`
    LoadReply + len(layers) frames for each block not in `failed`, in block order
"""

from __future__ import annotations

import enum

import msgspec

from ucm.api import BlockRef, StoreStats


class WireBlock(msgspec.Struct, array_like=True, frozen=True):
    key: bytes
    parent: bytes
    token_ids: list[int]

    @classmethod
    def of(cls, ref: BlockRef) -> WireBlock:
        return cls(ref.key, ref.parent, list(ref.token_ids))

    def ref(self) -> BlockRef:
        return BlockRef(self.key, self.parent, tuple(self.token_ids))


class _Msg(msgspec.Struct, tag_field="type", frozen=True):
    req_id: int


# --- requests -----------------------------------------------------------------------------------------


class Ping(_Msg, tag="ping"):
    pass


class Lookup(_Msg, tag="lookup"):
    keys: list[bytes]


class Contains(_Msg, tag="contains"):
    keys: list[bytes]


class Dump(_Msg, tag="dump"):
    blocks: list[WireBlock]
    layer: int
    num_layers: int


class Commit(_Msg, tag="commit"):
    keys: list[bytes]
    ok: bool


class Load(_Msg, tag="load"):
    blocks: list[WireBlock]
    layers: list[int]


class Prefetch(_Msg, tag="prefetch"):
    keys: list[bytes]


class Remove(_Msg, tag="remove"):
    keys: list[bytes]


class GetStats(_Msg, tag="stats"):
    pass


Request = Ping | Lookup | Contains | Dump | Commit | Load | Prefetch | Remove | GetStats
REQUEST_TYPES = frozenset(t.__struct_config__.tag for t in Request.__args__)  # type: ignore[attr-defined]

# --- replies ------------------------------------------------------------------------------------------


class ErrorCode(enum.Enum):
    MALFORMED = "malformed"  # not msgpack, or fields of the wrong type
    UNKNOWN_TYPE = "unknown_type"
    TOO_LARGE = "too_large"  # over the daemon's frame or byte limits
    BAD_REQUEST = "bad_request"  # well-formed but invalid (frame count, layer range...)
    INTERNAL = "internal"


class OkReply(_Msg, tag="ok"):
    pass


class LookupReply(_Msg, tag="lookup_reply"):
    hit: int


class ContainsReply(_Msg, tag="contains_reply"):
    present: list[bool]


class DumpReply(_Msg, tag="dump_reply"):
    failed: list[int]


class LoadReply(_Msg, tag="load_reply"):
    failed: list[int]


class StatsReply(_Msg, tag="stats_reply"):
    stats: StoreStats


class ErrorReply(_Msg, tag="error"):
    code: ErrorCode
    message: str


Reply = OkReply | LookupReply | ContainsReply | DumpReply | LoadReply | StatsReply | ErrorReply

_encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def classify_undecodable(frame: bytes | memoryview) -> tuple[ErrorCode, int]:
    """Why a request frame failed to decode, and its req_id if one can be read (else 0)."""
    try:
        raw = msgspec.msgpack.decode(frame)
    except msgspec.DecodeError:
        return ErrorCode.MALFORMED, 0
    if not isinstance(raw, dict):
        return ErrorCode.MALFORMED, 0
    req_id = raw.get("req_id")
    req_id = req_id if isinstance(req_id, int) and not isinstance(req_id, bool) else 0
    if raw.get("type") not in REQUEST_TYPES:
        return ErrorCode.UNKNOWN_TYPE, req_id
    return ErrorCode.MALFORMED, req_id
