"""Offline throughput: the same random workload through this engine and through HF transformers `generate`
(batched, left-padded, same dtype, same torch threads, greedy), plus single-request decode speed.

    python -m benchmarks.throughput                       # 32 and 128 requests, in 32-512, out 32-256
    python -m benchmarks.throughput --threads 1 --num-requests 32 --max-input 256 --max-output 64 --json out.json

HF keeps its default attention (sdpa): on CPU bf16 it beat eager (15.6 vs 21.0 CPU s, 32 requests, in <= 256,
out 64, 1 thread), so the baseline is HF at its best.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import LLM, SamplingParams
from engine.config import canonical_dtype, resolve_dtype_name


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class Result:
    system: str
    num_requests: int
    seconds: float
    input_tokens: int
    output_tokens: int
    # CPU time of this process: on a shared, oversubscribed machine it tracks the work done far better than
    # wall time (other jobs steal the cores); compare both.
    cpu_seconds: float = 0.0

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tok_s(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.seconds

    @property
    def output_tok_cpu_s(self) -> float:
        return self.output_tokens / self.cpu_seconds

    def summary(self) -> dict:
        return {
            **asdict(self),
            "output_tok_s": self.output_tok_s,
            "total_tok_s": self.total_tok_s,
            "output_tok_per_cpu_s": self.output_tok_cpu_s,
        }


def make_workload(n: int, args: argparse.Namespace, vocab: int, seed: int) -> Workload:
    rng = random.Random(seed)
    # Ordinary token ids (skip the first 1000: special and byte tokens).
    prompts = [
        [rng.randrange(1000, vocab) for _ in range(rng.randint(args.min_input, args.max_input))] for _ in range(n)
    ]
    return Workload(prompts, [rng.randint(args.min_output, args.max_output) for _ in range(n)])


def run_engine(llm: LLM, wl: Workload) -> Result:
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in wl.output_lens]
    start, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(wl.prompts, params, use_tqdm=True)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    got = sum(len(o.outputs[0].token_ids) for o in outs)
    assert got == wl.output_tokens, f"engine produced {got} tokens, expected {wl.output_tokens}"
    return Result("engine", len(wl.prompts), seconds, wl.input_tokens, wl.output_tokens, cpu)


def run_hf(hf, wl: Workload, batch_size: int, pad_id: int) -> Result:
    start, cpu = time.perf_counter(), time.process_time()
    order = list(range(len(wl.prompts)))
    for b in range(0, len(order), batch_size):
        idx = order[b : b + batch_size]
        width = max(len(wl.prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            p = wl.prompts[i]
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        new = max(wl.output_lens[i] for i in idx)  # a padded batch runs until its longest request is done
        with torch.no_grad():
            hf.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=pad_id,
            )
        print(f"  hf batch {b // batch_size + 1}: {len(idx)} requests, {time.perf_counter() - start:.1f} s", flush=True)
    return Result(
        "hf", len(wl.prompts), time.perf_counter() - start, wl.input_tokens, wl.output_tokens, time.process_time() - cpu
    )


def single_decode(llm: LLM, hf, prompt: list[int], tokens: int) -> dict[str, float]:
    """Decode tok/s of one request: (t(N tokens) - t(1 token)) / (N - 1), so the prefill cancels out.
    With one torch thread t is CPU time (robust on a shared machine), else wall time."""
    clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter

    def engine_time(n: int) -> float:
        llm.engine.kv_manager.pool.reset_prefix_cache()
        start = clock()
        llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return clock() - start

    def hf_time(n: int) -> float:
        start = clock()
        with torch.no_grad():
            hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        return clock() - start

    out = {
        "engine_decode_tok_s": (tokens - 1) / (engine_time(tokens) - engine_time(1)),
        "clock": "cpu" if clock is time.process_time else "wall",
    }
    if hf is not None:
        out["hf_decode_tok_s"] = (tokens - 1) / (hf_time(tokens) - hf_time(1))
        out["decode_ratio"] = out["engine_decode_tok_s"] / out["hf_decode_tok_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-requests", type=int, nargs="+", default=[32, 128])
    p.add_argument("--min-input", type=int, default=32)
    p.add_argument("--max-input", type=int, default=512)
    p.add_argument("--min-output", type=int, default=32)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory", default="2GiB")
    p.add_argument("--hf-batch-size", type=int, default=0, help="0: all requests in one padded batch")
    p.add_argument("--decode-tokens", type=int, default=128, help="tokens for the single-request decode test")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    dtype = canonical_dtype(args.dtype)
    llm = LLM(
        model=args.model,
        dtype=dtype,
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    dtype_name = resolve_dtype_name(dtype, "cpu")
    hf = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(llm.engine.loaded.path), dtype=getattr(torch, dtype_name)).eval()
    vocab = llm.engine.model_config.vocab_size
    report: dict = {"dtype": dtype_name, "threads": torch.get_num_threads(), "runs": []}
    if hf is not None:
        report["hf_attn_implementation"] = hf.config._attn_implementation
    print(f"dtype {dtype_name}, {torch.get_num_threads()} threads (engine and HF alike, one process)")
    llm.generate([1000 + i for i in range(16)], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    for n in args.num_requests:
        wl = make_workload(n, args, vocab, args.seed)
        llm.engine.kv_manager.pool.reset_prefix_cache()
        before = llm.engine.stats()
        eng = run_engine(llm, wl)
        preempted = llm.engine.stats().preemptions - before.preemptions
        run = {
            "num_requests": n,
            "input_tokens": wl.input_tokens,
            "output_tokens": wl.output_tokens,
            "engine": {**eng.summary(), "preemptions": preempted},
        }
        line = (
            f"[{n:4d} req] engine {eng.seconds:7.1f} s (cpu {eng.cpu_seconds:7.1f} s)  out {eng.output_tok_s:8.1f} "
            f"tok/s  total {eng.total_tok_s:8.1f} tok/s"
        )
        if hf is not None:
            ref = run_hf(hf, wl, args.hf_batch_size or n, pad_id=0)
            run["hf"] = ref.summary()
            run["ratio"] = eng.output_tok_s / ref.output_tok_s
            run["ratio_cpu_time"] = eng.output_tok_cpu_s / ref.output_tok_cpu_s
            line += (
                f" | hf {ref.seconds:7.1f} s (cpu {ref.cpu_seconds:7.1f} s)  out {ref.output_tok_s:8.1f} tok/s  "
                f"total {ref.total_tok_s:8.1f} tok/s | ratio {run['ratio']:.2f}x (cpu-time {run['ratio_cpu_time']:.2f}x)"
            )
        print(line, flush=True)
        report["runs"].append(run)
    if args.decode_tokens > 1:
        prompt = make_workload(1, args, vocab, args.seed + 1).prompts[0][:32]
        report["single_request"] = single_decode(llm, hf, prompt, args.decode_tokens)
        print(
            "single request decode:",
            {k: round(v, 2) if isinstance(v, float) else v for k, v in report["single_request"].items()},
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
