"""The router's one typed config (built by router.cli from argv, or directly by tests and the launcher)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RouterConfig:
    bind_nodes: str = "tcp://127.0.0.1:0"  # where nodes connect (ZeroMQ ROUTER)
    host: str = "127.0.0.1"
    port: int = 8000
    model: str = "smollm2-135m"  # spec for the tokenizer files (alias, HF folder, .gguf)
    served_model_name: str | None = None  # the name clients send; defaults to `model`
    api_key: str | None = None
    node_timeout_s: float = 3.0  # a node silent this long is dropped
    prefill_timeout_s: float = 60.0  # a prefill job slower than this is retried elsewhere
    decode_timeout_s: float = 120.0  # longest silence tolerated from a decode node mid-request
    max_model_len: int | None = None  # cap below the nodes' own limit

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in ("node_timeout_s", "prefill_timeout_s", "decode_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be non-empty when given")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model
