"""TTFT with and without the UCM store, for 512 / 1024 / 2048-token prompts, all in one run.

Scenarios per prompt length (each a fresh prompt, so nothing hits by accident):
  cold            engine without a connector: the whole prompt is computed
  cold+save       producer engine saving every layer to the store daemon (the layer-wise save overhead)
  device hit      the same prompt again on the producer engine: its own device prefix cache
  dram hit        a fresh consumer engine, daemon warm: loaded from the daemon's DRAM tier
  lmdb hit        the daemon restarted on the same LMDB directory (DRAM empty), a fresh consumer engine

TTFT = wall time of `generate(max_tokens=1)` (one prefill step + sampling). Median of --repeats runs.
    python benchmarks/ttft.py [--lengths 512 1024 2048] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Run as a script, this folder comes first on sys.path, where benchmarks/kernels.py would shadow the
# `ucm_kernels` package: put the repository root first instead.
_ROOT = str(Path(__file__).resolve().parents[1])
sys.path[:] = [_ROOT] + [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch

from engine import LLM, SamplingParams
from engine.loader import load_model
from launch.store_process import StoreProcess

log = logging.getLogger("ttft")
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def ttft(llm: LLM, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    llm.generate([prompt], ONE_TOKEN)
    return time.perf_counter() - t0


def make_prompts(lengths: list[int], repeats: int, seed: int) -> dict[int, list[list[int]]]:
    rng = random.Random(seed)
    return {n: [[rng.randrange(100, 40000) for _ in range(n)] for _ in range(repeats)] for n in lengths}


def measure_store_hits(
    label: str,
    address: str,
    engine_kw: dict[str, Any],
    warm: list[int],
    prompts: dict[int, list[list[int]]],
    times: dict[str, dict[int, list[float]]],
    load_wait: dict[str, dict[int, list[float]]],
) -> tuple[Any, Any]:
    """TTFT of a fresh consumer engine whose prompts all sit in the store; (connector stats, engine stats)."""
    consumer = LLM(kv_store=address, kv_role="kv_consumer", **engine_kw)
    try:
        ttft(consumer, warm)
        stats = consumer.engine.kv_connector[0].stats
        for n, per_length in prompts.items():
            for prompt in per_length:
                before = stats.load_wait_seconds
                times[label][n].append(ttft(consumer, prompt))
                load_wait[label][n].append(stats.load_wait_seconds - before)
            log.info("%5d tokens: %s %.3fs", n, label, statistics.median(times[label][n]))
        return stats, consumer.engine.stats()
    finally:
        consumer.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    # SIGTERM unwinds like Ctrl-C, so the `finally` blocks stop the store daemons.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("engine", "ucm", "connector"):
        logging.getLogger(noisy).setLevel(logging.ERROR)

    model = load_model(args.model, getattr(torch, args.dtype), args.device)
    engine_kw: dict[str, Any] = dict(
        loaded_model=model,
        dtype=args.dtype,
        device=args.device,
        kv_cache_memory=args.kv_cache_memory,
        max_num_batched_tokens=max(args.lengths),
        max_model_len=max(args.lengths) + 16,
    )
    prompts = make_prompts(args.lengths, args.repeats, seed=0)
    cold_prompts = make_prompts(args.lengths, args.repeats, seed=1)
    warm = [random.Random(2).randrange(100, 40000) for _ in range(64)]
    times: dict[str, dict[int, list[float]]] = {
        k: {n: [] for n in args.lengths} for k in ("cold", "cold+save", "device hit", "dram hit", "lmdb hit")
    }
    load_wait: dict[str, dict[int, list[float]]] = {k: {n: [] for n in args.lengths} for k in ("dram hit", "lmdb hit")}
    with tempfile.TemporaryDirectory(prefix="ttft-lmdb-") as tmp:
        daemon = StoreProcess(dram="2GiB", disk_path=Path(tmp), disk="4GiB")
        try:
            cold = LLM(**engine_kw)
            producer = LLM(kv_store=daemon.address, kv_role="kv_producer", **engine_kw)
            for llm in (cold, producer):
                ttft(llm, warm)
            producer_stats = producer.engine.kv_connector[0].stats
            save_path: dict[int, list[float]] = {n: [] for n in args.lengths}
            for n in args.lengths:
                for i in range(args.repeats):
                    # Interleave so machine noise hits both alike.
                    times["cold"][n].append(ttft(cold, cold_prompts[n][i]))
                    before = producer_stats.save_seconds
                    times["cold+save"][n].append(ttft(producer, prompts[n][i]))
                    save_path[n].append(producer_stats.save_seconds - before)
                    times["device hit"][n].append(ttft(producer, prompts[n][i]))
                log.info(
                    "%5d tokens: cold %.3fs  cold+save %.3fs  device hit %.3fs",
                    n,
                    statistics.median(times["cold"][n]),
                    statistics.median(times["cold+save"][n]),
                    statistics.median(times["device hit"][n]),
                )
            saved = producer.engine.kv_connector[0].stats.blocks_saved
            producer.close()
            del cold, producer
            dram_stats, _ = measure_store_hits("dram hit", daemon.address, engine_kw, warm, prompts, times, load_wait)
        finally:
            daemon.stop()
        daemon = StoreProcess(dram="2GiB", disk_path=Path(tmp), disk="4GiB")  # same LMDB directory, empty DRAM tier
        try:
            lmdb_stats, lmdb_engine = measure_store_hits(
                "lmdb hit", daemon.address, engine_kw, warm, prompts, times, load_wait
            )
        finally:
            daemon.stop()

    med = {k: {n: statistics.median(v) for n, v in per.items()} for k, per in times.items()}
    print(
        f"\nTTFT (median of {args.repeats}; {args.device}, {args.dtype}, {torch.get_num_threads()} torch threads); "
        "ratio = cold / scenario"
    )
    print(f"{'tokens':>7} " + " ".join(f"{k:>18}" for k in med))
    for n in args.lengths:
        cells = [
            f"{med[k][n] * 1000:9.1f}ms" + (f" {med['cold'][n] / med[k][n]:6.1f}x" if k != "cold" else " " * 8)
            for k in med
        ]
        print(f"{n:>7} " + " ".join(f"{c:>18}" for c in cells))
    slow = {n: med["cold+save"][n] / med["cold"][n] - 1 for n in args.lengths}
    print("save overhead (cold+save vs cold): " + ", ".join(f"{n}: {100 * s:+.1f}%" for n, s in slow.items()))
    share = {n: statistics.median(save_path[n]) / med["cold+save"][n] for n in args.lengths}
    print(
        "time inside the connector's save path (save_kv_layer + wait_for_save) / prefill: "
        + ", ".join(f"{n}: {100 * s:.1f}%" for n, s in share.items())
    )
    for k, per in load_wait.items():
        print(
            f"{k}: time the forward waited in wait_for_layer_load: "
            + ", ".join(f"{n}: {1000 * statistics.median(v):.0f}ms" for n, v in per.items())
        )
    print(
        f"blocks saved {saved}; dram: loaded {dram_stats.blocks_loaded} failed {dram_stats.blocks_load_failed}; "
        f"lmdb: loaded {lmdb_stats.blocks_loaded} failed {lmdb_stats.blocks_load_failed}, "
        f"external hit tokens {lmdb_engine.external_hit_tokens}"
    )
    top = max(args.lengths)
    targets = {
        "dram_hit_speedup": med["cold"][top] / med["dram hit"][top],
        "lmdb_hit_speedup": med["cold"][top] / med["lmdb hit"][top],
        "save_overhead": slow[top],
    }
    print(
        f"at {top} tokens: DRAM hit {targets['dram_hit_speedup']:.1f}x (target >= 30x), "
        f"LMDB hit {targets['lmdb_hit_speedup']:.1f}x (target >= 15x), save overhead {100 * slow[top]:+.1f}% "
        f"(target <= 5%)"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "device": args.device,
                    "dtype": args.dtype,
                    "repeats": args.repeats,
                    "ttft_s": times,
                    "median_s": med,
                    "save_overhead": slow,
                    "save_path_share": share,
                    "load_wait_s": load_wait,
                    "targets": targets,
                    "threads": torch.get_num_threads(),
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
