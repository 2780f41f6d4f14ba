"""What a Ray deployment runs: one frozen spec, validated once; the actor names and node ids derive from it.

Ray-free, so `ucm-serve up`'s parser and the tests can build a spec without importing ray.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from common.kv_events.config import KVEventsConfig, check_node_offsets
from common.save_policy import KVSavePolicy
from launch.cluster import ClusterSpec
from launch.serving_engine import ServingEngine
from ucm.store_config import DiskWrites

NAMESPACE = "ucm-serve"  # the Ray namespace of every deployment's controller (found by name from any driver)
DEFAULT_NAME = "ucm-serve"  # the controller's name: one deployment per name and Ray cluster
STORE_RESOURCE = "disk"  # custom resource of the hosts that may hold the store (`ray start --resources`)
STATUS_CLIENT = "ucm-status"  # the store key the store actor reads its own stats with (never a router key)

_UP = ClusterSpec()  # `ucm-serve up`'s defaults: the Ray deployment runs the same processes with the same settings


class NodeKind(enum.Enum):
    """A serving node's kind; its node ids are `<kind>-<index>`."""

    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"  # one engine that prefills and decodes (`ucm-serve decode --colocated`)

    @property
    def command(self) -> str:
        """The `ucm-serve` subcommand that runs it."""
        return "prefill" if self is NodeKind.PREFILL else "decode"

    def node_id(self, index: int) -> str:
        assert index >= 0, f"node index {index}"
        return f"{self.value}-{index}"


class ActorRole(enum.Enum):
    STORE = "store"
    ROUTER = "router"
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"

    @classmethod
    def of(cls, kind: NodeKind) -> ActorRole:
        return cls(kind.value)


@dataclass(frozen=True)
class DeploymentSpec:
    name: str = DEFAULT_NAME
    model: str = "smollm2-135m"
    prefill: int = 1
    decode: int = 1
    colocated: int = 0
    port: int = 8000  # the router's HTTP port on its host (0: any free port)
    api_key: str | None = None
    store: bool = True  # False: no store daemon, decode nodes recompute prompts
    dram: str = _UP.dram
    disk: str = _UP.disk
    disk_path: str | None = None  # the store's LMDB folder on its host (None: a temporary folder)
    disk_writes: DiskWrites | None = None  # None: the store daemon's default (every block, behind)
    dtype: str = _UP.dtype
    device: str | None = None  # None: each node's default (cuda when its host has one)
    kv_cache_memory: str = _UP.kv_cache_memory
    max_num_seqs: int = _UP.max_num_seqs
    max_num_batched_tokens: int | None = _UP.max_num_batched_tokens
    # When colocated nodes save their blocks to the store (prefill nodes always save as they compute). None: as
    # computed, since a Ray deployment scales and another node may need a block this one's device cache holds.
    kv_save_policy: KVSavePolicy | None = None
    node_timeout_s: float = _UP.node_timeout_s
    heartbeat_interval_s: float = _UP.heartbeat_interval_s
    store_nice: int = _UP.store_nice
    secure: bool = True  # False: no CURVE on the router's and the store's sockets (--insecure)
    # What each actor reserves, so Ray never places more work on a host than it has cores for. A node's engine
    # runs `node_cpus` torch threads; the router and the store mostly wait on sockets.
    node_cpus: int = 1
    node_gpus: float = 0.0  # per node actor; 1 with --device cuda
    router_cpus: float = 0.5
    store_cpus: float = 0.5
    store_node: str | None = None  # a Ray node id or IP for the store; None: a host with STORE_RESOURCE, if any
    store_resource: str = STORE_RESOURCE
    # Routers and stores read their authorized keys once, at start: every node a deployment may ever scale to needs
    # its key then. Keys exist for indices 0..max_nodes_per_kind-1 of each kind.
    max_nodes_per_kind: int = 16
    max_restarts: int = 10  # Ray restarts a node actor this many times (-1: forever); the store/router: never
    host: str | None = None  # bind address; None: 127.0.0.1 when every Ray node shares one IP, else the node's IP
    detached: bool = False  # the controller outlives the driver that deployed it (stop it with `ucm-serve down`)
    node_env: dict[str, dict[str, str]] = field(default_factory=dict)  # extra environment by node id (test hooks)
    # VLLM: `vllm serve` instances (kv_producer for prefill, kv_consumer for decode) instead of our nodes, the router
    # fronting them (launch/ray/vllm_actors.py)
    engine: ServingEngine = ServingEngine.UCM
    # vLLM's --kv-events-config for every node, each at its own port offset (`kv_events_for`): the router indexes
    # what they announce, wherever Ray placed them (a wildcard endpoint is announced at the node's own address)
    kv_events: KVEventsConfig | None = None

    def __post_init__(self) -> None:
        if min(self.prefill, self.decode, self.colocated) < 0:
            raise ValueError("node counts must be >= 0")
        if self.decode + self.colocated == 0:
            raise ValueError("a deployment needs at least one decode (or colocated) node")
        if max(self.prefill, self.decode, self.colocated) > self.max_nodes_per_kind:
            raise ValueError(f"at most {self.max_nodes_per_kind} nodes of a kind (max_nodes_per_kind)")
        if self.node_cpus < 1 or self.node_gpus < 0 or self.router_cpus < 0 or self.store_cpus < 0:
            raise ValueError("node_cpus >= 1 and non-negative router/store CPUs and node GPUs are required")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not self.name or "/" in self.name:
            raise ValueError(f"bad deployment name {self.name!r}")
        if self.engine is ServingEngine.VLLM and (self.colocated or not self.store):
            raise ValueError("--engine vllm runs prefill and decode instances that pass KV through the store")
        if self.kv_events is not None:
            if self.engine is ServingEngine.VLLM:
                raise ValueError("--kv-events-config is not supported with --ray --engine vllm yet")
            check_node_offsets(self.kv_events, len(NodeKind) * self.max_nodes_per_kind + int(self.store))

    def count(self, kind: NodeKind) -> int:
        return {NodeKind.PREFILL: self.prefill, NodeKind.DECODE: self.decode, NodeKind.COLOCATED: self.colocated}[kind]

    def kv_events_for(self, node_id: str) -> KVEventsConfig | None:
        """`node_id`'s KV events config: offset by its place among every node id the deployment may run, so two
        nodes Ray puts on one host (or a node scaled in later) never bind the same port."""
        if self.kv_events is None:
            return None
        kind, index = parse_kind(node_id)
        return self.kv_events.for_node(list(NodeKind).index(kind) * self.max_nodes_per_kind + index)

    def store_kv_events(self) -> KVEventsConfig | None:
        """The store daemon's `--kv-events-config` when the nodes publish: the offset after every node id's, so the
        router indexes what the store's DRAM and disk hold too (as `up` does: launch/cluster.py)."""
        if self.kv_events is None or not self.kv_events.enabled or not self.store:
            return None
        return self.kv_events.for_node(len(NodeKind) * self.max_nodes_per_kind)

    def key_names(self) -> tuple[str, ...]:
        """Every node id this deployment may run (one CURVE pair each)."""
        return tuple(kind.node_id(i) for kind in NodeKind for i in range(self.max_nodes_per_kind))


def parse_kind(node_id: str) -> tuple[NodeKind, int]:
    """`decode-3` -> (DECODE, 3); ValueError for anything else."""
    kind, _, index = node_id.rpartition("-")
    try:
        return NodeKind(kind), int(index)
    except ValueError:
        raise ValueError(f"not a node id of a Ray deployment: {node_id!r}") from None
