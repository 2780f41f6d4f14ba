"""`RequestStateStats`: a request's timeline, as vLLM's `RequestOutput.metrics` carries it (vllm/v1/metrics/stats.py).

`arrival_time` is wall-clock (`time.time()`); the `*_ts` fields are `time.monotonic()` taken by the engine; the
first token's latency counts from arrival. With n > 1 samples the request's first token is any sample's first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class RequestStateStats:
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.time)
    queued_ts: float = field(default_factory=time.monotonic)
    scheduled_ts: float = 0.0  # first scheduled (a preemption's reschedule does not move it)
    first_token_ts: float = 0.0
    last_token_ts: float = 0.0
    first_token_latency: float = 0.0  # seconds from arrival to the first token

    def scheduled(self) -> None:
        if self.scheduled_ts == 0.0:
            self.scheduled_ts = time.monotonic()

    def tokens(self, count: int) -> None:
        """`count` new tokens came out of a step just now."""
        if count <= 0:
            return
        now = time.monotonic()
        if self.first_token_ts == 0.0:
            self.first_token_ts = now
            self.first_token_latency = time.time() - self.arrival_time
        self.last_token_ts = now
        self.num_generation_tokens += count
