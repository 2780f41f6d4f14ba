"""Admission: every request the router accepts is served; the ones it cannot serve are refused up front.

Sequences run while the nodes have room (the sum of their capacities, max_num_seqs each: a request holds a
prefill slot, then a decode slot); the rest wait here, first come first served, so a node that dies loses
nothing that had not started yet. The queue takes `max_queued_requests` requests whatever the load, and more
while the tokens waiting fit in `max_queue_wait_s` of the measured service rate (router/service_rate.py).
Beyond that a request is `Rejected` (the app answers 429 with Retry-After) instead of joining a queue it would
time out in.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from router.service_rate import ServiceRate

# Retry-After while no service rate has been measured yet (the first second of the first burst).
_UNKNOWN_RATE_RETRY_S = 5.0


class Rejected(Exception):
    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    @property
    def retry_after_header(self) -> str:
        return str(max(1, math.ceil(self.retry_after_s)))


@dataclass(eq=False)
class Ticket:
    """One admitted request: `seqs` sequences (its n choices), asking for `tokens` (prompts + max new tokens)."""

    seqs: int
    tokens: int
    granted: bool = False
    released: bool = False
    _wake: asyncio.Future[None] | None = None


class AdmissionQueue:
    def __init__(
        self,
        capacity: Callable[[], int],
        max_queued_requests: int,
        max_queue_wait_s: float,
        rate: ServiceRate | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_queued_requests < 0 or max_queue_wait_s <= 0:
            raise ValueError(f"bad queue bounds: {max_queued_requests} requests, {max_queue_wait_s}s")
        self._capacity = capacity
        self.max_queued_requests = max_queued_requests
        self.max_queue_wait_s = max_queue_wait_s
        self.rate = rate if rate is not None else ServiceRate()
        self._clock = clock
        self._queue: deque[Ticket] = deque()
        self._queued_tokens = 0
        self._running = 0  # sequences granted and not yet released

    @property
    def depth(self) -> int:
        """Requests waiting for room on the nodes."""
        return len(self._queue)

    @property
    def running(self) -> int:
        return self._running

    @property
    def queued_tokens(self) -> int:
        return self._queued_tokens

    def bound_tokens(self) -> float:
        """How many queued tokens the measured rate serves within max_queue_wait_s (0 while unmeasured)."""
        rate = self.rate.tokens_per_s(self._clock())
        return rate * self.max_queue_wait_s if rate else 0.0

    def admit(self, seqs: int, tokens: int) -> Ticket:
        """A ticket that runs now or after the requests queued before it; Rejected if the queue is full."""
        if seqs <= 0 or tokens < 0:
            raise ValueError(f"a request needs >= 1 sequence and >= 0 tokens, got {seqs}, {tokens}")
        ticket = Ticket(seqs, tokens)
        if not self._queue and self._fits(seqs):
            self._grant(ticket)
            return ticket
        if len(self._queue) >= self.max_queued_requests:
            rate = self.rate.tokens_per_s(self._clock())
            budget = rate * self.max_queue_wait_s if rate else 0.0
            if self._queued_tokens + tokens > budget:
                excess = self._queued_tokens + tokens - budget
                retry = excess / rate if rate else _UNKNOWN_RATE_RETRY_S
                raise Rejected(
                    f"The server is overloaded: {len(self._queue)} requests ({self._queued_tokens} tokens) are "
                    f"already waiting. Please retry after {max(1, math.ceil(retry))}s.",
                    min(retry, self.max_queue_wait_s),
                )
        self._queue.append(ticket)
        self._queued_tokens += tokens
        return ticket

    async def wait(self, ticket: Ticket) -> None:
        """Until the ticket may run. On cancellation the caller's `release` takes it out of the queue."""
        assert not ticket.released, "waiting on a released ticket"
        if ticket.granted:
            return
        if ticket._wake is None:
            ticket._wake = asyncio.get_running_loop().create_future()
        await ticket._wake

    def release(self, ticket: Ticket, served_tokens: int = 0) -> None:
        """The request is over (done, failed or cancelled, queued or running). Idempotent."""
        if ticket.released:
            return
        ticket.released = True
        if ticket.granted:
            self._running -= ticket.seqs
            assert self._running >= 0, "released more sequences than were granted"
            self.rate.served(served_tokens, self._clock())
        else:
            self._queue.remove(ticket)
            self._queued_tokens -= ticket.tokens
        self.pump()

    def pump(self) -> None:
        """Start queued requests while there is room (call when capacity may have grown: a node registered)."""
        while self._queue and self._fits(self._queue[0].seqs):
            ticket = self._queue.popleft()
            self._queued_tokens -= ticket.tokens
            self._grant(ticket)
            if ticket._wake is not None and not ticket._wake.done():
                ticket._wake.set_result(None)
        self.rate.set_busy(self._running > 0, self._clock())

    def _fits(self, seqs: int) -> bool:
        # With nothing running the head always goes: a request wider than the cluster (n > capacity) or one
        # arriving while no node is registered must not wait forever (the dispatcher answers it 503 then).
        return self._running == 0 or self._running + seqs <= self._capacity()

    def _grant(self, ticket: Ticket) -> None:
        ticket.granted = True
        self._running += ticket.seqs
        self.rate.set_busy(True, self._clock())
