"""engine/heap.py: a CPU engine keeps freed memory for its next step, so a prompt step like the last one faults no
activation pages in again (glibc; Llama-1B's shape, 2 layers, a 2048-token prompt: ~20 thousand faults a step
without it)."""

from __future__ import annotations

import random
import resource

import pytest

from benchmarks.yardstick_models import ensure_model
from engine import LLM, SamplingParams
from engine import engine_core as engine_core_mod
from engine.heap import retain_freed_memory


def test_a_repeated_prompt_step_faults_no_pages_in(tmp_path, monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(engine_core_mod, "retain_freed_memory", lambda: calls.append(1) or retain_freed_memory())
    llm = LLM(model=str(ensure_model("llama-1b", 2, root=tmp_path)), dtype="bfloat16", enable_prefix_caching=False,
              kv_cache_memory="256MiB", max_num_batched_tokens=2048)  # fmt: skip
    if not retain_freed_memory():
        llm.close()
        pytest.skip("not glibc's malloc: nothing to ask")
    assert calls == [1], "the CPU engine asked for it once, at start-up"
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 40000) for _ in range(2048)]
    faults = []
    for _ in range(6):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    llm.close()
    # The heap settles within a few steps (free chunks coalesce into the sizes a step asks for); glibc's default
    # keeps faulting ~20 thousand pages a step here.
    assert sorted(faults[-3:])[1] < 200, f"minor faults per step: {faults}: the activations faulted in again"


def test_off_leaves_the_allocator_alone(tmp_path, monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(engine_core_mod, "retain_freed_memory", lambda: calls.append(1))
    monkeypatch.setenv("UCM_RETAIN_FREED_MEMORY", "0")
    LLM(model="smollm2-135m", kv_cache_memory="32MiB").close()
    assert calls == []
