"""Helpers shared by the store tests (no tests here): fake blocks with recognisable payloads, an in-process store,
rounds of dumps and loads from several threads, a daemon process."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from common.keys import KeyNamespace, block_keys, root_key
from launch.store_process import StoreProcess
from ucm.api import BlockRef, Tier
from ucm.store import Store, StoreConfig

BLOCK_SIZE = 4
NUM_LAYERS = 3
PAYLOAD = 256  # bytes per (block, layer)
MiB = 1 << 20


def make_refs(token_ids: list[int], salt: str | None = None) -> list[BlockRef]:
    root = root_key(KeyNamespace("test-model", "float16", BLOCK_SIZE), salt)
    keys = block_keys(root, token_ids, BLOCK_SIZE)
    parents = [root, *keys[:-1]]
    return [
        BlockRef(k, p, tuple(token_ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]))
        for i, (k, p) in enumerate(zip(keys, parents))
    ]


def payload(ref: BlockRef, layer: int, size: int = PAYLOAD) -> bytes:
    """Deterministic bytes that differ per block and per layer."""
    seed = int.from_bytes(ref.key[:4], "little") ^ (layer * 7919)
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def dump_all(
    store, refs: list[BlockRef], num_layers: int = NUM_LAYERS, commit: bool = True, size: int = PAYLOAD
) -> None:
    for layer in range(num_layers):
        task = store.dump(refs, layer, num_layers, [payload(r, layer, size) for r in refs])
        assert task.wait(10), f"dump failed: {task.failed_blocks}"
    if commit:
        store.commit([r.key for r in refs], True)


def load_all(store, refs: list[BlockRef], layers: list[int] | None = None, size: int = PAYLOAD):
    """(task succeeded?, failed indices, the dst buffers)."""
    layers = list(range(NUM_LAYERS)) if layers is None else layers
    dst = [[bytearray(size) for _ in layers] for _ in refs]
    task = store.load(refs, layers, [[memoryview(b) for b in row] for row in dst])
    ok = task.wait(10)
    return ok, task.failed_blocks, dst


def assert_loaded(refs: list[BlockRef], dst, layers: list[int] | None = None, skip: tuple[int, ...] = ()) -> None:
    layers = list(range(NUM_LAYERS)) if layers is None else layers
    for i, ref in enumerate(refs):
        if i in skip:
            continue
        for j, layer in enumerate(layers):
            assert bytes(dst[i][j]) == payload(ref, layer, len(dst[i][j])), f"block {i} layer {layer} differs"


def open_store(tmp_path: Path, dram: int = 4 * MiB, disk: int | None = 16 * MiB, **kw) -> Store:
    """An in-process Store with its LMDB under tmp_path/db (disk=None: DRAM only)."""
    return Store(
        StoreConfig(dram_bytes=dram, disk_path=str(tmp_path / "db") if disk else None, disk_bytes=disk or 0, **kw)
    )


def record_bytes(store: Store, ref: BlockRef) -> int:
    """The bytes one committed block of `ref` takes in DRAM (dumped, measured, removed again)."""
    dump_all(store, [ref], commit=True)
    size = store.stats().tiers[Tier.DRAM].bytes_used
    store.remove([ref.key])
    return size


def dump_load_rounds(store, refs: list[BlockRef], rounds: int) -> None:
    """Dump, commit and load back all of refs `rounds` times, checking every byte each time."""
    for _ in range(rounds):
        dump_all(store, refs)
        ok, failed, dst = load_all(store, refs)
        assert ok, f"failed {failed}"
        assert_loaded(refs, dst)


def run_threads(worker: Callable[[int], None], count: int, timeout_s: float = 60.0) -> list[str]:
    """worker(0..count-1), each on its own thread; what went wrong, one line per thread that raised."""
    errors: list[str] = []

    def guarded(n: int) -> None:
        try:
            worker(n)
        except Exception as exc:  # surfaced by the caller's assert
            errors.append(f"thread {n}: {exc!r}")

    threads = [threading.Thread(target=guarded, args=(n,)) for n in range(count)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return errors + [f"thread {n}: still running after {timeout_s} s" for n, t in enumerate(threads) if t.is_alive()]


@contextmanager
def run_daemon(disk_path: Path | None = None, *extra: str, dram: str = "64MiB") -> Iterator[StoreProcess]:
    """The store's own daemon (launch/store_process.py), --insecure unless `extra` names keys: these tests are about
    the store itself; test_store_security covers CURVE."""
    with StoreProcess(dram=dram, disk_path=disk_path, extra=extra) as daemon:
        yield daemon
