"""A whole deployment on this machine as child processes: store daemon, prefill and decode nodes, router.

Used by `ucm-serve up`, by the serving tests and by benchmarks/serve.py, so all three start the same thing.
Torch-free: the model is converted once by a child process before any node starts (so nodes don't race).

Secure by default: CURVE keys for every link are generated into a private temporary folder (mode 0700) — the
router's and the store's server pairs and one client pair per node, named for the node id (common/auth.py). Ports
are picked once (store, router HTTP and node socket), and a `Supervisor` restarts any child that exits on the
same address, so nodes find a restarted store or router and a restarted node registers again.
"""

from __future__ import annotations

import enum
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import TextIO

import httpx

from common.auth import KeyPaths, generate_keys
from common.kv_events import endpoints
from common.kv_events.config import KVEventsConfig
from common.save_policy import KVSavePolicy
from launch.child import Child
from launch.model_prep import model_folder
from launch.ports import free_port
from launch.supervisor import RestartPolicy, Supervisor
from protocol import defaults
from ucm.store_config import DiskWrites


class StoreMode(enum.Enum):
    DAEMON = "daemon"  # one `ucm-serve store` process shared by every node
    NONE = "none"  # no connector: decode nodes recompute the prompt


@dataclass(frozen=True)
class ClusterSpec:
    model: str = defaults.MODEL  # alias, HF folder or .gguf: resolved to a folder once, before anything starts
    served_model_name: str | None = None  # the name clients send; default: `model` as given
    max_model_len: int | None = None  # None: the model's (bounded by each node's KV cache)
    enable_prefix_caching: bool = True  # the nodes' device prefix cache
    kv_save_policy: KVSavePolicy | None = None  # None: `Cluster.save_policy` picks by the topology
    prefill: int = 1
    decode: int = 1
    colocated: int = 0  # nodes running prefill and decode in one engine
    store: StoreMode = StoreMode.DAEMON
    host: str = defaults.HTTP_HOST  # the router's HTTP address
    port: int = 0  # 0: a free port
    api_key: str | None = None
    dram: str = defaults.STORE_DRAM
    disk: str = defaults.STORE_DISK
    disk_path: str | None = None  # None: a temporary folder, removed on stop
    # None: BEHIND on a `disk_path` (it outlives the cluster), REUSED on the temporary folder (see start_store).
    disk_writes: DiskWrites | None = None
    dtype: str = "auto"
    device: str | None = None
    kv_cache_memory: str = defaults.NODE_KV_CACHE_MEMORY
    max_num_seqs: int = defaults.MAX_NUM_SEQS
    max_num_batched_tokens: int | None = defaults.MAX_NUM_BATCHED_TOKENS  # None: each engine picks it
    node_timeout_s: float = 3.0
    heartbeat_interval_s: float = 0.5
    router_args: tuple[str, ...] = ()
    node_args: tuple[str, ...] = field(default=())
    node_env: dict[str, dict[str, str]] = field(default_factory=dict)  # extra environment by node name (test hooks)
    secure: bool = True  # False: every child runs with --insecure (no CURVE)
    # vLLM's --kv-events-config for every node; the i-th node (node_names() order) gets both ports offset by i
    kv_events: KVEventsConfig | None = None
    extra_keys: tuple[str, ...] = ()  # more authorized node names (nodes started by hand, tests)
    # The store daemon's niceness (all its threads, set before exec). Its work is mostly background (every saved
    # block copied in and written behind to LMDB); at the default priority it preempts the engines' OpenMP threads
    # and each parallel region then waits for its preempted thread. benchmarks/served_overhead.py on 2 cores (one
    # run each, noisy): served/offline 1.26 and 1.22 at 0, 1.09 at 10, 1.21 at 19 (I/O threads starved too).
    # Loads are not starved by it: an engine waiting on a load leaves its cores idle.
    store_nice: int = 10
    supervise: bool = True  # restart children that exit (False: fault tests that want a node to stay dead)
    restart: RestartPolicy = field(default_factory=RestartPolicy)

    def __post_init__(self) -> None:
        if min(self.prefill, self.decode, self.colocated) < 0:
            raise ValueError("node counts must be >= 0")
        if self.decode + self.colocated == 0:
            raise ValueError("a cluster needs at least one decode (or colocated) node")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def node_names(self) -> list[str]:
        return (
            [f"prefill-{i}" for i in range(self.prefill)]
            + [f"decode-{i}" for i in range(self.decode)]
            + [f"colocated-{i}" for i in range(self.colocated)]
        )


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "launch.cli", *args]


class Cluster:
    def __init__(self, spec: ClusterSpec, sink: TextIO | None = None, log=print) -> None:
        self.spec = spec
        self.sink = sink
        self.log = log
        self.children: dict[str, Child] = {}
        self._lock = threading.Lock()  # children: the supervisor thread replaces entries
        # Fixed for the cluster's life, so a restarted store or router is found where its clients look.
        self.port = spec.port or free_port()
        # Where we (and the user) reach the router: a wildcard bind is reached on loopback.
        reach = "127.0.0.1" if spec.host in ("0.0.0.0", "::", "") else spec.host
        self.url = f"http://{reach}:{self.port}"
        self.model_dir: str | None = None  # the model folder, once `start` has prepared it
        self.nodes_addr = f"tcp://127.0.0.1:{free_port()}"
        self.store_addr: str | None = f"tcp://127.0.0.1:{free_port()}" if spec.store is StoreMode.DAEMON else None
        self.store_events_addr: str | None = None  # the router's --store-kv-events, once the store publishes
        self._tmp: str | None = None
        self.keys: KeyPaths | None = None
        self.supervisor: Supervisor | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 300.0) -> Cluster:
        try:
            self._prepare_model()
            if self.spec.secure:
                self._make_keys()
            if self.spec.store is StoreMode.DAEMON:
                self.start_store()
            self._start_router()
            for i in range(self.spec.prefill):
                self.start_node("prefill", i)
            for i in range(self.spec.decode):
                self.start_node("decode", i)
            if self.spec.colocated and self.store_addr is not None:
                policy, why = self.save_policy()
                self.log(f"[up] colocated nodes save KV blocks to the store: --kv-save-policy {policy.value} ({why})")
            for i in range(self.spec.colocated):
                self.start_node("colocated", i)
            self.wait_healthy(timeout)
            if self.spec.supervise:
                self.supervisor = Supervisor(self._snapshot, self._restart, self.spec.restart, self.log)
                self.supervisor.start()
        except BaseException:
            self.stop()
            raise
        return self

    def _make_keys(self) -> None:
        # mkdtemp makes the folder 0700; generate_keys makes the secret files 0600.
        folder = tempfile.mkdtemp(prefix="ucm-keys-")
        self.keys = generate_keys(folder, tuple(self.spec.node_names()) + self.spec.extra_keys)
        self.log(f"[up] CURVE keys for router, store and {len(self.spec.node_names())} node(s) in {folder}")

    def _auth_args(self) -> list[str]:
        return ["--curve-keys", str(self.keys.dir)] if self.keys is not None else ["--insecure"]

    def _snapshot(self) -> dict[str, Child]:
        with self._lock:
            return dict(self.children)

    def _restart(self, name: str, dead: Child) -> None:
        with self._lock:
            if self.children.get(name) is not dead:
                return  # replaced meanwhile (start_node) or stopped
            self.children[name] = dead.respawn()

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _prepare_model(self) -> None:
        """BadModel (one line) when the spec names no usable model; a first start converts, with progress."""
        self.log(f"[up] preparing model {self.spec.model} (converted once, then cached)")
        self.model_dir = str(model_folder(self.spec.model))
        self.log(f"[up] model folder: {self.model_dir}")

    def start_store(self) -> None:
        path, writes = self.spec.disk_path, DiskWrites.BEHIND
        if path is None:
            self._tmp = self._tmp or tempfile.mkdtemp(prefix="ucm-store-")
            # Removed at stop, so its disk tier only extends DRAM: written when DRAM evicts, and only while evicted
            # blocks come back. (On a 2-core EPYC writing every block behind cost ~10% of served throughput, and
            # every block DRAM evicts, in a workload of new prompts, ~10% more: docs/history/benchmarks.json, "Earlier:
            # the disk tier of `up` as a victim tier" and "Saves only while evicted blocks come back".)
            path, writes = self._tmp, DiskWrites.REUSED
        writes = self.spec.disk_writes or writes
        assert self.store_addr is not None, "start_store needs StoreMode.DAEMON"
        events = self.store_kv_events()
        events_args = ["--kv-events-config", events.to_json()] if events is not None else []
        store = self._spawn(
            "store",
            _cmd(
                "store",
                "--bind",
                self.store_addr,
                "--dram",
                self.spec.dram,
                "--disk-path",
                path,
                "--disk",
                self.spec.disk,
                "--disk-writes",
                writes.value,
                *events_args,
                *self._auth_args(),
            ),
            nice=self.spec.store_nice,
        )
        ready = store.wait_for(r"ucm-store ready (\S+)", 60).group(1)
        assert ready == self.store_addr, f"store bound {ready}, asked for {self.store_addr}"
        if events is not None:
            bound = store.wait_for(endpoints.BOUND_PATTERN, 60)
            self.store_events_addr = endpoints.subscription(bound, self.nodes_addr)
        self.log(f"[up] store ready at {self.store_addr}")

    def store_kv_events(self) -> KVEventsConfig | None:
        """The store daemon's `--kv-events-config` when the nodes publish KV events: the same config at the offset
        after the last node's, so the router indexes what the store's DRAM and disk hold too (cost pairing prices
        those blocks as loads)."""
        events = self.spec.kv_events
        if events is None or not events.enabled or self.spec.store is not StoreMode.DAEMON:
            return None
        return events.for_node(len(self.spec.node_names()))

    def _start_router(self) -> None:
        args = [
            "router",
            "--host",
            self.spec.host,
            "--port",
            str(self.port),
            "--bind-nodes",
            self.nodes_addr,
            "--model",
            str(self.model_dir),  # the router takes a folder (its tokenizer), never a spec
            "--served-model-name",
            self.spec.model_name,
            "--node-timeout",
            str(self.spec.node_timeout_s),
            *self._auth_args(),
            *self.spec.router_args,
        ]
        if self.spec.api_key:
            args += ["--api-key", self.spec.api_key]
        if self.spec.max_model_len is not None:
            args += ["--max-model-len", str(self.spec.max_model_len)]
        if self.store_events_addr is not None:
            args += ["--store-kv-events", self.store_events_addr]
        self._spawn("router", _cmd(*args)).wait_for(r"nodes connect to", 120)
        self.log(f"[up] router listening for nodes at {self.nodes_addr}")

    def start_node(self, kind: str, index: int) -> Child:
        """Start (or restart) node `<kind>-<index>`; kind is prefill, decode or colocated."""
        name = f"{kind}-{index}"
        with self._lock:
            old = self.children.pop(name, None)
        if old is not None:
            old.stop()
        sub = "prefill" if kind == "prefill" else "decode"
        store = self.store_addr or "none"
        if self.keys is not None:
            if not (self.keys.authorized / f"{name}.key").is_file():
                raise ValueError(
                    f"no key for node {name!r}: the cluster's keys name {self.spec.node_names()} and "
                    f"extra_keys {list(self.spec.extra_keys)}"
                )
            if self.store_addr is not None:
                store = f"{self.store_addr}?curve_keys={self.keys.dir}&curve_client={name}"
        args = [
            sub,
            "--router",
            self.nodes_addr,
            "--store",
            store,
            "--model",
            self.spec.model,
            "--served-model-name",
            self.spec.model_name,
            *self._auth_args(),
            "--node-id",
            name,
            "--dtype",
            self.spec.dtype,
            "--kv-cache-memory",
            self.spec.kv_cache_memory,
            "--max-num-seqs",
            str(self.spec.max_num_seqs),
            "--heartbeat-interval",
            str(self.spec.heartbeat_interval_s),
            *self.spec.node_args,
        ]
        if self.spec.device:
            args += ["--device", self.spec.device]
        if self.spec.max_model_len is not None:
            args += ["--max-model-len", str(self.spec.max_model_len)]
        if self.spec.max_num_batched_tokens is not None:
            args += ["--max-num-batched-tokens", str(self.spec.max_num_batched_tokens)]
        if not self.spec.enable_prefix_caching:
            args.append("--no-enable-prefix-caching")
        if "--threads" not in self.spec.node_args:
            # Several CPU engines on one box: oversubscribed OpenMP threads spin against each other and every
            # step gets many times slower, so split the cores between the nodes. Even with the nodes' short spin
            # (node/openmp_env.py), 1 prefill + 1 decode with 2 threads each on a 2-core Zen 5 served vLLM's random
            # burst at 64 against 145-164 tok/s and prefix_repetition at 8.2-8.4 against 4.3-4.7 s mean TTFT; only a
            # lone cold prompt gained (1.0-1.2 against 1.5-1.6 s). docs/history/benchmarks.json, "Before it: the
            # peers' own script, and `up` with and without its store" (2026-12-02).
            nodes = max(1, self.spec.prefill + self.spec.decode + self.spec.colocated)
            args += ["--threads", str(max(1, (os.cpu_count() or 1) // nodes))]
        if self.spec.kv_events is not None:
            nth = self.spec.node_names().index(name)
            args += ["--kv-events-config", self.spec.kv_events.for_node(nth).to_json()]
        if kind == "colocated":
            args.append("--colocated")
        if kind == "colocated" and self.store_addr is not None:  # prefill nodes always save as they compute
            args += ["--kv-save-policy", self.save_policy()[0].value]
        return self._spawn(name, _cmd(*args), self.spec.node_env.get(name))

    def save_policy(self) -> tuple[KVSavePolicy, str]:
        """When a colocated node saves its blocks to the store, and why."""
        spec = self.spec
        if spec.kv_save_policy is not None:
            return spec.kv_save_policy, "asked for"
        if spec.colocated == 1 and spec.prefill == spec.decode == 0 and spec.enable_prefix_caching:
            # Nobody else reads the store while its device cache holds a block. Saving every block as computed
            # cost ~10% of served random throughput and ~0.3-0.4 s of prefix_repetition TTFT on a 2-core EPYC
            # (`up --no-store` against `up`: docs/history/benchmarks.json, "AVX-512 BF16 host" and "Later the same
            # day: where the served system loses to itself"), and saving every evicted block, where none comes back,
            # ~10% more once the device cache is full ("Saves only while evicted blocks come back"): REUSED saves
            # them only while they come back.
            return KVSavePolicy.REUSED, "one engine: its device cache serves what it holds, the store the rest"
        return KVSavePolicy.COMPUTED, "several engines share the store"

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None, nice: int = 0) -> Child:
        child = Child(name, argv, sink=self.sink, env=env, nice=nice)
        with self._lock:
            self.children[name] = child
        return child

    def node_names(self) -> list[str]:
        return [n for n in self._snapshot() if n not in ("store", "router")]

    def halt_supervision(self) -> None:
        """Stop restarting children (a shutdown is starting); safe in a signal handler."""
        if self.supervisor is not None:
            self.supervisor.halt()

    def given_up(self) -> set[str]:
        """Children the supervisor stopped restarting (they kept failing right after starting)."""
        return self.supervisor.given_up() if self.supervisor is not None else set()

    # What wait_healthy waits for: the children that must be ready, how one is known ready, the words its
    # progress lines use, and how often it asks the router. A subclass fronting other servers redefines them.
    READY_WORDS = "nodes registered"
    READY_POLL_S = 0.2

    def expected_ready(self) -> set[str]:
        return set(self.node_names())

    def ready(self) -> set[str]:
        """Children the router knows as ready now: for our nodes, those registered."""
        try:
            return set(httpx.get(f"{self.url}/health", timeout=2).json().get("nodes", {}))
        except (httpx.HTTPError, ValueError):
            return set()

    def wait_healthy(self, timeout: float, expect: set[str] | None = None) -> None:
        """Until every node child (or `expect`) is ready (`ready`); a child that exits fails it; prints progress."""
        want = expect if expect is not None else self.expected_ready()
        deadline = time.monotonic() + timeout
        last = None
        while True:
            supervised = self.supervisor is not None and self.supervisor.is_alive()
            for name, child in self._snapshot().items():
                if supervised and name not in self.given_up():
                    continue  # a dead child is being restarted
                if not child.alive and (name in want or name in ("store", "router")):
                    raise RuntimeError(f"{name} exited ({child.proc.returncode}):\n{child.output()[-3000:]}")
            up = self.ready() & want
            if up == want:
                self.log(f"[up] all {len(want)} {self.READY_WORDS}")
                return
            status = f"{len(up)}/{len(want)} {self.READY_WORDS}"
            if status != last:
                self.log(f"[up] waiting: {status}")
                last = status
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster not healthy within {timeout:.0f}s ({status})")
            time.sleep(self.READY_POLL_S)

    def stop(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()  # before any child stops: a stopped child must stay stopped
            self.supervisor = None
        # Router first (no new work), then nodes, then the store they write to.
        order = ["router", *self.node_names(), "store"]
        children = self._snapshot()
        for name in order:
            child = children.get(name)
            if child is not None:
                child.stop()
        with self._lock:
            self.children.clear()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        if self.keys is not None:
            shutil.rmtree(self.keys.dir, ignore_errors=True)
            self.keys = None
