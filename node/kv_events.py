"""A node's KV events out: the engine's device prefix cache changes, one batch per engine step that had any, on a
`ZmqEventPublisher` (vLLM's wire format, common/kv_events/), and the endpoint the node announces in its Register.

With the router link's CURVE keys the event sockets are CURVE servers with the node's pair (docs/security.md).
"""

from __future__ import annotations

import logging
from typing import Any

from common.auth import PublisherAuth
from common.kv_events import endpoints
from common.kv_events.publisher import ZmqEventPublisher
from node.config import NodeConfig
from protocol import messages as P

log = logging.getLogger(__name__)


class NodeEvents:
    def __init__(self, config: NodeConfig, engine: Any) -> None:
        assert config.kv_events is not None and config.kv_events.enabled, "NodeEvents needs enabled KV events"
        auth = PublisherAuth.from_client(config.router_auth) if config.router_auth is not None else None
        self.engine = engine
        self.publisher = ZmqEventPublisher(config.kv_events, auth)
        engine.take_kv_events()  # warm-up's: it ended with a reset, so the cache the events describe starts empty
        pub = self.publisher
        self.announcement: P.KVEventsEndpoint | None = None
        if pub.bound:
            replay = endpoints.reachable(pub.replay_endpoint, config.router_addr) if pub.replay_endpoint else None
            self.announcement = P.KVEventsEndpoint(
                endpoints.reachable(pub.endpoint, config.router_addr), replay, config.kv_events.topic
            )
            log.info("KV events on %s (replay %s)", self.announcement.endpoint, replay or "none")
        else:
            log.info("KV events sent to %s (connected: the router's prefix index does not see them)", pub.endpoint)

    def after_step(self) -> None:
        events = self.engine.take_kv_events()
        if events:
            self.publisher.publish(events)

    def close(self) -> None:
        self.after_step()
        self.publisher.close()
