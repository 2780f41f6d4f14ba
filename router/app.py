"""The router's FastAPI app: OpenAI routes, /health, /metrics, OpenAI-style JSON errors. Never imports torch.

Hostile input (docs/security.md): bodies are capped before they are read (router/http_gate.py), parsed and
validated on a worker thread (router/json_body.py: big ints, NaN, deep nesting, lone surrogates are 400s), and
tokenized on that thread after the prompt size and fan-out were checked (router/serving.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from protocol import messages as P
from router.admission import AdmissionQueue, Rejected
from router.config import RouterConfig
from router.dispatcher import DECODE_ROLES, Dispatcher
from router.http_gate import HttpGate
from router.json_body import HugeInt, parse_json_object
from router.metrics import RouterMetrics
from router.node_client import NodeClient
from router.openai_schema import ApiError, ChatCompletionRequest, CompletionRequest, bad_request
from router.registry import Registry
from router.serving import Choice, Chunk, OpenAIServing, requested_tokens, sse, usage
from router.store_health import store_health

log = logging.getLogger(__name__)


def _logprobs_json(tok: Any, lps: list[P.TokenLogprob], chat: bool) -> dict[str, Any] | None:
    if not lps:
        return None

    def text(t: int) -> str:
        return tok.decode([t], skip_special_tokens=False)

    if chat:
        return {
            "content": [
                {
                    "token": text(lp.token_id),
                    "logprob": lp.logprob,
                    "bytes": list(text(lp.token_id).encode()),
                    "top_logprobs": [
                        {"token": text(t), "logprob": v, "bytes": list(text(t).encode())} for t, v in lp.top
                    ],
                }
                for lp in lps
            ]
        }
    return {
        "tokens": [text(lp.token_id) for lp in lps],
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{text(t): v for t, v in lp.top} for lp in lps],
        "text_offset": [],
    }


def _validation_error(e: ValidationError | RequestValidationError) -> ApiError:
    err = e.errors()[0] if e.errors() else {"loc": (), "msg": str(e)}
    loc = [str(x) for x in err.get("loc", ()) if x not in ("body",)]
    param = loc[0] if loc else None
    where = ".".join(loc)
    msg = "integer out of range" if isinstance(err.get("input"), HugeInt) else err.get("msg")
    return bad_request(f"{where}: {msg}" if where else str(msg), param)


def _validate(raw: bytes, model: type[BaseModel]) -> Any:
    """Body bytes -> the request model, or ApiError(400); CPU-bound, so it runs on the worker thread."""
    try:
        return model.model_validate(parse_json_object(raw))
    except ValidationError as e:
        raise _validation_error(e) from None


class _ReleasingStream(StreamingResponse):
    """A StreamingResponse that always runs `on_close`, even when the body iterator never started (client gone
    before the headers went out): an admitted request must give its admission ticket back."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:  # close the generators now (→ aborts on the nodes), not at GC time, before freeing the slots
                with contextlib.suppress(Exception):
                    await self.body_iterator.aclose()  # type: ignore[attr-defined]
            finally:
                self._on_close()


def create_app(config: RouterConfig, tokenizer: Any) -> FastAPI:
    registry = Registry(config.model_name, config.node_timeout_s, config.stall_timeout_s)
    admission = AdmissionQueue(registry.capacity, config.max_queued_requests, config.max_queue_wait_s)
    metrics = RouterMetrics(registry, admission)
    state: dict[str, Any] = {}
    # One thread for parsing and tokenizing: bounded CPU per request (the caps), never the event loop's.
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="router-parse")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = NodeClient(config.bind_nodes, registry, config.node_auth)
        client.on_node_event.append(metrics.node_event)
        client.on_node_event.append(lambda node_id, event: admission.pump())  # capacity may have grown
        await client.start()
        dispatcher = Dispatcher(client, config.decode_wait_s)
        state["client"] = client
        state["serving"] = OpenAIServing(
            dispatcher,
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
        try:
            yield
        finally:
            await client.close()
            pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="ucm-serve router", lifespan=lifespan)
    app.state.registry = registry
    app.state.metrics = metrics

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> Response:
        # json.dumps escapes non-ASCII: a message quoting client input can never fail to encode
        return Response(json.dumps(e.body()), status_code=e.status, headers=e.headers, media_type="application/json")

    @app.exception_handler(RequestValidationError)
    async def _fastapi_422(request: Request, e: RequestValidationError) -> JSONResponse:
        err = _validation_error(e)
        return JSONResponse(err.body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(ApiError(e.status_code, str(e.detail), kind).body(), status_code=e.status_code)

    async def parse(request: Request, model: type[BaseModel]) -> Any:
        raw = await request.body()  # at most config.max_body_bytes: HttpGate answered 413 beyond
        return await asyncio.get_running_loop().run_in_executor(pool, _validate, raw, model)

    async def respond(request: Request, body: CompletionRequest | ChatCompletionRequest) -> Response:
        serving: OpenAIServing = state["serving"]
        chat = isinstance(body, ChatCompletionRequest)
        choices, prompt_tokens = await serving.build_choices(body)
        rid = ("chatcmpl-" if chat else "cmpl-") + choices[0].seq.request_id.split("-")[0]
        created = int(time.time())
        head = {
            "id": rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": serving.model_name,
        }
        try:
            ticket = serving.admission.admit(len(choices), requested_tokens(choices))
        except Rejected as e:
            metrics.rejected.inc()
            # OpenAI's shape for a rate limit; Retry-After is what the openai client's backoff honours.
            raise ApiError(
                429, str(e), "requests", None, "rate_limit_exceeded", {"Retry-After": e.retry_after_header}
            ) from e

        def release() -> None:
            completion = sum(c.num_tokens for c in choices)
            serving.admission.release(ticket, completion + (prompt_tokens if completion else 0))

        stream = serving.run(choices, prompt_tokens, ticket)
        if body.stream:
            return _ReleasingStream(
                _sse(serving, body, choices, prompt_tokens, stream, head, chat), release, media_type="text/event-stream"
            )
        try:
            await _collect(request, stream)
        finally:
            release()
        out = []
        for c in choices:
            lp = _logprobs_json(serving.tok, c.logprobs, chat) if c.num_logprobs is not None else None
            if chat:
                out.append(
                    {
                        "index": c.index,
                        "message": {"role": "assistant", "content": c.detok.text},
                        "logprobs": lp,
                        "finish_reason": c.finish_reason,
                    }
                )
            else:
                out.append({"index": c.index, "text": c.detok.text, "logprobs": lp, "finish_reason": c.finish_reason})
        obj = "chat.completion" if chat else "text_completion"
        return JSONResponse({**head, "object": obj, "choices": out, "usage": usage(prompt_tokens, choices)})

    async def _collect(request: Request, stream: AsyncIterator[Chunk]) -> None:
        """Drain the choices, aborting everything (cancelled choices send Abort to their nodes) if the client
        disconnects first."""

        async def drain() -> None:
            async with contextlib.aclosing(stream):
                async for _ in stream:
                    pass

        async def disconnected() -> None:
            # The body was read already, so the server's next message is the disconnect (HttpGate passes the
            # server's own `receive` through: nothing in between swallows it).
            while (await request.receive())["type"] != "http.disconnect":
                pass

        task = asyncio.create_task(drain())
        watch = asyncio.create_task(disconnected())
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                raise ApiError(499, "client disconnected", "invalid_request_error")
            task.result()
        finally:
            for t in (task, watch):
                t.cancel()
            await asyncio.gather(task, watch, return_exceptions=True)

    async def _sse(
        serving: OpenAIServing,
        body: Any,
        choices: list[Choice],
        prompt_tokens: int,
        stream: AsyncIterator[Chunk],
        head: dict[str, Any],
        chat: bool,
    ) -> AsyncIterator[str]:
        started: set[int] = set()
        try:
            async with contextlib.aclosing(stream):
                async for ch in stream:
                    lp = _logprobs_json(serving.tok, ch.logprobs, chat)
                    if chat:
                        delta: dict[str, Any] = {"content": ch.text}
                        if ch.index not in started:
                            started.add(ch.index)
                            delta = {"role": "assistant", "content": ch.text}
                        choice = {"index": ch.index, "delta": delta, "logprobs": lp, "finish_reason": ch.finish_reason}
                    else:
                        choice = {"index": ch.index, "text": ch.text, "logprobs": lp, "finish_reason": ch.finish_reason}
                    yield sse({**head, "choices": [choice]})
        except ApiError as e:
            yield sse(e.body())
        except Exception as e:  # headers are sent already: report in-band
            log.exception("stream failed")
            yield sse(ApiError(500, f"internal error: {e}", "server_error").body())
        else:
            if body.include_usage:
                yield sse({**head, "choices": [], "usage": usage(prompt_tokens, choices)})
        yield sse("[DONE]")

    # The body is parsed by hand (size-capped, on the worker thread); the schema is declared for OpenAPI.
    @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await respond(request, await parse(request, CompletionRequest))

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await respond(request, await parse(request, ChatCompletionRequest))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": config.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "ucm-serve",
                    "max_model_len": registry.max_model_len(),
                }
            ],
        }

    @app.get("/health")
    async def health() -> JSONResponse:
        nodes = {
            n.node_id: {"role": n.role.value, "running": n.running, "waiting": n.waiting, "load": n.load}
            for n in registry.nodes.values()
        }
        ok = bool(registry.alive(*DECODE_ROLES))
        # A dead store degrades hit rates, not answers: it shows here but does not make the router unhealthy.
        return JSONResponse(
            {
                "status": "ok" if ok else "no_decode_node",
                "nodes": nodes,
                "store": store_health(registry.nodes.values()),
            },
            status_code=200 if ok else 503,
        )

    @app.get("/metrics")
    async def prom() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    base_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            components = base_openapi().setdefault("components", {}).setdefault("schemas", {})
            for model in (CompletionRequest, ChatCompletionRequest):
                components.update(_json_schema(model).get("$defs", {}))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    app.add_middleware(
        HttpGate,
        routes=frozenset(r.path for r in app.routes),
        count=metrics.count_request,
        max_body_bytes=config.max_body_bytes,
        api_key=config.api_key,
    )
    return app


def _json_schema(model: type[BaseModel]) -> dict[str, Any]:
    return model.model_json_schema(ref_template="#/components/schemas/{model}")


def _body_schema(model: type[BaseModel]) -> dict[str, Any]:
    schema = {k: v for k, v in _json_schema(model).items() if k != "$defs"}  # $defs go to components
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
