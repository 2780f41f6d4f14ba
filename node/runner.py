"""Protocol jobs → EngineCore requests, engine outputs → protocol messages. The only node module that knows
the engine's API; the socket loop (server.py) only moves messages.

Prefill job: the prompt with max_tokens=1 on a producer engine (its connector saves every full block during
the forward pass); the one sampled token and the connector's kv_transfer_params go back as PrefillDone.
Decode job: prompt + first token on a consumer engine, so the connector finds the prompt's blocks in the store,
only the tail (partial block + first token) is computed, and sampling continues at the right position.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

from node.key_cache import RecentKeys
from protocol import messages as P
from protocol.job_limits import OutOfBounds, check_job
from ucm.keys import KeyNamespace, block_keys, root_key
from ucm.log_limit import LogLimiter

log = logging.getLogger(__name__)
_errors = LogLimiter(log)  # a client repeating a bad request must not flood the node's log

_FINISH = {"stop": P.FinishReason.STOP, "length": P.FinishReason.LENGTH, "abort": P.FinishReason.ABORT}


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

    def as_stats(self) -> dict[str, float]:
        return {f"jobs_{k}": float(v) for k, v in vars(self).items()}


@dataclass
class _Job:
    kind: type[P.PrefillJob] | type[P.DecodeJob]
    prompt_tokens: int  # the prompt as the client sent it (without the first token)
    want_logprobs: int | None
    reported_cache: bool = False


def _to_logprobs(positions: list[dict[int, Any]] | None, want: int | None) -> list[P.TokenLogprob] | None:
    if want is None or not positions:
        return None
    out = []
    for pos in positions:
        items = list(pos.items())
        sampled_id, sampled = items[0]  # the engine puts the sampled token first
        top = sorted(((t, lp) for t, lp in items if 1 <= getattr(lp, "rank", 1) <= want), key=lambda x: x[1].rank)
        out.append(P.TokenLogprob(sampled_id, float(sampled.logprob), [(t, float(lp.logprob)) for t, lp in top[:want]]))
    return out


class JobRunner:
    def __init__(self, engine: Any, namespace: KeyNamespace, recent_keys: RecentKeys, step_delay_s: float = 0.0):
        self.engine = engine
        self.namespace = namespace
        self.recent_keys = recent_keys
        self.jobs: dict[str, _Job] = {}
        self.counters = JobCounters()
        self._step_delay_s = step_delay_s
        self.vocab_size: int | None = getattr(getattr(engine, "model_config", None), "vocab_size", None)

    @property
    def busy(self) -> bool:
        return bool(self.jobs) or self.engine.has_unfinished_requests()

    def _sampling(self, spec: P.SamplingSpec, max_tokens: int) -> Any:
        from engine import SamplingParams

        return SamplingParams(
            max_tokens=max_tokens,
            temperature=spec.temperature,
            top_p=spec.top_p,
            top_k=spec.top_k,
            seed=spec.seed,
            stop_token_ids=list(spec.stop_token_ids),
            ignore_eos=spec.ignore_eos,
            logprobs=spec.logprobs,
            detokenize=False,
        )

    def submit(self, job: P.PrefillJob | P.DecodeJob) -> list[P.Message]:
        """Queue a job in the engine; a JobFailed comes back at once if it is out of bounds or the engine refuses
        it. Never raises for a bad job: one request's fault must not end the node's loop."""
        rid = job.request_id
        try:
            check_job(job, self.vocab_size)
        except OutOfBounds as e:
            return self._refuse(rid, f"bad job: {e}")
        if rid in self.jobs:
            return self._refuse(rid, "duplicate request id")
        try:
            return self._submit(job)
        except Exception as e:
            _errors.warning("job %s refused: %r", rid, e)
            self.jobs.pop(rid, None)
            with contextlib.suppress(Exception):
                self.engine.abort_request([rid])
            return self._refuse(rid, f"the engine refused the job: {type(e).__name__}: {e}")

    def _refuse(self, rid: str, message: str) -> list[P.Message]:
        self.counters.refused += 1
        return [P.JobFailed(rid, message)]

    def _submit(self, job: P.PrefillJob | P.DecodeJob) -> list[P.Message]:
        rid = job.request_id
        prompt = list(job.prompt_token_ids)
        transfer: dict[str, Any] | None = None
        if isinstance(job, P.PrefillJob):
            params = self._sampling(job.params, 1)
        else:
            if job.first_token_id is not None:
                prompt.append(job.first_token_id)
                transfer = job.kv_transfer_params
            params = self._sampling(job.params, job.params.max_tokens)
        self.engine.add_request(rid, prompt, params, cache_salt=job.cache_salt, kv_transfer_params=transfer)
        self.jobs[rid] = _Job(type(job), len(job.prompt_token_ids), job.params.logprobs)
        if isinstance(job, P.PrefillJob):
            self.counters.prefill_started += 1
        else:
            self.counters.decode_started += 1
            self.counters.local_prefill_started += job.first_token_id is None
        self.recent_keys.touch(block_keys(root_key(self.namespace, job.cache_salt), prompt, self.namespace.block_size))
        return []

    def abort(self, request_ids: list[str]) -> None:
        live = [r for r in request_ids if r in self.jobs]
        for rid in live:
            del self.jobs[rid]
        self.counters.aborted += len(live)
        if live:
            self.engine.abort_request(live)

    def step(self) -> list[P.Message]:
        """One engine step's messages. If the step raises, the requests it ran get JobFailed (and are aborted,
        freeing their blocks); the others stay queued and the node keeps serving."""
        if not self.engine.has_unfinished_requests():
            return []
        if self._step_delay_s:
            time.sleep(self._step_delay_s)  # test hook only (NodeConfig.step_delay_s): a slow but live node
        try:
            outputs = self.engine.step()
        except Exception as e:
            self.counters.step_errors += 1
            log.exception("engine step failed")
            return self._fail_step(e)
        messages: list[P.Message] = []
        for out in outputs:
            job = self.jobs.get(out.request_id)
            if job is None:
                continue  # aborted meanwhile
            try:
                messages.extend(self._convert(out, job))
            except Exception as e:
                _errors.warning("output of %s failed: %r", out.request_id, e)
                messages.extend(self._fail([out.request_id], f"{type(e).__name__}: {e}"))
                continue
            if out.finished:
                self.jobs.pop(out.request_id, None)
        return messages

    def _fail_step(self, error: Exception) -> list[P.Message]:
        # The running requests are the ones the failed step computed; waiting ones were not touched. With none
        # running (the step failed before scheduling), every job goes: retrying them would only fail again.
        running = {seq.parent_id for seq in getattr(self.engine.scheduler, "running", ())}
        victims = [rid for rid in self.jobs if rid in running] or list(self.jobs)
        if not victims:  # nothing of the router's: drop what the engine holds, or it would fail every step
            with contextlib.suppress(Exception):
                self.engine.abort_request({seq.parent_id for seq in self.engine.scheduler.requests.values()})
        return self._fail(victims, f"engine step failed: {type(error).__name__}: {error}")

    def _fail(self, request_ids: list[str], message: str) -> list[P.Message]:
        live = [rid for rid in request_ids if self.jobs.pop(rid, None) is not None]
        self.counters.failed += len(live)
        try:
            self.engine.abort_request(live)
        except Exception:
            log.exception("aborting failed requests %s raised", live)
        return [P.JobFailed(rid, message) for rid in live]

    def _cache_info(self, out: Any, job: _Job) -> P.CacheInfo:
        cached = max(0, int(getattr(out, "num_cached_tokens", 0) or 0))
        store: int | None = getattr(out, "num_external_tokens", None)
        params = out.kv_transfer_params
        if store is None and isinstance(params, dict) and "num_cached_tokens" in params:
            store = int(params["num_cached_tokens"])  # the producer connector's count of tokens it loaded
        return P.CacheInfo(prompt_tokens=job.prompt_tokens, cached_tokens=cached, store_hit_tokens=store)

    def _convert(self, out: Any, job: _Job) -> list[P.Message]:
        comp = out.outputs[0]
        reason = _FINISH.get(comp.finish_reason) if comp.finish_reason else None
        logprobs = _to_logprobs(comp.logprobs, job.want_logprobs)
        if job.kind is P.PrefillJob:
            if not out.finished:
                return []  # prefill chunks in progress
            if not comp.token_ids:
                return [P.JobFailed(out.request_id, f"prefill ended without a token ({comp.finish_reason})")]
            return [
                P.PrefillDone(
                    request_id=out.request_id,
                    first_token_id=comp.token_ids[0],
                    # max_tokens=1 always ends with "length"; only a stop (EOS / stop token) ends the whole request
                    finished=reason is P.FinishReason.STOP,
                    finish_reason=reason if reason is P.FinishReason.STOP else None,
                    kv_transfer_params=out.kv_transfer_params,
                    logprob=logprobs[0] if logprobs else None,
                    cache=self._cache_info(out, job),
                )
            ]
        if not comp.token_ids and not out.finished:
            return []
        batch = P.TokenBatch(out.request_id, list(comp.token_ids), out.finished, reason, logprobs)
        if not job.reported_cache and (comp.token_ids or out.finished):
            batch.cache = self._cache_info(out, job)
            job.reported_cache = True
        return [batch]
