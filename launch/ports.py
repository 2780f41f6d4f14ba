"""Ports picked for children to bind later: the cluster's router, store and node sockets, vLLM instances and their
KV-event publishers, the benchmarks' servers.

A port is picked outside the kernel's ephemeral range (/proc/sys/net/ipv4/ip_local_port_range). A port from bind(0)
is an ephemeral one, free only until the kernel hands it out again — to any process's bind(0) or to the local end of
an outgoing connection — and a child binds it seconds later: in CI a vLLM prefill instance's KV-event publisher found
tcp://*:35345 taken ("Address already in use") beside the other instance starting and the test polling both over
HTTP. No bind(0) and no outgoing connection takes a port below the range.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Sequence
from pathlib import Path

PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL = (32768, 60999)  # Linux's default, where the file cannot be read
FIRST_UNPRIVILEGED = 1024
PICK_SPAN = 12000  # ports below the ephemeral range picked from: a few thousand tries' worth even on a busy host
TRIES = 200


def ephemeral_range(path: Path = PORT_RANGE) -> tuple[int, int]:
    """The kernel's range for bind(0) and outgoing connections' local ports."""
    try:
        lo, hi = (int(x) for x in path.read_text().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL
    return lo, hi


def bindable(port: int) -> bool:
    """Whether nothing holds `port` on any interface now (a child may bind it on all of them: tcp://*:port)."""
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_port(offsets: Sequence[int] = (0,), rng: random.Random | None = None) -> int:
    """A port P, below the ephemeral range, with P + o bindable for every o in `offsets` (a publisher block: vLLM's
    KV-event ports at node offsets, their replay ports 10 above)."""
    if not offsets or min(offsets) < 0:
        raise ValueError(f"offsets must be non-negative and not empty, got {list(offsets)}")
    rng = rng or random.Random()
    lo, _ = ephemeral_range()
    floor, top = max(FIRST_UNPRIVILEGED, lo - PICK_SPAN), lo - max(offsets)
    if top - floor < TRIES:
        raise RuntimeError(f"the ephemeral range starts at {lo}: no room below it for ports to pick")
    for _ in range(TRIES):
        port = rng.randrange(floor, top)
        if all(bindable(port + o) for o in offsets):
            return port
    raise RuntimeError(f"no free block {list(offsets)} in {TRIES} tries between {floor} and {top}")
