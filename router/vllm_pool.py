"""`VllmPool`: the vLLM instances the router fronts, which are alive, and which one serves next.

Liveness: a request that cannot reach an instance (connection refused or lost, a 5xx) marks it down at once, so
the retry goes elsewhere; a background probe of every instance's `/health` brings it back when it answers again
(e.g. restarted by `ucm-serve up --engine vllm`'s supervisor). Choice: the least loaded alive instance of the role
(the router's requests in flight on it), ties to the one listed first. vLLM's prefix cache does not matter for
the choice here: a decode instance loads the prompt from the shared store whichever instance prefilled it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Collection, Iterable

import httpx

from router.vllm_backend import BackendRole, VllmBackend

log = logging.getLogger("router.vllm")
_PROBE_TIMEOUT_S = 2.0
# A probe that times out may be a busy instance rather than a dead one (its API server shares the host's cores with
# the engine and everything else): down after this many in a row. A refused or reset connection (no process) and a
# failed request mark it down at once.
_SLOW_PROBES_TO_DOWN = 3


class VllmPool:
    def __init__(self, backends: Iterable[VllmBackend], max_num_seqs: int, probe_interval_s: float = 1.0) -> None:
        self.backends = list(backends)
        if not any(b.role is BackendRole.DECODE for b in self.backends):
            raise ValueError("the router needs at least one vLLM decode instance (--vllm-decode URL)")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.max_num_seqs = max_num_seqs
        self.probe_interval_s = probe_interval_s
        self._probe: asyncio.Task[None] | None = None
        self.on_alive: list[asyncio.Event] = []  # set whenever an instance comes back (waiting requests retry)

    def of(self, role: BackendRole) -> list[VllmBackend]:
        return [b for b in self.backends if b.role is role]

    def pick(self, role: BackendRole, exclude: Collection[VllmBackend] = ()) -> VllmBackend | None:
        candidates = [b for b in self.of(role) if b.alive and b not in exclude]
        if not candidates:
            return None
        return min(candidates, key=lambda b: b.in_flight)  # min keeps the first of equals: the listed order

    def capacity(self) -> int:
        """Sequences the decode instances run at once (admission's bound, router/admission.py)."""
        return self.max_num_seqs * sum(1 for b in self.of(BackendRole.DECODE) if b.alive)

    def mark_down(self, backend: VllmBackend, why: str) -> None:
        backend.failures += 1
        if backend.alive:
            log.warning("vLLM %s instance %s is down (%s); trying others", backend.role.value, backend.url, why)
        backend.alive = False

    def _mark_up(self, backend: VllmBackend) -> None:
        if not backend.alive:
            log.info("vLLM %s instance %s answers again", backend.role.value, backend.url)
            backend.alive = True
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
            elif backend.alive and (not slow or backend.slow_probes >= _SLOW_PROBES_TO_DOWN):
                backend.alive = False
                log.warning("vLLM %s instance %s fails its health check", backend.role.value, backend.url)

        await asyncio.gather(*(one(b) for b in self.backends))

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
