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
    """`ucm_node_stat{name=...}` of every node reporting it: node id -> value."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("ucm_node_stat{") and f'name="{name}"' in line:
            node = line.split('node="', 1)[1].split('"', 1)[0]
            out[node] = float(line.rsplit(" ", 1)[1])
    return out
