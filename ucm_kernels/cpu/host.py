"""What the host is, as the calibrations and benchmark headers name it: the CPU's model and flags, and the ISA torch's
own kernels, oneDNN and MKL are allowed to use on it."""

from __future__ import annotations

import os
import platform
from functools import lru_cache

import torch


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


@lru_cache(maxsize=1)
def last_level_cache_bytes() -> int | None:
    """The size of the CPU's last-level cache (the highest level sysfs lists for cpu0), or None where sysfs has none."""
    root = "/sys/devices/system/cpu/cpu0/cache"
    best: tuple[int, int] | None = None
    try:
        for entry in os.listdir(root):
            if not entry.startswith("index"):
                continue
            with open(f"{root}/{entry}/level", encoding="ascii") as f:
                level = int(f.read())
            with open(f"{root}/{entry}/size", encoding="ascii") as f:
                size = _cache_size(f.read().strip())
            if size and (best is None or level > best[0]):
                best = (level, size)
    except (OSError, ValueError):
        return None
    return best[1] if best else None


def _cache_size(text: str) -> int:
    """sysfs's cache size ("491520K", "32M", "1024") in bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text)
