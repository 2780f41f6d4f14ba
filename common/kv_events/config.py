"""`KVEventsConfig`: vLLM's `--kv-events-config` (vllm/config/kv_events.py), the same JSON object with the same
fields and defaults, parsed into a typed struct. Unknown fields and bad JSON are refused with the reason.

    --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
                         "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'
"""

from __future__ import annotations

from typing import Literal

import msgspec

from common.kv_events import endpoints

Publisher = Literal["null", "zmq"]


class KVEventsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    enable_kv_cache_events: bool = False
    # None: "zmq" when events are enabled, else "null" (vLLM's rule)
    publisher: Publisher | None = None
    # PUB address; bound if it is a wildcard (`tcp://*:5557`), ipc:// or inproc://, else connected to (a consumer
    # that binds: llm-d's indexer does). endpoints.py.
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None  # ROUTER address (always bound) where a subscriber asks for missed batches
    buffer_steps: int = 10_000  # batches (engine steps) kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark: beyond it a slow subscriber loses batches
    max_queue_size: int = 100_000  # batches waiting for the publisher thread before `publish` waits
    topic: str = ""  # the first frame of every message; subscribers filter on it

    def __post_init__(self) -> None:
        endpoints.check(self.endpoint, "endpoint")
        if self.replay_endpoint is not None:
            endpoints.check(self.replay_endpoint, "replay_endpoint")
            if self.replay_endpoint == self.endpoint:
                raise ValueError("replay_endpoint must differ from endpoint")
        if self.buffer_steps < 1:
            raise ValueError(f"buffer_steps must be >= 1, got {self.buffer_steps}")
        if self.hwm < 0:
            raise ValueError(f"hwm must be >= 0, got {self.hwm}")
        if self.max_queue_size < 1:
            raise ValueError(f"max_queue_size must be >= 1, got {self.max_queue_size}")

    @property
    def publisher_kind(self) -> Publisher:
        if self.publisher is not None:
            return self.publisher
        return "zmq" if self.enable_kv_cache_events else "null"

    @property
    def enabled(self) -> bool:
        """Events are made and published (vLLM: enabled, and a publisher other than "null")."""
        return self.enable_kv_cache_events and self.publisher_kind == "zmq"

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()

    def for_node(self, index: int) -> KVEventsConfig:
        """The config of a launcher's `index`-th node: both addresses offset as vLLM offsets them per data-parallel
        rank (endpoints.offset), so the nodes on one host do not collide."""
        replay = endpoints.offset(self.replay_endpoint, index) if self.replay_endpoint is not None else None
        return msgspec.structs.replace(self, endpoint=endpoints.offset(self.endpoint, index), replay_endpoint=replay)


FIELDS = tuple(KVEventsConfig.__struct_fields__)


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """The `--kv-events-config` JSON object → KVEventsConfig; ValueError saying what is wrong (bad JSON, a field we
    do not know, a wrong type or value)."""
    try:
        return msgspec.json.decode(text, type=KVEventsConfig)
    except msgspec.ValidationError as e:
        known = f" (fields: {', '.join(FIELDS)})" if "unknown field" in str(e) else ""
        raise ValueError(f"--kv-events-config: {e}{known}") from None
    except msgspec.DecodeError as e:
        raise ValueError(f"--kv-events-config is not a JSON object: {e}") from None


def check_node_offsets(config: KVEventsConfig, nodes: int) -> None:
    """ValueError if `nodes` nodes, offset by `for_node`, would bind one port twice (endpoint + i == replay + j)."""
    if config.replay_endpoint is None or nodes <= 1:
        return
    pub = endpoints.tcp_port(config.endpoint)
    replay = endpoints.tcp_port(config.replay_endpoint)
    if pub and replay and abs(pub - replay) < nodes:
        raise ValueError(
            f"--kv-events-config: {nodes} nodes take ports {pub}..{pub + nodes - 1} (endpoint) and "
            f"{replay}..{replay + nodes - 1} (replay_endpoint): move them at least {nodes} apart"
        )
