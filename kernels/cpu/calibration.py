"""Which CPU attention path runs, decided by measuring both on this machine (`UCM_CPU_ATTENTION=auto`, the default).

Neither path wins everywhere: the C kernel's speed depends on the vector path the build got (AVX-512, AVX2,
NEON or scalar) and the torch path's on its GEMMs and thread count. So on the first CPU attention call for a new
(dtype, head geometry, block size) at the current torch thread count, `plan()` times the native kernel and the
torch path on one small problem per shape class (`PROBLEMS`: a decode batch, a prefill chunk over a cached
prefix, a whole prompt), picks the faster of each, logs the numbers once, and, when its two rounds of timing
agree and no other process took cores meanwhile (a busy machine can flip a round: such a pick is used but measured
again next time), stores them in `<cache dir>/kernels/calibration-<key hash>.json`. Processes measure for one file
one at a time (a lock file beside it), so nodes that start together do not time each other's load. The key (`calibration_key`) is the CPU model and flags, the
native library's file name (a hash of its sources, flags and compiler), torch's version and the thread count:
when any of them changes the hash names another file, so a stale choice is never read. A later process with
the same key reads the file instead of measuring. `plan()` runs at most once per key and geometry per process
(engine start-up calls it through `kernels.calibrate_cpu_attention`, so no request waits on it); calls after
that are a dict lookup.

`bf16_matmul_faster()` is the same idea for `dtype="auto"` (engine/config.py): on a CPU whose flags say bf16 is
native, a model-shaped matmul in bf16 and in fp32, cached the same way.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import hashlib
import json
import logging
import os
import platform
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import TypeVar

import torch
import torch.nn.functional as F

from kernels.cache_dir import cache_dir
from kernels.cpu.native import NativeLib
from kernels.cpu.paged_attention import paged_attention_native
from kernels.reference import decode_attention_chunked_torch, prefill_attention_torch

log = logging.getLogger(__name__)
T = TypeVar("T")

NATIVE, TORCH = "native", "torch"
ROUNDS = 2  # independent rounds per class; a winner they disagree on is used but not stored (see `plan`)
REPS = 3  # timed calls of each path per round, the two paths alternating so a burst of other load hits both
MAX_S_PER_ROUND = 0.15  # stop a round early once it has taken this long (keeps a whole plan near 1 s)
# A measurement is stored only if other processes took at most this many cores on average meanwhile (the machine's
# busy time less this process's CPU time); beyond it the timings say more about the sharing than about the kernels
# (two nodes that start together calibrate at once). Intervals shorter than MIN_JUDGED_S, a few of the kernel's
# 10 ms ticks, are not judged (a test's forced result).
OTHERS_MAX_CORES = 0.25
MIN_JUDGED_S = 0.1
FILE_VERSION = 3  # 3: the skinny kernel measured against oneDNN too; 2: stored only when the rounds agree


class ShapeClass(str, enum.Enum):  # noqa: UP042 (str() of members is part of the cache-file format)
    DECODE = "decode"  # one query per sequence (`kernels.decode_attention`)
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


@lru_cache(maxsize=1)
def cpu_info() -> tuple[str, str]:
    """(model name, the flags line) from /proc/cpuinfo; platform's answer where there is none."""
    model, flags = "", ""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                name, _, value = line.partition(":")
                name = name.strip()
                if name in ("model name", "Model", "CPU part") and not model:
                    model = value.strip()
                elif name in ("flags", "Features") and not flags:
                    flags = value.strip()
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), flags


def vector_flags() -> list[str]:
    """The CPU flags that decide the kernels' speed, for logs and benchmark headers."""
    have = set(cpu_info()[1].split())
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "asimd", "sve")
    return [f for f in wanted if f in have]


def torch_isa() -> str:
    """The ISA torch's own kernels, its oneDNN and its MKL use here: the CPU's unless capped (`ATEN_CPU_CAPABILITY`,
    `ONEDNN_MAX_CPU_ISA`, `MKL_ENABLE_INSTRUCTIONS`), so a capped process never reads timings taken uncapped."""
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or ""
    mkl = os.environ.get("MKL_ENABLE_INSTRUCTIONS", "")
    caps = [f"oneDNN <= {onednn}"] * bool(onednn) + [f"MKL <= {mkl}"] * bool(mkl)
    return ", ".join([torch.backends.cpu.get_cpu_capability(), *caps])


def calibration_key(lib: NativeLib, threads: int) -> dict[str, object]:
    model, flags = cpu_info()
    return {"cpu": model, "flags": flags, "machine": platform.machine(), "library": lib.path.name,
            "torch": torch.__version__, "torch_isa": torch_isa(), "threads": threads}  # fmt: skip


def key_file(kind: str, key: dict[str, object], root: Path | None) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return (root if root is not None else cache_dir()) / "kernels" / f"{kind}-{digest}.json"


def read_entries(path: Path, key: dict[str, object]) -> dict[str, dict]:
    """The file's entries if it is ours (same version and key); else none (absent, stale or damaged)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != FILE_VERSION or data.get("key") != key:
        return {}
    entries = data.get("entries")
    return entries if isinstance(entries, dict) else {}


def write_entry(path: Path, key: dict[str, object], name: str, entry: dict) -> None:
    """Add one entry; written to a temporary file and renamed, so concurrent readers see an old or a new file."""
    entries = read_entries(path, key)
    entries[name] = entry
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump({"version": FILE_VERSION, "key": key, "entries": entries}, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache costs a measurement per process, nothing else
        log.warning("could not store the CPU calibration in %s: %s", path, e)


def best_ms(fn: Callable[[], object], reps: int = REPS) -> float:
    """Fastest of `reps` calls after a warm-up (first-touch of the output, torch's lazy initialisation), in ms."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1000


def alternating_best_ms(runs: Sequence[Callable[[], object]], reps: int, seconds: float = float("inf")) -> list[float]:
    """The fastest milliseconds of each of `runs` over `reps` passes that call them in turn, so load that comes
    and goes slows all of them rather than the one measured at the time; stops early after `seconds`. The
    caller warms them up."""
    best, t_end = [float("inf")] * len(runs), time.perf_counter() + seconds
    for _ in range(reps):
        for i, fn in enumerate(runs):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], (time.perf_counter() - t0) * 1000)
        if time.perf_counter() > t_end:
            break
    return best


def two_way_rounds(runs: Sequence[Callable[[], object]], reps: int) -> list[tuple[float, float]]:
    """The two `runs` (a kernel and what it stands in for) warmed up, then ROUNDS rounds of `alternating_best_ms`:
    (first's ms, second's ms) per round, what `measured_win` decides on."""
    assert len(runs) == 2, "a two-way choice"
    for fn in runs:
        fn()
    rounds = []
    for _ in range(ROUNDS):
        first, second = alternating_best_ms(runs, reps)
        rounds.append((first, second))
    return rounds


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
    return {
        NATIVE: lambda: paged_attention_native(lib, q, k_cache, v_cache, qsl, lens, tables, scale),
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


class _Memo:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.plans: dict[tuple[str, str, int, Geometry], Plan] = {}


_memo = _Memo()


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


@dataclass(frozen=True)
class Source:
    """Where a calibrated value came from, for the log line."""

    path: Path
    measured: bool
    seconds: float = 0.0
    not_stored: tuple[str, ...] = ()  # why the measurement was not stored (its rounds disagreed, other load)

    def __str__(self) -> str:
        if not self.measured:
            return f"from {self.path}"
        if not self.not_stored:
            return f"measured in {self.seconds:.2f} s; stored in {self.path}"
        return f"measured in {self.seconds:.2f} s; not stored: {'; '.join(self.not_stored)}"


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """One process at a time measures for a cache file: two nodes starting together would otherwise each time the
    kernels on half the cores and store what the sharing decided. Without a usable lock file, no lock."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def busy_cpu_s() -> float | None:
    """Seconds every CPU of the machine has spent busy since boot (Linux's /proc/stat), or None elsewhere."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal (guest time is already inside user and nice)
    ticks = [int(v) for v in fields[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / _TICKS_PER_S


_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class CpuClock:
    """A moment's wall clock, this process's CPU time and the machine's busy CPU time (None where it cannot be
    read): two of them tell whether other processes ran in between."""

    wall_s: float
    own_cpu_s: float
    machine_busy_s: float | None

    @classmethod
    def now(cls) -> CpuClock:
        return cls(time.perf_counter(), time.process_time(), busy_cpu_s())

    def others_cores_since(self, start: CpuClock) -> float | None:
        """How many cores other processes (and a hypervisor's steal) took on average since `start`, or None when
        the interval is too short for the kernel's tick to tell (a test's forced result) or unreadable."""
        wall = self.wall_s - start.wall_s
        if self.machine_busy_s is None or start.machine_busy_s is None or wall < MIN_JUDGED_S:
            return None
        others = (self.machine_busy_s - start.machine_busy_s) - (self.own_cpu_s - start.own_cpu_s)
        return max(0.0, others) / wall


def stored_or_measured(
    file_kind: str,
    name: str,
    lib: NativeLib,
    threads: int,
    root: Path | None,
    parse: Callable[[object], T | None],
    measure_fn: Callable[[], tuple[T, list[str]]],
    encode: Callable[[T], dict[str, object]],
) -> tuple[T, Source]:
    """Entry `name` of this machine's `file_kind` cache file where `parse` accepts it, else `measure_fn()`'s
    (value, what its rounds disagreed on), measured by one process at a time and stored only when the rounds agreed
    on everything and no other process took cores meanwhile: a loaded machine's answer is used now and measured
    again by the next process. The caller memoises and logs."""
    key = calibration_key(lib, threads)
    path = key_file(file_kind, key, root)
    found = parse(read_entries(path, key).get(name))
    if found is not None:
        return found, Source(path, measured=False)
    with _file_lock(path):
        found = parse(read_entries(path, key).get(name))  # stored by the process that held the lock before us
        if found is not None:
            return found, Source(path, measured=False)
        start = CpuClock.now()
        value, disagreed = measure_fn()
        end = CpuClock.now()
        others = end.others_cores_since(start)
        not_stored = [f"rounds disagreed on {', '.join(disagreed)} (other load on the CPU?)"] if disagreed else []
        if others is not None and others > OTHERS_MAX_CORES:
            not_stored.append(f"other processes took {others:.2f} cores meanwhile")
        if not not_stored:
            write_entry(path, key, name, encode(value))
    return value, Source(path, measured=True, seconds=end.wall_s - start.wall_s, not_stored=tuple(not_stored))


class WinMemo:
    """This process's answers of `measured_win`, per (root, library, threads, choice)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.wins: dict[tuple[str, str, int, str], bool] = {}

    def clear(self) -> None:
        with self.lock:
            self.wins.clear()


def measured_win(
    memo: WinMemo,
    lib: NativeLib,
    root: Path | None,
    name: str,
    field: str,
    rounds: Callable[[], Sequence[tuple[float, float]]],
    paths: tuple[str, str],
    calls: str,
    setting: str,
    logger: logging.Logger,
) -> bool:
    """Whether path `paths[0]` beat `paths[1]` in every round of `rounds()` ((first ms, second ms) each) for the
    linear-layer choice `name` on this machine: memoised, else read from the `linear` cache file under `field`, else
    measured. Rounds that disagree give the second path now, unstored, so the next process measures again. Logged
    once per process: `calls` names the calls the choice is for, `setting` what was measured (e.g. "8 rows")."""
    threads = torch.get_num_threads()
    memo_key = (str(root), lib.path.name, threads, name)
    with memo.lock:
        found = memo.wins.get(memo_key)
        if found is not None:
            return found
        tables: list[str] = []

        def run() -> tuple[bool, list[str]]:
            measured = rounds()
            picks = [first < second for first, second in measured]
            tables.append(", ".join(f"{first:.2f} vs {second:.2f} ms" for first, second in measured))
            return all(picks), [] if len(set(picks)) == 1 else [f"{paths[0]} won {sum(picks)} of {len(picks)} rounds"]

        def parse(stored: object) -> bool | None:
            wins = stored.get(field) if isinstance(stored, dict) else None
            return wins if isinstance(wins, bool) else None

        wins, where = stored_or_measured("linear", name, lib, threads, root, parse, run, lambda w: {field: w})
        measured = f" ({paths[0]} vs {paths[1]} at {setting}: {tables[0]})" if tables else ""
        logger.info(
            "CPU linear %s for %s [%s], %d thread(s): %s through %s%s (%s)",
            name, cpu_info()[0], " ".join(vector_flags()), threads, calls, paths[0] if wins else paths[1], measured,
            where,
        )  # fmt: skip
        memo.wins[memo_key] = wins
        return wins


def plan(lib: NativeLib, g: Geometry, root: Path | None = None) -> Plan:
    """The path per shape class for this geometry on this machine: memoised, else read from the cache file,
    else measured (and stored). `root` overrides the cache dir (tests)."""
    threads = torch.get_num_threads()
    # The memo's key stands for the file's (same CPU and torch within a process): no hashing per call.
    memo_key = (str(root), lib.path.name, threads, g)
    found = _memo.plans.get(memo_key)
    if found is not None:
        return found
    with _memo.lock:
        found = _memo.plans.get(memo_key)
        if found is not None:
            return found
        result, where = stored_or_measured(
            "calibration", g.label(), lib, threads, root, _parse_plan, lambda: _measure_plan(lib, g), _encode_plan
        )
        log.info("%s (%s)", _describe(g, threads, result, "calibrated" if where.measured else "calibration"), where)
        _memo.plans[memo_key] = result
        return result


def forget() -> None:
    """Drop this process's memoised plans (tests)."""
    with _memo.lock:
        _memo.plans.clear()


# ---------------------------------------------------------------- dtype="auto": is bf16 actually faster here?

# One projection of a small Llama (hidden 2048, MLP 5632) on a 64-token step: big enough for the GEMM to dominate.
MATMUL_SHAPE = (64, 2048, 5632)  # tokens, in features, out features


def measure_matmul() -> dict[str, float]:
    """Best-of-REPS milliseconds of F.linear in bf16 and fp32 on MATMUL_SHAPE (tests replace this)."""
    t, k, n = MATMUL_SHAPE
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(t, k, generator=gen), torch.randn(n, k, generator=gen)
    xb, wb = x.bfloat16(), w.bfloat16()
    return {"bfloat16": best_ms(lambda: F.linear(xb, wb), 5), "float32": best_ms(lambda: F.linear(x, w), 5)}


def bf16_matmul_faster(root: Path | None = None) -> tuple[bool, dict[str, float]]:
    """Whether a bf16 matmul beats fp32 here, with the milliseconds; cached per CPU, torch version and threads."""
    model, flags = cpu_info()
    key = {"cpu": model, "flags": flags, "machine": platform.machine(), "torch": torch.__version__,
           "torch_isa": torch_isa(), "threads": torch.get_num_threads()}  # fmt: skip
    path = key_file("dtype", key, root)
    times = read_entries(path, key).get("matmul")
    if not (isinstance(times, dict) and set(times) == {"bfloat16", "float32"}):
        times = measure_matmul()
        write_entry(path, key, "matmul", times)
    return times["bfloat16"] < times["float32"], times
