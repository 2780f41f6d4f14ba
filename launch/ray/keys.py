"""CURVE keys for a Ray deployment: generated once by the deploying driver, handed to each actor as bytes in its
constructor arguments (Ray's control plane), and written by the actor into a private folder on its own host.

Each actor gets only what it needs (common/auth.py lays the files out):

    router      router.key_secret + authorized/<node>.key + server.key  (no store secret, no node secrets)
    store       server.key_secret + authorized/<node>.key + the status client's pair (its own stats reads) + router.key
    node NAME   NAME.key_secret + router.key + server.key            (its own pair and the servers' public keys)

The status client is authorized by the store only: the router's folder never holds it, so it cannot register as a
node. Secrets cross the network inside Ray's actor-creation messages: see docs/deploy.md for how to protect them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from common.auth import AUTHORIZED, ROUTER, SERVER, generate_keys
from launch.ray.spec import STATUS_CLIENT


@dataclass(frozen=True)
class KeyFiles:
    """Key files by path relative to a key folder (`router.key`, `authorized/decode-0.key`, ...)."""

    files: dict[str, bytes] = field(repr=False)

    def write(self) -> Path:
        """A fresh private folder (0700; secrets 0600) holding these files; the caller removes it."""
        folder = Path(tempfile.mkdtemp(prefix="ucm-keys-"))
        (folder / AUTHORIZED).mkdir()
        for rel, data in self.files.items():
            path = folder / rel
            assert path.parent in (folder, folder / AUTHORIZED), f"unexpected key path {rel!r}"
            path.write_bytes(data)
            os.chmod(path, 0o600 if rel.endswith(".key_secret") else 0o644)
        return folder


@dataclass(frozen=True)
class KeyBundle:
    """Every pair of a deployment: the servers', one per possible node id, and the store's status client."""

    files: dict[str, bytes] = field(repr=False)
    nodes: tuple[str, ...]

    @classmethod
    def generate(cls, node_names: tuple[str, ...]) -> KeyBundle:
        folder = tempfile.mkdtemp(prefix="ucm-keys-")
        try:
            generate_keys(folder, (*node_names, STATUS_CLIENT))
            root = Path(folder)
            files = {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return cls(files, node_names)

    def _pick(self, *rels: str) -> dict[str, bytes]:
        missing = [r for r in rels if r not in self.files]
        assert not missing, f"key bundle lacks {missing}"
        return {r: self.files[r] for r in rels}

    def _authorized(self, names: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(f"{AUTHORIZED}/{n}.key" for n in names)

    def for_router(self) -> KeyFiles:
        # server.key: the store's public key, to subscribe to its tiers' KV events
        return KeyFiles(
            self._pick(f"{ROUTER}.key", f"{ROUTER}.key_secret", f"{SERVER}.key", *self._authorized(self.nodes))
        )

    def for_store(self) -> KeyFiles:
        return KeyFiles(
            self._pick(
                f"{SERVER}.key",
                f"{SERVER}.key_secret",
                f"{STATUS_CLIENT}.key",
                f"{STATUS_CLIENT}.key_secret",
                f"{ROUTER}.key",  # the tiers' KV events publisher lets the router subscribe
                *self._authorized((*self.nodes, STATUS_CLIENT)),
            )
        )

    def for_node(self, node_id: str) -> KeyFiles:
        if node_id not in self.nodes:
            raise ValueError(f"no key for node {node_id!r}: keys exist for {len(self.nodes)} node ids")
        return KeyFiles(self._pick(f"{node_id}.key", f"{node_id}.key_secret", f"{ROUTER}.key", f"{SERVER}.key"))
