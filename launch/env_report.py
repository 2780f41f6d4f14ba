"""`ucm-serve env`: what a bug report needs to reproduce a run ("slow", "different tokens"), as vLLM's collect-env.

What runs is decided by timing the host and cached outside the repository (the attention path per shape class, the
linear path per row class, dtype auto's matmul times, each per thread count), in front of AVX-512 / AMX / VDPBF16PS /
AVX2 / NEON / scalar bodies. This prints the host (CPU model and flags, cores, GPU), the versions that matter and
whether the venv is the lock, every choice in the calibration cache with the file it is in, and the environment
variables that override choices. `--pin FILE` writes the choices so that another run, here or on another host with
the same instruction sets, replays them exactly: `UCM_PIN=FILE` (ucm_kernels/cpu/calibration_store.py) takes a pinned
choice before any cache file or timing. `--json` prints the same as JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as metadata
import json
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from launch.lock_file import LOCKS, differences

VERSIONS = ("ucm-serve", "torch", "transformers", "triton", "numpy", "xgrammar", "kernels", "pyzmq", "lmdb", "msgspec")
# Every variable that changes which path runs, how many threads it gets or how its memory is kept.
OVERRIDES = (
    "UCM_CPU_ATTENTION", "UCM_ATTENTION_BACKEND", "UCM_CPU_LINEAR", "UCM_ADAPTIVE_THREADS", "UCM_RETAIN_FREED_MEMORY",
    "UCM_PIN", "UCM_CFLAGS", "UCM_CC", "UCM_CACHE_DIR", "OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT",
    "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
)  # fmt: skip


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def lock_state() -> dict[str, Any]:
    """The lock this checkout ships (lock/test.txt) and how far the running venv is from it."""
    lock = LOCKS / "test.txt"
    if not lock.exists():
        return {"lock": None}
    differ = differences(lock)
    return {"lock": str(lock), "sha256": hashlib.sha256(lock.read_bytes()).hexdigest()[:16],
            "differ": sorted(n for n, (_, have) in differ.items() if have is not None),
            "missing": sum(1 for _, have in differ.values() if have is None)}  # fmt: skip


def collect(before_choices: Callable[[], object] = lambda: None) -> dict[str, Any]:
    """The report; `before_choices` runs once everything else is read (torch imported, host, versions, lock), before the
    choices are."""
    import torch

    from ucm_kernels.cache_dir import cache_dir
    from ucm_kernels.cpu.calibration_store import stored_choices
    from ucm_kernels.cpu.host import cpu_info, torch_isa, vector_flags

    model, flags = cpu_info()
    gpus = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    )
    report = {
        "host": {
            "cpu": model, "vector_flags": vector_flags(), "flags": flags, "machine": platform.machine(),
            "cores": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "gpus": gpus, "torch_isa": torch_isa(), "torch_threads": torch.get_num_threads(),
            "python": sys.version.split()[0], "os": platform.platform(),
        },
        "versions": {d: _version(d) for d in VERSIONS},
        "lock": lock_state(),
        "cache_dir": str(cache_dir()),
        "overrides": {name: os.environ[name] for name in OVERRIDES if name in os.environ},
    }  # fmt: skip
    before_choices()
    report["choices"] = [
        {"kind": pin.kind, "threads": pin.threads, "name": pin.name, "entry": pin.entry, "file": str(path),
         "library": key.get("library"), "cpu": key.get("cpu")}
        for path, key, pin in stored_choices()
    ]  # fmt: skip
    return report


def render(report: dict[str, Any]) -> str:
    h, lock = report["host"], report["lock"]
    lines = [
        f"CPU        {h['cpu']} ({h['machine']}), {h['cores']} cores ({h['affinity']} usable)",
        f"ISA        {' '.join(h['vector_flags']) or 'no vector flags'}; torch's kernels: {h['torch_isa']}",
        f"GPU        {', '.join(h['gpus']) or 'none'}",
        f"threads    torch {h['torch_threads']}; python {h['python']}; {h['os']}",
        "versions   " + ", ".join(f"{d} {v}" for d, v in report["versions"].items() if v),
    ]
    if lock["lock"] is None:
        lines.append("lock       none beside this install")
    else:
        state = (
            "the venv is the lock"
            if not lock["differ"]
            else f"{len(lock['differ'])} differ: {', '.join(lock['differ'][:8])}"
        )
        lines.append(f"lock       {lock['lock']} ({lock['sha256']}): {state}")
    lines.append(f"overrides  {' '.join(f'{k}={v}' for k, v in report['overrides'].items()) or 'none'}")
    lines.append(f"choices    {len(report['choices'])} in {report['cache_dir']}/kernels:")
    for c in report["choices"]:
        entry = json.dumps(c["entry"], sort_keys=True)
        lines.append(f"  {c['kind']:<12} {c['threads']} thread(s)  {c['name']}: {entry[:160]}")
    return "\n".join(lines)


def pin_file(report: dict[str, Any]) -> dict[str, Any]:
    """What `--pin` writes: the host it came from, for the reader, and the choices `UCM_PIN` replays."""
    choices = [{k: c[k] for k in ("kind", "threads", "name", "entry")} for c in report["choices"]]
    return {"host": report["host"], "versions": report["versions"], "choices": choices}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ucm-serve env", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--pin", metavar="FILE", help="write the calibrated choices to FILE, for UCM_PIN=FILE elsewhere")
    ap.add_argument(
        "--choices-after-line",
        action="store_true",
        help="read the host now and the choices once a line arrives on stdin (`up` starts the report beside its "
        "nodes and sends the line once they have registered: none of its work falls on their first requests)",
    )
    args = ap.parse_args(argv)
    report = collect(sys.stdin.readline) if args.choices_after_line else collect()
    print(json.dumps(report, indent=2) if args.json else render(report))
    if args.pin:
        Path(args.pin).write_text(json.dumps(pin_file(report), indent=1))
        print(f"pinned {len(report['choices'])} choices in {args.pin}: run with UCM_PIN={args.pin} to replay them")
    if args.choices_after_line:  # `up`'s nodes serve by now: the interpreter's teardown (~0.3 s of a core) is theirs
        sys.stdout.flush()
        os._exit(0)
    return 0
