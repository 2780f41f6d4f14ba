"""Serving benchmark (like `vllm bench serve`): an async load generator against the OpenAI endpoint, in one run
for three deployments started here as child processes:

    disagg+store    1 prefill + 1 decode node + store daemon (prefill saves KV, decode loads it)
    disagg-nostore  1 prefill + 1 decode node, no store (decode recomputes the prompt)
    colocated       1 engine doing prefill and decode (its own device prefix cache only)

Workloads: random (distinct prompts), shared-prefix (a few long system prompts + short questions), multi-turn
chat (each turn resends the whole history), and a replay of the Mooncake conversation trace scaled to this
machine (token lengths / --trace-scale, its block hash ids reused as shared content, its timestamps as arrivals).
Reports request throughput, output tok/s and TTFT / TPOT / ITL / E2E mean, median and p99.

    .venv/bin/python -m benchmarks.serve --quick
    .venv/bin/python -m benchmarks.serve --workloads shared-prefix --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from launch.cluster import Cluster, ClusterSpec, StoreMode

MODEL = "smollm2-135m"
TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces" / "conversation_trace.jsonl"
TOKEN_LO, TOKEN_HI = 1000, 40000  # plain word-piece ids: no special tokens in synthetic prompts


@dataclass
class Req:
    prompt: list[int] | str
    max_tokens: int
    arrival_s: float = 0.0  # offset from the start (trace replay / Poisson)
    session: int = -1  # multi-turn: requests of one session run in order, each after the previous answer
    turn_text: str = ""  # multi-turn: the user's new message, appended to the history


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    text: str = ""
    error: str = ""


# ---------------------------------------------------------------------------------------------- workloads


def _rand_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(n)]


def random_workload(rng: random.Random, n: int, prompt_len: int, out_len: int) -> list[Req]:
    return [Req(_rand_ids(rng, prompt_len), out_len) for _ in range(n)]


def shared_prefix_workload(
    rng: random.Random, n: int, num_prefixes: int, prefix_len: int, question_len: int, out_len: int
) -> list[Req]:
    prefixes = [_rand_ids(rng, prefix_len) for _ in range(num_prefixes)]
    # Round-robin over the system prompts so consecutive requests do not share one (worst case for a device cache).
    return [Req(prefixes[i % num_prefixes] + _rand_ids(rng, question_len), out_len) for i in range(n)]


def multi_turn_workload(rng: random.Random, sessions: int, turns: int, out_len: int) -> list[Req]:
    topics = ["rivers", "volcanoes", "bread", "chess", "satellites", "bees", "glass", "trains"]
    reqs = []
    for s in range(sessions):
        for t in range(turns):
            text = f"Question {t + 1} about {topics[(s + t) % len(topics)]}: explain one surprising fact in detail."
            reqs.append(Req("", out_len, session=s, turn_text=text))
    return reqs


def trace_workload(
    rng: random.Random, n: int, scale: int, max_prompt: int, max_out: int, time_scale: float
) -> list[Req]:
    block = max(1, 512 // scale)  # Mooncake hash ids cover 512-token blocks
    blocks: dict[int, list[int]] = {}
    reqs = []
    with open(TRACE) as f:
        for line in f:
            if len(reqs) >= n:
                break
            row = json.loads(line)
            ids: list[int] = []
            for h in row["hash_ids"]:
                if h not in blocks:
                    blocks[h] = _rand_ids(rng, block)
                ids += blocks[h]
            length = max(block, min(max_prompt, row["input_length"] // scale))
            out = max(2, min(max_out, row["output_length"] // scale))
            reqs.append(Req(ids[:length], out, arrival_s=row["timestamp"] / 1000.0 * time_scale))
    return reqs


# ---------------------------------------------------------------------------------------------- the client


async def one_request(
    client: aiohttp.ClientSession, prompt: list[int] | str, max_tokens: int, model: str = MODEL
) -> Result:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    last = None
    res = Result(ok=False)
    parts = []
    try:
        async with client.post("/v1/completions", json=body) as r:
            if r.status != 200:
                return Result(ok=False, error=f"HTTP {r.status}: {(await r.read())[:200]!r}")
            async for raw in r.content:  # one line of the event stream at a time
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    return Result(ok=False, error=str(obj["error"]))
                now = time.perf_counter()
                if obj.get("choices") and obj["choices"][0]["text"]:
                    parts.append(obj["choices"][0]["text"])
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                if obj.get("usage"):
                    res.output_tokens = obj["usage"]["completion_tokens"]
    except (TimeoutError, aiohttp.ClientError) as e:
        return Result(ok=False, error=repr(e))
    res.e2e = time.perf_counter() - t0
    res.text = "".join(parts)
    res.ok = last is not None
    return res


def client_session(url: str, connections: int = 100, timeout_s: float = 600) -> aiohttp.ClientSession:
    """The load generator's HTTP client: aiohttp, as `vllm bench serve` uses. It shares the host's cores with the
    server under test, and httpx took ~2.5x its CPU per streamed token (0.41-0.55 s against 0.17-0.24 for 32 x 64
    tokens on a 2-core Zen 5 EPYC), time the served side then lost."""
    return aiohttp.ClientSession(
        base_url=url, timeout=aiohttp.ClientTimeout(total=timeout_s), connector=aiohttp.TCPConnector(limit=connections)
    )


async def run_workload(
    url: str, reqs: list[Req], concurrency: int, rate: float, seed: int, model: str = MODEL
) -> tuple[list[Result], float]:
    sem = asyncio.Semaphore(concurrency)
    rng = random.Random(seed)
    results: list[Result] = []
    async with client_session(url, concurrency + 4) as client:

        async def fire(req: Req) -> None:
            async with sem:
                results.append(await one_request(client, req.prompt, req.max_tokens, model))

        async def session(turns: list[Req]) -> None:
            history = ""
            for req in turns:
                history += f"User: {req.turn_text}\nAssistant:"
                async with sem:
                    res = await one_request(client, history, req.max_tokens, model)
                results.append(res)
                history += res.text + "\n"

        start = time.perf_counter()
        tasks = []
        if reqs and reqs[0].session >= 0:
            by_session: dict[int, list[Req]] = {}
            for r in reqs:
                by_session.setdefault(r.session, []).append(r)
            tasks = [asyncio.create_task(session(turns)) for turns in by_session.values()]
        else:
            t = 0.0
            for req in reqs:
                if req.arrival_s:
                    t = req.arrival_s
                elif rate != float("inf"):
                    t += rng.expovariate(rate)
                delay = start + t - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(fire(req)))
        await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


# ---------------------------------------------------------------------------------------------- reporting


def _stats(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
    s = sorted(xs)
    return {
        "mean": statistics.fmean(s) * 1000,
        "median": statistics.median(s) * 1000,
        "p99": s[min(len(s) - 1, round(0.99 * (len(s) - 1)))] * 1000,
    }


def summarize(results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "req_per_s": len(ok) / duration if duration else 0.0,
        "output_tok_per_s": sum(r.output_tokens for r in ok) / duration if duration else 0.0,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats(tpot),
        "itl_ms": _stats([x for r in ok for x in r.itl]),
        "e2e_ms": _stats([r.e2e for r in ok]),
        "errors": sorted({r.error for r in results if not r.ok})[:3],
    }


def print_table(rows: list[dict]) -> None:
    head = f"{'deployment':<16}{'workload':<15}{'ok':>5}{'req/s':>8}{'tok/s':>8}"
    for m in ("ttft", "tpot", "itl", "e2e"):
        head += f"{m.upper() + ' mean/med/p99 (ms)':>28}"
    print(head)
    print("-" * len(head))
    for row in rows:
        s = row["summary"]
        line = f"{row['deployment']:<16}{row['workload']:<15}{s['completed']:>5}{s['req_per_s']:>8.2f}{s['output_tok_per_s']:>8.1f}"
        for m in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            v = s[m]
            line += f"{v['mean']:>10.0f}{v['median']:>9.0f}{v['p99']:>9.0f}"
        print(line)


DEPLOYMENTS = {
    "disagg+store": dict(prefill=1, decode=1, store=StoreMode.DAEMON),
    "disagg-nostore": dict(prefill=1, decode=1, store=StoreMode.NONE),
    "colocated": dict(prefill=0, decode=0, colocated=1, store=StoreMode.NONE),
}


def build_workloads(args: argparse.Namespace) -> dict[str, list[Req]]:
    """--quick is sized for a shared 2-core CPU box (a 256-token prefill takes seconds there)."""
    rng = random.Random(args.seed)
    q = args.quick
    n = args.num_prompts or (6 if q else 24)
    prefix_len = args.prefix_len or 1024
    all_ = {
        "random": lambda: random_workload(rng, n, 128 if q else 512, 4 if q else 32),
        # 4+ requests per system prompt, so most requests are repeats (the first of each is a cold miss)
        "shared-prefix": lambda: shared_prefix_workload(
            rng, max(n, 4 * args.num_prefixes), args.num_prefixes, prefix_len, 16, 4 if q else 16
        ),
        "multi-turn": lambda: multi_turn_workload(rng, 2, 3 if q else 4, 6 if q else 32),
        "trace": lambda: trace_workload(
            rng, n, args.trace_scale, 512 if q else 1024, 4 if q else 32, args.trace_time_scale
        ),
    }
    return {name: all_[name]() for name in args.workloads}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small workloads (a few minutes on 2 CPU cores)")
    ap.add_argument(
        "--workloads",
        nargs="+",
        default=["random", "shared-prefix", "multi-turn", "trace"],
        choices=["random", "shared-prefix", "multi-turn", "trace"],
    )
    ap.add_argument("--deployments", nargs="+", default=list(DEPLOYMENTS), choices=list(DEPLOYMENTS))
    ap.add_argument("--num-prompts", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=2, help="max requests in flight")
    ap.add_argument(
        "--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second (inf: fixed concurrency)"
    )
    ap.add_argument("--num-prefixes", type=int, default=3, help="shared-prefix: distinct system prompts")
    ap.add_argument("--prefix-len", type=int, default=0, help="shared-prefix: system prompt tokens (0: 1024)")
    ap.add_argument("--trace-scale", type=int, default=16, help="divide the trace's token lengths by this")
    ap.add_argument("--trace-time-scale", type=float, default=0.05, help="multiply the trace's timestamps by this")
    ap.add_argument(
        "--kv-cache-memory",
        default="128MiB",
        help="each node's device KV cache (small on purpose: the prefixes must not all fit on the device)",
    )
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per node (0: torch's default)")
    ap.add_argument(
        "--prewarm",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="shared-prefix: send each system prompt once, untimed, before measuring",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write all results here")
    args = ap.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so each cluster's `with` block stops its children and removes its temp dirs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    workloads = build_workloads(args)
    rows = []
    for dep in args.deployments:
        spec = ClusterSpec(
            kv_cache_memory=args.kv_cache_memory,
            dtype=args.dtype,
            max_num_seqs=32,
            dram="4GiB",
            disk="8GiB",
            node_args=("--threads", str(args.threads)) if args.threads else (),
            **DEPLOYMENTS[dep],
        )
        print(f"== {dep}: starting", flush=True)
        with Cluster(spec, sink=open("/dev/null", "w"), log=lambda s: None) as cluster:
            # Warm-up: first-step costs (allocation, kernel selection) are not what we measure.
            asyncio.run(run_workload(cluster.url, random_workload(random.Random(1), 2, 64, 4), 2, float("inf"), 0))
            for name, reqs in workloads.items():
                if name == "shared-prefix" and args.prewarm:
                    # One untimed request per system prompt (every deployment alike): the steady state of a
                    # service whose system prompts were seen before — by any node, or before a restart.
                    seen = {tuple(r.prompt[: args.prefix_len or 1024]): r for r in reqs}
                    warm = [Req(r.prompt, 1) for r in seen.values()]
                    asyncio.run(run_workload(cluster.url, warm, 1, float("inf"), 0))
                results, duration = asyncio.run(
                    run_workload(cluster.url, reqs, args.concurrency, args.request_rate, args.seed)
                )
                summary = summarize(results, duration)
                rows.append({"deployment": dep, "workload": name, "summary": summary})
                print(
                    f"   {name}: {summary['completed']} ok, {summary['failed']} failed, "
                    f"TTFT mean {summary['ttft_ms']['mean']:.0f} ms, {summary['duration_s']:.1f}s",
                    flush=True,
                )
    print()
    print_table(rows)
    by = {(r["deployment"], r["workload"]): r["summary"] for r in rows}
    if ("disagg+store", "shared-prefix") in by and ("disagg-nostore", "shared-prefix") in by:
        a, b = by[("disagg+store", "shared-prefix")], by[("disagg-nostore", "shared-prefix")]
        ratio = b["ttft_ms"]["mean"] / a["ttft_ms"]["mean"] if a["ttft_ms"]["mean"] else float("nan")
        print(
            f"\nshared-prefix mean TTFT: store {a['ttft_ms']['mean']:.0f} ms vs no store {b['ttft_ms']['mean']:.0f} ms "
            f"= {ratio:.1f}x lower with the store (target >= 5x)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": dict(vars(args).items()), "rows": rows}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
