"""Which of a step's packed token rows are generated tokens: a position at or past its request's prompt length.

A bf16 matmul sends those rows through the decode kernel and the prompt's rows through oneDNN
(engine/models/dense.py, ucm_kernels/cpu/q4_bf16.py). The class is a row's own property, the same in every step
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

    @classmethod
    def from_mask(cls, mask: np.ndarray, device: torch.device) -> GeneratedRows:
        """mask [T] bool: row i is a generated token."""
        count = int(mask.sum())
        if 0 < count < mask.size:
            return cls(mask.size, count, torch.from_numpy(np.flatnonzero(mask)).to(device))
        return cls(mask.size, count, None)

    def select(self, index: torch.Tensor) -> GeneratedRows:
        """The classes of rows `index` (int64, in that order) of this step."""
        n = int(index.numel())
        if self.count in (0, self.total):
            return GeneratedRows(n, n if self.count else 0, None)
        assert self.generated is not None, "a mixed step has the generated rows' indices"
        mask = torch.zeros(self.total, dtype=torch.bool, device=index.device)
        mask[self.generated] = True
        return GeneratedRows.from_mask(mask[index].cpu().numpy(), index.device)

    def apply(
        self,
        x: torch.Tensor,
        generated_fn: Callable[[torch.Tensor], torch.Tensor],
        prompt_fn: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """Row-wise f(x) [T, N] with each row through the function of its class. `prompt_fn` must give a row the
        same result whatever rows it is called with (oneDNN does): a mixed step runs it on every row and then
        overwrites the few generated rows, since moving the prompt's rows in and out costs more (a 1024-row
        step's gathers and scatters of SmolLM2's activations took ~80 ms, a quarter of the step)."""
        assert x.shape[0] == self.total, f"{x.shape[0]} rows, but the step packs {self.total}"
        if self.count == 0:
            return prompt_fn(x)
        if self.count == self.total:
            return generated_fn(x)
        assert self.generated is not None, "a mixed step has the generated rows' indices"
        out = prompt_fn(x)
        out.index_copy_(0, self.generated, generated_fn(x.index_select(0, self.generated)))
        return out


@dataclass(frozen=True)
class RowSubset:
    """Some of a step's rows: their int64 indices (in output order) and their classes."""

    index: torch.Tensor
    rows: GeneratedRows | None  # None: every row a prompt row

    @classmethod
    def of(cls, index: torch.Tensor, step_rows: GeneratedRows | None) -> RowSubset:
        return cls(index, step_rows.select(index) if step_rows is not None else None)
