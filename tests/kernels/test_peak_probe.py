"""The host's multiply-accumulate probe (ucm_kernels/cpu/peak_probe.py, peak_probe.c): every loop this CPU has runs
and reports a rate, the loops it lacks say so, and the instruction chosen for a dtype follows the CPU's flags. And its
streaming read: every element counted once, however the buffer is cut into threads and streams."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ucm_kernels.cpu import native, peak_probe
from ucm_kernels.cpu.host import library_capped_off, vector_flags
from ucm_kernels.cpu.peak_probe import Kind, peak, widest

# The CPU flags each loop needs (besides what the build's -march=native gives it).
NEEDS = {
    Kind.AMX_BF16: {"amx_bf16"},
    Kind.AVX512_BF16: {"avx512_bf16"},
    Kind.AVX512_FP32: {"avx512f"},
    Kind.AVX2_FP32: {"avx2", "fma"},
    Kind.NEON_FP32: {"asimd"},
}


def test_the_widest_instruction_follows_the_flags() -> None:
    amx = ["avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"]
    assert widest("bfloat16", amx) is Kind.AMX_BF16 and widest("float32", amx) is Kind.AVX512_FP32
    assert widest("bfloat16", ["avx2", "fma", "avx512f", "avx512_bf16"]) is Kind.AVX512_BF16
    assert widest("bfloat16", ["avx2", "fma"]) is None and widest("float32", ["avx2", "fma"]) is Kind.AVX2_FP32
    assert widest("float32", ["asimd"]) is Kind.NEON_FP32
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        widest("float16")


def widest_in_a_process_with(caps: dict[str, str]) -> list[str]:
    """[widest('float32'), widest('bfloat16')] as a process started with these environment caps names them."""
    code = "from ucm_kernels.cpu.peak_probe import widest; print(widest('float32'), widest('bfloat16'))"
    env = {k: v for k, v in os.environ.items() if k not in UNCAPPED} | caps
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.split()


UNCAPPED = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
# The fp32 loop of a process capped to AVX2 (NEON where the caps name no flag this CPU has).
AVX2_FP32 = str(widest("float32", [f for f in vector_flags() if f not in library_capped_off("AVX2")]))


def test_a_process_capped_to_avx2_times_the_avx2_loop() -> None:
    """benchmarks.vs_vllm's AVX2_CAPS (an AVX2-only host's servers on this one): the probe names what the capped
    matmuls run on, not the AVX-512 loop the CPU also has."""
    assert widest_in_a_process_with({"ATEN_CPU_CAPABILITY": "avx2"}) == [AVX2_FP32, "None"]


def test_a_matmul_library_capped_alone_caps_its_own_dtype() -> None:
    """bf16 matmuls run in oneDNN, fp32 ones in MKL: a cap on one names the capped loop for its dtype and leaves the
    other dtype's widest loop as the CPU has it (each fails on an AVX-512 host if the cap is not read)."""
    fp32, bf16 = str(widest("float32", vector_flags())), str(widest("bfloat16", vector_flags()))
    assert widest_in_a_process_with({"ONEDNN_MAX_CPU_ISA": "AVX2"}) == [fp32, "None"]
    assert widest_in_a_process_with({"MKL_ENABLE_INSTRUCTIONS": "AVX2"}) == [AVX2_FP32, bf16]


def test_a_library_cap_names_the_flags_it_leaves_unused() -> None:
    assert library_capped_off("") == () and library_capped_off("ALL") == ()
    assert library_capped_off("AVX512_CORE_AMX") == () and library_capped_off("avx10_1_512_amx") == ()
    assert library_capped_off("AVX512_CORE_BF16") == ("amx_bf16",) == library_capped_off("AVX10_1_512")
    assert library_capped_off("AVX512_CORE_VNNI") == ("avx512_bf16", "amx_bf16") == library_capped_off("AVX512_E1")
    assert library_capped_off("AVX2_VNNI") == ("avx512f", "avx512_bf16", "amx_bf16") == library_capped_off("avx2")
    assert set(library_capped_off("SSE41")) == set(library_capped_off("AVX")) >= {"avx2", "fma", "avx512f"}


needs_compiler = pytest.mark.skipif(shutil.which(native.compiler()) is None, reason="no C compiler")


@needs_compiler
@pytest.mark.parametrize("kind", list(Kind), ids=lambda k: k.name)
def test_each_loop_runs_where_the_cpu_has_it_and_says_so_where_not(kind: Kind, tmp_path) -> None:
    fn = peak_probe._function(tmp_path)
    assert fn is not None, "the probe builds wherever the compiler is"
    have = NEEDS[kind] <= set(vector_flags())
    if have and kind is Kind.AMX_BF16 and fn(int(kind), 10, 1) == -1.0:
        lib = native.load()
        assert lib is None or not lib.has_amx, "the kernels use AMX here, the probe could not"
        pytest.skip("the OS does not let this process use AMX")
    last_sum = peak_probe._last_sum(tmp_path)
    assert last_sum is not None, "the same library"
    for threads in (1, 2):
        gflops = fn(int(kind), 2000, threads)
        if have:
            assert math.isfinite(gflops) and gflops > 0, f"{kind.name} on {threads} thread(s): {gflops}"
            # Zero operands would leave the sums at zero (and run faster than a matmul's values: peak_probe.c).
            assert math.isfinite(last_sum()) and last_sum() != 0.0, f"{kind.name} multiplied zeros"
        else:
            assert gflops == -1.0, f"{kind.name} is not on this CPU ({vector_flags()}), yet the loop ran: {gflops}"
    assert fn(int(kind), 0, 1) == -1.0 and fn(int(kind), 10, 0) == -1.0, "no rounds or no threads: no rate"


@needs_compiler
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_peak_names_the_loop_it_timed(dtype: str, tmp_path) -> None:
    found = peak(dtype, 2, seconds=0.005, cache_root=tmp_path)
    kind = widest(dtype)
    if kind is None:
        assert found is None
        return
    assert found is not None, f"{kind.name} is on this CPU, yet no rate"
    assert found.kind is kind and found.threads == 2 and found.tflops > 0
    assert kind.name in found.line()
    with pytest.raises(ValueError, match="positive"):
        peak(dtype, 0)


@needs_compiler
def test_the_read_probe_reads_every_element_once(tmp_path) -> None:
    # Small integers: every partial sum is exact in fp32, so the sum says which elements were read, and how often.
    for n in (0, 1, 31, 32, 1000, 4096 + 7, 100_003):
        buf = torch.arange(n, dtype=torch.float32) % 7
        want = float(buf.double().sum())
        for streams in (1, 2, 3, 4, 8, 16):
            for threads in (1, 2, 3):
                got = peak_probe.read_sum(buf.data_ptr() if n else 1, n, streams, threads, cache_root=tmp_path)
                assert got == want, f"{n} floats, {streams} streams, {threads} threads: {got} != {want}"
    one = torch.ones(8)
    for bad in ({"streams": 0}, {"streams": 17}, {"threads": 0}, {"floats": -1}):
        args = {"address": one.data_ptr(), "floats": 8, "streams": 4, "threads": 1} | bad
        with pytest.raises(ValueError, match=r"streams in 1\.\.16"):
            peak_probe.read_sum(**args, cache_root=tmp_path)
