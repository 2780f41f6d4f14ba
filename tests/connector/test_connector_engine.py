"""UCMDirectConnector end to end: the real model (fp32), real LMDB, a real store daemon, fresh processes.

One module fixture produces KV once per store (embedded LMDB, daemon) and runs every fresh-process consumer
in one child process (this file run as a script), so the whole module stays well under a minute or two.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import msgspec
import pytest

from launch.store_process import StoreProcess

BS = 16
NUM_LAYERS = 30
PROMPT_BLOCKS = 10
PROMPT_LEN = PROMPT_BLOCKS * BS + 7  # a tail that is never a full block
MAX_TOKENS = 6
EXTERNAL = PROMPT_BLOCKS * BS  # every full prompt block; the 7-token tail is computed
CORRUPT_BLOCK = 4  # its LMDB bytes are flipped: blocks 4.. of the prompt must be recomputed
ENGINE = dict(dtype="float32", kv_cache_memory="128MiB", max_model_len=1024)


def prompt_ids() -> list[int]:
    rng = random.Random(1234)
    return [rng.randrange(100, 40000) for _ in range(PROMPT_LEN)]


def run_engine(loaded_model, kv_store: str | None, kv_role: str | None, prompt: list[int] | None = None) -> dict:
    """Greedy generation on a fresh engine; its tokens, engine counters and connector counters."""
    from engine import LLM, SamplingParams

    llm = LLM(loaded_model=loaded_model, kv_store=kv_store, kv_role=kv_role, **ENGINE)
    prompt = prompt if prompt is not None else prompt_ids()
    out = llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))[0]
    llm.engine.check_integrity()
    result = {
        "tokens": list(out.outputs[0].token_ids),
        "engine": asdict(llm.engine.stats()),
        "kv_transfer_params": msgspec.to_builtins(out.kv_transfer_params),  # JSON, for the parent process
    }
    if llm.engine.kv_connector is not None:
        sched, worker = llm.engine.kv_connector
        result["connector"] = asdict(sched.stats)
        # A daemon client's counts of payloads that skipped the socket (None for an embedded store).
        result["shared"] = [getattr(worker.store, "shared_dumps", None), getattr(worker.store, "shared_loads", None)]
        if hasattr(sched, "log"):
            from connector.recording import check_lifecycle

            result["lifecycle_problems"] = check_lifecycle(sched.log.events, NUM_LAYERS)
            result["num_loads"] = sum(1 for ev in sched.log.events if ev.method == "wait_for_layer_load")
        worker.close()
    return result


def load_fp32_model():
    import torch

    from engine.loader import load_model

    return load_model("smollm2-135m", torch.float32, "cpu")


def child_main(scenarios: list[list[str]]) -> None:
    """A fresh process: one fresh engine per (kv_store, kv_role); prints one JSON line of results."""
    import torch

    torch.set_num_threads(1)
    model = load_fp32_model()
    print(json.dumps([run_engine(model, store, role) for store, role in scenarios]), flush=True)


def corrupt_lmdb_block(path: Path, key: bytes) -> None:
    import lmdb

    env = lmdb.open(str(path), map_size=1 << 30)
    with env.begin(write=True) as txn:
        value = bytearray(txn.get(key))
        value[-10] ^= 0xFF  # inside the last layer's payload: only the checksum can tell
        txn.put(key, bytes(value))
    env.close()


@pytest.fixture(scope="module")
def model():
    from tests.engine_helpers import single_thread

    with single_thread():  # 2 shared cores: OpenMP spin-waiting makes threaded small matmuls far slower
        yield load_fp32_model()


@pytest.fixture(scope="module")
def world(tmp_path_factory, model):
    from connector.factory import close_embedded_stores

    tmp = tmp_path_factory.mktemp("connector")
    lmdb_dir, bad_dir = tmp / "lmdb", tmp / "lmdb-corrupt"
    embedded = f"embedded?dram=64MiB&disk=256MiB&disk_path={lmdb_dir}"
    res = {"reference": run_engine(model, None, None)}
    # Engine A saves to the embedded store (DRAM + LMDB); engine A2 of the same process hits its DRAM.
    res["producer_lmdb"] = run_engine(model, f"recording+{embedded}", "kv_both")
    res["dram_in_process"] = run_engine(model, f"recording+{embedded}", "kv_consumer")
    # A block-aligned prompt whose every block is stored: all are loaded, only its last token is computed.
    aligned = prompt_ids()[:EXTERNAL]
    res["aligned_reference"] = run_engine(model, None, None, aligned)
    res["aligned_hit"] = run_engine(model, embedded, "kv_consumer", aligned)
    close_embedded_stores()  # flush LMDB and release it before another process opens it
    shutil.copytree(lmdb_dir, bad_dir)
    from common.keys import KeyNamespace, block_keys, root_key

    keys = block_keys(root_key(KeyNamespace(model.fingerprint, "float32", BS)), prompt_ids(), BS)
    corrupt_lmdb_block(bad_dir, keys[CORRUPT_BLOCK])
    daemon = StoreProcess(dram="256MiB")
    try:
        res["producer_daemon"] = run_engine(model, daemon.address, "kv_producer")
        scenarios = [
            [embedded, "kv_consumer"],
            [f"embedded?dram=64MiB&disk=256MiB&disk_path={bad_dir}", "kv_both"],
            [daemon.address, "kv_consumer"],
        ]
        root = Path(__file__).resolve().parents[2]
        child = subprocess.run(
            [sys.executable, __file__, json.dumps(scenarios)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=root,
            env={**os.environ, "PYTHONPATH": str(root)},
        )
        assert child.returncode == 0, child.stderr[-4000:]
        last = child.stdout.strip().splitlines()[-1]
        res["lmdb_new_process"], res["lmdb_corrupt"], res["daemon_new_process"] = json.loads(last)
        res["child_log"] = child.stderr
    finally:
        daemon.stop()
    return res


def assert_full_hit(r: dict, reference: dict) -> None:
    assert r["tokens"] == reference["tokens"]
    assert r["engine"]["external_hit_tokens"] == EXTERNAL
    assert r["engine"]["computed_tokens"] == PROMPT_LEN - EXTERNAL
    assert r["engine"]["load_error_tokens"] == 0
    assert r["connector"]["blocks_loaded"] == PROMPT_BLOCKS and r["connector"]["blocks_load_failed"] == 0


def test_producer_saves_every_full_block(world):
    r = world["producer_lmdb"]
    assert r["tokens"] == world["reference"]["tokens"]
    assert r["engine"]["external_hit_tokens"] == 0 and r["engine"]["computed_tokens"] == PROMPT_LEN
    # The prompt's 10 blocks, plus the generated tokens' full block (save_decode_blocks is on).
    expected = (PROMPT_LEN + MAX_TOKENS - 1) // BS
    assert r["connector"]["blocks_saved"] == expected and r["connector"]["blocks_save_failed"] == 0


def test_fresh_process_loads_from_lmdb(world):
    assert_full_hit(world["lmdb_new_process"], world["reference"])


def test_fresh_engine_loads_from_dram(world):
    assert_full_hit(world["dram_in_process"], world["reference"])


def test_aligned_prompt_fully_stored_computes_one_token(world):
    r = world["aligned_hit"]
    assert r["tokens"] == world["aligned_reference"]["tokens"]
    assert r["engine"]["external_hit_tokens"] == EXTERNAL - 1 and r["engine"]["computed_tokens"] == 1
    assert r["connector"]["blocks_loaded"] == PROMPT_BLOCKS


def test_producer_and_consumer_share_a_daemon(world):
    assert world["producer_daemon"]["tokens"] == world["reference"]["tokens"]
    assert world["producer_daemon"]["connector"]["blocks_saved"] > 0
    assert_full_hit(world["daemon_new_process"], world["reference"])
    # Same host: the daemon copied the saves out of the producer's shared staging (the prompt's 10 blocks are a
    # small save: all 30 layers in one request), and wrote every loaded layer into the consumer's (no payload
    # frames either way).
    assert world["producer_daemon"]["shared"][0] == 1
    assert world["daemon_new_process"]["shared"][1] == NUM_LAYERS


def test_corrupt_block_is_recomputed_and_not_a_hit(world):
    r = world["lmdb_corrupt"]
    assert r["tokens"] == world["reference"]["tokens"]
    good = CORRUPT_BLOCK * BS
    assert r["engine"]["external_hit_tokens"] == good  # the failed blocks were taken back
    assert r["engine"]["load_error_tokens"] == EXTERNAL - good
    assert r["connector"]["blocks_loaded"] == CORRUPT_BLOCK
    assert r["connector"]["blocks_load_failed"] == PROMPT_BLOCKS - CORRUPT_BLOCK
    assert "dropping" in world["child_log"]  # the store saw the bad checksum


def test_call_order_matches_documented_lifecycle(world):
    for name in ("producer_lmdb", "dram_in_process"):
        assert world[name]["lifecycle_problems"] == [], name
        # Every layer of the prompt's step, which saves its blocks; the decode steps fill no block, so the worker
        # says they need no hooks (`needs_layer_hooks`) and they run without them.
        assert world[name]["num_loads"] == NUM_LAYERS, world[name]["num_loads"]


def test_unreachable_store_changes_nothing(world, model):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = run_engine(model, f"tcp://127.0.0.1:{port}?timeout_s=0.2", "kv_both")
    assert r["tokens"] == world["reference"]["tokens"]
    assert r["engine"]["external_hit_tokens"] == 0 and r["connector"]["blocks_saved"] == 0
    assert r["connector"]["blocks_save_failed"] > 0


if __name__ == "__main__":
    child_main(json.loads(sys.argv[1]))
