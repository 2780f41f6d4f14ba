"""Which vLLM instance the router picks (router/vllm_pool.py), over real HTTP: stand-ins for `vllm serve` whose
/metrics are vLLM 0.32's series, and the router's real KVIndex fed by real ZeroMQ frames in vLLM's event format
(its own int block hashes, token ids, parent hashes), re-keyed from the token ids (router/vllm_block_keys.py).

The real thing: tests/router/test_kv_index_vllm.py (a real `vllm serve` publishing, re-keyed and looked up by the
prompt's ids; its real /metrics parsed)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from common.auth import generate_keys
from common.kv_events.config import KVEventsConfig
from common.kv_events.events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from common.kv_events.publisher import ZmqEventPublisher
from protocol import messages as P
from router.config import RouterConfig
from router.kv_index import STORE_MEDIA, STORE_SOURCE, KVIndex
from router.pairing_policy import PairingPolicy
from router.vllm_app import create_vllm_app
from router.vllm_backend import BackendRole, VllmBackend
from router.vllm_block_keys import VLLM_ROOT, Rechain, prompt_keys
from router.vllm_scrape import BadMetrics, parse_vllm_metrics
from tests.cluster_helpers import wait_until
from tests.router.test_router_vllm_proxy import MODEL, FakeVllm, metrics_text, serving

BS = 16  # the stand-ins' block size (their /metrics' cache_config_info)
PROMPT = list(range(1000, 1050))  # 50 tokens: 3 full blocks
OTHER = list(range(2000, 2050))
DEVICE = (MEDIUM_GPU, MEDIUM_CPU)


def vllm_stored(tokens: list[int], blocks: int, first_hash: int, medium: str = MEDIUM_GPU) -> BlockStored:
    """What vLLM announces for a prompt's first `blocks` blocks: its own int hashes, parent None, their tokens."""
    return BlockStored(
        block_hashes=[first_hash + i for i in range(blocks)],
        parent_block_hash=None,
        token_ids=tokens[: blocks * BS],
        block_size=BS,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )


# ---------------------------------------------------------------------- the parts


def test_vllm_metrics_are_read() -> None:
    load = parse_vllm_metrics(metrics_text(3, 2, block_size=128, num_blocks=400, usage=0.25, steps=10, tokens=700))
    assert (load.running, load.waiting, load.block_size, load.num_blocks) == (3, 2, 128, 400)
    assert (load.kv_usage, load.steps, load.computed_tokens) == (0.25, 10, 700)
    with pytest.raises(BadMetrics):
        parse_vllm_metrics("# TYPE x counter\nx_total 1\n")

    # Steps and tokens between scrapes fit the instance's cost as heartbeats fit a node's (router/step_cost.py).
    backend = VllmBackend("http://127.0.0.1:1", BackendRole.PREFILL, max_num_seqs=4)
    steps = tokens = now = 0.0
    for n in (100, 300, 50, 200, 400, 100):  # a step of n tokens takes 20 ms + 5 ms a token
        steps, tokens, now = steps + 1, tokens + n, now + 0.02 + 0.005 * n
        backend.observe(parse_vllm_metrics(metrics_text(steps=steps, tokens=tokens, num_blocks=64, usage=0.5)), now)
    assert backend.cost.prefill_token_s == pytest.approx(0.005)
    assert backend.cost.step_s == pytest.approx(0.02)
    assert (backend.info.block_size, backend.info.num_blocks, backend.free_blocks) == (16, 64, 32)


def test_vllm_hashes_are_rechained_from_their_tokens() -> None:
    index = KVIndex()
    try:
        index.attach("d", "one", rechain=True)
        keys = prompt_keys(PROMPT, BS)
        index.ingest("d", KVEventBatch(ts=0.0, events=[vllm_stored(PROMPT, 2, 7)]))
        assert index.depth("d", keys, DEVICE) == 2 and index.depth("d", prompt_keys(OTHER, BS), DEVICE) == 0
        # The third block, a child of vLLM's hash 8, and the same prompt's blocks again under other hashes.
        third = BlockStored(
            block_hashes=[9],
            parent_block_hash=8,
            token_ids=PROMPT[2 * BS : 3 * BS],
            block_size=BS,
            lora_id=None,
            medium=MEDIUM_GPU,
            lora_name=None,
        )
        index.ingest("d", KVEventBatch(ts=0.0, events=[third, vllm_stored(PROMPT, 2, 70)]))
        assert index.depth("d", keys, DEVICE) == 3
        # Block 7 leaves; block 70 (the same tokens) still holds it. Then 70 leaves too.
        index.ingest("d", KVEventBatch(ts=0.0, events=[BlockRemoved(block_hashes=[7], medium=MEDIUM_GPU)]))
        assert index.depth("d", keys, DEVICE) == 3
        index.ingest("d", KVEventBatch(ts=0.0, events=[BlockRemoved(block_hashes=[70], medium=MEDIUM_GPU)]))
        assert index.depth("d", keys, DEVICE) == 0
        index.ingest("d", KVEventBatch(ts=0.0, events=[AllBlocksCleared()]))
        assert index.blocks("d") == frozenset()
    finally:
        index.close()

    # The store's first block hangs off the plugin's root key, which no event names: it starts our chain.
    rechain = Rechain()
    stored = rechain.event(
        BlockStored(
            block_hashes=[b"k" * 16],
            parent_block_hash=b"r" * 16,
            token_ids=PROMPT[:BS],
            block_size=BS,
            lora_id=None,
            medium=MEDIUM_CPU,
            lora_name=None,
        )
    )
    assert isinstance(stored, BlockStored) and stored.block_hashes == prompt_keys(PROMPT, BS)[:1]
    assert prompt_keys(PROMPT, BS)[0] != VLLM_ROOT


# ---------------------------------------------------------------------- the choice, over HTTP and ZeroMQ


class Publisher:
    """A KV event publisher as `vllm serve --kv-events-config` runs one (vLLM's wire format, ZeroMQ PUB + replay)."""

    def __init__(self, tmp_path: Path, name: str) -> None:
        self.pub = ZmqEventPublisher(
            KVEventsConfig(
                enable_kv_cache_events=True,
                endpoint=f"ipc://{tmp_path}/{name}-pub",
                replay_endpoint=f"ipc://{tmp_path}/{name}-replay",
            )
        )

    @property
    def endpoint(self) -> P.KVEventsEndpoint:
        return P.KVEventsEndpoint(self.pub.endpoint, self.pub.replay_endpoint, "")


@contextmanager
def cluster(
    tmp_path: Path, instances: dict[str, FakeVllm], roles: dict[str, BackendRole], store: bool = False, **config: Any
) -> Iterator[tuple[httpx.Client, dict[str, str], dict[str, Publisher], KVIndex]]:
    """The stand-ins served, each with an event publisher, and a router fronting them with their events indexed."""
    with ExitStack() as stack:
        urls = {name: stack.enter_context(serving(fake.app())) for name, fake in instances.items()}
        pubs = {name: Publisher(tmp_path, name) for name in [*instances, *(["store"] if store else [])]}
        for p in pubs.values():
            stack.callback(p.pub.close)
        cfg = RouterConfig(
            port=0,
            served_model_name=MODEL,
            vllm_prefill=tuple(urls[n] for n in instances if roles[n] is BackendRole.PREFILL),
            vllm_decode=tuple(urls[n] for n in instances if roles[n] is BackendRole.DECODE),
            vllm_kv_events=tuple((urls[n], pubs[n].endpoint) for n in instances),
            store_events=pubs["store"].endpoint if store else None,
            vllm_max_num_seqs=4,
            **config,
        )
        app = create_vllm_app(cfg)
        url = stack.enter_context(serving(app))
        client = stack.enter_context(httpx.Client(base_url=url, timeout=30))
        yield client, urls, pubs, app.state.kv_index


def complete(client: httpx.Client, prompt: list[int]) -> None:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
    assert r.status_code == 200, r.text


def node_id(role: BackendRole, url: str) -> str:
    return VllmBackend(url, role).node_id


def scraped(client: httpx.Client, name: str, **want: int) -> bool:
    backends = client.get("/health").json()["backends"]
    return all(backends[name][k] == v for k, v in want.items())


def test_the_producer_holding_the_prompt_prefills_it_until_its_queue_outweighs_that(tmp_path) -> None:
    p1, p2, d = FakeVllm("p1"), FakeVllm("p2"), FakeVllm("d")
    roles = {"p1": BackendRole.PREFILL, "p2": BackendRole.PREFILL, "d": BackendRole.DECODE}
    with cluster(tmp_path, {"p1": p1, "p2": p2, "d": d}, roles) as (client, urls, pubs, index):
        keys = prompt_keys(PROMPT, BS)
        p2_id = node_id(BackendRole.PREFILL, urls["p2"])
        pubs["p2"].pub.publish([vllm_stored(PROMPT, 2, 1)])
        wait_until("p2's blocks indexed", lambda: index.depth(p2_id, keys, DEVICE) == 2, 10)
        # Idle producers would take turns; the one holding 2 of the prompt's 3 blocks computes 18 tokens, not 50.
        for _ in range(3):
            complete(client, PROMPT)
        assert (len(p1.bodies), len(p2.bodies)) == (0, 3)
        metrics = client.get("/metrics").text
        assert (
            "ucm_vllm_prefill_prompt_tokens_total 150" in metrics
            and "ucm_vllm_prefill_reused_tokens_total 96" in metrics
        )
        # A prompt nobody holds goes round them.
        for _ in range(2):
            complete(client, OTHER)
        assert (len(p1.bodies), len(p2.bodies)) == (1, 4)

        # p2's /metrics: 2 requests waiting that the router did not send, 100 prompt tokens computed per request
        # on average there: 200 tokens ahead + 18 > 50 on p1.
        p2.waiting, p2.prefills, p2.prefill_tokens = 2, 10, 1000
        wait_until(
            "p2's queue scraped", lambda: scraped(client, node_id(BackendRole.PREFILL, urls["p2"]), waiting=2), 10
        )
        complete(client, PROMPT)
        assert (len(p1.bodies), len(p2.bodies)) == (2, 4)

        # Never past admission: at its bound (running + waiting >= --max-num-seqs 4) p2 gets nothing it could take.
        p2.waiting, p2.prefills, p2.prefill_tokens = 4, 0, 0
        wait_until("p2 at its bound", lambda: scraped(client, node_id(BackendRole.PREFILL, urls["p2"]), waiting=4), 10)
        complete(client, PROMPT)
        assert (len(p1.bodies), len(p2.bodies)) == (3, 4)


def test_a_producer_is_not_priced_with_the_store_s_blocks(tmp_path) -> None:
    """A kv_producer saves and never loads: the store holding the whole prompt makes no producer cheaper. p1 holds 2
    blocks and has 20 tokens queued (18 + 20 to compute), p2 nothing (50): p1, with the store's blocks indexed too
    (priced as loads, p2 would compute 2 tokens and win)."""
    p1, p2, d = FakeVllm("p1", waiting=1, prefills=1, prefill_tokens=20), FakeVllm("p2"), FakeVllm("d")
    roles = {"p1": BackendRole.PREFILL, "p2": BackendRole.PREFILL, "d": BackendRole.DECODE}
    with cluster(tmp_path, {"p1": p1, "p2": p2, "d": d}, roles, store=True) as (client, urls, pubs, index):
        keys = prompt_keys(PROMPT, BS)
        pubs["p1"].pub.publish([vllm_stored(PROMPT, 2, 1)])
        # The store daemon's tiers, as ucm/tier_events.py announces them: its keys, the plugin's root as parent.
        pubs["store"].pub.publish(
            [
                BlockStored(
                    block_hashes=[bytes([i]) * 16 for i in range(1, 4)],
                    parent_block_hash=b"r" * 16,
                    token_ids=PROMPT[: 3 * BS],
                    block_size=BS,
                    lora_id=None,
                    medium=MEDIUM_STORAGE,
                    lora_name=None,
                )
            ]
        )
        p1_id = node_id(BackendRole.PREFILL, urls["p1"])
        wait_until("p1's blocks indexed", lambda: index.depth(p1_id, keys, DEVICE) == 2, 10)
        wait_until("the store's blocks indexed", lambda: index.depth(STORE_SOURCE, keys, STORE_MEDIA) == 3, 10)
        wait_until("p1's queue scraped", lambda: scraped(client, p1_id, waiting=1), 10)
        for _ in range(2):
            complete(client, PROMPT)
        assert (len(p1.bodies), len(p2.bodies)) == (2, 0)
        assert 'ucm_kv_index_blocks{source="<store>",medium="STORAGE"} 3' in client.get("/metrics").text


def test_the_consumer_holding_the_prompt_decodes_it(tmp_path) -> None:
    p, d1, d2 = FakeVllm("p"), FakeVllm("d1"), FakeVllm("d2")
    roles = {"p": BackendRole.PREFILL, "d1": BackendRole.DECODE, "d2": BackendRole.DECODE}
    # With CURVE keys (`up` gives them for the store's events) vLLM's own publishers are still read plain.
    auth = generate_keys(tmp_path / "keys").router_auth()
    with cluster(tmp_path, {"p": p, "d1": d1, "d2": d2}, roles, node_auth=auth) as (client, urls, pubs, index):
        keys = prompt_keys(PROMPT, BS)
        pubs["d2"].pub.publish([vllm_stored(PROMPT, 3, 1, medium=MEDIUM_CPU)])  # vLLM-CPU may say CPU: its own
        wait_until(
            "d2's blocks indexed", lambda: index.depth(node_id(BackendRole.DECODE, urls["d2"]), keys, DEVICE) == 3, 10
        )
        for _ in range(3):
            complete(client, PROMPT)
        assert (len(d1.bodies), len(d2.bodies)) == (0, 3), "every other consumer would load the prompt first"


def test_least_loaded_is_still_selectable(tmp_path) -> None:
    p1, p2, d = FakeVllm("p1"), FakeVllm("p2", running=1), FakeVllm("d")
    roles = {"p1": BackendRole.PREFILL, "p2": BackendRole.PREFILL, "d": BackendRole.DECODE}
    with cluster(tmp_path, {"p1": p1, "p2": p2, "d": d}, roles, pairing=PairingPolicy.LEAST_LOADED) as (
        client,
        urls,
        pubs,
        index,
    ):
        keys = prompt_keys(PROMPT, BS)
        pubs["p2"].pub.publish([vllm_stored(PROMPT, 3, 1)])
        wait_until(
            "p2's blocks indexed", lambda: index.depth(node_id(BackendRole.PREFILL, urls["p2"]), keys, DEVICE) == 3, 10
        )
        for _ in range(2):
            complete(client, PROMPT)
        assert (len(p1.bodies), len(p2.bodies)) == (2, 0), "least-loaded ignores what p2 holds"
