"""Builds a connector pair from the engine's `kv_store` / `kv_role` settings (engine-core imports this lazily).

    make_connector("embedded" | "embedded?disk_path=DIR" | "tcp://..." | "recording[+SPEC]", role,
                   engine_config, model_config, fingerprint) -> ConnectorPair(scheduler, worker)

Embedded stores are shared by every engine of the process that names the same spec (one DRAM tier, one
LMDB environment: LMDB forbids opening a directory twice in one process) and closed at exit.
"""

from __future__ import annotations

import atexit
import logging
import threading
from dataclasses import dataclass

from common.save_policy import KVSavePolicy
from connector.base import ConnectorPair, KVConnectorRole
from connector.metadata import ConnectorStats
from connector.request_view import EngineSettings
from connector.store_spec import StoreKind, StoreSpec
from connector.ucm_scheduler import UCMSchedulerConnector
from connector.ucm_worker import UCMWorkerConnector
from ucm.api import KVStore

log = logging.getLogger(__name__)

RECORDING_PREFIX = "recording"

# A node's daemon client: KV transfers may take a while on a loaded box, a lookup never should; the first
# lookup to a dead store is what a request pays before the breaker opens.
DAEMON_TIMEOUT_S = 5.0
CONTROL_TIMEOUT_S = 1.0

_embedded_lock = threading.Lock()
_embedded: dict[StoreSpec, KVStore] = {}


def _close_embedded() -> None:
    with _embedded_lock:
        stores = list(_embedded.values())
        _embedded.clear()
    for store in stores:
        store.close()


atexit.register(_close_embedded)


def open_store(spec: StoreSpec, stats: ConnectorStats | None = None) -> KVStore:
    """The process's embedded store for `spec`, or a new client of the daemon at `spec.address` behind a circuit
    breaker (a dead daemon costs one short timeout, then is skipped until it answers a probe), whose counters
    go into `stats`."""
    if spec.kind is StoreKind.DAEMON:
        from common.auth import ClientAuth
        from ucm.circuit_breaker import BreakerConfig
        from ucm.client import StoreClient

        assert spec.address is not None, "a daemon spec has an address"
        auth = ClientAuth.from_dir(spec.curve_keys, spec.curve_client) if spec.curve_keys else None
        data_timeout = spec.timeout_s if spec.timeout_s is not None else DAEMON_TIMEOUT_S
        return StoreClient(
            spec.address,
            timeout_s=data_timeout,
            control_timeout_s=min(data_timeout, CONTROL_TIMEOUT_S),
            auth=auth,
            breaker=BreakerConfig(),
            on_breaker_change=stats.absorb_breaker if stats is not None else None,
        )
    from ucm.store import Store
    from ucm.store_config import StoreConfig

    with _embedded_lock:
        store = _embedded.get(spec)
        if store is None:
            config = StoreConfig(
                dram_bytes=spec.dram_bytes,
                disk_path=spec.disk_path,
                disk_bytes=spec.disk_bytes,
                policy=spec.policy,
                disk_policy=spec.disk_policy,
            )
            store = _embedded[spec] = Store(config)
            log.info("embedded KV store opened (%s)", config)
        return store


def close_embedded_stores() -> None:
    """Close every embedded store of this process now (tests; normally done at exit)."""
    _close_embedded()


def parse_role(role: KVConnectorRole | str | None) -> KVConnectorRole:
    if role is None:
        return KVConnectorRole.BOTH
    if isinstance(role, KVConnectorRole):
        return role
    try:
        return KVConnectorRole(role)
    except ValueError:
        raise ValueError(f"kv_role must be one of {[r.value for r in KVConnectorRole]}, got {role!r}") from None


@dataclass
class UCMDirectConnector:
    """Both sides of one UCM connector, the store they share and their counters."""

    scheduler: UCMSchedulerConnector
    worker: UCMWorkerConnector
    store: KVStore
    spec: StoreSpec
    stats: ConnectorStats

    @classmethod
    def create(
        cls,
        kv_store: str,
        role: KVConnectorRole | str | None,
        block_size: int,
        *,
        save_decode_blocks: bool = True,
        recompute_last_token_only: bool = True,
        save_policy: KVSavePolicy = KVSavePolicy.COMPUTED,
    ) -> UCMDirectConnector:
        spec = StoreSpec.parse(kv_store)
        kv_role = parse_role(role)
        stats = ConnectorStats()
        store = open_store(spec, stats)
        scheduler = UCMSchedulerConnector(
            store,
            kv_role,
            block_size,
            stats,
            save_decode_blocks=save_decode_blocks,
            recompute_last_token_only=recompute_last_token_only,
            store_address=spec.display,
            save_policy=save_policy,
        )
        worker = UCMWorkerConnector(store, kv_role, stats, owns_store=spec.kind is StoreKind.DAEMON)
        return cls(scheduler, worker, store, spec, stats)

    def close(self) -> None:
        """Daemon clients are per connector; embedded stores belong to the process."""
        self.worker.close()


def make_connector(
    kv_store: str,
    role: KVConnectorRole | str | None,
    engine_config: EngineSettings,
    model_config: object,
    fingerprint: str,
) -> ConnectorPair:
    """(scheduler side, worker side) for `kv_store`; `recording[+SPEC]` wraps them in call recorders."""
    del model_config, fingerprint  # block keys come with each request; the layout comes from register_kv_caches
    if kv_store.startswith(RECORDING_PREFIX):
        from connector.recording import make_recording_connector

        inner = kv_store.removeprefix(RECORDING_PREFIX).removeprefix("+") or "embedded"
        return make_recording_connector(make_connector(inner, role, engine_config, None, ""))
    conn = UCMDirectConnector.create(
        kv_store,
        role,
        engine_config.block_size,
        save_decode_blocks=engine_config.kv_save_decode_blocks,
        recompute_last_token_only=engine_config.kv_recompute_last_token_only,
        save_policy=engine_config.kv_save_policy,
    )
    return ConnectorPair(conn.scheduler, conn.worker)
