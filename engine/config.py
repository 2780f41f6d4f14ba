"""Engine configuration: one frozen, validated dataclass per concern, composed into `EngineConfig`.

Torch-free: `import engine.config` must stay cheap (the router and CLIs import it)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from ucm.size import parse_size


def parse_memory_size(value: int | float | str) -> int:
    """Bytes from an int or a string such as "512MiB", "2GiB", "1.5GB", "1000000" (one parser: `ucm.size`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"memory size must be a number of bytes or a string like '2GiB', got {value!r}")
    try:
        nbytes = parse_size(value) if isinstance(value, str) else int(value)
    except ValueError as exc:
        raise ValueError(f"invalid memory size {value!r}: {exc}") from None
    if nbytes <= 0:
        raise ValueError(f"memory size must be positive, got {value!r}")
    return nbytes


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # Bytes (int) or a string like "2GiB"; the number of KV blocks is derived from it and the model's shape.
    kv_cache_memory: int | str = "1GiB"
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")
        parse_memory_size(self.kv_cache_memory)  # validate early; the value is cached below

    @functools.cached_property
    def kv_cache_bytes(self) -> int:
        return parse_memory_size(self.kv_cache_memory)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # None: the model's context length (clamped to what the KV cache can hold).
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if (
            not self.enable_chunked_prefill
            and self.max_model_len is not None
            and self.max_model_len > self.max_num_batched_tokens
        ):
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                f">= max_model_len ({self.max_model_len})"
            )


_DTYPES = ("auto", "float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def cpu_supports_bf16() -> bool:
    """AVX-512 BF16 (or AMX) makes bf16 matmuls fast on CPU; without it bf16 is emulated and slower than fp32."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return "avx512_bf16" in flags or "amx_bf16" in flags
    except OSError:
        pass
    return False


def resolve_dtype_name(dtype: str, device: str) -> str:
    """'auto' → bf16 on CUDA and on CPUs with native bf16, else fp32."""
    if dtype != "auto":
        return dtype
    if device.startswith("cuda"):
        return "bfloat16"
    return "bfloat16" if cpu_supports_bf16() else "float32"


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2-135m"
    dtype: str = "auto"
    device: str = "cpu"
    # Seeds the engine's generator for requests without their own seed.
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # KV store spec for the connector (e.g. "embedded", "ipc://..."); None = no connector.
    kv_store: str | None = None
    kv_role: str | None = None
    # Save generated tokens' full blocks too (a multi-turn chat's next turn reuses them).
    kv_save_decode_blocks: bool = True
    # A fully stored, block-aligned prompt loads every block and recomputes only its last token
    # (False: recompute the whole last block).
    kv_recompute_last_token_only: bool = True

    def __post_init__(self) -> None:
        dtype = _DTYPE_ALIASES.get(str(self.dtype).removeprefix("torch."), str(self.dtype).removeprefix("torch."))
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES} (or fp32/bf16/fp16), got {self.dtype!r}")
        if dtype != self.dtype:
            raise ValueError(f"use the canonical dtype name {dtype!r} instead of {self.dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.kv_role is not None and self.kv_store is None:
            raise ValueError("kv_role needs kv_store")
        if self.kv_role is not None and self.kv_role not in ("kv_producer", "kv_consumer", "kv_both"):
            raise ValueError(f"kv_role must be kv_producer, kv_consumer or kv_both, got {self.kv_role!r}")

    @property
    def dtype_name(self) -> str:
        return resolve_dtype_name(self.dtype, self.device)

    @property
    def block_size(self) -> int:
        return self.cache.block_size


def canonical_dtype(dtype: object) -> str:
    """Accepts 'fp32', 'bf16', torch.float32, ... and returns the canonical name EngineConfig wants."""
    name = str(dtype).removeprefix("torch.")
    return _DTYPE_ALIASES.get(name, name)
