"""`ServingEngine`: what `ucm-serve up` / `serve` run behind the router (`--engine`)."""

from __future__ import annotations

import enum


class ServingEngine(enum.Enum):
    UCM = "ucm"  # our own prefill/decode (or colocated) nodes
    VLLM = "vllm"  # `vllm serve` instances with UCMConnector, prefill as kv_producer, decode as kv_consumer
