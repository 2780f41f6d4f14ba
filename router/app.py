"""The router's FastAPI app, assembled: shared state, the lifespan that connects to the nodes, the routes
(router/routes.py, router/info_routes.py), OpenAI-style errors (router/errors.py) and the HTTP gate in front
(router/http_gate.py: body caps, the API key, request counts). Never imports torch.

Hostile input (docs/security.md): bodies are capped before they are read (router/http_gate.py), parsed and
validated on a worker thread (router/json_body.py: big ints, NaN, deep nesting, lone surrogates are 400s), and
tokenized on that thread after the prompt size and fan-out were checked (router/serving.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from router.admission import AdmissionQueue
from router.cache_routes import cache_routes
from router.config import PrefixSource, RouterConfig
from router.context import RouterContext
from router.dispatcher import Dispatcher
from router.errors import install_error_handlers
from router.http_gate import HttpGate
from router.info_routes import info_routes
from router.kv_index import STORE_SOURCE, KVIndex
from router.metrics import RouterMetrics
from router.node_client import NodeClient
from router.openai_schema import ChatCompletionRequest, CompletionRequest
from router.pairing import Pairing
from router.registry import Registry
from router.routes import generation_routes, json_schema
from router.serving import OpenAIServing
from router.stats_log import StatsLogger
from router.tokenize_routes import tokenize_routes


def create_app(config: RouterConfig, tokenizer: Any) -> FastAPI:
    registry = Registry(config.model_name, config.node_timeout_s, config.stall_timeout_s)
    admission = AdmissionQueue(registry.capacity, config.max_queued_requests, config.max_queue_wait_s)
    metrics = RouterMetrics(registry, admission)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="router-parse")
    ctx = RouterContext(config, registry, admission, metrics, tokenizer, pool)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = NodeClient(config.bind_nodes, registry, config.node_auth)
        client.on_node_event.append(metrics.node_event)
        client.on_node_event.append(lambda node_id, event: admission.pump())  # capacity may have grown
        index = KVIndex(config.node_auth) if config.prefix_source is PrefixSource.EVENTS else None
        if index is not None:
            client.on_node_event.append(index.follow(registry))
            if config.store_events is not None:
                auth = config.node_auth
                server_key = Path(auth.secret_file).parent / "server.key" if auth is not None else None
                index.track(STORE_SOURCE, "store", config.store_events, server_key)
        app.state.kv_index = index
        metrics.index = index
        await client.start()
        ctx.serving = OpenAIServing(
            Dispatcher(client, config.decode_wait_s, index, Pairing(config.pairing)),
            admission,
            tokenizer,
            metrics,
            config.model_name,
            config.max_model_len,
            pool=pool,
            max_prompt_chars=config.max_prompt_chars,
            max_sequences=config.max_sequences_per_request,
        )
        metrics.node_messages_dropped.set_function(
            lambda: getattr(client, "bad_messages", 0) + getattr(client, "loop_errors", 0)
        )
        app.state.nodes_address = client.address
        app.state.node_client = client  # tests talk to nodes through it (jobs the HTTP layer would refuse)
        print(f"ucm-serve router: nodes connect to {client.address}", flush=True)
        stats = asyncio.create_task(StatsLogger(metrics, registry, admission, config.stats_interval_s).run())
        try:
            yield
        finally:
            stats.cancel()
            await client.close()
            if index is not None:
                index.close()
            pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="ucm-serve router", lifespan=lifespan)
    app.state.registry = registry
    app.state.metrics = metrics
    install_error_handlers(app)
    app.include_router(generation_routes(ctx))
    app.include_router(info_routes(ctx))
    app.include_router(tokenize_routes(ctx))
    app.include_router(cache_routes(ctx))
    _declare_request_schemas(app)
    app.add_middleware(
        HttpGate,
        routes=frozenset(getattr(r, "path", "") for r in app.routes),
        count=metrics.count_request,
        max_body_bytes=config.max_body_bytes,
        api_key=config.api_key,
    )
    return app


def _declare_request_schemas(app: FastAPI) -> None:
    """The request models' nested schemas go to OpenAPI's components (the bodies are parsed by hand)."""
    base_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            components = base_openapi().setdefault("components", {}).setdefault("schemas", {})
            for model in (CompletionRequest, ChatCompletionRequest):
                components.update(json_schema(model).get("$defs", {}))
        assert app.openapi_schema is not None, "FastAPI.openapi() caches the schema it builds"
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
