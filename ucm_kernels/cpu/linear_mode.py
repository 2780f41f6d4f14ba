"""What the CPU linear layers may do, shared by the packed kernels (skinny_gemm.py) and oneDNN's path
(onednn_linear.py): `UCM_CPU_LINEAR` (auto / native / torch) and the size rules both measure by."""

from __future__ import annotations

import enum
import os

STACK_BYTES = 64 << 20  # weights per measured row count: past the last-level cache of the CPUs we run on
# A weight under this stays in the caches between steps, where the BLAS's repacking costs little: not measured, not
# packed (the tests' tiny random models would otherwise spend seconds per shape measuring noise).
MIN_PACK_BYTES = 1 << 20
ENV = "UCM_CPU_LINEAR"


class CpuLinear(str, enum.Enum):  # noqa: UP042 (the environment variable's values)
    AUTO = "auto"
    NATIVE = "native"
    TORCH = "torch"


def cpu_linear_mode() -> CpuLinear:
    text = os.environ.get(ENV, CpuLinear.AUTO.value).strip().lower()
    try:
        return CpuLinear(text)
    except ValueError:
        raise ValueError(f"{ENV}={text!r}: expected one of {[m.value for m in CpuLinear]}") from None
