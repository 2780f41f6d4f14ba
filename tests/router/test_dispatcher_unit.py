"""The dispatcher in process, with a fake node client (no sockets, no processes): the prefill → decode hand-off,
prefill failover, local prefill, a request ended by its first token, and aborts when the caller stops early.
Decode-node loss and resume: tests/router/test_router_resume.py (whose fake client this reuses)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import pytest

from protocol import messages as P
from router.dispatcher import Dispatcher, SeqEvent, SeqRequest, SeqTrace
from router.openai_schema import ApiError
from tests.router.test_router_resume import PROMPT, jobs, register, setup, until

TRANSFER = P.KVTransferParams(["ab" * 16], num_cached_tokens=4, block_size=4, store="tcp://127.0.0.1:1")


def _run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(test())


async def _collect(dispatcher: Dispatcher, max_tokens: int, events: list[SeqEvent], trace: SeqTrace) -> None:
    req = SeqRequest("req", list(PROMPT), P.SamplingSpec(max_tokens=max_tokens, temperature=0.0))
    async with contextlib.aclosing(dispatcher.generate(req, trace)) as stream:  # as router/serving.py does
        async for event in stream:
            events.append(event)
            if event.finished:
                return


def _tokens(events: list[SeqEvent]) -> list[int]:
    return [t for e in events for t in e.token_ids]


def test_prefill_then_decode_hands_over_first_token_and_transfer_params() -> None:
    async def run() -> None:
        _, client, dispatcher = setup(decode_nodes=1)
        events: list[SeqEvent] = []
        trace = SeqTrace()
        task = asyncio.create_task(_collect(dispatcher, 4, events, trace))
        await until(lambda: jobs(client, P.PrefillJob), "the prefill job")
        node, prefill = jobs(client, P.PrefillJob)[0]
        assert node == "prefill-0" and prefill.prompt_token_ids == PROMPT and prefill.params.max_tokens == 4
        client.reply(P.PrefillDone("req", 100, False, None, TRANSFER, cache=P.CacheInfo(5, 4, 4)))
        await until(lambda: jobs(client, P.DecodeJob), "the decode job")
        node, decode = jobs(client, P.DecodeJob)[0]
        assert node == "decode-0" and decode.first_token_id == 100 and decode.kv_transfer_params == TRANSFER
        assert decode.prompt_token_ids == PROMPT and decode.params.max_tokens == 3  # the first token is produced
        client.reply(P.TokenBatch("req", [101, 102, 103], True, P.FinishReason.LENGTH, cache=P.CacheInfo(6, 4, 4)))
        await task
        assert _tokens(events) == [100, 101, 102, 103] and events[-1].finish_reason is P.FinishReason.LENGTH
        assert (trace.prefill_node, trace.decode_node, trace.prefill_attempts) == ("prefill-0", "decode-0", 1)
        assert [role for role, _ in trace.caches] == [P.NodeRole.PREFILL, P.NodeRole.DECODE]
        assert not client.aborted and not client.streams  # finished normally: nothing to abort, no stream left

    _run(run)


def test_failed_prefill_is_aborted_and_retried_on_the_other_prefill_node() -> None:
    async def run() -> None:
        reg, client, dispatcher = setup(decode_nodes=1)
        register(reg, client, "prefill-1", P.NodeRole.PREFILL)
        events: list[SeqEvent] = []
        trace = SeqTrace()
        task = asyncio.create_task(_collect(dispatcher, 2, events, trace))
        await until(lambda: jobs(client, P.PrefillJob), "the first prefill job")
        first, _ = jobs(client, P.PrefillJob)[0]
        client.reply(P.JobFailed("req", "boom"))
        await until(lambda: len(jobs(client, P.PrefillJob)) == 2, "the retried prefill job")
        second, _ = jobs(client, P.PrefillJob)[1]
        assert second != first and (first, ["req"]) in client.aborted
        client.reply(P.PrefillDone("req", 100, False))
        await until(lambda: jobs(client, P.DecodeJob), "the decode job")
        client.reply(P.TokenBatch("req", [101], True, P.FinishReason.LENGTH))
        await task
        assert _tokens(events) == [100, 101] and trace.prefill_attempts == 2 and trace.prefill_node == second

    _run(run)


def test_without_a_prefill_node_the_decode_node_prefills_locally() -> None:
    async def run() -> None:
        reg, client, dispatcher = setup(decode_nodes=1)
        reg.drop("prefill-0")
        events: list[SeqEvent] = []
        trace = SeqTrace()
        task = asyncio.create_task(_collect(dispatcher, 3, events, trace))
        await until(lambda: jobs(client, P.DecodeJob), "the decode job")
        _, job = jobs(client, P.DecodeJob)[0]
        assert job.first_token_id is None and job.kv_transfer_params is None and job.params.max_tokens == 3
        client.reply(P.TokenBatch("req", [100, 101, 102], True, P.FinishReason.LENGTH))
        await task
        assert _tokens(events) == [100, 101, 102] and trace.local_prefill and not jobs(client, P.PrefillJob)

    _run(run)


@pytest.mark.parametrize("max_tokens,stopped", [(8, True), (1, False)], ids=["eos-first", "max-tokens-1"])
def test_a_request_ended_by_its_first_token_sends_no_decode_job(max_tokens: int, stopped: bool) -> None:
    async def run() -> None:
        _, client, dispatcher = setup(decode_nodes=1)
        events: list[SeqEvent] = []
        task = asyncio.create_task(_collect(dispatcher, max_tokens, events, SeqTrace()))
        await until(lambda: jobs(client, P.PrefillJob), "the prefill job")
        reason = P.FinishReason.STOP if stopped else None
        client.reply(P.PrefillDone("req", 2, stopped, reason))
        await task
        assert _tokens(events) == [2] and events[-1].finished and not jobs(client, P.DecodeJob)
        assert events[-1].finish_reason is (P.FinishReason.STOP if stopped else P.FinishReason.LENGTH)

    _run(run)


def test_caller_stopping_early_aborts_the_decode_job() -> None:
    async def run() -> None:
        _, client, dispatcher = setup(decode_nodes=1)
        req = SeqRequest("req", list(PROMPT), P.SamplingSpec(max_tokens=50))
        stream = dispatcher.generate(req, SeqTrace())
        first = asyncio.create_task(anext(stream))
        await until(lambda: jobs(client, P.PrefillJob), "the prefill job")
        client.reply(P.PrefillDone("req", 100, False))
        assert (await first).token_ids == [100]
        second = asyncio.create_task(anext(stream))
        await until(lambda: jobs(client, P.DecodeJob), "the decode job")
        client.reply(P.TokenBatch("req", [101]))
        assert (await second).token_ids == [101]
        await stream.aclose()  # a stop string matched, or the client went away
        assert client.aborted == [("decode-0", ["req"])] and not client.streams

    _run(run)


def test_a_failed_decode_job_is_a_500_and_no_decode_node_a_503() -> None:
    async def run() -> None:
        reg, client, dispatcher = setup(decode_nodes=1)
        task = asyncio.create_task(_collect(dispatcher, 4, [], SeqTrace()))
        await until(lambda: jobs(client, P.PrefillJob), "the prefill job")
        client.reply(P.PrefillDone("req", 100, False))
        await until(lambda: jobs(client, P.DecodeJob), "the decode job")
        client.reply(P.JobFailed("req", "engine step failed"))
        with pytest.raises(ApiError) as failed:
            await task
        assert failed.value.status == 500 and "engine step failed" in str(failed.value)
        reg.drop("decode-0")
        with pytest.raises(ApiError) as none:
            dispatcher.check_available()
        assert none.value.status == 503

    _run(run)


def test_cost_pairing_prices_the_store_and_counts_the_queue_ahead() -> None:
    """With the store's tiers indexed, a prompt whose blocks the store holds is priced as loads: the node is charged
    only the tokens left to compute (its queued tokens while the job is out), and they are given back after."""
    from common.kv_events.events import MEDIUM_CPU, KVEventBatch, block_stored
    from router.kv_index import STORE_SOURCE, KVIndex

    async def run() -> None:
        reg, client, dispatcher = setup(decode_nodes=1)
        register(reg, client, "prefill-1", P.NodeRole.PREFILL)
        index = KVIndex()
        try:
            dispatcher.prefix_index = index
            prompt = list(range(100, 140))  # 10 full blocks of 4
            keys = reg.prompt_keys(prompt, None)
            for node_id in ("prefill-0", "prefill-1"):
                index.attach(node_id, "a")
            index.attach(STORE_SOURCE, "store")
            index.ingest(STORE_SOURCE, KVEventBatch(ts=0.0, events=[block_stored(keys[:8], None, [], 4, MEDIUM_CPU)]))
            reg.nodes["prefill-0"].queued_tokens = 30  # another prompt's tokens ahead there
            req = SeqRequest("req", prompt, P.SamplingSpec(max_tokens=1, temperature=0.0))
            task = asyncio.create_task(dispatcher._prefill(req, SeqTrace()))
            await until(lambda: jobs(client, P.PrefillJob), "the prefill job")
            node, _ = jobs(client, P.PrefillJob)[0]
            assert node == "prefill-1"
            assert reg.nodes["prefill-1"].queued_tokens == 40 - 8 * 4  # what is left after the store's 8 blocks
            client.reply(P.PrefillDone("req", 7, False))
            assert (await task) is not None
            assert reg.nodes["prefill-1"].queued_tokens == 0 and reg.nodes["prefill-0"].queued_tokens == 30
        finally:
            index.close()

    _run(run)
