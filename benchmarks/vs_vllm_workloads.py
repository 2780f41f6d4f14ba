"""benchmarks/vs_vllm.py's workloads and the two clients that run them (vLLM's `vllm bench serve`, or
benchmarks.serve's generator), each result in one summary shape."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.serve import Req, client_session, one_request, run_workload, summarize

if TYPE_CHECKING:
    from benchmarks.bench_server import Server

TOKEN_LO, TOKEN_HI = 1000, 40000  # plain word pieces: no special tokens in synthetic prompts


# ---------------------------------------------------------------------------------------------- workloads


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(n)]


@dataclass(frozen=True)
class RandomShape:
    """The random workload: `prompts` prompts of `prompt_len` random tokens, `out_len` tokens each (EOS ignored),
    `concurrency` at a time."""

    prompts: int = 32
    prompt_len: int = 512
    out_len: int = 64
    concurrency: int = 8


@dataclass(frozen=True)
class Burst:
    """vLLM's prefix_repetition dataset: `prefixes` shared prefixes of `prefix_len` tokens, `per_prefix` requests on
    each with a `suffix_len`-token suffix of their own, `out_len` tokens each, every request at once."""

    prefixes: int = 4
    per_prefix: int = 8
    prefix_len: int = 1024
    suffix_len: int = 128
    out_len: int = 64

    @property
    def requests(self) -> int:
        return self.prefixes * self.per_prefix

    @property
    def tokens(self) -> int:
        """The prompt tokens a server with perfect prefix caching computes."""
        return self.prefixes * (self.prefix_len + self.per_prefix * self.suffix_len)


RANDOM, BURST, WARM = RandomShape(), Burst(), RandomShape(prompts=8, prompt_len=256, out_len=16, concurrency=4)
PROBE_TOKENS = 2048  # the cold / repeated TTFT probe's prompt


def random_reqs(
    seed: int, n: int = RANDOM.prompts, prompt_len: int = RANDOM.prompt_len, out_len: int = RANDOM.out_len
) -> list[Req]:
    rng = random.Random(seed)
    return [Req(_ids(rng, prompt_len), out_len) for _ in range(n)]


def prefix_rep_reqs(seed: int, n: int = BURST.requests, out_len: int = BURST.out_len) -> list[Req]:
    rng = random.Random(seed)
    heads = [_ids(rng, BURST.prefix_len) for _ in range(BURST.prefixes)]
    return [Req(heads[rng.randrange(BURST.prefixes)] + _ids(rng, BURST.suffix_len), out_len) for _ in range(n)]


def _random_args(shape: RandomShape) -> list[str]:
    return [
        "--dataset-name", "random", "--random-input-len", str(shape.prompt_len), "--random-output-len",
        str(shape.out_len), "--num-prompts", str(shape.prompts), "--max-concurrency", str(shape.concurrency),
    ]  # fmt: skip


def _prefix_args(burst: Burst) -> list[str]:
    return [
        "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(burst.prefix_len),
        "--prefix-repetition-suffix-len", str(burst.suffix_len), "--prefix-repetition-num-prefixes",
        str(burst.prefixes), "--prefix-repetition-output-len", str(burst.out_len), "--num-prompts",
        str(burst.requests),
    ]  # fmt: skip


VLLM_CLIENT_ARGS = {"random": _random_args(RANDOM), "prefix-rep": _prefix_args(BURST), "warm": _random_args(WARM)}
OWN_CLIENT = {  # the same shapes for our generator: (requests, concurrency)
    "random": (lambda seed: random_reqs(seed), RANDOM.concurrency),
    "prefix-rep": (lambda seed: prefix_rep_reqs(seed), BURST.requests),
    "warm": (lambda seed: random_reqs(seed, WARM.prompts, WARM.prompt_len, WARM.out_len), WARM.concurrency),
}


def run_vllm_client(
    args: argparse.Namespace, srv: Server, url: str, model_dir: Path, workload: str, seed: int, out_dir: Path
) -> dict:
    """`vllm bench serve` (vLLM's own client) against one of the compared servers."""
    venv = Path(args.vllm_venv)
    return vllm_bench_serve(venv, url, srv.served_name, model_dir, workload, seed, out_dir, srv.name, srv.env)


def vllm_bench_serve(
    venv: Path,
    url: str,
    served_name: str,
    model_dir: Path,
    workload: str,
    seed: int,
    out_dir: Path,
    tag: str,
    env: dict[str, str] | None = None,
) -> dict:
    """`vllm bench serve` from `venv` on one workload of VLLM_CLIENT_ARGS; its result JSON in our summary's shape
    (`error` with the log's tail when the client failed). `tag` names its files in `out_dir`."""
    result = out_dir / f"{tag}__{workload}_{seed}.json"
    argv = [
        str(venv / "bin" / "vllm"),
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        url,
        # --model is also what the client's /tokenize check sends as `model`: each server's own served name
        # (a model path there made ours answer 404 and the client skip that check for ucm-serve only).
        "--model",
        served_name,
        "--tokenizer",
        str(model_dir),
        "--served-model-name",
        served_name,
        "--ignore-eos",
        "--seed",
        str(seed),
        "--request-rate",
        "inf",
        "--disable-tqdm",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--save-result",
        "--result-dir",
        str(out_dir),
        "--result-filename",
        result.name,
        *VLLM_CLIENT_ARGS[workload],
    ]
    log = out_dir / f"{tag}__{workload}_{seed}.txt"
    full_env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k != "VIRTUAL_ENV"}
    proc = subprocess.run(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=full_env, check=False)
    if proc.returncode != 0 or not result.exists():
        return {"completed": 0, "failed": -1, "error": log.read_text()[-500:]}
    d = json.loads(result.read_text())
    num = d.get("num_prompts") or len(d.get("ttfts", [])) or d["completed"]
    return {
        "completed": d["completed"],
        "failed": num - d["completed"],
        "duration_s": d["duration"],
        "output_tok_per_s": d["output_throughput"],
        "ttft_mean_ms": d["mean_ttft_ms"],
        "ttft_p99_ms": d["p99_ttft_ms"],
        "tpot_mean_ms": d["mean_tpot_ms"],
    }


def run_own_client(srv: Server, url: str, workload: str, seed: int) -> dict:
    make, concurrency = OWN_CLIENT[workload]
    results, duration = asyncio.run(run_workload(url, make(seed), concurrency, float("inf"), seed, srv.served_name))
    s = summarize(results, duration)
    return {
        "completed": s["completed"],
        "failed": s["failed"],
        "duration_s": duration,
        "output_tok_per_s": s["output_tok_per_s"],
        "ttft_mean_ms": s["ttft_ms"]["mean"],
        "ttft_p99_ms": s["ttft_ms"]["p99"],
        "tpot_mean_ms": s["tpot_ms"]["mean"],
        "errors": s["errors"],
    }


async def ttft_probe(url: str, model: str, seed: int, tokens: int = PROBE_TOKENS, repeats: int = 3) -> list[float]:
    """The same prompt sent `repeats` times, one after another: [cold TTFT, repeated TTFTs...] in ms."""
    prompt = _ids(random.Random(seed), tokens)
    out = []
    async with client_session(url, 1, timeout_s=900) as client:
        for _ in range(repeats):
            res = await one_request(client, prompt, 8, model)
            out.append(res.ttft * 1000 if res.ok else float("nan"))
    return out
