"""Which store a connector talks to, parsed from the engine's `kv_store` string.

    embedded                                   in-process store, host DRAM only
    embedded?disk_path=DIR&dram=2GiB&disk=8GiB in-process store with an LMDB tier at DIR
    tcp://127.0.0.1:5555 | ipc:///tmp/ucm.sock a running `ucm-serve store` daemon
    tcp://127.0.0.1:5555?timeout_s=0.5         ... with the client's per-call timeout
    tcp://HOST:PORT?curve_keys=DIR&curve_client=NAME   ... over CURVE with DIR/NAME.key_secret and
                                               DIR/server.key (`ucm-serve store keys DIR`; NAME defaults to client)

Options after `?` for embedded: dram, disk (sizes), disk_path, policy, disk_policy.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from urllib.parse import parse_qsl

from common.size import parse_size
from ucm.eviction import PolicyName
from ucm.store_config import DEFAULT_POLICY

DEFAULT_DRAM = "2GiB"
DEFAULT_DISK = "8GiB"
_EMBEDDED_OPTIONS = {"dram", "disk", "disk_path", "policy", "disk_policy"}


class StoreKind(enum.Enum):
    EMBEDDED = "embedded"
    DAEMON = "daemon"


@dataclass(frozen=True)
class StoreSpec:
    kind: StoreKind
    address: str | None = None  # daemon only
    timeout_s: float | None = None  # daemon only: per-call timeout (None: the client's default)
    curve_keys: str | None = None  # daemon only: folder of CURVE keys (None: unauthenticated)
    curve_client: str = "client"  # daemon only: which client pair in curve_keys
    dram_bytes: int = 0  # embedded only
    disk_path: str | None = None
    disk_bytes: int = 0
    policy: PolicyName = DEFAULT_POLICY
    disk_policy: PolicyName = DEFAULT_POLICY

    @classmethod
    def parse(cls, text: str) -> StoreSpec:
        if not isinstance(text, str) or not text:
            raise ValueError(f"kv_store must be 'embedded[?options]', 'tcp://HOST:PORT' or 'ipc://PATH', got {text!r}")
        if text.startswith(("tcp://", "ipc://")):
            address, _, query = text.partition("?")
            opts = dict(parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)))
            known = {"timeout_s", "curve_keys", "curve_client"}
            if set(opts) - known:
                raise ValueError(
                    f"unknown daemon option(s) {sorted(set(opts) - known)} in {text!r}; known: {sorted(known)}"
                )
            timeout = float(opts["timeout_s"]) if "timeout_s" in opts else None
            if timeout is not None and not timeout > 0:
                raise ValueError(f"timeout_s must be positive in {text!r}")
            if "curve_client" in opts and not opts.get("curve_keys"):
                raise ValueError(f"curve_client needs curve_keys in {text!r}")
            return cls(
                StoreKind.DAEMON,
                address=address,
                timeout_s=timeout,
                curve_keys=opts.get("curve_keys") or None,
                curve_client=opts.get("curve_client") or "client",
            )
        head, _, query = text.partition("?")
        if head != "embedded":
            raise ValueError(f"kv_store must be 'embedded[?options]', 'tcp://HOST:PORT' or 'ipc://PATH', got {text!r}")
        opts = dict(parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)))
        unknown = set(opts) - _EMBEDDED_OPTIONS
        if unknown:
            raise ValueError(f"unknown kv_store option(s) {sorted(unknown)}; known: {sorted(_EMBEDDED_OPTIONS)}")
        disk_path = opts.get("disk_path") or None
        try:
            return cls(
                StoreKind.EMBEDDED,
                dram_bytes=parse_size(opts.get("dram", DEFAULT_DRAM)),
                disk_path=disk_path,
                disk_bytes=parse_size(opts.get("disk", DEFAULT_DISK)) if disk_path else 0,
                policy=PolicyName(opts.get("policy", DEFAULT_POLICY.value)),
                disk_policy=PolicyName(opts.get("disk_policy", DEFAULT_POLICY.value)),
            )
        except ValueError as exc:
            raise ValueError(f"bad kv_store {text!r}: {exc}") from exc

    @property
    def display(self) -> str:
        """What a node tells the next hop about where its KV went."""
        if self.kind is StoreKind.DAEMON:
            assert self.address is not None, "a daemon spec has an address"
            return self.address
        return "embedded"
