"""Per-node series, rebuilt from the registry at every scrape (a departed node's series simply stop): the
heartbeat stats as named counters (`ucm_node_<stat>_total{node}`) or gauges, and vLLM's scheduler gauges
(`vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`) with each node as
vLLM's `engine`.

Stat names come from nodes: only `[a-z][a-z0-9_]*` names are exported (at most MAX_STATS_PER_NODE per node), and
names that would collide with the router's own `ucm_node_*` families are skipped.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from router.registry import NodeState, Registry

MAX_STATS_PER_NODE = 256
_MAX_STAT_CHARS = 96
_STAT_NAME = re.compile(r"[a-z][a-z0-9_]*")
# Stats that are levels, not running totals: everything else a node reports only grows (until it restarts).
_GAUGE_STATS = frozenset({"connector_store_reachable", "threads"})
_GAUGE_STORE_SUFFIXES = ("_bytes_used", "_capacity_bytes", "_blocks")
# The router's own ucm_node_* families (router/metrics.py): a stat must not shadow them.
_RESERVED = frozenset(
    {"up", "running_requests", "waiting_requests", "free_kv_blocks", "events", "messages_dropped", "stat"}
)


def is_gauge_stat(name: str) -> bool:
    return name in _GAUGE_STATS or (name.startswith("store_") and name.endswith(_GAUGE_STORE_SUFFIXES))


def exported_stats(node: NodeState) -> dict[str, float]:
    names = (
        (k, v)
        for k, v in node.stats.items()
        if len(k) <= _MAX_STAT_CHARS and _STAT_NAME.fullmatch(k) and k.removesuffix("_total") not in _RESERVED
    )
    return dict(itertools.islice(names, MAX_STATS_PER_NODE))


class NodeCollector(Collector):
    def __init__(self, nodes: Registry, model_name: str) -> None:
        self._nodes = nodes
        self._model_name = model_name

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        nodes = list(self._nodes.nodes.values())
        engine = ["model_name", "engine"]
        running = GaugeMetricFamily(
            "vllm:num_requests_running", "Number of requests in model execution batches.", labels=engine
        )
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels=engine
        )
        usage = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels=engine
        )
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        for node in nodes:
            labels = [self._model_name, node.node_id]
            running.add_metric(labels, node.running)
            waiting.add_metric(labels, node.waiting)
            total = node.info.num_blocks
            usage.add_metric(labels, 1.0 - node.free_blocks / total if total > 0 else 0.0)
            for name, value in exported_stats(node).items():
                family = families.get(name)
                if family is None:
                    kind = GaugeMetricFamily if is_gauge_stat(name) else CounterMetricFamily
                    family = families[name] = kind(
                        f"ucm_node_{name.removesuffix('_total')}", f"node stat {name} (heartbeats)", labels=["node"]
                    )
                family.add_metric([node.node_id], value)
        yield running
        yield waiting
        yield usage
        yield from families.values()
