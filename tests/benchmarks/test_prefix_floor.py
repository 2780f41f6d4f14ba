"""benchmarks.prefix_floor's arithmetic: the work it counts, and that its order is the best one (every order of a
small burst that respects "a suffix after its prefix", searched exhaustively)."""

from __future__ import annotations

import itertools

from benchmarks.prefix_floor import (
    attention_flops,
    batched_order_mean_flops,
    best_order_mean_flops,
    prefix_and_suffix_flops,
)
from benchmarks.vs_vllm_workloads import Burst
from engine.model_config import ModelConfig
from engine.step_budget import linear_flops_per_token

MC = ModelConfig.from_hf_dict(
    {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 100,
    }
)


def test_attention_counts_every_causal_pair() -> None:
    # positions 2 and 3 attend to 3 and 4 keys: 7 pairs, 4 flops a pair per head dim, head and layer
    assert attention_flops(MC, 2, 4) == 7 * 4 * MC.head_dim * MC.num_heads * MC.num_layers


def test_the_whole_burst_is_every_prefix_once_and_every_suffix() -> None:
    burst = Burst(prefixes=3, per_prefix=2, prefix_len=16, suffix_len=4)
    _, total = best_order_mean_flops(MC, burst)
    linear = linear_flops_per_token(MC) * burst.tokens
    attention = 3 * (attention_flops(MC, 0, 16) + 2 * attention_flops(MC, 16, 20))
    assert burst.tokens == 3 * (16 + 2 * 4) and total == linear + attention


def test_no_order_gives_a_smaller_mean() -> None:
    burst = Burst(prefixes=2, per_prefix=3, prefix_len=16, suffix_len=4)
    per_token = linear_flops_per_token(MC)
    prefix = per_token * 16 + attention_flops(MC, 0, 16)
    suffix = per_token * 4 + attention_flops(MC, 16, 20)
    jobs = [("p", g) for g in range(2)] + [("s", g) for g in range(2) for _ in range(3)]
    best = None
    for order in set(itertools.permutations(jobs)):
        if any(kind == "s" and ("p", g) not in order[:i] for i, (kind, g) in enumerate(order)):
            continue  # a suffix before its prefix
        done, completions = 0, []
        for kind, _ in order:
            done += prefix if kind == "p" else suffix
            if kind == "s":
                completions.append(done)
        mean = sum(completions) / len(completions)
        best = mean if best is None else min(best, mean)
    ours, _ = best_order_mean_flops(MC, burst)
    assert ours == best


def test_a_step_based_engine_finishes_a_groups_followers_together() -> None:
    burst = Burst(prefixes=2, per_prefix=3, prefix_len=16, suffix_len=4)
    prefix, suffix = prefix_and_suffix_flops(MC, burst)
    leader = prefix + suffix  # a group's leader finishes alone
    group = prefix + 3 * suffix  # its 2 followers finish together, with the group's work
    want = (leader + 2 * group + (group + leader) + 2 * (2 * group)) / 6
    assert batched_order_mean_flops(MC, burst) == want
    assert batched_order_mean_flops(MC, burst) > best_order_mean_flops(MC, burst)[0], "batching can only cost"
