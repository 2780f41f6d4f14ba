"""Pluggable eviction policies for the store's tiers; `make_policy` is the one way to build one.

LRU is the baseline; S3-FIFO, ARC, GDSF and LRFU (LMCache's cost-aware score) are eviction orders; TinyLFU is an admission filter (meant for
the disk tier) over a segmented LRU; DENSITY evicts chains tail first by a hit density it learns per reuse
class (`reuse_model`); Adaptive follows whichever of LRU and DENSITY is winning. Belady's offline optimum
lives in `ucm.eviction.belady` and is for benchmarks only.
"""

from __future__ import annotations

from collections.abc import Callable

from ucm.eviction.adaptive import AdaptivePolicy
from ucm.eviction.arc import ARCPolicy
from ucm.eviction.base import EvictionPolicy, PolicyName
from ucm.eviction.density import DensityPolicy
from ucm.eviction.gdsf import GDSFPolicy
from ucm.eviction.lrfu import LRFUPolicy
from ucm.eviction.lru import LRUPolicy
from ucm.eviction.s3fifo import S3FIFOPolicy
from ucm.eviction.tinylfu import TinyLFUPolicy

__all__ = [
    "ARCPolicy",
    "AdaptivePolicy",
    "DensityPolicy",
    "EvictionPolicy",
    "GDSFPolicy",
    "LRFUPolicy",
    "LRUPolicy",
    "PolicyName",
    "S3FIFOPolicy",
    "TinyLFUPolicy",
    "make_policy",
]

_POLICIES: dict[PolicyName, Callable[[int], EvictionPolicy]] = {
    PolicyName.LRU: LRUPolicy,
    PolicyName.S3FIFO: S3FIFOPolicy,
    PolicyName.ARC: ARCPolicy,
    PolicyName.TINYLFU: TinyLFUPolicy,
    PolicyName.ADAPTIVE: AdaptivePolicy,
    PolicyName.DENSITY: DensityPolicy,
    PolicyName.GDSF: GDSFPolicy,
    PolicyName.LRFU: LRFUPolicy,
}


def make_policy(name: PolicyName, capacity_bytes: int) -> EvictionPolicy:
    """A fresh policy for a tier holding at most `capacity_bytes`."""
    if not isinstance(name, PolicyName):
        raise ValueError(f"policy name must be a PolicyName, got {name!r} (try PolicyName({name!r}))")
    return _POLICIES[name](capacity_bytes)
