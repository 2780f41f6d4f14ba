"""Which CPU attention path runs, decided by measuring both on this machine (`UCM_CPU_ATTENTION=auto`, the default).

Neither path wins everywhere: the C kernel's speed depends on the vector path the build got (AVX-512, AVX2,
NEON or scalar) and the torch path's on its GEMMs and thread count. So on the first CPU attention call for a new
(dtype, head geometry, block size), `plan()` times the native kernel and the torch path on one small problem per
shape class (`PROBLEMS`: a decode batch, a prefill chunk over a cached prefix, a whole prompt), picks the faster of
each and logs the numbers once. The result goes to a cache file keyed by the CPU, the native library, torch and the
host's thread count (ucm_kernels/cpu/choice_threads.py: one path per host, whatever a process or step runs on;
ucm_kernels/cpu/calibration_store.py: measured one process at a time at that count, and stored as provisional when
its rounds disagree or other processes took cores meanwhile). A later process with the same key reads the file
instead of measuring.
`plan()` runs at most once per key and geometry per process (engine start-up calls it through
`ucm_kernels.calibrate_cpu_attention`, so no request waits on it); calls after that are a dict lookup.

`bf16_matmul_faster()` is the same idea for `dtype="auto"` (engine/config.py): on a CPU whose flags say bf16 is
native, a model-shaped matmul in bf16 and in fp32, cached the same way.
"""

from __future__ import annotations

import enum
import functools
import logging
import platform
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from ucm_kernels.choice_memo import ChoiceMemo
from ucm_kernels.cpu.calibration_store import key_file, pinned, read_sections, stored_or_measured, write_entry
from ucm_kernels.cpu.choice_threads import choice_threads, measuring_at
from ucm_kernels.cpu.host import cpu_info, torch_isa, vector_flags
from ucm_kernels.cpu.native import NativeLib
from ucm_kernels.cpu.paged_attention import paged_attention_native
from ucm_kernels.cpu.timing import REPS, ROUNDS, alternating_best_ms
from ucm_kernels.reference import decode_attention_chunked_torch, prefill_attention_torch

log = logging.getLogger(__name__)

NATIVE, TORCH = "native", "torch"
# bf16 overrides the measurement: a row's bits must not depend on how its prompt was split (whole, in chunks,
# after a prefix-cache hit, a decode), or greedy output after a cache hit differs from the cold run's. The native
# kernel computes each row the same way whatever the split (ucm_kernels/cpu/paged_attention_dpbf16.h); torch's SDPA
# does not (its flash kernel's key blocks follow the call's lengths, and a chunk needs an explicit mask). On a
# 2-core Xeon with AMX that measured torch faster for prompts and chunks, 6 prompts continued after a 496-token
# hit diverged from the cold run (tests/engine/test_bf16_cache_hit.py). fp32's rounding is too fine to flip a
# greedy token, so fp32 keeps the faster path.
BF16_NATIVE_WHY = "the same bits for a row whatever the split (the cache-hit oracle), faster or not"
MAX_S_PER_ROUND = 0.15  # stop a round early once it has taken this long (keeps a whole plan near 1 s)


class ShapeClass(str, enum.Enum):  # noqa: UP042 (str() of members is part of the cache-file format)
    DECODE = "decode"  # one query per sequence (`ucm_kernels.decode_attention`)
    CHUNK = "chunk"  # prefill rows over a cached prefix: every prefill call that is not all whole prompts
    PROMPT = "prompt"  # sequences whose new tokens are their whole context


@dataclass(frozen=True)
class Problem:
    """The measured problem of a class: `batch` sequences of `ctx` context tokens, `new` of them queries."""

    batch: int
    ctx: int
    new: int


# Small but past the per-call overheads: the engine's decode batches, a 256-token chunk of a longer prompt.
PROBLEMS = {
    ShapeClass.DECODE: Problem(batch=8, ctx=1024, new=1),
    ShapeClass.CHUNK: Problem(batch=1, ctx=1024, new=256),
    ShapeClass.PROMPT: Problem(batch=1, ctx=256, new=256),
}


@dataclass(frozen=True)
class Geometry:
    """What the choice may depend on besides the machine: the tensors' dtype and the attention's shape."""

    dtype: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    def label(self) -> str:
        return f"{self.dtype} {self.num_q_heads}/{self.num_kv_heads} heads x {self.head_dim} bs{self.block_size}"


@dataclass(frozen=True)
class Pick:
    impl: str  # NATIVE or TORCH
    native_ms: float
    torch_ms: float


Plan = dict[ShapeClass, Pick]


def _runs(lib: NativeLib, g: Geometry, shape_class: ShapeClass) -> dict[str, Callable[[], object]]:
    """The native and torch calls on `PROBLEMS[shape_class]`, random data, blocks in shuffled order."""
    pb = PROBLEMS[shape_class]
    dtype = getattr(torch, g.dtype)
    gen = torch.Generator().manual_seed(0)
    per_seq = -(-pb.ctx // g.block_size)
    shape = (pb.batch * per_seq, g.block_size, g.num_kv_heads, g.head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    tables = torch.randperm(shape[0], generator=gen).view(pb.batch, per_seq).to(torch.int32)
    lens = torch.full((pb.batch,), pb.ctx, dtype=torch.int32)
    q = torch.randn(pb.batch * pb.new, g.num_q_heads, g.head_dim, generator=gen).to(dtype)
    scale = g.head_dim**-0.5
    if shape_class is ShapeClass.DECODE:
        return {
            NATIVE: lambda: paged_attention_native(lib, q, k_cache, v_cache, None, lens, tables, scale),
            TORCH: lambda: decode_attention_chunked_torch(q, k_cache, v_cache, tables, lens, scale, pb.ctx),
        }
    qsl = torch.arange(0, pb.batch * pb.new + 1, pb.new, dtype=torch.int32)
    # Named prompt rows, as the model runner names them (AttentionMetadata.prompt_queries): where the CPU has AMX they
    # take its prompt body, and unnamed rows a generated token's body, token by token; the engine runs the former.
    prompts = torch.full((pb.batch,), pb.new, dtype=torch.int32)
    return {
        NATIVE: lambda: paged_attention_native(lib, q, k_cache, v_cache, qsl, lens, tables, scale, prompts),
        TORCH: lambda: prefill_attention_torch(q, k_cache, v_cache, qsl, lens, tables, scale, pb.new),
    }


def measure(lib: NativeLib, g: Geometry, shape_class: ShapeClass) -> list[dict[str, float]]:
    """Per round, the fastest milliseconds of each path on the class's problem (tests replace this to force a
    result). The best of several calls, since other processes only ever add time; the paths alternate call by
    call, so load that comes and goes slows both rather than the one measured at the time."""
    runs = _runs(lib, g, shape_class)
    for fn in runs.values():
        fn()  # warm-up
    rounds = []
    for _ in range(ROUNDS):
        best = alternating_best_ms(list(runs.values()), REPS, MAX_S_PER_ROUND)
        rounds.append(dict(zip(runs, best)))
    return rounds


def _pick(rounds: list[dict[str, float]]) -> tuple[Pick, bool]:
    """The faster path over all rounds, and whether every round agreed on it."""
    native_ms = min(r[NATIVE] for r in rounds)
    torch_ms = min(r[TORCH] for r in rounds)
    winners = {NATIVE if r[NATIVE] <= r[TORCH] else TORCH for r in rounds}
    return Pick(NATIVE if native_ms <= torch_ms else TORCH, native_ms, torch_ms), len(winners) == 1


def _describe(g: Geometry, threads: int, plan: Plan, source: str) -> str:
    cls = "; ".join(
        f"{c.value} {p.impl} ({p.native_ms:.2f} ms native vs {p.torch_ms:.2f} torch)" for c, p in plan.items()
    )
    return (f"CPU attention {source} for {cpu_info()[0]} [{' '.join(vector_flags())}], {threads} thread(s), "
            f"{g.label()}: {cls}")  # fmt: skip


_memo: ChoiceMemo[tuple[str, str, int, Geometry], Plan] = ChoiceMemo()


def _parse_plan(stored: object) -> Plan | None:
    if not isinstance(stored, dict):
        return None
    try:
        result = {ShapeClass(c): Pick(**p) for c, p in stored.items()}
    except (TypeError, ValueError):  # written by another version of this code: measure again
        return None
    return result if set(result) == set(ShapeClass) else None


def _measure_plan(lib: NativeLib, g: Geometry) -> tuple[Plan, list[str]]:
    picked = {c: _pick(measure(lib, g, c)) for c in ShapeClass}
    return {c: pick for c, (pick, _) in picked.items()}, [c.value for c, (_, agreed) in picked.items() if not agreed]


def _encode_plan(result: Plan) -> dict[str, object]:
    return {c.value: asdict(p) for c, p in result.items()}


def plan(lib: NativeLib, g: Geometry, root: Path | None = None) -> Plan:
    """The path per shape class for this geometry on this machine: memoised, else read from the cache file,
    else measured (and stored). `root` overrides the cache dir (tests)."""
    threads = choice_threads()
    # The memo's key stands for the file's (same CPU and torch within a process): no hashing per call.
    memo_key = (str(root), lib.path.name, threads, g)

    def make() -> Plan:
        result, where = stored_or_measured(
            "calibration", g.label(), lib, threads, root, _parse_plan, lambda: _measure_plan(lib, g), _encode_plan
        )
        log.info("%s (%s)", _describe(g, threads, result, "calibrated" if where.measured else "calibration"), where)
        if g.dtype == "bfloat16" and any(p.impl != NATIVE for p in result.values()):
            result = {c: replace(p, impl=NATIVE) for c, p in result.items()}
            log.info("CPU attention in bf16 runs native for every shape class: %s", BF16_NATIVE_WHY)
        return result

    return _memo.get_or_make(memo_key, make)


def forget() -> None:
    """Drop this process's memoised plans (tests)."""
    _memo.clear()


# ---------------------------------------------------------------- dtype="auto": is bf16 actually faster here?

# One projection of a small Llama (hidden 2048, MLP 5632) on a 64-token step: big enough for the GEMM to dominate.
MATMUL_SHAPE = (64, 2048, 5632)  # tokens, in features, out features


MATMUL_REPS = 20  # alternating rounds (at most MATMUL_SECONDS)
MATMUL_SECONDS = 1.0


def measure_matmul() -> dict[str, float]:
    """Best milliseconds of F.linear in bf16 and fp32 on MATMUL_SHAPE, the two alternating (tests replace this).

    Cached for the machine's life, and engine/step_budget.py reads an absolute rate off it where the native library
    is missing (else it times the served model's own layer shapes), so it must not depend on the moment. On an idle 2-core Zen 5 EPYC, best of 5 calls each, one dtype after the other, gave 345-598 GFLOP/s
    in bf16 in three runs a minute apart (a 2048-token step predicted at 0.73-1.26 s, across step_budget's 1.0 s);
    alternating, best of 20, 462-599 in five runs (0.73-0.94 s), in 0.4-0.6 s each."""
    t, k, n = MATMUL_SHAPE
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(t, k, generator=gen), torch.randn(n, k, generator=gen)
    xb, wb = x.bfloat16(), w.bfloat16()
    runs = [lambda: F.linear(xb, wb), lambda: F.linear(x, w)]
    for run in runs:
        run()  # warm-up: oneDNN builds its primitive, the output is first touched
    bf16, fp32 = alternating_best_ms(runs, MATMUL_REPS, MATMUL_SECONDS)
    return {"bfloat16": bf16, "float32": fp32}


def bf16_matmul_faster(root: Path | None = None) -> tuple[bool, dict[str, float]]:
    """Whether a bf16 matmul beats fp32 here, with the milliseconds; cached per CPU, torch version and threads."""
    times = matmul_times(root)
    return times["bfloat16"] < times["float32"], times


def matmul_times(root: Path | None = None) -> dict[str, float]:
    """MATMUL_SHAPE's milliseconds in bf16 and fp32 on this machine: read from the cache file, else measured and
    stored (engine/step_budget.py reads the rate off them where the native library is missing)."""
    model, flags = cpu_info()
    key = {"cpu": model, "flags": flags, "machine": platform.machine(), "torch": torch.__version__,
           "torch_isa": torch_isa(), "threads": choice_threads()}  # fmt: skip
    path = key_file("dtype", key, root)
    pin = pinned("dtype", choice_threads(), "matmul")
    times = pin[0] if pin is not None else read_sections(path, key).entries.get("matmul")
    if not (isinstance(times, dict) and set(times) == {"bfloat16", "float32"}):
        with measuring_at(choice_threads()):
            times = measure_matmul()
        write_entry(path, key, "matmul", times)
    return times


INVARIANCE_ROWS = (1, 16, 48, 64, 128, 256, 512)  # call sizes compared with one call of 2048 rows


@functools.lru_cache(maxsize=1)
def bf16_linear_rows_invariant() -> bool:
    """Whether torch's bf16 matmul (oneDNN) gives a row the same bits whatever the call's row count, here.

    The engine's prompt rows go through it, so the bf16 cache-hit oracle (a prompt continued after a prefix hit,
    whose last few rows are a small call, gives the cold run's greedy tokens) needs it. The AVX-512 BF16 EPYC
    (Zen 5) has it; a 2-core Xeon with AMX does not: SmolLM2's three prompt shapes differ from the 2048-row
    call at 48-512 rows, and agree at up to 32 and at 1024, 1 thread or 2 (oneDNN picks another AMX blocking by
    row count). Capping oneDNN below AMX restores it at a tenth of the speed. A probe of ~20 ms, once a process."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(960, 576, generator=gen).bfloat16()
    x = torch.randn(2048, 576, generator=gen).bfloat16()
    whole = F.linear(x, w)
    return all(torch.equal(F.linear(x[:m], w), whole[:m]) for m in INVARIANCE_ROWS)
