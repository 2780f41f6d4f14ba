"""KV event batches ⇄ msgpack bytes. We encode as vLLM 0.32 does (events as maps tagged "type"); we decode that and
the positional arrays vLLM sent before 0.11 (`["BlockStored", hashes, parent, token_ids, block_size, lora_id]`,
later versions appending `medium`, `lora_name`, ...).

A consumer must survive a publisher newer than itself: an event type we do not know is skipped and counted, fields
we do not know are ignored, and fields an older publisher did not have read as their default (None). Anything else
malformed is a ValueError for the whole batch.
"""

from __future__ import annotations

from typing import Any

import msgspec

from common.kv_events.events import EVENT_TYPES, KVEvent, KVEventBatch

# A batch is one engine step's events; a frame far past this is a bug or an attack.
MAX_PAYLOAD_BYTES = 64 * 1024 * 1024

_encoder = msgspec.msgpack.Encoder()
_typed = msgspec.msgpack.Decoder(KVEventBatch)
_untyped = msgspec.msgpack.Decoder()


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


class BatchDecoder:
    """Decodes payloads from any vLLM version's publisher; counts the events it had to skip."""

    def __init__(self) -> None:
        self.unknown_events = 0  # events of a type this version does not know (a newer publisher)

    def decode(self, payload: bytes | memoryview) -> KVEventBatch:
        if len(payload) > MAX_PAYLOAD_BYTES:
            raise ValueError(f"event batch of {len(payload)} bytes exceeds {MAX_PAYLOAD_BYTES}")
        try:
            return _typed.decode(payload)  # vLLM 0.32's own encoding, and ours
        except msgspec.ValidationError:
            pass  # positional events, an event type we do not know, an older batch: the tolerant path
        except msgspec.DecodeError as e:
            raise ValueError(f"event batch is not msgpack: {e}") from None
        return self._tolerant(_untyped.decode(payload))

    def _tolerant(self, raw: Any) -> KVEventBatch:
        if not isinstance(raw, list) or not 2 <= len(raw) <= 3 or not isinstance(raw[1], list):
            raise ValueError("event batch is not [ts, events, data_parallel_rank]")
        ts, items = raw[0], raw[1]
        rank = raw[2] if len(raw) == 3 else None
        events: list[KVEvent] = []
        for item in items:
            fields = self._fields(item)
            if fields is None:
                self.unknown_events += 1
                continue
            try:
                events.append(msgspec.convert(fields, KVEvent))
            except msgspec.ValidationError as e:
                raise ValueError(f"bad {fields.get('type')} event: {e}") from None
        try:
            return KVEventBatch(ts=float(ts), events=events, data_parallel_rank=rank)
        except (TypeError, ValueError) as e:
            raise ValueError(f"bad event batch header: {e}") from None

    @staticmethod
    def _fields(item: Any) -> dict[str, Any] | None:
        """An event as a map with its "type" (positional fields named in vLLM's order, missing ones None); None for
        a type we do not know."""
        if isinstance(item, dict):
            kind = item.get("type")
            fields = dict(item)
        elif isinstance(item, list) and item and isinstance(item[0], str):
            kind = item[0]
            cls = EVENT_TYPES.get(kind)
            if cls is None:
                return None
            names = cls.__struct_fields__
            fields = dict(zip(names, item[1:], strict=False))  # a newer publisher's extra trailing fields: dropped
            fields["type"] = kind
        else:
            raise ValueError(f"an event is neither a map nor a tagged array: {type(item).__name__}")
        cls = EVENT_TYPES.get(kind) if isinstance(kind, str) else None
        if cls is None:
            return None
        required = len(cls.__struct_fields__) - len(cls.__struct_defaults__ or ())
        for name in cls.__struct_fields__[:required]:
            fields.setdefault(name, None)  # a field an older publisher did not send (medium, lora_name)
        return fields
