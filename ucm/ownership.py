"""`OwnerTable`: which client dumped (pending) or committed each block, so that no client can overwrite or
remove another's entries.

The owner is the client's CURVE public key (z85); a daemon without CURVE has one identity and keeps no table.
Rules:

- dump: a key pending for another client (and not older than the pending timeout) is refused for this one;
  a committed block is never overwritten anyway (the store skips keys it holds: same key, same bytes).
- commit: only the keys this client has pending are published; the rest are ignored.
- remove (when enforced): refused if any key is owned by another client, or is stored with no known owner
  (committed before a restart, or dropped from this bounded table).

Bounded: the oldest entries are forgotten past `max_entries` (their blocks then have no known owner).
"""

from __future__ import annotations

import enum
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from common.keys import BlockKey


class ClaimState(enum.Enum):
    PENDING = "pending"
    COMMITTED = "committed"


@dataclass(slots=True)
class _Claim:
    owner: str
    state: ClaimState
    since: float


class OwnerTable:
    def __init__(self, pending_timeout_s: float, max_entries: int = 1 << 20) -> None:
        if pending_timeout_s <= 0 or max_entries <= 0:
            raise ValueError("pending_timeout_s and max_entries must be positive")
        self._timeout = pending_timeout_s
        self._max = max_entries
        self._lock = threading.Lock()
        self._claims: OrderedDict[BlockKey, _Claim] = OrderedDict()

    def claim_pending(self, keys: Sequence[BlockKey], owner: str) -> list[bool]:
        """For each key (one the store does not hold): may `owner` dump it? Records the claim if so."""
        now = time.monotonic()
        allowed = []
        with self._lock:
            for key in keys:
                claim = self._claims.get(key)
                taken = (
                    claim is not None
                    and claim.owner != owner
                    and claim.state is ClaimState.PENDING
                    and now - claim.since <= self._timeout
                )
                allowed.append(not taken)
                if not taken and (claim is None or claim.owner != owner or claim.state is not ClaimState.PENDING):
                    self._put(key, _Claim(owner, ClaimState.PENDING, now))
            self._trim()
        return allowed

    def settle(self, keys: Sequence[BlockKey], owner: str, ok: bool) -> list[BlockKey]:
        """The keys `owner` has pending (those it may commit); they become committed (ok) or unclaimed."""
        mine = []
        now = time.monotonic()
        with self._lock:
            for key in keys:
                claim = self._claims.get(key)
                if claim is None or claim.owner != owner or claim.state is not ClaimState.PENDING:
                    continue
                mine.append(key)
                if ok:
                    self._put(key, _Claim(owner, ClaimState.COMMITTED, now))
                else:
                    del self._claims[key]
        return mine

    def foreign(
        self, keys: Sequence[BlockKey], owner: str, stored: Callable[[Sequence[BlockKey]], list[bool]]
    ) -> list[BlockKey]:
        """Keys `owner` may not remove: owned by another client, or stored with no known owner."""
        with self._lock:
            claims = [self._claims.get(key) for key in keys]
        unknown = [key for key, claim in zip(keys, claims) if claim is None]
        unknown_stored = {key for key, present in zip(unknown, stored(unknown)) if present} if unknown else set()
        return [
            key
            for key, claim in zip(keys, claims)
            if (claim is not None and claim.owner != owner) or key in unknown_stored
        ]

    def forget(self, keys: Sequence[BlockKey]) -> None:
        with self._lock:
            for key in keys:
                self._claims.pop(key, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._claims)

    def _put(self, key: BlockKey, claim: _Claim) -> None:
        self._claims[key] = claim
        self._claims.move_to_end(key)

    def _trim(self) -> None:
        while len(self._claims) > self._max:
            self._claims.popitem(last=False)
