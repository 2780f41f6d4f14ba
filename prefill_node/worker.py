"""A prefill node's job handling: a PrefillJob is the prompt with max_tokens=1 on an engine whose connector saves
every full block during the forward pass (and loads any prefix the store already holds: DESIGN.md §2.3); the one
sampled token and the connector's kv_transfer_params go back as PrefillDone."""

from __future__ import annotations

from typing import TYPE_CHECKING

from node.job import EngineJob, JobCounters, LiveJob, cache_info, finish_reason, to_logprobs
from protocol import messages as P

if TYPE_CHECKING:
    from connector.base import KVConnectorRole
    from engine.outputs import RequestOutput


class PrefillWorker:
    role = P.NodeRole.PREFILL
    job_type = P.PrefillJob

    @property
    def connector_role(self) -> KVConnectorRole:
        from connector.base import KVConnectorRole

        # BOTH, not PRODUCER: a prefix any node computed earlier is loaded instead of recomputed.
        return KVConnectorRole.BOTH

    def engine_job(self, job: P.PrefillJob, counters: JobCounters) -> EngineJob:
        counters.prefill_started += 1
        return EngineJob(list(job.prompt_token_ids), max_tokens=1)

    def messages(self, out: RequestOutput, job: LiveJob) -> list[P.Message]:
        if not out.finished:
            return []  # prefill chunks in progress
        comp = out.outputs[0]
        if not comp.token_ids:
            return [P.JobFailed(out.request_id, f"prefill ended without a token ({comp.finish_reason})")]
        reason = finish_reason(comp.finish_reason)
        logprobs = to_logprobs(comp.logprobs, job.want_logprobs)
        # max_tokens=1 always ends with "length"; only a stop (EOS / stop token) ends the whole request
        stopped = reason is P.FinishReason.STOP
        return [
            P.PrefillDone(
                request_id=out.request_id,
                first_token_id=comp.token_ids[0],
                finished=stopped,
                finish_reason=reason if stopped else None,
                kv_transfer_params=out.kv_transfer_params,
                logprob=logprobs[0] if logprobs else None,
                cache=cache_info(out, job),
            )
        ]
