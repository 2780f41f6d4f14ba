"""The inference engine. Exports are lazy so `import engine` (and torch-free submodules such as
`engine.tokenizer` and `engine.model_source`, used by the router) never import torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LLM": "engine.llm",
    "SamplingParams": "engine.sampling_params",
    "EngineCore": "engine.engine_core",
    "EngineConfig": "engine.config",
    "CacheConfig": "engine.config",
    "SchedulerConfig": "engine.config",
    "RequestOutput": "engine.outputs",
    "CompletionOutput": "engine.outputs",
    "EngineStats": "engine.stats",
    "RequestStatus": "engine.request",
    "FinishReason": "engine.request",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.engine_core import EngineCore
    from engine.llm import LLM
    from engine.outputs import CompletionOutput, RequestOutput
    from engine.request import FinishReason, RequestStatus
    from engine.sampling_params import SamplingParams
    from engine.stats import EngineStats


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
