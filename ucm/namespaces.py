"""`NamespaceRegistry`: the KV layout each client declared for each of its namespaces.

A namespace is scoped by the client's identity (its CURVE public key; "" for every peer of an unauthenticated
daemon), so one client cannot redeclare another's layout. A layout is checked against `LayoutCaps` when it is
declared; after that each dump must match it exactly. Re-declaring the same layout is a no-op (a client
reopens after a daemon restart); a different one under the same name is refused. Lives in memory only:
after a restart clients get `NO_NAMESPACE` and reopen.
"""

from __future__ import annotations

import threading

from ucm.refusal import Refused
from ucm.store_wire import ErrorCode, Layout
from ucm.wire_limits import MAX_BLOCK_TOKENS, MAX_LAYERS, LayoutCaps


def check_layout(layout: Layout, caps: LayoutCaps) -> None:
    """Raise Refused(BAD_REQUEST) unless every field is within the fixed caps."""
    if not 0 < layout.num_layers <= MAX_LAYERS:
        raise Refused(ErrorCode.BAD_REQUEST, f"num_layers {layout.num_layers} outside 1..{MAX_LAYERS}")
    if not 0 < layout.layer_nbytes <= caps.max_layer_nbytes:
        raise Refused(ErrorCode.BAD_REQUEST, f"layer_nbytes {layout.layer_nbytes} outside 1..{caps.max_layer_nbytes}")
    if not 0 < layout.block_tokens <= MAX_BLOCK_TOKENS:
        raise Refused(ErrorCode.BAD_REQUEST, f"block_tokens {layout.block_tokens} outside 1..{MAX_BLOCK_TOKENS}")
    if layout.block_nbytes > caps.max_block_nbytes:
        raise Refused(ErrorCode.BAD_REQUEST, f"a block of {layout.block_nbytes} bytes is over {caps.max_block_nbytes}")


class NamespaceRegistry:
    def __init__(self, caps: LayoutCaps) -> None:
        self._caps = caps
        self._lock = threading.Lock()
        self._layouts: dict[tuple[str, str], Layout] = {}
        self._per_client: dict[str, int] = {}

    def open(self, client: str, name: str, layout: Layout) -> None:
        check_layout(layout, self._caps)
        with self._lock:
            known = self._layouts.get((client, name))
            if known == layout:
                return
            if known is not None:
                raise Refused(ErrorCode.BAD_REQUEST, f"namespace {name!r} is open with layout {known}, not {layout}")
            if self._per_client.get(client, 0) >= self._caps.max_namespaces_per_client:
                raise Refused(ErrorCode.BUSY, f"already {self._caps.max_namespaces_per_client} namespaces open")
            self._layouts[(client, name)] = layout
            self._per_client[client] = self._per_client.get(client, 0) + 1

    def get(self, client: str, name: str) -> Layout:
        with self._lock:
            layout = self._layouts.get((client, name))
        if layout is None:
            raise Refused(ErrorCode.NO_NAMESPACE, f"namespace {name!r} is not open (send OpenNamespace first)")
        return layout
