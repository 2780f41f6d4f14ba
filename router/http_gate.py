"""`HttpGate`: the pure-ASGI layer in front of the router's routes: counts /v1 requests by route, checks the API
key, and caps request bodies before anything parses them.

Pure ASGI, not `@app.middleware("http")` (Starlette's BaseHTTPMiddleware): that one wraps `receive`, so an
endpoint never saw its client go away and a non-streaming request ran to completion for nobody. Here the
endpoint gets the server's own `receive` (after the capped body is replayed once), so a disconnect reaches it.

An over-long body is read and dropped in chunks (never held: memory stays flat) and answered 413; reading it out
rather than closing at once lets the client see the 413 instead of a connection reset. Past `discard_factor`
times the cap the connection is closed instead.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from router.auth import authorized
from router.openai_schema import ApiError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OTHER_ROUTE = "other"  # the metric label of every path that is not a route: labels stay bounded
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_CLIENT_GONE = 499  # nginx's code for "client closed the request": what the request counter records


async def send_error(send: Send, error: ApiError, close: bool = False) -> None:
    # ensure_ascii: a message quoting client input can never fail to encode
    body = json.dumps(error.body(), ensure_ascii=True).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (error.headers or {}).items()]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# Routes outside /v1/ that change the nodes' state: they need the API key too (vLLM serves its reset only in dev mode).
KEYED_ADMIN_ROUTES = frozenset({"/reset_prefix_cache"})


class HttpGate:
    def __init__(
        self,
        app: ASGIApp,
        *,
        routes: frozenset[str],
        count: Callable[[str, int], None],
        max_body_bytes: int,
        api_key: str | None = None,
        discard_factor: int = 64,
    ) -> None:
        assert max_body_bytes > 0, "the body cap must be positive"
        self.app = app
        self.routes = routes
        self.count = count  # (route label, status) for every /v1 request
        self.max_body_bytes = max_body_bytes
        self.api_key = api_key
        self.discard_limit = max_body_bytes * discard_factor

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        counted = path.startswith("/v1/")
        keyed = counted or path in KEYED_ADMIN_ROUTES
        status = 500  # what the server sends if the app raises before answering

        async def send_counting(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if keyed and self.api_key is not None and not authorized(scope["headers"], self.api_key):
                await send_error(
                    send_counting,
                    ApiError(401, "Incorrect or missing API key.", "authentication_error", None, "invalid_api_key"),
                )
                return
            if scope["method"] in _BODY_METHODS:
                replay = await self._read_capped(scope, receive, send_counting)
                if replay is None:  # answered 413, or the client left mid-body (nothing to answer)
                    status = status if status != 500 else _CLIENT_GONE
                    return
                receive = replay
            await self.app(scope, receive, send_counting)
        finally:
            if counted:
                self.count(path if path in self.routes else OTHER_ROUTE, status)

    async def _read_capped(self, scope: Scope, receive: Receive, send: Send) -> Receive | None:
        """The body read up to the cap, as a `receive` that replays it once then hands over to the server's;
        None when a 413 was sent instead or the client left before the body ended."""
        declared = None
        for key, value in scope["headers"]:
            if key == b"content-length":
                declared = int(value) if value.isdigit() else None
                break
        chunks: list[bytes] = []
        size = 0
        more = True
        too_big = declared is not None and declared > self.max_body_bytes
        while more and not too_big:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            more = message.get("more_body", False)
            if size > self.max_body_bytes:
                too_big = True
            else:
                chunks.append(chunk)
        if too_big:
            chunks.clear()
            finished = not more or await self._discard(receive, size)
            await send_error(
                send,
                ApiError(
                    413,
                    f"request body exceeds the router's limit of {self.max_body_bytes} bytes",
                    "invalid_request_error",
                    None,
                    "request_too_large",
                ),
                close=not finished,
            )
            return None
        return _replay(chunks, receive)

    async def _discard(self, receive: Receive, size: int) -> bool:
        """Read and drop the rest of a refused body; False if it ran past the discard limit (or the client
        left) before ending."""
        while size <= self.discard_limit:
            message = await receive()
            if message["type"] != "http.request":
                return False
            size += len(message.get("body", b""))
            if not message.get("more_body", False):
                return True
        return False


def _replay(chunks: list[bytes], receive: Receive) -> Receive:
    first: Message = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
    done = False

    async def replay() -> Message:
        nonlocal done
        if not done:
            done = True
            return first
        return await receive()

    return replay
