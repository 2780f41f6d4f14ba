"""`up --ray --engine vllm`: the vLLM instances and the router in front of them as Ray actors (the store is the same
StoreActor as for our nodes). Plain classes: controller.py makes them Ray actors.

VllmActor runs one `vllm serve` (UCMConnector as kv_producer or kv_consumer on the deployment's store, the command
line `up --engine vllm` uses: launch/vllm_command.py's `pd_instance`) as its child, on a free port of its host, and
restarts it in place on that port when it exits (as StoreActor does its daemon): the router was given its URL, and
takes it back when its /health answers again. So its actor is never restarted by Ray (a new actor would pick another
port). VllmRouterActor runs the router fronting the instances (router/vllm_app.py) in its own process; `nodes()`
shows each instance the router finds alive as a node, which is what the controller waits for and `status` prints.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from launch.child import Child
from launch.ray.actors import _host, _placement
from launch.ray.app_thread import AppThread
from launch.ray.keys import KeyFiles
from launch.ray.spec import NodeKind
from launch.ray.status import NodeView, Placement
from launch.supervisor import RestartPolicy, Supervisor
from launch.vllm_command import PdSettings, core_slice, default_vllm_venv, pd_instance
from protocol import messages as P

_ROLES = {NodeKind.PREFILL: P.NodeRole.PREFILL, NodeKind.DECODE: P.NodeRole.DECODE}


@dataclass(frozen=True)
class VllmLaunch:
    kind: NodeKind  # PREFILL or DECODE
    index: int
    position: int  # its place among the deployment's instances: its slice of its host's cores
    host: str | None
    store_addr: str
    model: str  # a spec, resolved to a folder on the actor's host
    settings: PdSettings
    cpus: int  # cores it reserves (the deployment's node_cpus)
    keys: KeyFiles | None  # its store client pair; None: --insecure

    @property
    def node_id(self) -> str:
        return self.kind.node_id(self.index)


class VllmActor:
    def __init__(self, launch: VllmLaunch) -> None:
        from launch.model_prep import model_folder
        from launch.ports import free_port

        self.launch = launch
        self._keys = launch.keys.write() if launch.keys is not None else None
        store = launch.store_addr
        if self._keys is not None:
            store += f"?curve_keys={self._keys}&curve_client={launch.node_id}"
        cores = os.cpu_count() or 1
        command = pd_instance(
            launch.settings,
            launch.kind.value,
            default_vllm_venv(),
            Path(model_folder(launch.model)),
            free_port(),
            store,
            core_slice(launch.position, max(1, cores // launch.cpus), cores),
            host=_host(launch.host),
        )
        self._url = command.url
        self._argv, self._env = command.argv(), command.env()
        self._lock = threading.Lock()
        self.child = Child(launch.node_id, self._argv, sys.stdout, env=self._env, group=True)
        self._supervisor = Supervisor(lambda: {launch.node_id: self.child}, self._respawn, RestartPolicy(), print)
        self._supervisor.start()

    def _respawn(self, name: str, dead: Child) -> None:
        with self._lock:
            self.child = Child(name, self._argv, sys.stdout, env=self._env, group=True)

    def url(self) -> str:
        return self._url

    def info(self) -> Placement:
        return _placement(self.child)

    def stop(self) -> None:
        self._supervisor.stop()
        self.child.stop()
        if self._keys is not None:
            shutil.rmtree(self._keys, ignore_errors=True)


@dataclass(frozen=True)
class VllmRouterLaunch:
    host: str | None
    port: int
    model: str
    api_key: str | None
    max_num_seqs: int
    instances: tuple[tuple[str, NodeKind, str], ...]  # (node id, kind, URL)


class VllmRouterActor:
    """The router fronting the instances, in this actor's process: uvicorn on its own thread and event loop."""

    def __init__(self, launch: VllmRouterLaunch, startup_timeout_s: float = 120.0) -> None:
        from engine.tokenizer import Tokenizer
        from launch.model_prep import model_folder
        from router.config import RouterConfig
        from router.vllm_app import create_vllm_app

        host = _host(launch.host)
        urls = {kind: tuple(url for _, k, url in launch.instances if k is kind) for kind in _ROLES}
        config = RouterConfig(
            host=host,
            port=launch.port,
            model=launch.model,
            api_key=launch.api_key,
            vllm_prefill=urls[NodeKind.PREFILL],
            vllm_decode=urls[NodeKind.DECODE],
            vllm_max_num_seqs=launch.max_num_seqs,
        )
        self._names = {url: (name, _ROLES[kind]) for name, kind, url in launch.instances}
        self.app = create_vllm_app(config, Tokenizer(model_folder(launch.model)))
        self._serving = AppThread(self.app, config.host, config.port, startup_timeout_s)
        self.url = self._serving.url

    def addresses(self) -> tuple[str, str]:
        """(HTTP URL, "": no node socket in front of vLLM)."""
        return self.url, ""

    def info(self) -> Placement:
        return _placement(None)

    def nodes(self) -> list[NodeView]:
        """The instances the router's probes find alive, as nodes (a snapshot: the pool's fields are plain ints)."""
        views = []
        for b in self.app.state.pool.backends:
            name, role = self._names[b.url]
            if b.alive:
                views.append(
                    NodeView(name, role, b.url, b.running, b.waiting, b.load, b.in_flight, b.free_blocks, False)
                )
        return views

    def drain(self, node_id: str) -> NodeView | None:
        raise ValueError("draining a vLLM instance is not supported (the router's instances are fixed at start)")

    def stop(self) -> None:
        self._serving.stop()
