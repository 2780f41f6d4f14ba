"""`VllmBackend`: one `vllm serve` instance the router fronts, by URL, in one of the two P/D roles.

The router never sees a vLLM instance register: it is given URLs (`ucm-serve router --vllm-prefill URL
--vllm-decode URL`) and learns whether each is alive from its `/health` and from the requests it sends
(router/vllm_pool.py). A prefill instance runs vLLM with the UCMConnector as `kv_producer`, a decode instance as
`kv_consumer`; both use the same store daemon, so any decode instance loads what any prefill instance saved.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


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


@dataclass(eq=False)
class VllmBackend:
    url: str
    role: BackendRole
    alive: bool = True  # until a request or a health probe finds it down
    in_flight: int = 0  # the router's requests on it now: pairing picks the least loaded
    failures: int = 0  # requests that failed on it (connection lost, 5xx): the router's /metrics and /health
    slow_probes: int = 0  # health probes in a row that timed out (router/vllm_pool.py)

    def __post_init__(self) -> None:
        self.url = normalize_url(self.url)

    @property
    def name(self) -> str:
        return f"{self.role.value}@{self.url.split('://', 1)[1]}"
