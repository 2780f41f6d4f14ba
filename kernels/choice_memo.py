"""A process's memo of measured kernel choices: one per choice (the CPU attention calibration, the GPU prefill plan,
the linear-layer choices), each keyed by what the answer depends on within a process."""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class ChoiceMemo(Generic[K, V]):
    """This process's answers of one choice, per key: the lock is held while one is measured, so the threads of a
    process measure it once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.values: dict[K, V] = {}

    def clear(self) -> None:
        with self.lock:
            self.values.clear()
