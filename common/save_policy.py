"""`KVSavePolicy`: when a node's connector saves a full block to the store.

Shared by the engine's config (`EngineConfig.kv_save_policy`), the connector that acts on it, and the launcher and
node flags that choose it, so the connector needs nothing of the engine to read it.
"""

from __future__ import annotations

import enum


class KVSavePolicy(str, enum.Enum):  # noqa: UP042 (CLI values)
    """When the connector saves a full block to the store."""

    # As soon as it is computed, layer by layer (write-through): other instances, and a restarted one, can
    # load it at once. What a prefill node feeding decode nodes needs.
    COMPUTED = "computed"
    # Only when the device prefix cache evicts it (write-back), all layers before its slot is reused. For one
    # engine alone on a store: the device cache already serves what it holds, so a block costs the store
    # nothing until the device is full; a crash loses what only the device held.
    EVICTED = "evicted"
    # As EVICTED while evicted blocks come back (the store is asked for them again); otherwise only blocks that showed
    # reuse: a prefix hit took them on the device, or they were evicted once before (ucm/reuse_admission.py). In a
    # workload of new prompts the store is then spared every save, each a copy beside the engine on its cores.
    REUSED = "reused"

    @property
    def writes_back(self) -> bool:
        """Saves happen at eviction from the device prefix cache, not as blocks are computed."""
        return self is not KVSavePolicy.COMPUTED
