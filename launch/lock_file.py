"""The lock files (lock/*.txt, `make lock`): their exact pins, and how an installed environment differs from them.
Read by `ucm-serve env`, by `make check-latest` (lock/newer_than_lock.py) and by the test that the venv is the lock."""

from __future__ import annotations

import importlib.metadata as metadata
import re
from pathlib import Path

LOCKS = Path(__file__).resolve().parents[1] / "lock"
PIN = re.compile(r"^([A-Za-z0-9_.\-]+)==([^\s\\;]+)")


def normalize(name: str) -> str:
    """A distribution's name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(lock: Path) -> dict[str, str]:
    """name -> version of every `name==version` line of a lock file."""
    return {normalize(m[1]): m[2] for line in lock.read_text().splitlines() if (m := PIN.match(line))}


def installed() -> dict[str, str]:
    """name -> version of every distribution in the running environment."""
    return {normalize(d.metadata["Name"]): d.version for d in metadata.distributions()}


def differences(lock: Path) -> dict[str, tuple[str, str | None]]:
    """name -> (locked, installed or None) for each pin the running environment does not have exactly."""
    have = installed()
    return {n: (v, have.get(n)) for n, v in pins(lock).items() if have.get(n) != v}
