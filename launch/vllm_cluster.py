"""`VllmCluster`: `ucm-serve up --engine vllm` — the store daemon, vLLM prefill instances (UCMConnector as
`kv_producer`), vLLM decode instances (`kv_consumer`, with `--enable-prompt-tokens-details` so `cached_tokens` counts
what they loaded) and the router in front of them (`--vllm-prefill URL --vllm-decode URL`), as supervised children.

The same `Cluster` life as with our own nodes (launch/cluster.py): the model prepared once, CURVE keys unless
`secure=False` (each vLLM instance is a store client named for its child: `prefill-0`, `decode-0`), fixed ports, a
child that exits restarted on the same address (a restarted vLLM instance answers `/health` again and the router
takes it back). vLLM comes from its own venv (launch/vllm_command.py); a missing one is `VllmMissing`, before
anything starts.

With `--kv-events-config` each instance publishes its KV events (vLLM's own publisher, the config offset per
instance as for our nodes) and the store daemon its tiers' at the next offset; the router subscribes to all of them
(`--vllm-kv-events`, `--store-kv-events`) and tokenizes prompts with the model folder's tokenizer to look them up, so
it chooses instances by what they and the store hold (router/vllm_pool.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TextIO

import httpx

from common.kv_events import endpoints
from common.kv_events.config import KVEventsConfig
from launch.child import Child
from launch.cluster import Cluster, ClusterSpec, StoreMode, _cmd
from launch.ports import free_port
from launch.supervisor import Supervisor
from launch.vllm_command import PdSettings, VllmCommand, core_slice, default_vllm_venv, pd_instance, vllm_executable


class VllmCluster(Cluster):
    def __init__(self, spec: ClusterSpec, venv: Path | None = None, sink: TextIO | None = None, log=print) -> None:
        if spec.colocated:
            raise ValueError("--engine vllm runs prefill and decode instances (--prefill N --decode N), not colocated")
        if spec.store is not StoreMode.DAEMON:
            raise ValueError(
                "--engine vllm passes KV from prefill to decode instances through the store: no --no-store"
            )
        self.venv = venv or default_vllm_venv()
        vllm_executable(self.venv)  # VllmMissing now, not after the store started
        super().__init__(spec, sink, log)
        self.ports = {name: free_port() for name in spec.node_names()}

    def urls(self, kind: str) -> list[str]:
        return [f"http://127.0.0.1:{port}" for name, port in self.ports.items() if name.startswith(kind + "-")]

    def __enter__(self) -> VllmCluster:
        return self.start()

    def start(self, timeout: float = 900.0) -> VllmCluster:
        try:
            self._prepare_model()
            if self.spec.secure:
                self._make_keys()
            self.start_store()
            for i in range(self.spec.prefill):
                self.start_node("prefill", i)
            for i in range(self.spec.decode):
                self.start_node("decode", i)
            self._start_router()
            self.wait_healthy(timeout)
            if self.spec.supervise:
                self.supervisor = Supervisor(self._snapshot, self._restart, self.spec.restart, self.log)
                self.supervisor.start()
        except BaseException:
            self.stop()
            raise
        return self

    def command(self, kind: str, index: int) -> VllmCommand:
        name = f"{kind}-{index}"
        assert self.store_addr is not None and self.model_dir is not None, "start_store and the model come first"
        store = self.store_addr
        if self.keys is not None:
            store += f"?curve_keys={self.keys.dir}&curve_client={name}"
        cpus = core_slice(list(self.ports).index(name), len(self.ports), os.cpu_count() or 1)
        settings = PdSettings(
            served_model_name=self.spec.model_name,
            dtype=self.spec.dtype,
            kv_cache_memory=self.spec.kv_cache_memory,
            max_num_seqs=self.spec.max_num_seqs,
            max_num_batched_tokens=self.spec.max_num_batched_tokens,
            max_model_len=self.spec.max_model_len,
            enable_prefix_caching=self.spec.enable_prefix_caching,
        )
        model = Path(self.model_dir)
        return pd_instance(settings, kind, self.venv, model, self.ports[name], store, cpus, self.kv_events_of(name))

    def start_node(self, kind: str, index: int) -> Child:
        name = f"{kind}-{index}"
        with self._lock:
            old = self.children.pop(name, None)
        if old is not None:
            old.stop()
        command = self.command(kind, index)
        self.log(f"[up] starting vLLM {kind} instance {name} at {command.url} (1-3 minutes on a small CPU host)")
        child = Child(name, command.argv(), sink=self.sink, env=command.env(), group=True)
        with self._lock:
            self.children[name] = child
        return child

    def kv_events_of(self, name: str) -> KVEventsConfig | None:
        """Instance `name`'s --kv-events-config (the launcher's, offset as for our nodes); None without events."""
        events = self.spec.kv_events
        if events is None or not events.enabled:
            return None
        return events.for_node(self.spec.node_names().index(name))

    def _start_router(self) -> None:
        self._spawn("router", _cmd(*self.router_args())).wait_for(r"fronting vLLM instances", 120)
        self.log(f"[up] router fronting {len(self.ports)} vLLM instance(s) at {self.url}")

    def router_args(self) -> list[str]:
        """`ucm-serve router`'s arguments in front of the instances."""
        args = ["router", "--host", self.spec.host, "--port", str(self.port)]
        args += ["--served-model-name", self.spec.model_name, "--vllm-max-num-seqs", str(self.spec.max_num_seqs)]
        for url in self.urls("prefill"):
            args += ["--vllm-prefill", url]
        for url in self.urls("decode"):
            args += ["--vllm-decode", url]
        for name, port in self.ports.items():
            events = self.kv_events_of(name)
            if events is not None:  # vLLM binds its wildcard endpoints on this host
                pub = endpoints.reachable(events.endpoint, "tcp://127.0.0.1:1")
                replay = (
                    endpoints.reachable(events.replay_endpoint, "tcp://127.0.0.1:1") if events.replay_endpoint else None
                )
                args += [
                    "--vllm-kv-events",
                    f"http://127.0.0.1:{port}=" + (pub if replay is None else f"{pub},{replay}"),
                ]
        if self.store_events_addr is not None:
            args += ["--store-kv-events", self.store_events_addr]
            if self.keys is not None:  # the store's publisher takes the router's CURVE pair
                args += ["--curve-keys", str(self.keys.dir)]
        if self.store_events_addr is not None or self.spec.kv_events is not None:
            args += ["--model", str(self.model_dir)]  # its tokenizer: prompts looked up in the events
        if self.spec.api_key:
            args += ["--api-key", self.spec.api_key]
        return args + list(self.spec.router_args)

    READY_WORDS = "vLLM instances healthy"
    READY_POLL_S = 1.0

    def expected_ready(self) -> set[str]:
        return set(self.ports)

    def ready(self) -> set[str]:
        """The instances the router's health probes find alive."""
        try:
            backends = httpx.get(f"{self.url}/health", timeout=2).json().get("backends", {})
        except (httpx.HTTPError, ValueError):
            return set()
        return {name for name in self.ports if backends.get(self._backend_name(name), {}).get("alive")}

    def _backend_name(self, name: str) -> str:
        kind = name.split("-", 1)[0]
        return f"{kind}@127.0.0.1:{self.ports[name]}"  # router/vllm_backend.py's VllmBackend.name
