"""Wake-ups for requests that wait for a node to (re)register: a decode node died and none is left, so the
request is held until the supervisor (or an operator) brings one back, instead of failing in-band.

NodeClient reports every registration through `on_node_event`; `wait` returns at the next one or at the
deadline. Waiters re-check the registry themselves: a registration is a hint, not a promise of a usable node.
"""

from __future__ import annotations

import asyncio
import contextlib
import time


class NodeArrivals:
    def __init__(self) -> None:
        # Replaced at each registration: everyone waiting on the old event wakes, later waiters get a fresh one.
        self._event = asyncio.Event()

    def node_event(self, node_id: str, event: str) -> None:
        """NodeClient.on_node_event callback."""
        del node_id
        if event == "registered":
            old, self._event = self._event, asyncio.Event()
            old.set()

    async def wait(self, deadline: float) -> bool:
        """Until the next registration (True) or `deadline` on the monotonic clock (False)."""
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        event = self._event
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), left)
        return event.is_set()
