"""`RouterContext`: the state the router's routes share, built once by `create_app`."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from router.admission import AdmissionQueue
from router.config import RouterConfig
from router.metrics import RouterMetrics
from router.registry import Registry
from router.serving import OpenAIServing


@dataclass
class RouterContext:
    """What the routes share; `serving` exists once the app's lifespan connected to the nodes."""

    config: RouterConfig
    registry: Registry
    admission: AdmissionQueue
    metrics: RouterMetrics
    tokenizer: Any
    pool: ThreadPoolExecutor  # one thread for parsing and tokenizing: bounded CPU per request, never the loop's
    serving: OpenAIServing | None = None

    def ready_serving(self) -> OpenAIServing:
        assert self.serving is not None, "the app's lifespan has not started"
        return self.serving

    def max_model_len(self) -> int:
        """The context length requests get: the nodes' (once one registered), capped by the router's option."""
        return self.ready_serving().max_model_len()
