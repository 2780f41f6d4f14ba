"""The asynchronous task returned by dump/load, shared by the in-process store and the daemon client."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Executor

from ucm.api import TaskStatus

# What a task's work returns: the failed blocks, or for a load (failed, served from disk).
Outcome = list[int] | tuple[list[int], list[int]]


class Task:
    """A `StoreTask` finished exactly once by whoever does the work (`finish`)."""

    def __init__(self, num_blocks: int) -> None:
        self._num_blocks = num_blocks
        self._event = threading.Event()
        self._failed: list[int] = []
        self._from_disk: list[int] = []
        self.error: str | None = None  # why the whole task failed (e.g. store unreachable), for logs

    @classmethod
    def completed(
        cls, num_blocks: int, failed: Iterable[int] = (), error: str | None = None, from_disk: Iterable[int] = ()
    ) -> Task:
        task = cls(num_blocks)
        task.finish(failed, error, from_disk)
        return task

    @classmethod
    def all_failed(cls, num_blocks: int, error: str) -> Task:
        return cls.completed(num_blocks, range(num_blocks), error)

    def finish(self, failed: Iterable[int] = (), error: str | None = None, from_disk: Iterable[int] = ()) -> None:
        """`from_disk`: blocks of a load served from the disk tier; a failed one is dropped (it loaded nothing)."""
        assert not self._event.is_set(), "a task is finished exactly once"
        self._failed = sorted(set(failed))
        assert all(0 <= i < self._num_blocks for i in self._failed), f"failed index out of range: {self._failed}"
        self._from_disk = sorted(set(from_disk) - set(self._failed))
        assert all(0 <= i < self._num_blocks for i in self._from_disk), f"disk index out of range: {self._from_disk}"
        self.error = error
        self._event.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until finished; True only if every block succeeded (False on timeout too)."""
        if not self._event.wait(timeout):
            return False
        return not self._failed

    def check(self) -> TaskStatus:
        if not self._event.is_set():
            return TaskStatus.RUNNING
        return TaskStatus.FAILED if self._failed else TaskStatus.DONE

    @property
    def failed_blocks(self) -> list[int]:
        """Failed block indices; only meaningful once the task finished."""
        return list(self._failed)

    @property
    def disk_blocks(self) -> list[int]:
        """Loaded block indices served from the disk tier (the other loaded ones came from DRAM); only
        meaningful once the task finished."""
        return list(self._from_disk)

    def __repr__(self) -> str:
        return f"Task(blocks={self._num_blocks}, status={self.check().value}, failed={self._failed})"


def run_task(pool: Executor, num_blocks: int, work: Callable[[], Outcome], failure: Callable[[Exception], str]) -> Task:
    """`work` on `pool` as a Task. An exception fails every block, with `failure(exc)` (which logs it) as the
    error; a pool already shut down fails the task at once."""
    task = Task(num_blocks)

    def run() -> None:
        try:
            result = work()
        except Exception as exc:
            task.finish(range(num_blocks), failure(exc))
            return
        failed, from_disk = result if isinstance(result, tuple) else (result, [])
        task.finish(failed, from_disk=from_disk)

    try:
        pool.submit(run)
    except RuntimeError:
        return Task.all_failed(num_blocks, "client is closed")
    return task
