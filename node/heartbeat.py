"""Registration and heartbeats on their own thread and socket, so a node stays visibly alive while one long
engine step (a big prefill chunk on CPU) holds the serving loop.

The thread's DEALER has identity `<node_id>/hb/<instance>`; jobs go to the loop's DEALER (`<node_id>/job/<instance>`),
which the router addresses by what it learnt from our Register (protocol/peer_identity.py). With CURVE both sockets
use the node's key pair, the one the router binds to this node id. A router that restarted (or dropped us after missed
heartbeats) answers a heartbeat with Welcome(UNKNOWN_NODE) and we register again.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import msgspec
import zmq

from common.auth import CurveClientKeys
from node.key_cache import RecentKeys
from protocol import messages as P
from protocol.peer_identity import Channel, PeerIdentity

log = logging.getLogger(__name__)


class StoreStatsPoller(threading.Thread):
    """Polls the store's per-tier counters on its own thread: a store that is down may block a call for its
    whole timeout, which must delay neither the serving loop nor the heartbeats."""

    def __init__(self, store: Any, interval_s: float = 2.0) -> None:
        super().__init__(name="ucm-store-stats", daemon=True)
        self._store = store
        self._interval_s = interval_s
        self._halt = threading.Event()
        self.latest: dict[str, float] = {}

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        while not self._halt.wait(self._interval_s):
            try:
                stats = self._store.stats()
            except Exception:  # store down: keep the last numbers, the connector already recomputes
                continue
            out = {
                f"store_{tier.value}_{name}": float(value)
                for tier, ts in stats.tiers.items()
                for name, value in vars(ts).items()
                if isinstance(value, (int, float))
            }
            out["store_lookup_hit_blocks"] = float(stats.lookup_hit_blocks)
            out["store_corrupt_dropped"] = float(stats.corrupt_dropped)  # blocks whose checksum failed on read
            self.latest = out


class HeartbeatThread(threading.Thread):
    def __init__(
        self,
        ctx: zmq.Context,
        router_addr: str,
        register: P.Register,
        interval_s: float,
        recent_keys: RecentKeys,
        keys: CurveClientKeys | None = None,
    ) -> None:
        super().__init__(name="ucm-heartbeat", daemon=True)
        self._ctx = ctx
        self._router_addr = router_addr
        self._register = register
        self._interval_s = interval_s
        self._recent_keys = recent_keys
        self._keys = keys
        self._load = P.Heartbeat(node_id=register.node_id, running=0, waiting=0, free_blocks=register.num_blocks)
        self._halt = threading.Event()
        self.registered = threading.Event()

    def update_load(self, load: P.Heartbeat) -> None:
        # One reference assignment: the thread always sees a complete snapshot.
        self._load = load

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        identity = PeerIdentity(self._register.node_id, Channel.HEARTBEAT, self._register.instance)
        sock.setsockopt(zmq.IDENTITY, identity.encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_MESSAGE_BYTES)
        if self._keys is not None:
            self._keys.apply(sock)
        sock.connect(self._router_addr)
        try:
            self._loop(sock)
        finally:
            sock.close(0)

    def _loop(self, sock: zmq.Socket) -> None:
        sock.send(P.encode(self._register))
        last_register = time.monotonic()
        sent_keys_len = -1
        sent_keys_last: bytes | None = None
        while not self._halt.is_set():
            while sock.poll(0):
                try:
                    msg = P.decode(sock.recv())
                except (ValueError, RecursionError) as e:  # a frame we cannot read must not stop the heartbeats
                    log.warning("dropping a bad message from the router: %s", str(e)[:200])
                    continue
                if isinstance(msg, P.Welcome):
                    if msg.accepted:
                        if not self.registered.is_set():
                            log.info("registered with router %s as %s", self._router_addr, msg.node_id)
                        self.registered.set()
                    elif msg.code is P.WelcomeCode.UNKNOWN_NODE:
                        self.registered.clear()
                        sent_keys_len = -1  # the router forgot our cache summary too
                    else:
                        log.error("router refused registration (%s): %s", msg.code.value, msg.reason)
            if not self.registered.is_set() and time.monotonic() - last_register > 1.0:
                sock.send(P.encode(self._register))
                last_register = time.monotonic()
            keys = self._recent_keys.snapshot()
            changed = len(keys) != sent_keys_len or (keys[-1] if keys else None) != sent_keys_last
            hb = self._load
            if changed:
                hb = msgspec.structs.replace(hb, cached_keys=keys)
                sent_keys_len, sent_keys_last = len(keys), (keys[-1] if keys else None)
            sock.send(P.encode(hb))
            self._halt.wait(self._interval_s)
