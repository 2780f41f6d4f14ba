"""Server-sent events for streamed completions: the event stream of one request (chunks, errors in-band once the
headers are out, the usage chunk, `[DONE]`) and the response that always gives the admission ticket back."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from router.access_log import AccessEntry
from router.openai_schema import ApiError, ChatCompletionRequest, CompletionRequest
from router.responses import delta_choice
from router.serving import Choice, Chunk, OpenAIServing, sse, usage

log = logging.getLogger(__name__)


class ReleasingStream(StreamingResponse):
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


async def sse_events(
    serving: OpenAIServing,
    body: CompletionRequest | ChatCompletionRequest,
    choices: list[Choice],
    prompt_tokens: int,
    stream: AsyncGenerator[Chunk, None],
    head: dict[str, Any],
    entry: AccessEntry,
) -> AsyncIterator[str]:
    """The events of one streamed request; its access log line says how it ended (status 200 is on the wire
    already, so a failure is logged with its error)."""
    chat = isinstance(body, ChatCompletionRequest)
    started: set[int] = set()
    try:
        async with contextlib.aclosing(stream):
            async for ch in stream:
                choice = delta_choice(serving.tok, ch, chat, first=ch.index not in started)
                started.add(ch.index)
                event = {**head, "choices": [choice]}
                if body.continuous_usage:
                    event["usage"] = usage(prompt_tokens, choices)
                yield sse(event)
    except ApiError as e:
        entry.done(200, f"in-band {e.status}: {e.message}")
        yield sse(e.body())
    except Exception as e:  # headers are sent already: report in-band
        log.exception("stream failed")
        entry.done(200, f"in-band 500: internal error: {e}")
        yield sse(ApiError(500, f"internal error: {e}", "server_error").body())
    else:
        entry.done(200)
        if body.include_usage:
            yield sse({**head, "choices": [], "usage": usage(prompt_tokens, choices)})
    yield sse("[DONE]")
