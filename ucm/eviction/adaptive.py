"""Adaptive: follow whichever expert policy (LRU or DENSITY) is winning on the recent past.

No single order wins everywhere on KV-cache traces: DENSITY learns which blocks are worth keeping and wins
by far when the cache is small next to the reuse distances (Mooncake at 1-10% of its working set, RAG, shared
system prompts), while LRU is near-optimal where recency is what predicts reuse (interleaved chat sessions)
and on a cache that holds most of what comes back. So each expert runs twice: a *real* copy over the resident
keys (all copies see every insert/touch/remove; the victim comes from the current leader, and the others drop
it too, DENSITY as an eviction: it keeps the victim as a ghost, so its hit counts and reuse model stay as
informed as if it had led, and a switch to it pays off sooner; at rag 10% this took Adaptive from 40.19 to
41.89, at sysprompt 2% from 61.91 to 63.05), and a small *shadow* cache that simulates the expert alone on a hash-sampled 1/M of the keys with 1/M of
the capacity (SHARDS-style). Shadow hits are counted with exponential decay; LRU leads at first, and a
challenger takes over only when its lead is beyond noise (a switch is not free: the real cache still holds what
the old leader chose). O(experts) per operation.

S3-FIFO and ARC were experts too. They were dropped: on Mooncake their shadows win early at small capacities
and the switch then costs more than DENSITY gains, and with more experts the noise between near-equal ones
made Adaptive switch away from LRU on recency workloads (synthetic chat: up to 0.25 points under LRU).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable

import xxhash

from ucm.eviction.base import PolicyName, check_capacity, check_size
from ucm.eviction.density import DensityPolicy
from ucm.eviction.lru import LRUPolicy
from ucm.eviction.sketch import key_bytes

EXPERTS = (LRUPolicy, DensityPolicy)
Expert = LRUPolicy | DensityPolicy
SHADOW_ENTRIES = 2048  # sample so that a shadow holds about this many blocks
# A challenger leads by more than 4 standard deviations of a Poisson count by chance about once in 30,000
# comparisons (one per sampled access); at 3 sigmas (once in 700) Adaptive left LRU on noise on chat.
SWITCH_SIGMAS = 4.0
MIN_HALF_LIFE = 64  # sampled accesses, for tiny caches
HALF_LIFE_SHADOWS = 4  # scores forget with a half-life of this many shadow-fulls of sampled accesses


def _everything(key: Hashable) -> bool:
    return True


class AdaptivePolicy:
    name = PolicyName.ADAPTIVE

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = check_capacity(capacity_bytes)
        self._real: list[Expert] = [expert(capacity_bytes) for expert in EXPERTS]
        self._shadows: list[Expert] = []  # built with the first block's size, which sets the sampling rate
        self._modulus = 1
        self._shadow_capacity = capacity_bytes
        self.scores = [0.0] * len(EXPERTS)
        self._decay = 1.0
        self.leader = 0

    @property
    def used_bytes(self) -> int:
        return self._real[0].used_bytes

    @property
    def leader_name(self) -> PolicyName:
        return self._real[self.leader].name

    def __len__(self) -> int:
        return len(self._real[0])

    def __contains__(self, key: Hashable) -> bool:
        return key in self._real[0]

    def admit(self, key: Hashable, size: int) -> bool:
        check_size(size)
        return True

    def insert(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        check_size(size)
        self._observe(key, size, parent)
        for policy in self._real:
            policy.insert(key, size, parent)

    def touch(self, key: Hashable) -> None:
        if key not in self:
            return
        self._observe(key, None, None)
        for policy in self._real:
            policy.touch(key)

    def remove(self, key: Hashable) -> None:
        for policy in self._real:
            policy.remove(key)

    def evict(self, can_evict: Callable[[Hashable], bool]) -> Hashable | None:
        victim = self._real[self.leader].evict(can_evict)
        if victim is not None:
            for i, policy in enumerate(self._real):
                if i == self.leader:
                    continue
                # Density keeps learning from the leader's choices (ghosts, hit counts), ready to take over.
                if isinstance(policy, DensityPolicy):
                    policy.evicted(victim)
                else:
                    policy.remove(victim)
        return victim

    # -- internals -----------------------------------------------------------------------------------

    def _observe(self, key: Hashable, size: int | None, parent: Hashable | None) -> None:
        """Replay one access (a touch, or an insert = a miss here) on the shadows of sampled keys."""
        if not self._shadows:
            if size is None:
                return
            entries = max(1, self.capacity_bytes // max(size, 1))
            self._modulus = max(1, entries // SHADOW_ENTRIES)
            self._shadow_capacity = max(1, self.capacity_bytes // self._modulus)
            self._shadows = [expert(self._shadow_capacity) for expert in EXPERTS]
            self._decay = 0.5 ** (1.0 / (HALF_LIFE_SHADOWS * max(MIN_HALF_LIFE, entries // self._modulus)))
        if self._modulus > 1 and xxhash.xxh3_64_intdigest(key_bytes(key)) % self._modulus:
            return
        for i, shadow in enumerate(self._shadows):
            self.scores[i] *= self._decay
            if key in shadow:
                self.scores[i] += 1.0
                shadow.touch(key)
                continue
            if size is None:
                lru = self._real[0]
                assert isinstance(lru, LRUPolicy), "EXPERTS[0] is LRU, which knows every resident size"
                size = lru.size(key)
            shadow.insert(key, size, parent)
            while shadow.used_bytes > self._shadow_capacity:
                if shadow.evict(_everything) is None:
                    break
        best = max(range(len(EXPERTS)), key=lambda i: (self.scores[i], -i))
        # Every switch leaves the real cache shaped by the old leader, so switch only on a lead that is not
        # noise: more than SWITCH_SIGMAS standard deviations of a Poisson count.
        lead = self.scores[best] - self.scores[self.leader]
        if lead > SWITCH_SIGMAS * math.sqrt(max(self.scores[self.leader], 1.0)):
            self.leader = best
