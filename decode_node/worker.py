"""A decode node's job handling: a DecodeJob with a first token is prompt + first token on an engine whose connector
loads the prompt's blocks from the store, so only the tail (partial block + first token) is computed and sampling
continues at the right position; without a first token the node prefills the prompt itself (no prefill node left,
or a colocated node). Tokens stream back as TokenBatch, the first one carrying where the prompt came from."""

from __future__ import annotations

from typing import TYPE_CHECKING

from node.job import EngineJob, JobCounters, LiveJob, cache_info, finish_reason, to_logprobs
from protocol import messages as P

if TYPE_CHECKING:
    from connector.base import KVConnectorRole
    from engine.outputs import RequestOutput


class DecodeWorker:
    """`colocated`: one engine that prefills and decodes, saving to the store as well as loading from it."""

    job_type = P.DecodeJob

    def __init__(self, colocated: bool = False) -> None:
        self.role = P.NodeRole.BOTH if colocated else P.NodeRole.DECODE

    @property
    def connector_role(self) -> KVConnectorRole:
        from connector.base import KVConnectorRole

        return KVConnectorRole.BOTH if self.role is P.NodeRole.BOTH else KVConnectorRole.CONSUMER

    def engine_job(self, job: P.DecodeJob, counters: JobCounters) -> EngineJob:
        counters.decode_started += 1
        prompt = list(job.prompt_token_ids)
        if job.first_token_id is None:
            counters.local_prefill_started += 1
            return EngineJob(prompt, job.params.max_tokens)
        return EngineJob([*prompt, job.first_token_id], job.params.max_tokens, job.kv_transfer_params)

    def messages(self, out: RequestOutput, job: LiveJob) -> list[P.Message]:
        comp = out.outputs[0]
        if not comp.token_ids and not out.finished:
            return []
        reason = finish_reason(comp.finish_reason)
        logprobs = to_logprobs(comp.logprobs, job.want_logprobs)
        batch = P.TokenBatch(out.request_id, list(comp.token_ids), out.finished, reason, logprobs)
        if not job.reported_cache:
            batch.cache = cache_info(out, job)
            job.reported_cache = True
        return [batch]
