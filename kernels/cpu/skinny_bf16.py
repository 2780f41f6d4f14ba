"""Python side of the bf16 decode matmul (`skinny_bf16.c`, AVX-512 BF16): the call, and whether it wins here.

The engine sends a step's generated-token rows through this kernel and its prompt rows through oneDNN
(engine/models/dense.py). Both give a row the same bits however many rows the call has, so a token's hidden
state does not depend on how its prompt was chunked or whether a prefix came from the cache: the cache-hit
oracle needs that in bf16, where a last-bit difference flips greedy tokens (tests/engine/test_bf16_cache_hit.py).
Routing by row count, as the fp32 skinny kernel does, would not give it: the 4 rows left after a 496-token prefix
hit would take the kernel where the cold run's 500-row prefill took oneDNN.

`UCM_CPU_LINEAR=auto` (the default) measures once per machine, per weight shape, the kernel against oneDNN on a
reordered weight at `DECODE_ROWS` rows over a stack of weights larger than the caches, and uses it only where it
won every round (logged, cached beside the other linear choices: kernels/cpu/calibration.py). `native` uses it
wherever the build has it, `torch` never.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import torch

from kernels.cpu.calibration import ROUNDS, alternating_best_ms, cpu_info, stored_or_measured, vector_flags
from kernels.cpu.native import NativeLib
from kernels.cpu.skinny_gemm import MIN_PACK_BYTES, STACK_BYTES, CpuLinear, cpu_linear_mode

log = logging.getLogger(__name__)

DECODE_ROWS = 8  # the decode batch the choice is measured at (vllm bench serve's concurrency in issue 10)
MAX_STACK = 32
REPS = 3

Timings = tuple[float, float]  # (kernel ms, oneDNN ms), best of REPS


def skinny_linear_bf16(
    lib: NativeLib, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T + bias, all bf16 on CPU; each output row's bits depend on its own x row only."""
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"skinny_linear_bf16 takes 2-D bf16 x and weight, got {x.dtype} {tuple(x.shape)}, "
                         f"{weight.dtype} {tuple(weight.shape)}")  # fmt: skip
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"x has {x.shape[1]} features, weight takes {weight.shape[1]}")
    if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != (weight.shape[0],)):
        raise ValueError(f"bias must be bf16 [{weight.shape[0]}], got {bias.dtype} {tuple(bias.shape)}")
    x, weight = x.contiguous(), weight.detach().contiguous()
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=torch.bfloat16)
    b = bias.detach().contiguous() if bias is not None else None
    status = lib.skinny_bf16(
        x.data_ptr(), m, k, weight.data_ptr(), n, b.data_ptr() if b is not None else None, y.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise RuntimeError(f"{lib.path.name} was built without AVX-512 BF16: skinny_bf16 is not in it")
    return y


def measure(lib: NativeLib, k: int, n: int) -> list[Timings]:
    """One (kernel, oneDNN) pair per round (tests replace this to force a result)."""
    gen = torch.Generator().manual_seed(0)
    count = min(MAX_STACK, max(2, -(-STACK_BYTES // (2 * n * k))))
    weights = [torch.randn(n, k, generator=gen).bfloat16() for _ in range(count)]
    reordered = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    x = torch.randn(DECODE_ROWS, k, generator=gen).bfloat16()
    runs = [
        lambda: [skinny_linear_bf16(lib, x, w, None) for w in weights],
        lambda: [torch.ops.mkldnn._linear_pointwise(x, r, None, "none", [], "") for r in reordered],
    ]
    for fn in runs:
        fn()
    rounds = []
    for _ in range(ROUNDS):
        best = alternating_best_ms(runs, REPS)
        rounds.append((best[0], best[1]))
    return rounds


class _Memo:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.wins: dict[tuple[str, str, int, int, int], bool] = {}


_memo = _Memo()


def _parse(stored: object) -> bool | None:
    wins = stored.get("decode_kernel") if isinstance(stored, dict) else None
    return wins if isinstance(wins, bool) else None


def kernel_wins(lib: NativeLib, k: int, n: int, root: Path | None = None) -> bool:
    """Whether a [n, k] bf16 weight's generated rows go through the kernel on this machine (see the module doc)."""
    mode = cpu_linear_mode()
    if mode is CpuLinear.TORCH or not lib.has_skinny_bf16:
        return False
    if mode is CpuLinear.NATIVE:
        return True
    if 4 * k * n < MIN_PACK_BYTES:
        return False  # the tests' tiny models: cache-sized, and measuring them would be noise
    threads = torch.get_num_threads()
    memo_key = (str(root), lib.path.name, threads, k, n)
    with _memo.lock:
        found = _memo.wins.get(memo_key)
        if found is not None:
            return found
        name = f"decode bf16 {n}x{k}"
        tables: list[str] = []

        def run() -> tuple[bool, list[str]]:
            rounds = measure(lib, k, n)
            picks = [kernel < onednn for kernel, onednn in rounds]
            tables.append(", ".join(f"{kernel:.2f} vs {onednn:.2f} ms" for kernel, onednn in rounds))
            # Disagreeing rounds: oneDNN now, measured again by the next process.
            return all(picks), [] if len(set(picks)) == 1 else [f"the kernel won {sum(picks)} of {len(picks)} rounds"]

        wins, where = stored_or_measured(
            "linear", name, lib, threads, root, _parse, run, lambda w: {"decode_kernel": w}
        )
        measured = f" (kernel vs oneDNN at {DECODE_ROWS} rows: {tables[0]})" if tables else ""
        log.info(
            "CPU linear %s for %s [%s], %d thread(s): generated rows through %s%s (%s)",
            name, cpu_info()[0], " ".join(vector_flags()), threads, "the decode kernel" if wins else "oneDNN",
            measured, where,
        )  # fmt: skip
        _memo.wins[memo_key] = wins
        return wins


def forget() -> None:
    """Drop this process's memoised choices (tests)."""
    with _memo.lock:
        _memo.wins.clear()
