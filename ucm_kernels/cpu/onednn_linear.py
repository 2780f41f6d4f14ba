"""fp32 linear layers for prefill-sized row counts through oneDNN, on a weight reordered once, where that measured
faster than `F.linear` on this machine.

`F.linear` on fp32 CPU tensors is MKL's sgemm. oneDNN's matmul on a weight reordered into its blocked layout at
load was faster for some of SmolLM2's shapes and slower for others on the 2-core AVX2 EPYC (Zen 3), 2 threads,
1024 rows, median of 15: [3072 x 576] 106 -> 134 GFLOPS, [960 x 576] 117 -> 132, [576 x 1536] 124 -> 115. So
`UCM_CPU_LINEAR=auto` measures each weight shape once per machine at `ROWS` rows (two rounds, `REPS` alternating
calls each), keeps the reordered copy only where oneDNN won both rounds, logs the numbers, and caches the answer
beside the skinny kernel's (ucm_kernels/cpu/calibration_store.py: same key, same file rules). `native` takes oneDNN
wherever it is available, `torch` never. The engine uses it above the skinny kernel's row counts
(engine/models/dense.py). Results differ from `F.linear`'s in the last bits (another summation order), as the
skinny kernel's do; the engine's greedy outputs are tested against HF transformers either way.

Few-row calls (a decode step's) are another regime: the weights stream from memory, and which path is faster
changes with the row count and the shape. On a 2-core Xeon with AMX (480 MiB L3), 30 layers' fp32 matmuls plus the
lm_head at 1 row took 23.7 ms through F.linear against 31.4 through oneDNN, at 8 rows 48.9 against 39.1
(benchmarks/kernels.py), and one choice at 512 rows sent both counts down one path. So each row class of
`FEW_ROWS` (a call takes the smallest class at least its row count) is measured too, on a stack of weights as a
decode step reads them (past the last-level cache: `few_rows_stack_bytes`), and oneDNN takes the classes it won
(`OnednnWeight.takes`).

Each shape chooses alone, but a layer calls its matmuls one after another, and alternating the two libraries costs
time that neither shape's measurement sees. On the Xeon with AMX (fp32, 2 threads, SmolLM2's four layer shapes plus
the lm_head, 30 layers): qkv and down chose oneDNN, o and gate_up F.linear, and that mix took 94.4 ms at 64 rows
against 80.3 all through oneDNN and 88.8 all through F.linear (134.5 / 125.0 / 131.3 at 128). So where a layer's
shapes disagree, `layer_many_rows` times the layer's calls their way, all through oneDNN and all through F.linear,
and the layer takes the fastest (stored like the others). The few-row classes the same (`layer_few_rows`): at 8 and
32 rows SmolLM2's shapes came out near ties alone, split both ways, and the mixed step of 8 rows took 1.07x (32
rows: 1.05x) the time of all through oneDNN (benchmarks/kernels.py, 2026-11-28); there each class is timed as a
layer over a stack of weights past the last-level cache, as `measure_few` times a shape.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ucm_kernels.choice_memo import ChoiceMemo
from ucm_kernels.cpu.calibration_store import stored_or_measured
from ucm_kernels.cpu.choice_threads import choice_threads
from ucm_kernels.cpu.host import cpu_info, last_level_cache_bytes, vector_flags
from ucm_kernels.cpu.linear_choice import WinMemo, measured_win
from ucm_kernels.cpu.linear_mode import MIN_PACK_BYTES, STACK_BYTES, CpuLinear, cpu_linear_mode
from ucm_kernels.cpu.native import NativeLib
from ucm_kernels.cpu.timing import ROUNDS, alternating_best_ms, two_way_rounds

log = logging.getLogger(__name__)

ROWS = 512  # a prefill chunk's rows: what the choice is for (fewer go to the skinny kernel or F.linear)
MAX_FLOP = 2 << 30  # ... but a wide weight (lm_head: 49152 x 576) is measured at fewer, so start-up stays short
REPS = 3
FEW_ROWS = (1, 8, 32)  # row classes of few-row calls; more rows than the last take the choice made at ROWS
LAYER_ROWS = (64, ROWS)  # a layer's calls past FEW_ROWS are timed at these: a batch of decodes, a prefill chunk
LAYER_STACK = 4  # layers of weights `measure_layer` cycles through, as a step goes from layer to layer


def measured_rows(k: int, n: int) -> int:
    """The row count a [n, k] weight is measured at: ROWS, fewer (not under 16) where that passes MAX_FLOP."""
    return max(16, min(ROWS, MAX_FLOP // (2 * k * n)))


Timings = tuple[float, float]  # (oneDNN ms, F.linear ms), best of REPS


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def reorder(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] (fp32, CPU) in oneDNN's blocked layout for `linear`."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError(f"oneDNN reorder takes a 2-D fp32 CPU weight, got {weight.dtype} {tuple(weight.shape)}")
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def linear(x: torch.Tensor, reordered: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T + bias with W from `reorder`."""
    return torch.ops.mkldnn._linear_pointwise(x, reordered, bias, "none", [], "")


def measure(k: int, n: int) -> list[Timings]:
    """One (oneDNN, F.linear) pair per round (tests replace this to force a result)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(measured_rows(k, n), k, generator=gen)
    packed = reorder(w)
    return two_way_rounds([lambda: linear(x, packed, None), lambda: F.linear(x, w)], REPS)


_memo = WinMemo()
_tie_memo = WinMemo()
NEAR_TIE = 0.05  # beyond the round-to-round spread of a tie measured (`prefill_near_tie`)


def onednn_wins(lib: NativeLib, k: int, n: int, root: Path | None = None) -> bool:
    """Whether oneDNN runs a [n, k] weight's prefill-sized calls on this machine (see the module doc)."""
    mode = cpu_linear_mode()
    if mode is CpuLinear.TORCH or not available():
        return False
    if mode is CpuLinear.NATIVE:
        return True
    if 4 * k * n < MIN_PACK_BYTES:
        return False  # cache-sized: the tests' tiny models would spend their start-up measuring noise
    # Disagreeing rounds: F.linear (no extra copy), stored as provisional.
    return measured_win(
        _memo, lib, root, f"onednn fp32 {n}x{k}", "onednn", lambda: measure(k, n),
        ("oneDNN", "F.linear"), f"calls of more than {FEW_ROWS[-1]} rows", f"{measured_rows(k, n)} rows", log,
    )  # fmt: skip


LayerChoice = tuple[bool, ...]  # per weight of a layer, in call order: oneDNN for its calls (of one row class)
LayerClasses = tuple[frozenset[int], ...]  # per weight of a layer, in call order: the FEW_ROWS classes oneDNN runs


def measure_layer(
    shapes: Sequence[tuple[int, int]],
    candidates: Sequence[LayerChoice],
    row_counts: Sequence[int] = LAYER_ROWS,
    layers: int = LAYER_STACK,
) -> list[list[float]]:
    """Per round, each candidate's ms per row (summed over `row_counts`) for `layers` layers of `shapes` ([n, k], in
    call order), the candidates taking turns (tests replace this to force a result)."""
    gen = torch.Generator().manual_seed(0)
    # One allocation each, filled at memory speed (a few-row stack is past the last-level cache: hundreds of MB)
    stack = [
        [w.uniform_(-1.0, 1.0, generator=gen) for w in (torch.empty(n, k) for n, k in shapes)] for _ in range(layers)
    ]
    reordered = [[reorder(w) for w in layer] for layer in stack]
    xs = {(rows, k): torch.randn(rows, k, generator=gen) for rows in row_counts for _, k in shapes}

    def run(choice: LayerChoice, rows: int) -> None:
        for layer, copies in zip(stack, reordered, strict=True):
            for w, r, one in zip(layer, copies, choice, strict=True):
                x = xs[(rows, w.shape[1])]
                _ = linear(x, r, None) if one else F.linear(x, w)

    runs = [lambda c=c, r=r: run(c, r) for c in candidates for r in row_counts]
    for fn in runs:
        fn()
    per_round = []
    for _ in range(ROUNDS):
        ms = alternating_best_ms(runs, REPS)
        per_round.append([
            sum(ms[i * len(row_counts) + j] / rows for j, rows in enumerate(row_counts)) for i in range(len(candidates))
        ])  # fmt: skip
    return per_round


_layer_memo: ChoiceMemo[tuple[str, str, int, str], LayerChoice] = ChoiceMemo()


def layer_many_rows(lib: NativeLib, shapes: Sequence[tuple[int, int]], root: Path | None = None) -> LayerChoice:
    """Which of a layer's weights ([n, k] shapes in call order) take oneDNN for calls past FEW_ROWS: each shape's
    own choice (`onednn_wins`) where they agree; where they disagree, whichever of that mix, all oneDNN and all
    F.linear ran the layer fastest in every round (rounds that disagree: the mix, provisional). See the module doc."""
    own = tuple(onednn_wins(lib, k, n, root) for n, k in shapes)
    what = f"calls of more than {FEW_ROWS[-1]} rows"
    return _layer_pick(lib, shapes, own, "", what, LAYER_ROWS, LAYER_STACK, root)


def layer_few_rows(lib: NativeLib, shapes: Sequence[tuple[int, int]], root: Path | None = None) -> LayerClasses:
    """Per weight of a layer ([n, k] shapes in call order), the `FEW_ROWS` classes oneDNN runs: each shape's own
    (`few_rows_won`) where they agree on a class; where they disagree, the layer's fastest way at that class, as
    `layer_many_rows` chooses, timed over a stack of layers past the last-level cache (see the module doc)."""
    own = [few_rows_won(lib, k, n, root) for n, k in shapes]
    layers = max(LAYER_STACK, -(-few_rows_stack_bytes() // sum(4 * n * k for n, k in shapes)))
    picks = {
        c: _layer_pick(
            lib, shapes, tuple(c in o for o in own), f" at {c} rows", f"calls of {c} rows", (c,), layers, root
        )
        for c in FEW_ROWS
    }
    return tuple(frozenset(c for c in FEW_ROWS if picks[c][i]) for i in range(len(shapes)))


def _layer_pick(
    lib: NativeLib, shapes: Sequence[tuple[int, int]], own: LayerChoice, suffix: str, what: str,
    row_counts: Sequence[int], layers: int, root: Path | None,
) -> LayerChoice:  # fmt: skip
    """`own` where the shapes agree; else whichever of `own`, all oneDNN and all F.linear ran `layers` layers
    fastest at `row_counts` in every round (stored under the layer's name + `suffix`; rounds that disagree: `own`,
    provisional). `what`: the calls it is for, in the log."""
    if len(set(own)) < 2:
        return own
    candidates = [own, (True,) * len(own), (False,) * len(own)]
    labels = ("as each shape chose", "all oneDNN", "all F.linear")
    name = "onednn fp32 layer " + " ".join(f"{n}x{k}" for n, k in shapes) + suffix
    threads = choice_threads()

    def make() -> LayerChoice:
        tables: list[str] = []

        def run() -> tuple[LayerChoice, list[str]]:
            rounds = measure_layer(shapes, candidates, row_counts, layers)
            picks = {min(range(len(candidates)), key=r.__getitem__) for r in rounds}
            tables.append("; ".join(" / ".join(f"{ms:.4f}" for ms in r) for r in rounds))
            if len(picks) > 1:
                return own, ["the layer's fastest paths"]
            return candidates[picks.pop()], []

        def parse(stored: object) -> LayerChoice | None:
            got = stored.get("onednn_layer") if isinstance(stored, dict) else None
            if not isinstance(got, list) or len(got) != len(own) or not all(isinstance(b, bool) for b in got):
                return None
            return tuple(got)

        choice, where = stored_or_measured(
            "linear", name, lib, threads, root, parse, run, lambda c: {"onednn_layer": list(c)}
        )
        measured = f" ({' / '.join(labels)}, ms a row at {tuple(row_counts)} rows: {tables[0]})" if tables else ""
        log.info(
            "CPU linear %s for %s [%s], %d thread(s): %s %s%s (%s)",
            name, cpu_info()[0], " ".join(vector_flags()), threads, what,
            labels[candidates.index(choice)] if choice in candidates else choice, measured, where,
        )  # fmt: skip
        return choice

    return _layer_memo.get_or_make((str(root), lib.path.name, threads, name), make)


def row_class(rows: int) -> int | None:
    """The `FEW_ROWS` class of a call of `rows` rows (the smallest class at least that), None past the last."""
    return next((c for c in FEW_ROWS if rows <= c), None)


FewTimings = dict[int, Timings]  # per row class: (oneDNN ms, F.linear ms) over the stack, best of REPS


def few_rows_stack_bytes() -> int:
    """The weight bytes `measure_few` cycles through: past the last-level cache, as a decode step's weights are
    when the model's are larger than it. A fixed 64 MB (STACK_BYTES) sat inside the 480 MiB L3 of a Xeon with AMX,
    where F.linear won 8-row calls that oneDNN won in the engine's step (0.54 GB of fp32 weights)."""
    llc = last_level_cache_bytes() or 0
    return max(STACK_BYTES, llc + llc // 4)


def measure_few(k: int, n: int) -> list[FewTimings]:
    """One FewTimings per round (tests replace this to force a result): each `FEW_ROWS` class over a stack of
    random [n, k] weights of `few_rows_stack_bytes`, each path taking its turn."""
    gen = torch.Generator().manual_seed(0)
    count = max(2, -(-few_rows_stack_bytes() // (4 * n * k)))
    # One allocation, filled at memory speed (randn of 600 MB took seconds); the weights are its slices.
    weights = list(torch.empty(count, n, k).uniform_(-1.0, 1.0, generator=gen).unbind(0))
    reordered = [reorder(w) for w in weights]
    xs = {rows: torch.randn(rows, k, generator=gen) for rows in FEW_ROWS}
    runs = {
        rows: [
            lambda x=x: [linear(x, r, None) for r in reordered],
            lambda x=x: [F.linear(x, w) for w in weights],
        ]
        for rows, x in xs.items()
    }
    for pair in runs.values():
        for fn in pair:
            fn()
    rounds: list[FewTimings] = []
    for _ in range(ROUNDS):
        timings: FewTimings = {}
        for rows, pair in runs.items():
            onednn_ms, torch_ms = alternating_best_ms(pair, REPS)
            timings[rows] = (onednn_ms, torch_ms)
        rounds.append(timings)
    return rounds


_few_memo: ChoiceMemo[tuple[str, str, int, int, int], frozenset[int]] = ChoiceMemo()


def _parse_classes(stored: object) -> frozenset[int] | None:
    rows = stored.get("onednn_rows") if isinstance(stored, dict) else None
    if not isinstance(rows, list) or not all(isinstance(r, int) and r in FEW_ROWS for r in rows):
        return None
    return frozenset(rows)


def few_rows_won(lib: NativeLib, k: int, n: int, root: Path | None = None) -> frozenset[int]:
    """The `FEW_ROWS` classes whose calls oneDNN runs for a [n, k] weight on this machine: those it won over the
    rounds. Stored as measured when every round agreed on every class; otherwise as provisional, taken as it is by
    every later process (calibration_store)."""
    mode = cpu_linear_mode()
    if mode is CpuLinear.TORCH or not available():
        return frozenset()
    if mode is CpuLinear.NATIVE:
        return frozenset(FEW_ROWS)
    if 4 * k * n < MIN_PACK_BYTES:
        return frozenset()
    threads = choice_threads()
    memo_key = (str(root), lib.path.name, threads, k, n)

    def make() -> frozenset[int]:
        tables: list[str] = []

        def run() -> tuple[frozenset[int], list[str]]:
            rounds = measure_few(k, n)
            won = [frozenset(c for c in FEW_ROWS if c in t and t[c][0] < t[c][1]) for t in rounds]
            tables.append(
                ", ".join(
                    f"{c}: {min(t[c][0] for t in rounds):.2f} vs {min(t[c][1] for t in rounds):.2f} ms"
                    for c in FEW_ROWS
                )
            )
            # A class the rounds disagree on (a near tie) goes to the path with the smaller total (provisional).
            disagreed = sorted(frozenset.union(*won) - frozenset.intersection(*won))
            total = {c: [sum(t[c][i] for t in rounds) for i in (0, 1)] for c in FEW_ROWS}
            taken = frozenset(c for c in FEW_ROWS if total[c][0] < total[c][1])
            return taken, [f"{c} rows" for c in disagreed]

        classes, where = stored_or_measured(
            "linear", f"onednn fp32 {n}x{k} few rows", lib, threads, root, _parse_classes, run,
            lambda c: {"onednn_rows": sorted(c)},
        )  # fmt: skip
        measured = f" (oneDNN vs F.linear over a stack of weights: {tables[0]})" if tables else ""
        log.info(
            "CPU linear onednn fp32 %dx%d for %s [%s], %d thread(s): calls of up to %s rows through oneDNN at %s, "
            "F.linear at the others%s (%s)",
            n, k, cpu_info()[0], " ".join(vector_flags()), threads, FEW_ROWS[-1],
            sorted(classes) or "none", measured, where,
        )  # fmt: skip
        return classes

    return _few_memo.get_or_make(memo_key, make)


@dataclass(frozen=True)
class OnednnWeight:
    """A weight reordered for oneDNN, and the calls it runs: the `FEW_ROWS` classes it won, and whether it won at
    `ROWS` (every call past the last class)."""

    reordered: torch.Tensor
    few_rows: frozenset[int]
    many_rows: bool

    def takes(self, rows: int) -> bool:
        c = row_class(rows)
        return self.many_rows if c is None else c in self.few_rows


@dataclass(frozen=True)
class OnednnCalls:
    """The calls a weight's layer chose oneDNN for (`layer_few_rows`, `layer_many_rows`)."""

    few_rows: frozenset[int]
    many_rows: bool


def onednn_weight(
    lib: NativeLib, weight: torch.Tensor, calls: OnednnCalls | None = None, taken_rows: int = 0
) -> OnednnWeight | None:
    """`weight` reordered for oneDNN with the calls it wins here, or None where it wins none (F.linear, no extra
    memory). `calls`: its layer's choice, else the weight's own. `taken_rows`: calls of up to that many rows go to
    another kernel first (the skinny kernel's panels), so the row classes within it are not oneDNN's: a copy kept
    for those alone would be a whole weight's memory for calls it never gets (Llama-1B's gate_up in fp32 on the 2-core
    Xeon as an AVX2-only host: 2.1 GB for the 8- and 32-row classes, which its bf16 panels take). A copy kept for
    few-row classes takes the prefill-sized calls too where the two paths tied there (`prefill_near_tie`)."""
    n, k = weight.shape
    many = onednn_wins(lib, k, n) if calls is None else calls.many_rows
    few = few_rows_won(lib, k, n) if calls is None else calls.few_rows
    few = frozenset(c for c in few if c > taken_rows)
    if few and not many:
        many = prefill_near_tie(lib, k, n)
    return OnednnWeight(reorder(weight), few, many) if many or few else None


def prefill_near_tie(lib: NativeLib, k: int, n: int, root: Path | None = None) -> bool:
    """Whether oneDNN and F.linear ran a [n, k] weight's prefill-sized calls within `NEAR_TIE` of each other in every
    round. Asked where a oneDNN copy is kept for few-row classes anyway and the prefill-sized calls went to F.linear:
    at a near tie they take the copy too, so it takes every call and the plain weight is freed (engine/models/dense.py)
    instead of both staying for a coin toss. The 2-core Xeon as an AVX2-only host, 512 rows of Llama-1B's shapes: the
    two within 2.5% either way round to round (gate_up 15.9 vs 15.7 ms, then 14.8 vs 15.1), while gate_up's 32-row
    class went to oneDNN by 3-8%: both copies of gate_up stayed, 2.1 GB of fp32. A clear difference either way keeps
    the choice made (a layer's may go against its shapes' own: `layer_many_rows`)."""
    if cpu_linear_mode() is not CpuLinear.AUTO:
        return False  # `native`: oneDNN everywhere already; `torch` keeps no copy to ask about
    return measured_win(
        _tie_memo, lib, root, f"onednn fp32 {n}x{k} near tie", "near_tie",
        lambda: [(abs(onednn - f_linear), NEAR_TIE * min(onednn, f_linear)) for onednn, f_linear in measure(k, n)],
        (f"either path (within {NEAR_TIE:.0%})", "the path chosen"), f"calls of more than {FEW_ROWS[-1]} rows",
        f"{measured_rows(k, n)} rows, the difference vs {NEAR_TIE:.0%} of the faster", log,
    )  # fmt: skip


def forget() -> None:
    """Drop this process's memoised choices (tests)."""
    _memo.clear()
    _tie_memo.clear()
    _few_memo.clear()
    _layer_memo.clear()
