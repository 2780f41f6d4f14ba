"""TTFT of one 2048-token prompt on vLLM-CPU: cold, device prefix hit, and loaded through a KV connector after a
vLLM restart — our UCMConnector (connector/vllm_plugin.py, over a `ucm-serve store` daemon) beside vLLM's own
ExampleConnector (safetensors files per layer), and vLLM with no connector (the baseline of the save overhead),
same prompts, same run; the processes are driven by benchmarks/vllm_harness.py.

    bash benchmarks/peers/install_ucm_vllm_plugin.sh          # vLLM-CPU + our package in its venv (make test does)
    .venv/bin/python -m benchmarks.vllm_plugin_ttft --json bench_out/vllm_plugin_ttft.json

Each connector: start vLLM, time distinct cold prompts (the connector saves them), send the prompt twice (cold,
then a device prefix-cache hit), restart vLLM, send it again (the connector must load it). Five vLLM starts in all
(1-3 min each on a 2-core box).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.vllm_harness import (
    StoreDaemon,
    VllmServer,
    complete,
    example_transfer_config,
    external_tokens,
    synthetic_prompt,
    ucm_transfer_config,
)
from engine.model_source import resolve_model_dir

# --------------------------------------------------------------------------------------------------- benchmark


@dataclass
class Row:
    connector: str
    cold_ttft_ms: float  # median over the cold prompts (the saving run, for a connector)
    cold_samples_ms: list[float]
    device_hit_ttft_ms: float
    loaded_ttft_ms: float | None  # None for the no-connector baseline: nothing to load after a restart
    loaded_external_tokens: float
    outputs_equal: bool
    startup_s: float


def measure(
    name: str,
    transfer_config: dict | None,
    model_dir: Path,
    prompt: list[int],
    out_dir: Path,
    dtype: str,
    eager: bool,
    cold_prompts: list[list[int]],
) -> Row:
    """`prompt` is the one reloaded after the restart; `cold_prompts` (distinct, same length, the same for every
    connector) time the cold path, where a connector saves while vLLM computes: their median against the
    no-connector run is the save overhead."""
    with VllmServer(model_dir, transfer_config, out_dir / f"vllm_{name}_1.log", dtype=dtype, eager=eager) as first:
        complete(first.url, synthetic_prompt(64, seed=99), 4)  # warm-up on another prompt
        samples = [complete(first.url, p).ttft_s * 1e3 for p in cold_prompts]
        cold = complete(first.url, prompt)
        hit = complete(first.url, prompt)
        startup = first.startup_s
    samples.append(cold.ttft_s * 1e3)
    loaded_ms, ext, same = None, 0.0, cold.text == hit.text
    if transfer_config is not None:
        with VllmServer(model_dir, transfer_config, out_dir / f"vllm_{name}_2.log", dtype=dtype, eager=eager) as second:
            complete(second.url, synthetic_prompt(64, seed=98), 4)
            before = external_tokens(second.url)
            loaded = complete(second.url, prompt)
            ext = external_tokens(second.url) - before
        loaded_ms, same = loaded.ttft_s * 1e3, same and loaded.text == cold.text
    return Row(name, statistics.median(samples), samples, hit.ttft_s * 1e3, loaded_ms, ext, same, startup)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--connectors",
        nargs="+",
        default=["none", "ucm", "example"],
        choices=["none", "ucm", "example"],
        help="none = vLLM without a connector: the baseline of the save overhead",
    )
    ap.add_argument("--cold-prompts", type=int, default=3, help="extra distinct cold prompts per server (median)")
    ap.add_argument("--compile", action="store_true", help="let vLLM compile with Inductor (slow start-up)")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    model_dir = resolve_model_dir("smollm2-135m")
    out_dir = Path(tempfile.mkdtemp(prefix="vllm_plugin_ttft_"))
    rows: list[Row] = []
    prompt = synthetic_prompt(args.prompt_tokens, seed=7)  # the same prompt for every connector
    cold_prompts = [synthetic_prompt(args.prompt_tokens, seed=100 + i) for i in range(args.cold_prompts)]
    for name in args.connectors:
        if name == "none":
            rows.append(measure(name, None, model_dir, prompt, out_dir, args.dtype, not args.compile, cold_prompts))
        elif name == "ucm":
            store = StoreDaemon()
            try:
                rows.append(
                    measure(
                        name,
                        ucm_transfer_config(store.address),
                        model_dir,
                        prompt,
                        out_dir,
                        args.dtype,
                        not args.compile,
                        cold_prompts,
                    )
                )
            finally:
                store.stop()
        else:
            folder = out_dir / "example_kv"
            folder.mkdir()
            rows.append(
                measure(
                    name,
                    example_transfer_config(folder),
                    model_dir,
                    prompt,
                    out_dir,
                    args.dtype,
                    not args.compile,
                    cold_prompts,
                )
            )
    mode = "Inductor" if args.compile else "eager"
    print(
        f"vLLM-CPU ({mode}), SmolLM2-135M {args.dtype}, {args.prompt_tokens}-token prompt, TTFT in ms "
        f"({platform.processor() or platform.machine()}, {os.cpu_count()} cores; logs in {out_dir})"
    )
    base = next((r.cold_ttft_ms for r in rows if r.connector == "none"), None)
    print(
        f"{'connector':<10}{'cold':>10}{'save ovh':>10}{'device hit':>12}{'loaded':>10}{'ext tokens':>12}"
        f"{'same text':>11}"
    )
    for r in rows:
        overhead = f"{(r.cold_ttft_ms / base - 1) * 100:+.1f}%" if base and r.connector != "none" else "-"
        loaded = f"{r.loaded_ttft_ms:.0f}" if r.loaded_ttft_ms is not None else "-"
        print(
            f"{r.connector:<10}{r.cold_ttft_ms:>10.0f}{overhead:>10}{r.device_hit_ttft_ms:>12.0f}{loaded:>10}"
            f"{r.loaded_external_tokens:>12.0f}{r.outputs_equal!s:>11}"
        )
    by_name = {r.connector: r for r in rows}
    if "ucm" in by_name and "example" in by_name:
        ucm, example = by_name["ucm"].loaded_ttft_ms, by_name["example"].loaded_ttft_ms
        assert ucm is not None and example is not None, "both connectors reload after the restart"
        print(f"restart TTFT ucm / ExampleConnector: {ucm / example:.2f}x (target <= 0.5x)")
    if base and "ucm" in by_name:
        print(
            f"save overhead on a cold prompt (median of {len(cold_prompts) + 1}): "
            f"{(by_name['ucm'].cold_ttft_ms / base - 1) * 100:+.1f}% (target <= 5%)"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps(
                {
                    "prompt_tokens": args.prompt_tokens,
                    "dtype": args.dtype,
                    "mode": mode,
                    "rows": [asdict(r) for r in rows],
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
