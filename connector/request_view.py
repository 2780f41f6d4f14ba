"""The few things the connector reads from engine-core's request and scheduler-output objects, in one place."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ScheduledView:
    """One request scheduled in a step."""

    request: Any
    block_ids: Sequence[int]  # all of the request's device blocks, in sequence order
    num_computed_tokens: int  # before this step
    num_scheduled_tokens: int


def token_ids_of(request: Any) -> Sequence[int]:
    """Prompt plus generated tokens so far."""
    return request.all_token_ids


def iter_scheduled(scheduler_output: Any) -> Iterator[ScheduledView]:
    for item in scheduler_output.scheduled:
        yield ScheduledView(item.request, item.block_ids, item.num_computed_tokens, item.num_scheduled_tokens)
