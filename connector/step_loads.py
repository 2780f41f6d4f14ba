"""A step's KV loads as the workers track them: one list of rows (request after request, each in prefix order),
the store task of every layer in flight, and the rows that failed in any layer. The native worker
(connector/ucm_worker.py) and the vLLM plugin's (connector/vllm/worker_core.py) each extend it with where the
rows land and how they are copied there."""

from __future__ import annotations

from dataclasses import dataclass, field

from connector.metadata import failed_rows
from ucm.api import BlockRef, StoreTask


@dataclass(frozen=True)
class LayerArrival:
    """One layer's load, waited for: the rows it filled, and whether its task is still running (a straggler keeps
    writing into its staging buffer, which the step must then not reuse)."""

    good: list[int]
    stuck: bool


@dataclass(kw_only=True)
class StepLoads:
    blocks: list[BlockRef]  # [rows]
    tasks: dict[int, StoreTask | None] = field(default_factory=dict)  # layer -> its load; None: the call raised
    failed_rows: set[int] = field(default_factory=set)  # rows some layer of which failed
    disk_rows: set[int] = field(default_factory=set)  # rows some layer of which the store read off disk

    @property
    def num_rows(self) -> int:
        return len(self.blocks)

    def arrive(self, layer: int, timeout: float) -> LayerArrival | None:
        """Wait for `layer`'s load (at most `timeout` seconds) and take it out of flight; None when none is."""
        if layer not in self.tasks:
            return None
        task = self.tasks.pop(layer)
        failed, stuck = failed_rows(task, self.num_rows, timeout)
        self.failed_rows |= failed
        if task is not None and not stuck:
            self.disk_rows.update(task.disk_blocks)
        return LayerArrival([r for r in range(self.num_rows) if r not in failed], stuck)

    def loaded_prefix(self, first: int, count: int) -> int:
        """Of a request's `count` blocks at rows `first`..., how many loaded in every layer before the first that
        failed in any: only a prefix of the KV is usable."""
        return next((i for i in range(count) if first + i in self.failed_rows), count)
