"""The block keys a node most recently computed or reused: a bounded, ordered summary of its device
prefix cache that the router uses to send a prompt to the prefill node already holding its prefix.

An approximation on purpose: it needs no access to the block pool's internals, and a stale key only costs
a less good pairing (the node's real prefix cache and the store still decide what is reused)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable


class RecentKeys:
    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self._capacity = capacity
        self._keys: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()  # the heartbeat thread reads while the loop writes

    def touch(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            for key in keys:
                self._keys[key] = None
                self._keys.move_to_end(key)
            while len(self._keys) > self._capacity:
                self._keys.popitem(last=False)

    def clear(self) -> None:
        """Forget every key (the device prefix cache was reset)."""
        with self._lock:
            self._keys.clear()

    def snapshot(self) -> list[bytes]:
        """Oldest first, newest last."""
        with self._lock:
            return list(self._keys)

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)
