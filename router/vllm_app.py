"""The router's FastAPI app when it fronts vLLM instances (`ucm-serve router --vllm-prefill URL --vllm-decode URL`)
instead of ucm-serve nodes: `/v1/completions` and `/v1/chat/completions` (streamed or not) through
router/vllm_proxy.py, `/v1/models` from a decode instance, `/health`, `/metrics`. vLLM validates and tokenizes the
request itself; the router checks only that the body is a JSON object (a 4xx from vLLM is relayed unchanged), and
applies the same HTTP gate (body cap, API key) and admission queue as in front of its own nodes. With the model's
tokenizer (`--model FOLDER`) it tokenizes each prompt too, only to look its blocks up in the KV event index
(`--vllm-kv-events`, `--store-kv-events`) when it chooses the instances (router/vllm_pool.py).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from router.admission import AdmissionQueue
from router.config import RouterConfig
from router.errors import install_error_handlers
from router.http_gate import HttpGate
from router.json_body import parse_json_object
from router.kv_index import STORE_SOURCE, KVIndex
from router.openai_schema import ApiError, bad_request
from router.vllm_backend import BackendRole, VllmBackend
from router.vllm_pool import VllmPool
from router.vllm_proxy import Endpoint, PromptTokenizer, VllmProxy

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer

# No read timeout: a long generation is not a failure (a dead instance is, and its connection closes).
_UPSTREAM_TIMEOUT = httpx.Timeout(connect=5.0, read=None, write=60.0, pool=None)


def backends_of(config: RouterConfig) -> list[VllmBackend]:
    events = dict(config.vllm_kv_events)
    seqs = config.vllm_max_num_seqs
    return [VllmBackend(u, BackendRole.PREFILL, seqs, events.get(u)) for u in config.vllm_prefill] + [
        VllmBackend(u, BackendRole.DECODE, seqs, events.get(u)) for u in config.vllm_decode
    ]


def prompt_tokenizer(tok: Tokenizer | None) -> PromptTokenizer:
    """A request's prompt token ids as vLLM makes them (its chat template, its special tokens); None for what the
    router does not tokenize (several prompts, a malformed body: vLLM answers those; text without `tok`)."""

    def tokenize(endpoint: Endpoint, body: dict[str, Any]) -> list[int] | None:
        try:
            if endpoint is Endpoint.CHAT and tok is not None:
                return tok.apply_chat_template(
                    body["messages"],
                    bool(body.get("add_generation_prompt", True)),
                    chat_template=body.get("chat_template"),
                    continue_final_message=bool(body.get("continue_final_message", False)),
                    tools=body.get("tools"),
                    add_special_tokens=bool(body.get("add_special_tokens", False)),
                    template_kwargs=body.get("chat_template_kwargs"),
                )
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1:
                prompt = prompt[0]
            if isinstance(prompt, str) and tok is not None:
                return tok.encode(prompt, add_special_tokens=bool(body.get("add_special_tokens", True)))
            if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
                return list(prompt)
        except Exception:  # anything the template or the tokenizer raises: vLLM reports it, not the router
            return None
        return None

    return tokenize


def event_index(config: RouterConfig, backends: list[VllmBackend]) -> KVIndex | None:
    """The KV event index of the instances and the store that publish, None if none does. Subscribed with the
    router's CURVE pair (`--curve-keys`) where the store's publisher requires it; vLLM's own publishers are plain."""
    if config.store_events is None and not any(b.events is not None for b in backends):
        return None
    auth = config.node_auth
    index = KVIndex(auth)
    if config.store_events is not None:
        server_key = Path(auth.secret_file).parent / "server.key" if auth is not None else None
        index.track(STORE_SOURCE, "store", config.store_events, server_key, rechain=True)
    return index


def create_vllm_app(config: RouterConfig, tokenizer: Tokenizer | None = None) -> FastAPI:
    backends = backends_of(config)
    index = event_index(config, backends)
    pool = VllmPool(backends, config.vllm_max_num_seqs, policy=config.pairing, index=index)
    tokenize = prompt_tokenizer(tokenizer) if index is not None else None  # the ids are only for the index
    admission = AdmissionQueue(pool.capacity, config.max_queued_requests, config.max_queue_wait_s)
    requests: Counter[tuple[str, int]] = Counter()
    state: dict[str, VllmProxy] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=_UPSTREAM_TIMEOUT, limits=limits) as client:
            state["proxy"] = VllmProxy(pool, admission, client, config.decode_wait_s, tokenize)
            await pool.probe_once(client)
            pool.start(client)
            urls = ", ".join(b.name for b in pool.backends)
            print(f"ucm-serve router: fronting vLLM instances {urls}", flush=True)
            try:
                yield
            finally:
                await pool.close()
                if index is not None:
                    index.close()

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
        backend = pool.any_alive(BackendRole.DECODE)
        if backend is None:
            raise ApiError(503, "no vLLM decode instance is available", "service_unavailable", code="503")
        upstream = await state["proxy"].client.get(backend.url + "/v1/models")
        return Response(upstream.content, upstream.status_code, media_type=upstream.headers.get("content-type"))

    @app.get("/health")
    async def health() -> JSONResponse:
        body: dict[str, Any] = {
            "engine": "vllm",
            "backends": {
                b.name: {"alive": b.alive, "in_flight": b.in_flight, "running": b.running, "waiting": b.waiting}
                for b in pool.backends
            },
        }
        ok = pool.any_alive(BackendRole.DECODE) is not None
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(_metrics_text(pool, state.get("proxy"), requests, admission, index))

    app.add_middleware(
        HttpGate,
        routes=frozenset(getattr(r, "path", "") for r in app.routes),
        count=lambda route, status: requests.update([(route, status)]),
        max_body_bytes=config.max_body_bytes,
        api_key=config.api_key,
    )
    app.state.pool = pool
    app.state.kv_index = index
    return app


def _metrics_text(
    pool: VllmPool,
    proxy: VllmProxy | None,
    requests: Counter[tuple[str, int]],
    admission: AdmissionQueue,
    index: KVIndex | None,
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
    for name in ("running", "waiting"):  # as each instance's /metrics said at the last probe
        lines.append(f"# TYPE ucm_vllm_backend_{name} gauge")
        lines += [
            f'ucm_vllm_backend_{name}{{role="{b.role.value}",url="{b.url}"}} {getattr(b, name)}' for b in pool.backends
        ]
    if index is not None:  # the same family as in front of our nodes (router/metrics.py)
        lines.append("# TYPE ucm_kv_index_blocks gauge")
        lines += [
            f'ucm_kv_index_blocks{{source="{source}",medium="{medium}"}} {n}'
            for (source, medium), n in sorted(index.sizes().items())
        ]
    if proxy is not None:
        for name, value in vars(proxy.stats).items():
            lines += [f"# TYPE ucm_vllm_{name}_total counter", f"ucm_vllm_{name}_total {value}"]
    return "\n".join(lines) + "\n"
