"""Per-step instructions from UCMDirectConnector's scheduler side to its worker side, and its counters."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from common.keys import BlockKey
from connector.base import ConnectorMetadata
from ucm.api import BlockRef, KVStore, StoreTask, TaskStatus
from ucm.circuit_breaker import BreakerStats

log = logging.getLogger("connector")
# The request id of a write-back save's BlockSpec: the blocks outlived the requests that computed them.
EVICTED_REQUEST = "<evicted>"
# A store that stays down is reported again at most this often; every failure is counted.
STORE_WARN_INTERVAL_S = 30.0


@dataclass(frozen=True)
class BlockSpec:
    """Blocks of one request moving between device blocks and the store, in prefix order: blocks[i] is device
    block block_ids[i]. A load fetches them; a save dumps blocks that became full and the store lacks."""

    request_id: str
    block_ids: tuple[int, ...]
    blocks: tuple[BlockRef, ...]

    def __post_init__(self) -> None:
        assert len(self.block_ids) == len(self.blocks), "one device block per stored block"


@dataclass
class UCMConnectorMetadata(ConnectorMetadata):
    loads: list[BlockSpec] = field(default_factory=list)
    saves: list[BlockSpec] = field(default_factory=list)
    # Write-back: blocks the device prefix cache evicted this step, saved whole (every layer) before the forward
    # overwrites their slots. One BlockSpec under EVICTED_REQUEST.
    evicted_saves: list[BlockSpec] = field(default_factory=list)

    @property
    def num_load_blocks(self) -> int:
        return sum(len(spec.blocks) for spec in self.loads)

    @property
    def num_save_blocks(self) -> int:
        return sum(len(spec.blocks) for spec in self.saves + self.evicted_saves)


@dataclass
class ConnectorStats:
    """Counters shared by both sides of one connector; tests and benchmarks read them."""

    lookups: int = 0
    lookup_hit_blocks: int = 0
    blocks_loaded: int = 0  # every layer arrived and was scattered; only these count as hits
    blocks_loaded_disk: int = 0  # of blocks_loaded, served from the store's disk tier (the rest: DRAM)
    blocks_load_failed: int = 0  # reported through get_block_ids_with_load_errors (prefix semantics)
    blocks_saved: int = 0  # committed with every layer
    blocks_save_failed: int = 0  # a dump failed, or the store was unreachable
    blocks_save_skipped: int = 0  # already in the store (contains)
    blocks_save_declined: int = 0  # evicted without a sign of reuse (KVSavePolicy.REUSED), so not saved
    bytes_loaded: int = 0
    bytes_saved: int = 0
    load_wait_seconds: float = 0.0  # time the forward pass spent blocked in wait_for_layer_load
    save_seconds: float = 0.0  # time spent in save_kv_layer + wait_for_save
    store_errors: int = 0  # calls that raised (store unreachable and the like)
    key_mismatches: int = 0  # requests whose producer computed other block keys than this engine
    # The daemon client's circuit breaker (ucm/circuit_breaker.py); an embedded store is always reachable.
    store_reachable: int = 1  # 0 while the breaker is open: the store is skipped, every prompt recomputed
    store_breaker_trips: int = 0
    store_timeouts: int = 0  # store calls that waited out their whole timeout
    store_skipped_calls: int = 0  # store calls the open breaker refused (or cut short) instead
    store_probes: int = 0

    def absorb_breaker(self, breaker: BreakerStats) -> None:
        """The breaker's counters, copied in so heartbeats carry them with the rest (`connector_store_*`)."""
        self.store_reachable = breaker.reachable
        self.store_breaker_trips = breaker.trips
        self.store_timeouts = breaker.timeouts
        self.store_skipped_calls = breaker.skipped
        self.store_probes = breaker.probes


def warn_limited(last_warned: float, msg: str, *args: object) -> float:
    """Log a warning unless one was logged in the last STORE_WARN_INTERVAL_S; returns when it last warned."""
    now = time.monotonic()
    if last_warned and now - last_warned < STORE_WARN_INTERVAL_S:
        log.debug(msg, *args)
        return last_warned
    log.warning(msg, *args)
    return now


def store_failed(stats: ConnectorStats, what: str, exc: Exception, last_warned: float) -> float:
    """Count a store call that raised and log it (rate-limited); returns when it last warned."""
    stats.store_errors += 1
    return warn_limited(
        last_warned, "KV store %s failed (%s: %s); continuing without it", what, type(exc).__name__, exc
    )


def failed_rows(task: StoreTask | None, n: int, timeout: float) -> tuple[set[int], bool]:
    """A store task's failed rows of its `n`, and whether it is still running (then it may still touch its
    buffers, so they must not be reused). A task that never started (its call raised) failed every row."""
    if task is None:
        return set(range(n)), False
    task.wait(timeout)
    if task.check() is TaskStatus.RUNNING:
        return set(range(n)), True
    return set(task.failed_blocks), False


def select_unsaved(
    candidates: Sequence[BlockSpec], held: Sequence[bool], seen: set[BlockKey], stats: ConnectorStats
) -> list[BlockSpec]:
    """Each candidate cut to the blocks worth dumping: not `held` by the store (one flag per candidate block, in
    order) and not `seen` already in this step. Adds the chosen keys to `seen`; counts the skipped blocks."""
    assert len(held) == sum(len(c.blocks) for c in candidates), "one store answer per candidate block"
    chosen_specs: list[BlockSpec] = []
    pos = 0
    for cand in candidates:
        ids: list[int] = []
        refs: list[BlockRef] = []
        for block_id, ref in zip(cand.block_ids, cand.blocks):
            if held[pos] or ref.key in seen:
                stats.blocks_save_skipped += 1
            else:
                seen.add(ref.key)  # two requests completing the same block in one step: save it once
                ids.append(block_id)
                refs.append(ref)
            pos += 1
        if refs:
            chosen_specs.append(BlockSpec(cand.request_id, tuple(ids), tuple(refs)))
    return chosen_specs


def commit_saves(
    store: KVStore,
    saves: Sequence[BlockSpec],
    failed: set[int],
    errored_requests: set[str],
    stats: ConnectorStats,
    block_nbytes: int,
    last_warned: float,
) -> float:
    """Publish this step's dumped blocks: rows in `failed` (a layer's dump failed) and every block of a request
    whose load failed (its KV was computed over wrong context) are committed as failed, the rest as good.
    `block_nbytes`: one block, all layers. Returns when it last warned."""
    blocks = [ref for spec in saves for ref in spec.blocks]
    failed = set(failed)
    row = 0
    for spec in saves:
        if spec.request_id in errored_requests:
            failed.update(range(row, row + len(spec.blocks)))
        row += len(spec.blocks)
    good = [b.key for i, b in enumerate(blocks) if i not in failed]
    bad = [b.key for i, b in enumerate(blocks) if i in failed]
    try:
        if good:
            store.commit(good, True)
        if bad:
            store.commit(bad, False)
    except Exception as exc:
        last_warned = store_failed(stats, "commit", exc, last_warned)
        good, bad = [], good + bad
    stats.blocks_saved += len(good)
    stats.bytes_saved += len(good) * block_nbytes
    stats.blocks_save_failed += len(bad)
    if bad:
        last_warned = warn_limited(
            last_warned,
            "dropped the saves of %d of %d blocks (dump failed, store unreachable or context load failed)",
            len(bad),
            len(blocks),
        )
    return last_warned
