"""Python side of the skinny fp32 GEMM (`skinny_gemm.c`): packing, the call, and up to how many rows it wins here.

`UCM_CPU_LINEAR=auto` (the default) measures once per machine, for a weight shape, the packed kernel against the
best of `F.linear` and oneDNN on a reordered weight (ucm_kernels/cpu/onednn_linear.py, where available) at each row count
of `ROW_LADDER` on a stack of such weights larger than the caches (a decode step reads every weight from memory; a
warm-cache micro-benchmark would flatter the BLAS), and uses the kernel up to the row count where its summed saving
over the ladder peaks, in the round that gives the fewest rows (`_rows_won`). (Against `F.linear` alone it won at 8
rows on the 2-core AMD EPYC with AVX-512 that oneDNN runs in 17.0 ms against the kernel's 22.2 over SmolLM2's
weights.) The result is logged and cached beside the attention
calibration (ucm_kernels/cpu/calibration_store.py: same key, same file rules, stored only when both rounds agree).
Weights under `MIN_PACK_BYTES` are left to `F.linear` unmeasured. A weight that is exactly 4-bit
(ucm_kernels/cpu/q4_panels.py) is packed and measured as 4-bit panels ("q4 NxK" in the cache file), one that is exactly
Q8_0 (ucm_kernels/cpu/q8_panels.py) as 8-bit panels ("q8 NxK"), one that is exactly bf16 (a bf16 checkpoint in fp32:
ucm_kernels/cpu/bf16_panels.py) as bf16 panels ("bf16 NxK"), others as fp32 ("fp32 NxK").
`UCM_CPU_LINEAR=native` uses the kernel up to the ladder's top, `torch` never.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ucm_kernels.choice_memo import ChoiceMemo
from ucm_kernels.cpu import onednn_linear
from ucm_kernels.cpu.bf16_panels import BF16Panels, pack_bf16, random_bf16_weight, skinny_linear_bf16
from ucm_kernels.cpu.calibration_store import stored_or_measured
from ucm_kernels.cpu.choice_threads import choice_threads
from ucm_kernels.cpu.host import cpu_info, vector_flags
from ucm_kernels.cpu.linear_mode import MIN_PACK_BYTES, STACK_BYTES, CpuLinear, cpu_linear_mode
from ucm_kernels.cpu.native import NativeLib
from ucm_kernels.cpu.q4_panels import Q4Panels, pack_q4, random_q4_weight, skinny_linear_q4, skinny_operands
from ucm_kernels.cpu.q8_panels import Q8Panels, pack_q8, random_q8_weight, skinny_linear_q8
from ucm_kernels.cpu.timing import ROUNDS, alternating_best_ms

log = logging.getLogger(__name__)

NR = 16  # output columns per packed panel (skinny_gemm.c)
ROW_LADDER = (1, 4, 8, 16, 32, 64, 128)
MAX_STACK = 32  # ... but no more calls than this per measurement (small weights: Python overhead, not memory)
REPS = 2
STOP_AFTER_LOSSES = 2  # consecutive row counts the kernel loses before the ladder stops (`_rows_won`)
# ... once it has measured this many rows, a decode step's: losses at 1 and 4 rows (a near tie at 1 row, where the
# alternative is memory-bound too) must not decide 8 and 16 unmeasured. The 2-core AMD EPYC Zen 3 (AVX2) had 0 rows
# stored for three 4-bit shapes that, measured again, won every row count to 128 (8 rows: 4.5 against 4.9 ms); the
# stored entry now keeps its timings, so such a choice can be read back. (A decode step of 8 took the same time either
# way there: 47.2-49.2 ms, the two files alternated three times.)
MIN_LADDER_ROWS = 16


class PanelFormat(enum.Enum):
    """How a packed weight is held: its name in the cache file's entries ("q4 NxK")."""

    FP32 = "fp32"
    Q4 = "q4"  # exactly GGUF Q4_1 (ucm_kernels/cpu/q4_panels.py)
    Q8 = "q8"  # exactly GGUF Q8_0 (ucm_kernels/cpu/q8_panels.py)
    BF16 = "bf16"  # exactly bf16 (ucm_kernels/cpu/bf16_panels.py)


AnyPanels = torch.Tensor | Q4Panels | Q8Panels | BF16Panels  # fp32 panels are a plain tensor


@dataclass(frozen=True)
class PanelWeight:
    """W [N, K] packed for skinny_gemm.c: fp32 panels, or 4-bit, 8-bit or bf16 ones where W is exactly that; `dense`
    uses it for at most `max_rows` rows, else `F.linear` on W."""

    panels: AnyPanels
    out_features: int
    in_features: int
    max_rows: int
    lib: NativeLib

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(self.panels, Q4Panels):
            return skinny_linear_q4(self.lib, x, self.panels, self.out_features, bias, out)
        if isinstance(self.panels, Q8Panels):
            return skinny_linear_q8(self.lib, x, self.panels, self.out_features, bias, out)
        if isinstance(self.panels, BF16Panels):
            return skinny_linear_bf16(self.lib, x, self.panels, self.out_features, bias, out)
        return skinny_linear(self.lib, x, self.panels, self.out_features, bias, out)

    def operands(self) -> tuple[torch.Tensor, torch.Tensor | None, PanelFormat]:
        """The panels' bytes, their scales (none for fp32 and bf16 panels) and their format: what a C caller of
        skinny_gemm.c passes (ucm_kernels/cpu/decode_layers.py)."""
        p = self.panels
        if isinstance(p, Q4Panels):
            return p.qp, p.dm, PanelFormat.Q4
        if isinstance(p, Q8Panels):
            return p.qp, p.d, PanelFormat.Q8
        if isinstance(p, BF16Panels):
            return p.bp, None, PanelFormat.BF16
        return p, None, PanelFormat.FP32


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
    lib: NativeLib,
    x: torch.Tensor,
    panels: torch.Tensor,
    n: int,
    bias: torch.Tensor | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ W.T + bias with W packed by `pack_panels`; x is made contiguous if it is not. `out`: where to
    write it (`fp32_output`)."""
    ops = skinny_operands("skinny_linear", x, n, bias, out)
    m, k = ops.x.shape
    if panels.numel() != -(-n // NR) * k * NR:
        raise ValueError(f"packed weight of {panels.numel()} floats is not {n} x {k}")
    lib.skinny_gemm(
        ops.x.data_ptr(), m, k, panels.data_ptr(), n, ops.bias_ptr, ops.y.data_ptr(), torch.get_num_threads()
    )
    return ops.y


Timings = dict[int, tuple[float, float]]  # rows -> (native ms, best alternative's ms), best of REPS


_RANDOM_WEIGHT: dict[PanelFormat, Callable[[int, int, torch.Generator], torch.Tensor]] = {
    PanelFormat.FP32: lambda n, k, gen: torch.randn(n, k, generator=gen),
    PanelFormat.Q4: random_q4_weight,
    PanelFormat.Q8: random_q8_weight,
    PanelFormat.BF16: random_bf16_weight,
}


def measure(lib: NativeLib, k: int, n: int, fmt: PanelFormat = PanelFormat.FP32) -> list[Timings]:
    """One Timings per round (tests replace this to force a result), on weights and panels of format `fmt`."""
    gen = torch.Generator().manual_seed(0)
    count = min(MAX_STACK, max(2, -(-STACK_BYTES // (4 * n * k))))
    weights = [_RANDOM_WEIGHT[fmt](n, k, gen) for _ in range(count)]
    packed = [_packed(lib, w, fmt) for w in weights]
    rounds: list[Timings] = []
    for _ in range(ROUNDS):
        timings: Timings = {}
        losses = 0
        for rows in ROW_LADDER:
            runs = _runs(lib, torch.randn(rows, k, generator=gen), weights, packed)
            for fn in runs:
                fn()
            best = alternating_best_ms(runs, REPS)
            timings[rows] = (best[0], min(best[1:]))
            losses = losses + 1 if best[0] > min(best[1:]) else 0
            if losses >= STOP_AFTER_LOSSES and rows >= MIN_LADDER_ROWS:  # larger counts only favour the BLAS more
                break
        rounds.append(timings)
    return rounds


def _pack_as(lib: NativeLib, weight: torch.Tensor, fmt: PanelFormat) -> AnyPanels | None:
    """`weight` as panels of format `fmt`, or None where it is not exactly that format."""
    if fmt is PanelFormat.FP32:
        return pack_panels(lib, weight)
    if fmt is PanelFormat.BF16:
        return pack_bf16(lib, weight)
    return {PanelFormat.Q4: pack_q4, PanelFormat.Q8: pack_q8}[fmt](weight)


def _packed(lib: NativeLib, weight: torch.Tensor, fmt: PanelFormat) -> PanelWeight:
    n, k = weight.shape
    panels = _pack_as(lib, weight, fmt)
    assert panels is not None, f"a random {fmt.value} weight must pack as {fmt.value}"
    return PanelWeight(panels, n, k, ROW_LADDER[-1], lib)


def pack(lib: NativeLib, weight: torch.Tensor) -> tuple[PanelFormat, AnyPanels]:
    """`weight` [N, K] as panels of the fewest bytes it is exactly: 4-bit (Q4_1), 8-bit (Q8_0), bf16, else fp32."""
    for fmt in (PanelFormat.Q4, PanelFormat.Q8, PanelFormat.BF16):
        panels = _pack_as(lib, weight, fmt)
        if panels is not None:
            return fmt, panels
    return PanelFormat.FP32, pack_panels(lib, weight)


def _runs(
    lib: NativeLib, x: torch.Tensor, weights: list[torch.Tensor], packed: list[PanelWeight]
) -> list[Callable[[], object]]:
    """The packed kernel, then its alternatives (F.linear; oneDNN where available), each over the whole stack."""
    runs: list[Callable[[], object]] = [
        lambda: [p.linear(x, None) for p in packed],
        lambda: [F.linear(x, w) for w in weights],
    ]
    if onednn_linear.available():
        reordered = [onednn_linear.reorder(w) for w in weights]
        runs.append(lambda: [onednn_linear.linear(x, r, None) for r in reordered])
    return runs


def _rows_won(timings: Timings) -> int:
    """The row count to use the kernel up to: where the running sum, over the ladder, of its relative saving
    against the best alternative peaks (0 when the sum never rises above 0). A threshold, since `dense` routes by
    row count; a sum, so that one close call does not give up the row counts where the kernel wins clearly. At
    1 row the alternative is memory-bound and, with fast memory, close to a 4-bit kernel paying its expansion: on the
    2-core AMD EPYC Zen 5 as an AVX2-only host the 4-bit gate_up was once stored at 0 rows (1.3 vs 1.2 ms at 1 row)
    where it wins 4 to 32 rows by 5-40%, because the ladder stopped at its first loss."""
    best, best_rows, total = 0.0, 0, 0.0
    for rows in ROW_LADDER:
        if rows not in timings:
            break
        kernel_ms, other_ms = timings[rows]
        total += (other_ms - kernel_ms) / other_ms
        if total > best:
            best, best_rows = total, rows
    return best_rows


def _parse_rows(stored: object) -> int | None:
    rows = stored.get("max_rows") if isinstance(stored, dict) else None
    return rows if isinstance(rows, int) else None


def _table(rounds: list[Timings]) -> str:
    return ", ".join(
        f"{r}: {min(t[r][0] for t in rounds if r in t):.1f} vs {min(t[r][1] for t in rounds if r in t):.1f} ms"
        for r in ROW_LADDER
        if any(r in t for t in rounds)
    )


_memo: ChoiceMemo[tuple[str, str, int, int, int, PanelFormat], int] = ChoiceMemo()


def max_rows(lib: NativeLib, k: int, n: int, root: Path | None = None, fmt: PanelFormat = PanelFormat.FP32) -> int:
    """Up to how many rows the packed kernel (on panels of format `fmt`) runs for a [n, k] weight on this machine
    (see the module doc)."""
    mode = cpu_linear_mode()
    if not _may_pack(mode, k, n):
        return 0
    if mode is CpuLinear.NATIVE:
        return ROW_LADDER[-1]
    threads = choice_threads()
    memo_key = (str(root), lib.path.name, threads, k, n, fmt)

    def make() -> int:
        name = f"{fmt.value} {n}x{k}"
        tables: list[str] = []

        def run() -> tuple[int, list[str]]:
            rounds = measure(lib, k, n, fmt)
            picks = [_rows_won(t) for t in rounds]
            tables.append(_table(rounds))
            # Disagreeing rounds: the smaller answer, stored as provisional.
            return min(picks), [] if len(set(picks)) == 1 else [f"rows {' vs '.join(map(str, picks))}"]

        rows, where = stored_or_measured(
            "linear", name, lib, threads, root, _parse_rows, run, lambda r: {"max_rows": r, "measured": tables[0]}
        )
        measured = (
            f" (rows: packed vs the best other over {STACK_BYTES >> 20} MB of weights: {tables[0]})" if tables else ""
        )
        log.info(
            "CPU linear %s for %s [%s], %d thread(s): packed kernel up to %d rows%s (%s)",
            name, cpu_info()[0], " ".join(vector_flags()), threads, rows, measured, where,
        )  # fmt: skip
        return rows

    return _memo.get_or_make(memo_key, make)


def _may_pack(mode: CpuLinear, k: int, n: int) -> bool:
    """Whether the kernel may run for a [n, k] weight at all, before anything is packed or measured."""
    return mode is CpuLinear.NATIVE or (mode is CpuLinear.AUTO and 4 * k * n >= MIN_PACK_BYTES)


def panel_weight(lib: NativeLib, weight: torch.Tensor) -> PanelWeight | None:
    """`weight` packed (`pack`) for the row counts where the kernel wins here, or None where it never does. A
    narrower packing that never wins (its expansion costs more than the bytes it saves: a fast memory) falls back to
    the fp32 panels where those win."""
    n, k = weight.shape
    if not _may_pack(cpu_linear_mode(), k, n):
        return None  # before pack: recovering 4- or 8-bit values costs time at start-up
    fmt, panels = pack(lib, weight)
    rows = max_rows(lib, k, n, fmt=fmt)
    if rows == 0 and fmt is not PanelFormat.FP32:
        panels, rows = pack_panels(lib, weight), max_rows(lib, k, n, fmt=PanelFormat.FP32)
    if rows == 0:
        return None
    return PanelWeight(panels, n, k, rows, lib)


def forget() -> None:
    """Drop this process's memoised row counts (tests)."""
    _memo.clear()
