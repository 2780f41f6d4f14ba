"""`RemovalClock`: tells a disk read whether a removal may have run since it started.

A load that finds a block only on disk promotes it into DRAM after reading it, outside the store lock. A
`remove` (or a corruption drop) running in between deletes the block from both tiers, and promoting it after
that would bring a removed block back. Removals tick the clock when they start and when they end; a reader
takes a mark before its disk read and promotes only if no removal was under way then and none has started
since (a removal of other keys costs it a promotion, nothing worse: removals are rare). Not locked itself: the
`Store` calls it under its own lock.
"""

from __future__ import annotations


class RemovalClock:
    def __init__(self) -> None:
        self._begun = 0
        self._done = 0

    def begin(self) -> None:
        self._begun += 1

    def end(self) -> None:
        self._done += 1
        assert self._done <= self._begun, "a removal ended that never began"

    def mark(self) -> int | None:
        """Taken before a disk read; None while a removal is under way."""
        return self._begun if self._begun == self._done else None

    def quiet_since(self, mark: int | None) -> bool:
        """Whether no removal was under way at `mark` and none has started since."""
        return mark is not None and self._begun == mark
