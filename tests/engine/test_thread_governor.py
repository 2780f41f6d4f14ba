"""The thread governor (engine/thread_governor.py): threads follow the cores other processes leave free.

The decisions are checked on a scripted clock and CPU counters (the arithmetic and the hysteresis), and once on the
real /proc/stat with a real busy process beside this one (tests/engine/test_busy_neighbour.py runs whole requests).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from engine import SamplingParams
from engine.thread_governor import BURST_WINDOW_S, WINDOW_S, ThreadGovernor, engine_cpus
from tests.engine_helpers import make_llm
from ucm_kernels.cpu.host import busy_cpu_s


class Host:
    """A scripted host: wall time, busy seconds over the engine's cores, the engine's own CPU seconds."""

    def __init__(self) -> None:
        self.wall = self.busy = self.own = 0.0
        self.tick = 0.0  # wall seconds each clock read adds (a layer's time, for steps the test runs)

    def clock(self) -> float:
        self.wall += self.tick
        return self.wall

    def run(self, seconds: float, own_cores: float, other_cores: float) -> None:
        self.wall += seconds
        self.own += own_cores * seconds
        self.busy += (own_cores + other_cores) * seconds

    def governor(self, cores: int = 2) -> ThreadGovernor:
        return ThreadGovernor(cores, frozenset(range(cores)), lambda _: self.busy, self.clock, lambda: self.own)


def test_a_busy_neighbour_takes_a_thread_and_gives_it_back() -> None:
    host = Host()
    gov = host.governor()
    host.run(0.5, own_cores=1.9, other_cores=0.05)
    assert gov.threads() == 2
    host.run(0.5, own_cores=1.2, other_cores=0.75)  # a busy loop: it gets its share of a core
    assert gov.threads() == 1 and gov.others_cores == pytest.approx(0.75)
    host.run(0.5, own_cores=1.0, other_cores=1.0)
    assert gov.threads() == 1
    host.run(0.5, own_cores=1.0, other_cores=0.02)  # it ended
    assert gov.threads() == 2 and gov.changes == 2


def test_reset_gives_every_thread_back_and_judges_from_then_on() -> None:
    host = Host()
    gov = host.governor()
    host.run(0.5, own_cores=1.0, other_cores=1.0)
    assert gov.threads() == 1
    host.run(0.5, own_cores=1.0, other_cores=1.0)  # a window the reset discards
    gov.reset()
    assert gov.current == 2 and gov.threads() == 2, "every thread back, and no window has passed since the reset"
    host.run(0.5, own_cores=1.0, other_cores=1.0)  # the neighbour is still there: the next decision sees it
    assert gov.threads() == 1


def test_short_bursts_of_the_router_and_store_do_not_flap_the_count() -> None:
    host = Host()
    gov = host.governor()
    for others in (0.3, 0.1, 0.35, 0.2):
        host.run(0.5, own_cores=1.7, other_cores=others)
        assert gov.threads() == 2
    host.run(0.5, own_cores=1.0, other_cores=0.9)
    assert gov.threads() == 1
    host.run(0.5, own_cores=1.0, other_cores=0.35)  # 1.65 free cores: not enough to go back yet
    assert gov.threads() == 1
    host.run(0.5, own_cores=1.0, other_cores=0.2)
    assert gov.threads() == 2


def test_decisions_wait_for_a_whole_window() -> None:
    host = Host()
    gov = host.governor()
    host.run(WINDOW_S / 2, own_cores=1.0, other_cores=1.0)
    assert gov.threads() == 2, "half a window decides nothing"
    host.run(WINDOW_S, own_cores=1.0, other_cores=1.0)
    assert gov.threads() == 1


def test_a_burst_takes_a_core_back_once_its_sender_stopped() -> None:
    """The sender of a burst (a benchmark client on the same cores) works until it sends. A window reaching back before
    the burst still holds that work: one thread for another whole window. A burst's first window starts with it."""
    for with_burst in (False, True):
        host = Host()
        gov = host.governor()
        host.run(0.5, own_cores=0.0, other_cores=1.0)
        assert gov.threads() == 1
        host.run(0.2, own_cores=0.0, other_cores=1.0)  # the client still prepares: no decision yet (a part window)
        assert gov.threads() == 1
        if with_burst:
            gov.burst()  # it sent the requests
        host.run(BURST_WINDOW_S + 0.01, own_cores=1.0, other_cores=0.0)
        want = 2 if with_burst else 1
        assert gov.threads() == want, f"burst {with_burst}: {BURST_WINDOW_S} s after the requests came"
        if not with_burst:
            host.run(WINDOW_S, own_cores=2.0, other_cores=0.0)
            assert gov.threads() == 2, "without the burst, a whole window later"


def test_a_burst_window_gives_threads_back_but_never_takes_them() -> None:
    """Work that comes with a burst (the router's on its requests) may take part of a core at its start: no drop on so
    short a window; a neighbour that stays is seen a whole window later, and the window is WINDOW_S again after it."""
    host = Host()
    gov = host.governor()
    gov.burst()
    host.run(BURST_WINDOW_S + 0.01, own_cores=1.0, other_cores=0.9)
    assert gov.threads() == 2 and gov.changes == 0
    host.run(WINDOW_S / 2, own_cores=1.0, other_cores=0.9)
    assert gov.threads() == 2, "after the burst's window the decisions wait for a whole one again"
    host.run(WINDOW_S / 2 + 0.01, own_cores=1.0, other_cores=0.9)
    assert gov.threads() == 1
    gov.burst()
    gov.restart()  # a restart judges from then on as usual
    host.run(BURST_WINDOW_S + 0.01, own_cores=1.0, other_cores=0.0)
    assert gov.threads() == 1


def test_wider_hosts_keep_the_cores_left() -> None:
    host = Host()
    gov = host.governor(cores=8)
    host.run(0.5, own_cores=5.0, other_cores=3.0)
    assert gov.threads() == 5
    host.run(0.5, own_cores=5.0, other_cores=0.1)
    assert gov.threads() == 8


def test_without_proc_stat_the_count_stays() -> None:
    gov = ThreadGovernor(2, frozenset({0, 1}), lambda _: None)
    assert gov.threads() == 2 and gov.changes == 0


def test_proc_stat_is_read_for_the_engines_cores_or_the_machine(tmp_path) -> None:
    stat = tmp_path / "stat"
    tick = os.sysconf("SC_CLK_TCK")
    stat.write_text(
        f"cpu  9 9 9 9 9 9 9 9 0 0\ncpu0 {tick} 0 {tick} 500 7 0 0 0 0 0\ncpu1 {2 * tick} 0 0 0 0 0 0 {tick} 0 0\n"
        "intr 1 2 3\n"
    )
    # cpu0: user + system = 2 s (idle and iowait are not busy); cpu1: user + steal = 3 s
    assert busy_cpu_s(frozenset({0}), str(stat)) == pytest.approx(2.0)
    assert busy_cpu_s(frozenset({0, 1}), str(stat)) == pytest.approx(5.0)
    assert busy_cpu_s(frozenset({7}), str(stat)) is None
    assert busy_cpu_s(None, str(stat)) == pytest.approx(54 / tick), "no CPUs named: the machine's line"


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="reads /proc/stat")
def test_a_real_busy_process_is_seen() -> None:
    cpus = engine_cpus()
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        host_busy = busy_cpu_s(cpus)
        assert host_busy is not None
        gov = ThreadGovernor(len(cpus), cpus)
        deadline = time.monotonic() + 30
        while gov.others_cores < 0.5:  # the spinning child takes most of a core once it runs
            assert time.monotonic() < deadline, f"the busy child was never seen: {gov.others_cores:.2f} cores"
            time.sleep(WINDOW_S)
            gov.threads()
    finally:
        spin.kill()
        spin.wait()


@pytest.fixture
def engine(smollm2_fp32):
    """A real engine for a test to script its governor (`_scripted`); torch's thread count restored after."""
    llm = make_llm(smollm2_fp32)
    threads_before = torch.get_num_threads()
    try:
        yield llm.engine
    finally:
        llm.close()
        torch.set_num_threads(threads_before)


def _scripted(engine) -> Host:
    """The engine's governor on a scripted host, from 2 threads."""
    host = Host()
    engine.governor = host.governor()
    torch.set_num_threads(2)
    return host


def test_an_idle_engine_judges_the_window_before_its_next_burst(engine) -> None:
    """A serving loop calls EngineCore.idle() while nothing is queued: a neighbour busy during the idle stretch that
    stopped before the burst leaves the burst's first step every thread. Without the idle decisions, the first
    step judges the whole stretch and runs on one."""
    params = SamplingParams(max_tokens=2, temperature=0)
    for with_idle in (False, True):
        host = _scripted(engine)
        for _ in range(20):  # 10 s: the neighbour (a benchmark client preparing its prompts) takes a core
            host.run(0.5, own_cores=0.0, other_cores=1.0)
            if with_idle:
                engine.idle()
        for _ in range(2):  # it stopped: 1 s before the burst arrives
            host.run(0.5, own_cores=0.0, other_cores=0.0)
            if with_idle:
                engine.idle()
        engine.add_request(f"burst-{with_idle}", list(range(100, 140)), params)
        engine.step()
        want = 2 if with_idle else 1
        assert engine.stats_counters.threads == want, f"idle decisions {with_idle}: the first step's threads"
        assert torch.get_num_threads() == want, "the count the kernels read follows the decision"
        while engine.has_unfinished_requests():
            engine.step()
    assert engine.governor.changes == 2, "while idle: dropped for the neighbour, back once it stopped"


def test_the_first_step_after_idling_starts_a_burst(engine) -> None:
    """EngineCore.step() tells the governor a burst began when idle() ran since its last step, and not otherwise."""
    bursts: list[int] = []
    _scripted(engine)
    engine.governor.burst = lambda: bursts.append(1)  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=3, temperature=0)
    engine.idle()
    engine.add_request("after-idle", list(range(100, 140)), params)
    engine.step()
    assert bursts == [1], "the burst's first step"
    engine.idle()  # a serving loop calls it between steps too; with work queued it is no idle stretch
    while engine.has_unfinished_requests():
        engine.step()
    assert bursts == [1], "later steps of the same burst"
    engine.add_request("no-idle", list(range(100, 140)), params)
    engine.step()
    assert bursts == [1], "no idle() since the last step: no burst (an offline generate)"
    while engine.has_unfinished_requests():
        engine.step()


def test_a_long_prompt_step_takes_a_freed_core_back_between_its_layers(engine) -> None:
    """A step's thread count is re-decided before each decoder layer once the window has passed: a prompt step that
    began on one thread beside a neighbour that then stopped runs its later layers on both cores. Without the
    between-layers decisions the whole step keeps one thread."""
    params = SamplingParams(max_tokens=1, temperature=0)
    for between in (False, True):
        host = _scripted(engine)
        host.run(0.5, own_cores=0.0, other_cores=1.0)  # the neighbour took a core, then stopped
        engine.idle()
        assert engine.governor.current == 1 and torch.get_num_threads() == 1
        host.tick = 0.1
        engine.runner.between_layers = engine._between_layers if between else None
        engine.add_request(f"long-{between}", list(range(100, 400)), params)
        while engine.has_unfinished_requests():
            engine.step()
        want = 2 if between else 1
        assert engine.governor.current == want and torch.get_num_threads() == want, f"between layers: {between}"
        assert engine.stats_counters.threads == want
