"""`VllmBackend`: one `vllm serve` instance the router fronts, by URL, in one of the two P/D roles.

The router never sees a vLLM instance register: it is given URLs (`ucm-serve router --vllm-prefill URL
--vllm-decode URL`) and learns whether each is alive from its `/health` and from the requests it sends
(router/vllm_pool.py). A prefill instance runs vLLM with the UCMConnector as `kv_producer`, a decode instance as
`kv_consumer`; both use the same store daemon, so any decode instance loads what any prefill instance saved.

It is a pairing `Candidate` (router/pairing.py): its queue, KV cache size and measured step costs come from its
`/metrics` (router/vllm_scrape.py, `observe`), what its device cache holds from its KV events where it publishes them
(`events`, router/kv_index.py), and the router's own requests on it cover the scrapes' lag.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from common.keys import BlockKey
from protocol import messages as P
from router.config import RouterConfig
from router.step_cost import StepCost
from router.vllm_scrape import VllmLoad

# Until the instance's /metrics names its block size (vllm:cache_config_info): vLLM's default on a GPU.
DEFAULT_BLOCK_SIZE = 16


class BackendRole(enum.Enum):
    PREFILL = "prefill"  # kv_producer: computes the prompt (max_tokens=1), its blocks land in the store
    DECODE = "decode"  # kv_consumer: loads the prompt's blocks from the store, generates the answer


class BadBackendUrl(ValueError):
    pass


def normalize_url(url: str) -> str:
    """`http://host:port` without a trailing slash or `/v1`: the router appends the OpenAI paths itself."""
    clean = url.strip().rstrip("/").removesuffix("/v1")
    if not clean.startswith(("http://", "https://")) or "://" not in clean or not clean.split("://", 1)[1]:
        raise BadBackendUrl(f"a vLLM instance is an http(s)://HOST:PORT URL, got {url!r}")
    return clean


@dataclass
class BackendSize:
    """Pairing's `Size` of an instance: its --max-num-seqs, and its KV cache as its /metrics announce it."""

    capacity: int
    block_size: int = DEFAULT_BLOCK_SIZE
    num_blocks: int = 0
    block_size_known: bool = False


@dataclass(eq=False)
class VllmBackend:
    url: str
    role: BackendRole
    max_num_seqs: int = RouterConfig.vllm_max_num_seqs
    events: P.KVEventsEndpoint | None = None  # its --kv-events-config publisher, where it has one
    alive: bool = True  # until a request or a health probe finds it down
    in_flight: int = 0  # the router's requests on it now
    failures: int = 0  # requests that failed on it (connection lost, 5xx): the router's /metrics and /health
    slow_probes: int = 0  # health probes in a row that timed out (router/vllm_pool.py)
    running: int = 0  # from its /metrics (0 until scraped)
    waiting: int = 0
    free_blocks: int = 0
    sent_tokens: int = 0  # prompt tokens of the router's prefills on it not answered yet (as pairing priced them)
    tokens_per_prefill: float = 0.0  # its /metrics' mean prompt tokens computed per request
    scraped: bool = False  # its /metrics answered at least once
    cost: StepCost = field(default_factory=StepCost)
    info: BackendSize = field(init=False)

    def __post_init__(self) -> None:
        self.url = normalize_url(self.url)
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        self.info = BackendSize(self.max_num_seqs)

    @property
    def name(self) -> str:
        return f"{self.role.value}@{self.url.split('://', 1)[1]}"

    @property
    def node_id(self) -> str:
        return self.name

    @property
    def queued_tokens(self) -> int:
        """The prompt tokens ahead of the next one: the router's own, and the mean request's for each request its
        /metrics count beyond the router's (another client's, or ones its scrape has not caught up with)."""
        others = max(0, self.running + self.waiting - self.in_flight)
        return self.sent_tokens + round(others * self.tokens_per_prefill)

    @property
    def load(self) -> float:
        return max(self.running + self.waiting, self.in_flight) / self.info.capacity

    def prefix_hit_blocks(self, keys: list[BlockKey]) -> int:
        return 0  # no summaries beside its KV events (which pairing gets as `hits`)

    def observe(self, load: VllmLoad, now: float) -> None:
        """One scrape of its /metrics."""
        self.running, self.waiting, self.scraped = load.running, load.waiting, True
        self.tokens_per_prefill = load.tokens_per_prefill
        if load.block_size is not None:
            self.info.block_size, self.info.block_size_known = load.block_size, True
        if load.num_blocks is not None:
            self.info.num_blocks = load.num_blocks
            self.free_blocks = round(load.num_blocks * (1.0 - load.kv_usage))
        self.cost.observe(load.step_stats(), now)
