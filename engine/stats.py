"""Engine counters. Tests assert on them ("only the new tokens were computed"), benchmarks report them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    num_requests: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests
    computed_tokens: int = 0  # tokens run through the model outside plain decode steps (prefill, recompute)
    prefix_cache_hit_tokens: int = 0  # tokens served from the device prefix cache
    external_hit_tokens: int = 0  # tokens loaded by the KV connector (failed loads are subtracted)
    load_error_tokens: int = 0  # tokens recomputed because their blocks failed to load
    preemptions: int = 0
    prefix_matches: int = 0  # device prefix-cache matches the scheduler ran (remembered until the cache changes)
    prefix_deferrals: int = 0  # (step, sequence) pairs held back while a running sequence computed their prefix
    generated_tokens: int = 0  # tokens sampled and kept
    steps: int = 0
    threads: int = 0  # the OpenMP threads the last step ran with (engine/thread_governor.py; 0: not governed)
    thread_changes: int = 0  # times the governor changed them because other processes took or freed cores
