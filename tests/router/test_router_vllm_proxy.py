"""The router fronting vLLM instances (router/vllm_app.py), over real HTTP, against stand-ins for `vllm serve`: what
the prefill instance is sent (vLLM's disaggregated-prefill parameters), that the decode instance gets the client's
request unchanged and its answer or stream reaches the client as is, that a dead prefill or decode instance costs no
request (the next one takes it), that vLLM's 4xx reach the client, and the router's own 4xx. Runs without vLLM; the
real thing is tests/connector/test_vllm_pd_e2e.py."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from launch.ports import free_port
from router.config import RouterConfig
from router.pairing_policy import PairingPolicy
from router.vllm_app import create_vllm_app
from tests.cluster_helpers import wait_until

MODEL = "smollm2-135m"
CACHED = 128


def metrics_text(
    running: int = 0,
    waiting: int = 0,
    block_size: int = 16,
    num_blocks: int = 64,
    usage: float = 0.0,
    steps: float = 0.0,
    tokens: float = 0.0,
    prefills: float = 0.0,
    prefill_tokens: float = 0.0,
) -> str:
    """A vLLM 0.32 /metrics body with the series the router reads (router/vllm_scrape.py), as vLLM writes them."""
    labels = f'engine="0",model_name="{MODEL}"'

    def histogram(name: str, doc: str, count: float, total: float) -> str:
        return (
            f"# HELP {name} {doc}\n# TYPE {name} histogram\n"
            f'{name}_bucket{{{labels},le="+Inf"}} {count}\n'
            f"{name}_count{{{labels}}} {count}\n{name}_sum{{{labels}}} {total}\n"
        )

    return (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        f"vllm:num_requests_running{{{labels}}} {running}.0\n"
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        f"vllm:num_requests_waiting{{{labels}}} {waiting}.0\n"
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f"vllm:kv_cache_usage_perc{{{labels}}} {usage}\n"
        + histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", steps, tokens)
        + histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            prefills,
            prefill_tokens,
        )
        + "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        "# TYPE vllm:cache_config_info gauge\n"
        f'vllm:cache_config_info{{block_size="{block_size}",cache_dtype="auto",engine="0",'
        f'num_gpu_blocks="{num_blocks}",prefix_caching_hash_algo="sha256"}} 1.0\n'
    )


@dataclass
class FakeVllm:
    """What a vLLM instance answers, enough for the proxy: a JSON completion or an SSE stream; `status` other than
    200 answers every generation request with that status."""

    name: str
    status: int = 200
    bodies: list[dict[str, Any]] = field(default_factory=list)
    running: int = 0  # what its /metrics report (the router's choice reads it)
    waiting: int = 0
    prefills: float = 0.0
    prefill_tokens: float = 0.0

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200)

        @app.get("/metrics")
        async def metrics() -> Response:
            text = metrics_text(self.running, self.waiting, prefills=self.prefills, prefill_tokens=self.prefill_tokens)
            return Response(text, media_type="text/plain")

        async def generate(request: Request) -> Response:
            body = json.loads(await request.body())
            self.bodies.append(body)
            if self.status != 200:
                error = {"error": {"message": f"{self.name} refuses", "type": "BadRequestError", "code": self.status}}
                return JSONResponse(error, status_code=self.status)
            usage = {"prompt_tokens": 200, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": CACHED}}
            if not body.get("stream"):
                return JSONResponse({"from": self.name, "choices": [{"text": "a b c"}], "usage": usage})

            async def events() -> Any:
                for word in ("a", " b", " c"):
                    yield f"data: {json.dumps({'from': self.name, 'choices': [{'text': word}]})}\n\n"
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        app.post("/v1/completions")(generate)
        app.post("/v1/chat/completions")(generate)
        return app


@contextmanager
def serving(app: FastAPI) -> Iterator[str]:
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, loop="asyncio", log_level="warning"))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(server.serve(),), daemon=True)
    thread.start()
    try:
        wait_until("a server to start", lambda: server.started, 30)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens: connection refused, as for a killed instance


@contextmanager
def dying() -> Iterator[str]:
    """An instance that passes its health check and dies on a generation request: the connection closes with no
    answer, as when vLLM is killed mid-request."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if head.startswith(b"GET /health"):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            await writer.drain()
        writer.close()

    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", 0))
    port = server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


@contextmanager
def router(prefill: list[str], decode: list[str], **config: Any) -> Iterator[httpx.Client]:
    cfg = RouterConfig(
        port=0, served_model_name=MODEL, vllm_prefill=tuple(prefill), vllm_decode=tuple(decode), **config
    )
    with serving(create_vllm_app(cfg)) as url, httpx.Client(base_url=url, timeout=30) as client:
        yield client


def chat(stream: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    return {**body, "stream": True, "stream_options": {"include_usage": True}, "n": 1} if stream else body


def test_prefill_then_decode_relays_the_consumer_answer() -> None:
    p, d = FakeVllm("p"), FakeVllm("d")
    with serving(p.app()) as p_url, serving(d.app()) as d_url, router([p_url], [d_url]) as client:
        r = client.post("/v1/chat/completions", json=chat())
        assert r.status_code == 200, r.text
        assert r.json()["from"] == "d" and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == CACHED
        [pre] = p.bodies
        assert pre["max_tokens"] == 1 and pre["stream"] is False
        assert pre["kv_transfer_params"]["do_remote_decode"] is True
        assert pre["messages"] == chat()["messages"]
        assert d.bodies == [chat()], "the decode instance gets the client's request unchanged"

        with client.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as s:
            assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
            text = "".join(s.iter_text())
        assert '"from": "d"' in text and '"cached_tokens": 128' in text and text.endswith("data: [DONE]\n\n")
        pre = p.bodies[-1]
        assert "stream_options" not in pre and "n" not in pre and pre["stream"] is False and pre["max_tokens"] == 1
        # A resumable stream: the router asks for token ids (router/vllm_resume.py), nothing else changes.
        assert d.bodies[-1] == {**chat(stream=True), "return_token_ids": True}

        health = client.get("/health").json()
        assert health["engine"] == "vllm" and all(b["alive"] for b in health["backends"].values())


def test_a_dead_instance_costs_no_request() -> None:
    p, d = FakeVllm("p"), FakeVllm("d")
    with (
        serving(p.app()) as p_url,
        serving(d.app()) as d_url,
        dying() as dead_p,
        dying() as dead_d,
        router([dead_p, p_url], [dead_d, d_url], decode_wait_s=5.0) as client,
    ):
        dead = (
            f'ucm_vllm_backend_failures_total{{role="prefill",url="{dead_p}"}} 0',
            f'ucm_vllm_backend_failures_total{{role="decode",url="{dead_d}"}} 0',
        )
        # Idle instances are priced alike and taken in turn, and a dying one passes its health check again: requests
        # go on until each dying one was chosen (and failed) at least once. Every one of them is served.
        sent = 0
        while sent < 20 and any(line in client.get("/metrics").text for line in dead):
            with client.stream("POST", "/v1/completions", json={**chat(sent % 2 == 1), "prompt": "hi"}) as r:
                assert r.status_code == 200, r.read()
                assert '"from": "d"' in r.read().decode().replace('"from":"d"', '"from": "d"')
            sent += 1
        metrics = client.get("/metrics").text
        assert not any(line in metrics for line in dead), metrics
        assert len(p.bodies) == sent and len(d.bodies) == sent
        for line in ("ucm_vllm_prefill_retries_total 0", "ucm_vllm_decode_retries_total 0"):
            assert line not in metrics, metrics


def test_a_failing_decode_instance_hands_over_and_no_prefill_instance_means_the_consumer_computes() -> None:
    # d reports a request running: the least loaded is the broken one, tried first.
    broken, d = FakeVllm("broken", status=500), FakeVllm("d", running=1)
    least = PairingPolicy.LEAST_LOADED
    with (
        serving(broken.app()) as b_url,
        serving(d.app()) as d_url,
        router([dead_url()], [b_url, d_url], pairing=least) as client,
    ):
        r = client.post("/v1/completions", json={**chat(), "prompt": "hi"})
        assert r.status_code == 200 and r.json()["from"] == "d"
        assert len(broken.bodies) == 1, "the 500 was tried once, then the request went to the next instance"
        metrics = client.get("/metrics").text
        assert "ucm_vllm_prefills_skipped_total 1" in metrics and "ucm_vllm_decode_retries_total 1" in metrics


@dataclass
class CountingVllm:
    """A stand-in decode instance whose greedy answer is deterministic from its prompt's token ids: each new token is
    the previous one + 1, text " t<id>". `die_after`: the stream breaks (connection lost, no end) after that many
    tokens, as when vLLM is killed mid-stream."""

    die_after: int | None = None
    bodies: list[dict[str, Any]] = field(default_factory=list)
    running: int = 0  # what its /metrics report (the router's choice reads it)

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200)

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(metrics_text(self.running), media_type="text/plain")

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            body = json.loads(await request.body())
            self.bodies.append(body)
            prompt = body["prompt"] if isinstance(body["prompt"], list) else [100, 101, 102]
            ids = body.get("return_token_ids")

            async def events() -> Any:
                last = prompt[-1]
                for k in range(body["max_tokens"]):
                    if self.die_after is not None and k == self.die_after:
                        raise ConnectionError("killed")  # uvicorn drops the connection mid-body
                    last += 1
                    choice: dict[str, Any] = {"index": 0, "text": f" t{last}", "finish_reason": None}
                    if ids:
                        choice["token_ids"] = [last]
                        if k == 0:
                            choice["prompt_token_ids"] = prompt
                    if k == body["max_tokens"] - 1:
                        choice["finish_reason"] = "length"
                    yield f"data: {json.dumps({'choices': [choice]})}\n\n"
                usage = {"prompt_tokens": len(prompt), "completion_tokens": body["max_tokens"]}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            body = json.loads(await request.body())
            self.bodies.append(body)
            prompt = CHAT_PROMPT_IDS  # the chat template applied
            ids = body.get("return_token_ids")
            head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": MODEL}

            async def events() -> Any:
                first: dict[str, Any] = {**head, "choices": [{"index": 0, "delta": {"role": "assistant"}}]}
                if ids:
                    first["prompt_token_ids"] = prompt
                yield f"data: {json.dumps(first)}\n\n"
                last = prompt[-1]
                for k in range(body.get("max_tokens") or CHAT_DEFAULT_TOKENS):
                    if self.die_after is not None and k == self.die_after:
                        raise ConnectionError("killed")
                    last += 1
                    choice = {"index": 0, "delta": {"content": f" t{last}"}, "finish_reason": None}
                    if ids:
                        choice["token_ids"] = [last]
                    yield f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        @app.get("/v1/models")
        async def models() -> Response:
            return JSONResponse({"data": [{"id": MODEL, "max_model_len": 64}]})

        return app


CHAT_PROMPT_IDS = [100, 101, 102]
CHAT_DEFAULT_TOKENS = 6


def test_a_chat_stream_whose_decode_instance_dies_resumes_as_a_completion() -> None:
    # d reports a request running: the idle dying instance is the cheaper one, chosen first.
    p, dying_d, d = FakeVllm("p"), CountingVllm(die_after=2), CountingVllm(running=1)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True, "temperature": 0}
    with (
        serving(p.app()) as p_url,
        serving(dying_d.app()) as dying_url,
        serving(d.app()) as d_url,
        router([p_url], [dying_url, d_url]) as client,
    ):
        for limit, resumed_max in (({"max_tokens": 6}, 4), ({}, 64 - 5)):
            text, chunks = "", []
            with client.stream("POST", "/v1/chat/completions", json={**body, **limit}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        chunks.append(chunk)
                        text += "".join(c["delta"].get("content") or "" for c in chunk["choices"])
            resumed = d.bodies[-1]
            assert resumed["prompt"] == [100, 101, 102, 103, 104] and resumed["max_tokens"] == resumed_max
            assert resumed["temperature"] == 0 and "messages" not in resumed
            assert text.startswith(" t103 t104 t105 t106"), text
            assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and {c["id"] for c in chunks} == {
                "chatcmpl-1"
            }
            assert all(c.get("prompt_token_ids") is None for c in chunks), "ids only when the client asks"
            # The dying instance is back (its /health answers) before the next round: it dies again.
            wait_until(
                "the dying instance to be back",
                lambda: all(b["alive"] for b in client.get("/health").json()["backends"].values()),
                10,
            )


def stream_text(client: httpx.Client, body: dict[str, Any]) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
    text, usage, chunks = "", dict[str, Any](), list[dict[str, Any]]()
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                chunks.append(chunk)
                text += "".join(c.get("text", "") for c in chunk.get("choices", []))
                usage = chunk.get("usage") or usage
    return text, usage, chunks


def test_a_decode_instance_dying_mid_stream_is_resumed_on_another() -> None:
    p, dying_d, d = FakeVllm("p"), CountingVllm(die_after=2), CountingVllm(running=1)
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 6, "stream": True, "min_tokens": 4}
    body["stream_options"] = {"include_usage": True}
    with (
        serving(p.app()) as p_url,
        serving(dying_d.app()) as dying_url,
        serving(d.app()) as d_url,
        router([p_url], [dying_url, d_url]) as client,
    ):
        text, usage, chunks = stream_text(client, body)
        assert text == " t8 t9 t10 t11 t12 t13", "the answer continues where the dead instance stopped"
        assert usage == {"prompt_tokens": 3, "completion_tokens": 6}, "usage counts the whole answer"
        assert all(
            c.get("token_ids") is None and c.get("prompt_token_ids") is None for ch in chunks for c in ch["choices"]
        )
        [first] = dying_d.bodies
        assert first["return_token_ids"] is True and first["prompt"] == [5, 6, 7]
        [resumed] = d.bodies
        assert resumed["prompt"] == [5, 6, 7, 8, 9] and resumed["max_tokens"] == 4 and resumed["min_tokens"] == 2
        metrics = client.get("/metrics").text
        assert "ucm_vllm_streams_broken_total 1" in metrics and "ucm_vllm_streams_resumed_total 1" in metrics

        # Asked for by the client, the ids stay (whichever instance serves it: the dying one may be back by now).
        text, _, chunks = stream_text(client, {**body, "return_token_ids": True})
        assert text == " t8 t9 t10 t11 t12 t13"
        assert chunks[0]["choices"][0]["prompt_token_ids"] == [5, 6, 7]
        assert [i for ch in chunks for c in ch["choices"] for i in c.get("token_ids", [])] == list(range(8, 14))


def test_client_errors() -> None:
    p, d = FakeVllm("p", status=400), FakeVllm("d")
    with serving(p.app()) as p_url, serving(d.app()) as d_url, router([p_url], [d_url], api_key="k") as client:
        auth = {"Authorization": "Bearer k"}
        assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 401
        refused = client.post("/v1/completions", json={"model": MODEL, "prompt": "x"}, headers=auth)
        assert refused.status_code == 400 and refused.json()["error"]["message"] == "p refuses"
        assert d.bodies == [], "a request vLLM refused is not decoded"
        wrong = client.post("/v1/completions", json={"model": "other", "prompt": "x"}, headers=auth)
        assert wrong.status_code == 404 and wrong.json()["error"]["param"] == "model"
        assert client.post("/v1/completions", content=b"[1]", headers=auth).status_code == 400
        bad_stream = client.post("/v1/completions", json={"prompt": "x", "stream": "yes"}, headers=auth)
        assert bad_stream.status_code == 400 and bad_stream.json()["error"]["param"] == "stream"


def test_config_refuses_prefill_without_decode() -> None:
    with pytest.raises(ValueError, match="decode"):
        RouterConfig(vllm_prefill=("http://127.0.0.1:1",))


def test_a_slow_health_check_is_not_a_dead_instance() -> None:
    """Probe timeouts mark an instance down only after three in a row; a refused connection at once."""
    from router.vllm_backend import BackendRole, VllmBackend
    from router.vllm_pool import VllmPool

    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("busy", request=request)

    def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    async def probes(handler: Any, rounds: int) -> list[bool]:
        backend = VllmBackend("http://127.0.0.1:1", BackendRole.DECODE)
        pool = VllmPool([backend], max_num_seqs=4)
        seen = []
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            for _ in range(rounds):
                await pool.probe_once(client)
                seen.append(backend.alive)
        return seen

    assert asyncio.run(probes(slow, 4)) == [True, True, False, False]
    assert asyncio.run(probes(refused, 1)) == [False]
