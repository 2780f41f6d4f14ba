"""The model's final state (the lm_head's input) at the last token of block-aligned prompts, by the prompt's last
block key, so that a prompt found whole in the prefix cache samples its first token without a forward.

A block-aligned prompt whose every block hits still computes its last token (kv_cache_manager.get_computed_blocks):
one row through every layer, ~28 ms of a 2048-token prompt's repeat on the 2-core Xeon with AMX, nearly all of it
the layers' weights read from memory for one row. That row's final state is a function of the prompt's tokens alone,
which the last block's chained key names (with the model's namespace and any cache salt), and of this process's
kernels: the state the first computation left is the one a recomputation gives, bit for bit where rows are
split-invariant; where they are not, a hit now gets exactly what the cold run got. So the model runner keeps it, a few KB a prompt,
and a step made only of such rows skips the forward (its copy-on-write copy still gives the sequence the last
block's KV, which the cold run wrote). Bounded, least recently used first out.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from common.keys import BlockKey

CAPACITY = 1024  # prompts remembered per engine: 1.2 MB of bf16 states for SmolLM2, 16 MB at a 4096-wide fp32 model


class FinalStates:
    def __init__(self, capacity: int = CAPACITY) -> None:
        assert capacity > 0, f"capacity must be positive, got {capacity}"
        self.capacity = capacity
        self._states: OrderedDict[BlockKey, torch.Tensor] = OrderedDict()
        self.hits = 0  # steps whose rows all came from here (tests, stats)

    def __len__(self) -> int:
        return len(self._states)

    def get(self, key: BlockKey) -> torch.Tensor | None:
        state = self._states.get(key)
        if state is not None:
            self._states.move_to_end(key)
        return state

    def put(self, key: BlockKey, state: torch.Tensor) -> None:
        """Keep `state` (one row, copied) for the prompt whose last block is `key`, unless one is kept already: the
        first computation's stays (a recomputation alone gives other bits where rows are not split-invariant, fp32
        prompt rows on some hosts, and every later hit should get what the first run got)."""
        if key not in self._states:
            self._states[key] = state.detach().clone()
        self._states.move_to_end(key)
        while len(self._states) > self.capacity:
            self._states.popitem(last=False)
