"""The router's one typed config (built by router.cli from argv, or directly by tests and the launcher)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from common.auth import ServerAuth
from protocol import defaults
from protocol import messages as P
from router.pairing_policy import PairingPolicy


class PrefixSource(enum.Enum):
    """Where prefix-aware pairing (router/pairing.py) learns what each node's device cache holds."""

    EVENTS = "events"  # the KV event index (router/kv_index.py) for nodes that publish events, else heartbeats
    HEARTBEAT = "heartbeat"  # the recent-key summaries in heartbeats alone (the policy before KV events)


@dataclass(frozen=True)
class RouterConfig:
    bind_nodes: str = "tcp://127.0.0.1:0"  # where nodes connect (ZeroMQ ROUTER)
    host: str = defaults.HTTP_HOST
    port: int = defaults.HTTP_PORT
    model: str = defaults.MODEL  # the model (the CLI takes its folder); the served name defaults to it
    served_model_name: str | None = None  # the name clients send; defaults to `model`
    api_key: str | None = None
    node_timeout_s: float = 3.0  # a node silent this long is dropped
    # A node holding our requests whose engine has not completed a step for this long is dropped and its requests
    # go elsewhere. Not a request timeout: queued requests on a node that keeps stepping wait as long as it takes.
    stall_timeout_s: float = 120.0
    # Admission (router/admission.py): sequences beyond the nodes' capacity wait in the router's queue. The queue
    # always takes this many requests, and more while their tokens fit in max_queue_wait_s of the measured
    # service rate; beyond that: 429 with Retry-After.
    max_queued_requests: int = 64
    max_queue_wait_s: float = 60.0
    max_model_len: int | None = None  # cap below the nodes' own limit
    # Hostile-input bounds (docs/security.md). A body is refused with 413 before it is parsed; 4 MiB holds a
    # 128k-token prompt as text or as token ids with room to spare. Prompt characters are counted before
    # tokenizing (which runs on a worker thread), and one request's sequences (prompts x n) are capped.
    max_body_bytes: int = 4 * 1024 * 1024
    max_prompt_chars: int = 1 << 20
    max_sequences_per_request: int = 64
    # CURVE on the node socket (router/node_client.py): the router's secret key and the folder of node keys, each
    # named for the node id it may register as. None: unauthenticated (the CLI requires --insecure for that).
    node_auth: ServerAuth | None = None
    # A request whose decode node died resumes on another one; with none alive it waits this long for one to
    # (re)register (e.g. restarted by `ucm-serve up`), then fails with a clear error.
    decode_wait_s: float = 60.0
    # The periodic stats line (router/stats_log.py: throughput, running/waiting, KV usage, hit rates), written
    # every this many seconds while there is activity; vLLM's default.
    stats_interval_s: float = 10.0
    # Nodes started with --kv-events-config announce their KV event endpoints; with EVENTS the router subscribes and
    # pairs by what the events say each node holds (nodes without events: their heartbeat summaries).
    prefix_source: PrefixSource = PrefixSource.EVENTS
    # Fronting vLLM instead of ucm-serve nodes (router/vllm_app.py): their base URLs, by P/D role. Prefill instances
    # run UCMConnector as kv_producer, decode instances as kv_consumer, on one store daemon (docs/vllm.md).
    vllm_prefill: tuple[str, ...] = ()
    vllm_decode: tuple[str, ...] = ()
    # The KV event publishers of vLLM instances started with --kv-events-config: (instance URL, its endpoints). The
    # router indexes what each one's device cache holds and prices it when it chooses instances (router/vllm_pool.py).
    vllm_kv_events: tuple[tuple[str, P.KVEventsEndpoint], ...] = ()
    # Sequences each vLLM decode instance runs at once (its --max-num-seqs): admission's capacity per instance.
    vllm_max_num_seqs: int = 64
    # How router/pairing.py picks each request's prefill and decode node (COST: by measured seconds).
    pairing: PairingPolicy = PairingPolicy.COST
    # The store daemon's KV events (`ucm-serve store --kv-events-config`): what its DRAM and disk hold, which every
    # node with a store can load instead of computing; COST pairing prices them. None: not indexed.
    store_events: P.KVEventsEndpoint | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if self.decode_wait_s < 0:
            raise ValueError(f"decode_wait_s must be >= 0, got {self.decode_wait_s}")
        for name in ("node_timeout_s", "stall_timeout_s", "max_queue_wait_s", "stats_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("max_body_bytes", "max_prompt_chars", "max_sequences_per_request"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.vllm_prefill and not self.vllm_decode:
            raise ValueError("vLLM prefill instances need at least one vLLM decode instance (--vllm-decode URL)")
        instances = set(self.vllm_prefill) | set(self.vllm_decode)
        for url, _ in self.vllm_kv_events:
            if url not in instances:
                raise ValueError(f"--vllm-kv-events names {url}, which is not a --vllm-prefill or --vllm-decode URL")
        if self.vllm_max_num_seqs < 1:
            raise ValueError(f"vllm_max_num_seqs must be >= 1, got {self.vllm_max_num_seqs}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be non-empty when given")

    @property
    def fronts_vllm(self) -> bool:
        return bool(self.vllm_decode)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model
