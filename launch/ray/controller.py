"""The deployment's controller: a named Ray actor (namespace `ucm-serve`) holding the spec, the key material and the
handles of the store, router and node actors. `ucm-serve up --ray` creates it; `scale`, `status` and `down` find it
by name from any driver of the same Ray cluster.

With `engine=VLLM` the nodes are `vllm serve` instances and the router fronts them (launch/ray/vllm_actors.py): the
store comes first, then the instances (each picks its port), then the router with their URLs; scaling is refused.

It owns the other actors (they die with it). Deploying and scaling hold one lock; status reads run beside them
(a threaded actor). Every call to another actor has a timeout, so a dead or restarting actor is reported, never
waited on.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError

from launch.ray.actors import NodeActor, NodeLaunch, RouterActor, RouterLaunch, StoreActor, StoreLaunch
from launch.ray.keys import KeyBundle
from launch.ray.placement import alive_nodes, bind_host, node_options, router_options, store_options
from launch.ray.spec import ActorRole, DeploymentSpec, NodeKind, parse_kind
from launch.ray.status import ActorState, ActorStatus, DeploymentStatus, Placement
from launch.ray.vllm_actors import VllmActor, VllmLaunch, VllmRouterActor, VllmRouterLaunch
from launch.serving_engine import ServingEngine
from launch.vllm_command import PdSettings
from router.drain import NodeView

_CALL_S = 10.0  # a control call to a live actor answers well within this
_INFO_S = 3.0  # status: an actor that does not answer in this is shown unavailable
_POLL_S = 0.25


class Controller:
    def __init__(self, spec: DeploymentSpec, keys: KeyBundle | None) -> None:
        assert (keys is not None) == spec.secure, "a secure deployment needs keys, an insecure one none"
        self.spec = spec
        self.keys = keys
        self._lock = threading.RLock()
        self._closing = threading.Event()  # shutdown() stops a deploy or scale that is still waiting
        self.host: str | None = None
        self.store: Any = None
        self.store_address: str | None = None
        self.store_events: str | None = None  # the store's tiers' KV events, for the router
        self.router: Any = None
        self.url = ""
        self.nodes_address = ""
        self.nodes: dict[str, Any] = {}  # node id -> NodeActor handle
        self.notes: list[str] = []

    # ------------------------------------------------------------------ deploy

    def deploy(self, timeout_s: float) -> DeploymentStatus:
        with self._lock:
            assert self.router is None, "deploy() runs once"
            spec = self.spec
            nodes = alive_nodes()
            self.host = bind_host(spec, nodes)
            want = (spec.store_cpus if spec.store else 0.0) + spec.router_cpus
            want += spec.node_cpus * (spec.prefill + spec.decode + spec.colocated)
            _check_free_cpus(want, "the deployment")
            if spec.store:
                options, note = store_options(spec, nodes)
                if note:
                    self.notes.append(note)
                launch = StoreLaunch(
                    self.host,
                    spec.dram,
                    spec.disk,
                    spec.disk_path,
                    spec.disk_writes,
                    spec.store_nice,
                    self.keys.for_store() if self.keys else None,
                    spec.store_kv_events(),
                )
                self.store = ray.remote(StoreActor).options(**options).remote(launch)
                self.store_address = ray.get(self.store.address.remote(), timeout=timeout_s)
                self.store_events = ray.get(self.store.events_address.remote(), timeout=timeout_s)
            if spec.engine is ServingEngine.VLLM:
                self._deploy_vllm(timeout_s)
                return self.status()
            router = RouterLaunch(
                self.host,
                spec.port,
                spec.model,
                spec.api_key,
                spec.node_timeout_s,
                self.keys.for_router() if self.keys else None,
                self.store_events,
            )
            self.router = ray.remote(RouterActor).options(**router_options(spec)).remote(router)
            self.url, self.nodes_address = ray.get(self.router.addresses.remote(), timeout=timeout_s)
            names = [self._start_node(kind, i) for kind in NodeKind for i in range(spec.count(kind))]
            self._wait_registered(names, timeout_s)
        return self.status()

    def _deploy_vllm(self, timeout_s: float) -> None:
        """The vLLM instances (each picks its port), then the router with their URLs; returns once the router finds
        every instance alive (vLLM takes minutes to start on a small CPU host)."""
        spec = self.spec
        assert self.store_address is not None, "vLLM instances pass KV through the store"
        settings = PdSettings(
            spec.model, spec.dtype, spec.kv_cache_memory, spec.max_num_seqs, spec.max_num_batched_tokens
        )
        positions = {NodeKind.PREFILL: 0, NodeKind.DECODE: spec.prefill}
        options = {**node_options(spec), "max_restarts": 0}  # the actor restarts its vLLM in place, on its port
        for kind in (NodeKind.PREFILL, NodeKind.DECODE):
            for i in range(spec.count(kind)):
                node_id = kind.node_id(i)
                launch = VllmLaunch(
                    kind,
                    i,
                    positions[kind] + i,
                    self.host,
                    self.store_address,
                    spec.model,
                    settings,
                    spec.node_cpus,
                    self.keys.for_node(node_id) if self.keys else None,
                )
                self.nodes[node_id] = ray.remote(VllmActor).options(**options).remote(launch)
        urls = ray.get([h.url.remote() for h in self.nodes.values()], timeout=timeout_s)
        instances = tuple((name, parse_kind(name)[0], url) for name, url in zip(self.nodes, urls, strict=True))
        router = VllmRouterLaunch(self.host, spec.port, spec.model, spec.api_key, spec.max_num_seqs, instances)
        self.router = ray.remote(VllmRouterActor).options(**router_options(spec)).remote(router)
        self.url, self.nodes_address = ray.get(self.router.addresses.remote(), timeout=timeout_s)
        self._wait_registered(list(self.nodes), timeout_s)

    def _start_node(self, kind: NodeKind, index: int) -> str:
        spec = self.spec
        node_id = kind.node_id(index)
        assert node_id not in self.nodes, f"{node_id} already runs"
        launch = NodeLaunch(
            kind=kind,
            index=index,
            router_addr=self.nodes_address,
            store_addr=self.store_address,
            model=spec.model,
            dtype=spec.dtype,
            device=spec.device,
            kv_cache_memory=spec.kv_cache_memory,
            max_num_seqs=spec.max_num_seqs,
            max_num_batched_tokens=spec.max_num_batched_tokens,
            kv_save_policy=spec.kv_save_policy,
            heartbeat_interval_s=spec.heartbeat_interval_s,
            threads=spec.node_cpus,
            keys=self.keys.for_node(node_id) if self.keys else None,
            env=spec.node_env.get(node_id, {}),
            kv_events=spec.kv_events_for(node_id),
        )
        self.nodes[node_id] = ray.remote(NodeActor).options(**node_options(spec)).remote(launch)
        return node_id

    def _views(self) -> dict[str, NodeView]:
        return {v.node_id: v for v in ray.get(self.router.nodes.remote(), timeout=_CALL_S)}

    def _wait_registered(self, names: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            views = self._views()
            missing = [n for n in names if n not in views]
            if not missing:
                return
            for name in missing:
                if self._state(self.nodes[name]) is ActorState.DEAD:
                    raise RuntimeError(f"node actor {name} died before registering (see its output above)")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"nodes {missing} did not register within {timeout_s:.0f}s (an actor Ray cannot place waits "
                    "for free CPUs/GPUs on one host: see `ray status`)"
                )
            self._pause()

    # ------------------------------------------------------------------ scale

    def scale(self, kind: NodeKind, delta: int, timeout_s: float) -> list[str]:
        """Add `delta` nodes of `kind` (registered when this returns), or drain and remove `-delta`; their ids."""
        if self.spec.engine is ServingEngine.VLLM:
            raise ValueError("scaling vLLM instances is not supported yet: the router's instances are fixed at start")
        with self._lock:
            if delta > 0:
                return self._add(kind, delta, timeout_s)
            if delta < 0:
                return self._remove(kind, -delta, timeout_s)
            return []

    def _of(self, kind: NodeKind) -> list[str]:
        return [n for n in self.nodes if parse_kind(n)[0] is kind]

    def _add(self, kind: NodeKind, count: int, timeout_s: float) -> list[str]:
        used = {parse_kind(n)[1] for n in self._of(kind)}
        free = [i for i in range(self.spec.max_nodes_per_kind) if i not in used][:count]
        if len(free) < count:
            raise ValueError(
                f"at most {self.spec.max_nodes_per_kind} {kind.value} nodes (keys exist for those; redeploy with "
                "a larger --max-nodes)"
            )
        _check_free_cpus(self.spec.node_cpus * count, f"{count} more {kind.value} node(s)")
        names = [self._start_node(kind, i) for i in free]
        self._wait_registered(names, timeout_s)
        return names

    def _remove(self, kind: NodeKind, count: int, timeout_s: float) -> list[str]:
        current = self._of(kind)
        if count > len(current):
            raise ValueError(f"only {len(current)} {kind.value} node(s) run")
        decoders = sum(len(self._of(k)) for k in (NodeKind.DECODE, NodeKind.COLOCATED))
        if kind is not NodeKind.PREFILL and decoders - count < 1:
            raise ValueError("the last decode (or colocated) node cannot be removed")
        views = self._views()
        # The least busy first (fewest requests to finish), then the newest.
        order = sorted(current, key=lambda n: (views[n].inflight if n in views else -1, -parse_kind(n)[1]))
        victims = order[:count]
        for name in victims:
            ray.get(self.router.drain.remote(name), timeout=_CALL_S)
        deadline = time.monotonic() + timeout_s
        for name in victims:
            while (view := self._views().get(name)) is not None and (view.inflight or not view.draining):
                if not view.draining:  # Ray restarted it meanwhile: the new incarnation must not take jobs either
                    ray.get(self.router.drain.remote(name), timeout=_CALL_S)
                    continue
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name} still holds {view.inflight} request(s) after {timeout_s:.0f}s")
                self._pause()
            self._stop_node(name)
        return victims

    def _pause(self) -> None:
        if self._closing.wait(_POLL_S):
            raise RuntimeError("the deployment is shutting down")

    def _stop_node(self, name: str) -> None:
        handle = self.nodes.pop(name)
        try:
            ray.get(handle.stop.remote(), timeout=30)
        except (RayActorError, GetTimeoutError):
            pass  # dead or restarting: the kill below ends it either way
        ray.kill(handle, no_restart=True)

    # ------------------------------------------------------------------ status

    def _state(self, handle: Any) -> ActorState:
        try:
            ray.get(handle.info.remote(), timeout=_INFO_S)
            return ActorState.RUNNING
        except ActorDiedError:
            return ActorState.DEAD
        except (RayActorError, GetTimeoutError):
            return ActorState.UNAVAILABLE

    def _placements(self, handles: dict[str, Any]) -> dict[str, tuple[ActorState, Placement | None]]:
        refs = {name: h.info.remote() for name, h in handles.items()}
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=_INFO_S)
        out: dict[str, tuple[ActorState, Placement | None]] = {}
        for name, ref in refs.items():
            try:
                out[name] = (ActorState.RUNNING, ray.get(ref, timeout=0))
            except ActorDiedError:
                out[name] = (ActorState.DEAD, None)
            except (RayActorError, GetTimeoutError):
                out[name] = (ActorState.UNAVAILABLE, None)
        return out

    def status(self) -> DeploymentStatus:
        handles = dict(self.nodes)
        roles = {name: ActorRole.of(parse_kind(name)[0]) for name in handles}
        for name, role, handle in (("store", ActorRole.STORE, self.store), ("router", ActorRole.ROUTER, self.router)):
            if handle is not None:
                handles[name], roles[name] = handle, role
        places = self._placements(handles)
        notes = list(self.notes)
        try:
            views = self._views()
        except (RayActorError, GetTimeoutError) as e:
            views, notes = {}, [*notes, f"router unreachable: {type(e).__name__}"]
        store = None
        if self.store is not None:
            try:
                store = ray.get(self.store.stats.remote(), timeout=_CALL_S)
            except Exception as e:  # the store (or its daemon) down: the rest of the status still shows
                notes.append(f"store stats unavailable: {type(e).__name__}: {str(e)[:200]}")
        order = ["store", "router", *sorted(self.nodes, key=parse_kind_order)]
        actors = [
            ActorStatus(name, roles[name], *places[name], node=views.get(name)) for name in order if name in handles
        ]
        return DeploymentStatus(self.spec.name, self.url, self.nodes_address, self.store_address, actors, store, notes)

    def handles(self) -> dict[str, Any]:
        """Actor handles by name (fault tests kill one)."""
        out = dict(self.nodes)
        if self.router is not None:
            out["router"] = self.router
        if self.store is not None:
            out["store"] = self.store
        return out

    # ------------------------------------------------------------------ shutdown

    def shutdown(self) -> None:
        """Nodes first (no more saves), then the router, then the store."""
        self._closing.set()
        with self._lock:
            for name in list(self.nodes):
                self._stop_node(name)
            for handle in (self.router, self.store):
                if handle is None:
                    continue
                try:
                    ray.get(handle.stop.remote(), timeout=30)
                except (RayActorError, GetTimeoutError):
                    pass
                ray.kill(handle, no_restart=True)
            self.router = self.store = None


def _check_free_cpus(want: float, what: str) -> None:
    """Fail at once when the whole cluster lacks the CPUs (Ray would leave the actors pending forever)."""
    free = ray.available_resources().get("CPU", 0.0)
    if want > free + 1e-9:
        raise ValueError(
            f"{what} needs {want:g} CPUs, the Ray cluster has {free:g} free: add a host (`ray start --address ...`) "
            "or ask for fewer (--node-cpus)"
        )


def parse_kind_order(node_id: str) -> tuple[int, int]:
    kind, index = parse_kind(node_id)
    return list(NodeKind).index(kind), index
