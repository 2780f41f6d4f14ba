"""The router's FastAPI app when it fronts vLLM instances (`ucm-serve router --vllm-prefill URL --vllm-decode URL`)
instead of ucm-serve nodes: `/v1/completions` and `/v1/chat/completions` (streamed or not) through
router/vllm_proxy.py, `/v1/models` from a decode instance, `/health`, `/metrics`. vLLM validates and tokenizes the
request itself; the router checks only that the body is a JSON object (a 4xx from vLLM is relayed unchanged), and
applies the same HTTP gate (body cap, API key) and admission queue as in front of its own nodes.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from router.admission import AdmissionQueue
from router.config import RouterConfig
from router.errors import install_error_handlers
from router.http_gate import HttpGate
from router.json_body import parse_json_object
from router.openai_schema import ApiError, bad_request
from router.vllm_backend import BackendRole, VllmBackend
from router.vllm_pool import VllmPool
from router.vllm_proxy import Endpoint, VllmProxy

# No read timeout: a long generation is not a failure (a dead instance is, and its connection closes).
_UPSTREAM_TIMEOUT = httpx.Timeout(connect=5.0, read=None, write=60.0, pool=None)


def backends_of(config: RouterConfig) -> list[VllmBackend]:
    return [VllmBackend(u, BackendRole.PREFILL) for u in config.vllm_prefill] + [
        VllmBackend(u, BackendRole.DECODE) for u in config.vllm_decode
    ]


def create_vllm_app(config: RouterConfig) -> FastAPI:
    pool = VllmPool(backends_of(config), config.vllm_max_num_seqs)
    admission = AdmissionQueue(pool.capacity, config.max_queued_requests, config.max_queue_wait_s)
    requests: Counter[tuple[str, int]] = Counter()
    state: dict[str, VllmProxy] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=_UPSTREAM_TIMEOUT, limits=limits) as client:
            state["proxy"] = VllmProxy(pool, admission, client, config.decode_wait_s)
            await pool.probe_once(client)
            pool.start(client)
            urls = ", ".join(b.name for b in pool.backends)
            print(f"ucm-serve router: fronting vLLM instances {urls}", flush=True)
            try:
                yield
            finally:
                await pool.close()

    app = FastAPI(title="ucm-serve router (vLLM instances)", lifespan=lifespan)
    install_error_handlers(app)

    async def generate(endpoint: Endpoint, request: Request) -> Response:
        raw = await request.body()
        body = parse_json_object(raw)
        if body.get("model") not in (None, config.model_name):
            raise ApiError(
                404, f"The model `{body.get('model')}` does not exist.", "not_found_error", "model", "model_not_found"
            )
        if "stream" in body and not isinstance(body["stream"], bool):
            raise bad_request("stream: must be a boolean", "stream")
        return await state["proxy"].serve(endpoint, body, len(raw), request)

    @app.post(Endpoint.COMPLETIONS.value)
    async def completions(request: Request) -> Response:
        return await generate(Endpoint.COMPLETIONS, request)

    @app.post(Endpoint.CHAT.value)
    async def chat(request: Request) -> Response:
        return await generate(Endpoint.CHAT, request)

    @app.get("/v1/models")
    async def models() -> Response:
        backend = pool.pick(BackendRole.DECODE)
        if backend is None:
            raise ApiError(503, "no vLLM decode instance is available", "service_unavailable", code="503")
        upstream = await state["proxy"].client.get(backend.url + "/v1/models")
        return Response(upstream.content, upstream.status_code, media_type=upstream.headers.get("content-type"))

    @app.get("/health")
    async def health() -> JSONResponse:
        body: dict[str, Any] = {
            "engine": "vllm",
            "backends": {b.name: {"alive": b.alive, "in_flight": b.in_flight} for b in pool.backends},
        }
        ok = pool.pick(BackendRole.DECODE) is not None
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(_metrics_text(pool, state.get("proxy"), requests, admission))

    app.add_middleware(
        HttpGate,
        routes=frozenset(getattr(r, "path", "") for r in app.routes),
        count=lambda route, status: requests.update([(route, status)]),
        max_body_bytes=config.max_body_bytes,
        api_key=config.api_key,
    )
    app.state.pool = pool
    return app


def _metrics_text(
    pool: VllmPool, proxy: VllmProxy | None, requests: Counter[tuple[str, int]], admission: AdmissionQueue
) -> str:
    lines = ["# TYPE ucm_vllm_backend_up gauge"]
    lines += [f'ucm_vllm_backend_up{{role="{b.role.value}",url="{b.url}"}} {int(b.alive)}' for b in pool.backends]
    lines.append("# TYPE ucm_vllm_backend_failures_total counter")
    lines += [
        f'ucm_vllm_backend_failures_total{{role="{b.role.value}",url="{b.url}"}} {b.failures}' for b in pool.backends
    ]
    lines.append("# TYPE ucm_requests_total counter")
    lines += [f'ucm_requests_total{{route="{r}",status="{s}"}} {n}' for (r, s), n in sorted(requests.items())]
    lines += ["# TYPE ucm_queue_depth gauge", f"ucm_queue_depth {admission.depth}"]
    if proxy is not None:
        for name, value in vars(proxy.stats).items():
            lines += [f"# TYPE ucm_vllm_{name}_total counter", f"ucm_vllm_{name}_total {value}"]
    return "\n".join(lines) + "\n"
