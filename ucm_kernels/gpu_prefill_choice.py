"""Which path a CUDA prefill runs, decided by measuring both on this GPU: the Triton paged kernel, or the torch
path (gather the context's K/V, then torch's fused SDPA: flash attention on whole prompts).

Neither wins everywhere. On an H100 (docs/history/benchmarks.json, "GPU: NVIDIA H100 ...: prefill attention",
2026-11-26) the torch path ran Llama-8B's heads (x 128) over one
whole 8k prompt in 1.2 ms against the Triton kernel's 2.1, while the kernel won the same prompt's second half over
its cached first (1.6 against 2.0 ms) and SmolLM2's heads (x 64) 2-3x either way. The torch path also loops over
the sequences on the host (a sync, then one gather and one SDPA each), so it can only pay where each sequence
brings many new tokens. Hence the choice is a length: per GPU, geometry and shape class (whole prompts; chunks
over a cached prefix), `plan()` times both paths on one sequence at each of `LENGTHS` new tokens and keeps the
shortest length from which the torch path won at every longer one (none: Triton everywhere). A call runs the torch
path when its new tokens per sequence reach its class's crossover. Telling whole prompts from chunks takes the
sum of the context lengths, which the engine passes from the host (`context_tokens`); without it a call long
enough to ask pays a device sync. fp32 always runs Triton: flash SDPA takes fp16 and bf16 only. Measured once per process and geometry (well under a second after Triton's
compile, which Triton caches on disk); `ucm_kernels.calibrate_gpu_prefill` runs it at engine start-up. Forcing
`UCM_ATTENTION_BACKEND=triton` bypasses it, as does a CUDA-graph capture (no host sync allowed).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ucm_kernels.choice_memo import ChoiceMemo
from ucm_kernels.cpu.calibration import Geometry, ShapeClass
from ucm_kernels.cpu.timing import REPS, alternating_best_ms
from ucm_kernels.reference import prefill_attention_torch

log = logging.getLogger(__name__)

LENGTHS = (256, 512, 1024, 2048, 4096, 8192)  # new tokens of the one measured sequence
CLASSES = (ShapeClass.PROMPT, ShapeClass.CHUNK)  # a chunk of n new tokens sits over n cached ones


@dataclass(frozen=True)
class LengthTiming:
    tokens: int
    triton_ms: float
    torch_ms: float


FLASH_DTYPES = (torch.float16, torch.bfloat16)  # the torch path's edge is flash SDPA, which takes these only


def crossover(timings: tuple[LengthTiming, ...]) -> int | None:
    """The shortest measured length from which the torch path won at every longer one, or None (Triton won the
    longest). A win that a longer length loses again is noise or a cliff, not a trend to bet on."""
    found = None
    for t in sorted(timings, key=lambda t: t.tokens, reverse=True):
        if t.torch_ms >= t.triton_ms:
            break
        found = t.tokens
    return found


@dataclass(frozen=True)
class GpuPrefillPlan:
    timings: dict[ShapeClass, tuple[LengthTiming, ...]]

    def __post_init__(self) -> None:
        assert set(self.timings) == set(CLASSES), f"a plan covers {CLASSES}, got {sorted(self.timings)}"

    @functools.cached_property
    def _crossovers(self) -> dict[ShapeClass, int | None]:
        return {c: crossover(self.timings[c]) for c in CLASSES}  # once: runs_torch asks on every CUDA prefill

    def crossover(self, shape_class: ShapeClass) -> int | None:
        return self._crossovers[shape_class]

    def runs_torch(self, num_tokens: int, num_seqs: int, all_whole_prompts: Callable[[], bool]) -> bool:
        """Whether a call of `num_tokens` new tokens over `num_seqs` sequences runs the torch path;
        `all_whole_prompts` (a device sync) is asked only when the length alone does not decide."""
        per_seq = num_tokens / max(num_seqs, 1)
        reached = [c for c in CLASSES if (x := self.crossover(c)) is not None and per_seq >= x]
        if not reached:
            return False
        shape_class = ShapeClass.PROMPT if all_whole_prompts() else ShapeClass.CHUNK
        return shape_class in reached

    def describe(self) -> str:
        def one(c: ShapeClass) -> str:
            x = self.crossover(c)
            where = f"torch from {x} new tokens a sequence" if x is not None else "Triton at every length"
            ms = ", ".join(f"{t.tokens}: {t.triton_ms:.3f}/{t.torch_ms:.3f}" for t in self.timings[c])
            return f"{c.value} {where} (ms Triton/torch: {ms})"

        return "; ".join(one(c) for c in CLASSES)


def _problem(g: Geometry, c: ShapeClass, tokens: int, device: torch.device) -> tuple[object, ...]:
    """One sequence with `tokens` new tokens (over as many cached ones for a chunk), its blocks in shuffled order."""
    ctx = tokens if c is ShapeClass.PROMPT else 2 * tokens
    dtype = getattr(torch, g.dtype)
    num_blocks = -(-ctx // g.block_size)
    shape = (num_blocks, g.block_size, g.num_kv_heads, g.head_dim)
    k_cache, v_cache = (torch.randn(shape, device=device, dtype=dtype) for _ in range(2))
    tables = torch.randperm(num_blocks, device=device, dtype=torch.int32).view(1, num_blocks)
    q = torch.randn(tokens, g.num_q_heads, g.head_dim, device=device, dtype=dtype)
    qsl = torch.tensor([0, tokens], dtype=torch.int32, device=device)
    lens = torch.tensor([ctx], dtype=torch.int32, device=device)
    return q, k_cache, v_cache, qsl, lens, tables, g.head_dim**-0.5, tokens


def measure(g: Geometry, device: torch.device) -> dict[ShapeClass, tuple[LengthTiming, ...]]:
    """Both paths' fastest ms per class, from the longest length down to the first the torch path loses (tests
    replace this to force a result)."""
    from ucm_kernels.triton_prefill_attention import prefill_attention_triton

    def synced(fn: Callable[..., torch.Tensor], args: tuple[object, ...]) -> Callable[[], None]:
        def run() -> None:
            fn(*args)
            torch.cuda.synchronize(device)

        return run

    timings = {}
    for c in CLASSES:
        row = []
        for tokens in sorted(LENGTHS, reverse=True):  # down to the first length torch loses: `crossover` stops there
            args = _problem(g, c, tokens, device)
            runs = [synced(prefill_attention_triton, args), synced(prefill_attention_torch, args)]
            for fn in runs:
                fn()  # warm-up: the Triton compile, the allocator
            triton_ms, torch_ms = alternating_best_ms(runs, REPS)
            row.append(LengthTiming(tokens, triton_ms, torch_ms))
            if torch_ms >= triton_ms:
                break
        timings[c] = tuple(reversed(row))
    return timings


_memo: ChoiceMemo[tuple[int, Geometry], GpuPrefillPlan] = ChoiceMemo()


def plan(g: Geometry, device: torch.device) -> GpuPrefillPlan:
    """This GPU's plan for the geometry: measured on the first call per process, a dict lookup after."""
    # The device's index, not its name: asking the driver for the name on every prefill costs launch time.
    key = (device.index if device.index is not None else torch.cuda.current_device(), g)

    def make() -> GpuPrefillPlan:
        made = GpuPrefillPlan(measure(g, device))
        log.info("GPU prefill on %s, %s: %s", torch.cuda.get_device_name(device), g.label(), made.describe())
        return made

    return _memo.get_or_make(key, make)


def forget() -> None:
    """Drop this process's plans (tests)."""
    _memo.clear()
