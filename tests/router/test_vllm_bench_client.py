"""`vllm bench serve` (vLLM 0.32's own load generator, from the vLLM venv `make vllm-plugin` installs) against
`ucm-serve serve` (or `up` where `serve` is not there yet): with only the base URL and model, and with `--model`
omitted (vLLM then reads the model card's `root` and loads its tokenizer from it). All requests must complete.

vLLM's client loads a tokenizer locally; with `--model <served name>` it would look the name up on the model hub
(offline here), so that run passes `--tokenizer <model folder>`; without `--model` no tokenizer flag is needed:
`root` is the folder. vLLM also checks its prompts against /tokenize (it aligns them when the counts differ).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.vllm_harness import DEFAULT_VENV
from engine.model_source import resolve_model_dir
from launch.child import Child
from launch.cli import SUBCOMMANDS
from launch.ports import free_port

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
PROMPTS = 4


@pytest.fixture(scope="module")
def vllm() -> Path:
    exe = DEFAULT_VENV / "bin" / "vllm"
    if not exe.exists():
        pytest.skip(f"no vLLM venv at {DEFAULT_VENV} (`make vllm-plugin` installs it)")
    return exe


@pytest.fixture(scope="module")
def server():
    port = free_port()
    command = ["serve", MODEL] if "serve" in SUBCOMMANDS else ["up"]
    argv = [sys.executable, "-m", "launch.cli", *command, "--port", str(port), "--kv-cache-memory", "64MiB"]
    child = Child("ucm-serve", argv, sink=open(os.devnull, "w"))
    try:
        url = child.wait_for(r"ucm-serve is up: (http://\S+)", 300).group(1)
        yield url
    finally:
        child.stop()


def bench(vllm: Path, url: str, tmp_path: Path, *model_args: str) -> dict:
    result = tmp_path / "result.json"
    argv = [
        str(vllm),
        "bench",
        "serve",
        "--backend",
        "openai-chat",
        "--endpoint",
        "/v1/chat/completions",
        "--base-url",
        url,
        *model_args,
        "--dataset-name",
        "random",
        "--num-prompts",
        str(PROMPTS),
        "--random-input-len",
        "32",
        "--random-output-len",
        "8",
        "--save-result",
        "--result-dir",
        str(tmp_path),
        "--result-filename",
        result.name,
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and result.exists(), (proc.stdout + proc.stderr)[-4000:]
    return json.loads(result.read_text())


def test_with_model_and_tokenizer(vllm, server, tmp_path) -> None:
    out = bench(vllm, server, tmp_path, "--model", MODEL, "--tokenizer", str(resolve_model_dir(MODEL)))
    assert out["completed"] == PROMPTS and out["total_output_tokens"] > 0


def test_without_model(vllm, server, tmp_path) -> None:
    out = bench(vllm, server, tmp_path)
    assert out["completed"] == PROMPTS and out["total_output_tokens"] > 0
