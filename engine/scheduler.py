"""Continuous batching: each step picks which sequences run and how many tokens each computes.

One token budget per step covers both decodes and (chunked) prefills. Running sequences go first, best
(priority, arrival) first; when blocks run out the worst running sequence is preempted by recompute (its blocks
are freed and it later recomputes prompt + output, sampling exactly as before). Then waiting sequences are
admitted by priority, then per `SchedulingPolicy` (arrival order, or fewest tokens left to compute per sequence
of a shared-prefix group, with aging), except one whose next uncached block a running sequence is computing right
now: it waits (keeping its place) until that block is cached and then loads it, instead of computing the same
prefix a second time in parallel (a burst of prompts sharing a system prompt would otherwise compute it once per
prompt admitted before the first finished). A step that already finishes `chunk_after_tokens` prompt tokens starts
no prompt it cannot finish: every prompt finishing in a step gets its first token at the step's end, and a chunk of a
later one would only make them wait longer (SchedulerConfig.chunk_after_tokens: the figures). Decodes do not
count, so however many run, a long prompt still starts in chunks. Connector call sites follow
connector/base.py's documented order."""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import Any

from common.keys import BlockKey
from engine.config import SchedulerConfig, SchedulingPolicy
from engine.kv_cache_manager import KVCacheManager, PrefixMatch
from engine.prefix_groups import Waiting, tokens_per_sequence
from engine.request import Request, RequestStatus
from engine.scheduler_output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from engine.stats import EngineStats

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        kv_manager: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: frozenset[int] = frozenset(),
        enable_chunked_prefill: bool = True,
        connector: Any = None,
        stats: EngineStats | None = None,
        policy: SchedulingPolicy = SchedulerConfig.policy,
        max_wait_s: float = SchedulerConfig.max_wait_s,
        chunk_after_tokens: int | None = SchedulerConfig.chunk_after_tokens,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kv = kv_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.enable_chunked_prefill = enable_chunked_prefill
        self.connector = connector
        self.stats = stats if stats is not None else EngineStats()
        self.policy = policy
        self.max_wait_s = max_wait_s
        self.chunk_after_tokens = chunk_after_tokens
        self._clock = clock
        self.waiting: list[Request] = []  # sorted by Request.sort_key
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every live sequence by its own id
        self._finished_since_step: set[str] = set()
        # Finished sequences whose blocks the connector still reads (request_finished said delay_free).
        self._delayed_free: dict[str, Request] = {}
        # Waiting sequences' device prefix matches: request id -> (cache version, num_tokens, match). Every step
        # with room orders (and admits) by them; they are recomputed only once the prefix cache has changed.
        self._matches: dict[str, tuple[int, int, PrefixMatch]] = {}

    # -- requests -------------------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests or request.request_id in self._delayed_free:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.validate_prompt_len(request.num_prompt_tokens)
        request.arrival_time = self._clock()
        self.requests[request.request_id] = request
        self.stats.num_requests += 1
        self.stats.prompt_tokens += request.num_prompt_tokens
        self._enqueue_waiting(request)

    def validate_prompt_len(self, num_tokens: int) -> None:
        if num_tokens == 0:
            raise ValueError("the prompt is empty")
        if num_tokens > self.max_model_len:
            raise ValueError(
                f"the prompt has {num_tokens} tokens, more than max_model_len={self.max_model_len} "
                f"(the KV cache holds {self.kv.num_blocks * self.kv.block_size} tokens)"
            )
        if self.kv.blocks_needed(num_tokens) > self.kv.num_blocks:
            raise ValueError(
                f"the prompt has {num_tokens} tokens and cannot fit the KV cache "
                f"({self.kv.num_blocks} blocks of {self.kv.block_size} tokens)"
            )

    def _enqueue_waiting(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=lambda r: r.sort_key)

    def abort_requests(self, parent_ids: set[str]) -> list[Request]:
        aborted = [r for r in self.requests.values() if r.parent_id in parent_ids and not r.is_finished]
        for req in aborted:
            if req in self.waiting:
                self.waiting.remove(req)
            self.finish_request(req, RequestStatus.FINISHED_ABORTED)
        return aborted

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        assert status.is_finished, f"{status} is not a finished state"
        if request.is_finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        request.status = status
        self.requests.pop(request.request_id, None)
        self._finished_since_step.add(request.request_id)
        delay_free = False
        if self.connector is not None:
            delay_free, params = self.connector.request_finished(request, self.kv.block_ids(request.request_id))
            request.finished_kv_transfer_params = params
        if delay_free:
            self._delayed_free[request.request_id] = request
        else:
            self.kv.free(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # -- scheduling -------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished_since_step)
        self._finished_since_step = set()
        budget = self.max_num_batched_tokens
        self.running.sort(key=lambda r: r.sort_key)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            block_ids = self.kv.allocate_slots(req, num_new)
            while block_ids is None:
                victim = self.running[-1]  # worst (priority, arrival) and not scheduled yet: it sits after i
                self._preempt(victim, out)
                if victim is req:
                    break
                block_ids = self.kv.allocate_slots(req, num_new)
            if block_ids is None:
                break
            out.scheduled_running_reqs.append(ScheduledRequest(req, block_ids, req.num_computed_tokens, num_new))
            budget -= num_new
            i += 1
        if not out.preempted_req_ids:
            budget = self._schedule_waiting(out, budget)
        out.cow_copies = self.kv.take_pending_copies()
        out.evicted_blocks = self.kv.take_evicted()
        for s in out.scheduled:
            # Prefill/recompute = every position except the newest output token (that one is a decode).
            req = s.request
            end = max(req.num_prompt_tokens, req.num_tokens - 1)
            self.stats.computed_tokens += max(
                0, min(s.num_computed_tokens + s.num_scheduled_tokens, end) - s.num_computed_tokens
            )
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        return out

    def _blocks_in_flight(self) -> set[BlockKey]:
        """Keys of the full prompt blocks running sequences have yet to compute (cached once they are)."""
        keys: set[BlockKey] = set()
        for req in self.running:
            keys.update(self._prompt_blocks_to_compute(req))
        return keys

    def _prompt_blocks_to_compute(self, req: Request) -> list[BlockKey]:
        bs = self.kv.block_size
        return req.block_keys[req.num_computed_tokens // bs : req.num_prompt_tokens // bs]

    def _admission_order(self) -> list[tuple[Request, PrefixMatch]]:
        """Waiting sequences in the order they may start, each with its device-cache prefix hit at this moment."""
        waiting_ids = {r.request_id for r in self.waiting}
        self._matches = {rid: m for rid, m in self._matches.items() if rid in waiting_ids}  # admitted or aborted
        if self.policy is SchedulingPolicy.FCFS:
            return [(r, PrefixMatch()) for r in self.waiting]
        matched = [(r, self._prefix_match(r)) for r in self.waiting]
        cost = tokens_per_sequence(
            [
                Waiting(r.request_id, r.block_keys, r.num_tokens, r.num_computed_tokens + m.num_tokens)
                for r, m in matched
            ],
            self.kv.block_size,
        )
        now = self._clock()
        matched.sort(key=lambda m: (
            m[0].priority,
            now - m[0].arrival_time <= self.max_wait_s,  # the starving first, in arrival order
            cost[m[0].request_id],
            m[0].sort_key,
        ))  # fmt: skip
        return matched

    def _prefix_match(self, req: Request) -> PrefixMatch:
        """The waiting sequence's device prefix-cache hit now: remembered until the prefix cache changes."""
        if req.num_computed_tokens:
            return PrefixMatch()
        version = self.kv.cache_version
        known = self._matches.get(req.request_id)
        if known is not None and known[0] == version and known[1] == req.num_tokens:
            return known[2]
        self.stats.prefix_matches += 1
        match = self.kv.get_computed_blocks(req)
        self._matches[req.request_id] = (version, req.num_tokens, match)
        return match

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        if not self.waiting or budget <= 0 or (self.running and len(self.running) >= self.max_num_seqs):
            return budget
        in_flight = self._blocks_in_flight() if self.kv.enable_caching else set()
        # Prompt tokens this step finishes (their first tokens wait for the step's end); decodes do not count.
        finishing = sum(
            s.num_scheduled_tokens for s in out.scheduled if s.completes_prompt and s.num_scheduled_tokens > 1
        )
        for req, _ in self._admission_order():
            if budget <= 0:
                break
            seats = 1 if req.forked else req.sampling_params.n
            if self.running and len(self.running) + seats > self.max_num_seqs:
                break
            # Matched again if an admission before this one in the loop changed the prefix cache (evicted blocks).
            prefix = self._prefix_match(req)
            num_computed = req.num_computed_tokens + prefix.num_tokens
            next_block = self.kv.blocks_needed(num_computed)  # a whole hit's last block is not computed again
            if next_block < len(req.block_keys) and req.block_keys[next_block] in in_flight:
                self.stats.prefix_deferrals += 1  # its prefix is being computed: it hits the cache in a step or two
                continue
            num_external = 0
            # A whole device hit (only its last token to compute, not block-aligned) has nothing to load.
            if self.connector is not None and num_computed % self.kv.block_size == 0:
                num_external, _load_async = self.connector.get_num_new_matched_tokens(req, num_computed)
                # Loads run inside this step's forward (layer by layer), so async loads are treated as sync.
                # At least one token must be computed: its logits give the next token.
                num_external = max(0, min(num_external or 0, req.num_tokens - 1 - num_computed))
            num_new = req.num_tokens - num_computed - num_external
            if not self.enable_chunked_prefill and num_new > budget:
                break
            if num_new > budget and self.chunk_after_tokens is not None and finishing >= self.chunk_after_tokens:
                break  # a chunk would only make this step's finishing prompts wait for work that finishes later
            if num_new <= budget:
                finishing += num_new
            num_new = min(num_new, budget)
            block_ids = self.kv.allocate_slots(req, num_new, prefix, num_external)
            if block_ids is None:
                break
            if self.connector is not None:
                self.connector.update_state_after_alloc(req, block_ids, num_external)
            self.waiting.remove(req)
            self._matches.pop(req.request_id, None)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_computed + num_external
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = req.num_computed_tokens
                req.num_external_tokens = num_external
            self.stats.prefix_cache_hit_tokens += prefix.num_tokens
            self.stats.external_hit_tokens += num_external
            self.running.append(req)
            if self.kv.enable_caching:
                in_flight.update(self._prompt_blocks_to_compute(req))
            sched = ScheduledRequest(req, block_ids, req.num_computed_tokens, num_new, num_external)
            out.scheduled_new_reqs.append(sched)
            budget -= num_new
        return budget

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.stats.preemptions += 1
        out.preempted_req_ids.add(req.request_id)
        self._enqueue_waiting(req)
        logger.debug("preempted %s", req)

    # -- results ----------------------------------------------------------------------------------------------
    def update_from_output(
        self, out: SchedulerOutput, result: ModelRunnerOutput
    ) -> list[tuple[Request, list[int], list[Any]]]:
        """Advance every scheduled sequence; returns (sequence, new token ids, their logprobs) per sequence
        that got tokens (forked children included)."""
        for rid in result.finished_sending:
            req = self._delayed_free.pop(rid, None)
            if req is not None:
                self.kv.free(req)
        updates = []
        for s in out.scheduled:
            req = s.request
            if req.is_finished:
                continue
            tiers = result.loaded_by_tier.get(req.request_id)
            if tiers:  # the connector counts only blocks that loaded and verified
                by_tier = req.external_tokens_by_tier
                for tier, blocks in tiers.items():
                    by_tier[tier] = by_tier.get(tier, 0) + blocks * self.kv.block_size
            if result.failed_block_ids and self._recover_load_error(s, result.failed_block_ids):
                continue
            req.num_computed_tokens = s.num_computed_tokens + s.num_scheduled_tokens
            self.kv.cache_full_blocks(req)
            tokens = result.sampled.get(req.request_id)
            if not tokens:
                continue  # a prefill chunk: nothing sampled yet
            logprobs = result.logprobs.get(req.request_id, [])
            seqs = self._fork(req, len(tokens)) if len(tokens) > 1 else [req]
            for i, (seq, token) in enumerate(zip(seqs, tokens, strict=True)):
                seq.append_output_token(token)
                self.stats.generated_tokens += 1
                self._check_stop(seq, token)
                updates.append((seq, [token], logprobs[i : i + 1]))
        return updates

    def _recover_load_error(self, s: ScheduledRequest, failed: set[int]) -> bool:
        """A block this sequence relies on failed to load: recompute from its start, drop the sample."""
        bad = [i for i, bid in enumerate(s.block_ids) if bid in failed]
        if not bad:
            return False
        req = s.request
        first = bad[0]
        restart = min(first * self.kv.block_size, s.num_computed_tokens)
        lost = s.num_computed_tokens - restart
        lost_external = min(lost, s.num_external_tokens)
        self.stats.external_hit_tokens -= lost_external
        self.stats.load_error_tokens += lost
        if req.num_cached_tokens > restart:
            req.num_external_tokens = max(0, req.num_external_tokens - (req.num_cached_tokens - restart))
            req.num_cached_tokens = restart
        req.num_computed_tokens = restart
        self.kv.uncache_from(req, first)
        logger.warning("%s: %d blocks failed to load; recomputing from token %d", req.request_id, len(bad), restart)
        return True

    def _fork(self, parent: Request, n: int) -> list[Request]:
        parent.forked = True
        seqs = [parent]
        for i in range(1, n):
            child = parent.fork(i)
            self.kv.fork(parent, child)
            self.requests[child.request_id] = child
            self.running.append(child)
            seqs.append(child)
        return seqs

    def _check_stop(self, req: Request, token: int) -> None:
        sp = req.sampling_params
        if req.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and token in self.eos_token_ids:
                self.finish_request(req, RequestStatus.FINISHED_STOPPED)
                return
            if token in sp.stop_token_ids:
                req.stop_reason = token
                self.finish_request(req, RequestStatus.FINISHED_STOPPED)
                return
        if (
            sp.max_tokens is not None and req.num_output_tokens >= sp.max_tokens
        ) or req.num_tokens >= self.max_model_len:
            self.finish_request(req, RequestStatus.FINISHED_LENGTH)

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        live = set(self.requests) | set(self._delayed_free)
        assert set(self.kv.req_blocks) <= live, f"blocks held by dead sequences: {set(self.kv.req_blocks) - live}"
        for req in self.waiting:
            assert req.request_id not in self.kv.req_blocks, f"waiting {req} holds blocks"
