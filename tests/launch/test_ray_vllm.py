"""`ucm-serve up --ray --engine vllm` on a local Ray: the store, a vLLM prefill instance, a vLLM decode instance and the
router fronting them, each a Ray actor (launch/ray/vllm_actors.py). A chat completion through the router is served
with the prompt's blocks loaded by the decode instance from the store (`cached_tokens`); `status` lists the actors
and the instances as nodes; scaling is refused. Two vLLM starts in parallel: minutes on a 2-core host.
"""

from __future__ import annotations

import httpx
import pytest

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

# needs ray: imported after the skip
from launch.ray.deploy import connect, deploy
from launch.ray.spec import ActorRole, DeploymentSpec, NodeKind
from launch.ray.status import ActorState
from launch.serving_engine import ServingEngine

QUESTION = "You answer questions about trains: timetables, fares, refunds and luggage rules. " * 12 + "Refunds?"


@pytest.mark.timeout(1500)
def test_up_ray_engine_vllm_serves_pd_through_the_store(vllm_venv) -> None:
    connect(None, log_to_driver=False)
    spec = DeploymentSpec(name="ucm-vllm-test", engine=ServingEngine.VLLM, port=0, max_nodes_per_kind=1)
    deployment = deploy(spec, timeout_s=900)
    try:
        status = deployment.status()
        running = {a.name: a for a in status.actors if a.state is ActorState.RUNNING}
        assert set(running) == {"store", "router", "prefill-0", "decode-0"}, status
        assert running["router"].role is ActorRole.ROUTER and running["decode-0"].node is not None
        body = {
            "model": spec.model,
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 8,
            "temperature": 0,
        }
        r = httpx.post(status.url + "/v1/chat/completions", json=body, timeout=600)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] >= 128 and usage["prompt_tokens_details"]["cached_tokens"] >= 128, usage
        with pytest.raises(Exception, match="not supported"):
            deployment.scale(NodeKind.DECODE, 1)
    finally:
        deployment.shutdown()
        ray.shutdown()
