"""Whether a node that holds the router's requests is getting anywhere with them.

A request may sit for minutes in a busy node's queue; that is slowness, not failure, and must never make the
router prefill the prompt a second time elsewhere. So the router does not time requests out: it watches each
node's step counter (Heartbeat.steps) and gives up on a node only when the counter has not moved for
`stall_s` while the node holds work. The clock starts when the work arrives, so idle time never counts.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ProgressWatch:
    stall_s: float
    steps: int = -1  # last reported; -1 before the first heartbeat
    last_advance: float = 0.0  # when the counter last moved, or the node last went from idle to busy
    busy: bool = False

    def __post_init__(self) -> None:
        if self.stall_s <= 0:
            raise ValueError(f"stall window must be positive, got {self.stall_s}")

    def reported(self, steps: int, now: float) -> None:
        """A heartbeat's step counter."""
        if steps != self.steps:
            self.steps = steps
            self.last_advance = now

    def work_started(self, now: float) -> None:
        """The router handed the node a request while it held none of ours."""
        if not self.busy:
            self.busy = True
            self.last_advance = now

    def work_ended(self) -> None:
        self.busy = False

    def stalled(self, now: float) -> bool:
        return self.busy and now - self.last_advance > self.stall_s

    def stalled_for(self, now: float) -> float:
        return now - self.last_advance
