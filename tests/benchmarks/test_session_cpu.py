"""benchmarks/session_cpu.py on real processes: a child started in its own session is found by that session, named by
its module, and its CPU seconds counted between two readings; processes of other sessions are not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.session_cpu import cpu_used, session_cpu, stat_fields
from tests.cluster_helpers import wait_until

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")

# Burns 0.3 s of CPU, says so, then blocks on stdin.
_BURN = "import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\nprint('burnt', flush=True)\nsys.stdin.read()"


def _state(pid: int) -> str:
    fields = stat_fields(Path(f"/proc/{pid}"))
    return fields[0] if fields else "gone"


def test_a_sessions_cpu_is_counted_per_process(tmp_path) -> None:
    (tmp_path / "burn_mod.py").write_text(_BURN)
    child = subprocess.Popen(
        [sys.executable, "-m", "burn_mod", "x"],
        cwd=tmp_path,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "burnt"
        wait_until("the child to block in stdin.read", lambda: _state(child.pid) == "S", poll_s=0.01)
        blocked = session_cpu(child.pid)
        name = f"{child.pid} burn_mod x"
        used = cpu_used({}, blocked)  # from its start, as vs_vllm counts a process born during a workload
        assert list(used) == [name] and used[name] >= 0.29, used
        assert cpu_used(blocked, session_cpu(child.pid)) == {}, "nothing more while it sleeps"
        assert not any(n.startswith(f"{child.pid} ") for n in session_cpu(os.getsid(0))), "not in our session"
    finally:
        child.kill()
        child.wait()
