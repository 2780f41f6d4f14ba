"""Read numbers from the router's Prometheus text (`/metrics`): a sample summed over the label sets that match."""

from __future__ import annotations

import httpx


def metric(url: str, metric_name: str, /, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if (line.startswith(metric_name + "{") or line.startswith(metric_name + " ")) and all(
            f'{k}="{v}"' in line for k, v in labels.items()
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


def node_stats(url: str, name: str) -> dict[str, float]:
    """Heartbeat stat `name` of every node reporting it: node id -> value. A counter is exported as
    `ucm_node_<name>_total{node}`, a level as `ucm_node_<name>{node}` (router/node_metrics.py)."""
    base = "ucm_node_" + name.removesuffix("_total")
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith((base + "_total{", base + "{")):
            node = line.split('node="', 1)[1].split('"', 1)[0]
            out[node] = float(line.rsplit(" ", 1)[1])
    return out
