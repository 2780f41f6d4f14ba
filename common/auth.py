"""CURVE authentication for the store daemon's and the router's sockets: key files, and applying them to ZeroMQ
sockets.

Key files are the z85 certificates `zmq.auth.create_certificates` writes (`NAME.key` public only,
`NAME.key_secret` both halves). `generate_keys(DIR, clients)` lays out one folder serving both links:

    DIR/server.key  DIR/server.key_secret       the store daemon: --curve-keys DIR (or --server-key + --authorized)
    DIR/router.key  DIR/router.key_secret       the router's node socket: ucm-serve router --curve-keys DIR
    DIR/NAME.key    DIR/NAME.key_secret         client NAME (a node: NAME is its node id), e.g.
                                                StoreClient(addr, auth=ClientAuth.from_dir(DIR, NAME))
    DIR/authorized/NAME.key                     public keys both servers accept (add more .key files here)

A node's KV event sockets (common/kv_events/publisher.py) are CURVE servers too, with the node's own pair
(`PublisherAuth`): they accept the router's key and every key in DIR/authorized/, so a consumer of the events
(the router's prefix index, or one written for vLLM) connects with a pair from the folder and the node's public
key DIR/NODE.key as its server key (`ServerAuth.client_keys_for`).

Handing a client `DIR` gives it the servers' public keys and its own pair; a server's secret is only read
by that server. The ZAP handler (`zmq.auth.thread.ThreadAuthenticator`) refuses any peer whose public key is
not in the authorized folder: the handshake fails, nothing it sends reaches the server. The router also binds
each key to its file name (`ServerAuth.peer_names`): key NAME may speak only as node NAME.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

SERVER = "server"  # the store daemon's pair
ROUTER = "router"  # the router's node-socket pair
CLIENT = "client"
AUTHORIZED = "authorized"
INSECURE_WARNING = "store daemon running without authentication (--insecure)"


@dataclass(frozen=True)
class KeyPaths:
    """Where `generate_keys` put each file."""

    dir: Path
    server_public: Path
    server_secret: Path
    client_public: Path
    client_secret: Path
    authorized: Path  # folder of client public keys the daemon accepts
    router_public: Path
    router_secret: Path

    @classmethod
    def of(cls, directory: str | os.PathLike[str], client: str = CLIENT) -> KeyPaths:
        d = Path(directory)
        return cls(
            d,
            d / f"{SERVER}.key",
            d / f"{SERVER}.key_secret",
            d / f"{client}.key",
            d / f"{client}.key_secret",
            d / AUTHORIZED,
            d / f"{ROUTER}.key",
            d / f"{ROUTER}.key_secret",
        )

    def server_auth(self) -> ServerAuth:
        """The store daemon's side."""
        return ServerAuth(self.server_secret, self.authorized)

    def client_auth(self) -> ClientAuth:
        """The client's side of the store link."""
        return ClientAuth(self.client_secret, self.server_public)

    def router_auth(self) -> ServerAuth:
        """The router's node socket."""
        return ServerAuth(self.router_secret, self.authorized)

    def router_client_auth(self) -> ClientAuth:
        """A node's side of the router link (the same client pair as for the store)."""
        return ClientAuth(self.client_secret, self.router_public)


def check_client_name(name: str) -> str:
    """A client key's name is also a node id on the router link: no '/' (it separates socket identity parts)."""
    if not name or "/" in name or name in (SERVER, ROUTER) or name != name.strip() or len(name) > 128:
        raise ValueError(
            f"bad client key name {name!r} (non-empty, no '/', at most 128 characters, not {SERVER!r} or {ROUTER!r})"
        )
    return name


def generate_keys(directory: str | os.PathLike[str], clients: tuple[str, ...] = (CLIENT,)) -> KeyPaths:
    """Write the store's and the router's server pairs and one pair per client name into `directory` (created,
    mode 0700); authorize the clients.

    Existing files are overwritten: regenerating is how keys are rotated. Returns the paths of the first client.
    """
    if not clients:
        raise ValueError("generate_keys: name at least one client")
    for name in clients:
        check_client_name(name)
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)  # secret keys inside: owner only
    (d / AUTHORIZED).mkdir(exist_ok=True)
    zmq.auth.create_certificates(d, SERVER)
    zmq.auth.create_certificates(d, ROUTER)
    for name in clients:
        public, _ = zmq.auth.create_certificates(d, name)
        (d / AUTHORIZED / f"{name}.key").write_bytes(Path(public).read_bytes())
    for secret in d.glob("*.key_secret"):
        os.chmod(secret, 0o600)
    return KeyPaths.of(d, clients[0])


def _load_pair(path: Path) -> tuple[bytes, bytes]:
    if not path.is_file():
        raise ValueError(f"key file {path} does not exist")
    public, secret = zmq.auth.load_certificate(path)
    if secret is None:
        raise ValueError(f"{path} holds no secret key (pass the .key_secret file)")
    return public, secret


@dataclass(frozen=True)
class ServerAuth:
    """The daemon's side: its secret key file and the folder of client public keys it accepts."""

    secret_file: Path
    authorized_dir: Path

    def __post_init__(self) -> None:
        if not Path(self.authorized_dir).is_dir():
            raise ValueError(f"authorized client keys folder {self.authorized_dir} does not exist")

    def apply(self, ctx: zmq.Context[Any], sock: zmq.Socket[Any]) -> ThreadAuthenticator:
        """Make `sock` (not yet bound) a CURVE server; start and return the ZAP handler (stop it at shutdown)."""
        public, secret = _load_pair(Path(self.secret_file))
        authenticator = ThreadAuthenticator(ctx)
        authenticator.start()
        # Loaded once, at start: adding a client key needs a daemon restart (documented in docs/security.md).
        authenticator.configure_curve(domain="*", location=str(self.authorized_dir))
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True
        return authenticator

    def client_keys_for(self, peer: str) -> CurveClientKeys:
        """This server's pair as a CURVE client of peer `peer`'s own server (the router subscribing to node NAME's
        KV events): NAME's public key is the one authorized under its name. ValueError if there is none."""
        return self.client_keys_with(Path(self.authorized_dir) / f"{check_client_name(peer)}.key")

    def client_keys_with(self, peer_file: Path) -> CurveClientKeys:
        """This server's pair as a CURVE client of the server whose public key is `peer_file` (the router subscribing
        to the store daemon's KV events: DIR/server.key). ValueError if the file is missing."""
        if not Path(peer_file).is_file():
            raise ValueError(f"no public key {peer_file}")
        public, secret = _load_pair(Path(self.secret_file))
        peer_public, _ = zmq.auth.load_certificate(peer_file)
        return CurveClientKeys(public, secret, peer_public)

    def peer_names(self) -> dict[str, str]:
        """z85 public key (ZAP's User-Id) -> the name of its file in the authorized folder, read now.

        The router lets key NAME speak only as node NAME, so one key must not appear under two names."""
        names: dict[str, str] = {}
        for path in sorted(Path(self.authorized_dir).glob("*.key")):
            public, _ = zmq.auth.load_certificate(path)
            user_id = public.decode("ascii")
            if user_id in names and names[user_id] != path.stem:
                raise ValueError(f"the key in {path} is also authorized as {names[user_id]!r}: one name per key")
            names[user_id] = path.stem
        return names


@dataclass(frozen=True)
class ClientAuth:
    """A client's side: its own key pair (the .key_secret file) and the server's public key file."""

    secret_file: Path
    server_public_file: Path

    @classmethod
    def from_dir(cls, directory: str | os.PathLike[str], client: str = CLIENT) -> ClientAuth:
        """The store link's client side."""
        return KeyPaths.of(directory, client).client_auth()

    @classmethod
    def for_router(cls, directory: str | os.PathLike[str], client: str) -> ClientAuth:
        """The router link's client side: client `client`'s pair and the router's public key."""
        return KeyPaths.of(directory, client).router_client_auth()

    def load(self) -> CurveClientKeys:
        """Read the key files (once per client, not once per socket); ValueError naming a missing file."""
        public, secret = _load_pair(Path(self.secret_file))
        if not Path(self.server_public_file).is_file():
            raise ValueError(f"server public key file {self.server_public_file} does not exist")
        server_public, _ = zmq.auth.load_certificate(self.server_public_file)
        return CurveClientKeys(public, secret, server_public)


@dataclass(frozen=True)
class CurveClientKeys:
    public: bytes
    secret: bytes = field(repr=False)
    server_public: bytes

    def apply(self, sock: zmq.Socket[Any]) -> None:
        """Make `sock` (not yet connected) a CURVE client of the server whose public key we hold."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_serverkey = self.server_public


@dataclass(frozen=True)
class PublisherAuth:
    """A node's KV event sockets (PUB and replay ROUTER) as CURVE servers: the node's own pair; the subscribers
    accepted are the router's key and every key in the authorized folder, read when the publisher starts."""

    secret_file: Path
    authorized_dir: Path
    router_public_file: Path

    @classmethod
    def from_client(cls, auth: ClientAuth) -> PublisherAuth:
        """From a node's router link (its pair, the router's public key), in the folder `generate_keys` wrote."""
        secret = Path(auth.secret_file)
        return cls(secret, secret.parent / AUTHORIZED, Path(auth.server_public_file))

    def accepted_keys(self) -> set[bytes]:
        """z85 public keys allowed to subscribe."""
        keys = {zmq.auth.load_certificate(path)[0] for path in sorted(Path(self.authorized_dir).glob("*.key"))}
        if not Path(self.router_public_file).is_file():
            raise ValueError(f"router public key file {self.router_public_file} does not exist")
        keys.add(zmq.auth.load_certificate(self.router_public_file)[0])
        return keys

    def start(self, ctx: zmq.Context[Any]) -> ThreadAuthenticator:
        """The context's ZAP handler accepting `accepted_keys` (stop it at shutdown); one per context."""
        authenticator = ThreadAuthenticator(ctx)
        authenticator.start()
        authenticator.configure_curve_callback(domain="*", credentials_provider=_KeySet(self.accepted_keys()))
        return authenticator

    def serve(self, sock: zmq.Socket[Any]) -> None:
        """Make `sock` (not yet bound or connected) a CURVE server with the node's pair."""
        public, secret = _load_pair(Path(self.secret_file))
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True


@dataclass(frozen=True)
class _KeySet:
    """pyzmq's ZAP credentials provider: a fixed set of z85 keys."""

    keys: set[bytes]

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys
