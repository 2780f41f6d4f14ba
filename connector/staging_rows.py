"""`StagingRows`: reusable host rows that blocks are packed into for a save or land in from a load; both the
UCMDirectConnector's worker and the vLLM plugin's stage through it."""

from __future__ import annotations

from collections.abc import Callable

import torch


class StagingRows:
    """Reusable host rows of `page_bytes`, seen as a tensor (to gather/scatter) and as memoryviews (the store).

    `alloc` hands out the memory (`KVStore.staging_buffer`: shared with a store daemon on this host, which then
    writes loads straight into it and copies saves straight out of it); without it, private memory, page-locked
    with `pin` (the source or target of a GPU copy). `reserve` rows are allocated now, so that the first load does
    not pay for them; the rows grow by doubling.
    """

    def __init__(
        self, page_bytes: int, alloc: Callable[[int], memoryview] | None = None, reserve: int = 0, *, pin: bool = False
    ) -> None:
        assert page_bytes > 0 and reserve >= 0, "a page has bytes"
        assert alloc is None or not pin, "memory from `alloc` cannot be pinned here"
        self.page_bytes = page_bytes
        self._alloc = alloc
        self._pin = pin
        self._rows = self._new(reserve)

    def _new(self, n: int) -> torch.Tensor:
        if self._alloc is None or n == 0:
            return torch.empty((n, self.page_bytes), dtype=torch.uint8, pin_memory=self._pin and n > 0)
        return torch.frombuffer(self._alloc(n * self.page_bytes), dtype=torch.uint8).view(n, self.page_bytes)

    def rows(self, n: int) -> torch.Tensor:
        if self._rows.shape[0] < n:
            self._rows = self._new(max(n, 2 * self._rows.shape[0]))
        return self._rows[:n]

    def memoryviews(self, n: int) -> list[memoryview]:
        whole = self.rows(n).numpy().reshape(-1).data
        return [whole[i * self.page_bytes : (i + 1) * self.page_bytes] for i in range(n)]
