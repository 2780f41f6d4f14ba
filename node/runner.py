"""Protocol jobs → EngineCore requests, engine outputs → protocol messages, for whichever role the node plays.

Role-agnostic: what a job becomes and which messages an output becomes is the role's (a `RoleWorker`:
prefill_node/worker.py, decode_node/worker.py). The runner checks every job's bounds, queues it, steps the engine,
and keeps one request's failure (a bad job, a step or an output that raises) from ending the node's loop. The socket
loop (server.py) only moves messages.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from common.log_limit import LogLimiter
from node.job import JobCounters, LiveJob, RoleWorker
from node.key_cache import RecentKeys
from node.sampling import sampling_params
from protocol import messages as P
from protocol.job_limits import OutOfBounds, check_job

log = logging.getLogger(__name__)
_errors = LogLimiter(log)  # a client repeating a bad request must not flood the node's log


class JobRunner:
    def __init__(
        self,
        engine: Any,
        worker: RoleWorker,
        recent_keys: RecentKeys,
        step_delay_s: float = 0.0,
    ) -> None:
        self.engine = engine
        self.worker = worker
        self.recent_keys = recent_keys
        self.jobs: dict[str, LiveJob] = {}
        self.counters = JobCounters()
        self._step_delay_s = step_delay_s
        self.vocab_size: int | None = getattr(getattr(engine, "model_config", None), "vocab_size", None)

    @property
    def busy(self) -> bool:
        return bool(self.jobs) or self.engine.has_unfinished_requests()

    def submit(self, job: P.PrefillJob | P.DecodeJob) -> list[P.Message]:
        """Queue a job in the engine; a JobFailed comes back at once if it is out of bounds, of a kind this node's
        role does not take, or refused by the engine. Never raises for a bad job: one request's fault must not end
        the node's loop."""
        rid = job.request_id
        try:
            check_job(job, self.vocab_size)
        except OutOfBounds as e:
            return self._refuse(rid, f"bad job: {e}")
        if not isinstance(job, self.worker.job_type):
            _errors.warning("%s %s sent to a %s node", type(job).__name__, rid, self.worker.role.value)
            return self._refuse(rid, f"a {self.worker.role.value} node takes no {type(job).__name__}")
        if rid in self.jobs:
            return self._refuse(rid, "duplicate request id")
        try:
            self._submit(job)
        except Exception as e:
            self.jobs.pop(rid, None)
            with contextlib.suppress(Exception):
                self.engine.abort_request([rid])
            if isinstance(e, ValueError):  # the engine's answer to a bad request: the client's fault, not ours
                _errors.warning("job %s refused as invalid: %s", rid, e)
                return self._refuse(rid, f"invalid request: {e}", P.FailureCode.INVALID_REQUEST)
            _errors.warning("job %s refused: %r", rid, e)
            return self._refuse(rid, f"the engine refused the job: {type(e).__name__}: {e}")
        return []

    def _refuse(self, rid: str, message: str, code: P.FailureCode = P.FailureCode.SERVER) -> list[P.Message]:
        self.counters.refused += 1
        return [P.JobFailed(rid, message, code)]

    def _submit(self, job: P.PrefillJob | P.DecodeJob) -> None:
        want = self.worker.engine_job(job, self.counters)
        params = sampling_params(job.params, want.max_tokens)
        keys = self.engine.add_request(
            job.request_id,
            want.prompt_token_ids,
            params,
            cache_salt=job.cache_salt,
            kv_transfer_params=want.kv_transfer_params,
        )
        self.jobs[job.request_id] = LiveJob(len(job.prompt_token_ids), job.params.logprobs)
        self.recent_keys.touch(keys)  # the engine computed the prompt's block keys: not a second time here

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
            self.engine.idle()
            return []
        if self._step_delay_s:
            time.sleep(self._step_delay_s)  # test hook only (NodeConfig.step_delay_s): a slow but live node
        started = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as e:
            self.counters.step_errors += 1
            log.exception("engine step failed")
            return self._fail_step(e)
        finally:
            self.counters.busy_seconds += time.perf_counter() - started
        messages: list[P.Message] = []
        for out in outputs:
            job = self.jobs.get(out.request_id)
            if job is None:
                continue  # aborted meanwhile
            try:
                messages.extend(self.worker.messages(out, job))
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
        running = self.engine.running_request_ids()
        victims = [rid for rid in self.jobs if rid in running] or list(self.jobs)
        if not victims:  # nothing of the router's: drop what the engine holds, or it would fail every step
            with contextlib.suppress(Exception):
                self.engine.abort_request(self.engine.unfinished_request_ids())
        return self._fail(victims, f"engine step failed: {type(error).__name__}: {error}")

    def _fail(self, request_ids: list[str], message: str) -> list[P.Message]:
        live = [rid for rid in request_ids if self.jobs.pop(rid, None) is not None]
        self.counters.failed += len(live)
        try:
            self.engine.abort_request(live)
        except Exception:
            log.exception("aborting failed requests %s raised", live)
        return [P.JobFailed(rid, message) for rid in live]
