"""What one engine step runs: the scheduler's plan (for the model runner and the connector) and the
runner's result (for the scheduler)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.block_pool import EvictedBlock
from engine.request import Request


@dataclass
class ScheduledRequest:
    request: Request
    block_ids: list[int]  # the sequence's blocks after allocation, in order
    num_computed_tokens: int  # before this step; includes device prefix hits and this step's external loads
    num_scheduled_tokens: int  # computed in this step, from position num_computed_tokens on
    num_external_tokens: int = 0  # of num_computed_tokens, loaded by the connector in this step

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def completes_prompt(self) -> bool:
        """After this step every known token is computed, so the step samples the next one."""
        return self.num_computed_tokens + self.num_scheduled_tokens >= self.request.num_tokens

    @property
    def num_samples(self) -> int:
        if not self.completes_prompt:
            return 0
        return 1 if self.request.forked else self.request.sampling_params.n


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[ScheduledRequest] = field(default_factory=list)
    scheduled_running_reqs: list[ScheduledRequest] = field(default_factory=list)
    # Copy-on-write (src block, dst block) pairs to apply before the forward.
    cow_copies: list[tuple[int, int]] = field(default_factory=list)
    # Prefix-cache blocks this step's allocations reused, for a write-back connector (KVSavePolicy.EVICTED);
    # their old contents are intact until the forward (the connector saves them in start_load_kv).
    evicted_blocks: list[EvictedBlock] = field(default_factory=list)
    preempted_req_ids: set[str] = field(default_factory=set)
    # Sequences that finished since the previous step (for the connector's get_finished).
    finished_req_ids: set[str] = field(default_factory=set)
    kv_connector_metadata: Any = None

    @property
    def scheduled(self) -> list[ScheduledRequest]:
        return self.scheduled_running_reqs + self.scheduled_new_reqs

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {s.request_id: s.num_scheduled_tokens for s in self.scheduled}

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.scheduled)


@dataclass
class TokenLogprobs:
    """Logprobs at one generated position: the top-k (sorted, descending) plus the sampled token."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]  # 1-based rank of each token in the full distribution


@dataclass
class ModelRunnerOutput:
    # seq id → sampled token(s): one per sequence, n for a sequence being forked into n samples.
    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    failed_block_ids: set[int] = field(default_factory=set)
    # request id -> blocks the connector loaded for it this step, by store tier (ucm.api.Tier)
    loaded_by_tier: dict[str, dict[Any, int]] = field(default_factory=dict)
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
