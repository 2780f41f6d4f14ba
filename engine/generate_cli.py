"""`ucm-serve generate "prompt"`: one offline generation on one engine, text streamed to stdout."""

from __future__ import annotations

import argparse
import logging
import sys

from protocol import defaults


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ucm-serve generate", description="Generate text offline, streaming to stdout.")
    p.add_argument("prompt", help="the prompt (a chat message with --chat)")
    p.add_argument("--model", default=defaults.MODEL, help=f"{defaults.MODEL}, a Hugging Face folder or a .gguf file")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--kv-cache-memory", default="512MiB", help="KV cache budget, bytes or e.g. 2GiB")
    p.add_argument("--verbose", action="store_true", help="log engine details to stderr")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr)
    from engine.config import CacheConfig, EngineConfig, canonical_dtype
    from engine.engine_core import EngineCore
    from engine.sampling_params import SamplingParams

    try:
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            max_tokens=args.max_tokens,
        )
        config = EngineConfig(
            model=args.model,
            dtype=canonical_dtype(args.dtype),
            device=args.device,
            cache=CacheConfig(kv_cache_memory=args.kv_cache_memory),
        )
        core = EngineCore(config)
        tok = core.tokenizer
        ids = (
            tok.apply_chat_template([{"role": "user", "content": args.prompt}])
            if args.chat
            else tok.encode(args.prompt)
        )
        core.add_request("cli", ids, params)
    except (ValueError, FileNotFoundError) as e:
        print(f"ucm-serve generate: {e}", file=sys.stderr)
        return 2
    reason = None
    while core.has_unfinished_requests():
        for out in core.step():
            for c in out.outputs:
                sys.stdout.write(c.text)
                reason = c.finish_reason or reason
            sys.stdout.flush()
    sys.stdout.write("\n")
    if args.verbose:
        print(f"[finish_reason={reason}] {core.stats()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
