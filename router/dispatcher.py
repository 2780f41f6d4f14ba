"""One sequence's trip through the cluster: prefill on P (elsewhere only if P dies), then decode on D.

    pick P (prefix-aware) → PrefillJob → PrefillDone(first token, kv_transfer_params)
        P lost (missed heartbeats, no progress while busy, restarted, unreachable) or the job failed
            → Abort to P (it may still be alive), then the next P; none left → D prefills locally
    pick D (least loaded) → DecodeJob → TokenBatch* until finished
    caller stops early (client gone, stop string) → Abort to whichever node holds the request

No per-request timeout: a request queued behind others on a live node that keeps stepping is waiting, not lost,
and computing its prompt a second time elsewhere would only add load (router/progress.py decides "stuck").
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec

from router import protocol as P
from router.node_client import NodeClient, NodeLost, NodeUnavailable
from router.openai_schema import ApiError
from router.pairing import pick_decode, pick_prefill
from router.registry import NodeState

log = logging.getLogger(__name__)

DECODE_ROLES = (P.NodeRole.DECODE, P.NodeRole.BOTH)


class _DecodeNodeFailed(Exception):
    """The decode node vanished; retried elsewhere if nothing was streamed from it yet."""


@dataclass(frozen=True)
class SeqRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: P.SamplingSpec
    cache_salt: str | None = None


@dataclass
class SeqEvent:
    token_ids: list[int]
    logprobs: list[P.TokenLogprob] | None
    finished: bool
    finish_reason: P.FinishReason | None


@dataclass
class SeqTrace:
    """What happened to a sequence (for metrics and logs)."""

    prefill_node: str | None = None
    decode_node: str | None = None
    prefill_attempts: int = 0
    local_prefill: bool = False
    caches: list[tuple[P.NodeRole, P.CacheInfo]] = field(default_factory=list)


class Dispatcher:
    def __init__(self, client: NodeClient):
        self.client = client

    @property
    def registry(self):
        return self.client.registry

    def check_available(self) -> None:
        if not self.registry.alive(*DECODE_ROLES):
            raise ApiError(503, "no decode node is alive", "service_unavailable", None, "no_decode_node")

    async def generate(self, req: SeqRequest, trace: SeqTrace) -> AsyncIterator[SeqEvent]:
        self.check_available()
        first = await self._prefill(req, trace)
        if first is not None:
            yield SeqEvent([first.first_token_id], [first.logprob] if first.logprob else None, first.finished,
                           first.finish_reason)
            if first.finished or req.params.max_tokens <= 1:
                if not first.finished:
                    yield SeqEvent([], None, True, P.FinishReason.LENGTH)
                return
        async with contextlib.aclosing(self._decode(req, first, trace)) as events:
            async for event in events:
                yield event

    async def _prefill(self, req: SeqRequest, trace: SeqTrace) -> P.PrefillDone | None:
        keys = self.registry.prompt_keys(req.prompt_token_ids, req.cache_salt)
        tried: set[str] = set()
        while True:
            choice = pick_prefill(self.registry.alive(P.NodeRole.PREFILL), keys, exclude=tried)
            if choice is None:
                if trace.prefill_attempts:
                    log.warning("%s: no prefill node left (tried %s); decode node prefills", req.request_id, tried)
                trace.local_prefill = True
                return None
            node = choice.node
            tried.add(node.node_id)
            trace.prefill_attempts += 1
            trace.prefill_node = node.node_id
            job = P.PrefillJob(req.request_id, req.prompt_token_ids, req.params, req.cache_salt)
            reply = await self._ask(node, req.request_id, job)
            if isinstance(reply, P.PrefillDone):
                trace.caches.append((P.NodeRole.PREFILL, reply.cache))
                return reply
            log.warning("%s: prefill on %s failed (%s); retrying", req.request_id, node.node_id, reply)

    async def _ask(self, node: NodeState, request_id: str, job: P.Message) -> P.PrefillDone | str:
        queue = self.client.open(request_id, node)
        try:
            await self.client.send(node.node_id, job)
            reply = await queue.get()
        except NodeUnavailable as e:
            reply = NodeLost(node.node_id, str(e))
        except BaseException:
            await self.client.abort(node.node_id, [request_id])
            raise
        finally:
            self.client.close_stream(request_id)
        if isinstance(reply, P.PrefillDone):
            return reply
        # Before the prompt goes elsewhere: a node dropped for silence may be merely paused and would resume it.
        await self.client.abort(node.node_id, [request_id])
        if isinstance(reply, NodeLost):
            return f"node lost: {reply.reason}"
        if isinstance(reply, P.JobFailed):
            return f"job failed: {reply.message}"
        return f"unexpected reply {type(reply).__name__}"

    async def _decode(self, req: SeqRequest, first: P.PrefillDone | None, trace: SeqTrace) -> AsyncIterator[SeqEvent]:
        params = req.params
        if first is not None:  # the first token came from the prefill node
            params = msgspec.structs.replace(params, max_tokens=params.max_tokens - 1)
        job = P.DecodeJob(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            params=params,
            first_token_id=first.first_token_id if first else None,
            kv_transfer_params=first.kv_transfer_params if first else None,
            cache_salt=req.cache_salt,
        )
        tried: set[str] = set()
        while True:
            node = pick_decode(self.registry.alive(*DECODE_ROLES), exclude=tried)
            if node is None:
                raise ApiError(503, "no decode node is alive", "service_unavailable", None, "no_decode_node")
            tried.add(node.node_id)
            trace.decode_node = node.node_id
            streamed = False
            try:
                # aclosing: if our caller stops early, the node's request is aborted now, not at GC time
                async with contextlib.aclosing(self._decode_on(node, job, trace)) as events:
                    async for event in events:
                        streamed = True
                        yield event
                return
            except _DecodeNodeFailed as e:
                if streamed:  # tokens already reached the client: cannot replay them elsewhere
                    raise ApiError(502, str(e), "server_error") from e
                log.warning("%s: %s; retrying on another decode node", req.request_id, e)

    async def _decode_on(self, node: NodeState, job: P.DecodeJob, trace: SeqTrace) -> AsyncIterator[SeqEvent]:
        queue = self.client.open(job.request_id, node)
        done = False
        try:
            await self.client.send(node.node_id, job)
            while not done:
                reply = await queue.get()
                if isinstance(reply, P.TokenBatch):
                    if reply.cache is not None:
                        trace.caches.append((node.role, reply.cache))
                    done = reply.finished
                    yield SeqEvent(reply.token_ids, reply.logprobs, reply.finished, reply.finish_reason)
                elif isinstance(reply, NodeLost):  # not `done`: the finally aborts it on a node that may resume
                    raise _DecodeNodeFailed(f"decode node {node.node_id} lost: {reply.reason}")
                elif isinstance(reply, P.JobFailed):
                    done = True
                    raise ApiError(500, f"decode failed on {node.node_id}: {reply.message}", "server_error")
        except NodeUnavailable as e:
            raise _DecodeNodeFailed(str(e)) from e
        finally:
            self.client.close_stream(job.request_id)
            if not done:  # the caller stopped early (client gone, stop string) or the node was lost
                await self.client.abort(node.node_id, [job.request_id])
