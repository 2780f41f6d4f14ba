"""Issue 11, router side, without model processes: the router's real node socket (NodeClient over CURVE) against
fake nodes on real ZeroMQ sockets; key files, socket identities, the gate, the node/router CLI flags, backoff."""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import pytest
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from common.auth import ClientAuth, CurveClientKeys, KeyPaths, generate_keys
from launch.supervisor import RestartPolicy
from protocol import messages as P
from protocol.peer_identity import Channel, PeerIdentity
from router.node_client import NodeClient
from router.node_gate import DropReason, NodeGate
from router.registry import Registry

FAILED = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL


async def _until(what: str, condition, timeout_s: float = 30.0) -> None:
    """Poll `condition` until it holds; AssertionError naming `what` after `timeout_s` (a generous bound: only a
    condition that never comes true reaches it)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def _register(node_id: str, instance: str, max_model_len: int = 2048) -> P.Register:
    return P.Register(
        node_id, P.NodeRole.DECODE, "m", "fp", "float32", 16, max_model_len, 8, 100, True, instance=instance
    )


def test_identity_round_trip_and_refusals() -> None:
    peer = PeerIdentity("decode-0", Channel.JOB, "ab12")
    assert PeerIdentity.parse(peer.encode()) == peer and peer.encode() == b"decode-0/job/ab12"
    for raw in (b"decode-0", b"decode-0/hb", b"decode-0/xx/ab", b"a/b/c/d", b"\xff/hb/x", b"/hb/x", b"x" * 300):
        with pytest.raises(ValueError):
            PeerIdentity.parse(raw)


def test_keys_serve_both_links_and_name_each_key(tmp_path) -> None:
    paths = generate_keys(tmp_path / "k", ("prefill-0", "decode-0"))
    assert paths.router_secret.is_file() and paths.server_secret.is_file()
    assert (paths.dir.stat().st_mode & 0o777) == 0o700 and (paths.router_secret.stat().st_mode & 0o777) == 0o600
    names = paths.router_auth().peer_names()
    assert sorted(names.values()) == ["decode-0", "prefill-0"]
    assert (
        ClientAuth.for_router(paths.dir, "decode-0").load().server_public
        != ClientAuth.from_dir(paths.dir, "decode-0").load().server_public
    )  # router and store are different servers
    (paths.authorized / "alias.key").write_bytes((paths.authorized / "decode-0.key").read_bytes())
    with pytest.raises(ValueError, match="one name per key"):
        paths.router_auth().peer_names()
    for bad in ("a/b", "router", "server", ""):
        with pytest.raises(ValueError):
            generate_keys(tmp_path / "bad", (bad,))


def test_gate_binds_keys_to_node_ids() -> None:
    gate = NodeGate({"KEY-A": "decode-0", "KEY-B": "intruder"})
    hb = PeerIdentity("decode-0", Channel.HEARTBEAT, "i1").encode()
    assert gate.peer(hb, "KEY-A") == PeerIdentity("decode-0", Channel.HEARTBEAT, "i1")
    assert gate.peer(hb, "KEY-B") is DropReason.WRONG_KEY
    assert gate.peer(b"decode-0", "KEY-A") is DropReason.BAD_IDENTITY
    assert gate.peer(hb, "KEY-C") is DropReason.UNKNOWN_KEY
    peer = gate.peer(PeerIdentity("intruder", Channel.HEARTBEAT, "i2").encode(), "KEY-B")
    assert gate.check(peer, _register("decode-0", "i2")) is DropReason.WRONG_NODE
    assert gate.check(peer, _register("intruder", "other")) is DropReason.WRONG_NODE  # instance of its socket only
    assert gate.check(peer, _register("intruder", "i2")) is None
    assert gate.check(peer, P.TokenBatch("r1", [1])) is DropReason.WRONG_CHANNEL
    assert sum(gate.dropped.values()) == 6
    insecure = NodeGate(None)
    assert insecure.peer(hb, None) == PeerIdentity("decode-0", Channel.HEARTBEAT, "i1")


def test_restart_backoff_doubles_up_to_the_cap() -> None:
    policy = RestartPolicy(first_delay_s=0.5, max_delay_s=5.0)
    assert [policy.delay_s(n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    with pytest.raises(ValueError):
        RestartPolicy(first_delay_s=6.0, max_delay_s=5.0)


def _node_args(**kw: object) -> argparse.Namespace:
    from node.config import add_node_args

    parser = argparse.ArgumentParser()
    add_node_args(parser)
    argv = ["--router", "tcp://127.0.0.1:1", "--device", "cpu"]
    for key, value in kw.items():
        flag = "--" + key.replace("_", "-")
        argv += [flag] if value is True else [flag, str(value)]
    return parser.parse_args(argv)


def test_node_flags_need_keys_or_insecure(tmp_path) -> None:
    from node.config import config_from_args

    keys = generate_keys(tmp_path / "k", ("decode-0",))
    with pytest.raises(ValueError, match="--insecure"):
        config_from_args(_node_args(), P.NodeRole.DECODE)
    with pytest.raises(ValueError, match="--node-id"):
        config_from_args(_node_args(curve_keys=keys.dir), P.NodeRole.DECODE)
    with pytest.raises(ValueError, match="does not exist"):  # no key named for this node id
        config_from_args(_node_args(curve_keys=keys.dir, node_id="decode-9"), P.NodeRole.DECODE)
    config = config_from_args(
        _node_args(curve_keys=keys.dir, node_id="decode-0", store="tcp://127.0.0.1:2"), P.NodeRole.DECODE
    )
    assert config.router_auth == ClientAuth.for_router(keys.dir, "decode-0")
    assert (
        config.store_addr == f"tcp://127.0.0.1:2?curve_keys={str(keys.dir).replace('/', '%2F')}&curve_client=decode-0"
    )
    from connector.store_spec import StoreSpec

    spec = StoreSpec.parse(config.store_addr)
    assert spec.curve_keys == str(keys.dir) and spec.curve_client == "decode-0"
    assert config_from_args(_node_args(insecure=True), P.NodeRole.DECODE).router_auth is None


def test_router_flags_need_keys_or_insecure(tmp_path) -> None:
    from router.cli import build_parser, node_auth_from_args

    keys = generate_keys(tmp_path / "k", ("decode-0",))
    with pytest.raises(ValueError, match="--insecure"):
        node_auth_from_args(build_parser().parse_args([]))
    with pytest.raises(ValueError, match="contradicts"):
        node_auth_from_args(build_parser().parse_args(["--insecure", "--curve-keys", str(keys.dir)]))
    assert node_auth_from_args(build_parser().parse_args(["--curve-keys", str(keys.dir)])) == keys.router_auth()
    assert node_auth_from_args(build_parser().parse_args(["--insecure"])) is None


# ---------------------------------------------------------------- the real socket


def _dealer(
    ctx: zmq.asyncio.Context, addr: str, identity: PeerIdentity | bytes, keys: CurveClientKeys | None
) -> tuple[zmq.asyncio.Socket, zmq.Socket]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity.encode() if isinstance(identity, PeerIdentity) else identity)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        keys.apply(sock)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | FAILED)
    sock.connect(addr)
    return sock, monitor


async def _handshake(monitor: zmq.asyncio.Socket) -> int:
    """The first handshake event of a socket (success or failure)."""
    return parse_monitor_message(await monitor.recv_multipart())["event"]


async def _recv(sock: zmq.asyncio.Socket, timeout: float = 30.0) -> P.Message:
    return P.decode(await asyncio.wait_for(sock.recv(), timeout))


def test_router_socket_binds_node_ids_to_keys(tmp_path) -> None:
    keys = generate_keys(tmp_path / "k", ("decode-0", "intruder"))
    stranger = generate_keys(tmp_path / "other", ("decode-0",))  # a well-formed pair the router does not know
    events: list[tuple[str, str]] = []

    async def main() -> None:
        registry = Registry("m", timeout_s=60.0)
        client = NodeClient("tcp://127.0.0.1:0", registry, keys.router_auth())
        client.on_node_event.append(lambda node, event: events.append((node, event)))
        await client.start()
        ctx = zmq.asyncio.Context()
        socks = []
        try:
            node_keys = ClientAuth.for_router(keys.dir, "decode-0").load()
            hb, hb_monitor = _dealer(
                ctx, client.address, PeerIdentity("decode-0", Channel.HEARTBEAT, "real"), node_keys
            )
            job, job_monitor = _dealer(ctx, client.address, PeerIdentity("decode-0", Channel.JOB, "real"), node_keys)
            socks += [hb, job, hb_monitor, job_monitor]
            assert await asyncio.wait_for(_handshake(job_monitor), 30) == zmq.EVENT_HANDSHAKE_SUCCEEDED
            await hb.send(P.encode(_register("decode-0", "real")))
            welcome = await _recv(hb)
            assert isinstance(welcome, P.Welcome) and welcome.accepted

            # No key the router knows (and no CURVE at all): refused in the handshake.
            bad_keys = CurveClientKeys(*zmq.auth.load_certificate(stranger.client_secret), node_keys.server_public)
            for creds in (bad_keys, None):
                sock, monitor = _dealer(ctx, client.address, PeerIdentity("fake-0", Channel.HEARTBEAT, "f"), creds)
                socks += [sock, monitor]
                await sock.send(P.encode(_register("fake-0", "f")))
                event = await asyncio.wait_for(_handshake(monitor), 30)
                assert event & FAILED, f"handshake event {event}"
            assert "fake-0" not in registry.nodes

            # A valid key of another name: its sockets claiming decode-0, or Registers naming decode-0, are dropped.
            intruder = ClientAuth.for_router(keys.dir, "intruder").load()
            attempts = [
                (b"decode-0", _register("decode-0", "evil", 8)),
                (PeerIdentity("decode-0", Channel.HEARTBEAT, "evil"), _register("decode-0", "evil", 8)),
                (PeerIdentity("decode-0", Channel.JOB, "evil"), P.Heartbeat("decode-0", 0, 0, 0)),
                (PeerIdentity("intruder", Channel.HEARTBEAT, "evil"), _register("decode-0", "evil", 8)),
            ]
            evil = []
            for identity, msg in attempts:
                sock, monitor = _dealer(ctx, client.address, identity, intruder)
                socks += [sock, monitor]
                evil.append(sock)
                await sock.send(P.encode(msg))
            # Even a peer that learnt the real job socket's identity cannot take it over (no handover).
            thief, thief_monitor = _dealer(ctx, client.address, PeerIdentity("decode-0", Channel.JOB, "real"), intruder)
            socks += [thief, thief_monitor]
            evil.append(thief)
            assert await asyncio.wait_for(_handshake(thief_monitor), 30) == zmq.EVENT_HANDSHAKE_SUCCEEDED
            await _until("the gate to drop every attempt", lambda: sum(client.gate.dropped.values()) >= len(attempts))
            assert client.gate.dropped == {
                DropReason.BAD_IDENTITY: 1,
                DropReason.WRONG_KEY: 2,
                DropReason.WRONG_NODE: 1,
            }
            assert events.count(("intruder", "unauthorized")) == 4
            assert registry.nodes["decode-0"].info.max_model_len == 2048 and set(registry.nodes) == {"decode-0"}

            # Jobs for decode-0 reach the socket its own Register named, whoever else claims that identity.
            job_msg = P.DecodeJob("r1", [1, 2, 3], P.SamplingSpec(max_tokens=1))
            await client.send("decode-0", job_msg)
            assert await _recv(job) == job_msg
            assert not any([await s.poll(0) for s in evil]), "an intruder socket received something"
        finally:
            for sock in socks:
                sock.close(0)
            ctx.term()
            await client.close()

    asyncio.run(main())


def test_restarted_node_gets_jobs_at_its_new_socket(tmp_path) -> None:
    """A new incarnation (new instance) replaces the old one's route; Abort goes to both."""
    keys = generate_keys(tmp_path / "k", ("decode-0",))

    async def main() -> None:
        registry = Registry("m", timeout_s=60.0)
        client = NodeClient("tcp://127.0.0.1:0", registry, keys.router_auth())
        await client.start()
        ctx = zmq.asyncio.Context()
        node_keys = ClientAuth.for_router(keys.dir, "decode-0").load()
        socks = []
        try:
            jobs = []
            for instance in ("one", "two"):
                hb, hb_monitor = _dealer(
                    ctx, client.address, PeerIdentity("decode-0", Channel.HEARTBEAT, instance), node_keys
                )
                job, job_monitor = _dealer(
                    ctx, client.address, PeerIdentity("decode-0", Channel.JOB, instance), node_keys
                )
                socks += [hb, job, hb_monitor, job_monitor]
                jobs.append(job)
                assert await asyncio.wait_for(_handshake(job_monitor), 30) == zmq.EVENT_HANDSHAKE_SUCCEEDED
                await hb.send(P.encode(_register("decode-0", instance)))
                assert (await _recv(hb)).accepted
            assert registry.nodes["decode-0"].info.instance == "two"
            await client.send("decode-0", P.Abort(["x"]))
            assert await _recv(jobs[1]) == P.Abort(["x"])
            await client.abort("decode-0", ["y"])
            assert await _recv(jobs[1]) == P.Abort(["y"]) and await _recv(jobs[0]) == P.Abort(["y"])
        finally:
            for sock in socks:
                sock.close(0)
            ctx.term()
            await client.close()

    asyncio.run(main())


def test_key_paths_layout(tmp_path) -> None:
    paths = KeyPaths.of(tmp_path, "n")
    assert paths.router_secret == Path(tmp_path) / "router.key_secret"
    assert paths.router_client_auth() == ClientAuth(Path(tmp_path) / "n.key_secret", Path(tmp_path) / "router.key")


def test_store_daemon_needs_keys_or_insecure(capsys) -> None:
    from ucm.daemon_cli import main

    assert main(["--bind", "tcp://127.0.0.1:0"]) == 2
    assert "--insecure" in capsys.readouterr().err
