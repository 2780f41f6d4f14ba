"""How a serving node's idle OpenMP threads wait: set in its environment before torch loads libgomp, which reads it
once, at load.

After each parallel region libgomp's threads spin for GOMP_SPINCOUNT rounds of `pause` (300,000 by default) before
they sleep. A node's step runs hundreds of short regions microseconds apart, where spinning keeps the threads warm;
but between steps (scheduling, sampling, the sockets: milliseconds of one thread's Python) the spinning threads hold
cores that on a small host the router, the store daemon and the client need. On Intel cores since Skylake a `pause`
takes ~140 cycles (Intel's figure), so on the 2-core Xeon with AMX the default spins for about 17 ms, longer than
the gap between steps. With NODE_SPINCOUNT (about half a millisecond there), `ucm-serve up` under `vllm bench serve`
gave prefix_repetition a 2-7% lower mean TTFT in each of six interleaved rounds against libgomp's default (two runs,
either server started first); random 512/64's throughput moved by +-4% with which server had started second, not
with the setting; a decode step in process, with nothing else running, kept its time (docs/benchmarks.md). 1000
rounds made those steps 35% slower.

Only where the user chose nothing: an explicit GOMP_SPINCOUNT or OMP_WAIT_POLICY stays as it is. Torch-free: the
entry point calls it before it imports a node (launch/cli.py); Ray node actors get it in their runtime environment.
"""

from __future__ import annotations

from collections.abc import MutableMapping

NODE_SPINCOUNT = "10000"
USER_SETTINGS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def node_openmp_env(environ: MutableMapping[str, str]) -> dict[str, str]:
    """Set GOMP_SPINCOUNT in `environ` unless the user set a wait policy; returns what it set ({} if nothing)."""
    if any(name in environ for name in USER_SETTINGS):
        return {}
    environ["GOMP_SPINCOUNT"] = NODE_SPINCOUNT
    return {"GOMP_SPINCOUNT": NODE_SPINCOUNT}


def openmp_wait(environ: MutableMapping[str, str]) -> str:
    """The wait policy this process's libgomp read, for the node's start-up line."""
    chosen = [f"{name}={environ[name]}" for name in USER_SETTINGS if name in environ]
    return ", ".join(chosen) or "libgomp's default"
