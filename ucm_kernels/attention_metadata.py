"""What one forward pass tells attention about the packed batch (shared by the model, the kernels'
callers and the connector)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """All scheduled tokens of all sequences are packed along one axis, sequence after sequence.

    slot_mapping:    [num_tokens] int64, cache slot of each new token (block_id * block_size + offset)
    query_start_loc: [num_seqs + 1] int32, cu_seqlens of the new (query) tokens
    seq_lens:        [num_seqs] int32, context length of each sequence after this step (cached + new)
    block_tables:    [num_seqs, max_blocks_per_seq] int32; entries past a sequence's blocks are 0 and unused
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    context_tokens: int | None = None  # sum of seq_lens, known on the host (saves a CUDA prefill a device sync)
    # [num_seqs] int32: how many of each sequence's first new tokens are prompt tokens (the rest are generated ones,
    # after a preemption's recompute). On CPUs with AMX, bf16 prompt rows take the AMX attention body; None: none.
    prompt_queries: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
