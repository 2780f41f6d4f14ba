"""The flags `ucm-serve up` gains for Ray, and the DeploymentSpec built from `up`'s arguments. Ray-free: `up`'s
parser imports this module; ray itself is imported only once `--ray` is given."""

from __future__ import annotations

import argparse

from common.kv_events.config import parse_kv_events_config
from launch.ray.spec import DEFAULT_NAME, STORE_RESOURCE, DeploymentSpec
from launch.serving_engine import ServingEngine
from launch.topology import Topology
from protocol import defaults

LOCAL = "local"  # `--ray` without an address: start a Ray on this machine for this deployment


def add_ray_args(parser: argparse.ArgumentParser) -> None:
    d = DeploymentSpec
    g = parser.add_argument_group("Ray (several machines; docs/deploy.md)")
    g.add_argument(
        "--ray",
        nargs="?",
        const=LOCAL,
        default=None,
        metavar="ADDRESS",
        help="run every role as a Ray actor: ADDRESS of a Ray cluster ('auto': the one this machine belongs to), "
        "or none to start a local Ray. Without --prefill/--decode: 1 prefill + 1 decode node "
        "(--topology colocated: one colocated node)",
    )
    g.add_argument("--name", default=DEFAULT_NAME, help="deployment name (scale/status/down find it by this)")
    g.add_argument(
        "--store-node",
        default=None,
        metavar="NODE",
        help=f"Ray node id or IP for the store (default: a node with the {STORE_RESOURCE!r} resource)",
    )
    g.add_argument("--node-cpus", type=int, default=d.node_cpus, help="CPUs (torch threads) each node reserves")
    g.add_argument(
        "--max-nodes",
        type=int,
        default=d.max_nodes_per_kind,
        help="most nodes of each kind `ucm-serve scale` may reach (their keys are made at start)",
    )
    g.add_argument(
        "--ray-host",
        default=None,
        help="address every actor's sockets bind (default: 127.0.0.1 if all Ray nodes share one IP, else each "
        "actor's node IP)",
    )
    g.add_argument(
        "--detach",
        action="store_true",
        help="leave the deployment running when `up` exits (stop it with `ucm-serve down`); needs an ADDRESS",
    )


def spec_from_args(args: argparse.Namespace) -> DeploymentSpec:
    """ValueError for a bad combination."""
    if args.detach and args.ray == LOCAL:
        raise ValueError("--detach needs a Ray cluster address (a local Ray ends with `up`)")
    # Honour or refuse: these serving flags are not carried into the Ray actors yet, so saying so beats ignoring them.
    unsupported = [
        flag
        for flag, given in (
            ("--served-model-name", args.served_model_name is not None),
            ("--max-model-len", args.max_model_len is not None),
            ("--no-enable-prefix-caching", not args.enable_prefix_caching),
            ("--host (use --ray-host)", args.host != defaults.HTTP_HOST),
        )
        if given
    ]
    if unsupported:
        raise ValueError(f"not supported with --ray yet: {', '.join(unsupported)}")
    engine = args.engine
    if engine is ServingEngine.VLLM and args.topology is Topology.COLOCATED:
        raise ValueError("--engine vllm runs prefill and decode instances, not colocated")
    if args.topology is Topology.COLOCATED and args.prefill is None and args.decode is None:
        prefill, decode, colocated = 0, 0, 1
    else:
        prefill = 1 if args.prefill is None else args.prefill
        decode = 1 if args.decode is None else args.decode
        colocated = 0
    cuda = args.device == "cuda"
    return DeploymentSpec(
        name=args.name,
        model=args.model,
        prefill=prefill,
        decode=decode,
        colocated=colocated,
        port=args.port,
        api_key=args.api_key,
        store=not args.no_store,
        dram=args.dram,
        disk=args.disk,
        disk_path=args.disk_path,
        disk_writes=args.disk_writes,
        dtype=args.dtype,
        device=args.device,
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_save_policy=args.kv_save_policy,
        secure=not args.insecure,
        kv_events=parse_kv_events_config(args.kv_events_config) if args.kv_events_config else None,
        node_cpus=args.node_cpus,
        node_gpus=1.0 if cuda else 0.0,
        store_node=args.store_node,
        max_nodes_per_kind=args.max_nodes,
        host=args.ray_host,
        detached=args.detach,
        engine=engine,
    )
