"""CURVE authentication for the store daemon's socket: key files, and applying them to ZeroMQ sockets.

Key files are the z85 certificates `zmq.auth.create_certificates` writes (`NAME.key` public only,
`NAME.key_secret` both halves). `generate_keys(DIR)` lays out one server and one client pair:

    DIR/server.key  DIR/server.key_secret       the daemon:  --curve-keys DIR  (or --server-key + --authorized)
    DIR/client.key  DIR/client.key_secret       a client:    StoreClient(addr, auth=ClientAuth.from_dir(DIR))
    DIR/authorized/client.key                   public keys the daemon accepts (add more .key files here)

Handing a client `DIR` gives it the server's public key and its own pair; the server's secret is only read
by the daemon. The daemon's ZAP handler (`zmq.auth.thread.ThreadAuthenticator`) refuses any peer whose
public key is not in the authorized folder: the handshake fails, nothing it sends reaches the daemon.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

SERVER = "server"
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

    @classmethod
    def of(cls, directory: str | os.PathLike[str], client: str = CLIENT) -> KeyPaths:
        d = Path(directory)
        return cls(d, d / f"{SERVER}.key", d / f"{SERVER}.key_secret", d / f"{client}.key",
                   d / f"{client}.key_secret", d / AUTHORIZED)

    def server_auth(self) -> ServerAuth:
        return ServerAuth(self.server_secret, self.authorized)

    def client_auth(self) -> ClientAuth:
        return ClientAuth(self.client_secret, self.server_public)


def generate_keys(directory: str | os.PathLike[str], clients: tuple[str, ...] = (CLIENT,)) -> KeyPaths:
    """Write a server pair and one pair per client name into `directory` (created, mode 0700); authorize the clients.

    Existing files are overwritten: regenerating is how keys are rotated. Returns the paths of the first client.
    """
    if not clients:
        raise ValueError("generate_keys: name at least one client")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)  # secret keys inside: owner only
    (d / AUTHORIZED).mkdir(exist_ok=True)
    zmq.auth.create_certificates(d, SERVER)
    for name in clients:
        if not name or "/" in name or name == SERVER:
            raise ValueError(f"generate_keys: bad client name {name!r}")
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

    def apply(self, ctx: zmq.Context, sock: zmq.Socket) -> ThreadAuthenticator:
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


@dataclass(frozen=True)
class ClientAuth:
    """A client's side: its own key pair (the .key_secret file) and the server's public key file."""

    secret_file: Path
    server_public_file: Path

    @classmethod
    def from_dir(cls, directory: str | os.PathLike[str], client: str = CLIENT) -> ClientAuth:
        return KeyPaths.of(directory, client).client_auth()

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

    def apply(self, sock: zmq.Socket) -> None:
        """Make `sock` (not yet connected) a CURVE client of the server whose public key we hold."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_serverkey = self.server_public
