"""A whole deployment on this machine as child processes: store daemon, prefill and decode nodes, router.

Used by `ucm-serve up`, by the serving tests and by benchmarks/serve.py, so all three start the same thing.
Torch-free: the model is converted once by a child process before any node starts (so nodes don't race).
"""

from __future__ import annotations

import enum
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import TextIO

import httpx

from router.child import Child


class StoreMode(enum.Enum):
    DAEMON = "daemon"  # one `ucm-serve store` process shared by every node
    NONE = "none"  # no connector: decode nodes recompute the prompt


@dataclass(frozen=True)
class ClusterSpec:
    model: str = "smollm2-135m"
    prefill: int = 1
    decode: int = 1
    colocated: int = 0  # nodes running prefill and decode in one engine
    store: StoreMode = StoreMode.DAEMON
    port: int = 0  # 0: a free port
    api_key: str | None = None
    dram: str = "2GiB"
    disk: str = "4GiB"
    disk_path: str | None = None  # None: a temporary folder, removed on stop
    dtype: str = "auto"
    device: str | None = None
    kv_cache_memory: str = "512MiB"
    max_num_seqs: int = 64
    node_timeout_s: float = 3.0
    heartbeat_interval_s: float = 0.5
    router_args: tuple[str, ...] = ()
    node_args: tuple[str, ...] = field(default=())
    node_env: dict[str, dict[str, str]] = field(default_factory=dict)  # extra environment by node name (test hooks)

    def __post_init__(self) -> None:
        if min(self.prefill, self.decode, self.colocated) < 0:
            raise ValueError("node counts must be >= 0")
        if self.decode + self.colocated == 0:
            raise ValueError("a cluster needs at least one decode (or colocated) node")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "engine.cli", *args]


class Cluster:
    def __init__(self, spec: ClusterSpec, sink: TextIO | None = None, log=print) -> None:
        self.spec = spec
        self.sink = sink
        self.log = log
        self.children: dict[str, Child] = {}
        self.port = spec.port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.nodes_addr = f"tcp://127.0.0.1:{free_port()}"
        self.store_addr: str | None = None
        self._tmp: str | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 300.0) -> Cluster:
        try:
            self._prepare_model()
            if self.spec.store is StoreMode.DAEMON:
                self.start_store()
            self._start_router()
            for i in range(self.spec.prefill):
                self.start_node("prefill", i)
            for i in range(self.spec.decode):
                self.start_node("decode", i)
            for i in range(self.spec.colocated):
                self.start_node("colocated", i)
            self.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _prepare_model(self) -> None:
        self.log(f"[up] preparing model {self.spec.model} (converted once, then cached)")
        code = "import sys; from engine.model_source import resolve_model_dir; print(resolve_model_dir(sys.argv[1]))"
        out = subprocess.run([sys.executable, "-c", code, self.spec.model], check=True, capture_output=True, text=True)
        self.log(f"[up] model folder: {out.stdout.strip()}")

    def start_store(self) -> None:
        path = self.spec.disk_path
        if path is None:
            self._tmp = self._tmp or tempfile.mkdtemp(prefix="ucm-store-")
            path = self._tmp
        store = self._spawn("store", _cmd("store", "--bind", "tcp://127.0.0.1:0", "--dram", self.spec.dram,
                                          "--disk-path", path, "--disk", self.spec.disk))
        self.store_addr = store.wait_for(r"ucm-store ready (\S+)", 60).group(1)
        self.log(f"[up] store ready at {self.store_addr}")

    def _start_router(self) -> None:
        args = ["router", "--host", "127.0.0.1", "--port", str(self.port), "--bind-nodes", self.nodes_addr,
                "--model", self.spec.model, "--node-timeout", str(self.spec.node_timeout_s), *self.spec.router_args]
        if self.spec.api_key:
            args += ["--api-key", self.spec.api_key]
        self._spawn("router", _cmd(*args)).wait_for(r"nodes connect to", 120)
        self.log(f"[up] router listening for nodes at {self.nodes_addr}")

    def start_node(self, kind: str, index: int) -> Child:
        """Start (or restart) node `<kind>-<index>`; kind is prefill, decode or colocated."""
        name = f"{kind}-{index}"
        old = self.children.pop(name, None)
        if old is not None:
            old.stop()
        sub = "prefill" if kind == "prefill" else "decode"
        args = [sub, "--router", self.nodes_addr, "--store", self.store_addr or "none", "--model", self.spec.model,
                "--node-id", name, "--dtype", self.spec.dtype, "--kv-cache-memory", self.spec.kv_cache_memory,
                "--max-num-seqs", str(self.spec.max_num_seqs),
                "--heartbeat-interval", str(self.spec.heartbeat_interval_s), *self.spec.node_args]
        if self.spec.device:
            args += ["--device", self.spec.device]
        if "--threads" not in self.spec.node_args:
            # Several CPU engines on one box: oversubscribed OpenMP threads spin against each other and every
            # step gets many times slower, so split the cores between the nodes.
            nodes = max(1, self.spec.prefill + self.spec.decode + self.spec.colocated)
            args += ["--threads", str(max(1, (os.cpu_count() or 1) // nodes))]
        if kind == "colocated":
            args.append("--colocated")
        return self._spawn(name, _cmd(*args), self.spec.node_env.get(name))

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
        child = Child(name, argv, sink=self.sink, env=env)
        self.children[name] = child
        return child

    def node_names(self) -> list[str]:
        return [n for n in self.children if n not in ("store", "router")]

    def wait_healthy(self, timeout: float, expect: set[str] | None = None) -> None:
        """Until every node child (or `expect`) is registered with the router; prints progress."""
        want = expect if expect is not None else set(self.node_names())
        deadline = time.monotonic() + timeout
        last = None
        while True:
            for name, child in self.children.items():
                if not child.alive and (name in want or name in ("store", "router")):
                    raise RuntimeError(f"{name} exited ({child.proc.returncode}):\n{child.output()[-3000:]}")
            try:
                nodes = set(httpx.get(f"{self.url}/health", timeout=2).json().get("nodes", {}))
            except (httpx.HTTPError, ValueError):
                nodes = set()
            if want <= nodes:
                self.log(f"[up] all {len(want)} nodes registered")
                return
            status = f"{len(want & nodes)}/{len(want)} nodes registered"
            if status != last:
                self.log(f"[up] waiting: {status}")
                last = status
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster not healthy within {timeout:.0f}s ({status})")
            time.sleep(0.2)

    def stop(self) -> None:
        # Router first (no new work), then nodes, then the store they write to.
        order = ["router", *self.node_names(), "store"]
        for name in order:
            child = self.children.get(name)
            if child is not None:
                child.stop()
        self.children.clear()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
