"""UCMDirectConnector, scheduler side: how many prompt tokens the store can supply, and what to load/save per step.

Loading is synchronous within the step (layer-wise, overlapped with the forward pass), so
`get_num_new_matched_tokens` always answers `async=False` and the request runs in the same step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from common.keys import BlockKey
from common.save_policy import KVSavePolicy
from connector.base import KVConnectorRole, KVConnectorScheduler
from connector.metadata import (
    EVICTED_REQUEST,
    BlockSpec,
    ConnectorStats,
    UCMConnectorMetadata,
    select_unsaved,
    store_failed,
)
from connector.request_view import (
    ConnectorRequest,
    ConnectorSchedulerOutput,
    EvictedBlockView,
    ScheduledView,
    iter_scheduled,
    token_ids_of,
)
from protocol.messages import KVTransferParams
from ucm.api import BlockRef, KVStore
from ucm.circuit_breaker import CircuitBreaker
from ucm.reuse_admission import ReuseAdmission

log = logging.getLogger(__name__)
# KVSavePolicy.REUSED remembers this many evicted blocks it did not save (about what `up`'s default store, 4 GiB of
# DRAM and 20 GiB of disk, holds of SmolLM2's 368 KiB blocks): one evicted longer ago could not be there anyway.
_GHOST_BLOCKS = 1 << 16


@dataclass
class _PendingLoad:
    """A request whose external hit was reported; becomes a BlockSpec once its blocks are allocated."""

    start_block: int
    num_blocks: int
    block_ids: tuple[int, ...] = ()


@dataclass
class _Progress:
    """What the connector did for one request, for its kv_transfer_params."""

    external_tokens: int = 0
    saved_blocks: int = 0


def block_refs(request: ConnectorRequest, start: int, stop: int) -> list[BlockRef]:
    """BlockRefs of blocks [start, stop) of a request (key, parent key, the block's token ids)."""
    return [
        BlockRef(request.block_keys[i], request.block_parent_key(i), request.block_token_ids(i))
        for i in range(start, stop)
    ]


class UCMSchedulerConnector(KVConnectorScheduler):
    def __init__(
        self,
        store: KVStore,
        role: KVConnectorRole,
        block_size: int,
        stats: ConnectorStats,
        *,
        save_decode_blocks: bool = True,
        recompute_last_token_only: bool = True,
        store_address: str = "embedded",
        save_policy: KVSavePolicy = KVSavePolicy.COMPUTED,
    ) -> None:
        """`recompute_last_token_only`: when every block of a block-aligned prompt is stored, load them all and
        compute only the last token (its KV slot is rewritten with the same values) instead of its whole block.
        `save_policy`: save blocks as they are computed, or only once the device prefix cache evicts them."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.store = store
        self.role = role
        self.block_size = block_size
        self.stats = stats
        self.save_decode_blocks = save_decode_blocks
        self.recompute_last_token_only = recompute_last_token_only
        self.store_address = store_address
        self.save_policy = save_policy
        self._admission = ReuseAdmission(_GHOST_BLOCKS) if save_policy is KVSavePolicy.REUSED else None
        self._pending: dict[str, _PendingLoad] = {}
        self._progress: dict[str, _Progress] = {}
        self._key_checked: set[str] = set()
        self._warn_at = 0.0  # when the last store-failure warning was logged

    # ---- 1. lookup -------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        self._pending.pop(request.request_id, None)
        if not self.role.loads:
            return 0, False
        bs = self.block_size
        if num_computed_tokens % bs:
            raise ValueError(f"num_computed_tokens {num_computed_tokens} is not a multiple of block size {bs}")
        start = num_computed_tokens // bs
        self._check_producer_keys(request)
        num_tokens = len(token_ids_of(request))
        # The last token is always computed: its logits give the first sampled token. Either the block
        # holding it is left to compute (whole blocks), or it is loaded too and only that token recomputed.
        stop = min(len(request.block_keys), (num_tokens if self.recompute_last_token_only else num_tokens - 1) // bs)
        if stop <= start:
            return 0, False
        if self._admission is not None:  # an evicted block asked for again: a reason to save what is evicted
            self._admission.looked_up(request.block_keys[start:stop])
        try:
            hit = self.store.lookup(request.block_keys[start:stop])
        except Exception as exc:  # the store being unreachable never stops the engine
            self._store_failed("lookup", exc)
            return 0, False
        self.stats.lookups += 1
        self.stats.lookup_hit_blocks += hit
        assert 0 <= hit <= stop - start, f"store lookup returned {hit} for {stop - start} keys"
        if not hit:
            return 0, False
        self._pending[request.request_id] = _PendingLoad(start, hit)
        return min(hit * bs, num_tokens - 1 - num_computed_tokens), False

    # ---- 2. allocation ---------------------------------------------------------------------------------

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """`block_ids` are all of the request's device blocks in sequence order (device hits first)."""
        pending = self._pending.get(request.request_id)
        if pending is None or num_external_tokens == 0:
            self._pending.pop(request.request_id, None)
            return
        num = -(-num_external_tokens // self.block_size)  # a partial last block is loaded whole
        if num > pending.num_blocks or (num_external_tokens % self.block_size and num != pending.num_blocks):
            raise ValueError(
                f"num_external_tokens {num_external_tokens} does not match the "
                f"{pending.num_blocks} blocks offered for {request.request_id}"
            )
        stop = pending.start_block + num
        if len(block_ids) < stop:
            raise ValueError(f"{request.request_id}: {len(block_ids)} device blocks, external blocks end at {stop}")
        pending.num_blocks = num
        pending.block_ids = tuple(block_ids[pending.start_block : stop])

    # ---- 3. per-step metadata ----------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: ConnectorSchedulerOutput) -> UCMConnectorMetadata:
        meta = UCMConnectorMetadata()
        scheduled = list(iter_scheduled(scheduler_output))
        by_id = {view.request.request_id: view for view in scheduled}
        for req_id, pending in self._pending.items():
            view = by_id.get(req_id)
            if view is None or not pending.block_ids:
                continue  # allocated but not scheduled after all: nothing to load
            req = view.request
            stop = pending.start_block + pending.num_blocks
            refs = block_refs(req, pending.start_block, stop)
            meta.loads.append(BlockSpec(req_id, pending.block_ids, tuple(refs)))
            self._progress.setdefault(req_id, _Progress()).external_tokens += pending.num_blocks * self.block_size
        self._pending.clear()
        loading = {ref.key for spec in meta.loads for ref in spec.blocks}
        if self.role.saves and self.save_policy.writes_back:
            meta.evicted_saves = self._evicted_saves(scheduler_output.evicted_blocks, loading)
        elif self.role.saves:
            meta.saves = self._saves(scheduled, loading)
        return meta

    def _evicted_saves(self, evicted: Sequence[EvictedBlockView], loading: set[BlockKey]) -> list[BlockSpec]:
        """Write-back: the evicted blocks the store lacks (a block loaded from it is evicted too, in time)."""
        if self._admission is not None:
            admits = self._admission.evicted
            kept = [b for b in evicted if admits(b.key, 1, b.reused)]
            self.stats.blocks_save_declined += len(evicted) - len(kept)
            evicted = kept
        if not evicted:
            return []
        refs = tuple(BlockRef(b.key, b.parent_key, b.token_ids) for b in evicted)
        candidate = BlockSpec(EVICTED_REQUEST, tuple(b.block_id for b in evicted), refs)
        return self._unsaved([candidate], loading, count_progress=False)

    def _saves(self, scheduled: list[ScheduledView], loading: set[BlockKey]) -> list[BlockSpec]:
        bs = self.block_size
        candidates: list[BlockSpec] = []
        for view in scheduled:
            req = view.request
            first = view.num_computed_tokens // bs
            stop = min(
                (view.num_computed_tokens + view.num_scheduled_tokens) // bs, len(req.block_keys), len(view.block_ids)
            )
            if not self.save_decode_blocks:
                stop = min(stop, len(req.prompt_token_ids) // bs)
            if stop > first:
                ids = tuple(view.block_ids[first:stop])
                candidates.append(BlockSpec(req.request_id, ids, tuple(block_refs(req, first, stop))))
        return self._unsaved(candidates, loading, count_progress=True)

    def _unsaved(self, candidates: list[BlockSpec], loading: set[BlockKey], count_progress: bool) -> list[BlockSpec]:
        """The candidates' blocks that the store lacks and no load of this step brings (one `contains` call)."""
        keys = [ref.key for cand in candidates for ref in cand.blocks]
        if not keys:
            return []
        if self._store_skipped():  # saves would only be packed into staging to be dropped
            self.stats.blocks_save_failed += len(keys)
            return []
        try:
            held = self.store.contains(keys)
        except Exception as exc:
            self._store_failed("contains", exc)
            self.stats.blocks_save_failed += len(keys)
            return []
        specs = select_unsaved(candidates, held, set(loading), self.stats)
        for spec in specs if count_progress else ():
            self._progress.setdefault(spec.request_id, _Progress()).saved_blocks += len(spec.blocks)
        return specs

    # ---- 10. request end ---------------------------------------------------------------------------------

    def request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> tuple[bool, KVTransferParams | None]:
        self._pending.pop(request.request_id, None)
        self._key_checked.discard(request.request_id)
        progress = self._progress.pop(request.request_id, _Progress())
        if not self.role.saves:
            return False, None
        # Saves finish within their step (wait_for_save), so the blocks can be freed at once.
        prompt_blocks = len(request.prompt_token_ids) // self.block_size
        return False, KVTransferParams(
            block_keys=[key.hex() for key in request.block_keys[:prompt_blocks]],
            # The engine's count: device and store hits, with failed loads already taken back.
            num_cached_tokens=max(0, int(getattr(request, "num_cached_tokens", progress.external_tokens))),
            num_saved_tokens=progress.saved_blocks * self.block_size,
            block_size=self.block_size,
            store=self.store_address,
        )

    def _check_producer_keys(self, request: ConnectorRequest) -> None:
        """Keys from a producer that differ from ours mean a different model, dtype, block size or salt: every
        lookup would silently miss, so say so (once per request)."""
        params = request.kv_transfer_params
        theirs = params.block_keys if params is not None else []
        if not theirs or request.request_id in self._key_checked:
            return
        self._key_checked.add(request.request_id)
        ours = [key.hex() for key in request.block_keys[: len(theirs)]]
        if ours != theirs[: len(ours)]:
            self.stats.key_mismatches += 1
            log.warning(
                "request %s: the producer's block keys differ from this engine's (model, dtype, block "
                "size or cache_salt differ?); its KV cannot be reused",
                request.request_id,
            )

    def _store_skipped(self) -> bool:
        """A daemon client's circuit breaker is open: the store did not answer and is being probed."""
        breaker = getattr(self.store, "breaker", None)
        return isinstance(breaker, CircuitBreaker) and breaker.is_open

    def _store_failed(self, what: str, exc: Exception) -> None:
        self._warn_at = store_failed(self.stats, what, exc, self._warn_at)
