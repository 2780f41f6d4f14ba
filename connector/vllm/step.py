"""What the scheduler core reads from one vLLM step (`StepDelta`) and what it sends the worker (`StepPlan`).

`StepDelta` is vLLM's `SchedulerOutput` reduced to what a store connector needs; the plugin converts, so the
core and its tests never see vLLM types. `StepPlan` travels to the worker process inside vLLM's metadata
(pickled), so it holds only plain values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from connector.metadata import BlockSpec
from ucm.api import BlockRef


@dataclass(frozen=True)
class ScheduledRequest:
    """One request scheduled in a step, as vLLM describes it."""

    request_id: str
    block_ids: tuple[int, ...]  # device blocks vLLM gave it in this step (all of them if `replaces_blocks`)
    replaces_blocks: bool  # a new or resumed request: `block_ids` is its whole block table
    num_computed_tokens: int  # before this step, device and external hits included
    num_scheduled_tokens: int

    def __post_init__(self) -> None:
        if self.num_computed_tokens < 0 or self.num_scheduled_tokens < 0:
            raise ValueError(f"{self.request_id}: negative token counts")


@dataclass(frozen=True)
class StepDelta:
    scheduled: tuple[ScheduledRequest, ...] = ()
    preempted: frozenset[str] = frozenset()  # their blocks are freed; a resumption brings a new block table
    finished: frozenset[str] = frozenset()

    @classmethod
    def of(cls, so: Any) -> StepDelta:
        """From vLLM's `SchedulerOutput` (read by attribute, so this module needs no vllm): new requests carry
        their whole block table, cached ones the blocks added this step — or, when resumed after a preemption,
        their whole new table. Block ids are per KV cache group; we have exactly one."""
        scheduled = [
            ScheduledRequest(
                r.req_id,
                tuple(r.block_ids[0]) if r.block_ids else (),
                True,
                r.num_computed_tokens,
                so.num_scheduled_tokens.get(r.req_id, 0),
            )
            for r in so.scheduled_new_reqs
        ]
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            scheduled.append(
                ScheduledRequest(
                    req_id,
                    tuple(new_ids[0]) if new_ids else (),
                    req_id in cached.resumed_req_ids,
                    cached.num_computed_tokens[i],
                    so.num_scheduled_tokens.get(req_id, 0),
                )
            )
        return cls(tuple(scheduled), frozenset(so.preempted_req_ids or ()), frozenset(so.finished_req_ids))


@dataclass(frozen=True)
class BlockLoad:
    """Stored blocks of one request to copy into device blocks: blocks[i] -> block_ids[i], in prefix order."""

    request_id: str
    block_ids: tuple[int, ...]
    blocks: tuple[BlockRef, ...]
    # The last block also holds tokens computed in this step (vLLM recomputes a fully cached prompt's last
    # token): it must be copied in before the forward pass writes that token's fresh K/V, never after.
    before_forward: bool = False
    # The plan could not be made (a scheduler hook failed after vLLM counted the tokens as cached): load
    # nothing and report every block as failed so vLLM recomputes them.
    poisoned: bool = False

    def __post_init__(self) -> None:
        assert len(self.block_ids) == len(self.blocks) or self.poisoned, "one device block per loaded block"


@dataclass
class StepPlan:
    loads: list[BlockLoad] = field(default_factory=list)
    saves: list[BlockSpec] = field(default_factory=list)  # full, computed by the end of the step, not stored

    @property
    def loads_before_forward(self) -> bool:
        return any(load.before_forward for load in self.loads)
