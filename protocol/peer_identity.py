"""The ZeroMQ routing identity of a node's sockets: `<node_id>/<channel>/<instance>`.

A node has two DEALERs on the router's ROUTER socket: the job socket (channel `job`) and the heartbeat socket
(channel `hb`, which also registers). `instance` is the random id of the node process (`Register.instance`).

Why the instance is in the identity: the router's ROUTER socket hands an identity over to whoever connects with it
last (a restarted node must get its jobs). If identities were just node ids, any peer allowed to connect could
take over `decode-0` before sending a single message, and the router would send decode-0's jobs to it. The
instance travels only inside the node's encrypted Register, so no other peer can name the job socket the router
sends to; the router learns it from a Register whose CURVE key belongs to that node (router/node_gate.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

MAX_NODE_ID_CHARS = 128
_MAX_IDENTITY_BYTES = 255  # ZeroMQ's limit on a routing id


class Channel(enum.Enum):
    JOB = "job"
    HEARTBEAT = "hb"


def check_node_id(node_id: str) -> str:
    """ValueError for a node id that cannot be part of an identity."""
    if not node_id or "/" in node_id or len(node_id) > MAX_NODE_ID_CHARS or node_id != node_id.strip():
        raise ValueError(
            f"bad node id {node_id!r}: non-empty, no '/', no surrounding spaces, at most {MAX_NODE_ID_CHARS} characters"
        )
    return node_id


@dataclass(frozen=True)
class PeerIdentity:
    node_id: str
    channel: Channel
    instance: str

    def __post_init__(self) -> None:
        check_node_id(self.node_id)
        if not self.instance or "/" in self.instance or len(self.instance) > 64:
            raise ValueError(f"bad instance {self.instance!r}")

    def encode(self) -> bytes:
        raw = f"{self.node_id}/{self.channel.value}/{self.instance}".encode()
        assert len(raw) <= _MAX_IDENTITY_BYTES, f"identity of {len(raw)} bytes"
        return raw

    @classmethod
    def parse(cls, raw: bytes) -> PeerIdentity:
        """ValueError for anything that is not an identity our nodes use."""
        if len(raw) > _MAX_IDENTITY_BYTES:
            raise ValueError(f"identity of {len(raw)} bytes")
        try:
            node_id, channel, instance = raw.decode("utf-8").split("/")
        except (UnicodeDecodeError, ValueError) as e:
            raise ValueError(f"identity {raw[:64]!r} is not <node_id>/<channel>/<instance>") from e
        try:
            kind = Channel(channel)
        except ValueError as e:
            raise ValueError(f"identity {raw[:64]!r}: unknown channel {channel!r}") from e
        return cls(node_id, kind, instance)
