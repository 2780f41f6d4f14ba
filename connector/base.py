"""The KV-connector API, split by role, with vLLM's (`KVConnectorBase_V1`) method names and meanings.

Lifecycle of one engine step (documented order; a test connector checks it):

  scheduler side, while scheduling:
    1. get_num_new_matched_tokens(request, num_computed_tokens)  for each waiting request
    2. update_state_after_alloc(request, block_ids, num_external_tokens)  after its blocks are allocated
    3. build_connector_meta(scheduler_output)  once, after the step is scheduled
  worker side, in the forward pass:
    4. bind_connector_metadata(meta)
    5. start_load_kv()                                  before the first layer
    6. for each layer L: wait_for_layer_load(L) → attention writes KV → save_kv_layer(L, k_cache, v_cache, attn_metadata)
    7. wait_for_save()                                  after the last layer
    8. get_finished(finished_req_ids), get_block_ids_with_load_errors()
    9. clear_connector_metadata()
  scheduler side, when a request ends:
   10. request_finished(request, block_ids) → (delay_free, kv_transfer_params)

The engine is written so that no connector at all is the common case: every call site checks for None.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from connector.request_view import ConnectorRequest, ConnectorSchedulerOutput
from protocol.messages import KVTransferParams
from ucm.api import Tier

if TYPE_CHECKING:  # importing this package stays torch-free
    import torch

    from ucm_kernels.attention_metadata import AttentionMetadata


class KVConnectorRole(enum.Enum):
    PRODUCER = "kv_producer"  # saves KV (prefill nodes)
    CONSUMER = "kv_consumer"  # loads KV (decode nodes)
    BOTH = "kv_both"  # saves and loads (colocated engine)

    @property
    def saves(self) -> bool:
        return self in (KVConnectorRole.PRODUCER, KVConnectorRole.BOTH)

    @property
    def loads(self) -> bool:
        return self in (KVConnectorRole.CONSUMER, KVConnectorRole.BOTH)


@dataclass
class ConnectorMetadata:
    """Per-step instructions from the scheduler side to the worker side; subclasses add fields."""


class KVConnectorScheduler(ABC):
    """Runs beside the scheduler: decides what to load and what to save."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond `num_computed_tokens` (the device prefix-cache hit) that the store can supply,
        and whether they load asynchronously (the request then waits for `get_finished`)."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """The request's device blocks are allocated; remember which ones the external tokens go to."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: ConnectorSchedulerOutput) -> ConnectorMetadata:
        """Everything the worker must load and save in this step. Resets per-step state."""

    @abstractmethod
    def request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> tuple[bool, KVTransferParams | None]:
        """A request ended. Returns (free blocks only later, kv_transfer_params for the next hop)."""

    def close(self) -> None:
        """The engine shuts down (called once, after the last step); release store connections."""


class KVConnectorWorker(ABC):
    """Runs beside the model: moves KV between the paged cache and the store."""

    def __init__(self) -> None:
        self._metadata: ConnectorMetadata | None = None

    def bind_connector_metadata(self, metadata: ConnectorMetadata) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    @property
    def metadata(self) -> ConnectorMetadata:
        assert self._metadata is not None, "connector metadata used outside a bound step"
        return self._metadata

    def needs_layer_hooks(self) -> bool:
        """Whether the bound step's forward must call wait_for_layer_load / save_kv_layer on every layer (asked
        after start_load_kv). True unless a connector knows they would do nothing this step (no loads, no
        per-layer saves): the engine then runs the forward without them, which a CPU decode step's native path
        needs (engine/models/native_decode.py). vLLM calls them every step; skipping no-ops changes nothing."""
        return True

    @abstractmethod
    def register_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The paged cache: per layer (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim]."""

    @abstractmethod
    def start_load_kv(self) -> None:
        """Begin loading this step's external blocks; must not block on the transfer."""

    @abstractmethod
    def wait_for_layer_load(self, layer: int) -> None:
        """Block until layer `layer`'s blocks are in the paged cache (called before its attention)."""

    @abstractmethod
    def save_kv_layer(
        self, layer: int, k_cache: torch.Tensor, v_cache: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> None:
        """Start saving this layer's newly full blocks (called after its KV is written); must not block."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Block until this step's saves are done and commit them."""

    @abstractmethod
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(request ids whose async saves finished, request ids whose async loads finished)."""

    @abstractmethod
    def get_block_ids_with_load_errors(self) -> set[int]:
        """Device block ids whose load failed since the last call; the scheduler recomputes them."""

    def take_loaded_by_tier(self) -> dict[str, dict[Tier, int]]:
        """Blocks each request loaded since the last call, by the store tier they were read from (only blocks
        that loaded and verified). A connector without tiers reports nothing."""
        return {}

    def close(self) -> None:
        """The engine shuts down (called once, after the last step); release store connections."""


class ConnectorPair(NamedTuple):
    """Both sides of one connector, as `make_connector` returns them (a tuple, so `sched, worker = pair` works)."""

    scheduler: KVConnectorScheduler
    worker: KVConnectorWorker
