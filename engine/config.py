"""Engine configuration: one frozen, validated dataclass per concern, composed into `EngineConfig`.

Torch-free: `import engine.config` must stay cheap (the router and CLIs import it)."""

from __future__ import annotations

import enum
import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from common.save_policy import KVSavePolicy
from common.size import parse_size
from protocol import defaults

logger = logging.getLogger(__name__)


def parse_memory_size(value: int | float | str) -> int:
    """Bytes from an int or a string such as "512MiB", "2GiB", "1.5GB", "1000000" (one parser: `common.size`)."""
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


class SchedulingPolicy(enum.Enum):
    """The order waiting sequences are admitted in (within one priority level)."""

    FCFS = "fcfs"  # arrival order (vLLM's default)
    # Fewest prompt tokens left to compute after the device prefix cache first (shortest job first, which is what
    # minimises mean TTFT; with shared prefixes it serves cache hits first, like SGLang's longest-prefix-match),
    # where sequences that would share their next blocks count as one group at its tokens per sequence
    # (engine/prefix_groups.py), arrival order among equals, and any sequence waiting longer than `max_wait_s`
    # goes first so none starves.
    CACHE_AWARE = "cache_aware"


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = defaults.MAX_NUM_SEQS
    # A step's token budget; None: chosen for the host at engine start-up (engine/step_budget.py).
    max_num_batched_tokens: int | None = defaults.MAX_NUM_BATCHED_TOKENS
    # None: the model's context length (clamped to what the KV cache can hold).
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    policy: SchedulingPolicy = SchedulingPolicy.CACHE_AWARE
    max_wait_s: float = 30.0  # CACHE_AWARE: past this a waiting sequence is admitted in arrival order
    # A step that already finishes this many prompt tokens starts no waiting prompt it cannot finish (None: always
    # fills the budget with a chunk of the next one). Two blocks, not 512: a finishing suffix of 128 tokens then
    # closes its step too. scheduler_sim's cost model at three hosts' rates (prefix_repetition, 4 seeds; random
    # prompts of 20-1500 tokens at 4 / 8 / 32 at a time) puts 32 at or below 512 everywhere: on Zen 4's Llama-1B
    # (60 ms + 207 tok/s, budget 1024) prefix_repetition 22.9 against 24.4 s, mixed at 8 at a time 5.5 against
    # 6.5 s, the same tok/s; below 32 a step finishing a prompt's last few tokens would run nearly empty. In process
    # there (Llama-1B bf16, 32 x 1024+128 at once, alternated): 23.4 / 24.2 against 24.2 / 25.0 s.
    chunk_after_tokens: int | None = 32

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if not isinstance(self.policy, SchedulingPolicy):
            raise ValueError(f"policy must be a SchedulingPolicy, got {self.policy!r}")
        if self.max_wait_s <= 0:
            raise ValueError(f"max_wait_s must be positive, got {self.max_wait_s}")
        if self.chunk_after_tokens is not None and self.chunk_after_tokens <= 0:
            raise ValueError(f"chunk_after_tokens must be positive or None, got {self.chunk_after_tokens}")
        if (
            not self.enable_chunked_prefill
            and self.max_model_len is not None
            and self.max_num_batched_tokens is not None
            and self.max_model_len > self.max_num_batched_tokens
        ):
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                f">= max_model_len ({self.max_model_len})"
            )


_DTYPES = ("auto", "float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_supports_bf16() -> bool:
    """AVX-512 BF16 (or AMX) makes bf16 matmuls fast on CPU; without it bf16 is emulated and slower than fp32."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _vector_isa(flags: frozenset[str]) -> str:
    """The widest vector extension among the flags, for the log line."""
    for isa in ("amx_bf16", "avx512_bf16", "avx512f", "avx2", "avx", "sve", "asimd"):
        if isa in flags:
            return isa
    return "no vector flags found"


@functools.lru_cache(maxsize=1)
def auto_cpu_dtype() -> str:
    """dtype "auto" on CPU: bf16 only where the flags say it is native AND a measured matmul agrees (cached per
    CPU, ucm_kernels/cpu/calibration.py); else fp32. Decided and logged once per process."""
    flags = cpu_flags()
    if not cpu_supports_bf16():
        logger.info("dtype auto -> float32: CPU has no native bf16 (%s)", _vector_isa(flags))
        return "float32"
    # torch only here, on CPUs that could pick bf16: `import engine.config` stays torch-free.
    from ucm_kernels.cpu.calibration import bf16_matmul_faster

    faster, ms = bf16_matmul_faster()
    pick = "bfloat16" if faster else "float32"
    logger.info(
        "dtype auto -> %s: CPU has native bf16 (%s); matmul %s bf16 %.2f ms vs fp32 %.2f ms",
        pick, _vector_isa(flags), "confirms" if faster else "says fp32 is faster:", ms["bfloat16"], ms["float32"],
    )  # fmt: skip
    return pick


def resolve_dtype_name(dtype: str, device: str) -> str:
    """'auto' → bf16 on CUDA; on CPU `auto_cpu_dtype()` (bf16 where native and measured faster, else fp32)."""
    if dtype != "auto":
        return dtype
    if device.startswith("cuda"):
        return "bfloat16"
    return auto_cpu_dtype()


ADAPTIVE_THREADS_ENV = "UCM_ADAPTIVE_THREADS"
RETAIN_FREED_ENV = "UCM_RETAIN_FREED_MEMORY"


def _on_unless_zero(env: str) -> Callable[[], bool]:
    """A default read from the environment when a config is made: on unless the variable is "0"."""
    return lambda: os.environ.get(env, "1").strip() != "0"


@dataclass(frozen=True)
class EngineConfig:
    model: str = defaults.MODEL
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
    kv_save_policy: KVSavePolicy = KVSavePolicy.COMPUTED
    # Log the device prefix cache's changes as vLLM's KV events (`EngineCore.take_kv_events`, which a node publishes
    # per step: common/kv_events/); vLLM's KVEventsConfig.enable_kv_cache_events.
    enable_kv_cache_events: bool = False
    # On CPU, run each step with as many threads as cores other processes leave free (engine/thread_governor.py);
    # False (or UCM_ADAPTIVE_THREADS=0 in the environment, which reaches every node `up` starts): torch's count.
    adaptive_threads: bool = field(default_factory=_on_unless_zero(ADAPTIVE_THREADS_ENV))
    # On CPU, keep freed memory in the process for the next step's activations (engine/heap.py); False (or
    # UCM_RETAIN_FREED_MEMORY=0): the C library's default, memory returned to the OS as it is freed.
    retain_freed_memory: bool = field(default_factory=_on_unless_zero(RETAIN_FREED_ENV))

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
        if not isinstance(self.kv_save_policy, KVSavePolicy):
            raise ValueError(f"kv_save_policy must be a KVSavePolicy, got {self.kv_save_policy!r}")
        if self.kv_save_policy.writes_back and not self.cache.enable_prefix_caching:
            raise ValueError(
                f"kv_save_policy {self.kv_save_policy.value!r} needs the prefix cache: without it nothing is ever evicted"
            )

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
