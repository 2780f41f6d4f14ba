"""A busy process beside the engine (issue 54): requests complete and their outputs do not change when the thread
governor hands a core to the neighbour, and again when it takes the core back. No timing is asserted: the speed
beside a neighbour is benchmarks/contention.py's."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from engine import SamplingParams
from engine.thread_governor import engine_cpus
from tests.engine_helpers import PROMPTS, make_llm
from ucm_kernels.cpu.host import busy_cpu_s

pytestmark = pytest.mark.skipif(
    len(engine_cpus()) < 2 or busy_cpu_s(engine_cpus()) is None, reason="needs 2 cores and /proc/stat"
)


class Outputs:
    """Greedy tokens, compared exactly, and their logprobs, within fp32's rounding over the model's reductions: the
    design promises bits across prompt splits and caching, not across thread counts (oneDNN and MKL may split a
    matmul differently with another team; on the Xeon with AMX of 2026-12-03 they were equal bit for bit)."""

    LOGPROB_TOL = 1e-3  # fp32: ~1e-7 relative per operation, through 30 layers of 576-long reductions and a softmax

    def __init__(self, llm) -> None:
        params = SamplingParams(max_tokens=8, temperature=0, logprobs=0)
        outs = [o.outputs[0] for o in llm.generate(PROMPTS[:4], params)]
        self.tokens = [o.token_ids for o in outs]
        self.logprobs = [[lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)] for o in outs]

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Outputs)
            and self.tokens == other.tokens
            and all(a == pytest.approx(b, abs=self.LOGPROB_TOL) for a, b in zip(self.logprobs, other.logprobs))
        )


def _outputs(llm) -> Outputs:
    return Outputs(llm)


def test_outputs_hold_while_a_neighbour_takes_a_core_and_gives_it_back(smollm2_fp32) -> None:
    widest = torch.get_num_threads()
    torch.set_num_threads(2)
    llm = make_llm(smollm2_fp32, enable_prefix_caching=False)
    try:
        governor = llm.engine.governor
        assert governor is not None and governor.max_threads == 2
        idle = _outputs(llm)
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(len(engine_cpus()) - 1)]
        try:
            deadline = time.monotonic() + 120
            while governor.current == 2:  # until the governor has seen the neighbour (each round a real batch)
                assert time.monotonic() < deadline, f"never saw the neighbour: {governor.others_cores:.2f} cores"
                assert _outputs(llm) == idle
            assert _outputs(llm) == idle, "one thread beside the neighbour gives the same tokens and logprobs"
        finally:
            for p in busy:
                p.kill()
                p.wait()
        deadline = time.monotonic() + 120
        while governor.current == 1:
            assert time.monotonic() < deadline, f"never took the core back: {governor.others_cores:.2f} cores"
            assert _outputs(llm) == idle
        assert llm.engine.stats().thread_changes >= 2
    finally:
        llm.close()
        torch.set_num_threads(widest)
