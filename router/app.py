"""The router's FastAPI app: OpenAI routes, /health, /metrics, OpenAI-style JSON errors. Never imports torch."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from router import protocol as P
from router.admission import AdmissionQueue, Rejected
from router.config import RouterConfig
from router.dispatcher import DECODE_ROLES, Dispatcher
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
        return {"content": [
            {"token": text(lp.token_id), "logprob": lp.logprob, "bytes": list(text(lp.token_id).encode()),
             "top_logprobs": [{"token": text(t), "logprob": v, "bytes": list(text(t).encode())} for t, v in lp.top]}
            for lp in lps]}
    return {"tokens": [text(lp.token_id) for lp in lps], "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{text(t): v for t, v in lp.top} for lp in lps], "text_offset": []}


def _validation_error(e: ValidationError | RequestValidationError) -> ApiError:
    err = e.errors()[0] if e.errors() else {"loc": (), "msg": str(e)}
    loc = [str(x) for x in err.get("loc", ()) if x not in ("body",)]
    param = loc[0] if loc else None
    where = ".".join(loc)
    return bad_request(f"{where}: {err.get('msg')}" if where else str(err.get("msg")), param)


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

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = NodeClient(config.bind_nodes, registry, config.node_auth)
        client.on_node_event.append(metrics.node_event)
        client.on_node_event.append(lambda node_id, event: admission.pump())  # capacity may have grown
        await client.start()
        dispatcher = Dispatcher(client, config.decode_wait_s)
        state["client"] = client
        state["serving"] = OpenAIServing(dispatcher, admission, tokenizer, metrics, config.model_name,
                                         config.max_model_len)
        app.state.nodes_address = client.address
        print(f"ucm-serve router: nodes connect to {client.address}", flush=True)
        try:
            yield
        finally:
            await client.close()

    app = FastAPI(title="ucm-serve router", lifespan=lifespan)
    app.state.registry = registry
    app.state.metrics = metrics

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _fastapi_422(request: Request, e: RequestValidationError) -> JSONResponse:
        err = _validation_error(e)
        return JSONResponse(err.body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(ApiError(e.status_code, str(e.detail), kind).body(), status_code=e.status_code)

    @app.middleware("http")
    async def _auth_and_count(request: Request, call_next):
        path = request.url.path
        if config.api_key and path.startswith("/v1/"):
            header = request.headers.get("authorization", "")
            token = header[7:] if header.lower().startswith("bearer ") else ""
            if not secrets.compare_digest(token.encode(), config.api_key.encode()):
                err = ApiError(401, "Incorrect or missing API key.", "authentication_error", None, "invalid_api_key")
                metrics.requests.labels(path, "401").inc()
                return JSONResponse(err.body(), status_code=401)
        response = await call_next(request)
        if path.startswith("/v1/"):
            metrics.requests.labels(path, str(response.status_code)).inc()
        return response

    async def parse(request: Request, model: type[BaseModel]) -> Any:
        raw = await request.body()
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise bad_request(f"invalid JSON body: {e}") from e
        if not isinstance(obj, dict):
            raise bad_request("the request body must be a JSON object")
        try:
            return model.model_validate(obj)
        except ValidationError as e:
            raise _validation_error(e) from e

    async def respond(request: Request, body: CompletionRequest | ChatCompletionRequest) -> Response:
        serving: OpenAIServing = state["serving"]
        chat = isinstance(body, ChatCompletionRequest)
        choices, prompt_tokens = serving.build_choices(body)
        rid = ("chatcmpl-" if chat else "cmpl-") + choices[0].seq.request_id.split("-")[0]
        created = int(time.time())
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": serving.model_name}
        try:
            ticket = serving.admission.admit(len(choices), requested_tokens(choices))
        except Rejected as e:
            metrics.rejected.inc()
            # OpenAI's shape for a rate limit; Retry-After is what the openai client's backoff honours.
            raise ApiError(429, str(e), "requests", None, "rate_limit_exceeded",
                           {"Retry-After": e.retry_after_header}) from e

        def release() -> None:
            completion = sum(c.num_tokens for c in choices)
            serving.admission.release(ticket, completion + (prompt_tokens if completion else 0))

        stream = serving.run(choices, prompt_tokens, ticket)
        if body.stream:
            return _ReleasingStream(_sse(serving, body, choices, prompt_tokens, stream, head, chat), release,
                                    media_type="text/event-stream")
        try:
            await _collect(request, stream)
        finally:
            release()
        out = []
        for c in choices:
            lp = _logprobs_json(serving.tok, c.logprobs, chat) if c.num_logprobs is not None else None
            if chat:
                out.append({"index": c.index, "message": {"role": "assistant", "content": c.detok.text},
                            "logprobs": lp, "finish_reason": c.finish_reason})
            else:
                out.append({"index": c.index, "text": c.detok.text, "logprobs": lp, "finish_reason": c.finish_reason})
        obj = "chat.completion" if chat else "text_completion"
        return JSONResponse({**head, "object": obj, "choices": out, "usage": usage(prompt_tokens, choices)})

    async def _collect(request: Request, stream: AsyncIterator[Chunk]) -> None:
        """Drain the choices, aborting everything if the client disconnects first."""
        async def drain() -> None:
            async with contextlib.aclosing(stream):
                async for _ in stream:
                    pass
        task = asyncio.create_task(drain())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=0.25)
                if not task.done() and await request.is_disconnected():
                    task.cancel()
                    raise ApiError(499, "client disconnected", "invalid_request_error")
            task.result()
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def _sse(serving: OpenAIServing, body: Any, choices: list[Choice], prompt_tokens: int,
                   stream: AsyncIterator[Chunk], head: dict[str, Any], chat: bool) -> AsyncIterator[str]:
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

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await respond(request, await parse(request, CompletionRequest))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await respond(request, await parse(request, ChatCompletionRequest))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "ucm-serve", "max_model_len": registry.max_model_len()}]}

    @app.get("/health")
    async def health() -> JSONResponse:
        nodes = {n.node_id: {"role": n.role.value, "running": n.running, "waiting": n.waiting, "load": n.load}
                 for n in registry.nodes.values()}
        ok = bool(registry.alive(*DECODE_ROLES))
        # A dead store degrades hit rates, not answers: it shows here but does not make the router unhealthy.
        return JSONResponse({"status": "ok" if ok else "no_decode_node", "nodes": nodes,
                             "store": store_health(registry.nodes.values())}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prom() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    return app
