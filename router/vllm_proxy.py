"""`VllmProxy`: one OpenAI request's prefill → decode trip across vLLM instances that share the UCM store.

1. Prefill on a producer (vLLM with UCMConnector as `kv_producer`): the client's request with the parameters vLLM's
   own disaggregated-prefill proxies send (`max_tokens=1`, no stream, `kv_transfer_params.do_remote_decode`). The
   plugin commits the prompt's full blocks to the store within the step that computed them, so they are in the store
   before this response comes back.
2. Decode on a consumer (`kv_consumer`): the client's request unchanged. vLLM asks the plugin how much of the prompt
   the store holds, loads it, computes the rest and generates; its response or SSE stream is relayed as is, so
   `usage.prompt_tokens_details.cached_tokens` is what the consumer took from its cache and the store
   (`vllm serve --enable-prompt-tokens-details`). No handshake: the store is content-addressed, any producer's saves
   serve any consumer.

Which producer and which consumer: router/vllm_pool.py (by cost, from the instances' /metrics and KV events, with
the prompt's token ids where the router has the model's tokenizer; `--pairing least-loaded` for the least loaded).

Faults: a producer that cannot be reached or answers 5xx is marked down and the prefill goes to another one; with
none left the consumer computes the prompt itself (like a ucm-serve decode node prefilling locally). A consumer
that fails before its response started is marked down and the request goes to another one, waiting up to
`decode_wait_s` for one to come back; one that dies mid-stream ends the stream with an error event (resuming a
vLLM stream elsewhere is not implemented). A 4xx from vLLM is the client's error and is relayed unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from router.admission import AdmissionQueue, Rejected
from router.openai_schema import ApiError
from router.vllm_backend import BackendRole, VllmBackend
from router.vllm_pool import PromptView, VllmPool
from router.vllm_resume import ResumableStream, resumable

log = logging.getLogger("router.vllm")
T = TypeVar("T")

# What vLLM's disaggregated-prefill proxies (examples/online_serving/disaggregated_serving/*proxy*.py) tell the
# prefill instance. UCMConnector needs none of it (blocks are found by content); a connector that does gets it.
PREFILL_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# Sampling fields that cannot hold with max_tokens=1 or would make the prefill compute more than one sequence.
_PREFILL_DROPS = ("stream_options", "min_tokens", "best_of", "n")
_DEFAULT_MAX_TOKENS = 16  # vLLM's completions default; used only for admission's token estimate
_BYTES_PER_TOKEN = 4  # admission's estimate of prompt tokens from the body (the router does not tokenize for vLLM)
_DISCONNECT_POLL_S = 0.5


class Endpoint(enum.Enum):
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"


class ClientGone(Exception):
    pass


class Upstream5xx(Exception):
    """A vLLM instance answered 5xx: it is treated as down for this request (its engine may have died)."""


@dataclass(frozen=True)
class _Decode:
    """What the choice of a consumer reads: the prompt, and whether the consumer computes it (no producer did)."""

    prompt: PromptView
    prefills_here: bool


@dataclass
class ProxyStats:
    """Counters the router's /metrics shows."""

    prefills: int = 0
    prefill_retries: int = 0  # a producer failed and the prefill went to another one
    prefills_skipped: int = 0  # no producer alive: the consumer computed the prompt itself
    decode_retries: int = 0  # a consumer failed before its response started and another one took the request
    streams_broken: int = 0  # a consumer died mid-stream
    streams_resumed: int = 0  # ... and another one continued the stream where it stopped
    # The prompts prefilled, and how much of them the choice found in the chosen producer's device cache or in the
    # store (the KV events, re-keyed: a router whose tokenizer disagreed with vLLM's would find nothing)
    prefill_prompt_tokens: int = 0
    prefill_reused_tokens: int = 0


def prefill_body(body: dict[str, Any], endpoint: Endpoint) -> dict[str, Any]:
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROPS}
    out["max_tokens"] = 1
    if endpoint is Endpoint.CHAT and "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = {**PREFILL_TRANSFER_PARAMS, **(body.get("kv_transfer_params") or {})}
    return out


def admission_size(body: dict[str, Any], raw_len: int) -> tuple[int, int]:
    """(sequences, tokens) for admission: n choices; the body's size stands in for its prompt tokens."""
    n = body.get("n", 1)
    seqs = n if isinstance(n, int) and n >= 1 else 1
    return seqs, raw_len // _BYTES_PER_TOKEN + seqs * max_tokens_of(body)


def max_tokens_of(body: dict[str, Any]) -> int:
    value = body.get("max_completion_tokens") or body.get("max_tokens") or _DEFAULT_MAX_TOKENS
    return value if isinstance(value, int) and value > 0 else _DEFAULT_MAX_TOKENS


# A request's prompt token ids (None: not tokenizable here; vLLM decides whether it is valid).
PromptTokenizer = Callable[[Endpoint, dict[str, Any]], list[int] | None]


async def prompt_view(
    body: dict[str, Any], endpoint: Endpoint, raw_len: int, tokenize: PromptTokenizer | None
) -> PromptView:
    """What the choice of instances reads of the prompt: its token ids when `tokenize` gives them (on a worker
    thread: a long prompt must not stall the event loop), else its length estimated from the body's bytes."""
    ids = await asyncio.to_thread(tokenize, endpoint, body) if tokenize is not None else None
    if ids is None:
        return PromptView(max(1, raw_len // _BYTES_PER_TOKEN), None, max_tokens_of(body))
    return PromptView(max(1, len(ids)), tuple(ids), max_tokens_of(body))


def _relayed(response: httpx.Response, content: bytes) -> Response:
    return Response(content, status_code=response.status_code, media_type=response.headers.get("content-type"))


def _sse_error(message: str) -> bytes:
    error = {"error": {"message": message, "type": "server_error", "param": None, "code": 503}}
    return f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()


class VllmProxy:
    def __init__(
        self,
        pool: VllmPool,
        admission: AdmissionQueue,
        client: httpx.AsyncClient,
        decode_wait_s: float,
        tokenize: PromptTokenizer | None = None,
    ) -> None:
        self.pool = pool
        self.admission = admission
        self.client = client
        self.decode_wait_s = decode_wait_s
        self.tokenize = tokenize
        self.stats = ProxyStats()

    async def serve(self, endpoint: Endpoint, body: dict[str, Any], raw_len: int, request: Request) -> Response:
        seqs, tokens = admission_size(body, raw_len)
        try:
            ticket = self.admission.admit(seqs, tokens)
        except Rejected as e:
            raise ApiError(429, str(e), "rate_limit_exceeded", headers={"Retry-After": e.retry_after_header}) from None
        streaming = False
        try:
            await self._until_disconnected(request, self.admission.wait(ticket))
            prompt = await prompt_view(body, endpoint, raw_len, self.tokenize)
            refusal, prefilled = await self._until_disconnected(request, self._prefill(endpoint, body, prompt))
            if refusal is not None:
                return refusal
            decode = _Decode(prompt, prefills_here=not prefilled)
            if body.get("stream"):
                chat = endpoint is Endpoint.CHAT
                resume = ResumableStream(body, chat) if resumable(body, chat) else None
                upstream = resume.upstream_body() if resume is not None else body
                response, backend = await self._until_disconnected(
                    request, self._open_decode(endpoint, upstream, decode)
                )
                if response.status_code != 200:
                    content = await response.aread()
                    await response.aclose()
                    backend.in_flight -= 1
                    return _relayed(response, content)
                streaming = True
                return StreamingResponse(
                    self._relay(response, backend, ticket, tokens)
                    if resume is None
                    else self._relay_resumable(resume, response, backend, ticket, tokens, decode),
                    media_type=response.headers.get("content-type", "text/event-stream"),
                )
            return await self._until_disconnected(request, self._decode(endpoint, body, decode))
        except ClientGone:
            return Response(status_code=499)
        finally:
            if not streaming:
                self.admission.release(ticket, tokens)

    async def _until_disconnected(self, request: Request, work: Awaitable[T]) -> T:
        """`work`, cancelled (its upstream connection closed, so vLLM aborts the request) if the client goes away."""
        task = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    raise ClientGone
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    async def _prefill(
        self, endpoint: Endpoint, body: dict[str, Any], prompt: PromptView
    ) -> tuple[Response | None, bool]:
        """Prefill on a producer: (a Response to return instead of decoding when vLLM refused the request (4xx),
        whether a producer prefilled it)."""
        tried: list[VllmBackend] = []
        payload = prefill_body(body, endpoint)
        while (choice := self.pool.pick_prefill(prompt, tried)) is not None:
            backend = choice.node
            tried.append(backend)
            backend.in_flight += 1
            backend.sent_tokens += choice.compute_tokens  # the queue ahead of the next prompt priced here
            try:
                response = await self.client.post(backend.url + endpoint.value, json=payload)
            except httpx.TransportError as e:
                self.pool.mark_down(backend, f"{type(e).__name__}: {e}")
                self.stats.prefill_retries += 1
                continue
            finally:
                backend.in_flight -= 1
                backend.sent_tokens -= choice.compute_tokens
            if response.status_code >= 500:
                self.pool.mark_down(backend, f"HTTP {response.status_code}")
                self.stats.prefill_retries += 1
                continue
            if response.status_code != 200:
                return _relayed(response, response.content), False
            self.stats.prefills += 1
            self.stats.prefill_prompt_tokens += prompt.tokens
            if choice.compute_tokens:  # priced (COST); the comparison rules leave it 0
                self.stats.prefill_reused_tokens += max(0, prompt.tokens - choice.compute_tokens)
            return None, True
        # No producer: the consumer loads what the store has and computes the rest itself.
        self.stats.prefills_skipped += 1
        return None, False

    async def _next_decode(self, tried: list[VllmBackend], decode: _Decode) -> VllmBackend:
        """An alive consumer not tried yet; waits up to decode_wait_s for one to come back, else ApiError(503)."""
        deadline = time.monotonic() + self.decode_wait_s
        while (backend := self.pool.pick_decode(decode.prompt, tried, decode.prefills_here)) is None:
            if not any(b.alive for b in self.pool.of(BackendRole.DECODE)):
                tried.clear()  # an instance that comes back may be one that failed this request before
            left = deadline - time.monotonic()
            if left <= 0:
                raise ApiError(503, "no vLLM decode instance is available", "service_unavailable", code="503")
            event = asyncio.Event()
            self.pool.on_alive.append(event)
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), left)
            finally:
                self.pool.on_alive.remove(event)
        return backend

    async def _decode(self, endpoint: Endpoint, body: dict[str, Any], decode: _Decode) -> Response:
        tried: list[VllmBackend] = []
        while True:
            backend = await self._next_decode(tried, decode)
            tried.append(backend)
            backend.in_flight += 1
            try:
                response = await self.client.post(backend.url + endpoint.value, json=body)
                if response.status_code >= 500:
                    raise Upstream5xx(f"HTTP {response.status_code}")
                return _relayed(response, response.content)
            except (httpx.TransportError, Upstream5xx) as e:
                self.pool.mark_down(backend, f"{type(e).__name__}: {e}")
                self.stats.decode_retries += 1
            finally:
                backend.in_flight -= 1

    async def _open_decode(
        self, endpoint: Endpoint, body: dict[str, Any], decode: _Decode
    ) -> tuple[httpx.Response, VllmBackend]:
        """A consumer's streamed response, headers received; the caller owns it and the backend's in_flight."""
        tried: list[VllmBackend] = []
        while True:
            backend = await self._next_decode(tried, decode)
            tried.append(backend)
            backend.in_flight += 1
            request = self.client.build_request("POST", backend.url + endpoint.value, json=body)
            try:
                response = await self.client.send(request, stream=True)
            except httpx.TransportError as e:
                backend.in_flight -= 1
                self.pool.mark_down(backend, f"{type(e).__name__}: {e}")
                self.stats.decode_retries += 1
                continue
            if response.status_code >= 500:
                await response.aclose()
                backend.in_flight -= 1
                self.pool.mark_down(backend, f"HTTP {response.status_code}")
                self.stats.decode_retries += 1
                continue
            return response, backend

    async def _relay(
        self, response: httpx.Response, backend: VllmBackend, ticket: Any, tokens: int
    ) -> AsyncIterator[bytes]:
        """The consumer's SSE bytes as they come; closing early (client gone) closes the upstream stream."""
        try:
            async for chunk in response.aiter_raw():
                yield chunk
        except httpx.TransportError as e:
            self.pool.mark_down(backend, f"stream broken: {type(e).__name__}: {e}")
            self.stats.streams_broken += 1
            yield _sse_error(f"the vLLM decode instance failed mid-stream ({type(e).__name__})")
        finally:
            await response.aclose()
            backend.in_flight -= 1
            self.admission.release(ticket, tokens)

    async def _relay_resumable(
        self,
        resume: ResumableStream,
        response: httpx.Response,
        backend: VllmBackend,
        ticket: Any,
        tokens: int,
        decode: _Decode,
    ) -> AsyncIterator[bytes]:
        """The consumer's SSE events, token ids stripped unless asked for; a consumer that dies mid-stream is
        replaced by another that continues from the tokens already sent (router/vllm_resume.py)."""
        held: tuple[httpx.Response, VllmBackend] | None = (response, backend)
        try:
            while held is not None:
                response, backend = held
                try:
                    async for line in response.aiter_lines():
                        out = resume.absorb(line)
                        if out is not None:
                            yield out
                    return
                except httpx.TransportError as e:
                    self.pool.mark_down(backend, f"stream broken: {type(e).__name__}: {e}")
                    self.stats.streams_broken += 1
                    again = resume.resume_body(await self._model_len() if resume.needs_model_len() else None)
                if again is None:
                    yield _sse_error("the vLLM decode instance failed mid-stream")
                    return
                held = None
                await response.aclose()
                backend.in_flight -= 1
                try:  # always a completion: a chat resumes on /v1/completions (router/vllm_resume.py)
                    held = await self._open_decode(Endpoint.COMPLETIONS, again, decode)
                except ApiError as e:
                    yield _sse_error(f"the vLLM decode instance failed mid-stream and none took over: {e}")
                    return
                if held[0].status_code != 200:
                    yield _sse_error(f"resuming the stream failed: HTTP {held[0].status_code}")
                    return
                self.stats.streams_resumed += 1
        finally:
            if held is not None:
                await held[0].aclose()
                held[1].in_flight -= 1
            self.admission.release(ticket, tokens)

    async def _model_len(self) -> int | None:
        """The context length an alive decode instance serves (vLLM's /v1/models), None if none answers."""
        backend = self.pool.any_alive(BackendRole.DECODE)
        if backend is None:
            return None
        try:
            models = (await self.client.get(backend.url + "/v1/models", timeout=10.0)).json()
            return int(models["data"][0]["max_model_len"])
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
            return None
