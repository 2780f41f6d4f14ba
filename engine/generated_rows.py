"""Which of a step's packed token rows are generated tokens: a position at or past its request's prompt length.

A bf16 matmul sends those rows through the decode kernel and the prompt's rows through oneDNN
(engine/models/dense.py, kernels/cpu/skinny_bf16.py). The class is a row's own property, the same in every step
that computes it (a decode step, a mixed step, a recompute after preemption), so a row's bits never depend on
how its step was made up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class GeneratedRows:
    total: int  # the step's packed rows
    count: int  # how many of them are generated tokens
    generated: torch.Tensor | None  # their int64 indices when the step mixes both classes, else None
    prompt: torch.Tensor | None  # the other rows' indices, likewise

    @classmethod
    def from_mask(cls, mask: np.ndarray, device: torch.device) -> GeneratedRows:
        """mask [T] bool: row i is a generated token."""
        count = int(mask.sum())
        if 0 < count < mask.size:
            gen = torch.from_numpy(np.flatnonzero(mask)).to(device)
            rest = torch.from_numpy(np.flatnonzero(~mask)).to(device)
            return cls(mask.size, count, gen, rest)
        return cls(mask.size, count, None, None)

    def apply(
        self,
        x: torch.Tensor,
        generated_fn: Callable[[torch.Tensor], torch.Tensor],
        prompt_fn: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """Row-wise f(x) [T, N] with each row through the function of its class."""
        assert x.shape[0] == self.total, f"{x.shape[0]} rows, but the step packs {self.total}"
        if self.count == 0:
            return prompt_fn(x)
        if self.count == self.total:
            return generated_fn(x)
        assert self.generated is not None and self.prompt is not None, "a mixed step has both index sets"
        gen = generated_fn(x.index_select(0, self.generated))
        out = torch.empty((self.total, gen.shape[1]), dtype=gen.dtype, device=gen.device)
        out.index_copy_(0, self.generated, gen)
        out.index_copy_(0, self.prompt, prompt_fn(x.index_select(0, self.prompt)))
        return out
