"""Wire messages between `StoreClient` and the store daemon (ZeroMQ DEALER ↔ ROUTER), protocol version 3.

A request is one msgpack frame holding a tagged msgspec Struct, followed by raw KV frames where the message
says so (never pickle). Every request carries a `req_id` echoed by its reply so a client can skip a late
reply to a request it already gave up on.

    Dump     + len(layers) frames per block, in block order (none for a `Dump` with `shm`: the daemon reads the
               payloads from the client's attached segment)
    LoadReply + len(layers) frames for each block not in `failed`, in block order (none for a `Load` with
                `shm`: the daemon wrote the payloads into the client's attached segment, ucm/shared_segment.py)

`AttachShm` / `DetachShm` and `Load.shm` (a same-host daemon writes loads into the client's shared memory) are
optional: an older daemon answers UNKNOWN_TYPE and the client keeps receiving frames.
Version 3 adds `Dump.shm` (a same-host daemon reads saves from shared memory too: no frames, no encryption of
the payloads) and `Dump.layers` (several layers of the same blocks in one request). Version 2 added `OpenNamespace` (a client declares its KV layout once; each `Dump` names it and is refused
unless every size matches) and the error codes a refusal carries. Every list has a fixed maximum length
(`ucm.wire_limits`) so that decoding one frame can never allocate without bound.
"""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec

from ucm.api import BlockRef, StoreStats
from ucm.wire_limits import MAX_BLOCK_TOKENS, MAX_KEYS_PER_REQUEST, MAX_LAYERS, MAX_LOAD_FRAMES, MAX_NAME_CHARS

PROTOCOL_VERSION = 3
DEFAULT_NAMESPACE = "default"
KeyList = Annotated[list[bytes], msgspec.Meta(max_length=MAX_KEYS_PER_REQUEST)]


class WireBlock(msgspec.Struct, array_like=True, frozen=True):
    key: bytes
    parent: bytes
    token_ids: Annotated[list[int], msgspec.Meta(max_length=MAX_BLOCK_TOKENS)]

    @classmethod
    def of(cls, ref: BlockRef) -> WireBlock:
        return cls(ref.key, ref.parent, list(ref.token_ids))

    def ref(self) -> BlockRef:
        return BlockRef(self.key, self.parent, tuple(self.token_ids))


class Layout(msgspec.Struct, array_like=True, frozen=True):
    """The shape every block of one namespace has: checked against each dumped payload before it is stored."""

    num_layers: int
    layer_nbytes: int  # payload bytes of one layer of one block (its K then V)
    block_tokens: int  # token ids per block (the engine's block size)

    @property
    def block_nbytes(self) -> int:
        return self.num_layers * self.layer_nbytes


class _Msg(msgspec.Struct, tag_field="type", frozen=True):
    req_id: int


# --- requests -----------------------------------------------------------------------------------------


class Ping(_Msg, tag="ping", frozen=True):
    pass


class Lookup(_Msg, tag="lookup", frozen=True):
    keys: KeyList


class Contains(_Msg, tag="contains", frozen=True):
    keys: KeyList


class OpenNamespace(_Msg, tag="open_namespace", frozen=True):
    """Declare (or re-declare, idempotently) the layout of a namespace this client will dump into."""

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME_CHARS)]
    layout: Layout
    protocol: int = PROTOCOL_VERSION


class ShmRanges(msgspec.Struct, array_like=True, frozen=True):
    """Payloads in a segment the client attached, exactly `lengths[...]` bytes at `offsets[...]`. For a load, entry
    `i * len(layers) + j` is where block i's layer j goes (a stored payload of another size fails the block); for a
    dump, entry i is block i's payload."""

    name: Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)]
    offsets: Annotated[list[int], msgspec.Meta(max_length=MAX_LOAD_FRAMES)]
    lengths: Annotated[list[int], msgspec.Meta(max_length=MAX_LOAD_FRAMES)]


class Dump(_Msg, tag="dump", frozen=True):
    """Payloads of `layers` (distinct) for each block, block after block: entry `i * len(layers) + j` is block i's
    layer j (one request for a whole small save instead of one per layer)."""

    blocks: Annotated[list[WireBlock], msgspec.Meta(max_length=MAX_KEYS_PER_REQUEST)]
    layers: Annotated[list[int], msgspec.Meta(min_length=1, max_length=MAX_LAYERS)]
    num_layers: int
    namespace: Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)] = DEFAULT_NAMESPACE
    shm: ShmRanges | None = None  # None: the payloads come as frames


class Commit(_Msg, tag="commit", frozen=True):
    keys: KeyList
    ok: bool


class Load(_Msg, tag="load", frozen=True):
    blocks: Annotated[list[WireBlock], msgspec.Meta(max_length=MAX_KEYS_PER_REQUEST)]
    layers: Annotated[list[int], msgspec.Meta(max_length=MAX_LAYERS)]
    shm: ShmRanges | None = None  # None: the payloads come back as frames


class AttachShm(_Msg, tag="attach_shm", frozen=True):
    """Map the client's segment `/dev/shm/<name>` of `nbytes` (header included) whose header starts with `token`."""

    name: Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)]
    nbytes: Annotated[int, msgspec.Meta(gt=0)]
    token: Annotated[bytes, msgspec.Meta(max_length=64)]


class DetachShm(_Msg, tag="detach_shm", frozen=True):
    name: Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)]


class Prefetch(_Msg, tag="prefetch", frozen=True):
    keys: KeyList


class Remove(_Msg, tag="remove", frozen=True):
    keys: KeyList


class GetStats(_Msg, tag="stats", frozen=True):
    pass


Request = (
    Ping
    | Lookup
    | Contains
    | OpenNamespace
    | Dump
    | Commit
    | Load
    | Prefetch
    | Remove
    | GetStats
    | AttachShm
    | DetachShm
)
REQUEST_TYPES = frozenset(t.__struct_config__.tag for t in Request.__args__)

# --- replies ------------------------------------------------------------------------------------------


class ErrorCode(enum.Enum):
    MALFORMED = "malformed"  # not msgpack, or fields of the wrong type
    UNKNOWN_TYPE = "unknown_type"
    TOO_LARGE = "too_large"  # over the daemon's frame or byte limits
    BAD_REQUEST = "bad_request"  # well-formed but invalid (frame count, layer range, sizes, a key that does not chain)
    NO_NAMESPACE = "no_namespace"  # a dump into a namespace this client has not opened (e.g. the daemon restarted)
    FORBIDDEN = "forbidden"  # the keys belong to another client
    VERSION = "version"  # the client speaks another protocol version
    BUSY = "busy"  # a fixed cap on pending state is reached; retry later
    NO_SEGMENT = "no_segment"  # a load into a segment this client has not attached (e.g. the daemon restarted)
    INTERNAL = "internal"


class OkReply(_Msg, tag="ok", frozen=True):
    pass


class LookupReply(_Msg, tag="lookup_reply", frozen=True):
    hit: int


class ContainsReply(_Msg, tag="contains_reply", frozen=True):
    present: list[bool]


class DumpReply(_Msg, tag="dump_reply", frozen=True):
    failed: list[int]


class LoadReply(_Msg, tag="load_reply", frozen=True):
    failed: list[int]
    from_disk: list[int] = []  # the loaded blocks the daemon read off its disk tier (the others came from DRAM)


class StatsReply(_Msg, tag="stats_reply", frozen=True):
    stats: StoreStats


class ErrorReply(_Msg, tag="error", frozen=True):
    code: ErrorCode
    message: str


Reply = OkReply | LookupReply | ContainsReply | DumpReply | LoadReply | StatsReply | ErrorReply

_encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


_envelope_decoder = msgspec.msgpack.Decoder(dict[str, msgspec.Raw])
_type_decoder = msgspec.msgpack.Decoder(str)
_req_id_decoder = msgspec.msgpack.Decoder(int)


def classify_undecodable(frame: bytes | memoryview) -> tuple[ErrorCode, int]:
    """Why a request frame failed to decode, and its req_id if one can be read (else 0).

    Runs on bytes from anyone: it decodes only the top-level map, each field typed, and treats *any* error
    (invalid UTF-8, unhashable values, nesting deep enough to hit the recursion limit) as MALFORMED.
    """
    try:
        raw = _envelope_decoder.decode(frame)
    except Exception:
        return ErrorCode.MALFORMED, 0
    req_id = 0
    try:
        if "req_id" in raw:
            req_id = _req_id_decoder.decode(raw["req_id"])
    except Exception:
        req_id = 0
    try:
        kind = _type_decoder.decode(raw["type"]) if "type" in raw else None
    except Exception:
        return ErrorCode.MALFORMED, req_id
    if kind not in REQUEST_TYPES:
        return ErrorCode.UNKNOWN_TYPE, req_id
    return ErrorCode.MALFORMED, req_id
