"""KVSavePolicy.EVICTED (write-back): a block reaches the store only when the device prefix cache evicts it, with
the bytes a write-through save would have stored, and a later request loads it and continues exactly like a cold
run. Real model (fp32), real embedded store with LMDB."""

from __future__ import annotations

import random

import pytest

from common.keys import block_keys, root_key
from ucm.api import BlockRef

BS = 16
PROMPT_LEN = 200  # 12 full blocks and a tail
ENGINE = dict(dtype="float32", kv_cache_memory="12MiB")  # 17 blocks of SmolLM2 in fp32: a second prompt evicts


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(100, 40000) for _ in range(PROMPT_LEN)] for _ in range(n)]


def make(smollm2_fp32, tmp_path, policy: str):
    from engine import LLM

    store = f"embedded?disk_path={tmp_path / policy}"
    return LLM(loaded_model=smollm2_fp32, kv_store=store, kv_save_policy=policy, **ENGINE)


def greedy(llm, prompt: list[int]) -> list[int]:
    from engine import SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    return list(llm.generate([prompt], params)[0].outputs[0].token_ids)


def refs_of(llm, prompt: list[int]) -> list[BlockRef]:
    """The prompt's full blocks as the engine keys them."""
    root = root_key(llm.engine.namespace)
    keys = block_keys(root, prompt, BS)
    return [BlockRef(k, keys[i - 1] if i else root, tuple(prompt[i * BS : (i + 1) * BS])) for i, k in enumerate(keys)]


def stored_bytes(llm, prompt: list[int], only_held: bool = False) -> dict[int, bytes]:
    """Every layer's payload of the prompt's full blocks (only those the store holds), read back from the
    engine's store: block index -> bytes."""
    _, worker = llm.engine.kv_connector
    refs = refs_of(llm, prompt)
    held = worker.store.contains([ref.key for ref in refs])
    index = [i for i, h in enumerate(held) if h or not only_held]
    refs = [refs[i] for i in index]
    layers = list(range(worker.layout.num_layers))
    size = worker.layout.payload_nbytes
    dst = [[memoryview(bytearray(size)) for _ in layers] for _ in refs]
    task = worker.store.load(refs, layers, dst)
    task.wait(30)
    assert not task.failed_blocks, f"blocks {task.failed_blocks} did not load"
    return {i: b"".join(bytes(view) for view in row) for i, row in zip(index, dst)}


@pytest.fixture(scope="module")
def cold(smollm2_fp32):
    """The greedy continuation of the first prompt without any store."""
    from engine import LLM

    llm = LLM(loaded_model=smollm2_fp32, **ENGINE)
    try:
        return greedy(llm, prompts(1)[0])
    finally:
        llm.close()


def test_nothing_is_saved_until_the_device_cache_evicts_it(smollm2_fp32, tmp_path, cold):
    llm = make(smollm2_fp32, tmp_path, "evicted")
    sched, _ = llm.engine.kv_connector
    first, *others = prompts(4)
    assert greedy(llm, first) == cold
    assert sched.stats.blocks_saved == 0, "write-back saved a block the device still caches"
    keys = [ref.key for ref in refs_of(llm, first)]
    assert len(keys) == PROMPT_LEN // BS
    assert not any(sched.store.contains(keys))
    for prompt in others:  # each needs more blocks than are free: the first prompt's are evicted
        greedy(llm, prompt)
    assert all(sched.store.contains(keys)), "an evicted block of the first prompt is not in the store"
    saved = sched.stats.blocks_saved
    assert saved >= PROMPT_LEN // BS
    loaded = sched.stats.blocks_loaded
    assert greedy(llm, first) == cold  # loaded from the store, continued exactly like the cold run
    assert sched.stats.blocks_loaded - loaded == PROMPT_LEN // BS
    llm.engine.check_integrity()
    llm.close()


def test_evicted_saves_hold_what_write_through_stores(smollm2_fp32, tmp_path):
    first, *others = prompts(4)
    through = make(smollm2_fp32, tmp_path, "computed")
    greedy(through, first)
    back = make(smollm2_fp32, tmp_path, "evicted")
    greedy(back, first)
    for prompt in others:
        greedy(back, prompt)
    assert stored_bytes(back, first) == stored_bytes(through, first)
    through.close()
    back.close()


def test_a_block_evicted_for_a_copy_on_write_is_saved_before_the_copy(smollm2_fp32, tmp_path):
    """n=2 forks share the prompt's partial last block; each fork's first write copies it into a new block, which
    here is an evicted block of the first prompt: its bytes must reach the store before the copy lands."""
    from engine import SamplingParams

    rng = random.Random(3)
    first = prompts(1)[0]
    forked = [rng.randrange(100, 40000) for _ in range(150)]  # 9 full blocks and a shared partial one
    through = make(smollm2_fp32, tmp_path, "computed")
    greedy(through, first)
    back = make(smollm2_fp32, tmp_path, "evicted")
    greedy(back, first)
    params = SamplingParams(n=2, max_tokens=3, temperature=1.0, seed=5, ignore_eos=True)
    back.generate([forked], params)
    held = stored_bytes(back, first, only_held=True)
    assert len(held) >= 3, "the forks evicted too little of the first prompt to test anything"
    want = stored_bytes(through, first)
    assert [i for i in held if held[i] != want[i]] == [], "stored bytes differ from write-through's"
    through.close()
    back.close()


def test_a_block_the_store_holds_is_not_saved_again(smollm2_fp32, tmp_path):
    llm = make(smollm2_fp32, tmp_path, "evicted")
    sched, _ = llm.engine.kv_connector
    first, second = prompts(2)
    greedy(llm, first)
    greedy(llm, second)  # evicts the first prompt's blocks: saved
    greedy(llm, first)  # loaded back from the store: evicts the second's
    skipped = sched.stats.blocks_save_skipped
    greedy(llm, second)  # evicts the first prompt's blocks again: the store has them
    assert sched.stats.blocks_save_skipped > skipped
    # 206 tokens a request: 12 full blocks each, 24 distinct blocks in all, none saved twice.
    assert sched.stats.blocks_saved <= 2 * (PROMPT_LEN // BS)
    llm.close()


def test_write_back_needs_the_prefix_cache():
    from common.save_policy import KVSavePolicy
    from engine.config import CacheConfig, EngineConfig

    with pytest.raises(ValueError, match="needs the prefix cache"):
        EngineConfig(
            kv_store="embedded", cache=CacheConfig(enable_prefix_caching=False), kv_save_policy=KVSavePolicy.EVICTED
        )
    with pytest.raises(ValueError, match="kv_save_policy"):
        EngineConfig(kv_store="embedded", kv_save_policy="evicted")  # type: ignore[arg-type]
