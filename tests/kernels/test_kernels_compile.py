"""Compile every Triton kernel for sm_90 ahead of time (no GPU needed): the interpreter never lowers the kernels,
so this is what catches compiled-path type errors on a CPU-only CI. Runs in a subprocess because the kernel tests
run triton interpreted in this one."""

from __future__ import annotations

import os
import subprocess
import sys


def test_all_kernels_compile_for_sm90_bf16(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run(
        [sys.executable, "-m", "ucm_kernels.compile_check", "--arch", "90", "--dtype", "bf16"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.stdout.count("ok ") >= 10, proc.stdout
