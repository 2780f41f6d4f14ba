"""The seam between the role-agnostic runner (node/runner.py) and a role's job handling (prefill_node/worker.py,
decode_node/worker.py): what a role tells the runner to queue, what the runner remembers about a live job, and the
output helpers both roles share.

A role is a `RoleWorker`: it says which job kind it takes, what engine request a job becomes, and which wire
messages an engine output becomes. The runner owns everything else (bounds checks, the engine calls, aborts,
failed steps, counters that are not per role).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from protocol import messages as P
from ucm.api import Tier

if TYPE_CHECKING:  # the runtime stays importable without torch; only the types are needed here
    from connector.base import KVConnectorRole
    from engine.outputs import PositionLogprobs, RequestOutput

Job = P.PrefillJob | P.DecodeJob


@dataclass
class JobCounters:
    """Jobs this node started, by kind: reported in heartbeats so tests and /metrics can tell that no prompt
    was prefilled twice (a prefill retried elsewhere shows up as a second start on another node)."""

    prefill_started: int = 0  # PrefillJob accepted
    decode_started: int = 0  # DecodeJob accepted (with or without a first token)
    local_prefill_started: int = 0  # DecodeJob without a first token: this node computes the whole prompt
    aborted: int = 0  # jobs the router aborted while they were live here
    refused: int = 0  # jobs answered JobFailed at once: out of bounds, or the engine would not take them
    failed: int = 0  # jobs failed later: their engine step (or their output) raised
    step_errors: int = 0  # engine steps that raised; the node kept serving
    busy_seconds: float = 0.0  # wall time inside engine steps: what router/step_cost.py divides by work

    def as_stats(self) -> dict[str, float]:
        return {f"jobs_{k}": float(v) for k, v in vars(self).items()}


@dataclass(frozen=True)
class EngineJob:
    """What a role asks the engine to compute for one job."""

    prompt_token_ids: list[int]  # decode with a first token: the prompt + that token
    max_tokens: int
    kv_transfer_params: P.KVTransferParams | None = None  # the connector's input (the producer's params)


@dataclass
class LiveJob:
    """What the runner keeps about a job while the engine works on it."""

    prompt_tokens: int  # the prompt as the client sent it (without the first token)
    want_logprobs: int | None
    reported_cache: bool = False


class RoleWorker(Protocol):
    """One node role's job handling. `connector_role` is the KV connector the role's engine runs with."""

    @property
    def role(self) -> P.NodeRole: ...

    @property
    def connector_role(self) -> KVConnectorRole: ...

    @property
    def job_type(self) -> type[P.PrefillJob] | type[P.DecodeJob]: ...

    def engine_job(self, job: Any, counters: JobCounters) -> EngineJob:
        """The engine request for an accepted job (of `job_type`); counts it as started."""
        ...

    def messages(self, out: RequestOutput, job: LiveJob) -> list[P.Message]:
        """The wire messages for one engine output of this job (possibly none: a prefill chunk in progress)."""
        ...


def finish_reason(engine_reason: str | None) -> P.FinishReason | None:
    """The engine's vLLM-style string ("stop" / "length" / "abort") as the wire enum."""
    return P.FinishReason(engine_reason) if engine_reason else None


def to_logprobs(positions: list[PositionLogprobs] | None, want: int | None) -> list[P.TokenLogprob] | None:
    if want is None or not positions:
        return None
    out = []
    for pos in positions:
        items = list(pos.items())
        sampled_id, sampled = items[0]  # the engine puts the sampled token first
        top = sorted(((t, lp) for t, lp in items if 1 <= getattr(lp, "rank", 1) <= want), key=lambda x: x[1].rank)
        out.append(P.TokenLogprob(sampled_id, float(sampled.logprob), [(t, float(lp.logprob)) for t, lp in top[:want]]))
    return out


def cache_info(out: RequestOutput, job: LiveJob) -> P.CacheInfo:
    cached = max(0, int(getattr(out, "num_cached_tokens", 0) or 0))
    store: int | None = getattr(out, "num_external_tokens", None)
    params = out.kv_transfer_params
    if store is None and params is not None:
        store = params.num_cached_tokens  # the producer connector's count of tokens it loaded
    by_tier: dict[str, int] = getattr(out, "external_tokens_by_tier", None) or {}
    # The connector counted the blocks it loaded; a block a preempted request loaded twice is one hit: clamp to
    # the engine's own count so that DRAM + disk == store_hit_tokens.
    disk = min(by_tier.get(Tier.DISK.value, 0), store or 0)
    dram = (store or 0) - disk if by_tier else 0
    return P.CacheInfo(
        prompt_tokens=job.prompt_tokens,
        cached_tokens=cached,
        store_hit_tokens=store,
        store_dram_tokens=dram,
        store_disk_tokens=disk,
    )
