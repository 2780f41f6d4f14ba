"""How a serving node's idle OpenMP threads wait: set in its environment before torch loads libgomp, which reads it
once, at load.

After each parallel region libgomp's threads spin GOMP_SPINCOUNT rounds of `pause` (300,000 by default) before they
sleep. A node's step runs hundreds of regions, where spinning keeps the threads warm; but between steps (scheduling,
sampling, the sockets: milliseconds of one thread's Python) spinning threads hold cores that on a small host the
router, the store daemon and the client need. So the node spins for about NODE_SPIN_S, not libgomp's default.

It is a time, set as a count of rounds measured on this CPU (ucm_kernels/cpu/pause_probe.py), because a round's length
differs several-fold: ~140 cycles on Intel cores since Skylake, 28 ns on the 2-core AMD EPYC (Zen 5) of 2026-12-01.
A fixed 10,000 rounds, chosen on the 2-core Xeon with AMX (about half a millisecond there; prefix_repetition's mean
TTFT 2-7% lower than with libgomp's ~17 ms in each of six interleaved rounds), was 0.28 ms on that EPYC, where
`ucm-serve up` under `vllm bench serve` then gave prefix_repetition 2.81-3.08 s at 10,000 rounds and 3.15-3.24 s at
30,000 (0.85 ms) against 2.39-2.40 s at 100,000 (2.8 ms); in process its prefill steps ran ~20% slower at 10,000
than at libgomp's default. NODE_SPIN_S sits at that good point there and well under libgomp's default everywhere.

Only where the user chose nothing: an explicit GOMP_SPINCOUNT or OMP_WAIT_POLICY stays as it is. Torch-free: the
entry point calls it before it imports a node (launch/cli.py); Ray node actors get it in their runtime environment.
"""

from __future__ import annotations

from collections.abc import MutableMapping

from ucm_kernels.cpu.pause_probe import pause_seconds

NODE_SPIN_S = 3e-3  # how long an idle thread spins before it sleeps (module doc)
ASSUMED_ROUND_S = 65e-9  # where the probe cannot run (no C compiler): ~140 cycles at 2.1 GHz
MIN_SPINCOUNT, MAX_SPINCOUNT = 1_000, 300_000  # ... and never longer than libgomp's default
USER_SETTINGS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def node_spincount(round_s: float | None) -> int:
    """GOMP_SPINCOUNT for a spin of NODE_SPIN_S where one round takes `round_s` seconds (None: not measured)."""
    rounds = NODE_SPIN_S / (round_s if round_s else ASSUMED_ROUND_S)
    return int(min(MAX_SPINCOUNT, max(MIN_SPINCOUNT, round(rounds))))


def node_openmp_env(environ: MutableMapping[str, str]) -> dict[str, str]:
    """Set GOMP_SPINCOUNT in `environ` unless the user set a wait policy; returns what it set ({} if nothing)."""
    if any(name in environ for name in USER_SETTINGS):
        return {}
    count = str(node_spincount(pause_seconds()))
    environ["GOMP_SPINCOUNT"] = count
    return {"GOMP_SPINCOUNT": count}


def openmp_wait(environ: MutableMapping[str, str]) -> str:
    """The wait policy this process's libgomp read, for the node's start-up line."""
    chosen = [f"{name}={environ[name]}" for name in USER_SETTINGS if name in environ]
    return ", ".join(chosen) or "libgomp's default"
