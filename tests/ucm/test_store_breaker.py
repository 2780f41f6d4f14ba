"""A dead store daemon costs one timeout, then the client's circuit breaker skips it until it answers a probe; a
daemon killed with SIGKILL and started again on the same LMDB and address serves its blocks again."""

from __future__ import annotations

import signal
import socket

from tests.cluster_helpers import wait_until as cluster_wait_until
from tests.store_helpers import NUM_LAYERS, PAYLOAD, assert_loaded, dump_all, load_all, make_refs, run_daemon
from ucm.api import Tier
from ucm.circuit_breaker import BreakerConfig, BreakerState, BreakerStats
from ucm.client import StoreClient

FAST_PROBES = BreakerConfig(probe_initial_s=0.05, probe_max_s=0.2, probe_timeout_s=0.5)


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def wait_until(what: str, condition, timeout: float = 30.0) -> None:
    cluster_wait_until(what, condition, timeout, poll_s=0.02)


def test_dead_store_costs_one_timeout_then_is_skipped_until_a_probe_answers() -> None:
    address = free_address()
    refs = make_refs(list(range(4 * 3)))
    keys = [r.key for r in refs]
    changes: list[BreakerStats] = []
    with StoreClient(
        address, timeout_s=10.0, control_timeout_s=0.3, breaker=FAST_PROBES, on_breaker_change=changes.append
    ) as client:
        assert client.breaker is not None
        # Loads in flight (10 s data timeout) while a lookup (0.3 s) finds the store dead: they give up with it.
        dst = [[memoryview(bytearray(PAYLOAD)) for _ in range(NUM_LAYERS)] for _ in refs]
        loads = [client.load(refs, list(range(NUM_LAYERS)), dst) for _ in range(2)]
        assert client.lookup(keys) == 0
        for task in loads:
            task.wait()
            assert task.failed_blocks == list(range(len(refs)))
        stats = client.breaker.stats()
        assert stats.trips == 1 and stats.reachable == 0
        assert stats.timeouts == 1, f"only the first call may wait out its timeout: {stats}"
        for _ in range(20):  # skipped at once: no call waits any more
            assert client.lookup(keys) == 0
            assert client.contains(keys) == [False] * len(keys)
        dump = client.dump(refs, 0, NUM_LAYERS, [bytes(PAYLOAD)] * len(refs))
        dump.wait()
        assert dump.failed_blocks == list(range(len(refs)))
        stats = client.breaker.stats()
        assert stats.timeouts == 1 and stats.skipped >= 41 and changes[-1].skipped == stats.skipped
        with run_daemon(None, "--bind", address) as daemon:
            assert daemon.address == address
            wait_until("a probe to close the breaker", lambda: client.breaker.state is BreakerState.CLOSED)
            assert client.breaker.stats().reachable == 1 and client.breaker.stats().probes >= 1
            dump_all(client, refs)
            assert client.lookup(keys) == len(refs)
        assert changes[-1].reachable == 1 and client.breaker.stats().timeouts == 1


def test_daemon_killed_and_restarted_on_the_same_lmdb_serves_its_blocks(tmp_path) -> None:
    refs = make_refs(list(range(4 * 6)))
    keys = [r.key for r in refs]
    with run_daemon(tmp_path / "db") as first, StoreClient(first.address, timeout_s=5.0) as client:
        address = first.address
        dump_all(client, refs)
        wait_until("the write-behind queue to reach LMDB", lambda: client.stats().tiers[Tier.DISK].blocks == len(refs))
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait()
    with run_daemon(tmp_path / "db", "--bind", address) as second, StoreClient(second.address, timeout_s=5.0) as client:
        assert second.address == address
        assert client.lookup(keys) == len(refs)
        ok, failed, dst = load_all(client, refs)
        assert ok, failed
        assert_loaded(refs, dst)
        assert client.stats().tiers[Tier.DISK].hits == len(refs)
