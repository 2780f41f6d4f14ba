"""Promotions from disk racing other loads and `remove`: a block enters DRAM once, and never after it was removed."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Hashable

import ucm.store_reader
from tests.store_helpers import PAYLOAD, dump_all, make_refs, open_store
from ucm.eviction import LRUPolicy, PolicyName, make_policy
from ucm.store import Store, StoreConfig


class CountingLRU(LRUPolicy):
    """An LRU policy that counts what the tier tells it, per key."""

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self.inserts: Counter[Hashable] = Counter()
        self.touches: Counter[Hashable] = Counter()

    def insert(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        self.inserts[key] += 1
        super().insert(key, size, parent)

    def touch(self, key: Hashable) -> None:
        self.touches[key] += 1
        super().touch(key)


def reopened(tmp_path, refs) -> tuple[Store, CountingLRU]:
    """A store whose blocks are on disk only (written, then reopened), with a counting DRAM policy."""
    with open_store(tmp_path) as store:
        dump_all(store, refs)
        store.flush()
    made: list[CountingLRU] = []

    def factory(name: PolicyName, capacity: int):
        if not made:  # the DRAM tier's policy is built first
            made.append(CountingLRU(capacity))
            return made[0]
        return make_policy(name, capacity)

    config = StoreConfig(dram_bytes=4 << 20, disk_path=str(tmp_path / "db"), disk_bytes=16 << 20)
    store = Store(config, policy_factory=factory)
    assert store.contains([r.key for r in refs]) == [True] * len(refs)
    assert all(r.key not in store._dram for r in refs)
    return store, made[0]


def load_layer(store: Store, ref, layer: int):
    return store.load([ref], [layer], [[memoryview(bytearray(PAYLOAD))]])


def test_two_loads_promote_a_disk_block_into_dram_once(tmp_path, monkeypatch) -> None:
    ref = make_refs(list(range(4)))[0]
    store, policy = reopened(tmp_path, [ref])
    both_read = threading.Barrier(2, timeout=10)
    decode = ucm.store_reader.decode_record

    def decode_together(buf):  # both loads found it on disk and not in DRAM: both decode it
        both_read.wait()
        return decode(buf)

    monkeypatch.setattr(ucm.store_reader, "decode_record", decode_together)
    with store:
        tasks = [load_layer(store, ref, layer) for layer in (0, 1)]  # the connector: one layer per call
        assert all(task.wait(10) for task in tasks)
        assert ref.key in store._dram
        assert policy.inserts[ref.key] == 1 and policy.touches[ref.key] == 0, "promoted twice (the second as a use)"


def test_a_load_racing_remove_does_not_bring_the_block_back(tmp_path, monkeypatch) -> None:
    ref = make_refs(list(range(4)))[0]
    store, _ = reopened(tmp_path, [ref])
    decoded, go = threading.Event(), threading.Event()
    decode = ucm.store_reader.decode_record

    def decode_then_wait(buf):  # the load has read the block from disk; `remove` runs now
        record = decode(buf)
        decoded.set()
        assert go.wait(10)
        return record

    monkeypatch.setattr(ucm.store_reader, "decode_record", decode_then_wait)
    with store:
        task = load_layer(store, ref, 0)
        assert decoded.wait(10)
        store.remove([ref.key])
        go.set()
        assert task.wait(10), "it was read before the remove: this load may still serve it"
        assert ref.key not in store._dram, "the load promoted a removed block back into DRAM"
        assert store.contains([ref.key]) == [False]
        store.prefetch([ref.key])  # nothing left to promote
        store._pool.submit(lambda: None).result()
        assert store.contains([ref.key]) == [False]
