"""Admission queue and service-rate meter in process: who runs, who waits, who gets a 429, and what frees room."""

from __future__ import annotations

import asyncio

import pytest

from router.admission import AdmissionQueue, Rejected
from router.service_rate import ServiceRate


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _queue(capacity: int, max_queued: int, wait_s: float = 10.0) -> tuple[AdmissionQueue, Clock, list[int]]:
    clock, cap = Clock(), [capacity]
    q = AdmissionQueue(lambda: cap[0], max_queued, wait_s, ServiceRate(half_life_s=60.0), clock=clock)
    return q, clock, cap


def test_runs_within_capacity_queues_fifo_then_rejects_with_retry_after() -> None:
    q, _, _ = _queue(capacity=2, max_queued=2)
    running = [q.admit(1, 100) for _ in range(2)]
    assert all(t.granted for t in running) and q.running == 2 and q.depth == 0
    waiting = [q.admit(1, 100) for _ in range(2)]
    assert not any(t.granted for t in waiting) and q.depth == 2 and q.queued_tokens == 200
    with pytest.raises(Rejected) as e:  # no rate measured yet: the floor is the whole bound
        q.admit(1, 100)
    assert int(e.value.retry_after_header) >= 1 and "overloaded" in str(e.value)
    assert q.depth == 2, "a rejected request must not take a queue place"
    q.release(running[0], served_tokens=100)
    assert waiting[0].granted and not waiting[1].granted, "first come, first served"
    q.release(running[1])
    assert waiting[1].granted and q.depth == 0 and q.queued_tokens == 0


def test_measured_rate_raises_the_bound_beyond_the_floor() -> None:
    q, clock, _ = _queue(capacity=1, max_queued=1, wait_s=10.0)
    first = q.admit(1, 50)
    clock.t += 5.0  # 5 s busy serving 500 tokens: 100 tokens/s → 1000 queued tokens fit in 10 s
    q.release(first, served_tokens=500)
    assert q.rate.tokens_per_s(clock()) == pytest.approx(100.0, rel=0.01)
    running = q.admit(1, 50)
    assert running.granted
    queued = [q.admit(1, 300) for _ in range(3)]  # 1 by the floor, 900 tokens within the rate's 1000
    assert q.depth == 3 and q.bound_tokens() == pytest.approx(1000.0, rel=0.01)
    with pytest.raises(Rejected) as e:
        q.admit(1, 300)
    assert 1.0 <= e.value.retry_after_s <= 10.0  # ~200 tokens over the bound at 100 tokens/s
    for t in [running, *queued]:
        q.release(t)
    assert q.running == 0 and q.depth == 0


def test_cancelled_waiter_leaves_the_queue_and_wide_requests_cannot_starve() -> None:
    async def main() -> None:
        q, _, cap = _queue(capacity=2, max_queued=4)
        a = q.admit(2, 10)
        b = q.admit(1, 10)
        c = q.admit(1, 10)
        waiter = asyncio.create_task(q.wait(b))
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        q.release(b)  # what the app's finally does for a client that left while queued
        assert q.depth == 1
        q.release(a)
        await asyncio.wait_for(q.wait(c), 1)
        assert c.granted
        # n wider than the whole cluster, or no node registered at all: it still runs once nothing else does
        cap[0] = 0
        wide = q.admit(8, 10)
        assert not wide.granted
        q.release(c)
        await asyncio.wait_for(q.wait(wide), 1)
        q.release(wide)
        assert q.running == 0
        # capacity that grows (a node registered) starts queued requests on pump()
        x, y = q.admit(1, 1), q.admit(1, 1)
        assert x.granted and not y.granted
        cap[0] = 2
        q.pump()
        assert y.granted

    asyncio.run(main())


def test_service_rate_ignores_idle_time_and_needs_a_sample() -> None:
    rate = ServiceRate(half_life_s=30.0)
    assert rate.tokens_per_s(0.0) is None
    rate.set_busy(True, 0.0)
    rate.served(200, 2.0)
    rate.set_busy(False, 2.0)
    assert rate.tokens_per_s(2.0) == pytest.approx(100.0)
    # Idle time decays both sums alike: the rate is unchanged, not diluted by the idle time ...
    assert rate.tokens_per_s(12.0) == pytest.approx(100.0, rel=1e-6)
    # ... until the sample has faded: after an idle hour the old load says nothing about the next burst.
    assert rate.tokens_per_s(3602.0) is None
    with pytest.raises(ValueError):
        ServiceRate(half_life_s=0)
    with pytest.raises(ValueError):
        AdmissionQueue(lambda: 1, -1, 1.0)
