"""One sequence's trip through the cluster: prefill on P (elsewhere only if P dies), then decode on D.

    pick P (prefix-aware) → PrefillJob → PrefillDone(first token, kv_transfer_params)
        P lost (missed heartbeats, no progress while busy, restarted, unreachable) or the job failed
            → Abort to P (it may still be alive), then the next P; none left → D prefills locally
    pick D (least loaded) → DecodeJob → TokenBatch* until finished
        D lost, before or after tokens reached the client → Abort to D, then resume on another D (or on a
            restarted one: with none alive the request waits up to `decode_wait_s` for a registration) from
            what was already sent: prompt + tokens so far, the last of them as the job's first token,
            max_tokens reduced; the caller sees one unbroken stream
    caller stops early (client gone, stop string) → Abort to whichever node holds the request

No per-request timeout: a request queued behind others on a live node that keeps stepping is waiting, not lost,
and computing its prompt a second time elsewhere would only add load (router/progress.py decides "stuck").
Greedy output is the same after a resume: the resumed node recomputes the KV of prompt + tokens so far (the
prompt's blocks from the store) and samples on from there. A seeded non-greedy stream stays deterministic but
not equal to an unbroken one: the sampler's noise is keyed by the position within the job's own output.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

import msgspec

from common.keys import BlockKey
from protocol import messages as P
from router.arrivals import NodeArrivals
from router.kv_index import STORE_MEDIA, STORE_SOURCE, KVIndex
from router.node_client import NodeClient, NodeLost, NodeUnavailable
from router.openai_schema import ApiError, bad_request
from router.pairing import Pairing
from router.pairing_policy import PairingPolicy
from router.registry import NodeState, Registry

log = logging.getLogger(__name__)

DECODE_ROLES = (P.NodeRole.DECODE, P.NodeRole.BOTH)
# How long a request whose decode node died waits for another one to register before it fails.
DEFAULT_DECODE_WAIT_S = 60.0


def _raise_if_invalid(reply: P.JobFailed) -> None:
    """A request the engine refused as invalid fails the same on every node: 400 now, no retry elsewhere."""
    if reply.code is P.FailureCode.INVALID_REQUEST:
        raise bad_request(reply.message)


class _DecodeNodeFailed(Exception):
    """The decode node vanished; the request resumes elsewhere from the tokens already produced."""


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
    decode_resumes: int = 0  # decode jobs sent again after a decode node was lost
    caches: list[tuple[P.NodeRole, P.CacheInfo]] = field(default_factory=list)
    # prompt tokens the KV event index said the prefill node held in its device cache (the part it can reuse)
    indexed_device_tokens: int = 0

    def stale_route(self) -> bool:
        """The prefill node reused fewer device-cached tokens than the index said it held: routed on a stale entry."""
        for role, info in self.caches:
            if role is P.NodeRole.PREFILL:
                return info.cached_tokens - (info.store_hit_tokens or 0) < self.indexed_device_tokens
        return False


@dataclass
class _DecodeState:
    """A sequence's decode so far: enough to send the job again to another node from where it stopped."""

    req: SeqRequest
    first: P.PrefillDone | None
    generated: list[int] = field(default_factory=list)  # every token the caller got, the prefill's first included
    attempts: int = 0
    failed: set[tuple[str, str]] = field(default_factory=set)  # (node id, incarnation) that lost this request

    def next_job(self) -> P.DecodeJob:
        """The job for the next attempt. The last token produced becomes the job's first token, so the node
        samples its successor; the prompt's KV still comes from the store (a prefix of the new prompt)."""
        req, first = self.req, self.first
        request_id = req.request_id if self.attempts == 0 else f"{req.request_id}/r{self.attempts}"
        self.attempts += 1
        left = req.params.max_tokens - len(self.generated)
        assert left >= 1, f"{req.request_id}: resuming with {left} tokens left"
        params = msgspec.structs.replace(req.params, max_tokens=left, num_generated=len(self.generated))
        if not self.generated:  # nothing produced yet: the decode node prefills the prompt itself
            return P.DecodeJob(request_id, req.prompt_token_ids, params, cache_salt=req.cache_salt)
        transfer = first.kv_transfer_params if first is not None else None
        return P.DecodeJob(
            request_id,
            req.prompt_token_ids + self.generated[:-1],
            params,
            first_token_id=self.generated[-1],
            kv_transfer_params=transfer,
            cache_salt=req.cache_salt,
        )

    @property
    def done(self) -> bool:
        return len(self.generated) >= self.req.params.max_tokens


class Dispatcher:
    def __init__(
        self,
        client: NodeClient,
        decode_wait_s: float = DEFAULT_DECODE_WAIT_S,
        prefix_index: KVIndex | None = None,
        pairing: Pairing | None = None,
    ):
        """`prefix_index`: what the nodes' KV events say they hold (router/kv_index.py); None: heartbeats only.
        `pairing`: which rule picks the nodes (router/pairing.py; default: the measured-cost one)."""
        if decode_wait_s < 0:
            raise ValueError(f"decode_wait_s must be >= 0, got {decode_wait_s}")
        self.client = client
        self.decode_wait_s = decode_wait_s
        self.prefix_index = prefix_index
        self.pairing = pairing if pairing is not None else Pairing(PairingPolicy.COST)
        self.arrivals = NodeArrivals()
        client.on_node_event.append(self.arrivals.node_event)

    @property
    def registry(self) -> Registry:
        return self.client.registry

    def check_available(self) -> None:
        if not self.registry.alive(*DECODE_ROLES):
            raise ApiError(503, "no decode node is alive", "service_unavailable", None, "no_decode_node")

    async def generate(self, req: SeqRequest, trace: SeqTrace) -> AsyncGenerator[SeqEvent, None]:
        first = await self._prefill(req, trace)
        if first is not None:
            yield SeqEvent(
                [first.first_token_id], [first.logprob] if first.logprob else None, first.finished, first.finish_reason
            )
            if first.finished or req.params.max_tokens <= 1:
                if not first.finished:
                    yield SeqEvent([], None, True, P.FinishReason.LENGTH)
                return
        async with contextlib.aclosing(self._decode(req, first, trace)) as events:
            async for event in events:
                yield event

    async def _prefill(self, req: SeqRequest, trace: SeqTrace) -> P.PrefillDone | None:
        keys: list[BlockKey] | None = None  # hashed only once there is a prefill node to pick by them
        tried: set[str] = set()
        while True:
            alive = self.registry.alive(P.NodeRole.PREFILL)
            if keys is None and alive:
                keys = self.registry.prompt_keys(req.prompt_token_ids, req.cache_salt)
            hits = store_hits = None
            index = self.prefix_index
            if index is not None and keys:
                hits = index.prefix_hits([n.node_id for n in alive], keys)
                if index.indexed(STORE_SOURCE):  # what the store holds, every node with a store can load
                    depth = index.depth(STORE_SOURCE, keys, STORE_MEDIA)
                    store_hits = {n.node_id: depth for n in alive if n.info.has_store}
            choice = self.pairing.prefill(
                alive,
                keys or [],
                exclude=tried,
                hits=hits,
                store_hits=store_hits,
                prompt_tokens=len(req.prompt_token_ids),
            )
            if choice is None:
                if trace.prefill_attempts:
                    log.warning("%s: no prefill node left (tried %s); decode node prefills", req.request_id, tried)
                trace.local_prefill = True
                return None
            node = choice.node
            tried.add(node.node_id)
            trace.prefill_attempts += 1
            trace.prefill_node = node.node_id
            if hits is not None and node.node_id in hits:  # the index's word (heartbeat summaries are a hint)
                block = node.info.block_size
                reusable = (len(req.prompt_token_ids) - 1) // block * block  # the last token is always computed
                trace.indexed_device_tokens = min(choice.prefix_hit_blocks * block, reusable)
            job = P.PrefillJob(req.request_id, req.prompt_token_ids, req.params, req.cache_salt)
            node.queued_tokens += choice.compute_tokens  # the queue ahead of the next prompt priced on this node
            try:
                reply = await self._ask(node, req.request_id, job)
            finally:
                node.queued_tokens -= choice.compute_tokens
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
            _raise_if_invalid(reply)
            return f"job failed: {reply.message}"
        return f"unexpected reply {type(reply).__name__}"

    async def _decode(
        self, req: SeqRequest, first: P.PrefillDone | None, trace: SeqTrace
    ) -> AsyncGenerator[SeqEvent, None]:
        state = _DecodeState(req, first, [first.first_token_id] if first is not None else [])
        while True:
            node = await self._decode_node(state)
            job = state.next_job()
            trace.decode_node = node.node_id
            try:
                # aclosing: if our caller stops early, the node's request is aborted now, not at GC time
                events = self._decode_on(node, job, trace, record_cache=state.attempts == 1)
                async with contextlib.aclosing(events):
                    async for event in events:
                        state.generated.extend(event.token_ids)
                        yield event
                return
            except _DecodeNodeFailed as e:
                state.failed.add((node.node_id, node.info.instance))
                if state.done:  # the node died right after its last token: nothing left to produce
                    yield SeqEvent([], None, True, P.FinishReason.LENGTH)
                    return
                trace.decode_resumes += 1
                log.warning(
                    "%s: %s after %d tokens; resuming on another decode node", req.request_id, e, len(state.generated)
                )

    async def _decode_node(self, state: _DecodeState) -> NodeState:
        """The pairing's decode node among those that have not lost this request; with none, wait for a
        registration."""
        deadline = time.monotonic() + self.decode_wait_s
        req = state.req
        while True:
            alive = [n for n in self.registry.alive(*DECODE_ROLES) if (n.node_id, n.info.instance) not in state.failed]
            keys: list[BlockKey] = []
            hits = None
            if alive and self.pairing.policy in (PairingPolicy.COST, PairingPolicy.DYNAMO):
                keys = self.registry.prompt_keys(req.prompt_token_ids, req.cache_salt)
                if self.prefix_index is not None and keys:
                    hits = self.prefix_index.prefix_hits([n.node_id for n in alive], keys)
            node = self.pairing.decode(
                alive,
                prompt_keys=keys,
                hits=hits,
                max_tokens=req.params.max_tokens - len(state.generated),
                prefills_here=state.first is None,
                prompt_tokens=len(req.prompt_token_ids),
            )
            if node is not None:
                return node
            if not await self.arrivals.wait(deadline):
                raise ApiError(
                    503,
                    f"no decode node available for {self.decode_wait_s:g}s (request "
                    f"{state.req.request_id} had {len(state.generated)} tokens)",
                    "service_unavailable",
                    None,
                    "no_decode_node",
                )

    async def _decode_on(
        self, node: NodeState, job: P.DecodeJob, trace: SeqTrace, record_cache: bool
    ) -> AsyncGenerator[SeqEvent, None]:
        """`record_cache`: only the first attempt's prompt counts in the cache metrics (a resumed job's prompt
        holds the generated tokens too)."""
        queue = self.client.open(job.request_id, node)
        done = False
        try:
            await self.client.send(node.node_id, job)
            while not done:
                reply = await queue.get()
                if isinstance(reply, P.TokenBatch):
                    if reply.cache is not None and record_cache:
                        trace.caches.append((node.role, reply.cache))
                    done = reply.finished
                    yield SeqEvent(reply.token_ids, reply.logprobs, reply.finished, reply.finish_reason)
                elif isinstance(reply, NodeLost):  # not `done`: the finally aborts it on a node that may resume
                    raise _DecodeNodeFailed(f"decode node {node.node_id} lost: {reply.reason}")
                elif isinstance(reply, P.JobFailed):
                    done = True
                    _raise_if_invalid(reply)
                    raise ApiError(500, f"decode failed on {node.node_id}: {reply.message}", "server_error")
        except NodeUnavailable as e:
            raise _DecodeNodeFailed(str(e)) from e
        finally:
            self.client.close_stream(job.request_id)
            if not done:  # the caller stopped early (client gone, stop string) or the node was lost
                await self.client.abort(node.node_id, [job.request_id])
