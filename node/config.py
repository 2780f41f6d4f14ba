"""One typed config for a serving node (prefill, decode or colocated), built in one place from argv.

prefill_node.cli and decode_node.cli only choose the role; the flags and their parsing live here so the
two node kinds can never drift apart.
"""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass
from urllib.parse import urlencode

from common.auth import ClientAuth
from common.kv_events.config import KVEventsConfig, parse_kv_events_config
from common.save_policy import KVSavePolicy
from protocol import defaults, flags
from protocol.messages import NodeRole
from protocol.peer_identity import check_node_id

# Store addresses that mean "no store": the node then runs without a connector (always recomputes).
NO_STORE = ("", "none", "off")
# Test hook: seconds each engine step sleeps on this node, so tests can make a node slow but alive.
STEP_DELAY_ENV = "UCM_TEST_STEP_DELAY_S"


@dataclass(frozen=True)
class NodeConfig:
    role: NodeRole
    router_addr: str  # the router's --bind-nodes address (protocol/defaults.py NODES_ADDR by hand)
    store_addr: str | None  # tcp://… of a store daemon, "embedded", or None (no connector)
    model: str = defaults.MODEL
    served_model_name: str | None = None  # the name clients use; defaults to `model`
    # "auto": bf16 on CUDA and on CPUs with native bf16 (AVX-512 BF16 / AMX), else fp32.
    dtype: str = "auto"
    device: str = "cpu"
    node_id: str = ""
    max_num_seqs: int = defaults.MAX_NUM_SEQS
    max_num_batched_tokens: int | None = defaults.MAX_NUM_BATCHED_TOKENS  # None: the engine picks it for the host
    max_model_len: int | None = None
    kv_cache_memory: str = defaults.NODE_KV_CACHE_MEMORY  # paged-cache size (the device tier of the KV cache)
    enable_prefix_caching: bool = True  # reuse prompt prefixes held in the paged cache
    kv_save_policy: KVSavePolicy = KVSavePolicy.COMPUTED  # when blocks go to the store (common/save_policy.py)
    heartbeat_interval_s: float = 0.5
    num_threads: int | None = None  # torch intra-op threads (several nodes on one small machine: 1 each)
    cached_keys_cap: int = 4096  # how many recent block keys a heartbeat carries
    step_delay_s: float = 0.0  # test hook (UCM_TEST_STEP_DELAY_S): extra seconds per engine step
    # CURVE keys for the router link (this node's pair, named for its node id, and the router's public key).
    # None: unauthenticated (the CLI requires --insecure for that). The KV event sockets use the same pair.
    router_auth: ClientAuth | None = None
    # vLLM's --kv-events-config: the device cache's KV events published per engine step (common/kv_events/)
    kv_events: KVEventsConfig | None = None

    def __post_init__(self) -> None:
        if not self.router_addr:
            raise ValueError("a node needs --router ADDR (the router's --bind-nodes address)")
        check_node_id(self.resolved_node_id)
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.heartbeat_interval_s <= 0:
            raise ValueError(f"heartbeat interval must be positive, got {self.heartbeat_interval_s}")
        if self.step_delay_s < 0:
            raise ValueError(f"{STEP_DELAY_ENV} must be >= 0, got {self.step_delay_s}")
        if self.kv_save_policy.writes_back and self.role is NodeRole.PREFILL:
            raise ValueError(
                f"--kv-save-policy {self.kv_save_policy.value} on a prefill node: its decode nodes load what it saves, "
                "as it computes it"
            )

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def publishes_kv_events(self) -> bool:
        return self.kv_events is not None and self.kv_events.enabled

    @property
    def resolved_node_id(self) -> str:
        return self.node_id or f"{self.role.value}-{socket.gethostname()}-{os.getpid()}"


def add_node_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--router", required=True, help=f"router's node address (its --bind-nodes), e.g. {defaults.NODES_ADDR}"
    )
    parser.add_argument("--store", default="none", help="store daemon address (tcp://…), 'embedded', or 'none'")
    flags.MODEL.add(parser)
    for flag in (flags.SERVED_MODEL_NAME, flags.DTYPE, flags.DEVICE):
        flag.add(parser)
    parser.add_argument("--node-id", default="", help="stable id (default: role-host-pid)")
    for flag in (flags.MAX_NUM_SEQS, flags.MAX_NUM_BATCHED_TOKENS, flags.MAX_MODEL_LEN, flags.KV_CACHE_MEMORY):
        flag.add(parser)
    flags.ENABLE_PREFIX_CACHING.add(parser)
    flags.KV_EVENTS_CONFIG.add(parser)
    parser.add_argument(
        "--kv-save-policy",
        **flags.one_of(KVSavePolicy, KVSavePolicy.COMPUTED),
        help="computed: every full block to the store as it is computed (other nodes and restarts load it); "
        "evicted: only when the device prefix cache evicts it (one engine alone on a store; not on prefill nodes); "
        "reused: as evicted while evicted blocks come back, else only those that showed reuse",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--heartbeat-interval", type=float, default=0.5, help="seconds between heartbeats")
    auth = parser.add_argument_group("authentication (ZeroMQ CURVE, docs/security.md)")
    flags.curve_keys(
        "this node's pair DIR/NODE_ID.key_secret and the router's DIR/router.key; also used for a tcp:// --store "
        "without ?curve_keys="
    ).add(auth)
    flags.insecure("to the router (and to a --store without ?curve_keys=)").add(auth)


def _authenticated_store(store: str, keys: str, node_id: str) -> str:
    """A daemon address without its own CURVE options uses the node's key folder (one folder for both links)."""
    if not store.startswith(("tcp://", "ipc://")):
        return store
    address, _, query = store.partition("?")
    if "curve_keys=" in query:
        return store
    extra = urlencode({"curve_keys": keys, "curve_client": node_id})
    return f"{address}?{query}&{extra}" if query else f"{address}?{extra}"


def config_from_args(args: argparse.Namespace, role: NodeRole) -> NodeConfig:
    """ValueError for a bad combination (keys without a node id, neither keys nor --insecure)."""
    store = None if args.store.strip().lower() in NO_STORE else args.store.strip()
    kv_events = parse_kv_events_config(args.kv_events_config) if args.kv_events_config else None
    router_auth = None
    if args.insecure and args.curve_keys:
        raise ValueError("--insecure contradicts --curve-keys")
    if args.curve_keys:
        if not args.node_id:
            raise ValueError(
                "with --curve-keys give --node-id: the router accepts a node only under the id its key "
                "file is named for (DIR/NODE_ID.key_secret)"
            )
        router_auth = ClientAuth.for_router(args.curve_keys, args.node_id)
        router_auth.load()  # a missing file fails here, not in the heartbeat thread
        if store is not None:
            store = _authenticated_store(store, args.curve_keys, args.node_id)
    elif not args.insecure:
        raise ValueError(
            "a node needs keys (--curve-keys DIR --node-id ID, from `ucm-serve keys DIR --nodes ID`) "
            "or an explicit --insecure"
        )
    device = args.device
    if device is None:
        import torch  # nodes may import torch; only the router must not

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return NodeConfig(
        role=role,
        router_addr=args.router,
        store_addr=store,
        model=args.model,
        served_model_name=args.served_model_name,
        dtype=args.dtype,
        device=device,
        node_id=args.node_id,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_memory,
        enable_prefix_caching=args.enable_prefix_caching,
        kv_save_policy=args.kv_save_policy,
        heartbeat_interval_s=args.heartbeat_interval,
        num_threads=args.threads,
        step_delay_s=float(os.environ.get(STEP_DELAY_ENV) or 0.0),
        router_auth=router_auth,
        kv_events=kv_events,
    )
