"""The store daemon's KV events (ucm/tier_events.py, --kv-events-config on `ucm-serve store`): a real daemon process
announces each tier's blocks (DRAM as medium CPU, disk as STORAGE) in vLLM's wire format, and the router's KVIndex
keeps them per tier, dropping what the store removed."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from common.kv_events.events import MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved, BlockStored
from protocol import messages as P
from router.kv_index import STORE_MEDIA, STORE_SOURCE, KVIndex
from tests.store_helpers import dump_all, make_refs, run_daemon
from ucm.client import StoreClient
from ucm.tier_events import TierEvents


def _until(what: str, condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_tier_events_group_a_chain_and_keep_media_apart() -> None:
    log = TierEvents()
    a, b, c = (bytes([i]) * 16 for i in (1, 2, 3))
    log.stored(MEDIUM_CPU, a, bytes(16), [1, 2])
    log.stored(MEDIUM_CPU, b, a, [3, 4])  # the next block of the chain: the same BlockStored
    log.stored(MEDIUM_STORAGE, c, b, [5, 6])
    log.removed(MEDIUM_CPU, [a])
    log.removed(MEDIUM_CPU, [b])
    log.removed(MEDIUM_STORAGE, [])
    first, second, removed = log.take()
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored) and isinstance(removed, BlockRemoved)
    assert first.block_hashes == [a, b] and first.token_ids == [1, 2, 3, 4] and first.medium == "CPU"
    assert second.medium == "STORAGE" and removed.block_hashes == [a, b]
    assert log.take() == []


def test_the_daemon_publishes_its_tiers_and_the_index_follows(tmp_path) -> None:
    endpoint, replay = f"ipc://{tmp_path}/store-events", f"ipc://{tmp_path}/store-replay"
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint,
        "replay_endpoint": replay,
    }
    index = KVIndex(replay_timeout_s=0.5)
    try:
        with run_daemon(tmp_path / "db", "--kv-events-config", json.dumps(config)) as daemon:
            index.track(STORE_SOURCE, "one", P.KVEventsEndpoint(endpoint, replay, ""))
            refs = make_refs(list(range(24)))  # 6 blocks
            keys = [r.key for r in refs]
            with StoreClient(daemon.address, timeout_s=10.0) as client:
                # The SUB joins a moment after `track`: dump a new probe block until one lands (later gaps replay).
                probes = iter(range(1_000_000))

                def probe() -> bool:
                    ref = make_refs(list(range(4)), salt=f"probe-{next(probes)}")
                    dump_all(client, ref)
                    return bool(index.holders([ref[0].key], MEDIUM_CPU))

                _until("the subscription", probe)
                dump_all(client, refs)
                _until("DRAM's blocks", lambda: index.holders(keys, MEDIUM_CPU) == {STORE_SOURCE: 6})
                _until(
                    "disk's blocks (written behind)", lambda: index.holders(keys, MEDIUM_STORAGE) == {STORE_SOURCE: 6}
                )
                assert index.depth(STORE_SOURCE, keys, STORE_MEDIA) == 6  # what pairing prices as loads
                client.remove(keys[3:4])
                _until("the removal", lambda: index.holders(keys, MEDIUM_CPU) == {STORE_SOURCE: 3})
                _until("the disk's removal", lambda: index.holders(keys, MEDIUM_STORAGE) == {STORE_SOURCE: 3})
                assert index.depth(STORE_SOURCE, keys, STORE_MEDIA) == 3
    finally:
        index.close()
