"""Which processes `ucm-serve up` starts on this host, and why: chosen from the host, not assumed.

    disagg      P prefill + D decode nodes + store daemon; the cores are split between the nodes
    colocated   one engine that prefills and decodes (continuous batching, chunked prefill) + store daemon,
                with every core

Measured on a 2-core AVX2 host (AMD EPYC Zen 3, fp32) with `benchmarks/vs_vllm.py` and vLLM's own client
(docs/history/benchmarks.json, "The skinny GEMM's rows in blocks", its earlier run): with one core per node a cold
2048-token prompt takes 9.8 s disaggregated vs 5.3 s on one engine with both cores, and a burst of 32 prompts over 4
shared 1024-token prefixes waits 31.2 s vs 18.6 s mean TTFT; random 512/64 at concurrency 8 is a tie (23.9 vs 22.5
out tok/s). The decode core idles through every
prefill and the prefill core through every decode phase, and the one engine still loads any prefix the store
holds (across requests, restarts and other nodes). Disaggregation pays once each role has cores of its own to
spare: from `DISAGG_MIN_CORES` cores (not measured here: no such host), or with a GPU.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass

DISAGG_MIN_CORES = 8


class Topology(enum.Enum):
    AUTO = "auto"
    DISAGG = "disagg"
    COLOCATED = "colocated"


@dataclass(frozen=True)
class TopologyChoice:
    topology: Topology  # never AUTO
    prefill: int
    decode: int
    colocated: int
    reason: str


def choose_topology(
    wanted: Topology, prefill: int | None, decode: int | None, cores: int | None = None, cuda: bool = False
) -> TopologyChoice:
    """The processes to start. Explicit node counts win over `auto`; `auto` picks by the host's cores."""
    cores = cores or os.cpu_count() or 1
    if wanted is Topology.AUTO and (prefill is not None or decode is not None):
        wanted = Topology.DISAGG
    if wanted is Topology.AUTO:
        if cuda or cores >= DISAGG_MIN_CORES:
            wanted, why = Topology.DISAGG, f"{cores} cores{' and a GPU' if cuda else ''}: each role gets its own"
        else:
            wanted, why = (
                Topology.COLOCATED,
                (
                    f"{cores} cores < {DISAGG_MIN_CORES}: split between a prefill and a decode node, each idles while "
                    f"the other works; one engine with all {cores} serves more"
                ),
            )
    else:
        why = f"--topology {wanted.value}" if prefill is None and decode is None else "node counts given"
    if wanted is Topology.COLOCATED:
        return TopologyChoice(Topology.COLOCATED, 0, 0, 1, why)
    p, d = (1 if prefill is None else prefill), (1 if decode is None else decode)
    if p < 0 or d < 0:
        raise ValueError(f"node counts must be >= 0, got --prefill {p} --decode {d}")
    if d == 0:
        raise ValueError("a disaggregated cluster needs at least one decode node (--decode >= 1)")
    return TopologyChoice(Topology.DISAGG, p, d, 0, why)
