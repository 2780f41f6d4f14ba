"""`PluginConfig`: what `kv_connector_extra_config` may say to UCMConnector, validated once."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from connector.store_spec import StoreKind, StoreSpec

_KNOWN = {"store", "save_decode_blocks", "task_timeout_s", "shared_memory"}
DEFAULT_TASK_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class PluginConfig:
    store: StoreSpec  # always a daemon: vLLM's scheduler and worker are separate processes
    save_decode_blocks: bool = False  # prompts are what gets reused; decode blocks only help multi-turn chats
    task_timeout_s: float = DEFAULT_TASK_TIMEOUT_S  # a store task still running after this is a failed one
    shared_memory: bool = True  # a daemon on this host writes loads into shared memory (ucm/shared_segment.py)

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> PluginConfig:
        extra = dict(extra or {})
        unknown = set(extra) - _KNOWN
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config key(s) {sorted(unknown)}; known: {sorted(_KNOWN)}")
        text = extra.get("store")
        if not isinstance(text, str) or not text:
            raise ValueError(
                'UCMConnector needs kv_connector_extra_config {"store": "tcp://HOST:PORT"}: the address '
                "of a running `ucm-serve store` daemon"
            )
        spec = StoreSpec.parse(text)
        if spec.kind is not StoreKind.DAEMON:
            raise ValueError(
                f"store {text!r}: vLLM runs its scheduler and worker in separate processes, so an "
                "embedded store would be two stores; start `ucm-serve store` and give its tcp:// or "
                "ipc:// address"
            )
        save_decode = extra.get("save_decode_blocks", False)
        if not isinstance(save_decode, bool):
            raise ValueError(f"save_decode_blocks must be true or false, got {save_decode!r}")
        timeout = extra.get("task_timeout_s", DEFAULT_TASK_TIMEOUT_S)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise ValueError(f"task_timeout_s must be a positive number, got {timeout!r}")
        shared = extra.get("shared_memory", True)
        if not isinstance(shared, bool):
            raise ValueError(f"shared_memory must be true or false, got {shared!r}")
        return cls(spec, save_decode, float(timeout), shared)
