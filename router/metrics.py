"""Prometheus metrics of the router (one CollectorRegistry per app, so tests can run several apps).

Names follow vLLM's where one exists (`…time_to_first_token_seconds`, `…time_per_output_token_seconds`,
`…e2e_request_latency_seconds`, `…prompt_tokens_total`, `…generation_tokens_total`), prefixed `ucm_`; vLLM's own
names are exported beside them (router/vllm_metrics.py, router/node_metrics.py). Node heartbeat stats are named
counters / gauges (`ucm_node_<stat>_total`, router/node_metrics.py): counters are exported as counters only.

Every label set is bounded, since label values come from clients and nodes: endpoints are the app's routes (any
other path is `other`, see router/http_gate.py), a node's series go when it leaves the registry, at most
MAX_STATS_PER_NODE heartbeat stats are exported per node, and node events are kept for at most MAX_EVENT_NODES
node ids (departed ones forgotten first).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from protocol import messages as P
from router.admission import AdmissionQueue
from router.node_metrics import NodeCollector
from router.registry import Registry
from router.vllm_metrics import VllmMetrics

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
MAX_EVENT_NODES = 64
_MAX_LABEL_CHARS = 128


class IndexSizes(Protocol):
    def sizes(self) -> dict[tuple[str, str], int]: ...


class _Observer(Protocol):
    def observe(self, amount: float) -> None: ...


class _Incrementer(Protocol):
    def inc(self, amount: float = 1) -> None: ...


class _TeeObserve:
    """One observation into ours and vLLM's histogram."""

    def __init__(self, *targets: _Observer) -> None:
        self._targets = targets

    def observe(self, amount: float) -> None:
        for t in self._targets:
            t.observe(amount)


class _TeeInc:
    def __init__(self, *targets: _Incrementer) -> None:
        self._targets = targets

    def inc(self, amount: float = 1) -> None:
        for t in self._targets:
            t.inc(amount)


class RouterMetrics:
    def __init__(self, registry: Registry, admission: AdmissionQueue) -> None:
        self._nodes = registry
        self._admission = admission
        self.registry = CollectorRegistry()
        r = self.registry
        self.vllm = VllmMetrics(r, registry.model_name)
        r.register(NodeCollector(registry, registry.model_name))
        self.requests = Counter(
            "ucm_requests", "HTTP requests by endpoint and status code", ["endpoint", "status"], registry=r
        )
        self.ttft = _TeeObserve(
            Histogram("ucm_time_to_first_token_seconds", "time to first token", buckets=_LATENCY_BUCKETS, registry=r),
            self.vllm.ttft,
        )
        self.itl = self.vllm.itl
        self.tpot = _TeeObserve(
            Histogram(
                "ucm_time_per_output_token_seconds",
                "mean time per output token after the first",
                buckets=_TPOT_BUCKETS,
                registry=r,
            ),
            self.vllm.tpot,
        )
        self.e2e = _TeeObserve(
            Histogram("ucm_e2e_request_latency_seconds", "end-to-end latency", buckets=_LATENCY_BUCKETS, registry=r),
            self.vllm.e2e,
        )
        self.prompt_tokens = _TeeInc(Counter("ucm_prompt_tokens", "prompt tokens", registry=r), self.vllm.prompt_tokens)
        self.generation_tokens = _TeeInc(
            Counter("ucm_generation_tokens", "generated tokens", registry=r), self.vllm.generation_tokens
        )
        self.cache_hit_tokens = Counter(
            "ucm_prefix_cache_hit_tokens",
            "prompt tokens not computed, by node role and source (device, store, cached)",
            ["role", "source"],
            registry=r,
        )
        self.prefill_retries = Counter("ucm_prefill_retries", "prefill jobs retried on another node", registry=r)
        self.stale_routes = Counter(
            "ucm_prefill_stale_routes",
            "prefills sent to a node for device-cached blocks (by the KV event index) it no longer held",
            registry=r,
        )
        self.local_prefills = Counter(
            "ucm_local_prefills", "sequences prefilled on the decode node (no prefill node)", registry=r
        )
        self.decode_resumes = Counter(
            "ucm_decode_resumes",
            "sequences resumed on another decode node after theirs was lost mid-stream",
            registry=r,
        )
        self.rejected = Counter(
            "ucm_requests_rejected", "requests refused with 429: the admission queue was full", registry=r
        )
        self.index_blocks = Gauge(
            "ucm_kv_index_blocks",
            "block keys the router's KV event index holds per source (a node, or <store>) and medium",
            ["source", "medium"],
            registry=r,
        )
        self.index: IndexSizes | None = None  # router/kv_index.py's KVIndex when the router indexes KV events
        self.queue_depth = Gauge(
            "ucm_queue_depth_requests", "requests waiting in the router for room on the nodes", registry=r
        )
        self.queue_tokens = Gauge("ucm_queue_tokens", "prompt + max new tokens of the requests waiting", registry=r)
        self.queue_bound_tokens = Gauge(
            "ucm_queue_bound_tokens",
            "queued tokens the measured service rate serves within --max-queue-wait-s (beyond --max-queued-requests)",
            registry=r,
        )
        self.running_seqs = Gauge("ucm_running_sequences", "sequences admitted to the nodes", registry=r)
        self.node_events = Counter("ucm_node_events", "node registrations / drops", ["node", "event"], registry=r)
        self.node_up = Gauge(
            "ucm_node_up", "1 while a node is registered and heartbeating", ["node", "role"], registry=r
        )
        self.node_running = Gauge("ucm_node_running_requests", "running requests per node", ["node"], registry=r)
        self.node_waiting = Gauge("ucm_node_waiting_requests", "waiting requests per node", ["node"], registry=r)
        self.node_free_blocks = Gauge("ucm_node_free_kv_blocks", "free KV blocks per node", ["node"], registry=r)
        self.store_tier = Gauge(
            "ucm_store_tier",
            "the KV store's per-tier counters (hits, misses, blocks, bytes_used, evictions…) as reported by its nodes",
            ["tier", "name"],
            registry=r,
        )
        self.node_messages_dropped = Gauge(
            "ucm_node_messages_dropped",
            "messages from nodes the router could not decode or handle (counted, logged rate-limited, skipped)",
            registry=r,
        )
        self._known: dict[str, P.NodeRole] = {}  # exported node -> role
        self._tiers: set[tuple[str, str]] = set()
        self._event_nodes: OrderedDict[str, set[str]] = OrderedDict()  # node -> its events, least recent first

    def count_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def node_event(self, node_id: str, event: str) -> None:
        node_id = node_id[:_MAX_LABEL_CHARS]
        events = self._event_nodes.pop(node_id, set())
        events.add(event)
        self._event_nodes[node_id] = events
        self.node_events.labels(node_id, event).inc()
        while len(self._event_nodes) > MAX_EVENT_NODES:
            victim = next((n for n in self._event_nodes if n not in self._nodes.nodes), None)
            if victim is None:
                break
            for name in self._event_nodes.pop(victim):
                with contextlib.suppress(KeyError):
                    self.node_events.remove(victim, name)

    def record_cache(self, role: P.NodeRole, info: P.CacheInfo) -> None:
        """Prompt tokens not computed, by source: device (node prefix cache), store (loaded through the
        connector), or cached (the node did not say which)."""
        if info.store_hit_tokens is None:
            if info.cached_tokens:
                self.cache_hit_tokens.labels(role.value, "cached").inc(info.cached_tokens)
            return
        device = max(0, info.cached_tokens - info.store_hit_tokens)
        if device:
            self.cache_hit_tokens.labels(role.value, "device").inc(device)
        if info.store_hit_tokens:
            self.cache_hit_tokens.labels(role.value, "store").inc(info.store_hit_tokens)

    def render(self) -> bytes:
        self._refresh_nodes()
        if self.index is not None:
            self.index_blocks.clear()  # a forgotten source leaves no stale series
            for (source, medium), n in self.index.sizes().items():
                self.index_blocks.labels(source, medium).set(n)
        self.queue_depth.set(self._admission.depth)
        self.queue_tokens.set(self._admission.queued_tokens)
        self.queue_bound_tokens.set(self._admission.bound_tokens())
        self.running_seqs.set(self._admission.running)
        return generate_latest(self.registry)

    def _forget(self, node_id: str, role: P.NodeRole) -> None:
        with contextlib.suppress(KeyError):
            self.node_up.remove(node_id, role.value)
        for gauge in (self.node_running, self.node_waiting, self.node_free_blocks):
            with contextlib.suppress(KeyError):
                gauge.remove(node_id)

    def _refresh_nodes(self) -> None:
        alive = self._nodes.nodes
        for node_id, role in list(self._known.items()):
            node = alive.get(node_id)
            if node is None or node.role is not role:
                self._forget(node_id, role)
                del self._known[node_id]
        for node in alive.values():
            self._known[node.node_id] = node.role
            self.node_up.labels(node.node_id, node.role.value).set(1)
            self.node_running.labels(node.node_id).set(node.running)
            self.node_waiting.labels(node.node_id).set(node.waiting)
            self.node_free_blocks.labels(node.node_id).set(node.free_blocks)
        # Every node of a deployment talks to the same store: show its tiers once (the freshest report).
        tiers: dict[tuple[str, str], float] = {}
        for node in alive.values():
            for name, value in node.stats.items():
                parts = name.split("_", 2)
                if name.startswith("store_") and len(parts) == 3 and parts[1] in ("dram", "disk"):
                    key = (parts[1], parts[2])
                    tiers[key] = max(tiers.get(key, 0.0), value)
        for tier, name in self._tiers - tiers.keys():
            with contextlib.suppress(KeyError):
                self.store_tier.remove(tier, name)
        self._tiers = set(tiers)
        for (tier, name), value in tiers.items():
            self.store_tier.labels(tier, name).set(value)
