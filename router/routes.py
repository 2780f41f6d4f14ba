"""The generation routes: /v1/completions and /v1/chat/completions. A request is parsed on the worker thread,
turned into choices, admitted (or refused 429), then answered as one JSON body or as server-sent events."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from router.access_log import AccessEntry
from router.admission import Rejected
from router.context import RouterContext
from router.errors import validate
from router.openai_schema import ApiError, ChatCompletionRequest, CompletionRequest
from router.responses import final_choice
from router.serving import Chunk, requested_tokens, usage
from router.sse import ReleasingStream, sse_events


async def parse(ctx: RouterContext, request: Request, model: type[BaseModel]) -> Any:
    raw = await request.body()  # at most config.max_body_bytes: HttpGate answered 413 beyond
    return await asyncio.get_running_loop().run_in_executor(ctx.pool, validate, raw, model)


async def respond(
    ctx: RouterContext, request: Request, model: type[CompletionRequest] | type[ChatCompletionRequest]
) -> Response:
    """Parse and answer one generation request; its access log line is written whatever the outcome."""
    entry = AccessEntry(request.url.path)
    try:
        return await answer(ctx, request, await parse(ctx, request, model), entry)
    except ApiError as e:
        entry.done(e.status, e.message)
        raise
    except Exception as e:
        entry.done(500, f"internal error: {e}")
        raise


async def answer(
    ctx: RouterContext, request: Request, body: CompletionRequest | ChatCompletionRequest, entry: AccessEntry
) -> Response:
    serving = ctx.ready_serving()
    chat = isinstance(body, ChatCompletionRequest)
    choices, prompt_tokens = await serving.build_choices(body)
    rid = ("chatcmpl-" if chat else "cmpl-") + choices[0].seq.request_id.split("-")[0]
    entry.request_id, entry.prompt_tokens, entry.choices = rid, prompt_tokens, choices
    head = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": serving.model_name,
    }
    try:
        ticket = serving.admission.admit(len(choices), requested_tokens(choices))
    except Rejected as e:
        ctx.metrics.rejected.inc()
        # OpenAI's shape for a rate limit; Retry-After is what the openai client's backoff honours.
        raise ApiError(
            429, str(e), "requests", None, "rate_limit_exceeded", {"Retry-After": e.retry_after_header}
        ) from e

    def release() -> None:
        completion = sum(c.num_tokens for c in choices)
        serving.admission.release(ticket, completion + (prompt_tokens if completion else 0))

    stream = serving.run(choices, prompt_tokens, ticket)
    if body.stream:
        events = sse_events(serving, body, choices, prompt_tokens, stream, head, entry)

        def close_stream() -> None:
            release()
            entry.done(499, "client disconnected")  # unless the stream logged its outcome already

        return ReleasingStream(events, close_stream, media_type="text/event-stream")
    try:
        await collect(request, stream)
    finally:
        release()
    out = [final_choice(serving.tok, c, chat) for c in choices]
    obj = "chat.completion" if chat else "text_completion"
    response = JSONResponse({**head, "object": obj, "choices": out, "usage": usage(prompt_tokens, choices)})
    entry.done(200)
    return response


async def collect(request: Request, stream: AsyncGenerator[Chunk, None]) -> None:
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


def generation_routes(ctx: RouterContext) -> APIRouter:
    api = APIRouter()

    # The body is parsed by hand (size-capped, on the worker thread); the schema is declared for OpenAPI.
    @api.post("/v1/completions", openapi_extra=body_schema(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await respond(ctx, request, CompletionRequest)

    @api.post("/v1/chat/completions", openapi_extra=body_schema(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await respond(ctx, request, ChatCompletionRequest)

    return api


def json_schema(model: type[BaseModel]) -> dict[str, Any]:
    return model.model_json_schema(ref_template="#/components/schemas/{model}")


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    schema = {k: v for k, v in json_schema(model).items() if k != "$defs"}  # $defs go to components
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
