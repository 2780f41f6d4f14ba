"""`ucm-serve store ...` (run the daemon), `ucm-serve store keys DIR` (write CURVE key pairs) and
`ucm-serve store-stats --connect ADDR` (print its live stats).

Authentication: `--curve-keys DIR` (a folder from `ucm-serve keys DIR` = `ucm-serve store keys DIR`), or
`--server-key FILE` with `--authorized DIR`, makes the socket a CURVE server. Without either the daemon refuses to
start unless `--insecure` says so on purpose (it then logs a warning; refused together with key options).

On start the daemon prints exactly one line `ucm-store ready <address>` (flushed) once it serves; the
launcher and the tests wait for it. SIGTERM/SIGINT stop it cleanly: in-flight requests finish, the
write-behind queue is flushed and LMDB is closed.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
import time
from pathlib import Path

import msgspec

from common.auth import ClientAuth, KeyPaths, PublisherAuth, ServerAuth, generate_keys
from common.kv_events import endpoints
from common.kv_events.config import parse_kv_events_config
from common.size import format_size, parse_size
from protocol import defaults, flags
from ucm.api import StoreStats
from ucm.client import StoreClient, StoreUnavailable
from ucm.daemon import DaemonConfig, StoreDaemon
from ucm.eviction import PolicyName
from ucm.malloc_tuning import retain_freed_memory
from ucm.store import Store, StoreConfig
from ucm.store_config import DEFAULT_POLICY, DiskWrites
from ucm.tier_events import TierEvents

READY_PREFIX = "ucm-store ready "


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="ucm-serve store",
        description="Run the standalone UCM KV-store daemon. "
        "`ucm-serve store keys DIR` writes CURVE key pairs for --curve-keys (docs/security.md).",
    )
    ap.add_argument("--bind", default="tcp://127.0.0.1:0", help="ZeroMQ address; port 0 picks a free port")
    ap.add_argument(
        "--dram", type=_size, default=parse_size(defaults.STORE_DRAM), help="DRAM tier capacity (e.g. 4GiB)"
    )
    ap.add_argument("--disk-path", default=None, help="LMDB directory; omit for a DRAM-only store")
    ap.add_argument(
        "--disk", type=_size, default=parse_size(defaults.STORE_DISK), help="disk tier capacity (e.g. 20GiB)"
    )
    ap.add_argument("--map-size", type=_size, default=None, help="LMDB map size (default: 2x --disk + 64MiB)")
    ap.add_argument(
        "--disk-writes",
        choices=[w.value for w in DiskWrites],
        default=DiskWrites.BEHIND.value,
        help="behind: every committed block reaches the disk (it survives a restart); evicted: only what DRAM "
        "evicts (a victim tier that extends DRAM, for a disk that does not outlive the store); reused: as evicted while "
        "evicted blocks come back, else only those that showed reuse (read in DRAM, or evicted before)",
    )
    choices = [p.value for p in PolicyName]
    ap.add_argument(
        "--policy",
        choices=choices,
        default=DEFAULT_POLICY.value,
        help="DRAM eviction policy (the default won benchmarks.hit_rate_suite's held-out traces)",
    )
    ap.add_argument("--disk-policy", choices=choices, default=None, help="disk eviction policy (default: --policy)")
    ap.add_argument("--workers", type=int, default=4, help="request worker threads")
    ap.add_argument("--max-request-bytes", type=_size, default=parse_size("1GiB"))
    ap.add_argument("--max-frames", type=int, default=1 + 65536)
    ap.add_argument(
        "--max-segments",
        type=int,
        default=DaemonConfig.max_segments,
        help="shared-memory segments of same-host clients mapped at once (loads are written into them)",
    )
    ap.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    flags.KV_EVENTS_CONFIG.add(ap)
    auth = ap.add_argument_group("authentication (ZeroMQ CURVE)")
    auth.add_argument(
        "--curve-keys",
        metavar="DIR",
        default=None,
        help="folder written by `ucm-serve store keys DIR`: server.key_secret + authorized/",
    )
    auth.add_argument("--server-key", metavar="FILE", default=None, help="the server's .key_secret file")
    auth.add_argument("--authorized", metavar="DIR", default=None, help="folder of accepted client public .key files")
    auth.add_argument(
        "--insecure", action="store_true", help="no authentication: anyone who reaches the port may use the store"
    )
    return ap


def _server_auth(args: argparse.Namespace) -> ServerAuth | None:
    if args.insecure and (args.curve_keys or args.server_key or args.authorized):
        raise ValueError("--insecure contradicts --curve-keys/--server-key/--authorized")
    if args.curve_keys:
        if args.server_key or args.authorized:
            raise ValueError("--curve-keys replaces --server-key and --authorized; give one or the other")
        return KeyPaths.of(args.curve_keys).server_auth()
    if bool(args.server_key) != bool(args.authorized):
        raise ValueError("--server-key and --authorized go together")
    if args.server_key:
        return ServerAuth(Path(args.server_key), Path(args.authorized))
    if not args.insecure:
        raise ValueError(
            "the daemon needs keys (--curve-keys DIR, from `ucm-serve keys DIR`) or an explicit --insecure"
        )
    return None  # the daemon logs that it runs without authentication


def keys_main(argv: list[str]) -> int:
    """`ucm-serve keys DIR --nodes a,b` (= `ucm-serve store keys DIR --clients a,b`): one folder for both links."""
    ap = argparse.ArgumentParser(
        prog="ucm-serve keys",
        description="Write CURVE key pairs (z85 files, as "
        "zmq.auth.create_certificates writes them) for the store daemon, the router and "
        "each node or client: one folder serves the node-router and node-store links.",
    )
    ap.add_argument(
        "dir",
        help="folder to write server.key[_secret] (store), router.key[_secret], NAME.key[_secret] and authorized/",
    )
    ap.add_argument(
        "--nodes",
        "--clients",
        dest="clients",
        default="client",
        help="comma-separated node ids / client names, one key pair each (a node registers with the "
        "router only under the id its key is named for)",
    )
    args = ap.parse_args(argv)
    try:
        names = tuple(n.strip() for n in args.clients.split(",") if n.strip())
        paths = generate_keys(args.dir, names)
    except ValueError as exc:
        print(f"ucm-serve keys: {exc}", file=sys.stderr)
        return 2
    print(f"store:  ucm-serve store --curve-keys {paths.dir}")
    print(f"router: ucm-serve router --curve-keys {paths.dir}")
    for name in names:
        print(
            f"node {name}: ucm-serve prefill|decode --curve-keys {paths.dir} --node-id {name} "
            f"--store tcp://HOST:PORT  (the store link uses the same folder); or as a store client: "
            f"kv_store 'tcp://HOST:PORT?curve_keys={paths.dir}&curve_client={name}'"
        )
    print(
        "copy the folder (or, per host, its public .key files plus that host's NAME.key_secret) to each host; "
        "keep it private (mode 0700)"
    )
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["keys"]:
        return keys_main(argv[1:])
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = StoreConfig(
            dram_bytes=args.dram,
            disk_path=args.disk_path,
            disk_bytes=args.disk if args.disk_path else 0,
            disk_writes=DiskWrites(args.disk_writes),
            lmdb_map_size=args.map_size,
            policy=PolicyName(args.policy),
            disk_policy=PolicyName(args.disk_policy or args.policy),
        )
        daemon_config = DaemonConfig(
            bind=args.bind,
            workers=args.workers,
            max_frames=args.max_frames,
            max_request_bytes=args.max_request_bytes,
            max_segments=args.max_segments,
            auth=_server_auth(args),
            kv_events=parse_kv_events_config(args.kv_events_config) if args.kv_events_config else None,
        )
        if daemon_config.kv_events is not None and daemon_config.auth is not None:
            # The tiers' events as CURVE servers with the store's pair, for the router (router.key beside the
            # store's secret, as `ucm-serve keys` writes them) and the authorized clients.
            secret = Path(daemon_config.auth.secret_file)
            events_auth = PublisherAuth(secret, Path(daemon_config.auth.authorized_dir), secret.parent / "router.key")
            daemon_config = dataclasses.replace(daemon_config, events_auth=events_auth)
    except ValueError as exc:
        print(f"ucm-serve store: {exc}", file=sys.stderr)
        return 2
    retain_freed_memory()  # this process is the store: keep evicted buffers' pages for reuse
    publishes = daemon_config.kv_events is not None and daemon_config.kv_events.enabled
    store = Store(config, events=TierEvents() if publishes else None)
    daemon = StoreDaemon(store, daemon_config)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: daemon.stop())
    disk = (
        f"disk {format_size(config.disk_bytes)} at {config.disk_path} (writes: {config.disk_writes.value})"
        if config.disk_path
        else "no disk tier"
    )
    logging.getLogger("ucm.daemon").info("DRAM %s, %s, policy %s", format_size(config.dram_bytes), disk, args.policy)
    if daemon.events_endpoint is not None:
        logging.getLogger("ucm.daemon").info(endpoints.BOUND_LOG, daemon.events_endpoint, daemon.events_replay_endpoint)
    print(f"{READY_PREFIX}{daemon.address}", flush=True)
    daemon.serve_forever()
    print("ucm-store stopped", flush=True)
    return 0


def stats_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="ucm-serve store-stats", description="Print a running store daemon's stats.")
    ap.add_argument("--connect", required=True, help="the daemon's address, as printed on its ready line")
    ap.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for an answer")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--watch", type=float, default=0.0, help="refresh every N seconds (0: print once)")
    ap.add_argument(
        "--curve-keys", metavar="DIR", default=None, help="client keys for a CURVE daemon (see `store keys`)"
    )
    args = ap.parse_args(argv)
    auth = ClientAuth.from_dir(args.curve_keys) if args.curve_keys else None
    with StoreClient(args.connect, timeout_s=args.timeout, retry_after_s=0.0, auth=auth) as client:
        while True:
            try:
                stats = client.stats()
            except StoreUnavailable as exc:
                print(f"ucm-serve store-stats: {exc}", file=sys.stderr)
                return 1
            if args.json:
                print(msgspec.json.encode(stats).decode(), flush=True)  # enum keys become their values
            else:
                print(_table(stats), flush=True)
            if args.watch <= 0:
                return 0
            time.sleep(args.watch)


def _table(stats: StoreStats) -> str:
    lines = [
        f"{'tier':<6}{'hits':>10}{'misses':>10}{'blocks':>9}{'used':>12}{'capacity':>12}"
        f"{'evicted':>9}{'removed':>9}{'corrupt':>9}{'declined':>9}{'load ms':>9}{'read GB/s':>11}{'write GB/s':>11}"
    ]
    for tier, t in stats.tiers.items():
        rd = t.bytes_read / t.read_seconds / 1e9 if t.read_seconds else 0.0
        wr = t.bytes_written / t.write_seconds / 1e9 if t.write_seconds else 0.0
        # Mean time a read of this tier took per block it served (loads read a request's blocks together).
        load_ms = 1e3 * t.read_seconds / t.hits if t.hits else 0.0
        lines.append(
            f"{tier.value:<6}{t.hits:>10}{t.misses:>10}{t.blocks:>9}{format_size(t.bytes_used):>12}"
            f"{format_size(t.capacity_bytes):>12}{t.evictions:>9}{t.removed:>9}{t.corrupt_dropped:>9}{t.declined:>9}"
            f"{load_ms:>9.3f}{rd:>11.2f}{wr:>11.2f}"
        )
    lines.append(
        f"lookups {stats.lookups}: {stats.lookup_hit_blocks}/{stats.lookup_blocks} blocks hit; "
        f"corrupt dropped {stats.corrupt_dropped}; pending {stats.pending_blocks} "
        f"({format_size(stats.transit_bytes)}, at most {format_size(stats.transit_bytes_peak)}); "
        f"bad frames {stats.bad_frames}; refused {stats.refused_requests}; "
        f"loads into / dumps from shared memory {stats.shared_memory_loads} / {stats.shared_memory_dumps}"
    )
    return "\n".join(lines)
