"""ZeroMQ addresses of a KV event publisher: which are bound and which connected (vLLM's rule), the offset each
further node on a host gets (vLLM's per-rank offset), and the address a bound wildcard is reached at.

vLLM binds a PUB endpoint that is a wildcard (`*` or `::` in it), ipc:// or inproc://, and connects to any other
(a consumer then binds: `tcp://indexer:5557`). We add `0.0.0.0`, which cannot be connected to, to the bound kind.
The replay endpoint is always bound.
"""

from __future__ import annotations

import ipaddress
import re
import socket

SCHEMES = ("tcp://", "ipc://", "inproc://")
# The line a publisher process (the store daemon) logs once bound, and how its launcher reads it back.
BOUND_LOG = "KV events of the tiers on %s (replay %s)"
BOUND_PATTERN = r"KV events of the tiers on (\S+) \(replay (\S+)\)"
_WILDCARDS = ("*", "0.0.0.0", "::", "[::]", "")


def check(endpoint: str, name: str) -> None:
    if not endpoint.startswith(SCHEMES):
        raise ValueError(f"{name} {endpoint!r} is not a ZeroMQ address ({', '.join(s + '...' for s in SCHEMES)})")
    if endpoint.startswith("tcp://"):
        tcp_port(endpoint)


def is_bind(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or "0.0.0.0" in endpoint or endpoint.startswith(SCHEMES[1:])


def _split_tcp(endpoint: str) -> tuple[str, str]:
    host, sep, port = endpoint.removeprefix("tcp://").rpartition(":")
    if not sep:
        raise ValueError(f"{endpoint!r} has no port")
    return host, port


def tcp_port(endpoint: str) -> int:
    """The port of a tcp:// address (0 for `*` or 0: one the OS picks); 0 for other schemes."""
    if not endpoint.startswith("tcp://"):
        return 0
    _, port = _split_tcp(endpoint)
    if port == "*":
        return 0
    try:
        value = int(port)
    except ValueError:
        raise ValueError(f"{endpoint!r}: port {port!r} is not a number") from None
    if not 0 <= value < 65536:
        raise ValueError(f"{endpoint!r}: port {value} out of range")
    return value


def offset(endpoint: str, index: int) -> str:
    """The address of the `index`-th publisher on a host (index 0: `endpoint` itself): a tcp port + index (a port
    the OS picks stays so), an ipc/inproc path + `_dp<index>` (vLLM's suffix for its data-parallel ranks)."""
    if index == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        port = tcp_port(endpoint)
        if port == 0:
            return endpoint
        host, _ = _split_tcp(endpoint)
        return f"tcp://{host}:{port + index}"
    return f"{endpoint}_dp{index}"


def reachable(bound: str, toward: str) -> str:
    """How a peer reaches what was bound at `bound` (zmq's LAST_ENDPOINT): a wildcard host becomes this host's
    address on the route to `toward` (the router's address: the peer that subscribes), loopback if that is local."""
    if not bound.startswith("tcp://"):
        return bound
    host, port = _split_tcp(bound)
    if host.strip("[]") not in _WILDCARDS and host not in _WILDCARDS:
        return bound
    local = _local_address(toward)
    return f"tcp://[{local}]:{port}" if ":" in local else f"tcp://{local}:{port}"


def subscription(bound: re.Match[str], toward: str) -> str:
    """`ENDPOINT[,REPLAY]` a subscriber (`--store-kv-events`) is given, from BOUND_PATTERN's match of the log line."""
    pub = reachable(bound.group(1), toward)
    replay = bound.group(2)
    return pub if replay == "None" else f"{pub},{reachable(replay, toward)}"


def _local_address(toward: str) -> str:
    if not toward.startswith("tcp://"):
        return "127.0.0.1"
    host, port = _split_tcp(toward)
    host = host.strip("[]")
    try:
        if ipaddress.ip_address(host).is_loopback:
            return "127.0.0.1"
    except ValueError:
        pass  # a host name
    try:
        info = socket.getaddrinfo(host, int(port) if port.isdigit() else 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(info[0], socket.SOCK_DGRAM) as probe:
            probe.connect(info[4])  # UDP: no packet sent, only the route chosen
            return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"
