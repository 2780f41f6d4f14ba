"""The deployment's Ray actors. Plain classes: controller.py makes them Ray actors with their placement options.

NodeActor and StoreActor each run our own process entry point (`ucm-serve prefill|decode|store`, the very command
`ucm-serve up` starts) as a child (launch/child.py), so a node on Ray is the node `up` runs; the actor is its
handle: where it runs, and its life. The child gets SIGTERM when the actor's process dies (PR_SET_PDEATHSIG), and a
node whose child exits ends its actor's process, so Ray restarts the actor (`max_restarts`) and with it the node,
which registers with the router again as a new incarnation. The store's child is restarted in place on the same
address instead (launch/supervisor.py, as `up` does): nodes keep the address they were given.

RouterActor runs the router in its own process (create_app + uvicorn on a thread): the controller drains a node
through it (router/drain.py on the router's event loop) and reads each node's load, over Ray's control plane, so
there is no admin route on the public HTTP port.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.kv_events.config import KVEventsConfig
from common.save_policy import KVSavePolicy
from launch.child import Child
from launch.ray.app_thread import AppThread
from launch.ray.keys import KeyFiles
from launch.ray.spec import STATUS_CLIENT, NodeKind
from launch.ray.status import NodeView, Placement
from launch.supervisor import RestartPolicy, Supervisor
from ucm.store_config import DiskWrites

_STORE_READY = r"ucm-store ready (\S+)"


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "launch.cli", *args]


def _placement(child: Child | None) -> Placement:
    import ray

    ctx = ray.get_runtime_context()
    with warnings.catch_warnings():  # Ray 2.60 warns from inside its own property (it reads a deprecated field)
        warnings.simplefilter("ignore", DeprecationWarning)
        restarted = ctx.was_current_actor_reconstructed
    return Placement(
        ray_node_id=ctx.get_node_id(),
        ip=ray.util.get_node_ip_address(),
        actor_pid=os.getpid(),
        child_pid=child.proc.pid if child is not None and child.alive else None,
        restarted=restarted,
    )


@dataclass(frozen=True)
class NodeLaunch:
    kind: NodeKind
    index: int
    router_addr: str
    store_addr: str | None
    model: str
    dtype: str
    device: str | None
    kv_cache_memory: str
    max_num_seqs: int
    max_num_batched_tokens: int | None
    kv_save_policy: KVSavePolicy | None  # given to a colocated node with a store; None: its default (as computed)
    heartbeat_interval_s: float
    threads: int
    keys: KeyFiles | None  # None: --insecure
    env: dict[str, str] = field(default_factory=dict)
    kv_events: KVEventsConfig | None = None  # this node's (DeploymentSpec.kv_events_for)

    @property
    def node_id(self) -> str:
        return self.kind.node_id(self.index)

    def argv(self, keys_dir: Path | None) -> list[str]:
        auth = ["--curve-keys", str(keys_dir)] if keys_dir is not None else ["--insecure"]
        args = [self.kind.command, "--router", self.router_addr, "--store", self.store_addr or "none"]
        args += ["--model", self.model, *auth, "--node-id", self.node_id, "--dtype", self.dtype]
        args += ["--kv-cache-memory", self.kv_cache_memory, "--max-num-seqs", str(self.max_num_seqs)]
        if self.max_num_batched_tokens is not None:
            args += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        args += ["--heartbeat-interval", str(self.heartbeat_interval_s), "--threads", str(self.threads)]
        if self.device:
            args += ["--device", self.device]
        if self.kind is NodeKind.COLOCATED:
            args.append("--colocated")
            if self.store_addr is not None and self.kv_save_policy is not None:
                args += ["--kv-save-policy", self.kv_save_policy.value]
        if self.kv_events is not None:
            args += ["--kv-events-config", self.kv_events.to_json()]
        return _cmd(*args)


class NodeActor:
    """One serving node. Its process dying ends this actor's process too: Ray then restarts both."""

    def __init__(self, launch: NodeLaunch) -> None:
        self.launch = launch
        self._keys = launch.keys.write() if launch.keys is not None else None
        self._stopping = threading.Event()
        # Spawned on the actor's main thread: PR_SET_PDEATHSIG follows the spawning thread, which lives as long as
        # the actor's process.
        self.child = Child(launch.node_id, launch.argv(self._keys), sink=sys.stdout, env=launch.env)
        threading.Thread(target=self._watch, name="ucm-node-watch", daemon=True).start()

    def _watch(self) -> None:
        code = self.child.proc.wait()
        if self._stopping.is_set():
            return
        print(f"[{self.launch.node_id}] exited ({code}): ending the actor so Ray restarts it", flush=True)
        self._cleanup()
        os._exit(1)  # not a clean actor exit: Ray counts it against max_restarts and restarts the actor

    def info(self) -> Placement:
        return _placement(self.child)

    def stop(self) -> None:
        """Stop the node (SIGTERM, then SIGKILL after 10 s); the controller then kills the actor for good."""
        self._stopping.set()
        self.child.stop()
        self._cleanup()

    def _cleanup(self) -> None:
        if self._keys is not None:
            shutil.rmtree(self._keys, ignore_errors=True)


def _host(host: str | None) -> str:
    """The address to bind: the deployment's, else this actor's node IP (several machines)."""
    import ray

    return host or ray.util.get_node_ip_address()


@dataclass(frozen=True)
class StoreLaunch:
    host: str | None
    dram: str
    disk: str
    disk_path: str | None
    disk_writes: DiskWrites | None
    nice: int
    keys: KeyFiles | None
    kv_events: KVEventsConfig | None = None  # its tiers' (DeploymentSpec.store_kv_events)


class StoreActor:
    """The store daemon. Bound once on a free port; a daemon that exits is restarted on that same address."""

    def __init__(self, launch: StoreLaunch, startup_timeout_s: float = 60.0) -> None:
        self._keys = launch.keys.write() if launch.keys is not None else None
        self._tmp = None if launch.disk_path else tempfile.mkdtemp(prefix="ucm-store-")
        self._lock = threading.Lock()
        auth = ["--curve-keys", str(self._keys)] if self._keys is not None else ["--insecure"]
        path = launch.disk_path or self._tmp
        args = ["--dram", launch.dram, "--disk-path", str(path), "--disk", launch.disk, *auth]
        if launch.disk_writes is not None:
            args += ["--disk-writes", launch.disk_writes.value]
        if launch.kv_events is not None:
            args += ["--kv-events-config", launch.kv_events.to_json()]
        self._nice = launch.nice
        host = _host(launch.host)
        first = Child("store", _cmd("store", "--bind", f"tcp://{host}:0", *args), sys.stdout, nice=self._nice)
        self._address = first.wait_for(_STORE_READY, startup_timeout_s).group(1)
        self._events: str | None = None  # where the router subscribes: ENDPOINT[,REPLAY] (`--store-kv-events`)
        if launch.kv_events is not None:
            from common.kv_events import endpoints

            self._events = endpoints.subscription(
                first.wait_for(endpoints.BOUND_PATTERN, startup_timeout_s), self._address
            )
        # Restarts bind the address the first one got: every node was given it.
        self._argv = _cmd("store", "--bind", self._address, *args)
        self.child = first
        self._supervisor = Supervisor(lambda: {"store": self.child}, self._respawn, RestartPolicy(), print)
        self._supervisor.start()

    def _respawn(self, name: str, dead: Child) -> None:
        with self._lock:
            self.child = Child(name, self._argv, sys.stdout, nice=self._nice)

    def address(self) -> str:
        return self._address

    def events_address(self) -> str | None:
        return self._events

    def info(self) -> Placement:
        return _placement(self.child)

    def stats(self) -> dict[str, Any]:
        """The daemon's live counters (what `ucm-serve store-stats --json` prints), read with the status key."""
        import msgspec

        from common.auth import ClientAuth
        from ucm.client import StoreClient

        auth = ClientAuth.from_dir(self._keys, STATUS_CLIENT) if self._keys is not None else None
        with StoreClient(self._address, timeout_s=3.0, retry_after_s=0.0, auth=auth) as client:
            return msgspec.to_builtins(client.stats())

    def stop(self) -> None:
        self._supervisor.stop()
        self.child.stop()
        for folder in (self._keys, self._tmp):
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)


@dataclass(frozen=True)
class RouterLaunch:
    host: str | None
    port: int
    model: str
    api_key: str | None
    node_timeout_s: float
    keys: KeyFiles | None
    store_kv_events: str | None = None  # the store's tiers' events, ENDPOINT[,REPLAY] (StoreActor.events_address)


class RouterActor:
    """The OpenAI router, in this actor's process: uvicorn serves on its own thread and event loop."""

    def __init__(self, launch: RouterLaunch, startup_timeout_s: float = 120.0) -> None:
        from common.auth import KeyPaths
        from engine.tokenizer import Tokenizer
        from launch.model_prep import model_folder
        from router.app import create_app
        from router.cli import store_events_endpoint
        from router.config import RouterConfig

        self._keys = launch.keys.write() if launch.keys is not None else None
        host = _host(launch.host)
        config = RouterConfig(
            bind_nodes=f"tcp://{host}:0",
            host=host,
            port=launch.port,
            model=launch.model,
            api_key=launch.api_key,
            node_timeout_s=launch.node_timeout_s,
            node_auth=KeyPaths.of(self._keys).router_auth() if self._keys is not None else None,
            store_events=store_events_endpoint(launch.store_kv_events),
        )
        self.app = create_app(config, Tokenizer(model_folder(config.model)))
        self._serving = AppThread(self.app, config.host, config.port, startup_timeout_s)
        self.url = self._serving.url
        self.nodes_address: str = self.app.state.nodes_address

    def addresses(self) -> tuple[str, str]:
        """(HTTP URL, nodes' ZeroMQ address)."""
        return self.url, self.nodes_address

    def info(self) -> Placement:
        return _placement(None)

    def nodes(self) -> list[NodeView]:
        from router.drain import node_views

        return self._serving.on_loop(lambda: node_views(self.app.state.registry))

    def drain(self, node_id: str) -> NodeView | None:
        """Stop sending `node_id` new jobs; its view (None if it is not registered)."""
        from router.drain import drain

        return self._serving.on_loop(lambda: drain(self.app.state.registry, node_id))

    def stop(self) -> None:
        self._serving.stop()
        if self._keys is not None:
            shutil.rmtree(self._keys, ignore_errors=True)
