"""The KV connector: joins an engine to the UCM store (DESIGN.md §5).

    base.py           the API (vLLM's method names), split by role, the documented per-step call order, ConnectorPair
    request_view.py   what the connector reads of the engine's requests and steps, as typing.Protocols
    factory.py        make_connector(kv_store, role, engine_config, model_config, fingerprint) -> ConnectorPair
    store_spec.py     the `kv_store` string: "embedded[?disk_path=DIR&dram=...]" or "tcp://..." / "ipc://..."
    ucm_scheduler.py  scheduler side: lookup past the device prefix cache, per-step loads and saves
    ucm_worker.py     worker side: layer-wise loads into / saves from the paged cache, load-error reporting
    kv_layout.py      one block of one layer <-> one payload (K then V), staging buffers
    metadata.py       the per-step metadata (BlockSpec), the counters, the save selection and commit both
                      connectors share
    recording.py      a test connector that records the call sequence and checks it

Importing this package stays torch-free; the names below load on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["UCMDirectConnector", "make_connector"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from connector import factory

        return getattr(factory, name)
    raise AttributeError(f"module 'connector' has no attribute {name!r}")
