"""The scheduler side of UCMConnector without vLLM: lookups, load plans, per-step load and save plans.

vLLM's hooks map one to one: `track` (on_new_request), `num_new_matched_tokens` (get_num_new_matched_tokens),
`after_alloc` (update_state_after_alloc), `build_plan` (build_connector_meta), `finished` (request_finished).
Loads finish within their step (layer by layer, before the layer's attention), so vLLM is always told
`load_kv_async=False` and the request runs in the step that loads it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from connector.base import KVConnectorRole
from connector.metadata import BlockSpec, ConnectorStats, select_unsaved, store_failed
from connector.vllm.key_scope import VllmKeyScope
from connector.vllm.step import BlockLoad, StepDelta, StepPlan
from connector.vllm.tracker import LoadOffer, LoadPlan, RequestTracker
from ucm.api import KVStore

log = logging.getLogger(__name__)


class VllmSchedulerCore:
    def __init__(
        self,
        store: KVStore,
        scope: VllmKeyScope,
        role: KVConnectorRole,
        stats: ConnectorStats,
        *,
        save_decode_blocks: bool = False,
    ) -> None:
        self.store = store
        self.scope = scope
        self.role = role
        self.stats = stats
        self.save_decode_blocks = save_decode_blocks
        self._trackers: dict[str, RequestTracker] = {}
        self._warn_at = 0.0

    @property
    def block_size(self) -> int:
        return self.scope.block_size

    def tracker(self, request_id: str) -> RequestTracker | None:
        return self._trackers.get(request_id)

    # ---- admission -----------------------------------------------------------------------------------------

    def track(
        self, request_id: str, token_ids: Callable[[], Sequence[int]], num_prompt_tokens: int, cache_salt: str | None
    ) -> RequestTracker:
        """Start tracking a request (idempotent: vLLM may show us a request more than once)."""
        tracker = self._trackers.get(request_id)
        if tracker is None:
            tracker = RequestTracker(request_id, token_ids, num_prompt_tokens, self.scope.root(cache_salt))
            self._trackers[request_id] = tracker
        return tracker

    def num_new_matched_tokens(self, request_id: str, num_computed_tokens: int) -> int:
        """Tokens past `num_computed_tokens` (a block-aligned device hit) that the store can supply."""
        tracker = self._trackers[request_id]
        tracker.offer = None
        if not self.role.loads:
            return 0
        bs = self.block_size
        if num_computed_tokens % bs:
            raise ValueError(f"num_computed_tokens {num_computed_tokens} is not a multiple of block size {bs}")
        num_tokens = len(tracker.token_ids())
        start, full = num_computed_tokens // bs, num_tokens // bs
        if full <= start:
            return 0
        keys = tracker.keys_upto(full, bs)
        try:
            hit = self.store.lookup(keys[start:full])
        except Exception as exc:  # an unreachable store is a miss, never an error
            self._warn_at = store_failed(self.stats, "lookup", exc, self._warn_at)
            return 0
        assert 0 <= hit <= full - start, f"store lookup returned {hit} for {full - start} keys"
        self.stats.lookups += 1
        self.stats.lookup_hit_blocks += hit
        # vLLM computes at least the last token (its logits give the first output): a fully stored prompt is
        # offered up to one token short, and that token is recomputed inside the last loaded block.
        external = min(hit * bs, num_tokens - 1 - num_computed_tokens)
        if external <= 0:
            return 0
        tracker.offer = LoadOffer(start, hit)
        return external

    def after_alloc(self, request_id: str, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks (`block_ids`: its whole table) and took `num_external_tokens`."""
        tracker = self._trackers[request_id]
        offer, tracker.offer = tracker.offer, None
        if num_external_tokens == 0:
            return
        if offer is None:
            raise ValueError(f"{request_id}: vLLM took {num_external_tokens} external tokens that were never offered")
        bs = self.block_size
        num = -(-num_external_tokens // bs)
        if num > offer.hit_blocks:
            raise ValueError(
                f"{request_id}: {num_external_tokens} external tokens exceed the {offer.hit_blocks} blocks offered"
            )
        stop = offer.start_block + num
        if len(block_ids) < stop:
            raise ValueError(f"{request_id}: {len(block_ids)} device blocks, external blocks end at {stop}")
        tracker.load = LoadPlan(
            offer.start_block, tuple(block_ids[offer.start_block : stop]), before_forward=num_external_tokens % bs != 0
        )

    def poison(self, request_id: str, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """After a failed hook: vLLM counts `num_external_tokens` as cached, so their blocks must be reported as
        failed loads (vLLM then recomputes them) instead of being served as whatever the blocks hold."""
        tracker = self._trackers.get(request_id)
        start = tracker.offer.start_block if tracker is not None and tracker.offer is not None else 0
        num = -(-num_external_tokens // self.block_size)
        ids = tuple(block_ids[start : start + num]) or tuple(block_ids)
        if tracker is not None:
            tracker.offer = None
            tracker.load = LoadPlan(start, ids, before_forward=False, poisoned=True)

    # ---- one step ------------------------------------------------------------------------------------------

    def build_plan(self, delta: StepDelta) -> StepPlan:
        plan = StepPlan()
        for request_id in delta.preempted:
            tracker = self._trackers.get(request_id)
            if tracker is not None:
                tracker.preempt()
        scheduled = []
        for item in delta.scheduled:
            tracker = self._trackers.get(item.request_id)
            if tracker is None:
                continue  # not ours (a hook failed before tracking it): neither loaded nor saved
            tracker.apply_blocks(item.block_ids, item.replaces_blocks)
            if tracker.load is not None:
                plan.loads.append(self._load(tracker))
            scheduled.append((tracker, item.num_computed_tokens + item.num_scheduled_tokens))
        for tracker in self._trackers.values():
            if tracker.load is not None:  # allocated but not scheduled: vLLM still counts the tokens as cached
                log.warning(
                    "request %s: its load was planned but it was not scheduled; reporting its blocks as "
                    "failed so they are recomputed",
                    tracker.request_id,
                )
                plan.loads.append(BlockLoad(tracker.request_id, tracker.load.block_ids, (), poisoned=True))
                tracker.load = None
        if self.role.saves and scheduled:
            try:
                plan.saves = self._saves(scheduled)
            except Exception:  # a save skipped is a future miss; the step itself must go on
                log.exception("planning this step's saves failed; saving nothing in it")
        return plan

    def poison_pending(self) -> StepPlan:
        """The plan for a step whose planning failed: every load vLLM is counting on is reported as failed."""
        plan = StepPlan()
        for tracker in self._trackers.values():
            if tracker.load is not None:
                plan.loads.append(BlockLoad(tracker.request_id, tracker.load.block_ids, (), poisoned=True))
                tracker.load = None
        return plan

    def _load(self, tracker: RequestTracker) -> BlockLoad:
        load, tracker.load = tracker.load, None
        assert load is not None, "called with a planned load"
        if load.poisoned:
            return BlockLoad(tracker.request_id, load.block_ids, (), poisoned=True)
        stop = load.start_block + len(load.block_ids)
        try:
            refs = tracker.refs(load.start_block, stop, self.block_size)
        except Exception:
            log.exception("request %s: cannot name its stored blocks; reporting them as failed", tracker.request_id)
            return BlockLoad(tracker.request_id, load.block_ids, (), poisoned=True)
        tracker.handled = max(tracker.handled, stop)  # in the store already: never dumped again
        return BlockLoad(tracker.request_id, load.block_ids, tuple(refs), before_forward=load.before_forward)

    def _saves(self, scheduled: list[tuple[RequestTracker, int]]) -> list[BlockSpec]:
        bs = self.block_size
        candidates: list[BlockSpec] = []
        spans: list[tuple[RequestTracker, int]] = []
        for tracker, computed_after in scheduled:
            stop = min(computed_after // bs, len(tracker.block_ids), len(tracker.token_ids()) // bs)
            if not self.save_decode_blocks:
                stop = min(stop, tracker.num_prompt_tokens // bs)
            first = tracker.handled
            if stop > first:
                refs = tuple(tracker.refs(first, stop, bs))
                candidates.append(BlockSpec(tracker.request_id, tuple(tracker.block_ids[first:stop]), refs))
                spans.append((tracker, stop))
        for tracker, stop in spans:
            tracker.handled = stop  # a failed save is a future miss, not a retry
        keys = [ref.key for cand in candidates for ref in cand.blocks]
        if not keys:
            return []
        try:
            held = self.store.contains(keys)
        except Exception as exc:
            self._warn_at = store_failed(self.stats, "contains", exc, self._warn_at)
            held = [False] * len(keys)
        return select_unsaved(candidates, held, set(), self.stats)

    def on_load_errors(self, block_ids: set[int]) -> None:
        """The worker reported failed loads: vLLM recomputes from the first failed block of each request, so
        those blocks become saveable again (the store no longer holds a usable copy)."""
        for tracker in self._trackers.values():
            for i, block_id in enumerate(tracker.block_ids[: tracker.handled]):
                if block_id in block_ids:
                    tracker.handled = i
                    break

    # ---- the end -------------------------------------------------------------------------------------------

    def finished(self, request_id: str) -> None:
        """Finished or aborted: forget it (its saves completed within their steps)."""
        self._trackers.pop(request_id, None)

    @property
    def num_tracked(self) -> int:
        return len(self._trackers)
