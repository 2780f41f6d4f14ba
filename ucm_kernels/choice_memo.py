"""A process's memo of measured kernel choices: one per choice (the CPU attention calibration, the GPU prefill plan,
the linear-layer choices), each keyed by what the answer depends on within a process."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class ChoiceMemo(Generic[K, V]):
    """This process's answers of one choice, per key: the lock is held while one is measured, so the threads of a
    process measure it once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.values: dict[K, V] = {}

    def get_or_make(self, key: K, make: Callable[[], V]) -> V:
        """The answer for `key`: remembered, else `make()`'s, made under the lock (so once per process) and kept."""
        found = self.values.get(key)  # a dict read needs no lock: the hot path of every call after the first
        if found is not None:
            return found
        with self.lock:
            found = self.values.get(key)
            if found is None:
                found = make()
                self.values[key] = found
            return found

    def clear(self) -> None:
        with self.lock:
            self.values.clear()
