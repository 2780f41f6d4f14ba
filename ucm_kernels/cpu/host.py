"""What the host is, as the calibrations and benchmark headers name it: the CPU's model and flags, and the ISA torch's
own kernels, oneDNN and MKL are allowed to use on it."""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass
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


_NO_AVX512 = ("avx512f", "avx512_bf16", "amx_bf16")
_NO_AVX2 = ("avx2", "fma", *_NO_AVX512)

# What torch's CPU capability (`ATEN_CPU_CAPABILITY` caps it) leaves a process of vector_flags; its AVX512 level is
# its widest (it caps nothing), and other architectures' levels name no x86 flag.
_TORCH_CAPPED_OFF = {"AVX2": _NO_AVX512, "DEFAULT": _NO_AVX2}


def library_capped_off(isa: str) -> tuple[str, ...]:
    """The vector_flags a matmul library's cap leaves unused: oneDNN's (`ONEDNN_MAX_CPU_ISA`: SSE41, AVX, AVX2[_VNNI],
    AVX512_CORE[_VNNI], AVX512_CORE_BF16, AVX10_1_512, AVX512_CORE_AMX, ALL) or MKL's (`MKL_ENABLE_INSTRUCTIONS`:
    SSE4_2, AVX, AVX2, AVX512[_E1 ..]); "" caps nothing."""
    cap = isa.upper()
    if cap in ("", "ALL") or "AMX" in cap:
        return ()
    if cap.startswith(("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10")):
        return ("amx_bf16",)
    if cap.startswith("AVX512"):
        return ("avx512_bf16", "amx_bf16")
    if cap.startswith("AVX2"):
        return _NO_AVX512
    return _NO_AVX2


def usable_vector_flags(dtype: str | None = None) -> list[str]:
    """vector_flags() less those this process is capped off: by torch's CPU capability, and for a `dtype` matmul by
    the library that runs it (bfloat16: oneDNN; float32: MKL). What its matmuls can run on: benchmarks.vs_vllm caps
    all three to run an AVX2-only host's servers; one capped alone caps its own dtype only."""
    off = set(_TORCH_CAPPED_OFF.get(torch.backends.cpu.get_cpu_capability(), ()))
    if dtype == "bfloat16":
        off.update(library_capped_off(_onednn_cap()))
    elif dtype == "float32":
        off.update(library_capped_off(_mkl_cap()))
    return [f for f in vector_flags() if f not in off]


def _onednn_cap() -> str:
    return os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or ""


def _mkl_cap() -> str:
    return os.environ.get("MKL_ENABLE_INSTRUCTIONS", "")


def torch_isa() -> str:
    """The ISA torch's own kernels, its oneDNN and its MKL use here: the CPU's unless capped (`ATEN_CPU_CAPABILITY`,
    `ONEDNN_MAX_CPU_ISA`, `MKL_ENABLE_INSTRUCTIONS`), so a capped process never reads timings taken uncapped."""
    onednn, mkl = _onednn_cap(), _mkl_cap()
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


_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal (guest time is already inside user and nice)
MIN_JUDGED_S = 0.1  # shorter intervals, a few of the kernel's 10 ms ticks, are not judged (a test's forced result)


def busy_cpu_s(cpus: frozenset[int] | None = None, stat_path: str = "/proc/stat") -> float | None:
    """Seconds the machine's CPUs (only `cpus`, if given) have spent busy since boot, from Linux's /proc/stat (a
    hypervisor's steal counts as busy: other guests took it); None where it cannot be read."""
    total, seen = 0, 0
    try:
        with open(stat_path, encoding="ascii") as f:
            for line in f:
                if not line.startswith("cpu"):
                    break
                name, *fields = line.split()
                if (name == "cpu") == (cpus is None) and (cpus is None or int(name[3:]) in cpus):
                    total += sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields))
                    seen += 1
    except (OSError, ValueError):
        return None
    return total / _TICKS_PER_S if seen else None


@dataclass(frozen=True)
class CpuClock:
    """A moment's wall clock, this process's CPU time and the busy CPU time of the machine (or of some of its CPUs;
    None where it cannot be read): two of them tell how many cores other processes took in between."""

    wall_s: float
    own_cpu_s: float
    machine_busy_s: float | None

    @classmethod
    def now(cls, cpus: frozenset[int] | None = None) -> CpuClock:
        return cls(time.perf_counter(), time.process_time(), busy_cpu_s(cpus))

    def others_cores_since(self, start: CpuClock, min_judged_s: float = MIN_JUDGED_S) -> float | None:
        """How many cores other processes (and a hypervisor's steal) took on average since `start`, or None when
        the interval is too short for the kernel's tick to tell or unreadable."""
        wall = self.wall_s - start.wall_s
        if self.machine_busy_s is None or start.machine_busy_s is None or wall < min_judged_s:
            return None
        others = (self.machine_busy_s - start.machine_busy_s) - (self.own_cpu_s - start.own_cpu_s)
        return max(0.0, others) / wall
