"""What `ucm-serve status` (and `up --ray`) shows: which actor runs where, its load, the store's tiers."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from launch.ray.spec import ActorRole
from router.drain import NodeView


@dataclass(frozen=True)
class Placement:
    ray_node_id: str
    ip: str
    actor_pid: int
    child_pid: int | None  # the role's own process (None: the router, which runs in the actor's process)
    restarted: bool  # Ray restarted this actor at least once


class ActorState(enum.Enum):
    RUNNING = "running"  # answered
    UNAVAILABLE = "unavailable"  # did not answer in time: being restarted by Ray, or its host is unreachable
    DEAD = "dead"  # Ray gave up on it (restarts exhausted, or stopped)


@dataclass(frozen=True)
class ActorStatus:
    name: str  # store, router, or the node id
    role: ActorRole
    state: ActorState
    placement: Placement | None
    node: NodeView | None = None  # a node as the router sees it (None: not registered, or not a node)


@dataclass(frozen=True)
class DeploymentStatus:
    name: str
    url: str
    nodes_address: str
    store_address: str | None
    actors: list[ActorStatus]
    store: dict[str, Any] | None = None  # the daemon's stats (tiers: hits, misses, blocks, bytes...); None: none
    notes: list[str] = field(default_factory=list)

    def actor(self, name: str) -> ActorStatus:
        for a in self.actors:
            if a.name == name:
                return a
        raise KeyError(f"no actor {name!r} in deployment {self.name!r}")

    def registered(self, name: str) -> bool:
        try:
            return self.actor(name).node is not None
        except KeyError:
            return False


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f}{unit}"
        n /= 1024
    return f"{n:.0f}TiB"


def format_status(st: DeploymentStatus) -> str:
    lines = [
        f"deployment {st.name}: {st.url} (OpenAI API at {st.url}/v1); nodes connect to {st.nodes_address}",
        f"{'actor':<14}{'state':<12}{'host':<16}{'ray node':<14}{'pid':>8}  {'load':>5} {'run':>4} {'wait':>4} "
        f"{'inflight':>8}  note",
    ]
    for a in st.actors:
        p = a.placement
        host, node_id, pid = (p.ip, p.ray_node_id[:12], str(p.child_pid or p.actor_pid)) if p else ("-", "-", "-")
        notes = []
        if p is not None and p.restarted:
            notes.append("restarted by Ray")
        n = a.node
        if n is not None:
            load = f"{n.load:>5.2f} {n.running:>4} {n.waiting:>4} {n.inflight:>8}"
            if n.draining:
                notes.append("draining")
        else:
            load = f"{'':>5} {'':>4} {'':>4} {'':>8}"
            if a.role not in (ActorRole.STORE, ActorRole.ROUTER):
                notes.append("not registered")
        lines.append(f"{a.name:<14}{a.state.value:<12}{host:<16}{node_id:<14}{pid:>8}  {load}  {', '.join(notes)}")
    if st.store is not None:
        lines.append(f"store {st.store_address}:")
        lines.append(f"  {'tier':<6}{'hits':>10}{'misses':>10}{'blocks':>9}{'used':>10}{'capacity':>10}{'evicted':>9}")
        for tier, t in (st.store.get("tiers") or {}).items():
            lines.append(
                f"  {tier:<6}{t['hits']:>10}{t['misses']:>10}{t['blocks']:>9}{_size(t['bytes_used']):>10}"
                f"{_size(t['capacity_bytes']):>10}{t['evictions']:>9}"
            )
    lines += [f"note: {n}" for n in st.notes]
    return "\n".join(lines)
