"""ZeroMQ frames no peer should send, fired at a running router's node socket and at a store daemon: random
bytes, truncated or hostile msgpack, wrong frame counts, messages of the wrong kind. Nothing may crash either
process (benchmarks/faults.py checks that every process is alive and serving afterwards)."""

from __future__ import annotations

import random

import msgspec
import zmq

from protocol import messages as P


def _frames(rng: random.Random) -> list[list[bytes]]:
    deep = b"\x91" * 5000 + b"\xc0"  # a 5000-deep msgpack array
    return [
        [b"\xa1\xff"],
        [b"\x00" * 64],
        [rng.randbytes(1024)],
        [rng.randbytes(64), rng.randbytes(64), rng.randbytes(64)],  # a frame count no message has
        [deep],
        [msgspec.msgpack.encode({"type": []})],
        [msgspec.msgpack.encode({"type": "register", "node_id": 5})],
        [
            msgspec.msgpack.encode(
                {"type": "heartbeat", "node_id": "ghost", "running": -1, "waiting": 2**63 - 1, "free_blocks": "x"}
            )
        ],
        [msgspec.msgpack.encode({"type": "tokens", "request_id": "nope", "token_ids": [1, 2, 3]})],
        [msgspec.msgpack.encode({"type": "lookup", "req_id": 1, "keys": [b"\x00" * 3] * 10})],
        [msgspec.msgpack.encode({"type": "load", "req_id": 2, "blocks": [{"key": 1}], "layers": list(range(10**4))})],
        [b""],
    ]


def fire(address: str, rounds: int = 3, seed: int = 0) -> int:
    """Send every hostile message `rounds` times to `address` from a fresh DEALER each round; the number sent."""
    rng = random.Random(seed)
    ctx = zmq.Context.instance()
    sent = 0
    for i in range(rounds):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, f"fuzzer-{seed}-{i}".encode())
        sock.connect(address)
        try:
            for frames in _frames(rng):
                sock.send_multipart(frames)
                sent += 1
            # A well-formed message of the wrong kind for this peer too.
            sock.send(P.encode(P.Abort(request_ids=["no-such-request"])))
            sent += 1
            while sock.poll(200):  # drain whatever the peer answers; its answers are not judged here
                sock.recv_multipart()
        finally:
            sock.close(0)
    return sent
