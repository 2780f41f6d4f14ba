"""The router's API key check: `Authorization: Bearer <key>`, compared in constant time."""

from __future__ import annotations

import secrets
from collections.abc import Iterable


def bearer_token(headers: Iterable[tuple[bytes, bytes]]) -> bytes:
    """The token of the first Authorization header (ASGI raw headers, names lower-case); b"" without one."""
    for key, value in headers:
        if key == b"authorization":
            return value[7:] if value[:7].lower() == b"bearer " else b""
    return b""


def authorized(headers: Iterable[tuple[bytes, bytes]], api_key: str) -> bool:
    return secrets.compare_digest(bearer_token(headers), api_key.encode())
