"""`StepCost`: what one node's work costs in seconds, measured from the counters in its heartbeats.

The engine's time goes to prompt tokens (linear in how many a step computes) and to steps themselves (a decode
step reads every weight once, whatever the batch). Between two heartbeats in which the node made steps, its busy
time is fitted as `prefill_token_s * computed_tokens + step_s * steps` (least squares over decayed sums, both
weights >= 0), so the router's cost-based pairing (router/pairing.py) weighs a prompt's blocks and a node's queue
by what this node measured, not by constants. A block loaded from the store costs the connector's wait per loaded
block (`connector_load_wait_seconds` / `connector_blocks_loaded`: only the part the forward pass could not hide).

The busy time of an interval is the node's own `jobs_busy_seconds` (wall time inside engine steps, node/runner.py);
from a node that does not report it, the whole interval when its step counter moved.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# Decayed sums forget with this half-life (in busy seconds): the fit follows a node whose speed changes (other
# processes took its cores, another model) within a minute of work.
HALF_LIFE_S = 60.0
# Below this much observed busy time a rate is noise (one short step reads as any number).
MIN_BUSY_S = 0.5
# Fewer loaded blocks than this say nothing about the store's speed.
MIN_LOADED_BLOCKS = 4.0
BUSY_KEY = "jobs_busy_seconds"  # node/job.py's JobCounters.busy_seconds as the heartbeat names it


@dataclass
class StepCost:
    """One node's measured costs; fed every heartbeat by the registry (`observe`), read by pairing."""

    half_life_s: float = HALF_LIFE_S
    # decayed sums of the normal equations of  t = a * tokens + b * steps
    _tt: float = 0.0
    _ts: float = 0.0
    _ss: float = 0.0
    _ty: float = 0.0
    _sy: float = 0.0
    _busy_s: float = 0.0
    _load_wait_s: float = 0.0
    _loaded_blocks: float = 0.0
    _last: Mapping[str, float] | None = None
    _last_at: float | None = None

    def __post_init__(self) -> None:
        if self.half_life_s <= 0:
            raise ValueError(f"half-life must be positive, got {self.half_life_s}")

    def observe(self, stats: Mapping[str, float], now: float) -> None:
        """A heartbeat's counters (engine `computed_tokens`, `steps`; connector load wait and blocks) at `now`."""
        last, last_at = self._last, self._last_at
        self._last, self._last_at = dict(stats), now
        if last is None or last_at is None:
            return
        dt = now - last_at
        steps = stats.get("steps", 0.0) - last.get("steps", 0.0)
        tokens = stats.get("computed_tokens", 0.0) - last.get("computed_tokens", 0.0)
        if dt <= 0 or steps <= 0 or tokens < 0:
            return  # idle, or counters that went back (a new process under the same state: never mixed)
        if BUSY_KEY in stats and BUSY_KEY in last:
            dt = stats[BUSY_KEY] - last[BUSY_KEY]
            if dt <= 0:
                return
        decay = 0.5 ** (dt / self.half_life_s)
        self._tt = self._tt * decay + tokens * tokens
        self._ts = self._ts * decay + tokens * steps
        self._ss = self._ss * decay + steps * steps
        self._ty = self._ty * decay + tokens * dt
        self._sy = self._sy * decay + steps * dt
        self._busy_s = self._busy_s * decay + dt
        waited = stats.get("connector_load_wait_seconds", 0.0) - last.get("connector_load_wait_seconds", 0.0)
        loaded = stats.get("connector_blocks_loaded", 0.0) - last.get("connector_blocks_loaded", 0.0)
        if waited >= 0 and loaded > 0:
            self._load_wait_s = self._load_wait_s * decay + waited
            self._loaded_blocks = self._loaded_blocks * decay + loaded

    def _fit(self) -> tuple[float, float] | None:
        """(seconds per computed token, seconds per step), both >= 0; None until enough busy time was seen."""
        if self._busy_s < MIN_BUSY_S:
            return None
        det = self._tt * self._ss - self._ts * self._ts
        if det > 1e-9 * max(self._tt * self._ss, 1e-30):
            a = (self._ty * self._ss - self._sy * self._ts) / det
            b = (self._sy * self._tt - self._ty * self._ts) / det
            if a >= 0 and b >= 0:
                return a, b
        # Collinear (every step the same size) or a negative weight: the better one-weight fit instead.
        only_tokens = (self._ty / self._tt, 0.0) if self._tt > 0 else None
        only_steps = (0.0, self._sy / self._ss) if self._ss > 0 else None
        fits = [f for f in (only_tokens, only_steps) if f is not None]
        return max(fits, key=lambda f: f[0] * self._ty + f[1] * self._sy) if fits else None

    @property
    def prefill_token_s(self) -> float | None:
        """Seconds one more prompt token adds to this node's steps (None: not measured yet)."""
        fit = self._fit()
        return fit[0] if fit is not None and fit[0] > 0 else None

    @property
    def step_s(self) -> float | None:
        """Seconds of a step beyond its prompt tokens: what a decode step costs (None: not measured yet)."""
        fit = self._fit()
        return fit[1] if fit is not None and fit[1] > 0 else None

    @property
    def block_load_s(self) -> float | None:
        """Seconds the forward pass waits per block loaded from the store (None: not measured yet)."""
        if self._loaded_blocks < MIN_LOADED_BLOCKS:
            return None
        return self._load_wait_s / self._loaded_blocks
