"""Which implementation a kernel call runs: the Triton kernels on CUDA, the CPU path elsewhere.

On the CPU path, write_kv and the fused elementwise ops (norms, SiLU-and-mul, RoPE; bf16 only) run the native C
library (`ucm_kernels/cpu/`) unless `UCM_CPU_ATTENTION=torch` asks for the pure-torch reference; attention runs
whichever of the two measured faster on this machine (`auto`, ucm_kernels/cpu/calibration.py) unless
`UCM_CPU_ATTENTION=native|torch` forces one. Block gather/scatter/copy are torch.
"""

from __future__ import annotations

import enum
import os

import torch

ENV_VAR = "UCM_ATTENTION_BACKEND"
CPU_ENV_VAR = "UCM_CPU_ATTENTION"


class AttentionBackend(enum.Enum):
    TORCH = "torch"
    TRITON = "triton"


def forced_backend() -> AttentionBackend | None:
    """The backend forced by `UCM_ATTENTION_BACKEND`, or None when unset (read per call: tests flip it)."""
    raw = os.environ.get(ENV_VAR, "").strip().lower()
    if not raw:
        return None
    try:
        return AttentionBackend(raw)
    except ValueError:
        choices = ", ".join(b.value for b in AttentionBackend)
        raise ValueError(f"{ENV_VAR}={raw!r} is not one of: {choices}") from None


class CpuAttention(enum.Enum):
    """The native library's ops on the CPU path (attention reading the paged cache in place, write_kv, the fused
    elementwise ops), or torch for all of them, or AUTO: attention by calibration (the faster of the two per
    shape class, measured once per machine), the other ops native. The name predates the elementwise ops."""

    AUTO = "auto"
    NATIVE = "native"
    TORCH = "torch"


def cpu_attention() -> CpuAttention:
    """`UCM_CPU_ATTENTION` (default auto; read per call: tests flip it). Native and auto still fall back to torch
    where the C kernel cannot run: no compiler, an unsupported dtype or layout."""
    raw = os.environ.get(CPU_ENV_VAR, "").strip().lower()
    if not raw:
        return CpuAttention.AUTO
    try:
        return CpuAttention(raw)
    except ValueError:
        choices = ", ".join(c.value for c in CpuAttention)
        raise ValueError(f"{CPU_ENV_VAR}={raw!r} is not one of: {choices}") from None


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def select_backend(device: torch.device) -> AttentionBackend:
    """Pick the backend for tensors on `device`; cheap enough to call on every kernel call."""
    forced = forced_backend()
    if forced is AttentionBackend.TORCH:
        return AttentionBackend.TORCH
    if forced is AttentionBackend.TRITON:
        if device.type != "cuda" and not triton_interpreted():
            raise ValueError(
                f"{ENV_VAR}=triton needs CUDA tensors (got device {device}); "
                "on CPU set TRITON_INTERPRET=1 before the first triton import to run the kernels interpreted"
            )
        return AttentionBackend.TRITON
    return AttentionBackend.TRITON if device.type == "cuda" else AttentionBackend.TORCH
