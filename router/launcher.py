"""`ucm-serve up`: store daemon + N prefill + M decode nodes + router on this machine, until Ctrl-C / SIGTERM."""

from __future__ import annotations

import argparse
import signal
import threading

from router.cluster import Cluster, ClusterSpec, StoreMode


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ucm-serve up", description=__doc__)
    p.add_argument("--prefill", type=int, default=1, help="prefill nodes")
    p.add_argument("--decode", type=int, default=1, help="decode nodes")
    p.add_argument("--port", type=int, default=8000, help="HTTP port of the router")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--api-key", default=None)
    p.add_argument("--no-store", action="store_true", help="run without the KV store (decode nodes recompute)")
    p.add_argument("--dram", default="4GiB", help="store DRAM tier capacity")
    p.add_argument("--disk", default="20GiB", help="store disk tier capacity")
    p.add_argument("--disk-path", default=None, help="store LMDB folder (default: a temporary folder)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto = bf16 on CPUs with native bf16 (and on CUDA), else fp32")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--kv-cache-memory", default="512MiB", help="each node's paged KV cache")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the cluster to be healthy")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    spec = ClusterSpec(
        model=args.model, prefill=args.prefill, decode=args.decode, port=args.port, api_key=args.api_key,
        store=StoreMode.NONE if args.no_store else StoreMode.DAEMON, dram=args.dram, disk=args.disk,
        disk_path=args.disk_path, dtype=args.dtype, device=args.device, kv_cache_memory=args.kv_cache_memory,
    )
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    cluster = Cluster(spec)
    try:
        cluster.start(args.timeout)
        auth = f" -H 'Authorization: Bearer {args.api_key}'" if args.api_key else ""
        print(f"\nucm-serve is up: {cluster.url}  (OpenAI API at {cluster.url}/v1, metrics at {cluster.url}/metrics)")
        print(f"try:\n  curl {cluster.url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
              f"    -d '{{\"model\": \"{args.model}\", \"messages\": [{{\"role\": \"user\", \"content\": "
              f"\"What is a KV cache?\"}}], \"max_tokens\": 64}}'\nCtrl-C stops everything.\n", flush=True)
        while not done.wait(0.5):
            router = cluster.children.get("router")
            if router is None or not router.alive:
                print("[up] the router exited; shutting down", flush=True)
                return 1
        print("[up] shutting down", flush=True)
        return 0
    except RuntimeError as e:
        print(f"[up] failed: {e}", flush=True)
        return 1
    finally:
        cluster.stop()
