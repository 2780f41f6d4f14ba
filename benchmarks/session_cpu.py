"""CPU seconds per process of a server the benchmarks started in its own session, read from /proc (Linux).

On a small host every process of a served system takes cores from the engine: issue 10's comparison on a 2-core
EPYC found ucm-serve's node, store daemon and router using 22.7, 1.9 and 0.6 CPU s over a random run the node
alone served in 20.7 without the store. `benchmarks.vs_vllm` records this per workload and server, so where the
served path spends its cores is in every comparison, not only in a hand-run profile.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Mapping
from pathlib import Path

PROC = Path("/proc")
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def stat_fields(pid_dir: Path) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state first), or None if the process is gone."""
    try:
        raw = (pid_dir / "stat").read_text()
    except OSError:  # exited meanwhile, or no permission
        return None
    # "pid (comm) state ppid pgrp session utime..." : comm may hold spaces and parentheses, so split after its ')'
    return raw[raw.rindex(")") + 2 :].split()


def process_name(pid_dir: Path) -> str:
    """A short name: the command line's module or program and first argument (`launch.cli store`,
    `VLLM::EngineCore`), else the kernel's comm."""
    try:
        argv = [a for a in (pid_dir / "cmdline").read_bytes().decode(errors="replace").split("\0") if a]
    except OSError:
        argv = []
    if "-m" in argv[:3]:
        at = argv.index("-m")
        return " ".join(argv[at + 1 : at + 3])
    if argv:
        return " ".join([Path(argv[0]).name, *argv[1:2]])
    try:
        return (pid_dir / "comm").read_text().strip()
    except OSError:
        return pid_dir.name


def session_cpu(session_id: int, proc: Path = PROC) -> dict[str, float]:
    """CPU seconds (user + system) so far of every live process in session `session_id`, by "pid name"."""
    out: dict[str, float] = {}
    for pid_dir in proc.iterdir():
        if not pid_dir.name.isdigit():
            continue
        fields = stat_fields(pid_dir)
        # after comm: state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime
        if fields is None or int(fields[3]) != session_id:
            continue
        out[f"{pid_dir.name} {process_name(pid_dir)}"] = (int(fields[11]) + int(fields[12])) / _TICKS
    return out


def cpu_used(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """CPU seconds each process used between two `session_cpu` readings (new processes count from zero),
    largest first; a process that exited in between is missing from `after` and not counted."""
    used = {name: after[name] - before.get(name, 0.0) for name in after}
    return dict(sorted(((n, round(s, 2)) for n, s in used.items() if s > 0), key=lambda kv: -kv[1]))


def client_cpu_s(external: bool) -> float:
    """CPU seconds of a benchmark's client so far: the client processes this one waited for (`vllm bench serve`),
    or this process."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN if external else resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def cpu_line(server: Mapping[str, float], client: float) -> str:
    """A workload's CPU seconds as one printed line: the server's by process (`cpu_used`; under 0.05 s left out),
    then the client's."""
    used = ", ".join(f"{name.split(' ', 1)[1]} {sec:.1f}" for name, sec in server.items() if sec >= 0.05)
    return f"{used or '-'}; client {client:.1f}"
