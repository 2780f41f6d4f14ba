"""What a node's first requests would otherwise pay for, paid before the node registers: healthy means ready.

Several choices are made on first use and memoised per process (ucm_kernels/cpu/: the attention path per shape
class, the linear path per row class, for the host's thread count; the sampler's paths; xgrammar's tokenizer
info), oneDNN builds its primitives per thread count, and a fresh process's first steps also fault in the weights and
the KV cache. A client whose first wave arrives the moment /health answers would wait for all of that. So a node
runs a few real steps of every shape class first — whole prompts, a chunk over a cached prefix, decodes, greedy and
sampled and guided — at every thread count the thread governor may pick (engine/thread_governor.py), with the KV
connector detached (nothing reaches the store) and a salt of its own (no block it leaves in the device cache can
match a user's), then zeroes the engine's counters.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.final_states import FinalStates
from engine.guided.spec import GuidedDecoding, GuidedKind
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.engine_core import EngineCore

logger = logging.getLogger(__name__)

SALT = "ucm-serve warm-up"  # its blocks' keys are rooted apart from every user's (common/keys.py)
LONG_PROMPT_TOKENS = 512  # a prompt step of many rows (capped by the step budget and max_model_len)
DECODE_TOKENS = 4
MAX_COUNTS = 4  # every thread count up to this many; beyond it the widest, half of it and one


@dataclass(frozen=True)
class WarmupReport:
    seconds: float
    thread_counts: tuple[int, ...]
    steps: int

    def line(self) -> str:
        threads = "/".join(map(str, self.thread_counts))
        return f"warm-up: {self.steps} steps at {threads} thread(s) in {self.seconds:.1f}s"


def thread_counts(widest: int) -> tuple[int, ...]:
    """The thread counts to warm, widest first: those the governor can pick between 1 and `widest`."""
    if widest <= MAX_COUNTS:
        return tuple(range(widest, 0, -1))
    return tuple(sorted({widest, max(1, widest // 2), 1}, reverse=True))


def _requests(engine: EngineCore, rng: random.Random) -> list[tuple[list[int], SamplingParams]]:
    bs, vocab = engine.namespace.block_size, engine.model_config.vocab_size
    long_len = max(bs + 1, min(LONG_PROMPT_TOKENS, engine.step_budget.tokens // 2, engine.max_model_len - 16))
    short = [rng.randrange(vocab // 8, vocab // 2) for _ in range(2 * bs + 5)]
    longer = [rng.randrange(vocab // 8, vocab // 2) for _ in range(long_len)]
    greedy = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, logprobs=1, ignore_eos=True)
    sampled = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.8, top_p=0.9, top_k=40, seed=0, ignore_eos=True)
    guided = SamplingParams(
        max_tokens=DECODE_TOKENS, temperature=0.0, guided_decoding=GuidedDecoding(GuidedKind.JSON_OBJECT)
    )
    # The short prompt again with a tail: a chunk over its cached prefix (the third shape class).
    return [(longer, greedy), (short, sampled), (short + longer[:bs], guided)]


def warm_up(engine: EngineCore) -> WarmupReport:
    """Run the warm-up on `engine` (idle, nothing queued); returns what it did."""
    assert not engine.has_unfinished_requests(), "warm-up runs before the engine takes requests"
    t0 = time.monotonic()
    governor, connector, live_budget = engine.governor, engine.scheduler.connector, engine.live_budget
    widest = governor.max_threads if governor is not None else torch.get_num_threads()
    counts = thread_counts(widest) if engine.config.device == "cpu" else (widest,)
    # The thread counts are ours to set, nothing is saved, and steps on fewer threads say nothing of the budget.
    engine.governor, engine.scheduler.connector, engine.live_budget = None, None, None
    rng = random.Random(0)
    steps = 0
    try:
        for threads in counts:
            torch.set_num_threads(threads)
            for i, (prompt, params) in enumerate(_requests(engine, rng)):
                engine.add_request(f"warm-up-{threads}-{i}", prompt, params, cache_salt=SALT)
                if i == 1:  # the chunk over a cached prefix needs its prefix computed first: a step between
                    engine.step()
                    steps += 1
            while engine.has_unfinished_requests():
                engine.step()
                steps += 1
    finally:
        torch.set_num_threads(widest)
        engine.governor, engine.scheduler.connector, engine.live_budget = governor, connector, live_budget
        if governor is not None:
            governor.restart()
        _forget_the_warm_up(engine)
    report = WarmupReport(time.monotonic() - t0, counts, steps)
    logger.info("%s", report.line())
    return report


def _forget_the_warm_up(engine: EngineCore) -> None:
    """The engine as if the warm-up had not run: its blocks out of the device prefix cache, unrecorded (a write-back
    connector would otherwise save them when a user's request takes their slots), its final states dropped, the
    counters from zero (in place: the scheduler holds the same object)."""
    pool = engine.kv_manager.pool
    pool.reset_prefix_cache()
    pool.take_evicted()
    engine.runner.final_states = FinalStates(engine.runner.final_states.capacity)
    stats = engine.stats_counters
    for f in dataclasses.fields(stats):
        setattr(stats, f.name, f.default)
