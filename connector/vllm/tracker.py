"""`RequestTracker`: what the scheduler side remembers about one vLLM request from admission to finish.

It survives preemption: vLLM frees a preempted request's blocks and, on resumption, hands it a whole new block
table (and asks for external hits again), while blocks already saved stay saved. Keys are chained over the
request's token ids under the connector's namespace and `cache_salt`, computed once per block and kept.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from common.keys import BlockKey, chain_key
from ucm.api import BlockRef


@dataclass(frozen=True)
class LoadOffer:
    """The answer `get_num_new_matched_tokens` gave: `hit_blocks` stored blocks from `start_block` on."""

    start_block: int
    hit_blocks: int


@dataclass(frozen=True)
class LoadPlan:
    """An offer vLLM took, with the device blocks it allocated for it."""

    start_block: int
    block_ids: tuple[int, ...]
    before_forward: bool  # the last loaded block also holds tokens computed in the same step
    poisoned: bool = False


@dataclass
class RequestTracker:
    request_id: str
    token_ids: Callable[[], Sequence[int]]  # prompt + output tokens so far (read from vLLM's live request)
    num_prompt_tokens: int
    root: BlockKey
    keys: list[BlockKey] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)  # device block table, in sequence order
    # Blocks [0, handled) were loaded, saved, found in the store or given up on: never dumped again, also
    # after a preemption (their bytes in the store do not depend on which device block held them).
    handled: int = 0
    offer: LoadOffer | None = None
    load: LoadPlan | None = None
    preemptions: int = 0

    def keys_upto(self, num_blocks: int, block_size: int) -> list[BlockKey]:
        """Keys of blocks [0, num_blocks); every one of those blocks must be full of known tokens."""
        if len(self.keys) < num_blocks:
            tokens = self.token_ids()
            if len(tokens) < num_blocks * block_size:
                raise ValueError(f"{self.request_id}: {len(tokens)} tokens do not fill {num_blocks} blocks")
            parent = self.keys[-1] if self.keys else self.root
            for i in range(len(self.keys), num_blocks):
                parent = chain_key(parent, tokens[i * block_size : (i + 1) * block_size])
                self.keys.append(parent)
        return self.keys[:num_blocks]

    def refs(self, start: int, stop: int, block_size: int) -> list[BlockRef]:
        """BlockRefs (key, parent, token ids) of blocks [start, stop)."""
        keys = self.keys_upto(stop, block_size)
        tokens = self.token_ids()
        return [
            BlockRef(
                keys[i],
                keys[i - 1] if i else self.root,
                tuple(int(t) for t in tokens[i * block_size : (i + 1) * block_size]),
            )
            for i in range(start, stop)
        ]

    def apply_blocks(self, block_ids: Sequence[int], replaces: bool) -> None:
        if replaces:
            self.block_ids = list(block_ids)
        else:
            self.block_ids.extend(block_ids)

    def preempt(self) -> None:
        self.block_ids = []
        self.offer = None
        self.load = None
        self.preemptions += 1
