"""How long one of libgomp's spin-wait rounds takes on this CPU (`pause_seconds`), for node/openmp_env.py.

libgomp's idle threads spin GOMP_SPINCOUNT rounds of `pause` before they sleep, and a `pause` is not one length: 28 ns
on the 2-core AMD EPYC (Zen 5) of 2026-12-01, ~140 cycles on Intel cores since Skylake (~65 ns at 2.1 GHz). A count
chosen on one CPU is another wait on the next, so the node sets its count from this measurement. A tiny C library
without OpenMP (pause_probe.c), built like the kernels (ucm_kernels/cpu/native.py) and loaded before torch; torch-free.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from ucm_kernels.cpu.native import Recipe, probe_function

PROBE = Recipe("ucm_pause_probe", (Path(__file__).with_name("pause_probe.c"),), (), ("-O2", "-shared", "-fPIC"))
ROUNDS = 20_000  # ~0.6-1.4 ms a try on the CPUs above
TRIES = 3


def pause_seconds(cache_root: Path | None = None) -> float | None:
    """Seconds per spin-wait round here, or None where the probe cannot be built (no C compiler) or loaded."""
    fn = probe_function(PROBE, "ucm_pause_ns", [ctypes.c_int64, ctypes.c_int32], ctypes.c_double,
                        "the CPU's spin-wait round", cache_root)  # fmt: skip
    if fn is None:
        return None
    ns = float(fn(ROUNDS, TRIES))
    assert ns > 0.0, f"a spin-wait round measured {ns} ns"
    return ns * 1e-9
