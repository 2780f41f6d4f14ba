"""One access log line per generation request on the `router.access` logger, written when the request ends:
answered, refused, failed in the middle of a stream (the status was 200 already: the error is on the line), or
left by its client (499).

    cmpl-1a2b… POST /v1/completions 200 prompt=31 cached=16 output=8 ttft=0.132s e2e=0.540s
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from router.serving import Choice, cached_tokens

log = logging.getLogger("router.access")


@dataclass
class AccessEntry:
    path: str
    started: float = field(default_factory=time.monotonic)
    request_id: str = "-"
    prompt_tokens: int = 0
    choices: list[Choice] = field(default_factory=list)
    logged: bool = False

    def done(self, status: int, error: str | None = None) -> None:
        """Write the line (once: the first outcome wins)."""
        if self.logged:
            return
        self.logged = True
        output = sum(c.num_tokens for c in self.choices)
        firsts = [c.ttft_s for c in self.choices if c.ttft_s is not None]
        ttft = f"{min(firsts):.3f}s" if firsts else "-"
        line = (
            f"{self.request_id} POST {self.path} {status} prompt={self.prompt_tokens} "
            f"cached={cached_tokens(self.choices)} output={output} ttft={ttft} e2e={time.monotonic() - self.started:.3f}s"
        )
        if error is not None:
            line += f" error={error!r}"
        log.info("%s", line)
