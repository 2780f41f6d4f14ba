"""The CPU's multiply-accumulate rate at this moment (`peak`): which phase of a shared host a benchmark ran in; and
a streaming read of a buffer as several streams a thread (`read_sum`), the read bandwidth no kernel beats.

A loop of the widest multiply-accumulate this CPU has for a dtype, on register-resident operands (values of magnitude
[1, 2), not zeros, which the AMX unit ran ~15% faster: peak_probe.c), for ~20 ms on the given threads (a small library
built like the kernels: ucm_kernels/cpu/native.py). No matmul beats it; what it measures is the host: on the 2-core
Xeon with AMX (a VM) the tile loop gave ~4.5 TFLOP/s at some moments and ~1.9 at others (2 threads, on values), for
seconds to minutes each, and the engine's and oneDNN's matmuls moved with it. Benchmarks probe before and after their
runs (benchmarks.vs_vllm, benchmarks.roofline) so that each figure carries its phase.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ucm_kernels.cpu.host import usable_vector_flags
from ucm_kernels.cpu.native import HEADERS, Recipe, probe_function

log = logging.getLogger(__name__)

PROBE = Recipe(
    "ucm_peak_probe",
    (Path(__file__).with_name("peak_probe.c"),),
    tuple(h for h in HEADERS if h.name == "amx_tiles.h"),
    ("-O3", "-march=native", "-std=c11", "-shared", "-fPIC", "-fopenmp"),
)
PROBE_S = 0.02  # each probe's length: several of a loop's rounds per scheduler tick, short beside a benchmark


class Kind(enum.IntEnum):
    """The instruction looped (peak_probe.c's enum)."""

    AMX_BF16 = 0  # TDPBF16PS
    AVX512_BF16 = 1  # VDPBF16PS
    AVX512_FP32 = 2  # VFMADD (zmm)
    AVX2_FP32 = 3  # VFMADD (ymm)
    NEON_FP32 = 4  # FMLA


def widest(dtype: str, flags: list[str] | None = None) -> Kind | None:
    """The instruction a `dtype` ("bfloat16" or "float32") matmul can run fastest here, or None (flags None: this
    process's for that dtype, so an AVX2-capped one times the AVX2 loop, as its matmuls run)."""
    have = set(usable_vector_flags(dtype) if flags is None else flags)
    order = {
        "bfloat16": [("amx_bf16", Kind.AMX_BF16), ("avx512_bf16", Kind.AVX512_BF16)],
        "float32": [("avx512f", Kind.AVX512_FP32), ("fma", Kind.AVX2_FP32), ("asimd", Kind.NEON_FP32)],
    }
    if dtype not in order:
        raise ValueError(f"dtype must be bfloat16 or float32, got {dtype!r}")
    return next((kind for flag, kind in order[dtype] if flag in have), None)


@dataclass(frozen=True)
class Peak:
    kind: Kind
    threads: int
    tflops: float

    def line(self) -> str:
        return f"{self.kind.name} loop {self.tflops:.2f} TFLOP/s on {self.threads} thread(s)"


@functools.lru_cache(maxsize=4)  # built or found once a process: finding it hashes the sources, asks gcc its version
def _function(cache_root: Path | None) -> Callable[[int, int, int], float] | None:
    return probe_function(PROBE, "ucm_peak_gflops", [ctypes.c_int32, ctypes.c_int64, ctypes.c_int32],
                          ctypes.c_double, "the CPU's peak multiply-accumulate rate", cache_root)  # fmt: skip


@functools.lru_cache(maxsize=4)
def _read_sum(cache_root: Path | None) -> Callable[[int, int, int, int], float] | None:
    return probe_function(PROBE, "ucm_read_sum", [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32],
                          ctypes.c_double, "the host's read bandwidth", cache_root)  # fmt: skip


@functools.lru_cache(maxsize=4)
def _last_sum(cache_root: Path | None) -> Callable[[], float] | None:
    """The last loop's accumulator sum (peak_probe.c): not zero where the loop multiplied its values."""
    return probe_function(PROBE, "ucm_peak_last_sum", [], ctypes.c_double, "the probe's accumulators", cache_root)


def peak(dtype: str, threads: int, seconds: float = PROBE_S, cache_root: Path | None = None) -> Peak | None:
    """The rate of `dtype`'s widest instruction on `threads` threads now (module doc); None where the CPU has none
    or the probe cannot be built (no C compiler)."""
    if threads < 1 or seconds <= 0:
        raise ValueError(f"threads and seconds must be positive, got {threads}, {seconds}")
    kind = widest(dtype)
    fn = _function(cache_root) if kind is not None else None
    if kind is None or fn is None:
        return None
    rounds = 1000
    while True:  # rounds grow until a call lasts a fifth of `seconds`; then one call of the whole length counts
        t0 = time.perf_counter()
        gflops = fn(int(kind), rounds, threads)
        took = time.perf_counter() - t0
        if gflops < 0:
            log.warning("this build of the peak probe has no %s loop", kind.name)
            return None
        if took >= seconds / 5:
            break
        rounds *= 4
    gflops = fn(int(kind), max(1, int(rounds * seconds / took)), threads)
    assert gflops > 0, f"{kind.name}: {gflops} GFLOP/s"
    return Peak(kind, threads, gflops / 1e3)


READ_MAX_STREAMS = 16  # peak_probe.c's


def read_sum(address: int, floats: int, streams: int, threads: int, cache_root: Path | None = None) -> float | None:
    """The sum of `floats` fp32 values at `address`, read by `threads` threads, each its share as `streams` sequential
    streams side by side (peak_probe.c: ucm_read_sum); None where the probe cannot be built. Timed, it is a read
    bandwidth: two threads reading four streams each outran torch's sum by ~25% on the 2-core Xeon with AMX."""
    if address == 0 or floats < 0 or not 1 <= streams <= READ_MAX_STREAMS or threads < 1:
        raise ValueError(
            f"a buffer, floats >= 0, streams in 1..{READ_MAX_STREAMS} and threads >= 1, got address {address:#x}, "
            f"floats {floats}, streams {streams}, threads {threads}"
        )
    fn = _read_sum(cache_root)
    if fn is None:
        return None
    total = fn(address, floats, streams, threads)
    assert total != -1.0 or floats == 0, "arguments checked above"
    return total
