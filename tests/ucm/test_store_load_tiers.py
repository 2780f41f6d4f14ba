"""Which tier a load's blocks were read from (`StoreTask.disk_blocks`), in-process and through the daemon: only
blocks that loaded and verified are named; a missing or failed block is in no tier."""

from __future__ import annotations

from tests.store_helpers import NUM_LAYERS, PAYLOAD, assert_loaded, dump_all, make_refs, open_store, run_daemon
from ucm.api import BlockRef, TaskStatus
from ucm.client import StoreClient
from ucm.task import Task


def _load(store, refs: list[BlockRef]) -> tuple[list[int], list[int]]:
    """(failed, served from disk) of one load of every layer; checks the loaded bytes."""
    dst = [[bytearray(PAYLOAD) for _ in range(NUM_LAYERS)] for _ in refs]
    task = store.load(refs, list(range(NUM_LAYERS)), [[memoryview(b) for b in row] for row in dst])
    task.wait(10)
    assert task.check() is not TaskStatus.RUNNING
    assert_loaded(refs, dst, skip=tuple(task.failed_blocks))
    return task.failed_blocks, task.disk_blocks


def _with_missing(refs: list[BlockRef], at: int) -> list[BlockRef]:
    """`refs` with a block nobody dumped inserted at `at` (a 7th block of the same chain: same keys scheme)."""
    stray = make_refs([t for r in refs for t in r.token_ids] + [7000, 7001, 7002, 7003])[len(refs)]
    return [*refs[:at], stray, *refs[at:]]


def test_in_process_dram_hits_then_disk_hits_after_reopen(tmp_path) -> None:
    refs = make_refs(list(range(24)))  # 6 blocks
    with open_store(tmp_path) as store:
        dump_all(store, refs)
        store.flush()
        assert _load(store, refs) == ([], [])  # every block still in DRAM
    with open_store(tmp_path) as store:  # reopened: only the disk tier holds them
        blocks = _with_missing(refs, 3)
        assert _load(store, blocks) == ([3], [0, 1, 2, 4, 5, 6])
        assert _load(store, blocks) == ([3], [])  # the load before promoted them into DRAM


def test_daemon_names_disk_hits_in_its_load_reply(tmp_path) -> None:
    refs = make_refs(list(range(300, 324)))
    with run_daemon(tmp_path / "db") as d:
        with StoreClient(d.address, timeout_s=5.0) as client:
            dump_all(client, refs)
            assert _load(client, refs) == ([], [])
        assert d.stop() == 0  # flushes the write-behind queue
    with run_daemon(tmp_path / "db") as d, StoreClient(d.address, timeout_s=5.0) as client:
        assert _load(client, _with_missing(refs, 0)) == ([0], [1, 2, 3, 4, 5, 6])
        assert _load(client, refs) == ([], [])  # promoted by the load before


def test_a_failed_block_is_never_a_disk_hit() -> None:
    task = Task(4)
    task.finish([1, 3], from_disk=[0, 1, 2, 3])
    assert task.disk_blocks == [0, 2]
    assert Task.all_failed(2, "down").disk_blocks == []
