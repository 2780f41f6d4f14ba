"""Python side of the skinny fp32 GEMM (`skinny_gemm.c`): packing, the call, and up to how many rows it wins here.

`UCM_CPU_LINEAR=auto` (the default) measures once per machine, for a weight shape, the packed kernel against
`F.linear` at each row count of `ROW_LADDER` on a stack of such weights larger than the caches (a decode step reads
every weight from memory; a warm-cache micro-benchmark would flatter the BLAS), and uses the kernel for the row
counts up to the last one where it won every time. The result is logged and cached beside the attention
calibration (kernels/cpu/calibration.py: same key, same file rules, stored only when both rounds agree).
Weights under `MIN_PACK_BYTES` are left to `F.linear` unmeasured. `UCM_CPU_LINEAR=native` uses the kernel up to the
ladder's top, `torch` never.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.cpu.calibration import ROUNDS, calibration_key, cpu_info, key_file, read_entries, vector_flags, write_entry
from kernels.cpu.native import NativeLib

log = logging.getLogger(__name__)

NR = 16  # output columns per packed panel (skinny_gemm.c)
ROW_LADDER = (1, 4, 8, 16, 32, 64, 128)
STACK_BYTES = 64 << 20  # weights per measured row count: past the last-level cache of the CPUs we run on
MAX_STACK = 32  # ... but no more calls than this per measurement (small weights: Python overhead, not memory)
# A weight under this stays in the caches between steps, where the BLAS's repacking costs little: not measured, not
# packed (the tests' tiny random models would otherwise spend seconds per shape measuring noise).
MIN_PACK_BYTES = 1 << 20
REPS = 2
ENV = "UCM_CPU_LINEAR"


class CpuLinear(str, enum.Enum):  # noqa: UP042 (the environment variable's values)
    AUTO = "auto"
    NATIVE = "native"
    TORCH = "torch"


def cpu_linear_mode() -> CpuLinear:
    text = os.environ.get(ENV, CpuLinear.AUTO.value).strip().lower()
    try:
        return CpuLinear(text)
    except ValueError:
        raise ValueError(f"{ENV}={text!r}: expected one of {[m.value for m in CpuLinear]}") from None


@dataclass(frozen=True)
class PanelWeight:
    """W [N, K] packed for skinny_gemm.c; `dense` uses it for at most `max_rows` rows, else `F.linear` on W."""

    panels: torch.Tensor
    out_features: int
    in_features: int
    max_rows: int
    lib: NativeLib


def pack_panels(lib: NativeLib, weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] (fp32, CPU) -> [ceil(N / NR) * K * NR] panels, zero-padded."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError(f"panel packing takes a 2-D fp32 CPU weight, got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    w = weight.detach().contiguous()
    panels = torch.empty(-(-n // NR) * k * NR, dtype=torch.float32)
    lib.pack_panels(w.data_ptr(), panels.data_ptr(), n, k)
    return panels


def skinny_linear(
    lib: NativeLib, x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [M, K] @ W.T + bias with W packed by `pack_panels`; x is made contiguous if it is not."""
    if x.dtype != torch.float32 or x.dim() != 2:
        raise ValueError(f"skinny_linear takes a 2-D fp32 input, got {x.dtype} {tuple(x.shape)}")
    x = x.contiguous()
    m, k = x.shape
    if panels.numel() != -(-n // NR) * k * NR:
        raise ValueError(f"packed weight of {panels.numel()} floats is not {n} x {k}")
    y = torch.empty((m, n), dtype=torch.float32)
    b = bias.detach().contiguous().float() if bias is not None else None
    lib.skinny_gemm(
        x.data_ptr(), m, k, panels.data_ptr(), n, b.data_ptr() if b is not None else None, y.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return y


Timings = dict[int, tuple[float, float]]  # rows -> (native ms, torch ms), best of REPS


def measure(lib: NativeLib, k: int, n: int) -> list[Timings]:
    """One Timings per round (tests replace this to force a result)."""
    gen = torch.Generator().manual_seed(0)
    count = min(MAX_STACK, max(2, -(-STACK_BYTES // (4 * n * k))))
    weights = [torch.randn(n, k, generator=gen) for _ in range(count)]
    packed = [pack_panels(lib, w) for w in weights]
    rounds: list[Timings] = []
    for _ in range(ROUNDS):
        timings: Timings = {}
        for rows in ROW_LADDER:
            runs = _runs(lib, torch.randn(rows, k, generator=gen), weights, packed)
            best = [float("inf"), float("inf")]
            for fn in runs:
                fn()
            for _ in range(REPS):
                for i, fn in enumerate(runs):
                    t0 = time.perf_counter()
                    fn()
                    best[i] = min(best[i], (time.perf_counter() - t0) * 1000)
            timings[rows] = (best[0], best[1])
            if best[0] > best[1]:  # lost here: larger row counts only favour the BLAS more
                break
        rounds.append(timings)
    return rounds


def _runs(
    lib: NativeLib, x: torch.Tensor, weights: list[torch.Tensor], packed: list[torch.Tensor]
) -> list[Callable[[], object]]:
    """The packed kernel, then F.linear, each over the whole stack of weights."""
    n = weights[0].shape[0]
    return [
        lambda: [skinny_linear(lib, x, p, n, None) for p in packed],
        lambda: [F.linear(x, w) for w in weights],
    ]


def _rows_won(timings: Timings) -> int:
    """The ladder's last row count up to which the kernel won at every step (0: it lost at one row)."""
    won = 0
    for rows in ROW_LADDER:
        if rows not in timings or timings[rows][0] > timings[rows][1]:
            break
        won = rows
    return won


class _Memo:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rows: dict[tuple[str, str, int, int, int], int] = {}


_memo = _Memo()


def max_rows(lib: NativeLib, k: int, n: int, root: Path | None = None) -> int:
    """Up to how many rows the packed kernel runs for a [n, k] weight on this machine (see the module doc)."""
    mode = cpu_linear_mode()
    if mode is CpuLinear.TORCH:
        return 0
    if mode is CpuLinear.NATIVE:
        return ROW_LADDER[-1]
    if 4 * k * n < MIN_PACK_BYTES:
        return 0
    threads = torch.get_num_threads()
    memo_key = (str(root), lib.path.name, threads, k, n)
    with _memo.lock:
        found = _memo.rows.get(memo_key)
        if found is not None:
            return found
        key = calibration_key(lib, threads)
        path = key_file("linear", key, root)
        name = f"fp32 {n}x{k}"
        stored = read_entries(path, key).get(name)
        if isinstance(stored, dict) and isinstance(stored.get("max_rows"), int):
            rows = int(stored["max_rows"])
            log.info("CPU linear %s: packed kernel up to %d rows (from %s)", name, rows, path)
        else:
            t0 = time.perf_counter()
            rounds = measure(lib, k, n)
            picks = [_rows_won(t) for t in rounds]
            rows = min(picks)
            table = ", ".join(
                f"{r}: {min(t[r][0] for t in rounds if r in t):.1f} vs {min(t[r][1] for t in rounds if r in t):.1f} ms"
                for r in ROW_LADDER
                if any(r in t for t in rounds)
            )
            if len(set(picks)) == 1:
                write_entry(path, key, name, {"max_rows": rows})
                where = f"stored in {path}"
            else:  # the machine's load changed the answer: take the smaller one now, measure again next time
                where = f"not stored: rounds disagreed ({picks})"
            log.info(
                "CPU linear %s for %s [%s], %d thread(s): packed kernel up to %d rows (rows: packed vs F.linear "
                "over %d MB of weights: %s; measured in %.2f s; %s)",
                name, cpu_info()[0], " ".join(vector_flags()), threads, rows, STACK_BYTES >> 20, table,
                time.perf_counter() - t0, where,
            )  # fmt: skip
        _memo.rows[memo_key] = rows
        return rows


def panel_weight(lib: NativeLib, weight: torch.Tensor) -> PanelWeight | None:
    """`weight` packed for the row counts where the kernel wins here, or None where it never does."""
    n, k = weight.shape
    rows = max_rows(lib, k, n)
    if rows == 0:
        return None
    return PanelWeight(pack_panels(lib, weight), n, k, rows, lib)


def forget() -> None:
    """Drop this process's memoised row counts (tests)."""
    with _memo.lock:
        _memo.rows.clear()
