"""How many tokens per second the cluster serves while it has work: what sizes the admission queue.

Tokens (prompt + generated) of finished sequences over *busy* time, both decayed with a half-life, so the rate
follows the current load and model, and an idle night does not read as a slow cluster. Prompt and generated
tokens cost differently, so this is a blend; it only has to say how long a queue of similar requests would wait.
"""

from __future__ import annotations

from dataclasses import dataclass

# Below this much observed busy time the rate is noise (one short request would read as any number).
_MIN_BUSY_S = 1.0


@dataclass
class ServiceRate:
    half_life_s: float = 60.0
    _tokens: float = 0.0
    _busy_s: float = 0.0
    _busy: bool = False
    _last: float | None = None

    def __post_init__(self) -> None:
        if self.half_life_s <= 0:
            raise ValueError(f"half-life must be positive, got {self.half_life_s}")

    def _advance(self, now: float) -> None:
        if self._last is not None:
            dt = max(0.0, now - self._last)
            decay = 0.5 ** (dt / self.half_life_s)
            self._tokens *= decay
            self._busy_s = self._busy_s * decay + (dt if self._busy else 0.0)
        self._last = now

    def set_busy(self, busy: bool, now: float) -> None:
        self._advance(now)
        self._busy = busy

    def served(self, tokens: int, now: float) -> None:
        self._advance(now)
        self._tokens += tokens

    def tokens_per_s(self, now: float) -> float | None:
        """None until enough busy time was seen to say."""
        self._advance(now)
        if self._busy_s < _MIN_BUSY_S or self._tokens <= 0:
            return None
        return self._tokens / self._busy_s
