"""The dispatcher resumes a sequence whose decode node was lost: on another decode node, or on one that registers
later, from the tokens already produced; and fails with a clear 503 once the wait is over. A fake node client
stands in for ZeroMQ (the real path is tests/cluster/test_faults_cluster.py)."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from protocol import messages as P
from router.dispatcher import Dispatcher, SeqRequest, SeqTrace
from router.node_client import NodeLost
from router.openai_schema import ApiError
from router.registry import NodeState, Registry

PROMPT = [11, 12, 13, 14, 15]


def register(reg: Registry, client: FakeClient, node_id: str, role: P.NodeRole) -> None:
    msg = P.Register(
        node_id=node_id,
        role=role,
        model="m",
        model_fingerprint="fp",
        dtype="float32",
        block_size=4,
        max_model_len=512,
        capacity=4,
        num_blocks=64,
        has_store=True,
        instance=uuid.uuid4().hex,
    )
    welcome, _ = reg.register(msg)
    assert welcome.accepted, welcome.reason
    for callback in client.on_node_event:
        callback(node_id, "registered")


class FakeClient:
    """NodeClient's surface as the dispatcher uses it; jobs are recorded, replies pushed by the test."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.on_node_event: list = []
        self.sent: list[tuple[str, P.Message]] = []
        self.aborted: list[tuple[str, list[str]]] = []
        self.streams: dict[str, tuple[str, asyncio.Queue]] = {}

    def open(self, request_id: str, node: NodeState) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        self.streams[request_id] = (node.node_id, queue)
        return queue

    def close_stream(self, request_id: str) -> None:
        self.streams.pop(request_id, None)

    async def send(self, node_id: str, msg: P.Message) -> None:
        self.sent.append((node_id, msg))

    async def abort(self, node_id: str, request_ids: list[str]) -> None:
        self.aborted.append((node_id, request_ids))

    def reply(self, msg: P.Message) -> None:
        self.streams[msg.request_id][1].put_nowait(msg)

    def lose(self, node_id: str) -> None:
        """What NodeClient does when a node misses its heartbeats."""
        self.registry.drop(node_id)
        for node, queue in list(self.streams.values()):
            if node == node_id:
                queue.put_nowait(NodeLost(node_id, "killed"))


async def until(condition, what: str) -> None:
    for _ in range(10_000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never happened: {what}")


async def collect(dispatcher: Dispatcher, max_tokens: int, out: list[int]) -> SeqTrace:
    trace = SeqTrace()
    req = SeqRequest("req", list(PROMPT), P.SamplingSpec(max_tokens=max_tokens, temperature=0.0))
    async for event in dispatcher.generate(req, trace):
        out.extend(event.token_ids)
        if event.finished:
            break
    return trace


def setup(decode_nodes: int, wait_s: float = 60.0) -> tuple[Registry, FakeClient, Dispatcher]:
    reg = Registry("m")
    client = FakeClient(reg)
    dispatcher = Dispatcher(client, decode_wait_s=wait_s)  # type: ignore[arg-type]
    register(reg, client, "prefill-0", P.NodeRole.PREFILL)
    for i in range(decode_nodes):
        register(reg, client, f"decode-{i}", P.NodeRole.DECODE)
    return reg, client, dispatcher


def jobs(client: FakeClient, kind: type) -> list[tuple[str, P.Message]]:
    return [(n, m) for n, m in client.sent if isinstance(m, kind)]


async def prefill(client: FakeClient, first: int) -> None:
    await until(lambda: jobs(client, P.PrefillJob), "the prefill job")
    client.reply(P.PrefillDone("req", first, False, kv_transfer_params={"block_keys": ["ab"]}))


def test_decode_node_lost_mid_stream_resumes_on_the_other_one() -> None:
    async def run() -> None:
        _, client, dispatcher = setup(decode_nodes=2)
        out: list[int] = []
        task = asyncio.create_task(collect(dispatcher, 6, out))
        await prefill(client, 100)
        await until(lambda: jobs(client, P.DecodeJob), "the decode job")
        node, job = jobs(client, P.DecodeJob)[0]
        assert job.first_token_id == 100 and job.params.max_tokens == 5 and job.prompt_token_ids == PROMPT
        client.reply(P.TokenBatch(job.request_id, [101, 102]))
        await until(lambda: out == [100, 101, 102], "the first tokens to reach the caller")
        client.lose(node)
        await until(lambda: len(jobs(client, P.DecodeJob)) == 2, "the resumed job")
        other, resumed = jobs(client, P.DecodeJob)[1]
        assert other != node and resumed.request_id != job.request_id
        # The last token the caller got becomes the job's first token: the node samples its successor.
        assert resumed.prompt_token_ids == [*PROMPT, 100, 101] and resumed.first_token_id == 102
        assert resumed.params.max_tokens == 3 and resumed.kv_transfer_params == {"block_keys": ["ab"]}
        assert (node, [job.request_id]) in client.aborted
        client.reply(P.TokenBatch(resumed.request_id, [103, 104, 105], True, P.FinishReason.LENGTH))
        trace = await task
        assert out == [100, 101, 102, 103, 104, 105] and trace.decode_resumes == 1

    asyncio.run(run())


def test_only_decode_node_lost_waits_for_a_new_one_to_register() -> None:
    async def run() -> None:
        reg, client, dispatcher = setup(decode_nodes=1)
        out: list[int] = []
        task = asyncio.create_task(collect(dispatcher, 4, out))
        await prefill(client, 100)
        await until(lambda: jobs(client, P.DecodeJob), "the decode job")
        _, job = jobs(client, P.DecodeJob)[0]
        client.reply(P.TokenBatch(job.request_id, [101]))
        await until(lambda: out == [100, 101], "the first tokens")
        client.lose("decode-0")
        await until(lambda: not client.streams, "the lost job's stream to close")
        for _ in range(100):
            await asyncio.sleep(0)
        assert len(jobs(client, P.DecodeJob)) == 1 and not task.done()  # held, not failed
        register(reg, client, "decode-0", P.NodeRole.DECODE)  # restarted: a new incarnation, same id
        await until(lambda: len(jobs(client, P.DecodeJob)) == 2, "the resumed job")
        node, resumed = jobs(client, P.DecodeJob)[1]
        assert node == "decode-0" and resumed.first_token_id == 101 and resumed.params.max_tokens == 2
        client.reply(P.TokenBatch(resumed.request_id, [102, 103], True, P.FinishReason.LENGTH))
        await task
        assert out == [100, 101, 102, 103]

    asyncio.run(run())


def test_no_decode_node_within_the_wait_is_a_503() -> None:
    async def run() -> None:
        _, client, dispatcher = setup(decode_nodes=1, wait_s=0.05)
        out: list[int] = []
        task = asyncio.create_task(collect(dispatcher, 4, out))
        await prefill(client, 100)
        await until(lambda: jobs(client, P.DecodeJob), "the decode job")
        client.lose("decode-0")
        with pytest.raises(ApiError) as e:
            await task
        assert e.value.status == 503 and "no decode node" in str(e.value)

    asyncio.run(run())


def test_node_lost_after_its_last_token_finishes_the_sequence() -> None:
    async def run() -> None:
        _, client, dispatcher = setup(decode_nodes=1, wait_s=0.05)
        out: list[int] = []
        task = asyncio.create_task(collect(dispatcher, 3, out))
        await prefill(client, 100)
        await until(lambda: jobs(client, P.DecodeJob), "the decode job")
        _, job = jobs(client, P.DecodeJob)[0]
        client.reply(P.TokenBatch(job.request_id, [101, 102]))  # every token, but the node died before `finished`
        await until(lambda: out == [100, 101, 102], "the tokens")
        client.lose("decode-0")
        await task
        assert out == [100, 101, 102] and len(jobs(client, P.DecodeJob)) == 1

    asyncio.run(run())
