"""Which node a message on the router's node socket comes from, or why it is dropped.

With CURVE, ZAP (common/auth.py) has already refused every peer whose key is not authorized, and stamps each frame
with the peer's public key (User-Id). The gate binds keys to node ids: the key authorized as `NAME.key` may speak
only as node `NAME`, on sockets whose identity names node `NAME`, in messages naming node `NAME`. So a key can
never register, heartbeat or answer jobs as another node, and a spoofed Register cannot change another node's
limits. Without CURVE (`--insecure`) a peer is whoever its identity says.
"""

from __future__ import annotations

import enum
from collections import Counter

from protocol import messages as P
from protocol.peer_identity import Channel, PeerIdentity


class DropReason(enum.Enum):
    BAD_IDENTITY = "bad_identity"  # not <node_id>/<channel>/<instance>
    UNKNOWN_KEY = "unknown_key"  # accepted by ZAP but under no name (cannot happen unless the folder changed)
    WRONG_KEY = "wrong_key"  # the identity names a node that another key belongs to
    WRONG_NODE = "wrong_node"  # the message names another node than its socket
    WRONG_CHANNEL = "wrong_channel"  # e.g. a job reply on the heartbeat socket, a Register on the job socket


class NodeGate:
    def __init__(self, key_names: dict[str, str] | None) -> None:
        """key_names: z85 public key -> node id (ServerAuth.peer_names()); None without authentication."""
        self._names = key_names
        self.dropped: Counter[DropReason] = Counter()

    @property
    def secure(self) -> bool:
        return self._names is not None

    def key_name(self, user_id: str | None) -> str | None:
        """The node id a CURVE key may speak as (None: unknown key, or no authentication)."""
        return None if self._names is None or user_id is None else self._names.get(user_id)

    def peer(self, identity: bytes, user_id: str | None) -> PeerIdentity | DropReason:
        """The sending socket, if its identity is well formed and (with CURVE) its key is that node's."""
        try:
            peer = PeerIdentity.parse(identity)
        except ValueError:
            return self._drop(DropReason.BAD_IDENTITY)
        if self._names is not None:
            name = self.key_name(user_id)
            if name is None:
                return self._drop(DropReason.UNKNOWN_KEY)
            if name != peer.node_id:
                return self._drop(DropReason.WRONG_KEY)
        return peer

    def check(self, peer: PeerIdentity, msg: P.Message) -> DropReason | None:
        """Whether `msg` may come from `peer` (None: yes)."""
        if isinstance(msg, P.Register):
            if peer.channel is not Channel.HEARTBEAT:
                return self._drop(DropReason.WRONG_CHANNEL)
            if msg.node_id != peer.node_id or msg.instance != peer.instance:
                return self._drop(DropReason.WRONG_NODE)
        elif isinstance(msg, P.Heartbeat):
            if peer.channel is not Channel.HEARTBEAT:
                return self._drop(DropReason.WRONG_CHANNEL)
            if msg.node_id != peer.node_id:
                return self._drop(DropReason.WRONG_NODE)
        elif isinstance(msg, (*P.JOB_REPLIES, P.StepReplies)) and peer.channel is not Channel.JOB:
            return self._drop(DropReason.WRONG_CHANNEL)
        return None

    def _drop(self, reason: DropReason) -> DropReason:
        self.dropped[reason] += 1
        return reason
