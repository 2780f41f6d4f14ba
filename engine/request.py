"""One sequence inside the engine: its tokens, progress, block keys and lifecycle state.

A user request with `n > 1` starts as one `Request`; after its prompt is computed it is forked into `n`
sequences that share the prompt's KV blocks (`Request.fork`). Every sequence keeps the user's id in
`parent_id` and its position among the samples in `sample_index`."""

from __future__ import annotations

import enum
from typing import Any

from common.keys import BlockKey, chain_key
from engine.sampling_params import SamplingParams
from protocol.messages import FinishReason, KVTransferParams  # FinishReason: the one enum (re-exported by engine)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        root_key: BlockKey,
        block_size: int,
        arrival: int,
        seed: int,
        priority: int = 0,
        cache_salt: str | None = None,
        kv_transfer_params: KVTransferParams | None = None,
        parent_id: str | None = None,
        sample_index: int = 0,
    ) -> None:
        self.request_id = request_id
        self.parent_id = parent_id if parent_id is not None else request_id
        self.sample_index = sample_index
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.priority = priority
        self.arrival = arrival
        self.arrival_time = 0.0  # the scheduler's clock when it was added (ages waiting sequences)
        # Every request samples from its own (seed, sample index, token position) streams, so a sample never
        # depends on the batch it ran in nor on being recomputed after preemption.
        self.seed = seed
        self.cache_salt = cache_salt
        self.kv_transfer_params = kv_transfer_params  # the producer's (a decode job's), for the connector
        # What the connector's request_finished returned: handed to the next hop (e.g. prefill → decode).
        self.finished_kv_transfer_params: KVTransferParams | None = None
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Prompt tokens served from a cache (device or connector) when first scheduled; -1 until then.
        self.num_cached_tokens = -1
        # Of those, tokens the KV connector loaded (failed loads subtracted).
        self.num_external_tokens = 0
        # Tokens the connector loaded, by store tier (ucm.api.Tier -> tokens): only blocks that loaded count.
        self.external_tokens_by_tier: dict[Any, int] = {}
        self.num_preemptions = 0
        self.forked = sampling_params.n == 1
        self.stop_reason: int | str | None = None
        self.block_size = block_size
        self.root_key = root_key
        self.block_keys: list[BlockKey] = []
        self._update_block_keys()

    # -- tokens -------------------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self._update_block_keys()

    def _update_block_keys(self) -> None:
        bs = self.block_size
        while (len(self.block_keys) + 1) * bs <= len(self.all_token_ids):
            i = len(self.block_keys)
            parent = self.block_keys[-1] if self.block_keys else self.root_key
            self.block_keys.append(chain_key(parent, self.all_token_ids[i * bs : (i + 1) * bs]))

    def block_parent_key(self, block_index: int) -> BlockKey:
        return self.block_keys[block_index - 1] if block_index > 0 else self.root_key

    def block_token_ids(self, block_index: int) -> tuple[int, ...]:
        bs = self.block_size
        return tuple(self.all_token_ids[block_index * bs : (block_index + 1) * bs])

    # -- state ----------------------------------------------------------------------------------------------
    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.status.finish_reason

    @property
    def sort_key(self) -> tuple[int, int, int]:
        """Scheduling order: lower priority value first, then arrival (FCFS), then sample index."""
        return (self.priority, self.arrival, self.sample_index)

    def fork(self, sample_index: int) -> Request:
        """A sibling sample with the same tokens and progress; the caller shares the KV blocks."""
        child = Request(
            f"{self.parent_id}#{sample_index}",
            self.prompt_token_ids,
            self.sampling_params,
            root_key=self.root_key,
            block_size=self.block_size,
            arrival=self.arrival,
            seed=self.seed,
            priority=self.priority,
            cache_salt=self.cache_salt,
            kv_transfer_params=self.kv_transfer_params,
            parent_id=self.parent_id,
            sample_index=sample_index,
        )
        child.output_token_ids = list(self.output_token_ids)
        child.all_token_ids = list(self.all_token_ids)
        child.block_keys = list(self.block_keys)
        child.status = self.status
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.num_external_tokens = self.num_external_tokens
        child.external_tokens_by_tier = dict(self.external_tokens_by_tier)
        child.forked = True
        return child

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, out={self.num_output_tokens})"
        )
