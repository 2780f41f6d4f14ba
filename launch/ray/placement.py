"""Where each actor may run, as Ray actor options, and which address the ZeroMQ and HTTP sockets bind.

store     the host named by `--store-node` (a Ray node id or IP), else one advertising the `disk` resource
          (`ray start --resources '{"disk": 1}'`), else anywhere (said in the status notes)
router    anywhere with `router_cpus` free
nodes     SPREAD over the hosts, each reserving `node_cpus` CPUs (its torch threads) and `node_gpus` GPUs, so
          Ray never puts more engines on a host than it has cores (or GPUs) for
"""

from __future__ import annotations

import os
from typing import Any

from launch.ray.spec import DeploymentSpec
from node.openmp_env import node_openmp_env

LOOPBACK = "127.0.0.1"


def alive_nodes() -> list[dict[str, Any]]:
    import ray

    return [n for n in ray.nodes() if n.get("Alive")]


def bind_host(spec: DeploymentSpec, nodes: list[dict[str, Any]]) -> str | None:
    """The host every actor binds: `spec.host`; 127.0.0.1 when every Ray node has the same IP (one machine: nothing
    is exposed to the network); None: each actor binds its own node's IP (several machines)."""
    if spec.host:
        return spec.host
    ips = {n["NodeManagerAddress"] for n in nodes}
    return LOOPBACK if len(ips) <= 1 else None


def store_options(spec: DeploymentSpec, nodes: list[dict[str, Any]]) -> tuple[dict[str, Any], str | None]:
    """Actor options for the store, and a note when the placement had to fall back."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    options: dict[str, Any] = {"num_cpus": spec.store_cpus, "max_restarts": 0}
    if spec.store_node:
        match = [n for n in nodes if spec.store_node in (n["NodeID"], n["NodeManagerAddress"])]
        if not match:
            raise ValueError(f"--store-node {spec.store_node!r} is neither the id nor the IP of a live Ray node")
        if len({n["NodeManagerAddress"] for n in match}) == 1 and len(match) > 1:
            match = match[:1]  # several Ray nodes on one machine (tests): any of them has that machine's disk
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=match[0]["NodeID"], soft=False)
        return options, None
    if any(spec.store_resource in n.get("Resources", {}) for n in nodes):
        options["resources"] = {spec.store_resource: 1}
        return options, None
    return options, (
        f"no Ray node advertises the {spec.store_resource!r} resource: the store runs wherever Ray put it "
        f"(start the disk host with --resources '{{\"{spec.store_resource}\": 1}}', or pass --store-node)"
    )


def router_options(spec: DeploymentSpec) -> dict[str, Any]:
    return {"num_cpus": spec.router_cpus, "max_restarts": 0}


def node_options(spec: DeploymentSpec) -> dict[str, Any]:
    return {
        "num_cpus": spec.node_cpus,
        "num_gpus": spec.node_gpus,
        "max_restarts": spec.max_restarts,
        "max_task_retries": 0,  # a call to a restarting node fails fast: the controller never waits on a dead actor
        "scheduling_strategy": "SPREAD",
        # before the actor's process imports torch: how its idle OpenMP threads wait, unless the user's environment
        # (the driver's, as Ray workers inherit theirs) chose (node/openmp_env.py)
        "runtime_env": {"env_vars": node_openmp_env(dict(os.environ))},
    }
