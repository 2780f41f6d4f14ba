"""What the connector reads from engine-core's request and scheduler-output objects, as `typing.Protocol`s: the
engine's `Request` / `SchedulerOutput` satisfy them structurally, and tests may pass small stand-ins."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from common.keys import BlockKey
from common.save_policy import KVSavePolicy
from protocol.messages import KVTransferParams


class ConnectorRequest(Protocol):
    """One sequence as the connector sees it (engine/request.py's `Request`)."""

    @property
    def request_id(self) -> str: ...

    @property
    def prompt_token_ids(self) -> Sequence[int]: ...

    @property
    def all_token_ids(self) -> Sequence[int]:
        """Prompt plus generated tokens so far."""
        ...

    @property
    def block_keys(self) -> Sequence[BlockKey]:
        """Chain keys of the request's full blocks, in order."""
        ...

    @property
    def kv_transfer_params(self) -> KVTransferParams | None:
        """The producer's, when this request continues one (a decode job)."""
        ...

    def block_parent_key(self, block_index: int) -> BlockKey: ...

    def block_token_ids(self, block_index: int) -> tuple[int, ...]: ...


class ConnectorScheduledItem(Protocol):
    @property
    def request(self) -> ConnectorRequest: ...

    @property
    def block_ids(self) -> Sequence[int]: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def num_scheduled_tokens(self) -> int: ...


class EvictedBlockView(Protocol):
    """A prefix-cache block whose slot a step reused (engine/block_pool.py's `EvictedBlock`)."""

    @property
    def block_id(self) -> int: ...

    @property
    def key(self) -> BlockKey: ...

    @property
    def parent_key(self) -> BlockKey: ...

    @property
    def token_ids(self) -> tuple[int, ...]: ...

    @property
    def reused(self) -> bool:
        """A prefix hit (or a fork) took the block while it was cached."""
        ...


class ConnectorSchedulerOutput(Protocol):
    """One scheduled step (engine/scheduler_output.py's `SchedulerOutput`)."""

    @property
    def scheduled(self) -> Sequence[ConnectorScheduledItem]: ...

    @property
    def evicted_blocks(self) -> Sequence[EvictedBlockView]:
        """Filled only for a write-back connector (EngineSettings.kv_save_policy 'evicted' or 'reused')."""
        ...


class EngineSettings(Protocol):
    """The engine settings the connector factory reads (engine/config.py's `EngineConfig`)."""

    @property
    def block_size(self) -> int: ...

    @property
    def kv_save_decode_blocks(self) -> bool: ...

    @property
    def kv_recompute_last_token_only(self) -> bool: ...

    @property
    def kv_save_policy(self) -> KVSavePolicy:
        """Write-through ('computed') or write-back ('evicted', 'reused')."""
        ...


@dataclass(frozen=True)
class ScheduledView:
    """One request scheduled in a step."""

    request: ConnectorRequest
    block_ids: Sequence[int]  # all of the request's device blocks, in sequence order
    num_computed_tokens: int  # before this step
    num_scheduled_tokens: int


def token_ids_of(request: ConnectorRequest) -> Sequence[int]:
    """Prompt plus generated tokens so far."""
    return request.all_token_ids


def iter_scheduled(scheduler_output: ConnectorSchedulerOutput) -> Iterator[ScheduledView]:
    for item in scheduler_output.scheduled:
        yield ScheduledView(item.request, item.block_ids, item.num_computed_tokens, item.num_scheduled_tokens)
